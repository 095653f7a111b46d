"""The varlen kernel body: one CTA = one packed query tile of one (sequence, KV head, split).

Work assignment is a policy in front of the shared body (emit_packed_tile, given a TileWork;
the tile's context and setup live in packed_tile.py, shared with varlen_wgmma.py's sm_90a body):
varlen's grid.x counts packed query tiles over the whole batch; sequence b's tiles start at
cu[b] * g // block_m + b, so a CTA finds its sequence by a binary search of cu_seqlens_q
(find_sequence) and at most `batch` tiles in all find no rows and exit. decode's tensor-core
path (decode_mma.py) gives one token per sequence straight from the grid instead.

Packed rows: row R of a sequence's query block is token R / g, query head kv_head * g + R % g
(g = group size), so a tile of block_m rows covers block_m / g tokens of all g heads and every
K/V tile it loads serves all of them. Per CTA:

    q_len, L      from cu_seqlens_q (clamped into [0, total_q]) and seq_lens (clamped to the
                  cache capacity); a tile whose first row is >= q_len * g exits at once
    tile range    keys visible to the tile's last token (variant.key_end) give the tiles to
                  visit; those visible to its first token, the tiles that need no mask; a split
                  takes an even share of the visited tiles
    Q tile        GQA-packed rows through load_tile_rows (strided per token and per head)
    K/V tiles     rows through KVAccess.row_address (the decode family's per-layout addressing:
                  page-table lookups guarded by row < L and page ids checked against num_pages)
    math          prefill's MmaMath (ldmatrix + mma.m16n8k16 + online softmax) and the shared
                  K/V pipeline (kv_pipeline.py), with this family's key limit per packed row
    epilogue      1/l per row (prefill.finish_rows), stores straight from the accumulators: o
                  in the dtype, or f32 o_part + log2 lse_part for split_reduce.py
"""

from __future__ import annotations

from ...ir import S32, S64, U32, Addr, KernelBuilder, Reg
from .. import common as C
from ..attention.packed_tile import TileWork, packed_tile_setup
from ..attention.varlen_tile import VarlenMath, WgmmaTileConfig, score_transform
from ..config.prefill import PrefillConfig
from ..kv.kv_access import KVAccess
from ..kv.kv_fp8 import stage_rows_dequant
from ..kv.kv_fp8_stage import FP8Staging, StagedFP8Config
from ..kv.kv_pages import PagedTiles, SparseSlots, prefetch_applies
from ..mainloop.kv_pipeline import run_kv_pipeline, run_shared_kv_pipeline
from ..mainloop.tiles import load_tile_rows, thread_slot


SEARCH_STEPS = 31   # bits of the sequence index the binary search resolves (any u32 batch)


def tile_start(b: KernelBuilder, cu_ptr: Reg, seq: Reg, g: int, bm: int, total_q: Reg) -> Reg:
    """u32 first packed tile of sequence `seq`: cu[seq] * g // block_m + seq (cu clamped to
    [0, total_q]). Non-decreasing in seq, and sequence seq's tiles fit before seq + 1's."""
    t0 = _token(b, cu_ptr, seq, 0, total_q)
    return b.add(b.div(b.mul(t0, g), bm), seq)


def _token(b: KernelBuilder, cu_ptr: Reg, seq: Reg, offset: int, total_q: Reg) -> Reg:
    addr = C.element_offset(b, cu_ptr, seq, b.mov(4, S64))
    return b.min(b.bitcast(b.max(b.ld("global", S32, Addr(addr, offset), nc=True), 0), U32), total_q)


def kv_tiles_of(b: KernelBuilder, kv: KVAccess, ptrs: dict, seq: Reg, bn: int) -> Reg:
    """u32 KV tiles of `bn` keys sequence `seq` holds (seq_lens clamped to the capacity)."""
    n = b.ld("global", S32, Addr(C.element_offset(b, ptrs["seq_lens"], seq, b.mov(4, S64))), nc=True)
    n = b.min(b.bitcast(b.max(n, 0), U32), kv.capacity(b))
    return b.div(b.add(n, bn - 1), bn)


