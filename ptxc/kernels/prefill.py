"""Family "prefill": FlashAttention-2 forward over whole sequences (causal or not, GQA, LSE).

One CTA per (block of `block_m` query rows, query head, batch). The CTA stages its Q tile and a
pipeline of `num_stages` K/V tiles of `block_n` keys in shared memory and runs the online
softmax over the KV tiles; causal CTAs stop at the last tile their last query row can see and
mask only the tiles that cross the diagonal or the end of the keys. The math per tile is either
tensor cores (f16/bf16, `prefill_mma.py`) or SIMT FMA (f32, `prefill_simt.py`); see
docs/kernels.md for the layouts and the pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import SpecError
from ..ir import F32, S32, S64, U32, U64, Addr, KernelBuilder, Reg
from ..spec.fields import Field, FamilyFields, int_range
from ..spec.model import KernelSpec
from ..targets import KIB, MAX_REGS_PER_THREAD, TARGETS, Target
from . import common as C
from .base import Family, Interface, Launch, LaunchParam, ParamSource, Program, TensorInfo
from .kv_pipeline import run_kv_pipeline
from .tiles import TileGeom, global_rows, load_tile, thread_slot
from .variant import (VARIANT_FIELDS, AttentionVariant, finish_rows, head_dim_v, load_head_f32,
                      validate_variant, variant_inputs,
                      variant_reference_args, variant_tensors)

_hd_check, _hd_allowed = int_range(8, 512, multiple_of=8)
MAX_SIMT_HEAD_DIM = 256   # f32 path: a 2 KiB row would not fit Q + K/V tiles in shared memory
_POW2_TILE = (16, 32, 64, 128, 256)
FIELDS = FamilyFields(
    fields=(
        Field("head_dim", "int", "elements per head", check=_hd_check, allowed=_hd_allowed),
        Field("causal", "bool", "causal mask, aligned bottom-right: query i sees key j iff "
              "j <= i + seq_k - seq_q", default=False),
        Field("return_lse", "bool", "also write lse [batch, num_heads, seq_q] (f32, natural log)",
              default=False),
        *VARIANT_FIELDS,
    ),
    tile=(
        Field("block_m", "int", "query rows per CTA (tensor cores: 16 per warp)", default=None,
              choices=_POW2_TILE),
        Field("block_n", "int", "keys per K/V tile", default=None, choices=_POW2_TILE),
        Field("num_warps", "int", "warps per CTA (tensor cores: block_m / 16)", default=None,
              choices=(1, 2, 4, 8, 16)),
        Field("num_stages", "int", "K/V tiles in flight in the cp.async pipeline", default=None,
              choices=(1, 2, 3, 4)),
    ),
)
SIMT_LANES_PER_ROW = 8    # f32 path: lanes sharing a query row (its keys and its head_dim chunks)
REG_OVERHEAD = 40         # addresses, loop state, softmax temporaries (register estimate)


@dataclass(frozen=True)
class PrefillConfig:
    fmt: C.ElemFormat
    head_dim: int
    tensor_cores: bool
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    cp_async: bool
    head_dim_v: int = 0      # V/O head size; 0: head_dim
    v_split: int = 1         # warps sharing 16 query rows, each owning dv / v_split O columns

    @property
    def dv(self) -> int:
        return self.head_dim_v or self.head_dim

    @property
    def v_geom(self) -> TileGeom:
        """V tiles (block_n x head_dim_v), in stage buffers sized for K (head_dim_v <= head_dim)."""
        return TileGeom(self.block_n, self.dv * self.fmt.bytes, self.threads)

    @property
    def o_geom(self) -> TileGeom:
        """The output tile staged in the Q tile's shared memory (block_m x head_dim_v)."""
        return TileGeom(self.block_m, self.dv * self.fmt.bytes, self.threads)

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def q_geom(self) -> TileGeom:
        return TileGeom(self.block_m, self.head_dim * self.fmt.bytes, self.threads)

    @property
    def kv_geom(self) -> TileGeom:
        return TileGeom(self.block_n, self.head_dim * self.fmt.bytes, self.threads)

    @property
    def smem_bytes(self) -> int:
        return self.q_geom.bytes + 2 * self.num_stages * self.kv_geom.bytes

    @property
    def rows_per_thread(self) -> int:
        """f32 path: query rows per lane (a warp holds 32 / SIMT_LANES_PER_ROW row groups)."""
        return self.block_m // (self.num_warps * 32 // SIMT_LANES_PER_ROW)

    @property
    def registers_estimate(self) -> int:
        if self.tensor_cores:   # O and S accumulators: 16 x head_dim and 16 x block_n f32 per warp
            return self.dv // 2 // self.v_split + self.block_n // 2 + REG_OVERHEAD
        chunks = -(-self.dv // 4 // SIMT_LANES_PER_ROW)
        tm = self.rows_per_thread
        return tm * chunks * 4 + tm * self.block_n // SIMT_LANES_PER_ROW + REG_OVERHEAD


def validate(spec: KernelSpec) -> None:
    C.check_dtype_target(spec.dtype, spec.targets)
    validate_variant(spec)
    if spec.dtype == "f32" and spec.head_dim > MAX_SIMT_HEAD_DIM:
        raise SpecError(f"head_dim = {spec.head_dim} with dtype f32: the SIMT path supports "
                        f"head_dim up to {MAX_SIMT_HEAD_DIM}; use f16 or bf16", key="head_dim")
    if spec.dtype != "f32":
        old = [t for t in spec.targets if not TARGETS[t].has_mma_m16n8k16]
        if old:
            raise SpecError(f"dtype {spec.dtype} prefill uses mma.m16n8k16 and cp.async (sm_80+), "
                            f"but targets include {old[0]}; use dtype f32 for {old[0]} or drop it",
                            key="targets")
    from .prefill_wgmma import configure as configure_wgmma, uses_wgmma
    for t in spec.targets:
        (configure_wgmma if uses_wgmma(spec, TARGETS[t]) else configure)(spec, TARGETS[t])


def _defaults(spec: KernelSpec, target: Target, tc: bool) -> tuple[int, int, int]:
    """(block_m, block_n, num_stages) before the shared-memory fit (docs/kernels.md)."""
    d, smem = spec.head_dim, target.max_smem_per_cta
    if not tc:
        return 32, 32, 1
    large, medium = smem >= 200 * KIB, smem >= 160 * KIB      # sm_90/sm_100, sm_80/sm_87
    if d > 256:    # 4 warps per 16 rows (value_split); the same block on every target
        return 16, 32, 2 if smem >= 160 * KIB else 1
    if d <= 128:   # d64 with block_n 128 took ~140 registers (1 CTA/SM); 64 keeps <= 128 (2)
        bm, bn = 128, 64
    else:
        bm, bn = (128 if large else 64), 64
    stages = (3 if d <= 128 else 2) if large else 2 if medium else 1
    return bm, bn, stages


def _warps_for(bm: int, tc: bool, v_split: int = 1) -> int:
    return bm // 16 * v_split if tc else max(1, min(8, bm // 8))


def value_split(dv: int, tc: bool) -> int:
    """Warps that share a 16-row query slice, each accumulating dv / v_split columns of O: 1
    up to head_dim_v 256; above, 4 (a 16 x 512 f32 accumulator would need 256 registers per
    thread; 16 x 128 needs 64). The scores and softmax are computed by each of them alike."""
    return 4 if tc and dv > 256 else 1


def configure(spec: KernelSpec, target: Target) -> PrefillConfig:
    tc = spec.dtype != "f32"
    given = spec.tile_dict()
    bm, bn, stages = _defaults(spec, target, tc)
    # A tile `ptxc tune` measured on this target replaces the heuristic's defaults (it may
    # still shrink to fit below); keys the spec gives win over both.
    tuned = C.tuned_tile("prefill", spec, target, ("block_m", "block_n", "num_stages", "num_warps"),
                         causal=spec.opt("causal"))
    bm, bn, stages = tuned.get("block_m", bm), tuned.get("block_n", bn), tuned.get("num_stages", stages)
    bm, bn, stages = given.get("block_m", bm), given.get("block_n", bn), given.get("num_stages", stages)
    vsplit = value_split(head_dim_v(spec), tc)
    if "num_warps" in given and "block_m" not in given:
        bm = 16 * given["num_warps"] // vsplit if tc else 8 * given["num_warps"]
    tuned_warps = tuned.get("num_warps") if bm == tuned.get("block_m") else None
    warps = given.get("num_warps") or tuned_warps or _warps_for(bm, tc, vsplit)

    def make():
        return PrefillConfig(C.FORMATS[spec.dtype], spec.head_dim, tc, bm, bn, warps, stages,
                             target.has_cp_async, head_dim_v(spec), vsplit)

    cfg = make()
    while cfg.smem_bytes > target.max_smem_per_cta:   # shrink what the spec left to us
        if "num_stages" not in given and stages > 1:
            stages -= 1
        elif "block_n" not in given and bn > 16:
            bn //= 2
        elif "block_m" not in given and "num_warps" not in given and bm > 16:
            bm //= 2
            warps = _warps_for(bm, tc, vsplit)
        else:
            key = next((k for k in ("block_n", "num_stages", "block_m", "num_warps") if k in given),
                       "block_n")
            raise SpecError(f"tile block_m={bm}, block_n={bn}, num_stages={stages} needs "
                            f"{cfg.smem_bytes} bytes of shared memory (Q {cfg.q_geom.bytes} + "
                            f"{stages} x K/V {2 * cfg.kv_geom.bytes}); {target} allows "
                            f"{target.max_smem_per_cta} per CTA: use a smaller tile", key=f"tile.{key}")
        cfg = make()
    _check_shape(cfg, target)
    return cfg


def _check_shape(cfg: PrefillConfig, target: Target) -> None:
    if cfg.tensor_cores and cfg.block_m * cfg.v_split != 16 * cfg.num_warps:
        split = f" / {cfg.v_split} (head_dim_v {cfg.dv}: {cfg.v_split} warps share 16 rows)" \
            if cfg.v_split > 1 else ""
        raise SpecError(f"block_m = {cfg.block_m} with num_warps = {cfg.num_warps}: on tensor cores "
                        f"each warp owns 16 query rows, so block_m must be 16 * num_warps{split}",
                        key="tile.block_m")
    if not cfg.tensor_cores and (cfg.block_m % (4 * cfg.num_warps) or cfg.rows_per_thread > 8):
        raise SpecError(f"block_m = {cfg.block_m} with num_warps = {cfg.num_warps}: the f32 path "
                        f"needs block_m = 4 * num_warps * r with r in 1..8 rows per lane",
                        key="tile.block_m")
    if cfg.q_geom.chunks > cfg.threads:
        raise SpecError(f"num_warps = {cfg.num_warps}: a {cfg.q_geom.row_bytes}-byte row needs at "
                        f"least {cfg.q_geom.chunks} threads to copy; use more warps",
                        key="tile.num_warps")
    if cfg.registers_estimate > MAX_REGS_PER_THREAD:
        raise SpecError(f"block_m = {cfg.block_m}, block_n = {cfg.block_n} needs about "
                        f"{cfg.registers_estimate} registers per thread for head_dim "
                        f"{cfg.head_dim} (limit {MAX_REGS_PER_THREAD} on {target}); use a smaller "
                        f"tile", key="tile.block_n")


def resolve_tile(spec: KernelSpec, target: Target) -> dict:
    from . import prefill_wgmma as wg
    if wg.uses_wgmma(spec, target):
        return wg.resolve_tile(spec, target)
    c = configure(spec, target)
    return {"block_m": c.block_m, "block_n": c.block_n, "num_warps": c.num_warps,
            "num_stages": c.num_stages, "path": "mma.m16n8k16" if c.tensor_cores else "simt",
            "cp_async": c.cp_async, "smem_row_stride": c.q_geom.stride, "smem_bytes": c.smem_bytes,
            **({"value_split": c.v_split} if c.v_split > 1 else {})}


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
    return Interface(tuple(tensors), ("batch", "seq_q", "seq_k"),
                     {"batch": 2, "seq_q": 17, "seq_k": 113})


@dataclass
class Ctx:
    """Per-CTA values the tile math needs (all u32 unless noted)."""

    spec: KernelSpec
    cfg: PrefillConfig
    tid: Reg
    lane: Reg
    warp: Reg
    batch: Reg
    head: Reg
    m_start: Reg
    seq_q: Reg
    seq_k: Reg
    key_offset: Reg       # s32: seq_k - seq_q (bottom-right causal alignment)
    q_smem: Reg
    o_base: Reg           # u64: o[batch, 0, head, 0]
    o_row_stride: Reg     # s64 bytes
    lse: Reg | None       # u64 or None
    variant: AttentionVariant
    sinks: Reg | None = None    # u64 sinks [num_heads] f32 (attention_sinks)
    slopes: Reg | None = None   # u64 alibi_slopes [num_heads] f32 (alibi)

    def key_limit(self, b: KernelBuilder, row: Reg) -> Reg:
        """s32 number of keys query `row` sees (before clamping to >= 0)."""
        sk = b.bitcast(self.seq_k, S32)
        if not self.spec.opt("causal"):
            return sk
        return b.min(sk, b.add(b.add(b.bitcast(row, S32), self.key_offset), 1))

    def key_begin(self, b: KernelBuilder, row: Reg) -> Reg | None:
        """s32 first key query `row` sees (sliding window), or None."""
        if self.variant.window is None:
            return None
        return self.variant.key_begin(b, b.add(b.bitcast(row, S32), self.key_offset))

    def sink_log2(self, b: KernelBuilder, row: Reg) -> Reg | None:
        """The row's sink logit in log2 units (attention_sinks), or None."""
        if self.sinks is None:
            return None
        return b.mul(load_head_f32(b, self.sinks, self.head), C.LOG2E)

    def alibi_row(self, b: KernelBuilder, row: Reg, lane_key: Reg, unit: float) -> tuple[Reg, Reg]:
        """(p - lane_key (s32), -unit · slope) of query `row` for variant.transform_scores."""
        pos = b.add(b.bitcast(row, S32), self.key_offset)
        return b.sub(pos, lane_key), b.mul(load_head_f32(b, self.slopes, self.head), -unit)

    def lse_addr(self, b: KernelBuilder, row: Reg) -> Reg:
        bh = b.mad(self.batch, self.spec.num_heads, self.head)
        idx = b.add(b.mul_wide(bh, self.seq_q), b.cvt(U64, row))
        return b.add(self.lse, b.shl(idx, 2))


def build(spec: KernelSpec, target: Target) -> Program:
    from . import prefill_wgmma as wg
    wgmma = wg.uses_wgmma(spec, target)     # sm_90a f16/bf16 d64/128/256: prefill_wgmma.py
    cfg = (wg.configure if wgmma else configure)(spec, target)
    b = KernelBuilder(f"ptxc_{spec.name}")
    params: list[LaunchParam] = []

    def param(name, type, source):
        params.append(LaunchParam(name, type, source))
        return b.load_param(b.param(name, type))

    ptrs = {t.name: b.to_global(param(t.name, U64, ParamSource("pointer", tensor=t.name)))
            for t in interface(spec).tensors}
    strides = {(t, a): C.byte_stride(b, param(f"{t}_stride{a}", S64, ParamSource("stride", t, a)), cfg.fmt)
               for t in "qkvo" for a in (0, 1, 2)}
    seq_q = param("seq_q", U32, ParamSource("dim", name="seq_q"))
    seq_k = param("seq_k", U32, ParamSource("dim", name="seq_k"))
    (wg.emit_body if wgmma else _emit_body)(b, spec, cfg, ptrs, strides, seq_q, seq_k)
    b.ret()
    launch = Launch(entry=b.entry.name, params=tuple(params),
                    grid=(f"cdiv(seq_q, {cfg.block_m})", str(spec.num_heads), "batch"),
                    block=(cfg.threads, 1, 1), dynamic_smem_bytes=cfg.smem_bytes)
    return Program([b.entry], [launch], resolve_tile(spec, target))


def _emit_body(b: KernelBuilder, spec: KernelSpec, cfg: PrefillConfig, ptrs, strides, seq_q, seq_k):
    from .prefill_mma import MmaMath
    from .prefill_simt import SimtMath
    bm, bn, stages = cfg.block_m, cfg.block_n, cfg.num_stages
    tid = b.special("%tid.x")
    lane, warp = b.and_(tid, 31), b.shr(tid, 5)
    m_blk, head, batch = b.special("%ctaid.x"), b.special("%ctaid.y"), b.special("%ctaid.z")
    kv_head = b.div(head, spec.group_size) if spec.group_size > 1 else head
    m_start = b.mul(m_blk, bm)

    def head_base(t: str, h: Reg) -> Reg:
        base = b.bitcast(C.element_offset(b, ptrs[t], batch, strides[(t, 0)]), U64)
        return b.bitcast(C.element_offset(b, base, h, strides[(t, 2)]), U64)

    # KV tiles [0, n_tiles) are visited; tiles >= n_full need the mask (seq_k end or diagonal).
    sq, sk = b.bitcast(seq_q, S32), b.bitcast(seq_k, S32)
    key_offset = b.sub(sk, sq)
    if spec.opt("causal"):
        last_row = b.sub(b.min(b.add(m_start, bm), seq_q), 1)
        visible = b.add(b.add(b.bitcast(last_row, S32), key_offset), 1)
        full = b.add(b.add(b.bitcast(m_start, S32), key_offset), 1)
        visible, full = (b.bitcast(b.min(b.max(x, 0), sk), U32) for x in (visible, full))
    else:
        visible = full = seq_k
    n_tiles, n_full = b.div(b.add(visible, bn - 1), bn), b.div(full, bn)
    # A sliding window starts the loop at the first tile the first row sees (earlier tiles are
    # never read) and masks the tiles before the first one wholly inside the last row's window.
    variant = AttentionVariant.from_spec(spec)
    first_tile = lo_full = None
    if variant.window is not None:
        first_tile = variant.first_tile(b, b.add(b.bitcast(m_start, S32), key_offset), bn)
        lo_full = variant.first_unmasked_tile(b, b.add(b.bitcast(last_row, S32), key_offset), bn)
        n_tiles = b.sub(b.max(n_tiles, first_tile), first_tile)
        n_full = b.sub(b.max(n_full, first_tile), first_tile)
        lo_full = b.sub(b.max(lo_full, first_tile), first_tile)

    smem = b.address_of(b.shared("prefill_smem", 0))
    kv_bytes = cfg.kv_geom.bytes
    k_smem = b.add(smem, cfg.q_geom.bytes)
    v_smem = b.add(k_smem, stages * kv_bytes)
    q_slot, kv_slot = thread_slot(b, cfg.q_geom, tid), thread_slot(b, cfg.kv_geom, tid)
    slots = {"k": kv_slot, "v": kv_slot if cfg.dv == cfg.head_dim else thread_slot(b, cfg.v_geom, tid)}
    gq = global_rows(b, q_slot, head_base("q", head), strides[("q", 1)])
    gkv = {t: global_rows(b, slots[t], head_base(t, kv_head), strides[(t, 1)]) for t in "kv"}
    ctx = Ctx(spec, cfg, tid, lane, warp, batch, head, m_start, seq_q, seq_k, key_offset, smem,
              head_base("o", head), strides[("o", 1)], ptrs.get("lse"), variant,
              ptrs.get("sinks"), ptrs.get("alibi_slopes"))
    math = (MmaMath if cfg.tensor_cores else SimtMath)(b, ctx)
    use_async = cfg.cp_async

    def commit():
        if use_async:
            b.cp_async_commit()

    # Each of K and V is loaded tile 0, 1, 2, ... in order, so this thread's global address of
    # the next tile is carried in a register and advanced by one tile's rows per load.
    next_addr = {t: b.mov(b.bitcast(gkv[t].thr_base, S64)) for t in "kv"}
    tile_step = {t: b.mul(gkv[t].row_stride, bn) for t in "kv"}
    if first_tile is not None:
        for t in "kv":
            b.mad(b.cvt(S64, first_tile), tile_step[t], next_addr[t], out=next_addr[t])

    def load_kv(t: str, tile: Reg | int, stage_off: Reg | int):
        """K or V tile `tile` (the next one of `t`) into buffer `stage_off` (a byte offset), if
        the tile exists."""
        tile = tile if isinstance(tile, Reg) else b.mov(tile, U32)
        with b.if_then(b.setp("lt", tile, n_tiles)):
            row0 = b.mul(tile if first_tile is None else b.add(tile, first_tile), bn)
            base = b.add(k_smem if t == "k" else v_smem, stage_off)
            load_tile(b, slots[t], gkv[t], row0, b.sub(sk, b.bitcast(row0, S32)), base, use_async,
                      first_addr=next_addr[t])
        b.add(next_addr[t], tile_step[t], out=next_addr[t])
        commit()

    def key0_of(j: Reg) -> Reg:
        return b.mul(j if first_tile is None else b.add(j, first_tile), bn)

    transform = math.transform if variant.transforms else None
    load_tile(b, q_slot, gq, m_start, b.sub(sq, b.bitcast(m_start, S32)), smem, use_async)
    run_kv_pipeline(b, stages=stages, kv_bytes=kv_bytes, k_smem=k_smem, v_smem=v_smem,
                    use_async=use_async, n_tiles=n_tiles, n_full=n_full,
                    key0_of=key0_of, load_kv=load_kv, math=math, lo_full=lo_full,
                    transform=transform)
    math.epilogue()


def make_inputs(spec: KernelSpec, dims: dict[str, int], rng) -> dict:
    """Random q/k/v in BSHD layout, already representable in the dtype."""
    import numpy as np

    from ..runtime.reference import round_to
    B, Sq, Sk = dims["batch"], dims["seq_q"], dims["seq_k"]
    H, Hk, d, dv = spec.num_heads, spec.num_kv_heads, spec.head_dim, head_dim_v(spec)
    q, k, v = (round_to(rng.standard_normal(shape), spec.dtype).astype(np.float32)
               for shape in ((B, Sq, H, d), (B, Sk, Hk, d), (B, Sk, Hk, dv)))
    return {"q": q, "k": k, "v": v, **variant_inputs(spec, rng)}


def reference(spec: KernelSpec, inputs: dict, dtype: str | None = None) -> dict:
    """fp64 (or naive same-dtype) outputs for BSHD inputs: o BSHD, lse [batch, heads, seq_q]."""
    import numpy as np

    from ..runtime import reference as ref
    q, k, v = (np.swapaxes(np.asarray(inputs[t]), 1, 2) for t in "qkv")
    o, lse = ref.attention(q, k, v, spec.softmax_scale, causal=spec.opt("causal"), dtype=dtype,
                           **variant_reference_args(spec, inputs))
    o = np.swapaxes(o, 1, 2)
    return {"o": o, "lse": lse} if spec.opt("return_lse") else {"o": o}


FAMILY = Family(name="prefill", doc=__doc__.split("\n")[0], fields=FIELDS, validate=validate,
                interface=interface, build=build, resolve_tile=resolve_tile,
                make_inputs=make_inputs, reference=reference,
                row_sum_dtype=lambda spec: None if spec.dtype == "f32" else spec.dtype)
