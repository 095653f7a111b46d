"""The GQA-packed query tile shared by varlen's bodies (varlen_attend.py on mma.sync,
varlen_wgmma.py on wgmma) and decode's tensor-core path: what a CTA works on (TileWork, from
the family's work-assignment policy), the per-row context of the tile math (VarlenCtx: token /
head of a packed row, positions, key limits, sinks, ALiBi, output indices), and the setup every
body starts with (packed_tile_setup: the key count, the early exit, shared memory, the range of
KV tiles with causal / window / split-KV shares) plus the row addressing of Q and K/V tiles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ...ir import F32, S32, S64, U32, U64, Addr, KernelBuilder, Reg
from .. import common as C
from ..config.prefill import PrefillConfig
from ..kv.kv_access import KVAccess
from ..kv.kv_pages import valid_word_slot
from .mask_tiles import TileList, classify_tiles
from .split_plan import auto_split, emit_balanced_split
from .variant import load_head_f32
from .variant import AttentionVariant, MaskPredicate


@dataclass
class VarlenCtx(MaskPredicate):
    """What MmaMath and finish_rows read (the same names as prefill's Ctx), for packed rows."""

    b: KernelBuilder
    spec: object
    cfg: PrefillConfig
    variant: AttentionVariant
    tid: Reg
    lane: Reg
    warp: Reg
    m_start: Reg          # u32 first packed row of the tile
    seq_q: Reg            # u32 packed rows of the sequence: q_len * g
    q_len: Reg            # s32
    kv_len: Reg           # s32 L after clamping
    q_smem: Reg
    kv_head: Reg
    token0: Reg           # u32 cu_seqlens_q[b] after clamping
    lse: Reg | None       # u64: lse, or lse_part with splits
    split: Reg | None     # u32 split index (None without split-KV)
    num_splits: Reg | None
    sinks: Reg | None = None    # u64 sinks [num_heads] f32 (attention_sinks)
    slopes: Reg | None = None   # u64 alibi_slopes [num_heads] f32 (alibi)
    mask_bits: Reg | None = None   # u64 first byte of the sequence's mask bits (custom_mask)
    # sparse keys (kv_access sparse): pred, key (s32) has no cache row -- masked like a key
    # past the limit (MmaMath.mask asks once per key of the lane, for all its rows)
    missing_key: Callable[[Reg], Reg] | None = None
    # ... or, where the tile's copies publish them (kv_pages.SparseSlots' valid_words): u32 word
    # of the tile at key0 (u32) whose bit k says key key0 + k has a cache row
    valid_word: Callable[[Reg], Reg] | None = None
    # split-KV on a path that finishes whole tiles (PrefillConfig.finishes_whole_tiles): pred,
    # this is split 0, S > 1 and it covers the tile's whole key range (chunk >= span): it
    # stores the final o itself and marks split 1's lse_part +inf (split_reduce)
    whole: Reg | None = None

    def mask_from_valid_words(self, b: KernelBuilder, smem: Reg) -> Reg:
        """Sparse keys masked from the words of valid rows the tile's copies publish
        (kv_pages.SparseSlots' valid_words: one shared load a tile) instead of each lane
        loading its keys' slots (missing_key); returns the words' address (cfg.slot_ring's,
        from the tile's shared memory at `smem`)."""
        words, bn = b.add(smem, self.cfg.valid_words_offset), self.cfg.block_n
        self.missing_key = None
        self.valid_word = lambda key0: b.ld("shared", U32, Addr(valid_word_slot(b, words, key0, bn)))
        return words

    # The custom mask predicate (variant.MaskPredicate) over this tile's packed rows: query
    # token i's row of bits; a tree's n x n bits cover the draft keys (column = key - (L - n)),
    # packed bits the q_len x L matrix (column = key).
    def mask_rows(self, b: KernelBuilder) -> Reg:
        return b.bitcast(self.q_len, U32)

    def mask_width(self, b: KernelBuilder) -> Reg:
        return b.bitcast(self.q_len if self.variant.tree else self.kv_len, U32)

    def mask_token(self, row: Reg) -> Reg:
        return self.token(row)

    def mask_shift(self, b: KernelBuilder) -> Reg | None:
        return b.sub(self.kv_len, self.q_len) if self.variant.tree else None

    def token(self, row: Reg) -> Reg:
        g = self.spec.group_size
        return self.b.div(row, g) if g > 1 else row

    def head(self, row: Reg) -> Reg:
        g = self.spec.group_size
        if g == 1:
            return self.kv_head
        return self.b.mad(self.kv_head, g, self.b.rem(row, g))

    def position(self, token: Reg) -> Reg:
        """s32 absolute position of a query token: L - q_len + token."""
        b = self.b
        return b.add(b.sub(self.kv_len, self.q_len), b.bitcast(token, S32))

    def key_limit(self, b: KernelBuilder, row: Reg) -> Reg:
        return self.variant.key_end(b, self.position(self.token(row)), self.kv_len)

    def key_begin(self, b: KernelBuilder, row: Reg) -> Reg | None:
        if not self.variant.bounded:
            return None
        return self.variant.key_begin(b, self.position(self.token(row)))

    def sink_log2(self, b: KernelBuilder, row: Reg) -> Reg | None:
        """The row's sink logit in log2 units; with split-KV only split 0 adds it (the partial
        LSEs then merge to log(e^sink + sum e^s) in split_reduce), the others get -inf."""
        if self.sinks is None:
            return None
        sink = b.mul(load_head_f32(b, self.sinks, self.head(row)), C.LOG2E)
        if self.split is not None:
            sink = b.selp(sink, C.NEG_INF, b.setp("eq", self.split, 0))
        return sink

    def alibi_row(self, b: KernelBuilder, row: Reg, lane_key: Reg, unit: float) -> tuple[Reg, Reg]:
        """(p - lane_key (s32), -unit · slope of the row's head) for variant.transform_scores."""
        pos = self.position(self.token(row))
        return b.sub(pos, lane_key), b.mul(load_head_f32(b, self.slopes, self.head(row)), -unit)

    def out_index(self, row: Reg) -> Reg:
        """u32 (token, head) index into [total_q, H] (times num_splits, plus split, for parts)."""
        b = self.b
        idx = b.mad(b.add(self.token0, self.token(row)), self.spec.num_heads, self.head(row))
        return idx if self.split is None else b.mad(idx, self.num_splits, self.split)

    def lse_addr(self, b: KernelBuilder, row: Reg) -> Reg:
        return b.add(self.lse, b.mul_wide(self.out_index(row), 4))


@dataclass(frozen=True)
class TileWork:
    """What a CTA works on, from the family's work-assignment policy: packed rows
    [m_start, m_start + block_m) of sequence `seq`'s query block (q_len tokens from `token0`),
    for KV head `kv_head` and, with split-KV, split `split`."""

    seq: Reg            # u32 sequence index (seq_lens, block_table / caches)
    kv_head: Reg        # u32
    split: Reg | None   # u32 split index (None without split-KV)
    token0: Reg         # u32 first query token of the sequence in q / o
    q_len: Reg          # s32 query tokens of the sequence
    m_start: Reg        # u32 first packed row of this CTA's tile
    # Split-KV only (split_plan.emit_balanced_split): the batch the chunk is balanced over,
    # the split rows of the grid, and (work, KV span) in KV tiles of sequence i, per KV head.
    n_seqs: Reg | None = None
    split_rows: Reg | None = None
    seq_units: Callable[[Reg], tuple[Reg, Reg]] | None = None
    keys: Reg | None = None   # u32 keys of the sequence when the policy knows them (sparse top-k);
                              # None: seq_lens[seq]


@dataclass
class PackedTile:
    """One CTA's GQA-packed tile after packed_tile_setup: the context of the tile math, the
    shared-memory regions (Q, then num_stages K and num_stages V tiles) and the KV tiles to
    visit: loop tile j is KV tile first + j for j < n_tiles; j >= n_full (or < lo_full with a
    sliding window) needs the mask. Shared by the mma.sync body below and varlen_wgmma.py."""

    ctx: VarlenCtx
    L: Reg                # s32 keys of the sequence (clamped)
    smem: Reg
    k_smem: Reg
    v_smem: Reg
    first: Reg            # u32 first KV tile
    n_tiles: Reg          # u32
    n_full: Reg           # u32
    lo_full: Reg | None   # u32 (sliding window only)
    # A packed custom mask: the visit order (mask_tiles.py); loop tile j is then KV tile
    # first + order.tile(j), for j < order.n_visit
    order: TileList | None = None

    def key0(self, j: Reg) -> Reg:
        """u32 first key of loop tile j."""
        b, bn = self.ctx.b, self.ctx.cfg.block_n
        rel = j if self.order is None else self.order.tile(j)[0]
        return b.mul(b.add(self.first, rel), bn)

    def mask_of(self, j: Reg) -> tuple[Reg, Reg]:
        """kv_pipeline's mask_of with a visit order: (first key, needs the mask) of loop tile j."""
        b, bn = self.ctx.b, self.ctx.cfg.block_n
        rel, needs = self.order.tile(j)
        return b.mul(b.add(self.first, rel), bn), needs

    def q_row(self, ptrs: dict, strides: dict, q_col: Reg):
        """load_tile_rows' row_address for packed Q rows: (token, head) of row R -> this
        thread's chunk at byte column `q_col` (s64)."""
        b, ctx = self.ctx.b, self.ctx

        def q_row(row: Reg, valid: Reg) -> tuple[Reg, Reg]:
            tok = b.add(ctx.token0, ctx.token(row))
            base = C.element_offset(b, ptrs["q"], tok, strides[("q", 0)])
            addr = C.element_offset(b, b.bitcast(base, U64), ctx.head(row), strides[("q", 1)])
            return b.bitcast(b.add(addr, q_col), U64), valid
        return q_row

    def key_lo(self) -> Reg | None:
        """A sliding window: keys before the first token's window are needed by no row of the
        tile, so they are zero-filled rather than read (the first tile may start before it)."""
        ctx = self.ctx
        return None if not ctx.variant.bounded else ctx.b.max(ctx.key_begin(ctx.b, ctx.m_start), 0)

    def kv_rows(self, kv: KVAccess, bases: dict, cache: str, key_lo: Reg | None):
        """load_tile_rows' row_address for K/V rows through the layout's per-row addressing."""
        b = self.ctx.b

        def rows_of(row, ok):
            if key_lo is not None:
                ok = b.and_(ok, b.setp("ge", b.bitcast(row, S32), key_lo))
            return kv_row(b, kv, bases, cache, row, ok)
        return rows_of


def packed_tile_setup(b: KernelBuilder, spec, cfg: PrefillConfig, kv: KVAccess, ptrs: dict,
                      work: TileWork, split_count: Reg | None, smem_align: int = 16,
                      mask_bytes: Reg | None = None) -> PackedTile:
    """The sequence's key count, the early exit of a tile without rows, the shared memory, the
    context, and the range of KV tiles (causal / window / split-KV share) of one packed tile.
    `mask_bytes`: the custom mask's bits-buffer size (u32), with custom_mask only."""
    g, bm, bn, stages = spec.group_size, cfg.block_m, cfg.block_n, cfg.num_stages
    variant = AttentionVariant.from_spec(spec)
    tid = b.special("%tid.x")
    lane, warp = b.and_(tid, 31), b.shr(tid, 5)
    seq, kv_head, split, t0, q_len, m_start = (work.seq, work.kv_head, work.split, work.token0,
                                               work.q_len, work.m_start)
    # keys [0, L), clamped so that a corrupt length can never address outside the cache
    if work.keys is None:
        lens = C.element_offset(b, ptrs["seq_lens"], seq, b.mov(4, S64))
        L = b.min(b.bitcast(b.max(b.ld("global", S32, Addr(lens), nc=True), 0), U32), kv.capacity(b))
    else:
        L = b.min(work.keys, kv.capacity(b))
    L = b.bitcast(L, S32)
    rows = b.mul(b.bitcast(q_len, U32), g)
    with b.if_then(b.setp("ge", m_start, rows)):
        b.ret()                                        # no query rows for this tile: exit

    smem = b.address_of(b.shared("varlen_smem", 0, align=smem_align))
    kv_bytes = cfg.kv_geom.bytes
    k_smem = b.add(smem, cfg.q_geom.bytes)
    v_smem = k_smem if cfg.shared_kv else b.add(k_smem, stages * kv_bytes)   # latent: V in K's tile
    ctx = VarlenCtx(b, spec, cfg, variant, tid, lane, warp, m_start, rows, q_len, L, smem, kv_head,
                    t0, ptrs.get("lse_part" if split is not None else "lse"), split, split_count,
                    ptrs.get("sinks"), ptrs.get("alibi_slopes"))
    if variant.mask is not None:   # the sequence's bits: segment `seq` of the bits buffer
        ctx.bind_mask(b, ptrs, seq, mask_bytes)
    if kv.sparse:                  # the token's slots: -1 / outside the cache hide the key
        index_row = kv.index_row(b, ptrs, seq)
        ctx.missing_key = lambda key: kv.key_missing(b, index_row, key, L)

    # KV tiles: [0, n_vis) visible to the tile's last token; [0, n_full) to its first as well.
    last_row = b.sub(b.min(b.add(m_start, bm), rows), 1)
    def keys_seen(row: Reg) -> Reg:
        return b.bitcast(b.max(ctx.key_limit(b, row), 0), U32)
    n_vis = b.div(b.add(keys_seen(last_row), bn - 1), bn)
    n_full = b.div(keys_seen(m_start), bn)
    if variant.tree:   # tiles wholly in the prefix (keys < L - q_len) need no tree bits
        n_full = b.div(b.bitcast(b.max(b.sub(L, q_len), 0), U32), bn)
    elif kv.sparse:   # slots: every tile is masked
        n_full = b.mov(0, U32)
    # A sliding window: tiles before the first token's window are never read; tiles before
    # the first one wholly inside the last token's window cross its left edge (masked).
    w_first = lo_full = None
    if variant.bounded:
        w_first = b.min(variant.first_tile(b, ctx.position(ctx.token(m_start)), bn), n_vis)
        lo_full = variant.first_unmasked_tile(b, ctx.position(ctx.token(last_row)), bn)
    first = b.mov(0, U32) if w_first is None else w_first
    if split is not None:                 # a uniform, length-balanced chunk (split_plan.py)
        # No idle exit before the batch pass here (decode has one: split_plan.emit_idle_exit):
        # with it ptxas 13.0 capped the d64 split kernel on sm_120 at 128 registers and spilled.
        # The paths that finish whole tiles leave after it (emit_idle_split_exit); on mma.sync
        # that exit too made ptxas 13.5 spill (4 of the sweep's combinations), so an idle split
        # there runs an empty KV loop and writes an empty partial.
        span = n_vis if w_first is None else b.sub(n_vis, w_first)
        begin, end = first, n_vis
        first, n_vis, chunk = emit_balanced_split(
            b, split=split, num_splits=split_count, lane=lane, n_seqs=work.n_seqs,
            seq_units=work.seq_units, own=span, begin=begin, end=end, rows=work.split_rows,
            auto=auto_split(spec), keep_split0="sinks" in ptrs, write_empty=None)
        if cfg.finishes_whole_tiles:
            whole = b.setp("ge", b.add(begin, chunk), end)
            emit_idle_split_exit(b, ctx, split, first, n_vis, whole, rows, cfg)
            # S = 1 keeps the partials: split 1's lse slot, the mark, is not there
            ctx.whole = b.and_(b.and_(whole, b.setp("eq", split, 0)), b.setp("gt", split_count, 1))
    n_tiles = b.sub(n_vis, first)
    n_full = b.sub(b.max(n_full, first), first)
    if lo_full is not None:
        lo_full = b.sub(b.max(lo_full, first), first)
    order = None
    if variant.mask == "packed":   # the tiles with a bit set, in order (mask_tiles.py)
        tok0 = ctx.token(m_start)
        order = classify_tiles(b, ctx, tid=tid, threads=cfg.threads, region=b.add(smem, cfg.mask_list_offset),
                               tok0=tok0, n_tok=b.add(b.sub(ctx.token(last_row), tok0), 1),
                               key0=b.bitcast(b.mul(first, bn), S32), n_tiles=n_tiles, n_full=n_full,
                               lo_full=lo_full, bn=bn)
    return PackedTile(ctx, L, smem, k_smem, v_smem, first, n_tiles, n_full, lo_full, order)


def emit_idle_split_exit(b: KernelBuilder, ctx: VarlenCtx, split: Reg, first: Reg, last: Reg,
                         whole: Reg, rows: Reg, cfg: PrefillConfig) -> None:
    """Leave at once when split index `split` (not 0) got no KV tiles, before the Q tile and
    the pipeline start, with an empty partial for the tile's rows (lse_part = -inf, o_part
    unwritten: the reduce weighs it 0 without reading it) -- or, where split 0 covers the whole
    tile (`whole`), nothing: the reduce reads no split past split 1's slot, which split 0
    marks."""
    idle = b.and_(b.setp("ne", split, 0), b.setp("ge", first, last))
    with b.if_then(idle):
        with b.if_then(whole, negate=True):
            with b.for_range(ctx.tid, cfg.block_m, cfg.launch_threads) as i:
                row = b.add(ctx.m_start, i)
                with b.predicate(b.setp("lt", row, rows)):
                    b.st("global", F32, Addr(ctx.lse_addr(b, row)), [b.mov(C.NEG_INF, F32)])
        b.ret()


def kv_row(b: KernelBuilder, kv: KVAccess, bases: dict, cache: str, row: Reg, ok: Reg):
    addr, valid = kv.row_address(b, bases, cache, row, ok, {})
    return b.bitcast(addr, U64) if addr.type != U64 else addr, valid
