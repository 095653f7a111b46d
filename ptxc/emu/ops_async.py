"""cp.async, cp.async.commit_group, cp.async.wait_group, cp.async.wait_all.

Model: a cp.async validates its addresses when issued and marks its shared destination bytes
as pending; the copy itself (reading the global source, zero-filling past src-size) happens at
the wait that completes its group. Until then a read or a write of the destination is an
error, so a missing wait shows up as an error rather than as a lucky read of stale data.
The bytes count as written by the issuing thread at its wait: another thread reading them
needs a barrier after that wait, which the race tracker (racecheck.py) checks.
"""

from __future__ import annotations

import numpy as np

from ptxc.emu.decode import NORMAL, Mods, Op, expect_operands, register
from ptxc.emu.memory import CP_ASYNC_PENDING, WRITTEN, _at
from ptxc.emu.operands import TYPES, DecodeError, Fault, src_plan
from ptxc.emu.ops_mem import address_plan
from ptxc.emu.ptx_ast import Imm


class AsyncCopies:
    """Per-batch cp.async bookkeeping: commit counters and not-yet-completed copies."""

    def __init__(self, n: int):
        self.commits = np.zeros(n, np.int64)     # groups committed so far, per thread
        self.records = []            # (threads, dst_flat, src_off, size, src_size, gid, line)

    def commit(self, threads):
        self.commits[threads] += 1

    def issue(self, threads, dst_flat, src_off, size, src_size, line):
        self.records.append((threads, dst_flat, src_off, size, src_size, self.commits[threads],
                             line))

    def complete(self, ctx, threads, keep_groups: int):
        """Complete the copies of `threads` except those in their `keep_groups` most recent
        committed groups and those not committed yet."""
        flag = ctx.scratch_flag
        flag[threads] = True
        remaining = []
        try:
            for rec in self.records:
                thr, dst, src, size, src_size, gid, line = rec
                done = flag[thr] & (gid < self.commits[thr] - keep_groups)
                if done.any():
                    self._apply(ctx, dst[done], src[done], size, src_size[done])
                    if ctx.race is not None:   # written by the issuing thread, at its wait
                        ctx.race.record_copy(dst[done], size, thr[done], line)
                    rest = ~done
                    rec = tuple(a[rest] for a in (thr, dst, src)) + (size,) + \
                        (src_size[rest], gid[rest], line)
                if rec[0].size:
                    remaining.append(rec)
        finally:
            flag[threads] = False
        self.records = remaining

    @staticmethod
    def _apply(ctx, dst, src, size, src_size):
        cols = np.arange(size)
        live = cols[None, :] < src_size[:, None]
        data = np.where(live, ctx.gmem.heap[np.where(live, src[:, None] + cols, 0)], 0)
        flat = dst[:, None] + cols
        ctx.smem.data[flat] = data
        ctx.smem.state[flat] = WRITTEN
        ctx.smem.forget_layout(flat[:, ::16])


