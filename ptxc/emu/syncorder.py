"""The order synchronisation gives a batch's accesses: a counter of sync events and, per CTA,
which events order which warps' accesses -- what the shared-memory race checker (racecheck.py)
and tensor memory's ordering rules (tmem.py) ask of an access.

Every synchronisation event takes a fresh counter value (a *stamp*) and records it where it
orders accesses; an access remembers the counter's value when it happened, and a later access
is ordered after it iff an event that both took part in is newer:

* a CTA-wide barrier completing (``bar.sync 0`` and friends) -> ``cta_sync[cta]``;
* a barrier with a thread count completing -> ``pair_sync[cta, wa, wb]`` for every pair of
  warps that took part (wa's accesses before that stamp are ordered before wb's after it);
* an arrival (``bar.arrive``, an mbarrier arrival or a copy's issue) and the waits that observe
  its phase -> ``pair_sync[cta, arriving warp, waiting warp]``, at the arrival's stamp;
* a warp-level synchronisation (``bar.warp.sync``, and the warp collectives ``shfl.sync``,
  ``mma.sync``, ``ldmatrix``) -> ``warp_sync[warp]``.

Counted barriers are transitive: an arrival hands its waiters what the arriving warps were
ordered after (their ``pair_sync`` columns, `knowledge`), a named barrier merges its
participants', a CTA-wide barrier every warp's -- a release / acquire chain through a third
warp orders the first warp's accesses before the last one's, as the PTX memory model's
cumulative release / acquire does. A tcgen05.commit's arrival is the tensor cores' (a pseudo
warp per issuing warp w, ``pair_sync`` row ``tensor_cores + w``): its waiters are ordered after
the completion of w's MMAs up to the commit, and hand that on like any knowledge.
"""

from __future__ import annotations

import numpy as np


class SyncOrder:
    """One batch's sync events (see the module docstring)."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.serial = 1
        self.cta_sync = np.ones(ctx.nctas, np.int64)       # newer than every initial stamp 0
        self.warp_sync = np.zeros(ctx.n // 32, np.int64)
        # (nctas, 2 warps, 2 warps) on demand; index `tensor_cores + w` is a pseudo warp: the
        # tcgen05.commit arrivals of warp w's MMAs, made by the tensor cores as they complete
        self.pair_sync = None
        self.tensor_cores = ctx.tpad // 32

    def _tick(self) -> int:
        self.serial += 1
        return self.serial

    def cta_barrier(self, ctas=None):
        """A CTA-wide barrier completed for `ctas` (None: every CTA of the batch); what any warp
        was ordered after, every warp is now (transitivity; what matters beyond cta_sync is
        the tensor cores' row)."""
        s = self._tick()
        if ctas is None:
            self.cta_sync[:] = s
        else:
            self.cta_sync[ctas] = s
        p = self.pair_sync
        if p is not None:
            if ctas is None:
                p[:] = p.max(axis=2, keepdims=True)
            else:
                p[ctas] = p[ctas].max(axis=-1, keepdims=True)

    def _pairs(self):
        if self.pair_sync is None:
            n = 2 * self.tensor_cores
            self.pair_sync = np.zeros((self.ctx.nctas, n, n), np.int64)
        return self.pair_sync

    def tensor_core_arrival(self, warp: int):
        """(stamp, knowledge) of a tcgen05.commit's arrival by a thread of `warp` (index in
        its CTA): its waiters are ordered after the completion of that warp's MMAs up to the
        commit (a commit tracks every earlier MMA of its thread: the row of the warp's tensor
        cores), not after anything the issuing thread had been ordered after."""
        known = np.zeros(self._pairs().shape[1], np.int64)
        stamp = self._tick()
        known[self.tensor_cores + warp] = stamp
        return stamp, known

    def arrival(self) -> int:
        """The stamp of a bar.arrive: the arriving threads' accesses up to here are the ones
        its barrier's waiters are ordered after."""
        return self._tick()

    def knowledge(self, cta: int, threads):
        """What the warps of `threads` (batch indices, of `cta`) are ordered after now: for
        every warp x of the CTA, the newest stamp s such that x's accesses before s are ordered
        before theirs (their pair_sync columns; None before any counted barrier). An arrival
        hands it on to the barrier's waiters, so ordering is transitive: a release / acquire
        chain through a third warp (softmax -> correction -> MMA warp) orders the first warp's
        accesses before the last one's."""
        if self.pair_sync is None:
            return None
        warps = np.unique((threads % self.ctx.tpad) >> 5)
        return self.pair_sync[cta][:, warps].max(axis=1)

    def counted_barrier(self, cta: int, threads, arrivers=(), pair_waiters: bool = True):
        """A barrier with a thread count completed for `threads` (batch indices) of `cta`,
        which waited at it; `arrivers` [(threads, arrival stamp, their knowledge then)] passed
        a bar.arrive (or an mbarrier arrival) of the same phase without waiting: their accesses
        before the arrival, and what those were ordered after, are ordered before the waiters'
        later ones -- not the ones after it, nor anything in the reverse direction.
        `pair_waiters` False (an mbarrier wait): the waiters are not ordered among themselves."""
        s = self._tick()
        tpad = self.ctx.tpad
        sync = self._pairs()[cta]
        warps = np.unique((threads % tpad) >> 5)
        for who, stamp, known in arrivers:
            ix = np.ix_(np.unique((who % tpad) >> 5), warps)
            sync[ix] = np.maximum(sync[ix], stamp)
            if known is not None:
                sync[:, warps] = np.maximum(sync[:, warps], known[:, None])
        if pair_waiters:
            sync[:, warps] = sync[:, warps].max(axis=1)[:, None]
            sync[np.ix_(warps, warps)] = s

    def warp_synced(self, sel):
        """A warp-level sync (bar.warp.sync or a warp collective) by the threads `sel`."""
        s = self._tick()
        if isinstance(sel, slice):
            self.warp_sync[:] = s
        else:
            self.warp_sync[sel >> 5] = s
