"""What a kernel family provides, and what it hands to the compiler for one (spec, target).

A family is one module under ptxc/kernels/ exposing `FAMILY = Family(...)`. `build(spec, target)`
returns a `Program`: the IR of every entry plus the launch list that the metadata records (the
exact parameter ABI with where each parameter comes from, grid/block expressions, shared memory).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..ir import EntryIR, PtxType
from ..spec.fields import FamilyFields
from ..spec.model import KernelSpec
from ..targets import Target

# Element types of tensors, as written in metadata.
TENSOR_DTYPES = ("f32", "f16", "bf16", "i32", "i64", "u64", "e4m3", "e5m2", "u8")   # FP8: raw bytes; u8: mask bits


@dataclass(frozen=True)
class TensorInfo:
    """A tensor in the runtime interface: logical shape over named dims and spec constants."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]
    role: str                      # "input" | "output" | "inout" | "workspace"
    doc: str = ""
    device_resident_scalars: bool = False   # per-step scalars (seq_lens, positions) read on device
    passed_as: str | None = None      # the kernel reaches this tensor through that pointer array
    derived_from: str | None = None   # built by the runtime: per-batch device pointers into it
    prefix_sums: str | None = None    # values are prefix sums 0 .. <this dim> (cu_seqlens_q)
    # read and written one element at a time (merge_states' lse): natural alignment and any
    # element strides, even where its rows are whole 16-byte vectors
    element_access: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = {"dtype": self.dtype, "shape": list(self.shape), "role": self.role}
        if self.device_resident_scalars:
            d["device_resident"] = True
        if self.passed_as:
            d["passed_as"] = self.passed_as
        if self.derived_from:
            d["derived_from"] = self.derived_from
        if self.prefix_sums:
            d["prefix_sums"] = self.prefix_sums
        if self.element_access:
            d["element_access"] = True
        if self.doc:
            d["doc"] = self.doc
        return d


@dataclass(frozen=True)
class ParamSource:
    """Where the runtime gets a kernel parameter's value.

    kind: "pointer" (device address of `tensor`), "stride" (element stride of `tensor` along
    `axis`), "dim" (the runtime dimension `name`), "scalar" (the runtime scalar argument `name`,
    e.g. an FP8 cache's k_scale), "const" (`value`, fixed at build time), or "tensor_map" (a
    CUtensorMap of `tensor` encoded at launch: dims = the tensor's shape innermost first, its
    byte strides, box `box` innermost first, `swizzle` bytes; docs/metadata.md).
    """

    kind: str
    tensor: str | None = None
    axis: int | None = None
    name: str | None = None
    value: int | float | None = None
    box: tuple[int, ...] | None = None
    swizzle: int | None = None

    def to_dict(self) -> dict[str, Any]:
        box = list(self.box) if self.box is not None else None
        return {k: v for k, v in (("kind", self.kind), ("tensor", self.tensor), ("axis", self.axis),
                                  ("name", self.name), ("value", self.value), ("box", box),
                                  ("swizzle", self.swizzle)) if v is not None}


@dataclass(frozen=True)
class LaunchParam:
    name: str
    type: PtxType
    source: ParamSource


@dataclass(frozen=True)
class Launch:
    entry: str
    params: tuple[LaunchParam, ...]
    grid: tuple[str, str, str]       # expressions over runtime dims (see ptxc.pipeline.exprs)
    block: tuple[int, int, int]
    dynamic_smem_bytes: int = 0
    # PTX .minnctapersm: ptxas keeps the registers within what this many resident CTAs per SM
    # leave (with .maxntid); 0 leaves the directive out.
    min_ctas_per_sm: int = 0
    # tensor-memory columns the kernel allocates (tcgen05.alloc; 0: none): CTAs per SM share 512
    tmem_columns: int = 0


@dataclass
class Program:
    """What a family builds for one (spec, target): IR entries and their launch list."""

    entries: list[EntryIR]
    launches: list[Launch]
    config: dict[str, Any] = field(default_factory=dict)   # resolved tiles, recorded in metadata
    ptx_version: str | None = None   # the module's PTX ISA version when newer than the target's


@dataclass(frozen=True)
class Interface:
    tensors: tuple[TensorInfo, ...]
    dims: tuple[str, ...]            # runtime dimensions, inferred from tensor shapes at launch
    defaults: dict[str, int] = field(default_factory=dict)  # small odd shapes for launch-test
    # Dims not inferable from shapes: {"num_splits": {"value": 3}} or {"num_splits": {"auto": {...}}}
    dim_rules: dict[str, dict] = field(default_factory=dict)
    # Runtime scalar arguments (kernel parameters, not dims): {"k_scale": {"dtype": "f32", "doc": ...}}
    scalars: dict[str, dict] = field(default_factory=dict)


@dataclass(frozen=True)
class Family:
    name: str
    doc: str
    fields: FamilyFields
    validate: Callable[[KernelSpec], None]
    interface: Callable[[KernelSpec], Interface]
    build: Callable[[KernelSpec, Target], Program]
    resolve_tile: Callable[[KernelSpec, Target], dict[str, Any]]
    # Random inputs at the given dims (host arrays, already representable in the dtype) ...
    make_inputs: Callable[[KernelSpec, dict[str, int], Any], dict[str, Any]] | None = None
    # ... and the outputs in float64; with dtype=..., the naive same-dtype computation instead.
    reference: Callable[..., dict[str, Any]] | None = None
    # The dtype the kernel's row sums take the probabilities in (tensor-core row sums), if not f32:
    # the lse tolerance's naive computation rounds them the same way (ptxc/reference).
    row_sum_dtype: Callable[[KernelSpec], str | None] | None = None
    # The cache rows no query reads, per cache tensor (a boolean mask over its row axes) for
    # make_inputs' inputs: launch-test fills them with NaN before the kernel runs
    # (attention/unread_rows.py); None: the family's inputs mark their own, or it has no cache.
    unread: Callable[[KernelSpec, dict[str, Any]], dict[str, Any]] | None = None
    # Fills the common values the family derives from its own keys (mla: head_dim, one KV head),
    # refusing given values that disagree; called on the validated keys before the defaults.
    derive: Callable[[dict[str, Any]], None] | None = None
    # Common keys the family does not need, with the value they take when absent (mla_append:
    # num_heads = 1, the cache has no query heads)
    implied: dict[str, Any] = field(default_factory=dict)
    # Tile keys that only make sense together (one group per code path, e.g. decode's SIMT and
    # tensor-core tiles): `ptxc tune` searches each group's product; empty: all keys at once.
    tile_groups: tuple[tuple[str, ...], ...] = ()
    # Whether a target's PTX depends on the spec's other targets (a tile sized to fit all of
    # them, so that the grid is target-independent): the PTX cache key then holds the whole
    # target list, else only the target (so specs that differ in other targets share entries;
    # tests/pipeline/test_hardening_cache.py checks the claim over every example spec).
    ptx_reads_all_targets: Callable[[KernelSpec], bool] = lambda spec: False
