"""Family "decode": one query token per sequence attends over its KV cache.

KV caches may be contiguous, per-sequence pointer arrays or paged (`kv_layout`; addressing in
kv_access.py). With `num_splits` > 1 (or "auto") the launch list is flash-decoding: a chunk
kernel writes per-split partial outputs to a workspace, and split_reduce.py merges them exactly.
Two paths, one interface and launch list (option `math`): for a GQA group >= 4 with f16/bf16
caches on sm_80+, tensor cores — varlen's GQA-packed body with one token per sequence
(decode_mma.py); otherwise SIMT, where one CTA handles one (sequence, KV head, chunk of
`heads_per_cta` query heads of that KV head's group), so each K/V row is loaded once for the
whole chunk (decode_attend.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...errors import InputError, SpecError
from ...ir import S64, U32, KernelBuilder
from ...spec.fields import Field, FamilyFields, int_range, head_dim_range
from ...spec.model import KernelSpec
from ...targets import DEFAULT_SMEM_PER_CTA, Target
from .. import common as C
from ..attention.split_reduce import build_reduce, split_interface
from ..attention.variant import (
    VARIANT_FIELDS, default_seq_len, validate_variant, variant_inputs, variant_reference_args,
    variant_tensors)
from ..base import Family, Interface, Launch, LaunchParam, ParamSource, Program, TensorInfo
from ..bodies.decode_attend import emit_attention
from ..config.register_floor import needs_floor
from ..kv import kv_fp8
from ..kv.kv_access import LAYOUTS, MAX_PAGE_SIZE, check_page_size
from ..math import fp8
from . import decode_mma
from .decode_mma import kv_access, page_size

_hd_check, _hd_allowed = head_dim_range(16, 512)
_page_check, _page_allowed = int_range(1, MAX_PAGE_SIZE)
_split_check, _split_allowed = int_range(1, 64)
FIELDS = FamilyFields(
    fields=(
        Field("head_dim", "int", "elements per head", check=_hd_check, allowed=_hd_allowed),
        Field("return_lse", "bool", "also write lse [batch, num_heads] (f32, natural log)",
              default=False),
        Field("kv_layout", "str", "KV cache layout (docs/kernels.md)", default="contiguous",
              choices=LAYOUTS),
        Field("page_size", "int", "rows per page of a paged cache (paged only; default 16)",
              default=None, check=_page_check, allowed=_page_allowed),
        Field("num_splits", "int_or_auto", 'KV splits per sequence (flash-decoding): 1, N, or '
              '"auto" (chosen at launch: resident CTA slots of the split kernel vs. batch x heads)', default=1,
              check=_split_check, allowed=f'{_split_allowed}, or "auto"'),
        Field("append_kv", "bool", "launch kv_append first: write this step's k_new/v_new at row "
              "seq_lens - 1, then attend (caches become inout)", default=False),
        Field("math", "str", 'GQA math: "mma" (tensor cores, query heads of a KV head packed '
              'into the tile rows), "simt", or "auto" (mma for a group >= 4 with f16/bf16 caches '
              'on sm_80+, docs/kernels.md)', default="auto", choices=("auto", "mma", "simt")),
        *kv_fp8.FIELDS,
        *VARIANT_FIELDS,
    ),
    tile=(
        Field("num_warps", "int", "SIMT path: warps per CTA (default 4)", default=None,
              choices=(1, 2, 4, 8)),
        Field("kv_unroll", "int", "SIMT path: KV rows each lane loads per iteration (default 4)",
              default=None, choices=(1, 2, 4, 8)),
        Field("block_n", "int", "tensor-core path: keys per K/V tile (default 64, 32 above "
              "head_dim 128)", default=None, choices=(16, 32, 64, 128)),
        Field("num_stages", "int", "tensor-core path: K/V tiles in the cp.async pipeline "
              "(default 2)", default=None, choices=(1, 2, 3, 4)),
        Field("kv_loads", "str", "tensor-core path on sm_90a / sm_100a (varlen's wgmma / tcgen05 "
              "tile): K/V tiles by TMA boxes (the default where the layout allows: contiguous "
              "caches and pages of >= 8 rows) or per-thread cp.async (sm_90a)", default=None,
              choices=("cp_async", "tma")),
        Field("warp_specialize", "bool", "tensor-core path with TMA: on sm_90a a producer "
              "warpgroup issues the boxes under full/empty mbarriers and the consumer warpgroup "
              "only computes, on sm_100a load and MMA warps (varlen's rule decides the default: "
              "docs/kernels.md \"decode\")", default=None),
    ),
)
SIMT_STAGES = 2     # K/V row sets in the SIMT path's cp.async pipeline (one in flight while computing)
MAX_HEAD_REGS = 32  # f32 registers per lane for the query chunk (same again for the accumulator): ~128 regs total


@dataclass(frozen=True)
class DecodeConfig:
    fmt: C.ElemFormat
    head_dim: int
    chunks: int            # 128-bit chunks per row
    lanes_per_row: int
    chunks_per_lane: int
    num_warps: int
    kv_unroll: int
    heads_per_cta: int
    group_size: int
    kv_stages: int = 0     # >= 2: K/V through a cp.async pipeline in shared memory (see kv_stage_bytes)
    min_ctas_per_sm: int = 0   # 1 where ptxas's own register cap spills (register_floor.py)

    @property
    def rows_per_warp(self) -> int:
        return 32 // self.lanes_per_row

    @property
    def head_chunks(self) -> int:
        return self.group_size // self.heads_per_cta

    @property
    def ml_smem_bytes(self) -> int:
        """(m, l) per warp and head, padded so the accumulator region stays 16-byte aligned."""
        return -(-self.num_warps * self.heads_per_cta * 8 // 16) * 16

    @property
    def merge_smem_bytes(self) -> int:
        return self.ml_smem_bytes + self.num_warps * self.heads_per_cta * self.head_dim * 4

    def kv_stage_bytes(self, stages: int) -> int:
        """Shared memory of a `stages`-deep K/V pipeline: every thread's chunks, K and V."""
        return stages * 2 * self.kv_unroll * self.chunks_per_lane * self.num_warps * 32 * C.VEC_BYTES


