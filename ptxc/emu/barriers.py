"""The barrier side of the emulator's scheduler (executor.BatchRun mixes it in).

Barriers (bar.sync / barrier.sync a{, b}): a thread that reaches one waits. A barrier without
a thread count completes for a CTA when every non-exited thread of that CTA waits at that same
instruction (exited threads do not count, per the PTX ISA); with a count b, when b threads of
the CTA have arrived at barrier a: those waiting at any bar.sync a, b and those that passed a
bar.arrive a, b (which counts toward the phase without waiting: the producer/consumer and
ping-pong patterns of FlashAttention-3) -- counted barriers are per id, as in hardware. More
arrivals than b in one phase is an error (the hardware would complete the phase early and
count the rest toward the next). If a CTA can make no progress because its threads wait at
different uncounted barrier instructions (e.g. bar.sync inside an if/else), or a count is
never reached, the launch fails with a "barrier divergence" / "barrier deadlock" error.
Waiting at two different uncounted bar.sync instructions is reported even though sm_70+
hardware counts arrivals per barrier id: that pattern is a bug in CUDA's __syncthreads()
contract and never intended by ptxc.
An .aligned barrier (bar.sync, barrier.sync.aligned) reached by some lanes of a warp while
other live lanes of that warp are elsewhere is reported at once, naming both sides.
"""

from __future__ import annotations

import numpy as np

from ptxc.emu.operands import Fault


