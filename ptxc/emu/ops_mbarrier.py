"""mbarrier (init, arrive, arrive.expect_tx, expect_tx, test_wait, try_wait, inval) and
cp.async.bulk global -> shared with mbarrier::complete_tx.

Model (PTX ISA, "Parallel Synchronization and Communication Instructions: mbarrier"). An
mbarrier is an 8-byte shared object; its state lives beside shared memory: the expected
arrival count, the pending count of the current phase, the transaction count and the phase
number. A phase completes when the pending count and the transaction count are both zero;
then the phase number advances and the pending count is reset. An arrive returns a state token
(the phase it arrived in); test_wait/try_wait with a token succeed once the phase differs, with
`.parity p` once the current phase's parity differs from p (the phase of parity p completed).

cp.async.bulk is validated when issued, marks its destination pending (reading or overwriting it
is an error, as for cp.async) and performs complete_tx(size) on its mbarrier at once. A
try_wait that fails *yields*: the executor parks the thread until some mbarrier phase completes
(a spinning thread is just a slow thread) and reports a deadlock when every thread is parked or
blocked and no phase can change. test_wait never blocks, so a test_wait spin loop waiting for
threads at a higher pc (which the lowest-pc scheduler never reaches) ends at the step limit:
spin on try_wait.

Racecheck: a successful wait orders the waiting threads with every thread that arrived on or
copied into the completed phase (a counted-barrier sync event between their warps); the copied
bytes land (and count as written by the issuing thread) when a wait first observes the phase,
so a thread reading them without waiting finds them pending. mbarrier objects themselves are
not race-checked.
"""

from __future__ import annotations

import numpy as np

from ptxc.emu.decode import NORMAL, PARK, Mods, Op, expect_operands, register
from ptxc.emu.memory import BULK_PENDING, WRITTEN
from ptxc.emu.operands import TYPES, DecodeError, Fault, dst_plan, src_plan
from ptxc.emu.ops_mem import address_plan
from ptxc.emu.ptx_ast import Reg, Sink

U32, U64, B64, PRED = TYPES["u32"], TYPES["u64"], TYPES["b64"], TYPES["pred"]
_MAX_COUNT = (1 << 20) - 1
_SEMANTICS = ("release", "acquire", "relaxed", "cta", "cluster")


def arrival(ctx) -> int:
    """The race tracker's stamp of an arrival (0 without the tracker)."""
    return ctx.race.arrival() if ctx.race is not None else 0


def arrival_part(ctx, threads, cumulative: bool = True) -> tuple:
    """(threads, stamp, knowledge) of an arrival by `threads` (one CTA's) on an mbarrier
    phase: what its waiters are ordered after (syncorder.SyncOrder.counted_barrier).
    `cumulative` False (a tcgen05.commit's arrival, made by the tensor cores when the MMAs
    complete): the waiters are ordered after the issuing thread's own accesses before the
    commit and after the MMAs' completion (syncorder's tensor-core row), not after what that
    thread had been ordered after -- no release chain is assumed through the asynchronous
    unit."""
    if ctx.race is None:
        return threads, 0, None
    if not cumulative:
        return (threads, *ctx.race.tensor_core_arrival(int(ctx.lin[threads[0]]) >> 5))
    known = ctx.race.knowledge(int(ctx.cta_of[threads[0]]), threads)
    stamp = ctx.race.arrival()
    ctx.race.release(threads, stamp)
    return threads, stamp, known


class Barrier:
    __slots__ = ("expected", "pending", "tx", "phase", "parts", "last_parts", "copies",
                 "landed", "tracked", "completed")

    def __init__(self, count: int):
        self.expected = self.pending = count
        self.tx, self.phase = 0, 0
        # (threads, race-tracker stamp of their arrival or copy issue) of the open phase and of
        # the last completed one: what a wait observing it is ordered after
        self.parts, self.last_parts, self.copies = [], [], []
        self.landed = []            # copies of completed phases, applied at the first wait
        # asynchronous operations a phase tracks (tcgen05.commit): callables retiring them,
        # run when a wait first observes the phase
        self.tracked, self.completed = [], []


