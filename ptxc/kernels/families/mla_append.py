"""Family "mla_append": write a step's latent rows into an MLA cache at vLLM's slot mapping.

vLLM's concat_and_cache_mla: token t's row of the latent cache is kv_c[t] (kv_lora_rank columns)
followed by k_pe[t] (qk_rope_head_dim columns), at slot slot_mapping[t] = page * page_size +
offset of a paged kv_cache [num_pages, page_size, kv_lora_rank + qk_rope_head_dim] (the mla
family's). A negative slot (padding) or one outside the cache is skipped - no byte of the cache
is written for it. Optionally RoPE rotates k_pe at positions[t] (cos_sin_cache, neox or gptj,
kv_transform.Rope's exact f32 sequence; a token outside [0, max_position) is skipped), and an
e4m3 cache stores fp8(x / k_scale) (satfinite RNE: inf -> 448, NaN -> the NaN byte). An
e4m3_ds cache (kv_fp8.GroupScaledRows, vLLM's fp8_ds_mla) stores each 128-column group over its
own scale amax / 448, the scales in the row, and the RoPE part in bf16 (store_group_scaled).

One CTA per token; thread i writes 8-element chunk i of the row (kv_c's chunks, then k_pe's).
"""

from __future__ import annotations

import dataclasses

from ...errors import SpecError
from ...ir import B32, F32, S64, U32, U64, Addr, KernelBuilder, Reg
from ...spec.fields import Field, FamilyFields
from ...spec.model import KernelSpec
from ...targets import TARGETS, Target
from .. import common as C
from ..base import Family, Interface, Launch, LaunchParam, ParamSource, Program, TensorInfo
from ..kv import kv_fp8
from ..kv.kv_access import KVAccess
from ..kv.kv_rows import NewRows
from ..kv.kv_transform import CHUNK, Rope, layout_and_rope_params, load8, store8
from ..math import fp8
from . import mla

_FIELD = {f.name: f for f in mla.FIELDS.fields}
FIELDS = FamilyFields(fields=(
    _FIELD["kv_lora_rank"], _FIELD["qk_rope_head_dim"], _FIELD["head_dim"],
    dataclasses.replace(_FIELD["page_size"], doc="rows per page of the latent cache (default 64)"),
    dataclasses.replace(_FIELD["kv_dtype"], doc="latent cache element type: the dtype, e4m3 "
                        "(x / k_scale quantised) or e4m3_ds (656-byte rows, a scale per 128 "
                        "columns = amax / 448, bf16 RoPE)"),
    _FIELD["kv_scale"],
    Field("rope", "str", "rotate k_pe at positions[t] before it is stored (vLLM's cos_sin_cache "
          "layout; default: none, k_pe arrives rotated)", default=None, choices=("neox", "gptj")),
))
# num_heads is not a property of the cache: accepted for symmetry with the mla spec, default 1
IMPLIED = {"num_heads": 1}


def derive(values: dict) -> None:
    """mla's head_dim and one KV head, the page size recorded; the softmax scale means nothing
    here (1.0 when absent)."""
    mla.latent_head(values)
    if values.get("page_size") is None:
        values["page_size"] = mla.DEFAULT_PAGE_SIZE
    if values.get("softmax_scale") is None:
        values["softmax_scale"] = 1.0


def page_size(spec: KernelSpec) -> int:
    return spec.opt("page_size") or mla.DEFAULT_PAGE_SIZE


def validate(spec: KernelSpec) -> None:
    if spec.dtype == "f32":
        raise SpecError("dtype f32: MLA caches are bf16, f16 or e4m3; use bf16 or f16", key="dtype")
    mla.check_cache_keys(spec)
    kd = spec.opt("kv_dtype")
    C.check_dtype_target(spec.dtype, spec.targets)
    if kd in ("e4m3", kv_fp8.GROUP_SCALED):
        old = [t for t in spec.targets if not TARGETS[t].has_mma_m16n8k16]
        if old:
            raise SpecError(f"{kd} latent caches need sm_80+ (the attention side's targets), but "
                            f"targets include {old[0]}; drop it", key="targets")


def _kv(spec: KernelSpec) -> KVAccess:
    return KVAccess("paged", kv_fp8.kv_format(spec), page_size(spec), by_slot=True, latent=True)


