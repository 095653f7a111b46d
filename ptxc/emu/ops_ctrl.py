"""Control flow and synchronisation: bra, ret, exit, bar/barrier.sync and .arrive, bar.warp.sync,
membar/fence (no-ops: emulated memory is sequentially consistent; fence.proxy.async is recorded
for the race tracker's proxy check, racecheck.py)."""

from __future__ import annotations

import numpy as np

from ptxc.emu.decode import BARRIER, BRANCH, EXIT, NORMAL, Mods, Op, expect_operands, register
from ptxc.emu.operands import TYPES, DecodeError, Fault, src_plan
from ptxc.emu.ops_warp import executing_lanes
from ptxc.emu.ptx_ast import Imm, Sym


@register("bra")
def decode_bra(ins, env):
    m = Mods(ins)
    uni = bool(m.flag("uni"))
    m.done()
    expect_operands(ins, 1)
    (target,) = ins.operands
    if not isinstance(target, Sym):
        raise DecodeError("only direct branches to a label are supported")
    return Op(BRANCH, ins, target=env.label_pc(target.name), uniform=uni)


@register("ret", "exit")
def decode_exit(ins, env):
    m = Mods(ins)
    m.flag("uni")
    m.done()
    expect_operands(ins, 0)
    return Op(EXIT, ins)


@register("bar", "barrier")
def decode_bar(ins, env):
    m = Mods(ins)
    if ins.opcode == "bar" and m.flag("warp"):
        return _decode_warp_sync(ins, env, m)
    m.flag("cta")
    kind = m.flag("sync", "arrive")
    if kind is None:
        raise DecodeError("only bar.sync / barrier.sync and bar.arrive / barrier.arrive are "
                          "supported (not red)")
    aligned = ins.opcode == "bar" or bool(m.flag("aligned"))
    m.done()
    expect_operands(ins, 1, 2)
    ops = ins.operands
    if not all(isinstance(o, Imm) and o.kind == "int" for o in ops):
        raise DecodeError("barrier id and thread count must be integer constants")
    bar_id = ops[0].value
    if not 0 <= bar_id <= 15:
        raise DecodeError(f"barrier id {bar_id} is not in 0..15")
    count = ops[1].value if len(ops) == 2 else None
    if count is not None and (count <= 0 or count % 32):
        raise DecodeError(f"barrier thread count {count} is not a positive multiple of 32")
    if kind == "arrive" and count is None:
        raise DecodeError("bar.arrive needs a thread count (PTX ISA: b is required with .arrive)")
    return Op(BARRIER, ins, bar_id=bar_id, bar_count=count, aligned=aligned, arrive=kind == "arrive")


def _decode_warp_sync(ins, env, m):
    if not m.flag("sync"):
        raise DecodeError("only bar.warp.sync is supported")
    m.done()
    expect_operands(ins, 1)
    mask_plan = src_plan(env, ins.operands[0], TYPES["u32"])

    def bind(ctx):
        read_mask = mask_plan(ctx)

        def run(sel):
            idx = ctx.all_index if isinstance(sel, slice) else sel
            mask = np.broadcast_to(np.asarray(read_mask(sel), np.int64) & 0xFFFFFFFF, idx.shape)
            here = executing_lanes(ctx, idx).astype(np.int64)
            lane = ctx.lane[idx]
            bad = (((mask >> lane) & 1) == 0) | ((mask & ~here) != 0)
            if bad.any():
                k = int(np.flatnonzero(bad)[0])
                raise Fault(f"bar.warp.sync membermask 0x{int(mask[k]):08x} does not match the "
                            f"converged lanes 0x{int(here[k]):08x}", int(idx[k]))
            if ctx.race is not None:
                ctx.race.warp_synced(sel)
        return run
    return Op(NORMAL, ins, bind)


@register("membar", "fence")
def decode_fence(ins, env):
    expect_operands(ins, 0)
    allowed = {"cta", "gl", "sys", "gpu", "sc", "acq_rel", "proxy", "async", "alias",
               "shared::cta", "global"}
    bad = [x for x in ins.mods if x not in allowed]
    if bad:
        raise DecodeError("unsupported modifier " + ", ".join("." + b for b in bad))
    if {"proxy", "async"} <= set(ins.mods) and "global" not in ins.mods:
        # a proxy fence over shared memory: the race tracker checks async-proxy reads against it
        def bind(ctx):
            return (lambda sel: ctx.race.proxy_fence(sel)) if ctx.race is not None else (lambda sel: None)
        return Op(NORMAL, ins, bind)
    return Op(NORMAL, ins, lambda ctx: (lambda sel: None))


@register("griddepcontrol")
def decode_griddepcontrol(ins, env):
    """sm_90 programmatic dependent launch: in a single emulated launch there is no
    preceding/dependent grid, so launch_dependents and wait are no-ops."""
    m = Mods(ins)
    m.need("launch_dependents", "wait")
    m.done()
    expect_operands(ins, 0)
    return Op(NORMAL, ins, lambda ctx: (lambda sel: None))
