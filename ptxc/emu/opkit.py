"""Small builders shared by the op families: `d = fn(a, b, ...)` style instructions."""

from __future__ import annotations

from ptxc.emu.decode import NORMAL, Op
from ptxc.emu.operands import dst_plan, src_plan


def simple_op(ins, env, dst, dty, srcs, fn, *, wants_sel=False) -> Op:
    """An Op computing ``dst = fn(*sources)``; srcs is a list of (operand, PtxType).

    With wants_sel, fn is called as fn(sel, *values) (for ops that report faulting threads).
    All sources are read before the destination is written, so ``add %r1, %r1, %r1`` is fine.
    """
    dplan = dst_plan(env, dst, dty)
    splans = [src_plan(env, o, t) for o, t in srcs]

    def bind(ctx):
        write = dplan(ctx)
        readers = [p(ctx) for p in splans]
        if wants_sel:
            def run(sel):
                write(sel, fn(sel, *[r(sel) for r in readers]))
            return run
        if len(readers) == 1:
            (r0,) = readers
            return lambda sel: write(sel, fn(r0(sel)))
        if len(readers) == 2:
            r0, r1 = readers
            return lambda sel: write(sel, fn(r0(sel), r1(sel)))
        if len(readers) == 3:
            r0, r1, r2 = readers
            return lambda sel: write(sel, fn(r0(sel), r1(sel), r2(sel)))

        def run(sel):
            write(sel, fn(*[r(sel) for r in readers]))
        return run
    return Op(NORMAL, ins, bind)


def multi_op(ins, env, dsts, srcs, fn) -> Op:
    """Like simple_op with several destinations: fn returns a tuple, one value per dst.

    dsts: list of (operand, PtxType)."""
    dplans = [dst_plan(env, o, t) for o, t in dsts]
    splans = [src_plan(env, o, t) for o, t in srcs]

    def bind(ctx):
        writers = [p(ctx) for p in dplans]
        readers = [p(ctx) for p in splans]

        def run(sel):
            values = fn(*[r(sel) for r in readers])
            for w, v in zip(writers, values):
                w(sel, v)
        return run
    return Op(NORMAL, ins, bind)
