"""Tensor memory (Blackwell): per CTA 128 lanes x 512 columns of 32-bit cells, allocated by
columns, written by tcgen05.mma / tcgen05.st and read by tcgen05.ld / tcgen05.mma.

What it checks (each a Fault naming the line and the thread, hence the warp):
* allocation: tcgen05.alloc of a power of two from 32 to 512 columns, none after the CTA
  relinquished its permit; tcgen05.dealloc of exactly one live allocation (a second dealloc of
  it is a double free); every allocation released before the CTA exits (a leak otherwise);
* every access inside this CTA's allocated columns and, for a warp's tcgen05.ld / st, inside
  the 32 lanes of its sub-partition (32 * (warp id % 4) onwards);
* no read of a never-written cell;
* no tcgen05.ld / tcgen05.st / dealloc of cells that a tcgen05.mma still writes: an MMA's
  cells stay *in flight* from its issue until a wait observes the mbarrier phase that a later
  tcgen05.commit of the issuing thread arrives on -- a commit tracks every earlier MMA of its
  thread not yet complete, as the PTX ISA defines it (a missing commit, or a read before the
  wait, is caught there);
* no tcgen05.mma or tcgen05.ld reading cells that a tcgen05.st has not completed (the storing
  warp's tcgen05.wait::st completes them).

The MMA's values are written when it is issued (as for wgmma, nothing may observe the cells
before it completes, so this is the value every legal observer sees).
"""

from __future__ import annotations

import numpy as np

from ptxc.emu.operands import Fault
from ptxc.emu.tcgen05_layout import COLUMNS, LANES


class MmaRecord:
    """One issued tcgen05.mma: the cells it writes and the shared chunks it reads."""

    __slots__ = ("cta", "lanes", "cols", "smem_rows", "thread", "line", "done")

    def __init__(self, cta, lanes, cols, smem_rows, thread, line):
        self.cta, self.lanes, self.cols = cta, lanes, cols
        self.smem_rows, self.thread, self.line = smem_rows, thread, line
        self.done = False


