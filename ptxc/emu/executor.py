"""Runs a decoded program for one batch of CTAs, all threads vectorised.

Scheduling: every thread has a pc; each step executes the instruction at the LOWEST pc among
runnable threads, for exactly the threads at that pc. Divergent paths therefore reconverge at
the lowest pc, and threads of different CTAs at the same pc run together. To keep the common
cases cheap the threads at the lowest pc form a "group" that runs with a scalar pc (no
per-thread pc bookkeeping) until it reaches the lowest pc of any other thread, splits at a
branch, or meets an instruction that needs per-thread treatment (exit, barrier). When the group
is every live thread and none has exited, selections are `slice(None)` and every register read
is a view.

Barriers (bar.sync, named barriers, bar.arrive) and their divergence / deadlock reports are
barriers.py's (BarrierScheduling, mixed in here). Completed barriers and warp syncs are sync
events for the race tracker (racecheck.py); uninitialised-register checks are bound per op
(uninit.py).
"""

from __future__ import annotations

import numpy as np

from ptxc.emu.barriers import BarrierScheduling
from ptxc.emu.decode import BARRIER, BRANCH, EXIT, NORMAL, PARK
from ptxc.emu.operands import ALL, Fault
from ptxc.emu.ops_wgmma import bind_wgmma_checks
from ptxc.emu.uninit import bind_init_checks, check_defined
from ptxc.errors import EmulationError

BIG = np.iinfo(np.int64).max


