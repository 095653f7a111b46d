"""Shared-memory race detection (what compute-sanitizer's racecheck does), cheap enough to be on
by default.

Every shared byte has a shadow word: who wrote it last and when,
``stamp << 30 | line << 10 | writer`` (writer: the thread's linear index in its CTA, line: the
PTX line of the write, stamp: the value of the batch-wide sync counter at the write; the sync
events and what they order: syncorder.py).

An access by thread U of a byte last written by thread T != U is ordered after that write iff
a sync event that both took part in happened after it: ``cta_sync > stamp``, or (same warp)
``warp_sync > stamp``, or (counted barrier) ``pair_sync > stamp``. A read (RAW) or a write
(WAW) that is not ordered is a race; the error names both accesses. The common case -- the
last CTA-wide barrier is newer than every byte touched -- costs one gather and one compare.

Reads are remembered too, per 4-byte word (the last reader, and whether other threads -- of
the same warp or of others -- read the word since the CTA's last barrier), so a write that is
not ordered after another thread's read is a write-after-read race (WAR): the classic missing
barrier before a shared buffer is refilled. Several readers count as ordered by a CTA-wide
barrier, by a warp sync when they all are in the writer's warp, or by counted-barrier events
(an mbarrier phase, a named barrier) that paired the writer's warp with every warp that read
the word since the CTA's last barrier (a per-word mask of reader warps: a producer refilling a
buffer that several consumer warpgroups read, once each has released it). Word granularity
keeps reads cheap; its one imprecision: a thread writing some bytes of a word that another
thread read *other* bytes of, with no barrier in between, is reported too.

Proxies. Shared memory written through the generic proxy (st.shared, stmatrix, cp.async) and
then read through the async proxy (a wgmma or tcgen05.mma descriptor operand) needs a
fence.proxy.async in between (PTX ISA, "Memory Consistency Model: proxies"): without it the
tensor cores may read stale data on hardware, whatever the barriers say. Each byte remembers
whether its last write was generic (TMA and bulk copies write through the async proxy), each
thread the serial of its last fence.proxy.async, the CTA barrier it had passed then, and its
last fence before its CTA's last barrier. An async read of a generic byte is ordered iff the
writer fenced after writing and a sync event (the same thread, a CTA-wide or counted barrier
pairing the two warps, or a warp sync for the same warp) followed that fence -- its last fence,
or the last one a CTA-wide barrier followed (a later fence must not hide it) -- or the reader
fenced after a CTA-wide barrier that followed the write (fences are cumulative: what the
barrier made visible, the reader's fence covers).

Not tracked: atomics (they never race with each other and are not checked against plain
accesses), and several threads of ONE instruction storing to the same byte.
"""

from __future__ import annotations

import re

import numpy as np

from ptxc.emu.operands import Fault
from ptxc.emu.syncorder import SyncOrder

_LINE_BITS, _LIN_BITS = 20, 10
RELEASES = 8       # arrivals per thread whose preceding fence a reader may still rely on
_STAMP_SHIFT = _LINE_BITS + _LIN_BITS
_LIN_MASK = (1 << _LIN_BITS) - 1
_LINE_MASK = (1 << _LINE_BITS) - 1
# Reader words: stamp << 32 | CROSS | MULTI | line << 10 | reader (the last one). MULTI: other
# threads read it too since the CTA's last barrier; CROSS: some of them in another warp.
_READ_SHIFT = 32
_MULTI, _CROSS = 1 << 30, 1 << 31
# Instructions that can complete a counted barrier (pair_sync events): any mbarrier operation
# (incl. cp.async.mbarrier.arrive and the bulk copies' complete_tx) and a bar / barrier with a
# thread count (matched loosely: any operand list with a comma; a false match only costs time).
# Instructions whose shared-memory operands are read through the async proxy (async_read).
_ASYNC_READER = re.compile(r"\b(?:wgmma\.mma_async|tcgen05\.mma|cp\.async\.bulk\.tensor\.\w+\.global)\b")
_COUNTED = re.compile(r"mbarrier|\b(?:bar|barrier)(?:\.[\w:]+)*\s[^;]*,")