class TensorMemory:
    def __init__(self, ctx):
        n = ctx.nctas
        self.ctx = ctx
        self.data = np.zeros((n, LANES, COLUMNS), np.uint32)
        self.written = np.zeros((n, LANES, COLUMNS), np.bool_)
        self.in_flight = np.zeros((n, LANES, COLUMNS), np.int32)    # tcgen05.mma writes
        self.stored = np.zeros((n, LANES, COLUMNS), np.int32)       # tcgen05.st not waited
        self.allocated = np.zeros((n, COLUMNS), np.bool_)
        self.allocs = [dict() for _ in range(n)]                   # column -> columns
        self.relinquished = np.zeros(n, np.bool_)
        self.live: dict = {}            # issuing thread -> its MMAs not yet complete
        self.stores: dict = {}          # warp -> [(cta, lanes, cols)] before tcgen05.wait::st
        smem = ctx.smem
        if smem.async_readers is None:
            smem.async_readers = np.zeros(smem.data.size // 16 + 1, np.int32)
        smem.async_reader = ("a tcgen05.mma in flight reads, before a wait observes the "
                             "mbarrier phase of a tcgen05.commit issued after it")

    # ------------------------------------------------------------------ allocation
    def alloc(self, cta: int, ncols: int, thread: int) -> int:
        if ncols < 32 or ncols > COLUMNS or ncols & (ncols - 1):
            raise Fault(f"tcgen05.alloc of {ncols} columns: the count must be a power of two "
                        f"from 32 to {COLUMNS}", thread)
        if self.relinquished[cta]:
            raise Fault("tcgen05.alloc after this CTA's tcgen05.relinquish_alloc_permit",
                        thread)
        taken = self.allocated[cta].reshape(-1, ncols).any(axis=1)
        free = np.flatnonzero(~taken)
        if free.size == 0:
            used = int(self.allocated[cta].sum())
            raise Fault(f"tcgen05.alloc of {ncols} columns with {used} of {COLUMNS} already "
                        f"allocated by this CTA: it would wait forever", thread)
        col = int(free[0]) * ncols
        self.allocated[cta, col:col + ncols] = True
        self.allocs[cta][col] = ncols
        return col

    def dealloc(self, cta: int, taddr: int, ncols: int, thread: int):
        lane, col = taddr >> 16, taddr & 0xFFFF
        if lane or self.allocs[cta].get(col) != ncols:
            live = ", ".join(f"{n} at column {c}" for c, n in sorted(self.allocs[cta].items()))
            raise Fault(f"tcgen05.dealloc of {ncols} columns at tensor-memory address "
                        f"0x{taddr:08x}, which is no live allocation of this CTA (double "
                        f"free, or the wrong address or count; live: {live or 'none'})",
                        thread)
        if self.in_flight[cta, :, col:col + ncols].any():
            raise Fault(f"tcgen05.dealloc of columns {col}-{col + ncols - 1} that a tcgen05.mma "
                        f"still writes (no wait observed its commit)", thread)
        del self.allocs[cta][col]
        self.allocated[cta, col:col + ncols] = False
        self.written[cta, :, col:col + ncols] = False

    def check_released(self):
        for cta, allocs in enumerate(self.allocs):
            if allocs:
                col, n = next(iter(allocs.items()))
                thread = int(np.flatnonzero(self.ctx.cta_of == cta)[0])
                raise Fault(f"tensor memory leak: the CTA exited with {n} columns at column "
                            f"{col} allocated (every tcgen05.alloc needs a tcgen05.dealloc)",
                            thread)

    # ------------------------------------------------------------------ access checks
    def cells(self, cta, lanes, cols, thread, what):
        """Validate a block of cells (lanes x cols of one CTA) for `what`."""
        bad_lane = (lanes < 0) | (lanes >= LANES)
        bad_col = (cols < 0) | (cols >= COLUMNS)
        if bad_lane.any() or bad_col.any():
            raise Fault(f"{what} outside tensor memory (lanes {int(lanes.min())}-"
                        f"{int(lanes.max())}, columns {int(cols.min())}-{int(cols.max())})",
                        thread)
        off = ~self.allocated[cta, cols]
        if off.any():
            raise Fault(f"{what} of column {int(cols[np.flatnonzero(off)[0]])}, which this CTA "
                        f"has not allocated (tcgen05.alloc)", thread)

    def check_read(self, cta, lanes, cols, thread, what, in_flight_ok=False):
        block = np.ix_(lanes, cols)
        if not in_flight_ok and self.in_flight[cta][block].any():
            li, ci = np.argwhere(self.in_flight[cta][block])[0]
            raise Fault(f"{what} reads tensor memory (lane {lanes[li]}, column {cols[ci]}) that "
                        f"a tcgen05.mma still writes: no wait has observed the mbarrier phase "
                        f"of a tcgen05.commit issued after it", thread)
        self.check_stored(cta, lanes, cols, thread, f"{what} reads")
        if not self.written[cta][block].all():
            li, ci = np.argwhere(~self.written[cta][block])[0]
            raise Fault(f"{what} reads never-written tensor memory (lane {lanes[li]}, column "
                        f"{cols[ci]})", thread)

    def check_stored(self, cta, lanes, cols, thread, access):
        """No cell of lanes x cols waits for its tcgen05.st to complete; `access`: "X reads"
        or "X overwrites", for the message."""
        pending = self.stored[cta][np.ix_(lanes, cols)]
        if pending.any():
            li, ci = np.argwhere(pending)[0]
            raise Fault(f"{access} tensor memory (lane {lanes[li]}, column {cols[ci]}) that a "
                        f"tcgen05.st has not completed (the storing warp's tcgen05.wait::st)",
                        thread)

    def check_write(self, cta, lanes, cols, thread, what):
        block = np.ix_(lanes, cols)
        if self.in_flight[cta][block].any():
            li, ci = np.argwhere(self.in_flight[cta][block])[0]
            raise Fault(f"{what} writes tensor memory (lane {lanes[li]}, column {cols[ci]}) that "
                        f"a tcgen05.mma still writes (no wait observed its commit)", thread)

    # ------------------------------------------------------------------ asynchronous MMAs
    def issue(self, rec: MmaRecord):
        self.in_flight[rec.cta][np.ix_(rec.lanes, rec.cols)] += 1
        np.add.at(self.ctx.smem.async_readers, rec.smem_rows, 1)
        self.ctx.smem.async_live += 1
        self.live.setdefault(rec.thread, []).append(rec)

    def commit(self, thread: int) -> list:
        """The issuing thread's MMAs not yet complete, now (also) tracked by an mbarrier."""
        return list(self.live.get(thread, ()))

    def retire(self, records):
        """A wait observed the phase their commit arrived on: the MMAs are complete (those an
        earlier commit's phase already completed are skipped)."""
        for rec in records:
            if rec.done:
                continue
            rec.done = True
            self.live[rec.thread].remove(rec)
            self.in_flight[rec.cta][np.ix_(rec.lanes, rec.cols)] -= 1
            np.subtract.at(self.ctx.smem.async_readers, rec.smem_rows, 1)
            self.ctx.smem.async_live -= 1
