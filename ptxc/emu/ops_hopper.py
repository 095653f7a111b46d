"""sm_90 warp-level helpers: elect.sync, setmaxnreg, stmatrix.

elect.sync elects the lowest lane of its membermask (PTX ISA: "the leader is the thread with the
lowest lane id"; every lane of the mask must execute it, as for shfl.sync). setmaxnreg moves a
warpgroup's registers through the CTA's pool (RegisterPool below): .dec gives them back,
.inc takes them and *waits* while the pool lacks them (PTX ISA: "blocks the execution until
enough registers are available in the CTA's register pool") -- so a budget beyond what the
CTA started with hangs, and the emulator reports it as it reports an mbarrier deadlock; it
also checks the operand (24..256, a multiple of 8) and that whole warpgroups execute it.
stmatrix is the store
counterpart of ldmatrix: lanes 8i..8i+7 give the row addresses of matrix i, register i of lane l
holds row l/4, columns 2(l%4) and 2(l%4)+1 (transposed with .trans).
"""

from __future__ import annotations

import numpy as np

from ptxc.emu.decode import NORMAL, PARK, Mods, Op, expect_operands, register
from ptxc.emu.operands import TYPES, DecodeError, Fault, dst_plan, src_plan
from ptxc.emu.ops_warp import MATRIX_COL, MATRIX_ROW, check_membermask, decode_matrix, matrix_rows
from ptxc.emu.ops_wgmma import warpgroups
from ptxc.emu.ptx_ast import Imm, Pair

U32, B32, PRED = TYPES["u32"], TYPES["b32"], TYPES["pred"]


@register("elect")
def decode_elect(ins, env):
    m = Mods(ins)
    if not m.flag("sync"):
        raise DecodeError("needs .sync")
    m.done()
    expect_operands(ins, 2)
    d, mask = ins.operands
    if not isinstance(d, Pair):
        raise DecodeError("elect.sync's destination is d|p")
    dp, pp = dst_plan(env, d.first, B32), dst_plan(env, d.second, PRED)
    mp = src_plan(env, mask, U32)

    def bind(ctx):
        write, pwrite, rmask = dp(ctx), pp(ctx), mp(ctx)

        def run(sel):
            idx = ctx.all_index if isinstance(sel, slice) else sel
            lane = ctx.lane[idx]
            member = np.broadcast_to(np.asarray(rmask(sel), np.int64) & 0xFFFFFFFF, idx.shape)
            if (member == 0).any():
                raise Fault("elect.sync with an empty membermask", int(idx[0]))
            check_membermask(ctx, idx, lane, member, "elect.sync")
            leader = np.log2(member & -member).astype(np.uint32)     # lowest set bit
            if ctx.race is not None:
                ctx.race.warp_synced(sel)
            write(sel, leader)
            pwrite(sel, lane == leader)
        return run
    return Op(NORMAL, ins, bind)


@register("setmaxnreg")
def decode_setmaxnreg(ins, env):
    m = Mods(ins)
    m_inc = m.need("inc", "dec") == "inc"
    if not (m.flag("sync") and m.flag("aligned")):
        raise DecodeError("needs .sync.aligned")
    if m.one_type().name != "u32":
        raise DecodeError("needs .u32")
    m.done()
    expect_operands(ins, 1)
    count = ins.operands[0]
    if not isinstance(count, Imm) or count.kind != "int" or not 24 <= count.value <= 256 \
            or count.value % 8:
        raise DecodeError("the register count must be a constant in 24..256, a multiple of 8")

    inc, want = m_inc, count.value

    def bind(ctx):
        def run(sel):
            groups = warpgroups(ctx, sel, "setmaxnreg")
            pool = ctx.register_pool()
            waiting = [g for g in groups if not pool.move(g, want, inc)]
            return np.concatenate(waiting) if waiting else groups.reshape(-1)[:0]
        return run
    # .inc may yield (PARK, no predicate: run returns the threads that wait for registers)
    return Op(PARK if inc else NORMAL, ins, bind)


