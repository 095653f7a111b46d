"""varlen's schedulers: which packed query tile of which (sequence, KV head, split) a CTA owns.

Work assignment is a policy in front of the shared tile body (packed_paths.emit_packed_tile,
given a TileWork; the tile's context and setup live in attention/packed_tile.py, its bodies per
instruction set in varlen_mma.py, varlen_wgmma.py and varlen_tma.py):
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
from ..attention.packed_tile import TileWork
from ..config.prefill import PrefillConfig
from ..kv.kv_access import KVAccess
from .packed_paths import emit_packed_tile


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


def longest_first(spec) -> bool:
    """Whether emit_varlen launches a sequence's query blocks last to first (causal: the last
    block sees the most keys); the metadata records it as config.query_order."""
    return bool(spec.opt("causal"))


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
    first = b.add(b.div(b.mul(t0, g), bm), seq)
    local = b.sub(tile, first)
    if longest_first(spec):
        # longest first (FA3 / FlashInfer): a sequence's tiles [first, next) take its query
        # blocks last to first -- the last block sees the most keys -- so the grid's last wave
        # holds the short ones. next = tile_start(seq + 1); a tile at or past it (the last
        # sequence's, when cu_seqlens_q ends before total_q) gets no block and exits as a
        # spare tile does.
        count = b.sub(b.add(b.add(b.div(b.mul(t1, g), bm), seq), 1), first)
        m_start = b.selp(b.mul(b.sub(b.sub(count, 1), local), bm), 0xFFFFFFFF,
                         b.setp("lt", local, count), U32)
    else:
        m_start = b.mul(local, bm)

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
