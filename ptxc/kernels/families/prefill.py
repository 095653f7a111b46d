"""Family "prefill": FlashAttention-2 forward over whole sequences (causal or not, GQA, LSE).

One CTA per (block of `block_m` query rows, query head, batch). The CTA stages its Q tile and a
pipeline of `num_stages` K/V tiles of `block_n` keys in shared memory and runs the online
softmax over the KV tiles; causal CTAs stop at the last tile their last query row can see and
mask only the tiles that cross the diagonal or the end of the keys. The math per tile is either
tensor cores (f16/bf16, `math/mma.py`) or SIMT FMA (f32, `math/simt.py`); see
docs/kernels.md for the layouts and the pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ...errors import SpecError
from ...ir import S64, U32, U64, KernelBuilder
from ...spec.model import KernelSpec
from ...targets import TARGETS, Target
from .. import common as C
from ..attention.prefill_tile import PERSISTENT_DIM, PERSISTENT_MAX, PERSISTENT_RULE
from ..attention.variant import (
    default_seq_len, head_dim_v, mask_bytes_param, validate_variant, variant_inputs,
    variant_reference_args, variant_tensors)
from ..base import Family, Interface, Launch, LaunchParam, ParamSource, Program, TensorInfo
from ..bodies import prefill_cp_async, prefill_tma
from ..config import tcgen05 as tc  # sm_100a/sm_103a f16/bf16, head dims 64/128
from ..config import wgmma as wg  # sm_90a f16/bf16, head dims 64/128/192/256
from ..config.prefill import FIELDS, MAX_SIMT_HEAD_DIM, configure
from ..mainloop.tiles import swizzled_slot, thread_slot
from ..math.mma import MmaMath
from ..math.simt import SimtMath
from ..math.wgmma import WgmmaMath


def interface(spec: KernelSpec) -> Interface:
    d, dv, H, Hk = spec.head_dim, head_dim_v(spec), spec.num_heads, spec.num_kv_heads
    tensors = [
        TensorInfo("q", spec.dtype, ("batch", "seq_q", H, d), "input"),
        TensorInfo("k", spec.dtype, ("batch", "seq_k", Hk, d), "input"),
        TensorInfo("v", spec.dtype, ("batch", "seq_k", Hk, dv), "input"),
        TensorInfo("o", spec.dtype, ("batch", "seq_q", H, dv), "output"),
    ]
    if spec.opt("return_lse"):
        tensors.append(TensorInfo("lse", "f32", ("batch", H, "seq_q"), "output",
                                  "log-sum-exp of the scaled scores; -inf for a row that sees no key"))
    tensors += variant_tensors(spec)
    packed = spec.opt("custom_mask") == "packed"
    if packed:
        tensors += [TensorInfo("custom_mask", "u8", ("mask_bytes",), "input", "mask bits: batch "
                               "entry b's bit (i, j) (query i sees key j) is bit (i*seq_k + j) % 8 "
                               "of byte mask_indptr[b] + (i*seq_k + j) // 8"),
                    TensorInfo("mask_indptr", "i32", ("batch + 1",), "input", "byte offset of "
                               "each batch entry's bits: 0, non-decreasing, segments >= "
                               "ceil(seq_q*seq_k / 8)", device_resident_scalars=True)]
    rules = persistent_rule(spec)
    return Interface(tuple(tensors), ("batch", "seq_q", "seq_k") + (("mask_bytes",) if packed else ())
                     + tuple(rules), {"batch": 2, "seq_q": 17, "seq_k": default_seq_len(spec, 113)},
                     dim_rules=rules)


def persistent_rule(spec: KernelSpec) -> dict:
    """tile.persistent's grid, the persistent_ctas dim: a CTA per resident slot (num_sms x the
    kernel's CTAs per SM on the launched target), no more than the work tiles of the kernel that
    takes the key (a given value: that many CTAs, each taking tiles in turn)."""
    if not spec.tile_dict().get("persistent"):
        return {}
    takers = [t for t in spec.targets if "persistent" in path_of(spec, TARGETS[t]).keys]
    if not takers:
        return {}
    rows = _configure(spec, TARGETS[takers[0]]).cta_rows
    return {PERSISTENT_DIM: {"auto": {"max": PERSISTENT_MAX, "occupancy_of": f"ptxc_{spec.name}",
                                      "ctas": f"cdiv(seq_q, {rows}) * {spec.num_heads} * batch",
                                      "rule": PERSISTENT_RULE}}}



# ---- the path table: which kernel a (spec, target) gets ------------------------------------
@dataclass(frozen=True)
class PrefillPath:
    """One prefill kernel: the specs and targets it takes, its configuration and the tile it
    records, its body, and the tile keys only it reads (the others ignore them; a spec setting
    one that no target's kernel reads is refused, naming the kernels that do)."""

    name: str
    applies: Callable[[KernelSpec, Target], bool]
    configure: Callable
    resolve_tile: Callable[[KernelSpec, Target], dict]
    body: Callable       # (b, spec, cfg, ptrs, strides, seq_q, seq_k, params, mask_bytes, batch)
    keys: tuple[str, ...]
    shapes: str
    targets: tuple[str, ...]     # where it runs, for refusals (the last path: every target)


def _tma_body(b, spec, cfg, ptrs, strides, seq_q, seq_k, params, mask_bytes, batch=None) -> None:
    prefill_tma.build_body(b, spec, cfg, ptrs, strides, seq_q, seq_k, params,   # tensor maps last
                           batch=batch)


def _wgmma_body(b, spec, cfg, ptrs, strides, seq_q, seq_k, params, mask_bytes, batch=None) -> None:
    if cfg.tma:      # tile.kv_loads = "tma"
        _tma_body(b, spec, cfg, ptrs, strides, seq_q, seq_k, params, mask_bytes, batch)
    else:
        prefill_cp_async.emit_body(b, spec, cfg, ptrs, strides, seq_q, seq_k, slot=swizzled_slot,
                                   math_type=WgmmaMath, mainloop="wgmma")


def _portable_body(b, spec, cfg, ptrs, strides, seq_q, seq_k, params, mask_bytes, batch=None) -> None:
    prefill_cp_async.emit_body(b, spec, cfg, ptrs, strides, seq_q, seq_k, mask_bytes,
                               slot=thread_slot, math_type=MmaMath if cfg.tensor_cores else SimtMath,
                               mainloop="cp_async")


# Most specific first: the first that applies is the target's kernel.
PATHS = (
    PrefillPath("the sm_100a tcgen05 kernel", tc.uses_tcgen05, tc.configure, tc.resolve_tile,
                _tma_body, ("kv_loads", "warp_specialize", "exp2_poly", "q_tiles", "correction",
                            "tma_store"),
                tc.TCGEN05_SHAPES,
                tc.TCGEN05_TARGETS),
    PrefillPath("the sm_90a wgmma kernel", wg.uses_wgmma, wg.configure, wg.resolve_tile,
                _wgmma_body, ("kv_loads", "warp_specialize", "pingpong", "tma_store", "persistent"),
                wg.WGMMA_SHAPES,
                wg.WGMMA_TARGETS),
    PrefillPath("the mma.sync / SIMT kernel", lambda spec, target: True,
                lambda spec, target: configure(spec, target),
                lambda spec, target: _resolve_portable(spec, target), _portable_body, (),
                "every other shape", ()),
)


def path_of(spec: KernelSpec, target: Target) -> PrefillPath:
    return next(p for p in PATHS if p.applies(spec, target))


def validate(spec: KernelSpec) -> None:
    C.check_dtype_target(spec.dtype, spec.targets)
    validate_variant(spec)
    if spec.opt("custom_mask") == "packed":
        if spec.opt("causal"):
            raise SpecError('custom_mask = "packed" needs causal = false (the bits are the whole '
                            'mask; set the causal part in them)', key="custom_mask")
        if spec.dtype == "f32":
            raise SpecError('custom_mask = "packed" with dtype f32: masks run on the tensor-core '
                            'path only; use f16 or bf16', key="custom_mask")
    if spec.dtype == "f32" and spec.head_dim > MAX_SIMT_HEAD_DIM:
        raise SpecError(f"head_dim = {spec.head_dim} with dtype f32: the SIMT path supports "
                        f"head_dim up to {MAX_SIMT_HEAD_DIM}; use f16 or bf16", key="head_dim")
    if spec.dtype != "f32":
        old = [t for t in spec.targets if not TARGETS[t].has_mma_m16n8k16]
        if old:
            raise SpecError(f"dtype {spec.dtype} prefill uses mma.m16n8k16 and cp.async (sm_80+), "
                            f"but targets include {old[0]}; use dtype f32 for {old[0]} or drop it",
                            key="targets")
    for t in spec.targets:
        if spec.tile_dict().get("block_m") == 192 and not wg.uses_wgmma(spec, TARGETS[t]):
            raise SpecError(f"block_m = 192 with targets {', '.join(spec.targets)}: 192 rows are the "
                            f"sm_90a warp-specialised kernel's three consumer warpgroups "
                            f"({wg.WGMMA_SHAPES}); {t} takes 16, 32, 64, 128 or 256",
                            key="tile.block_m")
        _configure(spec, TARGETS[t])
    paths = [path_of(spec, TARGETS[t]) for t in spec.targets]
    given = spec.tile_dict()
    for key, value in (("kv_loads", "tma"), ("warp_specialize", True), ("pingpong", True),
                       ("exp2_poly", given.get("exp2_poly") or None),
                       ("q_tiles", 2 if given.get("q_tiles") == 2 else None),
                       ("correction", True), ("tma_store", True), ("persistent", True)):
        if value is not None and given.get(key) == value and not any(key in p.keys for p in paths):
            takers = [p for p in PATHS if key in p.keys]
            shown = f'"{value}"' if isinstance(value, str) else str(value).lower()
            names = " and ".join(f"{p.name} ({p.shapes})" for p in takers)
            raise SpecError(f"{key} = {shown} with dtype {spec.dtype}, head_dim {spec.head_dim}, "
                            f"targets {', '.join(spec.targets)}: only {names} "
                            f"{'takes' if len(takers) == 1 else 'take'} it; add "
                            f"{' or '.join(t for p in takers for t in p.targets)} or drop the key",
                            key=f"tile.{key}")


def _configure(spec: KernelSpec, target: Target):
    return path_of(spec, target).configure(spec, target)


def resolve_tile(spec: KernelSpec, target: Target) -> dict:
    return path_of(spec, target).resolve_tile(spec, target)


def _resolve_portable(spec: KernelSpec, target: Target) -> dict:
    c = configure(spec, target)
    return {"block_m": c.block_m, "block_n": c.block_n, "num_warps": c.num_warps,
            "num_stages": c.num_stages, "path": "mma.m16n8k16" if c.tensor_cores else "simt",
            "cp_async": c.cp_async, "smem_row_stride": c.q_geom.stride, "smem_bytes": c.smem_bytes,
            **({"min_ctas_per_sm": c.min_ctas_per_sm} if c.min_ctas_per_sm else {}),
            **({"smem_swizzle": True} if c.q_geom.swizzled else {}),
            **({"warp_rows": c.warp_rows} if c.warp_rows != 16 else {}),
            **({"value_split": c.v_split} if c.v_split > 1 else {})}


def build(spec: KernelSpec, target: Target) -> Program:
    path = path_of(spec, target)
    cfg = path.configure(spec, target)
    b = KernelBuilder(f"ptxc_{spec.name}")
    params: list[LaunchParam] = []

    param = C.param_loader(b, params)

    ptrs = {t.name: b.to_global(param(t.name, U64, ParamSource("pointer", tensor=t.name)))
            for t in interface(spec).tensors}
    strides = {(t, a): C.byte_stride(b, param(f"{t}_stride{a}", S64, ParamSource("stride", t, a)), cfg.fmt)
               for t in "qkvo" for a in (0, 1, 2)}
    seq_q = param("seq_q", U32, ParamSource("dim", name="seq_q"))
    seq_k = param("seq_k", U32, ParamSource("dim", name="seq_k"))
    mask_bytes = mask_bytes_param(spec, param)
    persistent = getattr(cfg, "persistent", False)
    # a persistent kernel counts its work tiles (PersistentTiles) from the batch dim
    batch = param("batch", U32, ParamSource("dim", name="batch")) if persistent else None
    path.body(b, spec, cfg, ptrs, strides, seq_q, seq_k, params, mask_bytes, batch)
    b.ret()
    grid = (PERSISTENT_DIM, "1", "1") if persistent else \
        (f"cdiv(seq_q, {cfg.cta_rows})", str(spec.num_heads), "batch")
    launch = Launch(entry=b.entry.name, params=tuple(params), grid=grid,
                    block=(cfg.launch_threads, 1, 1), dynamic_smem_bytes=cfg.smem_bytes,
                    min_ctas_per_sm=cfg.min_ctas_per_sm,
                    tmem_columns=getattr(cfg, "tmem_columns", 0))
    return Program([b.entry], [launch], path.resolve_tile(spec, target))




def make_inputs(spec: KernelSpec, dims: dict[str, int], rng) -> dict:
    """Random q/k/v in BSHD layout, already representable in the dtype."""
    import numpy as np

    from ...reference import round_to
    B, Sq, Sk = dims["batch"], dims["seq_q"], dims["seq_k"]
    H, Hk, d, dv = spec.num_heads, spec.num_kv_heads, spec.head_dim, head_dim_v(spec)
    q, k, v = (round_to(rng.standard_normal(shape), spec.dtype).astype(np.float32)
               for shape in ((B, Sq, H, d), (B, Sk, Hk, d), (B, Sk, Hk, dv)))
    out = {"q": q, "k": k, "v": v, **variant_inputs(spec, rng)}
    if spec.opt("custom_mask") == "packed":   # one kind of bits per batch entry
        from .varlen_inputs import packed_inputs
        out.update(packed_inputs([Sq] * B, [Sk] * B, rng))
    return out


def reference(spec: KernelSpec, inputs: dict, dtype: str | None = None) -> dict:
    """fp64 (or naive same-dtype) outputs for BSHD inputs: o BSHD, lse [batch, heads, seq_q]."""
    import numpy as np

    from ... import reference as ref
    q, k, v = (np.swapaxes(np.asarray(inputs[t]), 1, 2) for t in "qkv")
    mask = None
    if spec.opt("custom_mask") == "packed":   # [batch, 1, seq_q, seq_k] from the same bits
        from .varlen_inputs import packed_visible
        B, _, Sq, Sk = q.shape[0], None, q.shape[2], k.shape[2]
        mask = np.stack([packed_visible(inputs, b, Sq, Sk) for b in range(B)])[:, None]
    o, lse = ref.attention(q, k, v, spec.softmax_scale, causal=spec.opt("causal"), dtype=dtype,
                           mask=mask, **variant_reference_args(spec, inputs))
    o = np.swapaxes(o, 1, 2)
    return {"o": o, "lse": lse} if spec.opt("return_lse") else {"o": o}


FAMILY = Family(name="prefill", doc=__doc__.split("\n")[0], fields=FIELDS, validate=validate,
                interface=interface, build=build, resolve_tile=resolve_tile,
                make_inputs=make_inputs, reference=reference,
                row_sum_dtype=lambda spec: None if spec.dtype == "f32" else spec.dtype)