REGISTER_FILE = 65536       # 32-bit registers per SM (sm_90, sm_100)


class RegisterPool:
    """setmaxnreg's per-CTA pool (PTX ISA "setmaxnreg"). Every warpgroup starts at the kernel's
    register count at entry, which ptxc pins (.minnctapersm N on every kernel that moves
    registers: 1, or 2 for varlen's packed tile): ptxas then gives each thread the file's share,
    65536 / (threads x N) in multiples of 8 (255 where that is 256), which the hardware holds in
    granules of 8. The pool starts
    empty -- the CTA holds those registers, no more -- .dec adds (count - new) x 128 and .inc
    takes (new - count) x 128, or waits (the executor parks the warpgroup; a release wakes it)."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.entry = min(256, REGISTER_FILE // (ctx.nthreads * ctx.min_ctas_per_sm) // 8 * 8)
        groups = ctx.tpad // 128 if ctx.tpad % 128 == 0 else 0
        self.count = np.full((ctx.nctas, max(groups, 1)), self.entry, np.int64)
        self.free = np.zeros(ctx.nctas, np.int64)

    def move(self, group: np.ndarray, want: int, inc: bool) -> bool:
        """Warpgroup `group` (its 128 thread indices) to `want` registers a thread; False when
        an .inc must wait for the pool."""
        ctx = self.ctx
        first = int(group[0])
        cta, g = int(ctx.cta_of[first]), int(ctx.lin[first]) >> 7
        have = int(self.count[cta, g])
        if inc and want < have or not inc and want > have:
            raise Fault(f"setmaxnreg.{'inc' if inc else 'dec'} to {want} registers from the "
                        f"warpgroup's {have}: .inc may only raise the count, .dec only lower it",
                        first)
        delta = 128 * (want - have)
        if inc and delta > self.free[cta]:
            return False
        self.free[cta] -= delta
        self.count[cta, g] = want
        if not inc and delta:
            ctx.mbar.version += 1          # parked .inc warpgroups retry
        return True

    def describe(self, thread: int) -> str:
        """Why an .inc at `thread` waits: the pool against the warpgroups' counts."""
        cta = int(self.ctx.cta_of[thread])
        counts = ", ".join(str(int(c)) for c in self.count[cta])
        return (f"setmaxnreg.inc waits for ever: the CTA's register pool holds {int(self.free[cta])} "
                f"registers, and no warpgroup releases more (the CTA started with "
                f"{self.entry} a thread x {self.ctx.nthreads} threads; warpgroups now at "
                f"{counts})")


@register("stmatrix")
def decode_stmatrix(ins, env):
    nmat, trans, space, rplans, aplan = decode_matrix(ins, env, "stmatrix", src_plan)
    row, col, line = MATRIX_ROW, MATRIX_COL, ins.line

    def bind(ctx):
        readers = [p(ctx) for p in rplans]
        address = aplan(ctx)

        def run(sel):
            idx, nw, addr, who, rows, addr_of = matrix_rows(ctx, sel, address, nmat, space,
                                                            "stmatrix", "stmatrix row store")
            ctx.smem.check_not_pending(rows, 16, who, addr_of)
            if ctx.race is not None:
                ctx.race.warp_synced(sel)
                ctx.race.check(rows, 16, who, line, "write", addr_of)
                ctx.race.record(rows, 16, who, line)
            M = np.zeros((nw, nmat, 8, 8), np.uint16)              # [w, m, row, col]
            for i, rd in enumerate(readers):
                v = np.broadcast_to(np.asarray(rd(sel), np.uint32), idx.shape).reshape(nw, 32)
                lo, hi = (v & 0xFFFF).astype(np.uint16), (v >> 16).astype(np.uint16)
                if trans:
                    M[:, i, col, row], M[:, i, col + 1, row] = lo, hi
                else:
                    M[:, i, row, col], M[:, i, row, col + 1] = lo, hi
            ctx.smem.rows.scatter(rows, 16, M.reshape(-1, 8))
            ctx.smem.mark_written(rows, 16)
        return run
    return Op(NORMAL, ins, bind)