class BarrierScheduling:
    """Mixed into executor.BatchRun (uses its waiting / wait_pc / bar_* state, ops and ctx)."""

    def _barrier_groups(self):
        """The waiting threads grouped by CTA and barrier: (threads, group CTA, group slot,
        group of each thread, group sizes); a slot <= nops is an uncounted barrier's pc."""
        widx = np.flatnonzero(self.waiting)
        nkeys = len(self.ops) + 17
        key = self.ctx.cta_of[widx] * nkeys + self.bar_slot[self.wait_pc[widx]]
        uniq, inv, counts = np.unique(key, return_inverse=True, return_counts=True)
        return widx, uniq // nkeys, uniq % nkeys, inv, counts

    def _group_needs(self, widx, g_cta, g_slot, inv):
        """Per waiting group: (threads it completes at, bar.arrive's already in its phase), and
        the live threads per CTA -- every live thread of the CTA for an uncounted barrier; the
        waiters of one id must agree on the count."""
        nops = len(self.ops)
        counted = g_slot > nops
        need = self.bar_count_of[self.wait_pc[widx]]
        first = np.empty(len(g_slot), np.int64)
        first[inv[::-1]] = need[::-1]                  # each group's first waiter's count
        differ = np.flatnonzero(need != first[inv])
        if differ.size:
            t = int(widx[differ[0]])
            self.cur_pc = int(self.wait_pc[t])
            g = inv[differ[0]]
            theirs = sorted(set(need[inv == g].tolist()))
            raise Fault(f"threads wait on barrier {int(g_slot[g]) - nops - 1} with different thread "
                        f"counts ({', '.join(map(str, theirs))})", t)
        live = np.bincount(self.ctx.cta_of[~self.exited], minlength=self.ctx.nctas)
        bid = np.where(counted, g_slot - nops - 1, 0)
        required = np.where(counted, first, live[g_cta])
        arrived = np.where(counted, self.bar_arrived[g_cta, bid], 0)
        return required, arrived, live

    def _release_barriers(self) -> bool:
        widx, g_cta, g_slot, inv, counts = self._barrier_groups()
        required, arrived, live = self._group_needs(widx, g_cta, g_slot, inv)
        total = counts + arrived
        over = total > required
        if over.any():
            g = int(np.flatnonzero(over)[0])
            self.cur_pc = int(self.wait_pc[widx[np.flatnonzero(inv == g)[0]]])
            raise Fault(f"{total[g]} threads arrived at a barrier for "
                        f"{required[g]} threads", int(widx[np.flatnonzero(inv == g)[0]]))
        done = total == required
        if not done.any():
            return False
        rel = widx[done[inv]]
        if self.ctx.race is not None:
            self._barrier_sync_events(widx, inv, g_cta, g_slot, required, live, done)
        nops = len(self.ops)
        for g in np.flatnonzero(done & (g_slot > nops)).tolist():   # the phase is over
            bid = int(g_slot[g]) - nops - 1
            self.bar_arrived[int(g_cta[g]), bid] = 0
            self.bar_arrivers.pop((int(g_cta[g]), bid), None)
        self.waiting[rel] = False
        self.pc_eff[rel] = self.wait_pc[rel] + 1
        self.n_waiting -= rel.size
        return True

    def _arrive(self, op, threads):
        """bar.arrive a, b: the threads count toward barrier a's open phase and go on; a phase
        all of whose b threads arrive without waiting completes at once."""
        bid, count = op.bar_id, op.bar_count
        ctas = self.ctx.cta_of[threads]
        add = np.bincount(ctas, minlength=self.ctx.nctas)
        race = self.ctx.race
        stamp = race.arrival() if race is not None else 0
        if race is not None:
            race.release(threads, stamp)
        for c in np.flatnonzero(add).tolist():
            mine = threads[ctas == c]
            before = self.bar_arrivers.setdefault((c, bid), [])
            again = [t for t, *_ in before if np.isin(mine, t).any()]
            if again:
                raise Fault(f"a thread arrives twice at barrier {bid} in one phase (the "
                            f"hardware would count both arrivals: the phase completes early)",
                            int(mine[np.isin(mine, again[0])][0]))
            before.append((mine, stamp, race.knowledge(c, mine) if race is not None else None))
        self.bar_arrived[:, bid] += add
        over = self.bar_arrived[:, bid] > count
        if over.any():
            c = int(np.flatnonzero(over)[0])
            raise Fault(f"{int(self.bar_arrived[c, bid])} threads arrived at barrier {bid} for "
                        f"{count} threads (an arrival for the next phase before this one "
                        f"completed?)", int(threads[ctas == c][0]))
        if self.n_waiting:
            self._release_barriers()
        for c in np.flatnonzero(self.bar_arrived[:, bid] == count).tolist():
            self.bar_arrived[c, bid] = 0              # nobody waits: the phase is over
            self.bar_arrivers.pop((c, bid), None)

    def _barrier_sync_events(self, widx, inv, g_cta, g_slot, required, live, done):
        race, nops = self.ctx.race, len(self.ops)
        for g in np.flatnonzero(done).tolist():
            cta, slot = int(g_cta[g]), int(g_slot[g])
            arrivers = self.bar_arrivers.get((cta, slot - nops - 1), []) if slot > nops else []
            if (slot <= nops or required[g] >= live[cta]) and not arrivers:
                race.cta_barrier(cta)
            else:
                race.counted_barrier(cta, widx[inv == g], arrivers)

    def _check_aligned_barrier(self, pc, arriving):
        """bar.sync / barrier.sync.aligned must be executed by every non-exited thread of a
        warp together (PTX ISA, .aligned): lanes live elsewhere are barrier divergence."""
        warps = np.unique(arriving >> 5)
        lanes = (warps[:, None] * 32 + np.arange(32)).reshape(-1)
        flag = self.ctx.scratch_flag
        flag[arriving] = True
        arrives = flag[lanes]
        flag[arriving] = False
        waits_here = self.waiting[lanes] & (self.wait_pc[lanes] == pc)
        ok = (arrives | self.exited[lanes] | waits_here).reshape(-1, 32)
        if ok.all():
            return
        w = int(np.flatnonzero(~ok.all(axis=1))[0])
        warp_lanes, warp_arrives = lanes.reshape(-1, 32)[w], arrives.reshape(-1, 32)[w]
        at = [int(t) for t in warp_lanes[warp_arrives]]
        away = [int(t) for t in warp_lanes[~ok[w]]]
        where = sorted({int(self.wait_pc[t]) if self.waiting[t] else int(self.pc_eff[t])
                        for t in away})
        places = ", ".join(f"line {self.ops[p].ins.line} (`{self.ops[p].ins.text}`)"
                           if p < len(self.ops) else "the end of the kernel" for p in where)
        tid_at, tid_away = self.ctx.coords(at[0])[1], self.ctx.coords(away[0])[1]
        self.cur_pc = pc
        raise Fault(f"barrier divergence: lanes {_lane_list(at)} of warp "
                    f"{(at[0] % self.ctx.tpad) >> 5} (first thread tid={tid_at}) reached this "
                    f".aligned barrier while lanes {_lane_list(away)} of the same warp (first "
                    f"thread tid={tid_away}) are live elsewhere, at {places}; every non-exited "
                    f"thread of a warp must execute the barrier together", at[0])

    def _report_stuck(self):
        widx, g_cta, g_slot, inv, counts = self._barrier_groups()
        cta = int(g_cta[0])
        mine = widx[self.ctx.cta_of[widx] == cta]
        pcs = sorted(set(self.wait_pc[mine].tolist()))
        slots = sorted(set(g_slot[g_cta == cta].tolist()))
        first = int(mine[0])
        self.cur_pc = pcs[0]
        nops = len(self.ops)
        if len(slots) > 1 and all(sl > nops for sl in slots):   # named barriers, each short
            required = self._group_needs(widx, g_cta, g_slot, inv)[0]
            ids = ", ".join(f"{g_slot[g] - nops - 1} ({counts[g]} waiting, "
                            f"{self.bar_arrived[cta, g_slot[g] - nops - 1]} arrived, count {required[g]})"
                            for g in np.flatnonzero(g_cta == cta).tolist())
            raise Fault(f"barrier deadlock: threads of one CTA wait on named barriers {ids} "
                        f"and no thread is left to arrive", first)
        if len(slots) > 1:
            lines = ", ".join(f"line {self.ops[p].ins.line} (`{self.ops[p].ins.text}`)"
                              for p in pcs)
            raise Fault(f"barrier divergence: threads of one CTA wait at different barrier "
                        f"instructions ({lines}); no thread can make progress", first)
        live = int(np.count_nonzero(~self.exited & (self.ctx.cta_of == cta)))
        raise Fault(f"barrier deadlock: {int(counts[g_cta == cta][0])} of {live} live threads "
                    f"of the CTA wait here and the barrier's count is never reached", first)


def _lane_list(threads) -> str:
    lanes = [t & 31 for t in threads]
    runs, start = [], lanes[0]
    for a, b in zip(lanes, lanes[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ",".join(runs)


__all__ = ["BarrierScheduling"]
