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
from ...spec.fields import Field, FamilyFields, head_dim_range
from ...spec.model import KernelSpec
from ...targets import TARGETS, Target
from .. import common as C
from ..attention.prefill_tile import PERSISTENT_DIM, PERSISTENT_MAX, PERSISTENT_RULE
from ..attention.variant import (
    VARIANT_FIELDS, default_seq_len, head_dim_v, mask_bytes_param, validate_variant, variant_inputs,
    variant_reference_args, variant_tensors)
from ..base import Family, Interface, Launch, LaunchParam, ParamSource, Program, TensorInfo
from ..bodies import prefill_cp_async, prefill_tma
from ..config import tcgen05 as tc  # sm_100a/sm_103a f16/bf16, head dims 64/128
from ..config import wgmma as wg  # sm_90a f16/bf16, head dims 64/128/192/256
from ..config.prefill import MAX_SIMT_HEAD_DIM, configure
from ..mainloop.tiles import swizzled_slot, thread_slot
from ..math.mma import MmaMath
from ..math.simt import SimtMath
from ..math.wgmma import WgmmaMath

# the spec keys: the family's, then its tile's
_hd_check, _hd_allowed = head_dim_range(8, 512)
_POW2_TILE = (16, 32, 64, 128, 256)
FIELDS = FamilyFields(
    fields=(
        Field("head_dim", "int", "elements per head", check=_hd_check, allowed=_hd_allowed),
        Field("causal", "bool", "causal mask, aligned bottom-right: query i sees key j iff "
              "j <= i + seq_k - seq_q", default=False),
        Field("return_lse", "bool", "also write lse [batch, num_heads, seq_q] (f32, natural log)",
              default=False),
        Field("custom_mask", "str", '"packed": runtime custom_mask bits + mask_indptr, a seq_q x '
              'seq_k bit matrix per batch entry (needs causal = false; f16/bf16), or "none" '
              '(docs/spec.md)', default="none", choices=("none", "packed")),
        *VARIANT_FIELDS,
    ),
    tile=(
        Field("block_m", "int", "query rows per CTA (tensor cores: 16 per warp; 192: the sm_90a "
              "warp-specialised kernel's three consumer warpgroups)", default=None,
              choices=(*_POW2_TILE[:4], 192, _POW2_TILE[4])),
        Field("block_n", "int", "keys per K/V tile", default=None, choices=_POW2_TILE),
        Field("num_warps", "int", "warps per CTA (tensor cores: block_m / 16)", default=None,
              choices=(1, 2, 4, 8, 16)),
        Field("num_stages", "int", "K/V tiles in flight in the cp.async pipeline", default=None,
              choices=(1, 2, 3, 4)),
        Field("warp_rows", "int", "query rows per warp on tensor cores: 16, or 32 as two m16 "
              "tiles sharing each K/V fragment (docs/kernels.md)", default=None, choices=(16, 32)),
        Field("smem_layout", "str", "shared-memory tiles (tensor cores): rows padded to an odd "
              "number of 16-byte chunks, or XOR-swizzled chunks without padding (docs/kernels.md; "
              "default: padded unless only swizzled tiles fit)", default=None,
              choices=("padded", "swizzled")),
        Field("kv_loads", "str", "how the sm_90a wgmma kernel loads Q/K/V tiles: TMA boxes under "
              "mbarriers (tensor-map parameters; the default), or per-thread cp.async "
              "(docs/kernels.md \"Hopper\")", default=None, choices=("tma", "cp_async")),
        Field("warp_specialize", "bool", "sm_90a TMA kernel: one producer warpgroup issues the "
              "loads under full/empty mbarriers, the block_m / 64 consumer warpgroups compute "
              "(setmaxnreg; the default with TMA loads; docs/kernels.md \"Hopper\")", default=None),
        Field("pingpong", "bool", "sm_90a warp-specialised kernel with two consumer warpgroups: "
              "they take turns at issuing their wgmma on named barriers, one's softmax under the "
              "other's products (FlashAttention-3; docs/kernels.md \"Hopper\")", default=False),
        Field("exp2_poly", "int", "sm_100a tcgen05 kernel: of every 8 exponentials of a row, how "
              "many an FMA polynomial computes instead of MUFU.EX2 (FlashAttention-4's trick where "
              "MUFU bounds the softmax; relative error 8.8e-5, below P's rounding; 0: none)",
              default=None, choices=tuple(range(9))),
        Field("correction", "bool", "sm_100a warp-specialised tcgen05 kernel: a correction "
              "warpgroup rescales O in tensor memory when a row's running max grew past the "
              "lazy slack, so the softmax warps never wait for the previous P·V "
              "(FlashAttention-4's; P double-buffered; with q_tiles = 2 it serves both tiles; "
              "docs/kernels.md \"tcgen05\")",
              default=None),
        Field("tma_store", "bool", "sm_90a / sm_100a TMA kernels: O leaves through shared "
              "memory (stmatrix) by TMA stores (one box a 128-byte column slab, clipped at "
              "seq_q) instead of the threads' row stores (FlashAttention-3's epilogue; untimed, "
              "hence off)",
              default=None),
        Field("persistent", "bool", "sm_90a warp-specialised TMA kernel: a grid of one CTA per "
              "resident slot (the persistent_ctas dim: SMs x CTAs per SM, from the device at "
              "launch) whose CTAs take the query tiles in turn; the producer loads the next "
              "tile's Q and K/V during this tile's epilogue (FlashAttention-3's persistent "
              "scheduler; block_m 64 or 128, 32-key tiles at d256; untimed, hence off; "
              "docs/kernels.md \"Persistent CTAs\")", default=None),
        Field("q_tiles", "int", "sm_100a warp-specialised tcgen05 kernel: Q tiles of 128 rows per "
              "CTA sharing each K/V tile (2: FlashAttention-4's two tiles, their softmax warps' "
              "work interleaved on the MMA warp; docs/kernels.md \"tcgen05\")",
              default=None, choices=(1, 2)),
    ),
)


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
            fix = C.path_key_fix(spec.targets, [t for p in takers for t in p.targets])
            raise SpecError(f"{key} = {shown} with dtype {spec.dtype}, head_dim {spec.head_dim}, "
                            f"targets {', '.join(spec.targets)}: only {names} "
                            f"{'takes' if len(takers) == 1 else 'take'} it; {fix}",
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
