"""Paged K/V tiles for the cp.async pipeline with the page ids loaded one tile ahead.

A K/V tile of `block_n` rows starting at a multiple of block_n covers max(1, block_n / page_size)
whole pages (block_n a power of two: then page_size is one too, or a multiple of block_n and
the tile sits in one page). When a thread's rows (r0 + i * rows_per_pass, r0 <
rows_per_pass) stay inside one page per pass (rows_per_pass divides page_size, or the tile sits
in one page), the page of pass i is a compile-time slot, so a tile needs only those few
block-table entries instead of one lookup per row. They are loaded with the previous tile:
K(t) is issued with the ids of tile t (loaded while K(t-1) was issued) and loads tile t + 1's;
V(t), which kv_pipeline always issues right after K(t), reuses K(t)'s ids. So no block-table
round trip sits between the pipeline and its cp.async requests.
"""

from __future__ import annotations

from ...ir import S32, S64, U32, U64, Addr, KernelBuilder, Reg
from .. import common as C
from ..mainloop.tiles import ThreadSlot, load_tile_passes, load_tile_rows
from .kv_access import KVAccess


def prefetch_applies(kv: KVAccess, slot: ThreadSlot, block_n: int) -> bool:
    ps, rpp = kv.page_size, slot.geom.rows_per_pass
    return kv.block_table and (ps % block_n == 0 or (block_n % ps == 0 and ps % rpp == 0))


