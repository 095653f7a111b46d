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

Not tracked: write-after-read hazards (a write to a byte another thread read with no barrier
in between), atomics (they never race with each other and are not checked against plain
accesses), and several threads of ONE instruction storing to the same byte.
"""

from __future__ import annotations

import numpy as np

from ptxc.emu.operands import Fault

_LINE_BITS, _LIN_BITS = 20, 10
_STAMP_SHIFT = _LINE_BITS + _LIN_BITS
_LIN_MASK = (1 << _LIN_BITS) - 1
_LINE_MASK = (1 << _LINE_BITS) - 1


class RaceTracker:
    """Shadow state of one batch's shared memory (see the module docstring)."""

    def __init__(self, ctx, nbytes: int, lines: dict):
        self.ctx, self.lines = ctx, lines          # lines: PTX line -> instruction text
        self.shadow = np.zeros(nbytes, np.int64)
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
    def _rows(self, total: int):
        v = self.views.get(total)
        if v is None:
            v = self.views[total] = self.shadow.view(np.dtype((np.void, 8 * total)))
        return v

    def check(self, rows, total: int, idx, line: int, what: str, addr_of):
        """Raise if an access (`what`: 'read'/'write') of `total`-byte items `rows` by threads
        `idx` (batch indices) is not ordered after the last write of each byte."""
        sh = self._rows(total)[rows].view(np.int64).reshape(-1, total)
        stamp = sh >> _STAMP_SHIFT
        cta = self.ctx.cta_of[idx]
        unordered = stamp >= self.cta_sync[cta][:, None]
        if not unordered.any():
            return
        me = (self.ctx.lin[idx])[:, None]
        writer = sh & _LIN_MASK
        race = unordered & (writer != me)
        if race.any():
            warp = (idx >> 5)[:, None]
            same_warp = (writer >> 5) == (me >> 5)
            race &= ~(same_warp & (self.warp_sync[warp] > stamp))
            if self.pair_sync is not None and race.any():
                pairs = self.pair_sync[cta[:, None], writer >> 5, me >> 5]
                race &= ~(pairs > stamp)
        if race.any():
            k, b = (int(x[0]) for x in np.nonzero(race))
            self._report(k, b, sh[k, b], idx, line, what, addr_of)

    def record(self, rows, total: int, idx, line: int):
        """The threads `idx` wrote `total`-byte items `rows` at PTX line `line`."""
        word = (np.int64(self.serial) << _STAMP_SHIFT) | (line << _LIN_BITS) | self.ctx.lin[idx]
        self.shadow.reshape(-1, total)[rows] = word[:, None]

    def record_bytes(self, flat, idx, line: int):
        """Like record, for a (n, k) array of byte offsets written by thread idx[i] (row i)."""
        word = (np.int64(self.serial) << _STAMP_SHIFT) | (line << _LIN_BITS) | self.ctx.lin[idx]
        self.shadow[flat] = word[:, None]

    def _report(self, k, b, shadow_word, idx, line, what, addr_of):
        ctx = self.ctx
        me = int(idx[k])
        other = me - int(ctx.lin[me]) + int(shadow_word & _LIN_MASK)
        other_line = int((shadow_word >> _LIN_BITS) & _LINE_MASK)
        _, tid = ctx.coords(other)
        a = addr_of(k) + b
        kind = "read" if what == "read" else "write"
        text = self.lines.get(other_line, "?")
        same = "the same warp" if (other >> 5) == (me >> 5) else "another warp"
        sync = "bar.warp.sync, a warp collective or a barrier" if same == "the same warp" \
            else "barrier"
        raise Fault(f"shared-memory race: {kind} of shared address 0x{a:x} that thread "
                    f"tid=({tid[0]}, {tid[1]}, {tid[2]}) ({same}) wrote at line {other_line} "
                    f"(`{text}`) with no {sync} in between", me, a)