def _scatter_items(arr, rows, total: int, values):
    """arr viewed as `total`-element items: arr[item rows] = values (n, total) int64. Pairs of
    int64 move as complex128 (numpy scatters wide void items slowly)."""
    if total == 1:
        arr[rows] = values.reshape(-1)
        return
    half = total // 2
    idx = (rows[:, None] * half + np.arange(half)).reshape(-1)
    arr.view(np.complex128)[idx] = np.ascontiguousarray(values).view(np.complex128).reshape(-1)


def _words(rows, total: int):
    """Items of `total` bytes -> (item rows, words per item) of the 4-byte reader shadow."""
    if total >= 4:
        return rows, total // 4
    return (rows * total) >> 2, 1


def _as_read_stamp(cta_sync, ndim: int):
    """CTA barrier stamps in reader-word units: word >= this <=> read after the barrier."""
    s = cta_sync << _READ_SHIFT
    return s[:, None] if ndim == 2 else s


class RaceTracker(SyncOrder):
    """Shadow state of one batch's shared memory (see the module docstring), on the batch's
    sync events (SyncOrder)."""

    def __init__(self, ctx, nbytes: int, lines: dict):
        super().__init__(ctx)
        self.lines = lines                         # PTX line -> instruction text
        self.shadow = np.zeros(nbytes, np.int64)        # last write of each byte
        self.readers = np.zeros(nbytes // 4, np.int64)  # reads of each 4-byte word since then
        # bit w: warp w read the word since then -- only what counted barriers need, so kept
        # only in programs that have one (the bookkeeping costs every shared read)
        counted = any(_COUNTED.search(t) for t in lines.values())
        self.reader_warps = np.zeros(nbytes // 4, np.int64) if counted else None
        self.views = {}
        # serial of each CTA's last shared write / read: when older than its last barrier, no
        # byte can be unordered and the per-byte checks are skipped
        self.last_write = np.zeros(ctx.nctas, np.int64)
        self.last_read = np.zeros(ctx.nctas, np.int64)
        self.scratch = self.scratch_flags = None          # per reader word, on demand
        # last write through the generic proxy, per byte: kept only in programs whose tensor
        # cores read shared memory (the only async-proxy reads checked), as every store sets it
        async_reads = any(_ASYNC_READER.search(t) for t in lines.values())
        self.generic = np.zeros(nbytes, np.bool_) if async_reads else None
        self.fenced = np.zeros(ctx.n, np.int64)            # each thread's last fence.proxy.async
        self.fenced_after = np.zeros(ctx.n, np.int64)      # ... and its CTA's barrier then
        # each thread's last fence before its CTA's last barrier: a later fence (of a later
        # write) must not hide the one a CTA barrier already published
        self.fenced_published = np.zeros(ctx.n, np.int64)
        # ... and before each of its last RELEASES arrivals (mbarrier, bar.arrive): (arrival
        # stamp, fence) rings, so that a writer that fences and arrives again for its next
        # tile does not hide the release a reader of the last one observed
        self.released = np.zeros((ctx.n, RELEASES, 2), np.int64)
        self.released_next = np.zeros(ctx.n, np.int64)

    def release(self, threads, stamp: int) -> None:
        """The threads `threads` arrived at `stamp` (an mbarrier arrival, a bar.arrive): their
        fences so far are published to whoever observes that arrival."""
        if self.generic is None:
            return
        slot = self.released_next[threads] % RELEASES
        self.released[threads, slot, 0] = stamp
        self.released[threads, slot, 1] = self.fenced[threads]
        self.released_next[threads] += 1

    def _released_before(self, writer, stamp, cta, reader):
        """Whether `writer` fenced after `stamp` and then arrived at a barrier phase the
        reader's warp has observed (its pair_sync from the writer's warp is that arrival's or
        newer), within its last RELEASES arrivals."""
        if self.pair_sync is None:
            return np.zeros(writer.shape, bool)
        rel = self.released[writer]                        # (m, RELEASES, 2)
        after = np.where(rel[..., 1] > stamp[:, None], rel[..., 0], np.iinfo(np.int64).max).min(axis=1)
        seen = self.pair_sync[cta, self.ctx.lin[writer] >> 5, self.ctx.lin[reader] >> 5]
        return (after <= seen) & (after > 0)

    def cta_barrier(self, ctas=None):
        super().cta_barrier(ctas)
        if ctas is None:
            self.fenced_published[:] = self.fenced
        else:
            mine = np.isin(self.ctx.cta_of, ctas)
            self.fenced_published[mine] = self.fenced[mine]

    def proxy_fence(self, sel):
        """fence.proxy.async by the threads `sel` (shared memory between the generic and async
        proxies)."""
        idx = self.ctx.all_index if isinstance(sel, slice) else sel
        self.fenced[idx] = self._tick()
        self.fenced_after[idx] = self.cta_sync[self.ctx.cta_of[idx]]

    # ------------------------------------------------------------------ accesses
    def _rows(self, total: int, readers: bool = False):
        key = (total, readers)
        v = self.views.get(key)
        if v is None:
            base = self.readers if readers else self.shadow
            v = self.views[key] = base.view(np.dtype((np.void, 8 * total)))
        return v

    def _unordered(self, stamp, cta, idx, me, other, multi=None, cross=None, warps=None):
        """Mask of accesses by `me` not ordered after the recorded access(es) of `other`
        (multi: several threads did it; cross: some of them in another warp; warps: the mask
        of the warps that did)."""
        live = stamp >= self.cta_sync[cta][:, None]
        race = live & (other != me)
        if multi is not None:
            race |= live & multi
        if not race.any():
            return race
        warp = (idx >> 5)[:, None]
        same_warp = (other >> 5) == (me >> 5)
        if cross is not None:
            same_warp &= ~cross
        race &= ~(same_warp & (self.warp_sync[warp] > stamp))
        if self.pair_sync is not None and race.any():
            ordered = self.pair_sync[cta[:, None], other >> 5, me >> 5] > stamp
            if multi is not None:
                ordered = np.where(multi, self._paired_with_all(stamp, cta, me, warps), ordered) \
                    if warps is not None else ordered & ~multi
            race &= ~ordered
        return race

    def _paired_with_all(self, stamp, cta, me, warps):
        """Whether a counted-barrier event newer than `stamp` paired `me`'s warp with every
        warp of the mask `warps` (n, k each)."""
        nw = self.tensor_cores                          # the real warps' rows only
        w = np.arange(nw)
        pairs = self.pair_sync[cta[:, None], w[None, :], (me >> 5)]          # (n, nw)
        bits = ((warps[..., None] >> w) & 1) != 0                           # (n, k, nw)
        newest_needed = np.where(bits, pairs[:, None, :], np.iinfo(np.int64).max).min(axis=2)
        return newest_needed > stamp

    def check(self, rows, total: int, idx, line: int, what: str, addr_of):
        """Raise if an access (`what`: 'read'/'write') of `total`-byte items `rows` by threads
        `idx` (batch indices) is not ordered after the last write of each byte (and, for a
        write, after the reads of it since then)."""
        cta = self.ctx.cta_of[idx]
        fresh_writes = (self.last_write[cta] >= self.cta_sync[cta]).any()
        if what == "write":
            fresh_reads = (self.last_read[cta] >= self.cta_sync[cta]).any()
            self.last_write[cta] = self.serial
            if not (fresh_writes or fresh_reads):
                return
        elif not fresh_writes:
            return
        sh = self._rows(total)[rows].view(np.int64).reshape(-1, total)
        stamp = sh >> _STAMP_SHIFT
        if fresh_writes and (stamp >= self.cta_sync[cta][:, None]).any():
            me = (self.ctx.lin[idx])[:, None]
            race = self._unordered(stamp, cta, idx, me, sh & _LIN_MASK)
            if race.any():
                k, b = (int(x[0]) for x in np.nonzero(race))
                self._report(k, b, sh[k, b], idx, line, what, addr_of, "wrote")
        if what != "write":
            return
        wrows, wtotal = _words(rows, total)
        rd = self._rows(wtotal, True)[wrows].view(np.int64).reshape(-1, wtotal)
        rstamp = rd >> _READ_SHIFT
        if not (rstamp >= self.cta_sync[cta][:, None]).any():
            return
        me = (self.ctx.lin[idx])[:, None]
        warps = None if self.reader_warps is None else \
            self.reader_warps[(wrows[:, None] * wtotal + np.arange(wtotal))]
        race = self._unordered(rstamp, cta, idx, me, rd & _LIN_MASK,
                               multi=(rd & _MULTI) != 0, cross=(rd & _CROSS) != 0, warps=warps)
        if race.any():
            k, w = (int(x[0]) for x in np.nonzero(race))
            self._report(k, 4 * w, rd[k, w], idx, line, what, addr_of, "read")

    def read(self, rows, total: int, idx, line: int, addr_of):
        """A read: check it against the last writes, then remember the reader."""
        self.check(rows, total, idx, line, "read", addr_of)
        cta, me = self.ctx.cta_of[idx], self.ctx.lin[idx]
        rows, total = _words(rows, total)
        superseded = self._superseded(rows, total, cta, me)
        if self.reader_warps is not None:
            self._note_reader_warps(rows, total, cta, me, superseded)
        if (self.last_read[cta] >= self.cta_sync[cta]).any():
            old = self._rows(total, True)[rows].view(np.int64).reshape(-1, total)
            if superseded is not None:       # as if read before the CTA's last barrier
                old = np.where(superseded, -1, old)
            first = old[:, 0]
            if total > 1 and not (old == first[:, None]).all():
                self.last_read[cta] = self.serial
                self._read_bytes(rows, total, cta, me, line, old)
                return
            word = self._reader_word(first, cta, me, line)
        else:                         # the CTA's first reads since its last barrier
            word = (np.int64(self.serial) << _READ_SHIFT) | (line << _LIN_BITS) | me
        self.last_read[cta] = self.serial
        word = word | self._same_instruction_readers(rows, me)
        # Every item's words share one reader record (whole-item accesses).
        full = np.empty((rows.size, total), np.int64)
        full[:] = word[:, None]
        _scatter_items(self.readers, rows, total, full)

    def _superseded(self, rows, total, cta, me):
        """Per word, whether its recorded reads (since the CTA's last barrier) are all ordered
        before this read by a counted barrier that paired each reader's warp with this one's
        after the newest of them -- two warps that read a row, meet at a named barrier, and
        one rewrites it: its own new read must not carry the other's old one past the barrier
        (ordering is transitive, so a later write ordered after this read is ordered after
        those too). None where no counted barrier has run."""
        if self.pair_sync is None or self.reader_warps is None or \
                not (self.last_read[cta] >= self.cta_sync[cta]).any():
            return None
        flat = rows[:, None] * total + np.arange(total)
        old = self.readers[flat]
        # only words other threads read since the barrier: a thread's re-read of its own words
        # (the common case) needs no pairing look-up
        others = (old >= _as_read_stamp(self.cta_sync[cta], 2)) & \
            (((old & _LIN_MASK) != me[:, None]) | ((old & _MULTI) != 0))
        if not others.any():
            return None
        return others & self._paired_with_all(old >> _READ_SHIFT, cta, me[:, None], self.reader_warps[flat])

    def _note_reader_warps(self, rows, total, cta, me, superseded=None):
        """Add the readers' warps to each word's mask (reset where its reads predate the CTA's
        last barrier, or are `superseded`), before the reader records are replaced."""
        flat = (rows[:, None] * total + np.arange(total)).reshape(-1)
        if (self.last_read[cta] >= self.cta_sync[cta]).any():
            old = self.readers[flat].reshape(-1, total)
            stale = old < _as_read_stamp(self.cta_sync[cta], 2)
            if superseded is not None:
                stale |= superseded
            self.reader_warps[flat[stale.reshape(-1)]] = 0
        else:
            self.reader_warps[flat] = 0
        bits = np.left_shift(np.int64(1), (me >> 5).astype(np.int64))
        np.bitwise_or.at(self.reader_warps, flat, np.repeat(bits, total))

    def _same_instruction_readers(self, rows, me):
        """MULTI/CROSS flags for items that several threads of this instruction read (numpy
        keeps one of their records, so each record must already say so)."""
        n = rows.size
        if self.scratch is None:
            self.scratch = np.zeros(self.readers.size, np.int32)
            self.scratch_flags = np.zeros(self.readers.size, np.int8)
        order = np.arange(n, dtype=np.int32)
        self.scratch[rows] = order
        winner = self.scratch[rows]
        dup = winner != order
        if not dup.any():
            return 0
        cross = (me >> 5) != (me[winner] >> 5)
        flags = self.scratch_flags
        flags[rows[dup]] = 1
        flags[rows[cross]] = 3
        got = flags[rows]
        flags[rows] = 0
        return np.where(got & 1, _MULTI, 0) | np.where(got & 2, _CROSS, 0)

    def _reader_word(self, old, cta, me, line):
        """New reader records (any shape broadcastable with me/cta) given the old ones."""
        live = old >= _as_read_stamp(self.cta_sync[cta], old.ndim)     # reads since a barrier
        if old.ndim == 2:
            me, cta = me[:, None], cta
        word = (np.int64(self.serial) << _READ_SHIFT) | (line << _LIN_BITS) | me
        if live.any():
            other = old & _LIN_MASK
            several = live & ((other != me) | ((old & _MULTI) != 0))
            cross = several & (((old & _CROSS) != 0) | ((other >> 5) != (me >> 5)))
            word = word | np.where(several, _MULTI, 0) | np.where(cross, _CROSS, 0)
        return word

    def _read_bytes(self, rows, total, cta, me, line, old):
        """General path: word-wise reader records (items partly read before)."""
        word = np.broadcast_to(self._reader_word(old, cta, me, line), old.shape)
        flat = rows[:, None] * total + np.arange(total)
        self.readers[flat] = word
        back = self.readers[flat]
        dup = (back & _LIN_MASK) != me[:, None]
        if dup.any():
            cross = dup & (((back & _LIN_MASK) >> 5) != (me >> 5)[:, None])
            self.readers[flat[dup]] = back[dup] | _MULTI
            if cross.any():
                self.readers[flat[cross]] = back[cross] | (_MULTI | _CROSS)

    def record(self, rows, total: int, idx, line: int):
        """The threads `idx` wrote `total`-byte items `rows` at PTX line `line` (generic proxy)."""
        word = (np.int64(self.serial) << _STAMP_SHIFT) | (line << _LIN_BITS) | self.ctx.lin[idx]
        full = np.empty((word.size, total), np.int64)
        full[:] = word[:, None]
        _scatter_items(self.shadow, rows, total, full)
        if self.generic is not None:
            self.generic[(rows[:, None] * total + np.arange(total)).reshape(-1)] = True

    def record_copy(self, dst, size: int, idx, line: int, async_proxy: bool = False,
                    stamp: int | None = None):
        """Thread idx[i] wrote `size` bytes at flat shared offset dst[i] (a completed cp.async,
        or with `async_proxy` a bulk / TMA copy, ordered like its issuer's accesses up to
        `stamp`; dst is aligned to size)."""
        when = self.serial if stamp is None else stamp
        word = (np.int64(when) << _STAMP_SHIFT) | (line << _LIN_BITS) | self.ctx.lin[idx]
        full = np.empty((word.size, size), np.int64)
        full[:] = word[:, None]
        _scatter_items(self.shadow, dst // size, size, full)
        if self.generic is not None:
            self.generic[(dst[:, None] + np.arange(size)).reshape(-1)] = not async_proxy
        self.last_write[self.ctx.cta_of[idx]] = self.serial

    def async_read(self, rows, total: int, idx, line: int, what: str, addr_of):
        """An async-proxy read (`what`: wgmma / tcgen05.mma operand) of `total`-byte items
        `rows` by threads `idx`: every byte last written through the generic proxy must be
        ordered after a fence.proxy.async (the module docstring's rule)."""
        if self.generic is None:
            return
        flat = rows[:, None] * total + np.arange(total)
        generic = self.generic[flat]
        if not generic.any():
            return
        k, b = np.nonzero(generic)
        word = self.shadow[flat[k, b]]
        stamp = word >> _STAMP_SHIFT
        me = idx[k]
        lin = self.ctx.lin[me]
        writer = me - lin + (word & _LIN_MASK)
        cta = self.ctx.cta_of[me]
        f = self.fenced[writer]
        synced = (writer == me) | (self.cta_sync[cta] > f)
        same_warp = (writer >> 5) == (me >> 5)
        synced |= same_warp & (self.warp_sync[me >> 5] > f)
        if self.pair_sync is not None:
            synced |= self.pair_sync[cta, (word & _LIN_MASK) >> 5, lin >> 5] > f
        ordered = ((f > stamp) & synced) | (self.fenced_published[writer] > stamp) | \
            ((self.fenced[me] > stamp) & ((writer == me) | (self.fenced_after[me] > stamp)))
        if not ordered.all():
            ordered |= self._released_before(writer, stamp, cta, me)
        if ordered.all():
            return
        i = int(np.flatnonzero(~ordered)[0])
        t, w = int(me[i]), int(word[i])
        _, tid = self.ctx.coords(int(writer[i]))
        other_line = (w >> _LIN_BITS) & _LINE_MASK
        a = addr_of(int(k[i])) + int(b[i])
        raise Fault(f"shared-memory proxy race: {what} reads shared address 0x{a:x} through the "
                    f"async proxy, which thread tid=({tid[0]}, {tid[1]}, {tid[2]}) wrote through "
                    f"the generic proxy at line {other_line} (`{self.lines.get(other_line, '?')}`) "
                    f"with no fence.proxy.async ordered in between (by the writer before a "
                    f"barrier, or by the reader after one)", t, a)

    def _report(self, k, b, word, idx, line, what, addr_of, did):
        ctx = self.ctx
        me = int(idx[k])
        other = me - int(ctx.lin[me]) + int(word & _LIN_MASK)
        other_line = int((word >> _LIN_BITS) & _LINE_MASK)
        _, tid = ctx.coords(other)
        a = addr_of(k) + b
        text = self.lines.get(other_line, "?")
        same = "the same warp" if (other >> 5) == (me >> 5) else "another warp"
        if did == "read" and other == me:           # this thread read it too; others did
            who = "other threads"
        else:
            who = f"thread tid=({tid[0]}, {tid[1]}, {tid[2]}) ({same})"
            if did == "read" and word & _MULTI:
                who += " and others"
        cross = did == "read" and word & _CROSS
        sync = "barrier" if same == "another warp" or cross else \
            "bar.warp.sync, warp collective or barrier"
        hazard = " (write after read)" if did == "read" else ""
        raise Fault(f"shared-memory race{hazard}: {what} of shared address 0x{a:x} that "
                    f"{who} {did} at line {other_line} (`{text}`) with no {sync} in between",
                    me, a)