def validate(spec: KernelSpec) -> None:
    C.check_dtype_target(spec.dtype, spec.targets)
    check_page_size(spec)
    kv_fp8.validate(spec)
    validate_variant(spec, causal_option=False, separate_v=False)
    decode_mma.validate(spec)
    if spec.opt("append_kv") and spec.opt("kv_layout") == "pointer_array":
        raise SpecError("append_kv supports kv_layout \"contiguous\" and \"paged\", not "
                        "\"pointer_array\"", key="append_kv")


def configure(spec: KernelSpec, target: Target) -> DecodeConfig:
    fmt = C.FORMATS[spec.dtype]
    chunks = spec.head_dim // fmt.per_vec
    lpr = min(32, C.next_pow2(chunks))
    cpl = -(-chunks // lpr)
    per_head = cpl * fmt.per_vec
    tile = {**C.tuned_tile("decode", spec, target, ("num_warps", "kv_unroll")),
            **spec.tile_dict()}  # the user's keys win over tuned ones
    nw = tile.get("num_warps") or 4
    cap = max(1, MAX_HEAD_REGS // per_head)
    hp = max(h for h in range(1, spec.group_size + 1) if spec.group_size % h == 0 and h <= cap
             and nw * h * (4 + spec.head_dim) * 4 <= DEFAULT_SMEM_PER_CTA)
    unroll = tile.get("kv_unroll") or (4 if hp * per_head <= 32 else 2)
    cfg = DecodeConfig(fmt, spec.head_dim, chunks, lpr, cpl, nw, unroll, hp, spec.group_size,
                       min_ctas_per_sm=1 if needs_floor("decode", spec, target) else 0)
    # Plain caches on cp.async targets take a 2-stage pipeline when it fits the static
    # shared-memory limit beside the merge area (per target: grid and block do not change).
    if target is not None and target.has_cp_async and kv_fp8.kv_dtype(spec) == spec.dtype and \
            cfg.merge_smem_bytes + cfg.kv_stage_bytes(SIMT_STAGES) <= DEFAULT_SMEM_PER_CTA:
        cfg = dataclasses.replace(cfg, kv_stages=SIMT_STAGES)
    if cfg.merge_smem_bytes > DEFAULT_SMEM_PER_CTA:
        raise SpecError(f"num_warps = {nw} needs {cfg.merge_smem_bytes} bytes of shared memory for "
                        f"the cross-warp merge; at most {DEFAULT_SMEM_PER_CTA}: use fewer warps",
                        key="tile.num_warps")
    return cfg


def resolve_tile(spec: KernelSpec, target: Target) -> dict:
    if decode_mma.uses_mma(spec):
        return decode_mma.resolve_tile(spec, target)
    c = configure(spec, target)
    return {"num_warps": c.num_warps, "kv_unroll": c.kv_unroll, "heads_per_cta": c.heads_per_cta,
            "lanes_per_row": c.lanes_per_row, "kv_stages": c.kv_stages}


def _splits(spec: KernelSpec):
    return spec.opt("num_splits")


def interface(spec: KernelSpec) -> Interface:
    d, H, Hk = spec.head_dim, spec.num_heads, spec.num_kv_heads
    kv = kv_access(spec)
    append = spec.opt("append_kv")
    tensors = [TensorInfo("q", spec.dtype, ("batch", H, d), "input"),
               *kv.tensors(kv_fp8.kv_dtype(spec), Hk, d, "inout" if append else "input"),
               TensorInfo("seq_lens", "i32", ("batch",), "input", "KV rows used per sequence "
                          "(0 allowed; clamped to the cache's capacity)", device_resident_scalars=True),
               TensorInfo("o", spec.dtype, ("batch", H, d), "output")]
    if spec.opt("return_lse"):
        tensors.append(TensorInfo("lse", "f32", ("batch", H), "output",
                                  "log-sum-exp of the scaled scores; -inf for an empty sequence"))
    tensors += variant_tensors(spec)
    if append:
        tensors += _append_inputs(spec)
    scale_tensors, scalars = kv_fp8.interface_extras(spec)
    tensors += scale_tensors
    dims = ["batch", *kv.dims()]
    S = default_seq_len(spec, 203)
    if spec.opt("kv_layout") == "paged":
        S = max(S, page_size(spec) + page_size(spec) // 2 + 1)   # launch-test's sequences cross a page
    defaults = {"batch": 5, "max_seq_len": S} if spec.opt("kv_layout") != "paged" else \
        {"batch": 5, "max_pages_per_seq": -(-S // page_size(spec)), "num_pages": 5 * -(-S // page_size(spec)) + 3}
    rules = {}
    splits = _splits(spec)
    if splits != 1:
        ctas = f"{Hk * _ctas_per_kv_head(spec)} * batch"
        work, rules["num_splits"] = split_interface("batch", H, d, splits, ctas, f"ptxc_{spec.name}_split")
        tensors += work
        dims.append("num_splits")
    return Interface(tuple(tensors), tuple(dims), defaults, rules, scalars=scalars)


def _ctas_per_kv_head(spec: KernelSpec) -> int:
    """CTAs per (sequence, KV head, split): query tiles (mma) or head chunks (SIMT)."""
    return decode_mma.tiles_per_seq(spec) if decode_mma.uses_mma(spec) else \
        configure(spec, None).head_chunks


def build(spec: KernelSpec, target: Target) -> Program:
    mma = decode_mma.uses_mma(spec)
    cfg = decode_mma.configure(spec, target) if mma else configure(spec, target)
    kv = kv_access(spec)
    split = _splits(spec) != 1
    b = KernelBuilder(f"ptxc_{spec.name}" + ("_split" if split else ""))
    params: list[LaunchParam] = []

    param = C.param_loader(b, params)

    # split: the partials, and o where the tensor-core tile finishes whole sequences in split 0
    # (VarlenMath.epilogue; its pointer and strides are loaded there)
    finals = split and mma and cfg.finishes_whole_tiles
    names = ["q", *kv.pointer_tensors(), "seq_lens"] + \
        (["o_part", "lse_part"] + (["o"] if finals else []) if split else
         ["o"] + (["lse"] if spec.opt("return_lse") else [])) + \
        [t.name for t in variant_tensors(spec)]
    ptrs = {t: param(t, C.U64, ParamSource("pointer", tensor=t), b.to_global, late=split and t == "o")
            for t in names}
    strides = {("q", a): C.byte_stride(b, param(f"q_stride{a}", S64, ParamSource("stride", "q", a)), cfg.fmt)
               for a in (0, 1)}
    kv.emit_strides(param)
    if not split or finals:
        strides.update({("o", a): param(f"o_stride{a}", S64, ParamSource("stride", "o", a),
                                        lambda r: C.byte_stride(b, r, cfg.fmt), late=split)
                        for a in (0, 1)})
    kv.emit_dims(param)
    split_count = param("num_splits", U32, ParamSource("dim", name="num_splits")) if split else None
    quant = kv_fp8.emit_params(spec, target, b, param)
    if mma:
        tmaps = None
        if getattr(cfg, "tma", False):   # the TMA tiles: k/v tensor maps after the other params
            from ..kv.kv_boxes import tensor_map_params
            tmaps = tensor_map_params(b, cfg, kv, params)
        decode_mma.emit_attention(b, spec, cfg, kv, ptrs, strides, split_count, quant, tmaps)
    else:
        emit_attention(b, spec, cfg, kv, ptrs, strides, split_count, quant, target)
    b.ret()
    grid = (str(spec.num_kv_heads * _ctas_per_kv_head(spec)), "batch", "num_splits" if split else "1")
    threads = getattr(cfg, "launch_threads", cfg.num_warps * 32)   # a producer warpgroup's too
    launches = [Launch(entry=b.entry.name, params=tuple(params), grid=grid, block=(threads, 1, 1),
                       dynamic_smem_bytes=cfg.smem_bytes if mma else 0,
                       min_ctas_per_sm=getattr(cfg, "min_ctas_per_sm", 0),
                       tmem_columns=getattr(cfg, "tmem_columns", 0))]
    entries = [b.entry]
    if spec.opt("append_kv"):
        from .kv_append import build as build_append
        appended = build_append(append_spec(spec), target)
        entries.insert(0, appended.entries[0])
        # one new token per sequence: kv_append's num_new dim is the constant 1 here
        launches.insert(0, dataclasses.replace(appended.launches[0], grid=("1", "batch", "1")))
    if split:
        entry, launch = build_reduce(spec, f"ptxc_{spec.name}_reduce", spec.opt("return_lse"))
        entries.append(entry)
        launches.append(launch)
    return Program(entries, launches, resolve_tile(spec, target),
                   ptx_version=fp8.ptx_version(target) if quant is not None else None)


def append_spec(spec: KernelSpec) -> KernelSpec:
    """The kv_append kernel fused in front of decode (entry `ptxc_<name>_append`)."""
    keep = {"kv_layout", "page_size", "kv_dtype", "kv_scale"}   # FP8: the append quantises
    return dataclasses.replace(spec, name=f"{spec.name}_append", family="kv_append",
                               options=tuple((k, v) for k, v in spec.options if k in keep))


def _append_inputs(spec: KernelSpec) -> list[TensorInfo]:
    Hk, d = spec.num_kv_heads, spec.head_dim
    return [TensorInfo(t, spec.dtype, ("batch", 1, Hk, d), "input", "this step's new row") for t in ("k_new", "v_new")] + [
        TensorInfo("positions", "i32", ("batch",), "input", "row of the new token (normally "
                   "seq_lens - 1; out-of-range rows are skipped)", device_resident_scalars=True)]


def make_inputs(spec: KernelSpec, dims: dict[str, int], rng) -> dict:
    """Random q/k/v and ragged seq_lens cycling through full, 0, 1, an odd middle, 17; paged
    caches get a shuffled block table with spare pages, so page order != sequence order."""
    import numpy as np

    from ...reference import round_to
    B, H, Hk, d = dims["batch"], spec.num_heads, spec.num_kv_heads, spec.head_dim
    paged = spec.opt("kv_layout") == "paged"
    S = dims["max_pages_per_seq"] * page_size(spec) if paged else dims["max_seq_len"]
    rows = (dims["num_pages"], page_size(spec)) if paged else (B, S)
    q, k, v = (round_to(rng.standard_normal(shape), spec.dtype).astype(np.float32)
               for shape in ((B, H, d), (*rows, Hk, d), (*rows, Hk, d)))
    pattern = [S, 0, 1, max(1, (S * 5 // 9) | 1), 17]
    lens = np.array([min(pattern[i % len(pattern)], S) for i in range(B)], dtype=np.int32)
    inputs = {"q": q, "k_cache": k, "v_cache": v, "seq_lens": lens}
    if paged:
        need = B * dims["max_pages_per_seq"]
        if dims["num_pages"] < need:
            raise InputError(f"num_pages = {dims['num_pages']} < batch * max_pages_per_seq = {need}")
        pages = rng.permutation(dims["num_pages"])[:need].astype(np.int32)
        inputs["block_table"] = pages.reshape(B, dims["max_pages_per_seq"])
    if spec.opt("append_kv"):
        inputs["k_new"], inputs["v_new"] = (round_to(rng.standard_normal((B, 1, Hk, d)), spec.dtype)
                                            .astype(np.float32) for _ in range(2))
        inputs["positions"] = (lens - 1).astype(np.int32)
    kv_fp8.add_inputs(spec, inputs, rng)
    inputs.update(variant_inputs(spec, rng))
    return inputs


def unread(spec: KernelSpec, inputs: dict) -> dict:
    """The cache rows no decode query (at position L - 1) reads (attention/unread_rows.py)."""
    from ..attention.unread_rows import unread_cache_rows
    return unread_cache_rows(spec, inputs, lambda b, L: L - 1 if L > 0 else None)


def dense_caches(spec: KernelSpec, inputs: dict) -> tuple:
    """Gather a paged cache into [batch, rows, Hk, d] for the reference."""
    if spec.opt("kv_layout") != "paged":
        return inputs["k_cache"], inputs["v_cache"]
    import numpy as np
    bt = inputs["block_table"]
    gather = lambda c: np.concatenate([c[bt[:, p]] for p in range(bt.shape[1])], axis=1) \
        if bt.shape[1] else c[:0]
    return gather(inputs["k_cache"]), gather(inputs["v_cache"])


def reference(spec: KernelSpec, inputs: dict, dtype: str | None = None) -> dict:
    from ... import reference as ref
    out = {}
    if spec.opt("append_kv"):
        from .kv_append import reference as append_reference
        out = append_reference(append_spec(spec), inputs)
        inputs = {**inputs, **out}
    k, v = kv_fp8.dequantized(spec, inputs, *dense_caches(spec, inputs))
    if dtype in fp8.KINDS:   # the naive baseline of FP8 cache outputs: bytes, compared exactly
        dtype = None
    o, lse = ref.decode(inputs["q"], k, v, inputs["seq_lens"], spec.softmax_scale, dtype=dtype,
                        **variant_reference_args(spec, inputs))
    out["o"] = o
    if spec.opt("return_lse"):
        out["lse"] = lse
    return out


FAMILY = Family(name="decode", doc=__doc__.split("\n")[0], fields=FIELDS, validate=validate,
                interface=interface, build=build, resolve_tile=resolve_tile,
                make_inputs=make_inputs, reference=reference, unread=unread,
                row_sum_dtype=lambda spec: spec.dtype if decode_mma.uses_mma(spec) else None,
                tile_groups=(decode_mma.SIMT_TILE_KEYS, decode_mma.MMA_TILE_KEYS))