class Mbarriers:
    """Per batch: the initialised mbarrier objects by flat shared offset; `version` counts
    completed phases (parked waiters re-check when it changes)."""

    def __init__(self):
        self.objects, self.version = {}, 0

    def get(self, flat, thread, addr):
        b = self.objects.get(int(flat))
        if b is None:
            raise Fault(f"mbarrier operation on shared address 0x{addr:x}, which holds no "
                        f"initialised mbarrier (missing mbarrier.init?)", thread, addr)
        return b

    def arrive(self, ctx, b, threads, count, thread, addr, cumulative=True):
        if count > b.pending:
            raise Fault(f"{count} arrivals on an mbarrier phase expecting {b.pending} more "
                        f"(of {b.expected}) at shared address 0x{addr:x}", thread, addr)
        b.pending -= count
        part = arrival_part(ctx, threads, cumulative)
        b.parts.append(part)
        self.maybe_complete(ctx, b)
        return part

    def complete_tx(self, ctx, b, nbytes):
        b.tx -= nbytes
        self.maybe_complete(ctx, b)

    def maybe_complete(self, ctx, b):
        if b.pending or b.tx:
            return
        b.landed += b.copies
        b.copies = []
        b.completed += b.tracked
        b.tracked = []
        b.last_parts, b.parts = b.parts, []
        b.phase += 1
        b.pending = b.expected
        self.version += 1

    @staticmethod
    def land(ctx, b):
        """The data of completed phases becomes visible when a wait first observes one (a
        reader that did not wait, directly or through a barrier after a wait, sees it
        pending)."""
        for cols, data, thread, line, swizzle, stamp in b.landed:
            ctx.smem.data[cols] = data
            ctx.smem.state[cols] = WRITTEN
            if swizzle is None:
                ctx.smem.forget_layout(cols[::16])
            else:
                ctx.smem.note_tma_layout(cols[::16], swizzle)
            if ctx.race is not None:
                chunks = cols[::16]
                ctx.race.record_copy(chunks, 16, np.full(chunks.size, thread), line, async_proxy=True,
                                     stamp=stamp)
        b.landed = []
        for retire in b.completed:
            retire()
        b.completed = []


def _smem_flat(ctx, idx, addr, what):
    return ctx.smem.offsets(ctx.cta_of[idx], addr, 8, 8, what, idx)


def _groups(flat):
    uniq, first, inv = np.unique(flat, return_index=True, return_inverse=True)
    return uniq, first, inv


@register("mbarrier")
def decode_mbarrier(ins, env):
    m = Mods(ins)
    expect_tx = "arrive" in ins.mods and bool(m.flag("expect_tx"))
    kind = m.need("init", "arrive", "expect_tx", "test_wait", "try_wait", "inval")
    parity = bool(m.flag("parity"))
    for s in _SEMANTICS:
        m.flag(s)
    if not m.flag("shared", "shared::cta"):
        raise DecodeError("only .shared(::cta) mbarrier objects are supported")
    if m.one_type().name != "b64":
        raise DecodeError("needs .b64")
    m.done()
    ops = ins.operands
    what = f"mbarrier.{kind}"
    if kind in ("init", "expect_tx", "inval"):
        expect_operands(ins, 1 if kind == "inval" else 2)
        aplan = address_plan(env, ops[0], "shared")
        vplan = src_plan(env, ops[1], U32) if kind != "inval" else None
        return Op(NORMAL, ins, lambda ctx: _simple(ctx, kind, aplan(ctx),
                                                   vplan(ctx) if vplan else None, what))
    if kind == "arrive":
        expect_operands(ins, *((3,) if expect_tx else (2, 3)))
        dplan = dst_plan(env, ops[0], B64) if not isinstance(ops[0], Sink) else None
        aplan = address_plan(env, ops[1], "shared")
        cplan = src_plan(env, ops[2], U32) if len(ops) == 3 else None
        return Op(NORMAL, ins, lambda ctx: _arrive(ctx, aplan(ctx), dplan(ctx) if dplan else
                                                   None, cplan(ctx) if cplan else None,
                                                   expect_tx, what))
    expect_operands(ins, 3, 4)
    if not isinstance(ops[0], Reg) or env.reg_type(ops[0].name).kind != "p":
        raise DecodeError("the destination of a wait is a predicate register")
    pplan, aplan = dst_plan(env, ops[0], PRED), address_plan(env, ops[1], "shared")
    splan = src_plan(env, ops[2], U32 if parity else B64)
    bind = lambda ctx: _wait(ctx, pplan(ctx), aplan(ctx), splan(ctx), parity, what)  # noqa
    if kind == "test_wait":         # non-blocking by definition: the thread goes on at once
        return Op(NORMAL, ins, bind)
    return Op(PARK, ins, bind, park_reg=ops[0].name)