def find_sequence(b: KernelBuilder, cu_ptr: Reg, tile: Reg, batch: Reg, g: int, bm: int,
                  total_q: Reg) -> Reg:
    """The last sequence whose first tile is <= `tile`: a branch-free binary search over the
    bits of the index (a step's load is predicated off once it would pass `batch`)."""
    seq = b.mov(0, U32)
    for k in reversed(range(SEARCH_STEPS)):
        mid = b.add(seq, 1 << k)
        ok = b.setp("lt", mid, batch)
        start = b.mov(0xFFFFFFFF, U32)
        with b.predicate(ok):
            b.mov(tile_start(b, cu_ptr, mid, g, bm, total_q), out=start)
        b.mov(b.selp(mid, seq, b.setp("le", start, tile)), out=seq)
    return seq


def emit_varlen(b: KernelBuilder, spec, cfg: PrefillConfig, kv: KVAccess, ptrs: dict,
                strides: dict, batch: Reg, total_q: Reg, split_count: Reg | None, quant=None,
                tmaps: dict | None = None, mask_bytes: Reg | None = None) -> None:
    """varlen's policy: grid.x counts packed query tiles over the whole batch (a binary search
    of cu_seqlens_q finds the tile's sequence), grid.y = KV head (x split)."""
    g, bm = spec.group_size, cfg.block_m
    tile, cy = b.special("%ctaid.x"), b.special("%ctaid.y")
    Hk = spec.num_kv_heads
    kv_head, split = (b.rem(cy, Hk), b.div(cy, Hk)) if split_count is not None else (cy, None)
    # Which sequence this tile belongs to; its query tokens [t0, t1), clamped so that corrupt
    # prefix sums can never address outside q/o.
    cu = ptrs["cu_seqlens_q"]
    seq = find_sequence(b, cu, tile, batch, g, bm, total_q)
    t0 = _token(b, cu, seq, 0, total_q)
    t1 = b.max(_token(b, cu, seq, 4, total_q), t0)
    m_start = b.mul(b.sub(tile, b.add(b.div(b.mul(t0, g), bm), seq)), bm)

    def seq_units(i):   # (query tiles x KV tiles, KV tiles) of sequence i: upper bounds
        a = _token(b, cu, i, 0, total_q)
        q_tiles = b.div(b.add(b.mul(b.sub(b.max(_token(b, cu, i, 4, total_q), a), a), g), bm - 1), bm)
        kv_tiles = kv_tiles_of(b, kv, ptrs, i, cfg.block_n)
        work = b.mul(q_tiles, kv_tiles)
        return work, b.min(kv_tiles, work)            # a sequence without queries has no span
    work = TileWork(seq, kv_head, split, t0, b.bitcast(b.sub(t1, t0), S32), m_start,
                    batch, b.special("%nctaid.x"), seq_units)
    emit_packed_tile(b, spec, cfg, kv, ptrs, strides, work, split_count, quant, tmaps, mask_bytes)


def emit_token_tiles(b: KernelBuilder, spec, cfg: PrefillConfig, kv: KVAccess, ptrs: dict,
                     strides: dict, total_q: Reg, split_count: Reg | None, quant=None) -> None:
    """Sparse top-k's policy (kv.sparse = N): every query token is its own "sequence" of one
    query over its own keys, the slots indices[token, :n] with n = N, or topk_length[token]
    clamped to [0, N]. grid.x = total_q x (num_heads / block_m) tiles, each one token's block of
    heads (the heads fill whole tiles: block_m divides num_heads); grid.y = split."""
    tiles_per_token = spec.num_heads // cfg.block_m
    tile = b.special("%ctaid.x")
    token, m_start = b.div(tile, tiles_per_token), b.mul(b.rem(tile, tiles_per_token), cfg.block_m)
    with b.if_then(b.setp("ge", token, total_q)):
        b.ret()
    split = b.special("%ctaid.y") if split_count is not None else None

    def keys_of(i):   # u32 keys of token i
        if "topk_length" not in ptrs:
            return b.mov(kv.sparse, U32)
        n = b.ld("global", S32, Addr(C.element_offset(b, ptrs["topk_length"], i, b.mov(4, S64))), nc=True)
        return b.min(b.bitcast(b.max(n, 0), U32), kv.sparse)

    def token_units(i):   # (query tiles x KV tiles, KV tiles) of token i
        kv_tiles = b.div(b.add(keys_of(i), cfg.block_n - 1), cfg.block_n)
        return b.mul(kv_tiles, tiles_per_token), kv_tiles
    work = TileWork(token, b.mov(0, U32), split, token, b.mov(1, S32), m_start, total_q,
                    b.special("%nctaid.x"), token_units, keys=keys_of(token))
    emit_packed_tile(b, spec, cfg, kv, ptrs, strides, work, split_count, quant)


