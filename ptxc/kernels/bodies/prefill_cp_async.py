"""Prefill's portable body (every target; the tensor-core kernel on sm_80..sm_120 and the SIMT
f32 kernel): the cp.async K/V pipeline (kv_pipeline.py) with the mma.sync or SIMT math."""

from __future__ import annotations

from ...ir import S32, S64, U32, KernelBuilder, Reg
from ...spec.model import KernelSpec
from ..attention.mask_tiles import classify_tiles
from ..attention.prefill_tile import Ctx, cta_coords, tile_range
from ..config.prefill import PrefillConfig
from ..mainloop.kv_pipeline import run_kv_pipeline
from ..mainloop.tiles import SWIZZLE_ALIGN, global_rows, load_tile, thread_slot
from ..math.mma import MmaMath
from ..math.simt import SimtMath


def emit_body(b: KernelBuilder, spec: KernelSpec, cfg: PrefillConfig, ptrs, strides, seq_q, seq_k,
               mask_bytes: Reg | None = None):
    """The portable prefill: Q and the K/V stages in padded (or swizzled) tiles copied by
    cp.async (or plain loads), the K/V loop of kv_pipeline.py with MmaMath (f16/bf16) or
    SimtMath (f32), a packed custom mask's tile list first."""
    bm, bn, stages = cfg.block_m, cfg.block_n, cfg.num_stages
    tid, lane, warp, head, batch, kv_head, m_start, head_base = cta_coords(b, spec, bm, ptrs, strides)
    key_offset, n_tiles, n_full, first_tile, lo_full, variant = tile_range(
        b, spec, bm, bn, m_start, seq_q, seq_k)
    sq, sk = b.bitcast(seq_q, S32), b.bitcast(seq_k, S32)

    swizzled = cfg.q_geom.swizzled or cfg.v_geom.swizzled   # their ldmatrix XORs need 128-B tiles
    smem = b.address_of(b.shared("prefill_smem", 0, align=SWIZZLE_ALIGN if swizzled else 16))
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
    order = None
    if variant.mask is not None:   # packed bits: segment `batch` of custom_mask; the tiles with
        ctx.bind_mask(b, ptrs, batch, mask_bytes)   # a bit set, in order (mask_tiles.py)
        order = classify_tiles(b, ctx, tid=tid, threads=cfg.threads, region=b.add(smem, cfg.mask_list_offset),
                               tok0=m_start, n_tok=b.sub(b.min(b.add(m_start, bm), seq_q), m_start),
                               key0=b.mov(0, S32) if first_tile is None else b.bitcast(b.mul(first_tile, bn), S32),
                               n_tiles=n_tiles, n_full=n_full, lo_full=lo_full, bn=bn)
        n_tiles = order.n_visit
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
            base = b.add(k_smem if t == "k" else v_smem, stage_off)
            load_tile(b, slots[t], gkv[t], row0, b.sub(sk, b.bitcast(row0, S32)), base, use_async,
                      first_addr=next_addr[t] if order is None else None)
        if order is None:
            b.add(next_addr[t], tile_step[t], out=next_addr[t])
        commit()

    transform = math.transform if variant.transforms else None
    load_tile(b, q_slot, gq, m_start, b.sub(sq, b.bitcast(m_start, S32)), smem, use_async)
    run_kv_pipeline(b, stages=stages, kv_bytes=kv_bytes, k_smem=k_smem, v_smem=v_smem,
                    use_async=use_async, n_tiles=n_tiles, n_full=n_full,
                    key0_of=key0_of, load_kv=load_kv, math=math, lo_full=lo_full,
                    transform=transform, mask_of=None if order is None else mask_of)
    math.epilogue()