@register("cp")
def decode_cp(ins, env):
    if "bulk" in ins.mods and ("commit_group" in ins.mods or "wait_group" in ins.mods):
        from ptxc.emu.ops_tma_store import decode_bulk_group
        return decode_bulk_group(ins, env)
    if "tensor" in ins.mods:
        if "bulk_group" in ins.mods:        # a store completes by bulk group, a load on an mbarrier
            from ptxc.emu.ops_tma_store import decode_cp_bulk_tensor_store
            return decode_cp_bulk_tensor_store(ins, env)
        from ptxc.emu.ops_tma import decode_cp_bulk_tensor
        return decode_cp_bulk_tensor(ins, env)
    if "bulk" in ins.mods:
        from ptxc.emu.ops_mbarrier import decode_cp_bulk
        return decode_cp_bulk(ins, env)
    m = Mods(ins)
    if not m.flag("async"):
        raise DecodeError("only cp.async is supported")
    if m.flag("commit_group"):
        m.done()
        expect_operands(ins, 0)
        return _simple_async(ins, lambda ctx, idx: ctx.cp_async.commit(idx))
    if m.flag("wait_all"):      # = cp.async.commit_group + cp.async.wait_group 0
        m.done()
        expect_operands(ins, 0)

        def wait_all(ctx, idx):
            ctx.cp_async.commit(idx)
            ctx.cp_async.complete(ctx, idx, 0)
        return _simple_async(ins, wait_all)
    if m.flag("wait_group"):
        m.done()
        expect_operands(ins, 1)
        n = ins.operands[0]
        if not isinstance(n, Imm) or n.kind != "int" or n.value < 0:
            raise DecodeError("wait_group needs a non-negative integer constant")
        return _simple_async(ins, lambda ctx, idx: ctx.cp_async.complete(ctx, idx, n.value))
    level = m.need("ca", "cg")
    if not m.flag("shared", "shared::cta") or not m.flag("global"):
        raise DecodeError("only cp.async.{ca,cg}.shared.global is supported")
    m.flag("L2::64B", "L2::128B", "L2::256B")
    m.done()
    expect_operands(ins, 3, 4)
    dst, src, size = ins.operands[:3]
    if not isinstance(size, Imm) or size.value not in (4, 8, 16):
        raise DecodeError("cp-size must be 4, 8 or 16")
    size = size.value
    if level == "cg" and size != 16:
        raise DecodeError("cp.async.cg needs cp-size 16")
    u32 = TYPES["u32"]
    if len(ins.operands) == 4:
        src_size_plan = src_plan(env, ins.operands[3], u32)
    else:
        full = np.uint32(size)
        src_size_plan = lambda ctx: (lambda sel: full)  # noqa: E731
    dplan, splan = address_plan(env, dst, "shared"), address_plan(env, src, "global")
    line = ins.line

    def bind(ctx):
        daddr, saddr, ssize = dplan(ctx), splan(ctx), src_size_plan(ctx)

        def run(sel):
            idx = ctx.all_index if isinstance(sel, slice) else sel
            n = idx.size
            src_size = np.broadcast_to(np.asarray(ssize(sel), np.int64), (n,)).copy()
            if (src_size > size).any():
                k = int(np.flatnonzero(src_size > size)[0])
                raise Fault(f"cp.async src-size {src_size[k]} exceeds cp-size {size}",
                            _at(idx, k))
            da = np.broadcast_to(daddr(sel), (n,))
            dflat = ctx.smem.offsets(ctx.cta_of[idx], da, size, size, "cp.async write", idx)
            sa = np.broadcast_to(np.asarray(saddr(sel), np.uint64), (n,))
            soff = np.zeros(n, np.int64)
            for nbytes in np.unique(src_size[src_size > 0]):
                rows = np.flatnonzero(src_size == nbytes)
                bad = (sa[rows] & np.uint64(size - 1)) != 0
                if bad.any():
                    k = rows[int(np.flatnonzero(bad)[0])]
                    raise Fault(f"misaligned cp.async source 0x{int(sa[k]):x} (cp-size {size})",
                                _at(idx, k), int(sa[k]))
                soff[rows] = ctx.gmem.offsets(sa[rows], int(nbytes), 1, "cp.async read",
                                              idx[rows])
            addr_of = lambda k: int(da[k])  # noqa: E731
            ctx.smem.check_not_pending(dflat // size, size, idx, addr_of)
            if ctx.race is not None:
                ctx.race.check(dflat // size, size, idx, line, "write", addr_of)
            if ctx.traffic is not None:
                live = src_size > 0
                ctx.traffic.global_access(line, "cp.async", idx[live], sa[live], src_size[live],
                                          False)
                ctx.traffic.shared_access(line, "cp.async", idx, da, size)
            ctx.smem.state[dflat[:, None] + np.arange(size)] = CP_ASYNC_PENDING
            ctx.cp_async.issue(idx, dflat, soff, size, src_size, line)
        return run
    return Op(NORMAL, ins, bind)


def _simple_async(ins, action):
    def bind(ctx):
        def run(sel):
            action(ctx, ctx.all_index if isinstance(sel, slice) else sel)
        return run
    return Op(NORMAL, ins, bind)