def emit_packed_tile(b: KernelBuilder, spec, cfg: PrefillConfig, kv: KVAccess, ptrs: dict,
                     strides: dict, work: TileWork, split_count: Reg | None, quant=None,
                     tmaps: dict | None = None, mask_bytes: Reg | None = None) -> None:
    """The body shared by varlen and decode's tensor-core path: one GQA-packed query tile of
    one (sequence, KV head, split) over its keys [0, L), L = seq_lens[seq] clamped.
    With `quant` (kv_fp8.KVDequant) the cache holds FP8 bytes: with a StagedFP8Config they
    travel by cp.async through the pipeline and are dequantised into f16/bf16 tiles after their
    wait (kv_fp8_stage.py); otherwise (head dims not a multiple of 16) a dequantising copy
    (kv_fp8.stage_rows_dequant: FP8 bytes -> registers -> exact f16/bf16 -> st.shared) stages
    them. Either way the tile math is unchanged; k_scale joins the softmax scale
    (MmaMath.scale_log2 becomes a register) and v_scale the final 1/l.
    A varlen_tile.WgmmaTileConfig (sm_90a) runs varlen_wgmma.py's body (cp.async) or
    varlen_tma.py's (TMA) instead."""
    if isinstance(cfg, WgmmaTileConfig):
        if cfg.tma:      # tile.kv_loads = "tma": K/V tiles by TMA boxes
            from .varlen_tma import emit_tma_tile
            emit_tma_tile(b, spec, cfg, kv, ptrs, strides, work, split_count, tmaps, mask_bytes)
        else:
            from .varlen_wgmma import emit_wgmma_tile
            emit_wgmma_tile(b, spec, cfg, kv, ptrs, strides, work, split_count, quant, mask_bytes)
        return
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
        sparse = SparseSlots(b, kv, bases, kv_slot, bn, L, b.add(smem, cfg.slot_ring_offset), tid,
                             stages, tile.key0)

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
                                   quant, "f16x2" if cfg.fmt.name == "f16" else "bf16x2")
        b.cp_async_commit()

    load_tile_rows(b, q_slot, q_row, m_start, b.sub(b.bitcast(rows, S32), b.bitcast(m_start, S32)),
                   smem, True)
    if pages is not None:
        pages.load_ahead(b.mul(first, bn))
    math = VarlenMath(b, ctx, ptrs, strides)
    if quant is not None and quant.mode != "group":   # group scales: applied in the staging
        k_scale, math.v_scale = quant.scales(b, kv_head)
        math.scale_log2 = b.mul(k_scale, math.scale_log2)
    loop = dict(n_tiles=n_tiles, n_full=tile.n_full, key0_of=tile.key0,
                load_kv=load_kv, math=math, transform=score_transform(b, spec, math),
                lo_full=tile.lo_full, landed=None if staging is None else staging.landed)
    if tile.order is not None:   # a packed mask: the tiles with a bit set (mask_tiles.py)
        loop["mask_of"] = tile.mask_of
    if cfg.shared_kv:   # MLA's latent rows: one tile per stage for both products
        run_shared_kv_pipeline(b, stages=stages, kv_bytes=kv_bytes, kv_smem=k_smem, **loop)
    else:
        run_kv_pipeline(b, stages=stages, kv_bytes=kv_bytes, k_smem=k_smem, v_smem=v_smem,
                        use_async=True, **loop)
    math.epilogue()


