"""Uninitialised registers: a register read before any write, whose value reaches a memory
address, a stored value or a branch condition, is an error naming the register and the line.

Two stages keep this free for ordinary kernels:

1. At decode time a forward data-flow analysis over the kernel's control-flow graph finds the
   registers that MAY hold a never-written value ("poisoned") at each instruction: every
   register is poisoned at entry; an unguarded write kills it unless one of its sources may be
   poisoned (then the poison flows into it); a guarded write can only add poison. Registers
   poisoned where they are used as an address, a store value or a branch guard are *checked*;
   the registers whose values can flow into a checked one are *tracked*. In kernels that define
   every register before use on every path (all of ptxc's) nothing is tracked.
2. At run time each tracked register gets a per-thread "holds a defined value" flag, set by
   the instructions that write it (the AND of their tracked sources' flags), and a checked use
   fails for the first thread whose flag is clear. Predicated definitions followed by uses under
   the same predicate therefore pass: the check is per thread, not static.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ptxc.emu.operands import Fault
from ptxc.emu.ptx_ast import Addr, Imm, Pair, Reg, TensorAddr, Vec

# Instructions whose first operand is not a register destination.
_NO_DEST = {"st", "red", "bar", "barrier", "bra", "exit", "ret", "cp", "membar", "fence",
            "prefetch", "prefetchu", "griddepcontrol", "trap", "brkpt", "nanosleep", "pmevent"}
_STORES = {"st", "red"}
_BRANCHES = {"bra", "exit", "ret"}


@dataclass(frozen=True)
class InitPlan:
    """Per pc: `checks` ((register, what), ...) to verify before the instruction runs, and for
    instructions writing tracked registers `defs` (tracked destinations) and `srcs` (tracked
    sources whose flags the destinations inherit)."""
    checks: dict
    defs: dict
    srcs: dict
    tracked: frozenset


def _regs(op, out: list):
    if isinstance(op, Reg):
        out.append(op.name)
    elif isinstance(op, Vec):
        for x in op.items:
            _regs(x, out)
    elif isinstance(op, Pair):
        _regs(op.first, out)
        _regs(op.second, out)
    elif isinstance(op, Addr) and isinstance(op.base, Reg):
        out.append(op.base.name)
    elif isinstance(op, TensorAddr):
        _regs(op.map, out)
        for c in op.coords:
            _regs(c, out)


def roles(ins, declared):
    """(destinations, sources, checked uses [(reg, what)]) of one instruction."""
    ops = ins.operands
    has_dest = ins.opcode not in _NO_DEST and ops and not isinstance(ops[0], Addr) and \
        not (ins.opcode == "tcgen05" and ins.mods[:1] != ("ld",))
    dsts, srcs = [], []
    if has_dest:
        _regs(ops[0], dsts)
    for op in ops[1:] if has_dest else ops:
        _regs(op, srcs)
    if ins.opcode == "wgmma" and len(ops) > 3 and not (isinstance(ops[3], Imm) and
                                                       ops[3].value == 0):
        _regs(ops[0], srcs)          # scale-d true: the accumulator is read as well
    checks = []
    for op in ops:
        if isinstance(op, Addr) and isinstance(op.base, Reg):
            checks.append((op.base.name, "used as an address"))
    if ins.opcode in _STORES and len(ops) >= 2:
        vals = []
        _regs(ops[1], vals)
        checks += [(r, "stored to memory") for r in vals]
    if ins.guard is not None:
        srcs.append(ins.guard.name)
        if ins.opcode in _BRANCHES:
            checks.append((ins.guard.name, "used as a branch condition"))
    keep = declared.__contains__
    return ([r for r in dsts if keep(r)], [r for r in srcs if keep(r)],
            [(r, w) for r, w in checks if keep(r)])


def analyse(entry, succ) -> InitPlan:
    """succ[pc]: the pcs that can follow instruction pc (len(body) = falling off the end)."""
    declared = {name for name, _ in entry.regs}
    index = {name: i for i, name in enumerate(sorted(declared))}
    body = entry.body
    n = len(body)
    info = [roles(ins, declared) for ins in body]
    bit = [(sum(1 << index[r] for r in set(d)), [index[r] for r in s]) for d, s, _ in info]
    all_bits = (1 << len(index)) - 1
    state = [None] * (n + 1)                               # poisoned set at each pc (bits)
    state[0] = all_bits
    work = [0]
    while work:
        pc = work.pop()
        if pc >= n:
            continue
        cur = state[pc]
        dbits, sidx = bit[pc]
        if any(cur >> i & 1 for i in sidx):
            out = cur | dbits
        elif body[pc].guard is None:
            out = cur & ~dbits
        else:
            out = cur
        for s in succ[pc]:
            old = state[s]
            new = out if old is None else old | out
            if new != old:
                state[s] = new
                work.append(s)
    checks, tracked = {}, set()
    for pc, (_, _, uses) in enumerate(info):
        cur = state[pc]
        if cur is None:
            continue                                       # unreachable
        bad = [(r, w) for r, w in uses if cur >> index[r] & 1]
        if bad:
            checks[pc] = tuple(bad)
            tracked.update(r for r, _ in bad)
    # Close over data flow: a tracked register's poisoned sources are tracked too.
    changed = True
    while changed:
        changed = False
        for pc, (dsts, srcs, _) in enumerate(info):
            cur = state[pc]
            if cur is None or not tracked.intersection(dsts):
                continue
            for r in srcs:
                if r not in tracked and cur >> index[r] & 1:
                    tracked.add(r)
                    changed = True
    defs, srcs_of = {}, {}
    for pc, (dsts, srcs, _) in enumerate(info):
        d = tuple(r for r in dsts if r in tracked)
        if d and state[pc] is not None:
            defs[pc] = d
            srcs_of[pc] = tuple(r for r in srcs if r in tracked and state[pc] >> index[r] & 1)
    return InitPlan(checks, defs, srcs_of, frozenset(tracked))


# ----------------------------------------------------------------------------- run time

def bind_init_checks(plan, ctx, ops, bound):
    """Per-thread 'defined' flags for the tracked registers (usually none); wrap the ops
    that write or check them. Returns {pc: checks} for branch/exit instructions."""
    if not plan.tracked:
        return {}
    flags = {r: np.zeros(ctx.n, np.uint8) for r in plan.tracked}
    control = {}
    for pc in range(len(ops)):
        checks = tuple((r, what, flags[r]) for r, what in plan.checks.get(pc, ()))
        if bound[pc] is None:                 # branch, exit or barrier
            if checks:
                control[pc] = checks
            continue
        defs = [flags[r] for r in plan.defs.get(pc, ())]
        if checks or defs:
            srcs = [flags[r] for r in plan.srcs.get(pc, ())]
            bound[pc] = _with_init_flags(bound[pc], checks, defs, srcs)
    return control


def check_defined(checks, sel):
    """flags: 0 never written, 1 defined, 2 computed from a never-written value."""
    for reg, what, flag in checks:
        state = flag[sel]
        bad = state != 1
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            thread = k if isinstance(sel, slice) else int(sel[k])
            why = ("is read before any write (uninitialised)" if state[k] == 0 else
                   "holds a value computed from a never-written (uninitialised) register")
            raise Fault(f"register {reg} {why} and is {what}", thread)


def _with_init_flags(run, checks, defs, srcs):
    """`run` preceded by the checks of its uses; its tracked destinations become defined (1)
    where all its tracked sources are, else tainted (2)."""
    def checked(sel):
        if checks:
            check_defined(checks, sel)
        run(sel)
        if defs:
            ok = True
            for f in srcs:
                ok = ok & (f[sel] == 1)
            value = np.where(ok, np.uint8(1), np.uint8(2))
            for d in defs:
                d[sel] = value
    return checked
