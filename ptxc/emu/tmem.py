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
  warp's tcgen05.wait::st completes them);
* ordering across warps, on the batch's sync events (syncorder.py; with racecheck=False
  only the pending rules below stay):
  - write after read: a tcgen05.mma (its D) or another warp's tcgen05.st overwriting cells a
    warp read with tcgen05.ld must be ordered after that read -- the reading warp's
    tcgen05.wait::ld, then a CTA-wide barrier, or a chain of named barriers / mbarrier phases
    from that warp to the writer's (FlashAttention-4's "S free" handshake). An MMA
    overwriting cells its own warp read needs that warp's wait::ld first. A tcgen05.st, or
    another warp's MMA, writing cells an MMA read as its A operand (P in tensor memory) must be
    ordered after that MMA's completion, as a read of its D (below; the issuing warp's later
    MMAs run in order and may);
  - read after a tcgen05.st: an MMA (A from tensor memory, or D accumulated) or another warp's
    tcgen05.ld reading stored cells must be ordered after the storing warp's tcgen05.wait::st
    the same way (the softmax warps' "P full" handshake);
  - reading an MMA's result: a tcgen05.ld (or st) of D cells must be ordered after the MMA's
    completion -- a wait by the reading warp on the phase of a commit its issuing thread made
    after it, or a chain from a warp that waited (syncorder's tensor-core row of the issuing
    warp); the in-flight rule above only asks that some wait observed it;
  - shared memory an MMA read as A or B: a write (a store, cp.async, a TMA copy's issue) must
    be ordered after that MMA's completion the same way (SharedReads).
  One record per cell (the last reader, the last storer, the last MMA): a cell several warps
  read is checked against the last of them only, so a race can be missed there, never
  invented.

The MMA's values are written when it is issued (as for wgmma, nothing may observe the cells
before it completes, so this is the value every legal observer sees); the ordering checks are
what stop an early overwrite or a late store from hiding behind that.
"""

from __future__ import annotations

import numpy as np

from ptxc.emu.operands import Fault
from ptxc.emu.tcgen05_layout import COLUMNS, LANES


# the stamp of a tcgen05.ld / st not yet completed by its warp's wait: ordered after nothing
PENDING = 1 << 62


class MmaRecord:
    """One issued tcgen05.mma: the cells it writes (`lanes` x `cols`; `cells` the same as an
    index), the cells it reads as A (`a_cells`; None: A from shared memory) and the shared
    chunks it reads."""

    __slots__ = ("cta", "lanes", "cols", "cells", "a_cells", "smem_rows", "thread", "line",
                 "done")

    def __init__(self, cta, lanes, cols, smem_rows, thread, line, cells=None, a_cells=None):
        self.cta, self.lanes, self.cols = cta, lanes, cols
        self.cells = cells if cells is not None else np.ix_(lanes, cols)
        self.a_cells = a_cells
        self.smem_rows, self.thread, self.line = smem_rows, thread, line
        self.done = False


def flat_cells(cta: int, lanes, cols):
    """Cells (lanes, cols: index arrays of one shape) of one CTA as flat indices into the
    (CTAs, lanes, columns) arrays: a warp's ld / st fragment is then one 1-D gather."""
    return ((cta * LANES + lanes) * COLUMNS + cols).reshape(-1)


class CellLog:
    """The last access of one kind to every cell: its warp (index in the CTA, + 1; 0: none),
    its stamp (the sync counter when the warp's wait completed it; PENDING before) and
    its PTX line. np.zeros, so a batch pays only for the pages its allocations touch."""

    def __init__(self, shape, kind: str, wait: str, tensor_cores: bool = False):
        self.kind, self.wait = kind, wait           # for messages: the access, what completes it
        # an MMA's access: stamped by its commit, ordered only by a wait on that commit's phase
        # or a chain from one (syncorder's tensor-core row), for its own warp too
        self.tensor_cores = tensor_cores
        self.by = np.zeros(shape, np.int16)
        self.at = np.zeros(shape, np.int64)
        self.line = np.zeros(shape, np.int32)
        self.pending: dict = {}         # warp (batch index) -> [flat cell indices]

    def record(self, flat, warp_in_cta: int, line: int, gwarp: int):
        """A warp's access of the cells `flat` (flat_cells), pending until its wait."""
        self.by.reshape(-1)[flat] = warp_in_cta + 1
        self.at.reshape(-1)[flat] = PENDING
        self.line.reshape(-1)[flat] = line
        self.pending.setdefault(gwarp, []).append(flat)

    def forget(self, cta, cells):
        """A later write (checked against this one) replaced the cells' last access of this
        kind: it is what the next accesses are ordered against. `cells`: an index into the
        CTA's lanes x columns, or flat_cells."""
        if isinstance(cells, np.ndarray):
            self.by.reshape(-1)[cells] = 0
        else:
            self.by[cta][cells] = 0

    def complete(self, gwarp: int, warp_in_cta: int, stamp: int):
        """The warp's wait: its pending accesses (those no other warp redid since) get `stamp`."""
        pending = self.pending.pop(gwarp, None)
        if not pending:
            return
        flat = np.concatenate(pending) if len(pending) > 1 else pending[0]
        by, at = self.by.reshape(-1), self.at.reshape(-1)
        at[flat[(by[flat] == warp_in_cta + 1) & (at[flat] == PENDING)]] = stamp


class SharedReads:
    """The shared memory tcgen05.mma operands read, per 16-byte chunk: the issuing warp (+ 1;
    0: none), the stamp of the commit that tracks the MMA (PENDING before one) and the MMA's
    line. A write of such a chunk must be ordered after that MMA's completion, as a read of its
    D: the writer's warp waited on the phase of a commit the issuing thread made after it, or a
    chain leads to it from one that did (the load warp refilling a K/V stage waits on the
    stage's "empty" mbarrier, which the MMA warp's commit arrives on). The in-flight count
    (smem.async_readers) only asks that some wait observed the commit."""

    def __init__(self, ctx):
        n = ctx.smem.data.size // 16 + 1
        self.ctx = ctx
        self.by = np.zeros(n, np.int16)
        self.at = np.zeros(n, np.int64)
        self.line = np.zeros(n, np.int32)

    def record(self, chunks, warp: int, line: int):
        self.by[chunks], self.at[chunks], self.line[chunks] = warp + 1, PENDING, line

    def committed(self, chunks, warp: int, stamp: int):
        mine = chunks[(self.by[chunks] == warp + 1) & (self.at[chunks] == PENDING)]
        self.at[mine] = stamp - 1

    def check(self, rows, total: int, sel, addr_of):
        """Writes of `total`-byte items `rows` by the threads `sel` (smem.check_not_pending)."""
        chunks = (np.asarray(rows, np.int64) * total) >> 4
        by = self.by[chunks]
        live = by > 0
        if not live.any():
            return
        ctx = self.ctx
        idx = ctx.all_index if isinstance(sel, slice) else np.asarray(sel)
        at, race = self.at[chunks], ctx.race
        bad = live & (at == PENDING)
        if race is not None:
            sync = race.pair_sync
            rest = live & ~bad
            if sync is None:
                bad |= rest
            elif rest.any():
                k = np.flatnonzero(rest)
                ordered = sync[ctx.cta_of[idx[k]], race.tensor_cores + by[k].astype(np.intp) - 1,
                               ctx.lin[idx[k]] >> 5] > at[k]
                bad[k[~ordered]] = True
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            t, warp = int(idx[k]), int(ctx.lin[idx[k]]) >> 5
            how = ("before a tcgen05.commit tracked it" if at[k] == PENDING else
                   f"warp {warp} did not wait on the mbarrier phase its tcgen05.commit arrives "
                   f"on, and no CTA barrier or chain of mbarriers / named barriers from a warp "
                   f"that did came after that wait")
            raise Fault(f"write to shared memory (shared address 0x{addr_of(k):x}) that the "
                        f"tcgen05.mma at PTX line {int(self.line[chunks[k]])} (warp "
                        f"{int(by[k]) - 1}) read, not ordered after its completion: {how}", t,
                        addr_of(k))


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
        shape = (n, LANES, COLUMNS)
        self.loads = CellLog(shape, "tcgen05.ld", "its warp's tcgen05.wait::ld")
        self.puts = CellLog(shape, "tcgen05.st", "its warp's tcgen05.wait::st")
        # an MMA's D cells and A cells (A from tensor memory): the issuing warp, stamped
        # (commit arrival - 1) by the thread's next commit
        self.mmas = CellLog(shape, "tcgen05.mma", "a tcgen05.commit after it", True)
        self.mma_reads = CellLog(shape, "tcgen05.mma (as its A operand)",
                                 "a tcgen05.commit after it", True)
        self.stores: dict = {}          # warp -> [(cta, lanes, cols)] before tcgen05.wait::st
        smem = ctx.smem
        self.smem_reads = smem.tc_reads = SharedReads(ctx)
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

    # ------------------------------------------------------------------ ordering across warps
    def unordered(self, log: CellLog, cta: int, cells, warp: int, own_pending: bool = False,
                  own_ordered: bool = True):
        """Mask over `cells` (an index into one CTA's lanes x columns) whose last access in `log`
        an access by `warp` (index in the CTA) now is not ordered after. `own_pending`: the
        warp's own pending accesses count too (an MMA is another unit than its warp's ld);
        `own_ordered` False: program order does not order the warp's own accesses either (an
        MMA's, for a warp's ld / st)."""
        flat = isinstance(cells, np.ndarray)
        by = log.by.reshape(-1)[cells] if flat else log.by[cta][cells]    # warp + 1; 0: none
        live = by > 0
        if not live.any():
            return live
        at = log.at.reshape(-1)[cells] if flat else log.at[cta][cells]
        other = live & (by != warp + 1) if own_ordered else live
        pending = (other | (live & own_pending)) & (at == PENDING)
        race = self.ctx.race
        if race is None:
            return pending
        sync = race.pair_sync
        if log.tensor_cores:    # the issuing warp's tensor-core row
            if sync is None:
                return other | pending
            rows = race.tensor_cores + np.maximum(by.astype(np.intp) - 1, 0)
            return other & ~(sync[cta][rows, warp] > at) | pending
        bad = other & ~(race.cta_sync[cta] > at)
        if sync is not None and bad.any():
            bad &= ~(sync[cta][np.maximum(by.astype(np.intp) - 1, 0), warp] > at)
        return bad | pending

    def check_ordered(self, log: CellLog, cta, cells, warp, thread, what, own_pending=False,
                      own_ordered=True):
        """Fail when `what` (by `warp`) is not ordered after the last access in `log` of one of
        `cells` (flat_cells, or a lane index and a column slice); the message names both
        accesses."""
        bad = self.unordered(log, cta, cells, warp, own_pending, own_ordered)
        if not bad.any():
            return
        if isinstance(cells, np.ndarray):
            lanes, cols = cells // COLUMNS % LANES, cells % COLUMNS
        else:
            lanes, cols = np.arange(LANES)[cells[0]][:, None], np.arange(COLUMNS)[cells[1]][None, :]
            lanes, cols = np.broadcast_arrays(lanes, cols)
        pos = tuple(int(i[0]) for i in np.nonzero(bad))
        lane, col = int(lanes[pos]), int(cols[pos])
        other, line = int(log.by[cta, lane, col]) - 1, int(log.line[cta, lane, col])
        if log.at[cta, lane, col] == PENDING:
            how = f"before {log.wait} completed it"
        elif log.tensor_cores:
            how = (f"warp {warp} did not wait on the mbarrier phase its tcgen05.commit arrives "
                   f"on, and no CTA barrier or chain of mbarriers / named barriers from a warp "
                   f"that did came after that wait")
        else:
            how = (f"no CTA barrier, and no chain of mbarriers / named barriers from warp "
                   f"{other} to warp {warp}, came after {log.wait}")
        raise Fault(f"{what} tensor memory (lane {lane}, column {col}) that warp {other} "
                    f"accessed with {log.kind} at PTX line {line}, not ordered after it: {how}",
                    thread)

    # ------------------------------------------------------------------ asynchronous MMAs
    def issue(self, rec: MmaRecord):
        self.in_flight[rec.cta][np.ix_(rec.lanes, rec.cols)] += 1
        np.add.at(self.ctx.smem.async_readers, rec.smem_rows, 1)
        self.ctx.smem.async_live += 1
        self.smem_reads.record(rec.smem_rows, int(self.ctx.lin[rec.thread]) >> 5, rec.line)
        self.live.setdefault(rec.thread, []).append(rec)

    def commit(self, thread: int) -> list:
        """The issuing thread's MMAs not yet complete, now (also) tracked by an mbarrier."""
        return list(self.live.get(thread, ()))

    def committed(self, records, warp: int, stamp: int):
        """A commit's arrival (race stamp `stamp`) tracks `records`: their D and A cells not
        yet stamped are ordered for the warps that wait on its phase (the tensor-core row >=
        stamp) and for what those waits order after them."""
        done = set()
        for rec in records:
            self.smem_reads.committed(rec.smem_rows, warp, stamp)
            for log, cells in ((self.mmas, rec.cells), (self.mma_reads, rec.a_cells)):
                if cells is None:
                    continue
                lanes = cells[0]                        # S's or O's MMAs share a block
                key = (id(log), rec.cta, (lanes.start, lanes.stop) if isinstance(lanes, slice)
                       else lanes.size, cells[1].start, cells[1].stop)
                if key in done:
                    continue
                done.add(key)
                at = log.at[rec.cta][cells]
                at[(log.by[rec.cta][cells] == warp + 1) & (at == PENDING)] = stamp - 1
                log.at[rec.cta][cells] = at

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
