"""Prefill's bodies start here: `setup` (the CTA's place in the dense grid, its tile range and the
shared-memory regions: Q, then the K and V stages), which every prefill body shares, and the
body whose K/V tiles are copied by the threads themselves (cp.async, or plain loads below sm_80)
-- one body for each math, the pieces given by the family's path table:

  portable (every target)  padded or swizzled tiles (`thread_slot`), MmaMath (f16/bf16) or
                           SimtMath (f32), the "cp_async" main loop (kv_pipeline.py), a packed
                           custom mask's tile list first
  sm_90a wgmma             128-byte-swizzled slabs (`swizzled_slot`), WgmmaMath, the "wgmma"
                           main loop (wgmma_pipeline.py; tile.kv_loads = "cp_async")

The TMA body (wgmma and tcgen05) is prefill_tma.py, after the same setup; both end in
assemble.py's `assemble`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...ir import S32, S64, U32, KernelBuilder, Reg
from ...spec.model import KernelSpec
from ..attention.mask_tiles import classify_tiles
from ..attention.prefill_tile import Ctx, cta_coords, tile_range
from ..config.prefill import PrefillConfig
from ..mainloop.tiles import global_rows, load_tile
from .assemble import Buffers, KeyTiles, Loads, assemble, prebuilt


@dataclass(frozen=True)
class Setup:
    """What every prefill body starts from."""

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

    def ctx(self, spec: KernelSpec, cfg: PrefillConfig, ptrs, strides, seq_q, seq_k) -> Ctx:
        """The tile math's context (emits the o row address where it is called)."""
        return Ctx(spec, cfg, self.tid, self.lane, self.warp, self.batch, self.head, self.m_start, seq_q, seq_k,
                   self.key_offset, self.smem, self.head_base("o", self.head), strides[("o", 1)],
                   ptrs.get("lse"), self.variant, ptrs.get("sinks"), ptrs.get("alibi_slopes"))

    def transform_of(self, math):
        """The variant's score transform through `math`'s fragments, or None."""
        return math.transform if self.variant.transforms else None


def setup(b: KernelBuilder, spec: KernelSpec, cfg: PrefillConfig, ptrs, strides, seq_q, seq_k,
          place=None, smem: Reg | None = None) -> Setup:
    """The CTA's place, its tile range and the shared-memory regions (Q, then the K and V stages,
    aligned as the config's tiles need). A persistent CTA gives its work tile's `place`
    (prefill_tile.PersistentTiles) and the `smem` it declared once."""
    tid, lane, warp, head, batch, kv_head, m_start, head_base = cta_coords(b, spec, cfg.cta_rows, ptrs,
                                                                           strides, place)
    key_offset, n_tiles, n_full, first_tile, lo_full, variant = tile_range(
        b, spec, cfg.cta_rows, cfg.block_n, m_start, seq_q, seq_k)
    sq, sk = b.bitcast(seq_q, S32), b.bitcast(seq_k, S32)
    if smem is None:
        smem = b.address_of(b.shared("prefill_smem", 0, align=cfg.smem_align))
    k_smem = b.add(smem, cfg.q_region_bytes)
    v_smem = b.add(k_smem, cfg.num_stages * cfg.kv_geom.bytes)   # then V's stages (then barriers)
    return Setup(tid, lane, warp, head, batch, kv_head, m_start, head_base, key_offset, n_tiles, n_full,
                 first_tile, lo_full, variant, sq, sk, smem, k_smem, v_smem)