def _simple(ctx, kind, address, value, what):
    bars = ctx.mbar

    def run(sel):
        idx = ctx.all_index if isinstance(sel, slice) else sel
        addr = np.broadcast_to(np.asarray(address(sel), np.int64), idx.shape)
        flat = _smem_flat(ctx, idx, addr, what)
        vals = np.broadcast_to(np.asarray(value(sel), np.int64), idx.shape) if value else None
        for k in range(idx.size):
            f, a, t = int(flat[k]), int(addr[k]), int(idx[k])
            if kind == "init":
                count = int(vals[k])
                if not 1 <= count <= _MAX_COUNT:
                    raise Fault(f"mbarrier.init count {count} outside 1..{_MAX_COUNT}", t, a)
                bars.objects[f] = Barrier(count)
                ctx.smem.state[f:f + 8] = WRITTEN
            elif kind == "inval":
                bars.get(f, t, a)
                del bars.objects[f]
            else:
                bars.get(f, t, a).tx += int(vals[k])
    return run


def _arrive(ctx, address, token_write, count, expect_tx, what):
    bars = ctx.mbar

    def run(sel):
        idx = ctx.all_index if isinstance(sel, slice) else sel
        addr = np.broadcast_to(np.asarray(address(sel), np.int64), idx.shape)
        flat = _smem_flat(ctx, idx, addr, what)
        vals = np.broadcast_to(np.asarray(count(sel), np.int64), idx.shape) if count else \
            np.ones(idx.shape, np.int64)
        tokens = np.zeros(idx.size, np.uint64)
        uniq, first, inv = _groups(flat)
        for g, f in enumerate(uniq.tolist()):
            rows = np.flatnonzero(inv == g)
            t, a = int(idx[first[g]]), int(addr[first[g]])
            b = bars.get(f, t, a)
            tokens[rows] = b.phase
            if expect_tx:
                b.tx += int(vals[rows].sum())
                bars.arrive(ctx, b, idx[rows], rows.size, t, a)
            else:
                bars.arrive(ctx, b, idx[rows], int(vals[rows].sum()), t, a)
        if token_write is not None:
            token_write(sel, tokens)
    return run


def _wait(ctx, pwrite, address, state, parity, what):
    bars = ctx.mbar

    def run(sel):
        idx = ctx.all_index if isinstance(sel, slice) else sel
        addr = np.broadcast_to(np.asarray(address(sel), np.int64), idx.shape)
        flat = _smem_flat(ctx, idx, addr, what)
        want = np.broadcast_to(np.asarray(state(sel), np.int64), idx.shape)
        ok = np.zeros(idx.size, np.bool_)
        uniq, first, inv = _groups(flat)
        for g, f in enumerate(uniq.tolist()):
            rows = np.flatnonzero(inv == g)
            b = bars.get(f, int(idx[first[g]]), int(addr[first[g]]))
            done = (want[rows] & 1) != (b.phase & 1) if parity else want[rows] != b.phase
            ok[rows] = done
            if done.any() and (b.landed or b.completed):
                bars.land(ctx, b)
            if ctx.race is not None and done.any():
                # the phase's arrivals (and copy issues) up to their stamps are ordered before
                # the waiters' later accesses; waiters are not ordered among themselves
                seen = idx[rows[done]]
                for cta in np.unique(ctx.cta_of[seen]).tolist():
                    arrivers = [(t[ctx.cta_of[t] == cta], stamp, known)
                                for t, stamp, known in b.last_parts]
                    ctx.race.counted_barrier(cta, seen[ctx.cta_of[seen] == cta],
                                             [a for a in arrivers if a[0].size],
                                             pair_waiters=False)
        pwrite(sel, ok)
    return run


