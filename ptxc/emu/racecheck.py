"""Shared-memory race detection (what compute-sanitizer's racecheck does), cheap enough to be on
by default.

Every shared byte has a shadow word: who wrote it last and when,
``stamp << 30 | line << 10 | writer`` (writer: the thread's linear index in its CTA, line: the
PTX line of the write, stamp: the value of a batch-wide sync counter at the write). Every
synchronisation event takes a fresh counter value and records it where it orders accesses:

* a CTA-wide barrier completing (``bar.sync 0`` and friends) -> ``cta_sync[cta]``;
* a barrier with a thread count completing -> ``pair_sync[cta, wa, wb]`` for every pair of
  warps that took part;
* a warp-level synchronisation (``bar.warp.sync``, and the warp collectives ``shfl.sync``,
  ``mma.sync``, ``ldmatrix``) -> ``warp_sync[warp]``.

An access by thread U of a byte last written by thread T != U is ordered after that write iff
a sync event that both took part in happened after it: ``cta_sync > stamp``, or (same warp)
``warp_sync > stamp``, or (counted barrier) ``pair_sync > stamp``. A read (RAW) or a write
(WAW) that is not ordered is a race; the error names both accesses. The common case -- the
last CTA-wide barrier is newer than every byte touched -- costs one gather and one compare.

Reads are remembered too (the last reader, and whether other threads -- of the same warp or of
others -- read the byte since the CTA's last barrier), so a write that is not ordered after
another thread's read is a write-after-read race (WAR): the classic missing barrier before a
shared buffer is refilled. Several readers count as ordered only by a CTA-wide barrier (or a
warp sync when they all are in the writer's warp).

Not tracked: atomics (they never race with each other and are not checked against plain
accesses), and several threads of ONE instruction storing to the same byte.
"""

from __future__ import annotations

import numpy as np

from ptxc.emu.operands import Fault

_LINE_BITS, _LIN_BITS = 20, 10
_STAMP_SHIFT = _LINE_BITS + _LIN_BITS
_LIN_MASK = (1 << _LIN_BITS) - 1
_LINE_MASK = (1 << _LINE_BITS) - 1
# Reader words: stamp << 32 | CROSS | MULTI | line << 10 | reader (the last one). MULTI: other
# threads read it too since the CTA's last barrier; CROSS: some of them in another warp.
_READ_SHIFT = 32
_MULTI, _CROSS = 1 << 30, 1 << 31