def emit_body(b: KernelBuilder, spec: KernelSpec, cfg: PrefillConfig, ptrs, strides, seq_q, seq_k,
              mask_bytes: Reg | None = None, *, slot, math_type, mainloop: str) -> None:
    """Q and the K/V stages copied by every thread into the tiles `slot` lays out (a
    ThreadSlot per geometry), assembled with the main loop `mainloop` ("cp_async" | "wgmma")
    around `math_type`'s tile math, a packed custom mask's tile list first."""
    bn = cfg.block_n
    s = setup(b, spec, cfg, ptrs, strides, seq_q, seq_k)
    n_tiles, first_tile, sk = s.n_tiles, s.first_tile, s.sk
    q_slot, kv_slot = slot(b, cfg.q_geom, s.tid), slot(b, cfg.kv_geom, s.tid)
    slots = {"k": kv_slot, "v": kv_slot if cfg.dv == cfg.head_dim else slot(b, cfg.v_geom, s.tid)}
    gq = global_rows(b, q_slot, s.head_base("q", s.head), strides[("q", 1)])
    gkv = {t: global_rows(b, slots[t], s.head_base(t, s.kv_head), strides[(t, 1)]) for t in "kv"}
    ctx = s.ctx(spec, cfg, ptrs, strides, seq_q, seq_k)
    order = None
    if s.variant.mask is not None:   # packed bits: segment `batch` of custom_mask; the tiles with
        ctx.bind_mask(b, ptrs, s.batch, mask_bytes)   # a bit set, in order (mask_tiles.py)
        order = classify_tiles(b, ctx, tid=s.tid, threads=cfg.threads,
                               region=b.add(s.smem, cfg.mask_list_offset), tok0=s.m_start,
                               n_tok=b.sub(b.min(b.add(s.m_start, cfg.block_m), seq_q), s.m_start),
                               key0=b.mov(0, S32) if first_tile is None else b.bitcast(b.mul(first_tile, bn), S32),
                               n_tiles=n_tiles, n_full=s.n_full, lo_full=s.lo_full, bn=bn)
        n_tiles = order.n_visit
    math = math_type(b, ctx)

    # Each of K and V is loaded tile 0, 1, 2, ... in order, so this thread's global address of
    # the next tile is carried in a register and advanced by one tile's rows per load.
    next_addr = {t: b.mov(b.bitcast(gkv[t].thr_base, S64)) for t in "kv"}
    tile_step = {t: b.mul(gkv[t].row_stride, bn) for t in "kv"}
    if first_tile is not None:
        for t in "kv":
            b.mad(b.cvt(S64, first_tile), tile_step[t], next_addr[t], out=next_addr[t])

    def key0_of(j: Reg) -> Reg:
        rel = j if order is None else order.tile(j)[0]
        return b.mul(rel if first_tile is None else b.add(rel, first_tile), bn)

    def mask_of(j: Reg) -> tuple[Reg, Reg]:   # a packed mask's visit order
        rel, needs = order.tile(j)
        return b.mul(rel if first_tile is None else b.add(rel, first_tile), bn), needs

    def load_kv(t: str, tile: Reg | int, stage_off: Reg | int):
        """K or V tile `tile` (the next one of `t`) into buffer `stage_off` (a byte offset), if
        the tile exists. (A mask's visit order is not in tile order: no carried address.)"""
        tile = tile if isinstance(tile, Reg) else b.mov(tile, U32)
        with b.if_then(b.setp("lt", tile, n_tiles)):
            row0 = key0_of(tile)
            base = b.add(s.k_smem if t == "k" else s.v_smem, stage_off)
            load_tile(b, slots[t], gkv[t], row0, b.sub(sk, b.bitcast(row0, S32)), base, cfg.cp_async,
                      first_addr=next_addr[t] if order is None else None)
        if order is None:
            b.add(next_addr[t], tile_step[t], out=next_addr[t])
        if cfg.cp_async:
            b.cp_async_commit()

    load_tile(b, q_slot, gq, s.m_start, b.sub(s.sq, b.bitcast(s.m_start, S32)), s.smem, cfg.cp_async)
    # (the cp.async loop strides V's stages as K's; the wgmma loop by V's own tile)
    buffers = Buffers(cfg.num_stages, s.smem, s.k_smem, s.v_smem, cfg.kv_geom.bytes,
                      cfg.v_geom.bytes if mainloop == "wgmma" else None)
    assemble(b, mainloop, buffers=buffers,
             tiles=KeyTiles(n_tiles, s.n_full, key0_of, s.lo_full, None if order is None else mask_of),
             loads=Loads(load_kv=load_kv, use_async=cfg.cp_async), math=prebuilt(math),
             transform_of=s.transform_of)