def issue_copy(ctx, thread, cols, data, dst_addr, bar_flat, bar_addr, line, swizzle=None):
    """An asynchronous copy of `data` into flat shared bytes `cols` (whole 16-byte chunks)
    by `thread`, completing its byte count on the mbarrier at `bar_flat`; `swizzle`: the
    width a TMA copy swizzled the chunks with (None for a plain bulk copy)."""
    chunks = cols[::16] >> 4
    who = np.full(chunks.size, thread)
    addr_of = lambda j: dst_addr + 16 * j  # noqa: E731
    ctx.smem.check_not_pending(chunks, 16, who, addr_of)
    if ctx.race is not None:
        ctx.race.check(chunks, 16, who, line, "write", addr_of)
    b = ctx.mbar.get(bar_flat, thread, bar_addr)
    ctx.smem.state[cols] = BULK_PENDING
    # the copy's writes are ordered like the issuer's accesses before the issue: stamped just
    # before the part the phase's waiters are ordered after
    b.copies.append((cols, data, thread, line, swizzle, arrival(ctx)))
    b.parts.append(arrival_part(ctx, np.array([thread], np.int64)))
    ctx.mbar.complete_tx(ctx, b, cols.size)


def decode_cp_bulk(ins, env):
    """cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [dst], [src], size,
    [mbar] (also .shared::cta destinations)."""
    m = Mods(ins)
    m.need("async")
    m.need("bulk")
    m.need("shared::cluster", "shared::cta")
    m.need("global")
    m.need("mbarrier::complete_tx::bytes")
    m.done()
    expect_operands(ins, 4)
    dplan, splan = address_plan(env, ins.operands[0], "shared"), \
        address_plan(env, ins.operands[1], "global")
    zplan, bplan = src_plan(env, ins.operands[2], U32), address_plan(env, ins.operands[3],
                                                                     "shared")
    line = ins.line

    def bind(ctx):
        daddr, saddr, size_r, baddr = dplan(ctx), splan(ctx), zplan(ctx), bplan(ctx)

        def run(sel):
            idx = ctx.all_index if isinstance(sel, slice) else sel
            n = idx.size
            da = np.broadcast_to(np.asarray(daddr(sel), np.int64), (n,))
            sa = np.broadcast_to(np.asarray(saddr(sel), np.uint64), (n,))
            sizes = np.broadcast_to(np.asarray(size_r(sel), np.int64), (n,))
            ba = np.broadcast_to(np.asarray(baddr(sel), np.int64), (n,))
            bflat = _smem_flat(ctx, idx, ba, "mbarrier (cp.async.bulk)")
            for k in range(n):
                t, size = int(idx[k]), int(sizes[k])
                if size <= 0 or size % 16:
                    raise Fault(f"cp.async.bulk size {size} is not a positive multiple of 16",
                                t)
                dst = int(ctx.smem.offsets(ctx.cta_of[idx[k:k + 1]], da[k:k + 1], size, 16,
                                           "cp.async.bulk write", idx[k:k + 1])[0])
                if int(sa[k]) % 16:
                    raise Fault(f"misaligned cp.async.bulk source 0x{int(sa[k]):x} (needs 16 "
                                f"bytes)", t, int(sa[k]))
                src = int(ctx.gmem.offsets(sa[k:k + 1], size, 1, "cp.async.bulk read",
                                           idx[k:k + 1])[0])
                if ctx.traffic is not None:
                    ctx.traffic.bulk_read(line, "cp.async.bulk", sa[k:k + 1], size)
                cols = dst + np.arange(size)
                issue_copy(ctx, t, cols, ctx.gmem.heap[src:src + size].copy(),
                           int(da[k]), int(bflat[k]), int(ba[k]), line)
        return run
    return Op(NORMAL, ins, bind)