class RaceTracker:
    """Shadow state of one batch's shared memory (see the module docstring)."""

    def __init__(self, ctx, nbytes: int, lines: dict):
        self.ctx, self.lines = ctx, lines          # lines: PTX line -> instruction text
        self.shadow = np.zeros(nbytes, np.int64)        # last write of each byte
        self.readers = np.zeros(nbytes, np.int64)       # reads of each byte since then
        self.views = {}
        self.serial = 1
        self.cta_sync = np.ones(ctx.nctas, np.int64)       # newer than every initial stamp 0
        self.warp_sync = np.zeros(ctx.n // 32, np.int64)
        self.pair_sync = None                              # (nctas, warps, warps) on demand

    # ------------------------------------------------------------------ sync events
    def _tick(self) -> int:
        self.serial += 1
        return self.serial

    def cta_barrier(self, ctas=None):
        """A CTA-wide barrier completed for `ctas` (None: every CTA of the batch)."""
        s = self._tick()
        if ctas is None:
            self.cta_sync[:] = s
        else:
            self.cta_sync[ctas] = s

    def counted_barrier(self, cta: int, threads):
        """A barrier with a thread count completed for `threads` (batch indices) of `cta`."""
        s = self._tick()
        tpad = self.ctx.tpad
        if self.pair_sync is None:
            self.pair_sync = np.zeros((self.ctx.nctas, tpad // 32, tpad // 32), np.int64)
        warps = np.unique((threads % tpad) >> 5)
        self.pair_sync[cta][np.ix_(warps, warps)] = s

    def warp_synced(self, sel):
        """A warp-level sync (bar.warp.sync or a warp collective) by the threads `sel`."""
        s = self._tick()
        if isinstance(sel, slice):
            self.warp_sync[:] = s
        else:
            self.warp_sync[sel >> 5] = s

    # ------------------------------------------------------------------ accesses
    def _rows(self, total: int, readers: bool = False):
        key = (total, readers)
        v = self.views.get(key)
        if v is None:
            base = self.readers if readers else self.shadow
            v = self.views[key] = base.view(np.dtype((np.void, 8 * total)))
        return v

    def _unordered(self, stamp, cta, idx, me, other, multi=None, cross=None):
        """Mask of accesses by `me` not ordered after the recorded access(es) of `other`
        (multi: several threads did it; cross: some of them in another warp)."""
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
                ordered &= ~multi
            race &= ~ordered
        return race

    def check(self, rows, total: int, idx, line: int, what: str, addr_of):
        """Raise if an access (`what`: 'read'/'write') of `total`-byte items `rows` by threads
        `idx` (batch indices) is not ordered after the last write of each byte (and, for a
        write, after the reads of it since then)."""
        cta = self.ctx.cta_of[idx]
        sh = self._rows(total)[rows].view(np.int64).reshape(-1, total)
        stamp = sh >> _STAMP_SHIFT
        if (stamp >= self.cta_sync[cta][:, None]).any():
            me = (self.ctx.lin[idx])[:, None]
            race = self._unordered(stamp, cta, idx, me, sh & _LIN_MASK)
            if race.any():
                k, b = (int(x[0]) for x in np.nonzero(race))
                self._report(k, b, sh[k, b], idx, line, what, addr_of, "wrote")
        if what != "write":
            return
        rd = self._rows(total, True)[rows].view(np.int64).reshape(-1, total)
        rstamp = rd >> _READ_SHIFT
        if not (rstamp >= self.cta_sync[cta][:, None]).any():
            return
        me = (self.ctx.lin[idx])[:, None]
        race = self._unordered(rstamp, cta, idx, me, rd & _LIN_MASK,
                               multi=(rd & _MULTI) != 0, cross=(rd & _CROSS) != 0)
        if race.any():
            k, b = (int(x[0]) for x in np.nonzero(race))
            self._report(k, b, rd[k, b], idx, line, what, addr_of, "read")

    def read(self, rows, total: int, idx, line: int, addr_of):
        """A read: check it against the last writes, then remember the reader."""
        self.check(rows, total, idx, line, "read", addr_of)
        cta, me = self.ctx.cta_of[idx], self.ctx.lin[idx][:, None]
        view = self.readers.reshape(-1, total)
        old = self._rows(total, True)[rows].view(np.int64).reshape(-1, total)
        live = (old >> _READ_SHIFT) >= self.cta_sync[cta][:, None]    # reads since a barrier
        word = (np.int64(self.serial) << _READ_SHIFT) | (line << _LIN_BITS) | me
        if live.any():
            other = old & _LIN_MASK
            several = live & ((other != me) | ((old & _MULTI) != 0))
            cross = several & (((old & _CROSS) != 0) | ((other >> 5) != (me >> 5)))
            word = word | np.where(several, _MULTI, 0) | np.where(cross, _CROSS, 0)
        view[rows] = word
        back = view[rows] & _LIN_MASK                 # lanes of this instruction reading the
        dup = back != me                              # same byte: one record survives
        if dup.any():
            extra = np.where(dup, _MULTI, 0) | np.where(dup & ((back >> 5) != (me >> 5)),
                                                         _CROSS, 0)
            np.bitwise_or.at(view, rows, extra)

    def record(self, rows, total: int, idx, line: int):
        """The threads `idx` wrote `total`-byte items `rows` at PTX line `line`."""
        word = (np.int64(self.serial) << _STAMP_SHIFT) | (line << _LIN_BITS) | self.ctx.lin[idx]
        self.shadow.reshape(-1, total)[rows] = word[:, None]

    def record_bytes(self, flat, idx, line: int):
        """Like record, for a (n, k) array of byte offsets written by thread idx[i] (row i)."""
        word = (np.int64(self.serial) << _STAMP_SHIFT) | (line << _LIN_BITS) | self.ctx.lin[idx]
        self.shadow[flat] = word[:, None]

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
