"""Packed custom masks: the KV tiles a CTA visits, chosen from the bits before its loop.

A packed mask (custom_mask = "packed") may hide whole KV tiles from every query row of a CTA
(a prefix-LM's image block, a document boundary) and may show whole tiles to all of them. Each
CTA classifies its candidate tiles once, up front: for every (query token of the tile, KV tile)
pair a thread reads the token's bits over the tile's keys (MaskPredicate.mask_window, bounded
by the segment and the buffer as everywhere else) and ORs into two shared bitmaps "some bit
set" and "some bit clear or past the key limit". The tiles with a bit set are then compacted, in
order, into a visit list (u32 entries: candidate index | needs-mask << 31; the position of a
tile is the popcount of the bitmap before it), and the K/V pipeline walks that list: an all-zero
tile costs neither its loads nor its math, an all-one tile wholly inside the key limit skips
the mask arithmetic (kv_pipeline.modify_scores' `mask_of`).

The list is bounded (MASK_TILES candidates, 4 KiB of keys per CTA and more): candidates past it
are visited in order with the mask, as without the list, so any sequence length is served.
The cost is a pass over the CTA's bits before the loop (the loop itself reads them again for
the tiles it masks) and three barriers.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...ir import B32, S32, U32, Addr, KernelBuilder, Reg
from .variant import MaskPredicate

MASK_TILES = 256           # candidate KV tiles a CTA classifies (bitmaps of 8 words)
NEEDS_MASK = 1 << 31       # entry flag: the tile needs the mask arithmetic


def classified_tiles(spec) -> int:
    """The config's mask_tiles: MASK_TILES for a packed custom mask, else 0."""
    return MASK_TILES if spec.opt("custom_mask") == "packed" else 0


@dataclass
class TileList:
    """The visit order of a CTA's KV tiles: loop tile j is candidate tile(j) (relative to the
    loop's first tile) for j < n_visit."""

    b: KernelBuilder
    entries: Reg      # u32 shared address of the u32 entries
    n_listed: Reg     # u32 candidates with a bit set, in the list
    listed: Reg       # u32 candidates classified: min(n_tiles, MASK_TILES)
    n_visit: Reg      # u32 loop tiles: n_listed, then every candidate past the classified ones

    def tile(self, j: Reg) -> tuple[Reg, Reg]:
        """(u32 candidate index, pred needs the mask) of loop tile j."""
        b = self.b
        in_list = b.setp("lt", j, self.n_listed)
        entry = b.mov(NEEDS_MASK, U32)
        with b.predicate(in_list):
            b.ld("shared", U32, Addr(b.add(self.entries, b.shl(j, 2))), out=[entry])
        rel = b.selp(b.and_(entry, NEEDS_MASK - 1), b.add(self.listed, b.sub(j, self.n_listed)), in_list)
        return rel, b.setp("ne", b.and_(entry, NEEDS_MASK), 0)


def classify_tiles(b: KernelBuilder, mask: MaskPredicate, *, tid: Reg, threads: int, region: Reg,
                   tok0: Reg, n_tok: Reg, key0: Reg, n_tiles: Reg, n_full: Reg, lo_full: Reg | None,
                   bn: int) -> TileList:
    """Classify candidate tiles [0, n_tiles) (keys key0 + c·bn, key0 s32) for bit-matrix rows
    tok0 .. tok0 + n_tok - 1 (u32; the CTA's query tokens that exist), and build the list at
    shared address `region` (mask_list_bytes of the config). Candidates c >= n_full (past the
    key limit) or < lo_full (a window's left edge) always need the mask."""
    words = MASK_TILES // 32
    any_map, clear_map = b.add(region, 4 * MASK_TILES), b.add(region, 4 * MASK_TILES + 4 * words)
    with b.if_then(b.setp("lt", tid, 2 * words)):
        b.st("shared", U32, Addr(b.add(any_map, b.shl(tid, 2))), [b.mov(0, U32)])
    b.bar_sync(0)
    listed = b.min(n_tiles, MASK_TILES)
    width = b.bitcast(mask.mask_width(b), S32)
    with b.for_range(tid, b.mul(n_tok, listed), threads) as p:
        c = b.rem(p, listed)
        state = mask.token_state(b, b.add(tok0, b.div(p, listed)))
        k = b.add(key0, b.bitcast(b.mul(c, bn), S32))
        seen = clear = None
        for o in range(0, bn, MaskPredicate.MASK_SPAN):
            span = min(MaskPredicate.MASK_SPAN, bn - o)
            ko = b.add(k, o) if o else k
            bits = mask.mask_window(b, state, ko, span)
            valid = b.bitcast(b.min(b.max(b.sub(width, ko), 0), span), U32)   # columns < width
            bits = b.and_(bits, b.sub(b.shl(b.mov(1, U32), valid), 1))
            s_o, c_o = b.setp("ne", bits, 0), b.setp("ne", bits, (1 << span) - 1)
            seen, clear = (s_o, c_o) if seen is None else (b.or_(seen, s_o), b.or_(clear, c_o))
        word = b.shl(b.shr(c, 5), 2)
        bit = b.shl(b.mov(1, U32), b.and_(c, 31))
        with b.predicate(seen):
            b.red("shared", "or", B32, Addr(b.add(any_map, word)), bit)
        with b.predicate(clear):
            b.red("shared", "or", B32, Addr(b.add(clear_map, word)), bit)
    b.bar_sync(0)
    # Every thread counts the tiles before each bitmap word (8 popcounts) ...
    counts, n_listed = [], b.mov(0, U32)
    for w in range(words):
        counts.append(b.mov(n_listed))
        b.add(n_listed, b.popc(b.ld("shared", U32, Addr(any_map, 4 * w))), out=n_listed)
    # ... and writes the entries of its candidates at their ranks
    with b.for_range(tid, listed, threads) as c:
        w, bit = b.shr(c, 5), b.and_(c, 31)
        seen = b.ld("shared", U32, Addr(b.add(any_map, b.shl(w, 2))))
        with b.if_then(b.setp("ne", b.and_(b.shr(seen, bit), 1), 0)):
            before = b.mov(0, U32)
            for i, count in enumerate(counts):
                b.mov(b.selp(count, before, b.setp("eq", w, i)), out=before)
            rank = b.add(before, b.popc(b.and_(seen, b.sub(b.shl(b.mov(1, U32), bit), 1))))
            clear = b.ld("shared", U32, Addr(b.add(clear_map, b.shl(w, 2))))
            needs = b.or_(b.setp("ne", b.and_(b.shr(clear, bit), 1), 0), b.setp("ge", c, n_full))
            if lo_full is not None:
                needs = b.or_(needs, b.setp("lt", c, lo_full))
            entry = b.or_(c, b.selp(b.mov(NEEDS_MASK, U32), 0, needs))
            b.st("shared", U32, Addr(b.add(region, b.shl(rank, 2))), [entry])
    b.bar_sync(0)
    n_visit = b.add(n_listed, b.sub(n_tiles, listed))
    return TileList(b, region, n_listed, listed, n_visit)


__all__ = ["MASK_TILES", "TileList", "classified_tiles", "classify_tiles"]
