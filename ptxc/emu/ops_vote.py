"""Lane masks: activemask, and vote.sync.ballot (one bit per lane of the warp whose predicate
holds; FlashMLA-style producers publish a tile's valid keys this way).

vote.sync, as shfl.sync, needs every lane of its membermask to execute it with the thread and
every executing thread in the mask; anything else is undefined behaviour in PTX and a Fault
here naming the first offending thread.
"""

from __future__ import annotations

import numpy as np

from ptxc.emu.decode import NORMAL, Mods, Op, expect_operands, register
from ptxc.emu.operands import TYPES, DecodeError, dst_plan, src_plan
from ptxc.emu.ops_warp import FULL_MASK, check_membermask, executing_lanes

B32, U32, PRED = TYPES["b32"], TYPES["u32"], TYPES["pred"]


@register("activemask")
def decode_activemask(ins, env):
    m = Mods(ins)
    if m.one_type().name != "b32":
        raise DecodeError("activemask needs .b32")
    m.done()
    expect_operands(ins, 1)
    dp = dst_plan(env, ins.operands[0], B32)

    def bind(ctx):
        write = dp(ctx)
        return lambda sel: write(sel, executing_lanes(
            ctx, ctx.all_index if isinstance(sel, slice) else sel).astype(np.uint32))
    return Op(NORMAL, ins, bind)


@register("vote")
def decode_vote(ins, env):
    m = Mods(ins)
    if not m.flag("sync"):
        raise DecodeError("only vote.sync is supported (legacy vote needs sm_6x)")
    m.need("ballot")
    if m.one_type().name != "b32":
        raise DecodeError("vote.sync.ballot needs .b32")
    m.done()
    expect_operands(ins, 3)
    d, a, mask = ins.operands
    dp, ap, mp = dst_plan(env, d, B32), src_plan(env, a, PRED), src_plan(env, mask, U32)

    def bind(ctx):
        write, ra, rm = dp(ctx), ap(ctx), mp(ctx)

        def run(sel):
            idx = ctx.all_index if isinstance(sel, slice) else sel
            lane = ctx.lane[idx]
            membermask = np.broadcast_to(np.asarray(rm(sel), np.int64) & FULL_MASK, idx.shape)
            check_membermask(ctx, idx, lane, membermask, "vote.sync")
            bits = np.where(np.asarray(ra(sel), bool), np.int64(1) << lane, 0)
            warp, inverse = np.unique(idx >> 5, return_inverse=True)
            votes = np.zeros(warp.size, np.int64)
            np.bitwise_or.at(votes, inverse, bits)
            if ctx.race is not None:
                ctx.race.warp_synced(sel)
            write(sel, (votes[inverse] & membermask).astype(np.uint32))
        return run
    return Op(NORMAL, ins, bind)