def interface(spec: KernelSpec) -> Interface:
    rank, rope_d = spec.opt("kv_lora_rank"), spec.opt("qk_rope_head_dim")
    kv = _kv(spec)
    tensors = [
        TensorInfo("kv_c", spec.dtype, ("num_tokens", rank), "input", "the new latent rows (the "
                   "compressed KV, after its norm)"),
        TensorInfo("k_pe", spec.dtype, ("num_tokens", rope_d), "input",
                   "the new keys' RoPE part" + (" (un-rotated)" if spec.opt("rope") else ", rotated")),
        TensorInfo("slot_mapping", "i64", ("num_tokens",), "input", "cache slot of each token: page * "
                   "page_size + offset; negative (padding) and slots past the cache are skipped",
                   device_resident_scalars=True),
        *kv.tensors(kv_fp8.kv_dtype(spec), 1, kv_fp8.row_elems(spec), "inout"),
    ]
    dims, scalars = ["num_tokens", *kv.dims()], {}
    if kv_fp8.kind(spec):
        scale_tensors, scalars = kv_fp8.interface_extras(spec)
        tensors += scale_tensors
    defaults = {"num_tokens": 11, "num_pages": 3}
    if spec.opt("rope"):
        tensors += [TensorInfo("positions", "i64", ("num_tokens",), "input", "RoPE position of each "
                               "token; a token outside [0, max_position) is skipped",
                               device_resident_scalars=True),
                    TensorInfo("cos_sin_cache", "f32", ("max_position", rope_d), "input", "row p: cos "
                               "of the qk_rope_head_dim/2 frequencies at position p, then their sin")]
        dims.append("max_position")
        defaults["max_position"] = 45
    return Interface(tuple(tensors), tuple(dims), defaults, scalars=scalars)


