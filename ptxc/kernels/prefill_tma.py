"""The sm_90a wgmma prefill's body with its tiles fed by TMA (tile.kv_loads = "tma"): the
tensor-map copies of one elected thread (tma_pipeline.py), or of a producer warpgroup with
tile.warp_specialize = true (tma_ws_pipeline.py). Everything else is prefill_wgmma.py's."""

from __future__ import annotations

from ..ir import S32, Addr, Reg
from .prefill_tile import Ctx
from .prefill_wgmma import ROWS_PER_WARPGROUP, SWIZZLE, WgmmaMath, setup
from .tma_pipeline import run_tma_pipeline
from .tma_ws_pipeline import run_tma_ws_pipeline


def emit_tma_body(b, spec, cfg, tmaps, smem, k_smem, v_smem, tid, lane, warp, head, batch,
                  kv_head, m_start, head_base, strides, ptrs, seq_q, seq_k, key_offset, n_tiles,
                  n_full, first_tile, lo_full, variant):
    """prefill_wgmma.emit_body with the tiles fed by TMA: one box per 128-byte column slab,
    coordinates {64 s, head, row, batch} (innermost first), issued by one elected thread
    (tma_pipeline.py) or by the producer warpgroup (tile.warp_specialize, tma_ws_pipeline.py)."""
    bn, stages = cfg.block_n, cfg.num_stages
    ctx = Ctx(spec, cfg, tid, lane, warp, batch, head, m_start, seq_q, seq_k, key_offset, smem,
              head_base("o", head), strides[("o", 1)], ptrs.get("lse"), variant,
              ptrs.get("sinks"), ptrs.get("alibi_slopes"))
    math = None if cfg.warp_specialize else WgmmaMath(b, ctx)   # (ws: in the consumer branch)
    addr = {t: b.tensor_map_address(tmaps[t]) for t in "qkv"}
    coords = {t: (b.bitcast(head if t == "q" else kv_head, S32), b.bitcast(batch, S32))
              for t in "qkv"}
    slab_cols = SWIZZLE // cfg.fmt.bytes

    def copy_tile(t: str, tile, dst: Reg, bar) -> None:
        if t == "q":
            row0, rows = m_start, cfg.block_m
        else:
            row0, rows = b.mul(tile if first_tile is None else b.add(tile, first_tile), bn), bn
        h, n = coords[t]
        row0 = b.bitcast(row0, S32)
        for s in range(cfg.head_dim // slab_cols):   # slab s: rows x 128 B, 1024-B aligned
            b.tma_load(Addr(dst, s * rows * SWIZZLE), addr[t], [s * slab_cols, h, row0, n], bar)

    def key0_of(j: Reg) -> Reg:
        return b.mul(j if first_tile is None else b.add(j, first_tile), bn)

    if cfg.warp_specialize:
        run_tma_ws_pipeline(
            b, stages=stages, consumers=cfg.block_m // ROWS_PER_WARPGROUP,
            kv_bytes=cfg.kv_geom.bytes, q_bytes=cfg.q_geom.bytes, q_smem=smem, k_smem=k_smem,
            v_smem=v_smem, bars=b.add(k_smem, 2 * stages * cfg.kv_geom.bytes), tid=tid, lane=lane,
            n_tiles=n_tiles, n_full=n_full, key0_of=key0_of, copy_tile=copy_tile,
            make_math=lambda: WgmmaMath(b, ctx), transforms=bool(variant.transforms),
            lo_full=lo_full)
        return
    run_tma_pipeline(b, stages=stages, kv_bytes=cfg.kv_geom.bytes, q_bytes=cfg.q_geom.bytes,
                     q_smem=smem, k_smem=k_smem, v_smem=v_smem,
                     bars=b.add(k_smem, 2 * stages * cfg.kv_geom.bytes),
                     leader=b.setp("eq", tid, 0), n_tiles=n_tiles, n_full=n_full,
                     key0_of=key0_of, copy_tile=copy_tile, math=math, lo_full=lo_full,
                     transform=math.transform if variant.transforms else None)
    math.epilogue()


def emit_tma_prefill(b, spec, cfg, ptrs, strides, seq_q, seq_k, tmaps: dict) -> None:
    """The sm_90a prefill with K/V (and Q) tiles by TMA: prefill_wgmma.setup, then the TMA body
    (warp-specialised or not, as emit_tma_body picks)."""
    s = setup(b, spec, cfg, ptrs, strides, seq_q, seq_k)
    emit_tma_body(b, spec, cfg, tmaps, s.smem, s.k_smem, s.v_smem, s.tid, s.lane, s.warp, s.head,
                  s.batch, s.kv_head, s.m_start, s.head_base, strides, ptrs, seq_q, seq_k, s.key_offset,
                  s.n_tiles, s.n_full, s.first_tile, s.lo_full, s.variant)