class BatchRun(BarrierScheduling):
    """The scheduler state of one batch; `run()` executes it to completion."""

    def __init__(self, program, ctx: BatchContext, step_limit: int):
        self.program, self.ctx, self.step_limit = program, ctx, step_limit
        self.ops = program.ops
        self.bound = [op.bind(ctx) if op.kind in (NORMAL, PARK) else None for op in self.ops]
        self.init_checks = bind_init_checks(program.init, ctx, self.ops, self.bound)
        bind_wgmma_checks(program, ctx, self.ops, self.bound)
        self.kinds = [op.kind for op in self.ops]
        self.guards = [None if op.ins.guard is None else
                       (ctx.regs[op.ins.guard.name].bits, op.ins.guard.neg) for op in self.ops]
        n = ctx.n
        self.exited = np.zeros(n, np.bool_)
        self.exited[ctx.lin >= ctx.nthreads] = True         # padding up to whole warps
        self.n_live = ctx.nctas * ctx.nthreads
        self.pc_eff = np.full(n, BIG, np.int64)             # BIG: exited or waiting
        # The current group: threads sharing a pc that run without per-thread pcs until they
        # reach `limit`, the lowest pc of any other thread. Its pc_eff entries are stale.
        self.group_sel = ALL if self.n_live == n else np.flatnonzero(~self.exited)
        self.group_n, self.pc, self.limit, self.has_group = self.n_live, 0, BIG, True
        self.waiting = np.zeros(n, np.bool_)
        self.wait_pc = np.zeros(n, np.int64)
        self.n_waiting = 0
        # what a waiting thread's barrier is counted by: an uncounted bar.sync by its
        # instruction, a counted one by its id (slot nops + 1 + id)
        nops = len(self.ops)
        self.bar_slot = np.array([nops + 1 + op.bar_id if op.kind == BARRIER and op.bar_count is not None
                                  else pc for pc, op in enumerate(self.ops)] + [nops], np.int64)
        # a counted barrier's thread count per pc (-1: uncounted or not a barrier)
        self.bar_count_of = np.array([op.bar_count if op.kind == BARRIER and op.bar_count is not None
                                      else -1 for op in self.ops] + [-1], np.int64)
        self.bar_arrived = np.zeros((ctx.nctas, 16), np.int64)   # bar.arrive's in the open phase
        # (cta, id) -> [(threads, race stamp, knowledge)] of the open phase
        self.bar_arrivers: dict = {}
        # threads whose mbarrier wait failed yield until some mbarrier phase completes
        self.parked = np.zeros(n, np.bool_)
        self.park_version = np.zeros(n, np.int64)
        self.thread_instructions = 0
        self.steps = 0
        self.cur_pc, self.cur_sel = 0, ALL

    # ------------------------------------------------------------------ helpers
    def _guard(self, pc, sel, nsel):
        """Threads of `sel` whose guard predicate holds: sel itself, None, or an index array."""
        g = self.guards[pc]
        if g is None:
            return sel
        arr, neg = g
        p = arr[sel]
        if neg:
            p = ~p
        cnt = int(np.count_nonzero(p))
        if cnt == nsel:
            return sel
        if cnt == 0:
            return None
        return np.flatnonzero(p) if isinstance(sel, slice) else sel[p]

    # ------------------------------------------------------------------ main loop
    def run(self):
        try:
            with np.errstate(all="ignore"):
                while self.n_live > 0:
                    if self.has_group:
                        self._run_group()
                    else:
                        self._pick_group()
                    if self.steps > self.step_limit:
                        raise self._step_limit_fault()
                if self.ctx.tmem is not None:
                    self.cur_pc = len(self.ops)          # reported as the end of the kernel
                    self.ctx.tmem.check_released()
                if self.ctx.bulk_stores is not None:
                    self.cur_pc = len(self.ops)
                    self.ctx.bulk_stores.check_drained()
        except Fault as fault:
            raise self._error(fault) from None

    def _step_limit_fault(self):
        return Fault(f"step limit of {self.step_limit} instruction issues exceeded "
                     f"(an infinite loop?)")

    def _pick_group(self):
        """Form the next group: the runnable threads at the lowest pc."""
        pe = self.pc_eff
        m = int(pe.min())
        if m == BIG:
            if self.n_waiting and self._release_barriers():
                return
            if self.parked.any():
                self._unpark()
                return
            self._report_stuck()
        at_m = pe == m
        sel = np.flatnonzero(at_m)
        self.pc, self.group_n, self.has_group = m, sel.size, True
        if sel.size == self.n_live:       # every live thread: converged
            self.group_sel = ALL if self.n_live == self.ctx.n else sel
            self.limit = BIG
        else:
            self.group_sel = sel
            self.limit = int(np.where(at_m, BIG, pe).min())

    def _run_group(self):
        """Run the group's instructions while it stays together below `limit`; hand an
        instruction that needs per-thread treatment to the general path."""
        ops, bound, kinds, guards = self.ops, self.bound, self.kinds, self.guards
        nops, limit = len(ops), self.limit
        pc, sel, nsel = self.pc, self.group_sel, self.group_n
        full = limit == BIG and nsel == self.n_live    # all live threads of the batch
        steps = 0
        try:
            while pc < limit:
                kind = kinds[pc] if pc < nops else EXIT    # falling off the end exits
                if kind == NORMAL:
                    s2 = self._guard(pc, sel, nsel) if guards[pc] else sel
                    if s2 is not None:
                        self.cur_pc, self.cur_sel = pc, s2
                        bound[pc](s2)
                    pc += 1
                    steps += 1
                    continue
                if kind == BRANCH:
                    if pc in self.init_checks:
                        self.cur_pc, self.cur_sel = pc, sel
                        check_defined(self.init_checks[pc], sel)
                    taken = self._guard(pc, sel, nsel)
                    if taken is None:
                        pc += 1
                    elif taken is sel:
                        if ops[pc].target <= pc and self.steps + steps > self.step_limit:
                            self.cur_pc, self.cur_sel = pc, sel
                            raise self._step_limit_fault()
                        pc = ops[pc].target
                    else:
                        break                     # the group splits
                    steps += 1
                    continue
                if full and kind == EXIT and (pc >= nops or guards[pc] is None):
                    steps += 1
                    self.n_live = 0               # every live thread exits
                    self.has_group = False
                    return
                if full and kind == BARRIER and guards[pc] is None and \
                        ops[pc].bar_count is None:
                    pc += 1                       # every live thread of every CTA arrives
                    steps += 1
                    if self.ctx.race is not None:
                        self.ctx.race.cta_barrier()
                    continue
                break
        finally:
            self.steps += steps
            self.thread_instructions += steps * nsel
        self.has_group = False
        idx = self.ctx.all_index if isinstance(sel, slice) else sel
        if pc >= limit:                           # others are at `limit`: merge with them
            self.pc_eff[idx] = pc
            return
        self.cur_pc, self.cur_sel = pc, idx
        self.steps += 1
        self.thread_instructions += nsel
        self._exec_general(pc, idx)

    def _exec_general(self, pc, sel):
        pe = self.pc_eff
        if pc >= len(self.ops):
            self._exit_threads(sel)
            return
        op = self.ops[pc]
        if pc in self.init_checks:
            check_defined(self.init_checks[pc], sel)
        s2 = self._guard(pc, sel, sel.size)
        if op.kind == NORMAL:
            if s2 is not None:
                self.cur_sel = s2
                self.bound[pc](s2)
            pe[sel] = pc + 1
        elif op.kind == BRANCH:
            pe[sel] = pc + 1
            if s2 is not None:
                if op.uniform:
                    self._check_uniform(sel, s2)
                pe[s2] = op.target
        elif op.kind == EXIT:
            pe[sel] = pc + 1
            if s2 is not None:
                self._exit_threads(s2)
        elif op.kind == PARK:
            pe[sel] = pc + 1
            if s2 is not None:
                waiting = self.bound[pc](s2)
                # an mbarrier wait names its predicate; setmaxnreg.inc returns its waiters
                failed = s2[~self.ctx.regs[op.park_reg].bits[s2]] if op.park_reg else waiting
                if failed.size:              # yield: re-run the wait after a phase completes
                    self.parked[failed] = True
                    self.park_version[failed] = self.ctx.mbar.version
                    self.wait_pc[failed] = pc
                    pe[failed] = BIG
        else:  # BARRIER
            pe[sel] = pc + 1
            if s2 is not None:
                if op.aligned:
                    self._check_aligned_barrier(pc, s2)
                if op.arrive:
                    self._arrive(op, s2)
                    return
                self.waiting[s2] = True
                self.wait_pc[s2] = pc
                pe[s2] = BIG
                self.n_waiting += s2.size
                self._release_barriers()

    def _unpark(self):
        """Every runnable thread is blocked: parked waiters retry if a phase completed since
        they parked; otherwise nothing can ever complete their phase."""
        parked = np.flatnonzero(self.parked)
        retry = parked[self.park_version[parked] != self.ctx.mbar.version]
        if retry.size == 0:
            t = int(parked[0])
            self.cur_pc = int(self._park_pc(t))
            pool = [int(u) for u in parked if not self.ops[int(self._park_pc(int(u)))].park_reg]
            if pool:            # a setmaxnreg.inc: name the pool, not an mbarrier
                self.cur_pc = int(self._park_pc(pool[0]))
                raise Fault(self.ctx.register_pool().describe(pool[0]), pool[0])
            raise Fault("mbarrier deadlock: every thread waits on an mbarrier phase (or a "
                        "barrier) and no arrival or copy can complete one", t)
        self.parked[retry] = False
        self.pc_eff[retry] = self._park_pc(retry)

    def _park_pc(self, threads):
        """Parked threads re-run the wait they parked at (the instruction before pc_eff's
        resume point is recorded in wait_pc)."""
        return self.wait_pc[threads]

    def _exit_threads(self, idx):
        self.exited[idx] = True
        self.pc_eff[idx] = BIG
        self.n_live -= idx.size
        if self.n_waiting:
            self._release_barriers()

    def _check_uniform(self, sel, taken):
        warps = sel >> 5
        total = np.bincount(warps, minlength=1)
        hit = np.bincount(taken >> 5, minlength=total.size)
        mixed = (hit > 0) & (hit < total)
        if mixed.any():
            w = int(np.flatnonzero(mixed)[0])
            first = int(sel[np.flatnonzero(warps == w)[0]])
            raise Fault("bra.uni with a guard predicate that differs between the lanes of a "
                        "warp (undefined behaviour)", first)

    # ------------------------------------------------------------------ errors
    def _error(self, fault: Fault) -> EmulationError:
        pc = self.cur_pc
        ins = self.ops[pc].ins if pc < len(self.ops) else None
        thread = fault.thread
        if thread is None:
            sel = self.cur_sel
            thread = 0 if isinstance(sel, slice) else int(sel[0]) if len(sel) else 0
        ctaid, tid = self.ctx.coords(int(thread))
        entry = self.program.entry.name
        where = f"line {ins.line}: `{ins.text}`" if ins else "end of kernel"
        msg = (f"kernel '{entry}': {where}: {fault.message} "
               f"[block ctaid=({ctaid[0]}, {ctaid[1]}, {ctaid[2]}), "
               f"thread tid=({tid[0]}, {tid[1]}, {tid[2]})]")
        err = EmulationError(msg)
        err.kernel, err.ctaid, err.tid, err.address = entry, ctaid, tid, fault.address
        err.line, err.text = (ins.line, ins.text) if ins else (None, None)
        return err

