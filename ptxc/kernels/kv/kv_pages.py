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

from ...ir import S32, S64, Addr, KernelBuilder, Reg
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


class SparseSlots:
    """Sparse top-k tiles (KVAccess(sparse=N)): row r of tile q reads the cache slot
    indices[token, key0(q) + r]. Loaded where the row's copy needs it, that slot is a global
    round trip in front of every tile's cp.async (in-order issue: the warp waits for it). Here
    thread i < block_n loads row i's slot two tiles ahead into a register (`mine`) and parks it
    in a two-tile ring in shared memory one tile ahead; the copy of tile q reads its rows' slots
    from ring[q % 2]. The shared pipeline's barrier at the top of each iteration orders the park
    (while issuing tile q - 1) before the reads (issuing tile q), and a ring half is rewritten
    only an iteration after its last read. The first S - 1 tiles (the pipeline's prologue) read
    their slots directly; the last of them primes the ring. A tile the loop does not issue
    (q >= n_tiles) skips the park and the load with it, and so does every later one."""

    def __init__(self, b: KernelBuilder, kv: KVAccess, bases: dict, slot: ThreadSlot, block_n: int,
                 L: Reg, ring: Reg, tid: Reg, stages: int, key0_of):
        self.b, self.kv, self.bases, self.slot, self.bn, self.L = b, kv, bases, slot, block_n, L
        self.ring, self.tid, self.stages, self.key0_of = ring, tid, stages, key0_of
        self.issued = 0                      # load_kv calls emitted so far (prologue, then the loop's)
        self.own = b.setp("lt", tid, block_n)
        self.mine = b.mov(-1, S32)

    def _half(self, q: Reg) -> Reg:
        return self.b.add(self.ring, self.b.mul(self.b.and_(q, 1), 4 * self.bn))

    def _fetch(self, q: Reg) -> None:
        """mine <- the slot of row tid of tile q (-1 past the token's keys, and for tid >= block_n)."""
        b = self.b
        key = b.add(self.key0_of(q), self.tid)
        self.kv.load_page(b, self.bases, key, b.and_(self.own, b.setp("lt", b.bitcast(key, S32), self.L)),
                          out=self.mine)

    def _park(self, q: Reg) -> None:
        with self.b.predicate(self.own):
            self.b.st("shared", S32, Addr(self.b.add(self._half(q), self.b.shl(self.tid, 2))), [self.mine])

    def issue(self, cache: str, q: Reg, nvalid: Reg, dst: Reg, rows_of) -> None:
        """cp.async tile q of `cache` (rows past `nvalid` zero-filled); `rows_of` is the per-row
        addressing the prologue's tiles use."""
        b, slot = self.b, self.slot
        row0 = self.key0_of(q)
        if self.issued < self.stages - 1:
            load_tile_rows(b, slot, rows_of, row0, nvalid, dst, True)
            if self.issued == self.stages - 2:       # prime: ring[q + 1], mine = tile q + 2's
                self._fetch(b.add(q, 1))
                self._park(b.add(q, 1))
                self._fetch(b.add(q, 2))
        else:
            half, rpp = self._half(q), slot.geom.rows_per_pass

            def pass_address(i: int) -> tuple[Reg, Reg]:
                r = b.add(slot.r0, i * rpp)
                inside = b.setp("lt", r, self.bn)    # idle threads' rows lie past the tile
                parked = b.mov(-1, S32)
                with b.predicate(inside):
                    b.ld("shared", S32, Addr(b.add(half, b.shl(r, 2))), out=[parked])
                row, cache_pages = b.add(row0, r), {}
                self.kv.use_page(b, cache_pages, row, inside, parked)
                addr, ok = self.kv.row_address(b, self.bases, cache, row, inside, cache_pages)
                return b.bitcast(addr, C.U64) if addr.type != C.U64 else addr, ok
            load_tile_passes(b, slot, pass_address, nvalid, dst, True)
            self._park(b.add(q, 1))
            self._fetch(b.add(q, 2))
        self.issued += 1


__all__ = ["PagedTiles", "SparseSlots", "prefetch_applies"]