class PagedTiles:
    """Page ids of the next K tile (`ahead`) and of the last K tile issued (`current`, V's)."""

    def __init__(self, b: KernelBuilder, kv: KVAccess, bases: dict, slot: ThreadSlot,
                 block_n: int, L: Reg):
        self.b, self.kv, self.bases, self.slot, self.bn, self.L = b, kv, bases, slot, block_n, L
        ps = kv.page_size
        self.pages = max(1, block_n // ps)
        self.ahead = [b.mov(-1, S32) for _ in range(self.pages)]
        self.current = [b.mov(-1, S32) for _ in range(self.pages)]
        rpp = slot.geom.rows_per_pass
        # byte offset of this thread's first row in its page, and between passes of one page
        self.row_off = {t: b.mul(b.cvt(S64, slot.r0), bases[t][1][1]) for t in ("k_cache", "v_cache")}
        self.pass_step = {t: b.mul(bases[t][1][1], rpp) for t in ("k_cache", "v_cache")}

    def load_ahead(self, row0: Reg) -> None:
        """Block-table entries of the tile starting at key row0 (-1 for pages past L)."""
        b = self.b
        for p, reg in enumerate(self.ahead):
            row = b.add(row0, p * self.kv.page_size)
            self.kv.load_page(b, self.bases, row, b.setp("lt", b.bitcast(row, S32), self.L), out=reg)

    def issue(self, cache: str, row0: Reg, nvalid: Reg, dst: Reg, key_lo: Reg | None = None) -> None:
        """cp.async the tile at row0 of `cache` (K: with the ids in `ahead`, then load the next
        tile's; V: with K's ids of the same tile). Rows below `key_lo` (s32) are zero-filled."""
        chunks = self.pass_chunks(cache, self.ids_of(cache), row0, key_lo)
        b = self.b
        load_tile_passes(b, self.slot, lambda i: (b.bitcast(chunks[i][0], C.U64), chunks[i][1]),
                         nvalid, dst, True)
        if cache == "k_cache":
            self.advance(row0)

    def ids_of(self, cache: str) -> list[Reg]:
        """The page ids a K or V tile request uses (a pipeline that issues V later may differ)."""
        return self.ahead if cache == "k_cache" else self.current

    def advance(self, row0: Reg) -> None:
        """After K of the tile at row0: its ids become V's, the next tile's are loaded."""
        for cur, nxt in zip(self.current, self.ahead):
            self.b.mov(nxt, out=cur)
        self.load_ahead(self.b.add(row0, self.bn))

    def pass_chunks(self, cache: str, ids: list[Reg], row0: Reg,
                    key_lo: Reg | None) -> list[tuple[Reg, Reg]]:
        """(this thread's chunk address (s64), page validity) of every copy pass of the tile at
        row0 of `cache` with page ids `ids`; rows below `key_lo` (s32) are invalid."""
        b, kv = self.b, self.kv
        base, stride = self.bases[cache]
        rpp, ps = self.slot.geom.rows_per_pass, kv.page_size
        num_pages = b.bitcast(kv.regs["num_pages"], S32)
        addrs, oks = [], []
        for i in range(self.slot.geom.passes):   # pass i's page slot, then rows within it
            p = i * rpp // ps if self.pages > 1 else 0
            if i == 0 or (self.pages > 1 and i * rpp % ps == 0):
                page = ids[p]
                start = C.element_offset(b, b.bitcast(base, C.U64), b.cvt(S64, page), stride[0])
                addr = b.add(start, self.row_off[cache])
                if self.pages == 1:   # the tile sits inside one page, row0 % ps rows in
                    addr = b.add(addr, b.mul(b.cvt(S64, kv.offset_in_page(b, row0)), stride[1]))
                ok = b.and_(b.setp("ge", page, 0), b.setp("lt", page, num_pages))
            else:
                addr = b.add(addrs[-1], self.pass_step[cache])
            addrs.append(addr)
            if key_lo is None:
                oks.append(ok)
            else:
                row = b.add(row0, b.add(self.slot.r0, i * rpp))
                oks.append(b.and_(ok, b.setp("ge", b.bitcast(row, S32), key_lo)))
        return list(zip(addrs, oks))


RING_ENTRY = 8       # SparseSlots: a parked row is its s64 byte offset in the cache
# SparseSlots(valid_words): a ring of u32 words, one per tile (its rows with a cache row), slot
# (first + q) mod VALID_WORDS -- deep enough that a word is rewritten only for a tile issued
# after the consumer read it (valid_word_slot)
VALID_WORDS = 16


class SparseSlots:
    """Sparse top-k tiles (KVAccess(sparse=N)): row r of tile q reads the cache slot
    indices[token, key0(q) + r]. Loaded where the row's copy needs it, that slot is a global
    round trip in front of every tile's cp.async (in-order issue: the warp waits for it). Here
    thread i < block_n loads row i's slot two tiles ahead into a register (`mine`) and parks the
    row's byte offset in the cache (-1 for a missing key) in a two-tile ring in shared memory
    one tile ahead; the copy of tile q reads its rows' offsets from ring[q % 2] -- the slot's
    range check and the page arithmetic done once per row, not by each thread copying a chunk
    of it (a 576-column row is 36 to 72 chunks). A barrier among the copying threads between
    two issues (the pipelines' one at the top of each iteration) orders the park (while
    issuing tile q - 1) before the reads (issuing tile q), and a ring half is rewritten only an
    iteration after its last read.
    The `prologue` tiles a pipeline issues before its loop (mma.sync's S - 1, the latent
    tiles' S - 2, S for converted FP8 rows) read their slots directly; the last of them primes
    the ring. A tile the loop does not issue (q >= n_tiles) skips the park and the load with
    it, and so does every later one.

    `valid_words` (block_n <= 32): the first warp of the copying threads, whole, also publishes each
    tile's rows that have a cache row as one u32 (a ballot: bit r = row r's slot is in the cache
    and r below the token's keys) in a ring of VALID_WORDS, which the warps that mask the
    scores read (one shared load a tile) instead of each lane loading its keys' slots. The
    prologue's tiles publish theirs with an extra slot load each, before the loop. Ordering:
    tile q's word is written while tile q - 1 is issued, before the barrier that precedes tile
    q's scores (the copying threads' one at the top of an iteration, or a dequantising
    warpgroup's arrival on the tile's full barrier), and rewritten VALID_WORDS tiles later
    (valid_word_slot)."""

    def __init__(self, b: KernelBuilder, kv: KVAccess, bases: dict, slot: ThreadSlot, block_n: int,
                 L: Reg, ring: Reg, tid: Reg, prologue: int, key0_of, valid_words: Reg):
        assert prologue >= 1, "the last prologue tile primes the ring"
        assert block_n <= 32, "one warp's ballot holds a tile's rows"
        assert prologue <= VALID_WORDS - 5, "valid_word_slot: a word rewritten unread"
        self.b, self.kv, self.bases, self.slot, self.bn, self.L = b, kv, bases, slot, block_n, L
        self.ring, self.tid, self.prologue, self.key0_of = ring, tid, prologue, key0_of
        self.valid_words = valid_words
        self.issued = 0                      # load_kv calls emitted so far (prologue, then the loop's)
        self.own = b.setp("lt", tid, block_n)
        self.mine = b.mov(-1, S32)

    def _half(self, q: Reg) -> Reg:
        return self.b.add(self.ring, self.b.mul(self.b.and_(q, 1), RING_ENTRY * self.bn))

    def _fetch(self, q: Reg) -> None:
        """mine <- the slot of row tid of tile q (-1 past the token's keys, and for tid >= block_n)."""
        b = self.b
        key = b.add(self.key0_of(q), self.tid)
        self.kv.load_page(b, self.bases, key, b.and_(self.own, b.setp("lt", b.bitcast(key, S32), self.L)),
                          out=self.mine)

    def _park(self, q: Reg) -> None:
        """Row tid of tile q: its byte offset in the cache, worked out once here for every
        thread that copies a chunk of it (-1: a missing key -- a slot of -1 or outside the
        cache)."""
        b = self.b
        with b.if_then(b.setp("lt", self.tid, 32)):    # the first warp, whole: its ballot
            page, ok, offset = self.kv.slot_place(b, b.cvt(S64, self.mine))
            stride = self.bases["k_cache"][1]      # a latent cache: V's rows are K's
            off = b.mad(b.cvt(S64, offset), stride[1], b.mul(b.cvt(S64, page), stride[0]))
            with b.predicate(self.own):            # its lanes of the tile's rows store
                b.st("shared", S64, Addr(b.add(self._half(q), b.shl(self.tid, 3))), [b.selp(off, -1, ok)])
            self._publish(q, ok)

    def _publish(self, q: Reg, ok: Reg) -> None:
        """Lane 0 writes the first warp's ballot of `ok` as tile q's word of valid rows."""
        b = self.b
        word = b.ballot(ok)
        with b.if_then(b.setp("eq", self.tid, 0)):
            b.st("shared", U32, Addr(valid_word_slot(b, self.valid_words, self.key0_of(q), self.bn)), [word])

    def issue(self, cache: str, q: Reg, nvalid: Reg, dst: Reg, rows_of) -> None:
        """cp.async tile q of `cache` (rows past `nvalid` zero-filled); `rows_of` is the per-row
        addressing the prologue's tiles use."""
        b, slot = self.b, self.slot
        row0 = self.key0_of(q)
        if self.issued < self.prologue:
            load_tile_rows(b, slot, rows_of, row0, nvalid, dst, True)
        else:
            half = self._half(q)
            load_tile_passes(b, slot, lambda i: self._parked(cache, half, i), nvalid, dst, True)
        self.advance(q)

    def chunks(self, cache: str, q: Reg, nvalid: Reg, rows_of, row0: Reg) -> list[tuple[Reg, Reg]]:
        """Each pass's (chunk address, validity) of tile q (first row `row0`) -- for a copy that
        takes them all at once (bodies/varlen_wgmma.py's column groups) --, then `advance(q)`
        after it."""
        b, slot = self.b, self.slot
        geom = slot.geom
        if self.issued < self.prologue:
            rem = b.sub(nvalid, b.bitcast(slot.r0, S32))
            return [rows_of(b.add(row0, b.add(slot.r0, i * geom.rows_per_pass)),
                            b.setp("gt", rem, i * geom.rows_per_pass)) for i in range(geom.passes)]
        half = self._half(q)
        return [self._parked(cache, half, i) for i in range(geom.passes)]

    def advance(self, q: Reg) -> None:
        """After tile q's copy: a prologue tile publishes its word, the last one primes the ring
        (ring[q + 1], mine = tile q + 2's); the loop's park tile q + 1's slots and fetch tile
        q + 2's."""
        b = self.b
        if self.issued < self.prologue:
            self._fetch(q)           # a prologue tile's word: its slots, loaded once more
            with b.if_then(b.setp("lt", self.tid, 32)):
                self._publish(q, b.and_(self.own, self.kv.slot_in_cache(b, b.cvt(S64, self.mine))))
        if self.issued == self.prologue - 1:
            self._fetch(b.add(q, 1))
        if self.issued >= self.prologue - 1:
            self._park(b.add(q, 1))
            self._fetch(b.add(q, 2))
        self.issued += 1

    def _parked(self, cache: str, half: Reg, i: int) -> tuple[Reg, Reg]:
        """Pass i's chunk address from the offset its row's thread parked, and its validity."""
        b, rpp = self.b, self.slot.geom.rows_per_pass
        r = b.add(self.slot.r0, i * rpp)
        off = b.mov(-1, S64)
        with b.predicate(b.setp("lt", r, self.bn)):    # idle threads' rows lie past the tile
            b.ld("shared", S64, Addr(b.add(half, b.shl(r, 3))), out=[off])
        return b.bitcast(b.add(self.bases[cache][0], off), U64), b.setp("ge", off, 0)


def valid_word_slot(b: KernelBuilder, words: Reg, key0: Reg, block_n: int) -> Reg:
    """The address of the valid-rows word of the tile starting at key `key0` (u32): slot
    (key0 / block_n) mod VALID_WORDS. With P tiles issued before the loop (SparseSlots'
    prologue) tile q's word is written while tile q - 1 is issued, in loop iteration q - 1 - P.
    Where the copying threads mask too (mma.sync, every warp converting), that is after the
    barrier that ended tile q - P - 2's reads, so VALID_WORDS >= P + 2 keeps tile q -
    VALID_WORDS's word until read. Under a dequantising warpgroup that iteration saw tile q -
    P - 5 released (iteration q - 2 - P's wait on the converted ring's empty barrier): P <=
    VALID_WORDS - 5 (its staging buffers, at most 4)."""
    tile = b.shr(key0, block_n.bit_length() - 1)
    return b.add(words, b.shl(b.and_(tile, VALID_WORDS - 1), 2))


__all__ = ["PagedTiles", "SparseSlots", "VALID_WORDS", "prefetch_applies", "valid_word_slot"]