def threads(spec: KernelSpec) -> int:
    return -(-spec.head_dim // CHUNK // 32) * 32


def build(spec: KernelSpec, target: Target) -> Program:
    rank, rope_d, rope = spec.opt("kv_lora_rank"), spec.opt("qk_rope_head_dim"), spec.opt("rope")
    fmt = C.FORMATS[spec.dtype]
    kind = kv_fp8.kind(spec)
    kv = _kv(spec)
    b = KernelBuilder(f"ptxc_{spec.name}")
    params: list[LaunchParam] = []

    param = C.param_loader(b, params)

    mode = kv_fp8.scale_mode(spec)
    names = ("kv_c", "k_pe", "slot_mapping", *(("positions", "cos_sin_cache") if rope else ()),
             *kv.pointer_tensors(), *(("k_scale",) if mode == "device" else ()))
    ptrs = {t: b.to_global(param(t, U64, ParamSource("pointer", tensor=t))) for t in names}
    strides = {t: C.byte_stride(b, param(f"{t}_stride0", S64, ParamSource("stride", t, 0)), fmt)
               for t in ("kv_c", "k_pe")}
    cs_stride, max_position = layout_and_rope_params(b, kv, param, bool(rope))
    scale = param("k_scale", F32, ParamSource("scalar", name="k_scale")) if mode == "tensor" else None

    tid, token = b.special("%tid.x"), b.special("%ctaid.x")
    rows = NewRows(b, kv, ptrs, token)      # by slot: the row is the slot, valid iff in the cache
    valid = rows.valid
    rot = None
    if rope:   # the position is its own input; the slot only says where the row goes
        pos = b.ld("global", S64, Addr(C.element_offset(b, ptrs["positions"], token, b.mov(8, S64))))
        valid = b.and_(valid, b.and_(b.setp("ge", pos, 0), b.setp("lt", pos, b.cvt(S64, max_position))))
        cs_row = C.element_offset(b, ptrs["cos_sin_cache"], b.cvt(U32, b.selp(pos, 0, valid)), cs_stride)
        rot = Rope(b, rope, rope_d, b.bitcast(cs_row, U64))

    def row_byte(offset: Reg):
        """(address of byte `offset` (u32) of the token's cache row, row in the cache)."""
        bases = kv.bases(b, ptrs, None, None, b.cvt(S64, offset))
        return kv.row_address(b, bases, "k_cache", rows.row, valid, rows.page_cache())

    grouped = kv_fp8.group_scaled(spec)
    # store_group_scaled's half-warp amax needs kv_c's chunk i on thread i, in one round
    assert grouped is None or threads(spec) * CHUNK >= rank, (threads(spec), rank)
    with b.if_then(valid):
        if mode == "device":
            scale = b.ld("global", F32, Addr(ptrs["k_scale"]), nc=True)
        for src, col0, width in (("kv_c", 0, rank), ("k_pe", rank, rope_d)):
            row_addr = C.element_offset(b, ptrs[src], token, strides[src])
            for rnd in range(-(-width // CHUNK // threads(spec))):
                chunk = b.add(tid, rnd * threads(spec))
                with b.if_then(b.setp("lt", chunk, width // CHUNK)):
                    first = b.mul(chunk, CHUNK)
                    vals = load8(b, fmt, b.bitcast(b.add(row_addr, b.cvt(S64, b.mul(first, fmt.bytes))), U64))
                    if rot is not None and src == "k_pe":
                        vals = rot.rotate(vals, first, b.bitcast(row_addr, U64), fmt, valid)
                    if grouped is not None:
                        store_group_scaled(b, grouped, src, chunk, vals, row_byte, target)
                        continue
                    dst, ok = row_byte(b.mul(b.add(first, col0), kv.fmt.bytes))
                    with b.if_then(ok):
                        if kind:
                            words = fp8.quantize(b, [b.div(v, scale) for v in vals], kind, target)
                            b.st("global", B32, Addr(dst), words)
                        else:
                            store8(b, fmt, dst, vals, target)
    b.ret()
    launch = Launch(entry=b.entry.name, params=tuple(params), grid=("num_tokens", "1", "1"),
                    block=(threads(spec), 1, 1))
    return Program([b.entry], [launch], {"threads": threads(spec), "chunk_elems": CHUNK},
                   ptx_version=fp8.ptx_version(target) if kind else None)


FLT_MIN = 1.1754943508222875e-38     # the smallest normal f32: a group scale's floor


def store_group_scaled(b: KernelBuilder, rows: kv_fp8.GroupScaledRows, src: str, chunk: Reg,
                       vals: list[Reg], row_byte, target: Target) -> None:
    """Thread `chunk`'s 8 values into a kv_fp8.GroupScaledRows row, as vLLM's
    concat_and_cache_ds_mla writes it. kv_c: the 16 threads of a 128-column group (a half-warp:
    chunk i is thread i, every lane active) reduce amax = max |x| by butterfly shuffles (max.f32
    drops a NaN operand, as fmaxf does), scale = max(amax / 448, FLT_MIN), codes = satfinite RNE
    e4m3 of x / scale at bytes [8 i, 8 i + 8), and the group's first thread writes the f32 scale.
    k_pe: bf16 values at rope_at + 16 i (the dtype is bf16: mla.check_group_scaled)."""
    if src == "k_pe":
        dst, ok = row_byte(b.add(b.mul(chunk, 2 * CHUNK), rows.rope_at))
        with b.if_then(ok):
            store8(b, C.FORMATS["bf16"], dst, vals, target)
        return
    per_group = rows.group // CHUNK
    amax = b.abs(vals[0])
    for v in vals[1:]:
        amax = b.max(amax, b.abs(v))
    lane = 1
    while lane < per_group:
        amax = b.max(amax, b.shfl("bfly", amax, lane))
        lane *= 2
    scale = b.max(b.div(amax, 448.0), FLT_MIN)
    words = fp8.quantize(b, [b.div(v, scale) for v in vals], "e4m3", target)
    dst, ok = row_byte(b.mul(chunk, CHUNK))
    with b.if_then(ok):
        b.st("global", B32, Addr(dst), words)
    group = b.shr(chunk, per_group.bit_length() - 1)
    first = b.setp("eq", b.and_(chunk, per_group - 1), 0)
    dst, ok = row_byte(b.add(b.shl(group, 2), rows.scales_at))
    with b.if_then(b.and_(ok, first)):
        b.st("global", F32, Addr(dst), [scale])


def resolve_tile(spec: KernelSpec, target: Target) -> dict:
    return {"threads": threads(spec), "chunk_elems": CHUNK}


def make_inputs(spec: KernelSpec, dims: dict[str, int], rng) -> dict:
    from .mla_inputs import append_inputs
    return append_inputs(spec, dims, rng, page_size(spec))


def reference(spec: KernelSpec, inputs: dict, dtype: str | None = None) -> dict:
    from .mla_inputs import append_reference
    return append_reference(spec, inputs, page_size(spec))


def unread(spec: KernelSpec, inputs: dict) -> dict:
    """The latent rows the append does not write (mla_inputs.append_destinations): launch-test
    fills them with NaN (bytes: 0x7F) and they must come back as they went in."""
    import numpy as np

    from .mla_inputs import append_destinations
    mask = np.ones(inputs["kv_cache"].shape[:2], dtype=bool)
    for _, page, offset in append_destinations(spec, inputs, page_size(spec)):
        mask[page, offset] = False
    return {"kv_cache": mask}


FAMILY = Family(name="mla_append", doc=__doc__.split("\n")[0], fields=FIELDS, validate=validate,
                interface=interface, build=build, resolve_tile=resolve_tile,
                make_inputs=make_inputs, reference=reference, unread=unread, derive=derive,
                implied=IMPLIED)

__all__ = ["FAMILY"]
