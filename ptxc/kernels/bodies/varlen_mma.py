"""The GQA-packed query tile on mma.sync: varlen's, decode's tensor-core path's and MLA's body
on every tensor-core target (sm_80+), over the cp.async K/V pipeline (kv_pipeline.py) -- plain,
paged with page ids a tile ahead, sparse slots, FP8 bytes staged and dequantised, or latent rows
(one tile per stage for both products). What the tile works on comes from a scheduler
(varlen_attend.py, decode_mma.py) as a TileWork."""

from __future__ import annotations

from ...ir import S32, S64, KernelBuilder, Reg
from ..attention.packed_tile import TileWork, packed_tile_setup
from ..attention.varlen_tile import VarlenMath, score_transform
from ..config.prefill import PrefillConfig
from ..kv.kv_access import KVAccess
from ..kv.kv_fp8 import stage_rows_dequant
from ..kv.kv_fp8_stage import FP8Staging, StagedFP8Config
from ..kv.kv_pages import PagedTiles, SparseSlots, prefetch_applies
from ..mainloop.tiles import load_tile_rows, thread_slot
from .assemble import Buffers, KeyTiles, Loads, assemble, prebuilt


def emit_mma_tile(b: KernelBuilder, spec, cfg: PrefillConfig, kv: KVAccess, ptrs: dict,
                  strides: dict, work: TileWork, split_count: Reg | None, quant=None,
                  mask_bytes: Reg | None = None) -> None:
    """The GQA-packed query tile on mma.sync (every tensor-core target): one (sequence, KV
    head, split) over its keys [0, L), L = seq_lens[seq] clamped.
    With `quant` (kv_fp8.KVDequant) the cache holds FP8 bytes: with a StagedFP8Config they
    travel by cp.async through the pipeline and are dequantised into f16/bf16 tiles after their
    wait (kv_fp8_stage.py); otherwise (head dims not a multiple of 16) a dequantising copy
    (kv_fp8.stage_rows_dequant: FP8 bytes -> registers -> exact f16/bf16 -> st.shared) stages
    them. Either way the tile math is unchanged; k_scale joins the softmax scale
    (MmaMath.scale_log2 becomes a register) and v_scale the final 1/l.
    The wgmma and tcgen05 tiles are varlen_wgmma.py's and varlen_tma.py's bodies
    (packed_paths.py picks)."""
    bn, stages = cfg.block_n, cfg.num_stages
    tile = packed_tile_setup(b, spec, cfg, kv, ptrs, work, split_count, mask_bytes=mask_bytes)
    ctx, L, first = tile.ctx, tile.L, tile.first
    n_tiles = tile.n_tiles if tile.order is None else tile.order.n_visit
    smem, k_smem, v_smem, m_start, rows = tile.smem, tile.k_smem, tile.v_smem, ctx.m_start, ctx.seq_q
    tid, seq, kv_head = ctx.tid, work.seq, work.kv_head
    kv_bytes = cfg.kv_geom.bytes
    staging = None
    if isinstance(cfg, StagedFP8Config):   # FP8 bytes through the pipeline (kv_fp8_stage.py)
        staging = FP8Staging(b, cfg, tid, k_smem, quant)
        kv_bytes, k_smem, v_smem = staging.stage_bytes, staging.k_stage, staging.v_stage

    q_slot = thread_slot(b, cfg.q_geom, tid)
    kv_slot = thread_slot(b, cfg.kv_geom, tid) if staging is None else staging.slots["k_cache"]
    q_row = tile.q_row(ptrs, strides, b.cvt(S64, q_slot.col))

    def chunk_col(slot):   # FP8 caches hold a byte per element (staged: slots of FP8 rows)
        return slot.col if quant is None or staging is not None else b.shr(slot.col, 1)
    bases = kv.bases(b, ptrs, seq, kv_head, b.cvt(S64, chunk_col(kv_slot)))
    slots = {"k_cache": kv_slot, "v_cache": kv_slot}
    if cfg.dv != cfg.head_dim and not cfg.shared_kv:   # head_dim_v: V rows are narrower, so a thread's chunk differs
        slots["v_cache"] = thread_slot(b, cfg.v_geom, tid) if staging is None else staging.slots["v_cache"]
        bases["v_cache"] = kv.bases(b, ptrs, seq, kv_head, b.cvt(S64, chunk_col(slots["v_cache"])))["v_cache"]

    # Paged caches: a tile's few page ids are loaded with the previous tile (kv_pages.py)
    pages = None
    # (a latent cache issues K tiles only, in order; a mask's visit order is not in order)
    if (quant is None or staging is not None) and (cfg.dv == cfg.head_dim or cfg.shared_kv) and \
            prefetch_applies(kv, kv_slot, bn) and tile.order is None:
        pages = PagedTiles(b, kv, bases, kv_slot, bn, L)

    key_lo = tile.key_lo()   # a sliding window: keys no row of the tile sees are zero-filled
    sparse = None            # sparse top-k: the slots of the next tile parked in shared memory
    if cfg.slot_ring:
        assert cfg.shared_kv and key_lo is None and tile.order is None
        words = ctx.mask_from_valid_words(b, smem)    # the copies' valid rows mask the scores
        sparse = SparseSlots(b, kv, bases, kv_slot, bn, L, b.add(smem, cfg.slot_ring_offset), tid,
                             stages - 1, tile.key0, words)

    def load_kv(t: str, j: Reg, stage_off: Reg | int) -> None:
        with b.if_then(b.setp("lt", j, n_tiles)):
            row0 = tile.key0(j)
            dst = b.add(k_smem if t == "k" else v_smem, stage_off)
            cache = "k_cache" if t == "k" else "v_cache"
            rows_of = tile.kv_rows(kv, bases, cache, key_lo)
            if pages is not None:
                pages.issue(cache, row0, b.sub(L, b.bitcast(row0, S32)), dst, key_lo)
            elif sparse is not None:
                sparse.issue(cache, j, b.sub(L, b.bitcast(row0, S32)), dst, rows_of)
            elif quant is None or staging is not None:
                load_tile_rows(b, slots[cache], rows_of, row0, b.sub(L, b.bitcast(row0, S32)), dst, True)
            else:
                stage_rows_dequant(b, slots[cache], rows_of, row0, b.sub(L, b.bitcast(row0, S32)), dst,
                                   quant, cfg.math_pair)
        b.cp_async_commit()

    load_tile_rows(b, q_slot, q_row, m_start, b.sub(b.bitcast(rows, S32), b.bitcast(m_start, S32)),
                   smem, True)
    if pages is not None:
        pages.load_ahead(b.mul(first, bn))
    math = VarlenMath(b, ctx, ptrs, strides)
    if quant is not None and quant.mode != "group":   # group scales: applied in the staging
        k_scale, math.v_scale = quant.scales(b, kv_head)
        if staging is not None and staging.factor != 1.0:   # tiles of the values times factor
            k_scale, math.v_scale = (b.mul(x, 1.0 / staging.factor) for x in (k_scale, math.v_scale))
        math.fold_k_scale(k_scale)
    assemble(b, "latent" if cfg.shared_kv else "cp_async",   # MLA: one latent tile per stage
             buffers=Buffers(stages, smem, k_smem, v_smem, kv_bytes),
             tiles=KeyTiles(n_tiles, tile.n_full, tile.key0, tile.lo_full,
                            None if tile.order is None else tile.mask_of),   # a packed mask's tiles
             loads=Loads(load_kv=load_kv, landed=None if staging is None else staging.landed,
                         scores_from=staging.staged if staging is not None and cfg.qk_staged else None,
                         # f16 products over a bf16 Q: its rows rescaled into f16 first (or
                         # rounded to e4m3 values: qk_products)
                         q_landed=math.q_rewrite(quant.target) if quant is not None else None),
             math=prebuilt(math), transform_of=lambda m: score_transform(b, spec, m))
