"""The sm_90a wgmma prefill's bodies start here: the CTA's place, tile range and shared-memory
regions (`setup`), the q/k/v tensor maps of the TMA loads, and the cp.async body
(tile.kv_loads = "cp_async": per-thread copies into the swizzled slabs on wgmma_pipeline.py).
The TMA bodies are prefill_tma.py; the tcgen05 body prefill_tcgen05.py starts from the same
setup. Layout and math: math/wgmma.py."""

from __future__ import annotations

from dataclasses import dataclass

from ...ir import S32, S64, KernelBuilder, Reg
from ...spec.model import KernelSpec
from ..attention.prefill_tile import Ctx, cta_coords, tile_range
from ..config.wgmma import WgmmaConfig
from ..mainloop.tiles import SWIZZLE, SWIZZLE_PERIOD, global_rows, load_tile, swizzled_slot
from ..mainloop.wgmma_pipeline import run_wgmma_pipeline
from ..math.wgmma import WgmmaMath


def tensor_map_params(b: KernelBuilder, spec: KernelSpec, cfg: WgmmaConfig, params: list) -> dict:
    """The q/k/v tensor-map parameters of the TMA loads (appended to `params`): one box is a
    64-element (128-byte) column slab of block_m (Q) or block_n (K, V) rows of one head."""
    from ...ir import TMAP
    from ..base import LaunchParam, ParamSource
    maps = {}
    for t, rows in (("q", cfg.block_m), ("k", cfg.block_n), ("v", cfg.block_n)):
        box = (SWIZZLE // cfg.fmt.bytes, 1, rows, 1)    # innermost first: d, head, seq, batch
        src = ParamSource("tensor_map", tensor=t, box=box, swizzle=SWIZZLE)
        params.append(LaunchParam(f"{t}_tmap", TMAP, src))
        maps[t] = b.param(f"{t}_tmap", TMAP)
    return maps


@dataclass(frozen=True)
class Setup:
    """What both wgmma prefill bodies (cp.async here, TMA in prefill_tma.py) start from."""

    tid: Reg
    lane: Reg
    warp: Reg
    head: Reg
    batch: Reg
    kv_head: Reg
    m_start: Reg
    head_base: object     # (tensor, head) -> u64 address of (batch, head)
    key_offset: Reg
    n_tiles: Reg
    n_full: Reg
    first_tile: Reg | None
    lo_full: Reg | None
    variant: object
    sq: Reg
    sk: Reg
    smem: Reg
    k_smem: Reg
    v_smem: Reg

    def ctx(self, spec: KernelSpec, cfg: WgmmaConfig, ptrs, strides, seq_q, seq_k) -> Ctx:
        """The tile math's context (emits the o row address where it is called)."""
        return Ctx(spec, cfg, self.tid, self.lane, self.warp, self.batch, self.head, self.m_start, seq_q, seq_k,
                   self.key_offset, self.smem, self.head_base("o", self.head), strides[("o", 1)],
                   ptrs.get("lse"), self.variant, ptrs.get("sinks"), ptrs.get("alibi_slopes"))


def setup(b: KernelBuilder, spec: KernelSpec, cfg: WgmmaConfig, ptrs, strides, seq_q, seq_k) -> Setup:
    """The CTA's place, its tile range and the shared-memory regions (Q, then the K and V stages)."""
    tid, lane, warp, head, batch, kv_head, m_start, head_base = cta_coords(b, spec, cfg.block_m, ptrs, strides)
    key_offset, n_tiles, n_full, first_tile, lo_full, variant = tile_range(
        b, spec, cfg.block_m, cfg.block_n, m_start, seq_q, seq_k)
    sq, sk = b.bitcast(seq_q, S32), b.bitcast(seq_k, S32)
    smem = b.address_of(b.shared("prefill_smem", 0, align=SWIZZLE_PERIOD))
    k_smem = b.add(smem, cfg.q_region_bytes)
    v_smem = b.add(k_smem, cfg.num_stages * cfg.kv_geom.bytes)   # then V's stages (then barriers)
    return Setup(tid, lane, warp, head, batch, kv_head, m_start, head_base, key_offset, n_tiles, n_full,
                 first_tile, lo_full, variant, sq, sk, smem, k_smem, v_smem)


def emit_body(b: KernelBuilder, spec: KernelSpec, cfg: WgmmaConfig, ptrs, strides, seq_q, seq_k):
    """prefill.py's body with the swizzled tiles and WgmmaMath (same tile range and masks), K/V
    tiles by per-thread cp.async (tile.kv_loads = "tma" runs prefill_tma.emit_tma_prefill)."""
    bn, stages = cfg.block_n, cfg.num_stages
    s = setup(b, spec, cfg, ptrs, strides, seq_q, seq_k)
    n_tiles, n_full, first_tile, lo_full, variant = s.n_tiles, s.n_full, s.first_tile, s.lo_full, s.variant
    sq, sk, smem, k_smem, v_smem = s.sq, s.sk, s.smem, s.k_smem, s.v_smem
    kv_bytes = cfg.kv_geom.bytes
    q_slot, kv_slot = swizzled_slot(b, cfg.q_geom, s.tid), swizzled_slot(b, cfg.kv_geom, s.tid)
    slots = {"k": kv_slot,
             "v": kv_slot if cfg.dv == cfg.head_dim else swizzled_slot(b, cfg.v_geom, s.tid)}
    gq = global_rows(b, q_slot, s.head_base("q", s.head), strides[("q", 1)])
    gkv = {t: global_rows(b, slots[t], s.head_base(t, s.kv_head), strides[(t, 1)]) for t in "kv"}
    math = WgmmaMath(b, s.ctx(spec, cfg, ptrs, strides, seq_q, seq_k))

    next_addr = {t: b.mov(b.bitcast(gkv[t].thr_base, S64)) for t in "kv"}
    tile_step = {t: b.mul(gkv[t].row_stride, bn) for t in "kv"}
    if first_tile is not None:
        for t in "kv":
            b.mad(b.cvt(S64, first_tile), tile_step[t], next_addr[t], out=next_addr[t])

    def load_kv(t: str, tile: Reg, stage_off):
        with b.if_then(b.setp("lt", tile, n_tiles)):
            row0 = b.mul(tile if first_tile is None else b.add(tile, first_tile), bn)
            base = b.add(k_smem if t == "k" else v_smem, stage_off)
            load_tile(b, slots[t], gkv[t], row0, b.sub(sk, b.bitcast(row0, S32)), base, True,
                      first_addr=next_addr[t])
        b.add(next_addr[t], tile_step[t], out=next_addr[t])
        b.cp_async_commit()

    def key0_of(j: Reg) -> Reg:
        return b.mul(j if first_tile is None else b.add(j, first_tile), bn)

    load_tile(b, q_slot, gq, s.m_start, b.sub(sq, b.bitcast(s.m_start, S32)), smem, True)
    run_wgmma_pipeline(b, stages=stages, kv_bytes=kv_bytes, v_bytes=cfg.v_geom.bytes, k_smem=k_smem,
                       v_smem=v_smem, n_tiles=n_tiles, n_full=n_full, key0_of=key0_of, load_kv=load_kv,
                       math=math, lo_full=lo_full,
                       transform=math.transform if variant.transforms else None)
    math.epilogue()
