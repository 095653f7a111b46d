"""Hopper warpgroup MMA: wgmma.mma_async (m64nNk16, f32 += f16/bf16; m64nNk32, f32 +=
e4m3/e5m2, K-major operands only), wgmma.fence, wgmma.commit_group, wgmma.wait_group.

Model. A warpgroup is 4 consecutive warps whose first warp index is a multiple of 4; every
wgmma instruction must be executed by all 128 threads of each warpgroup together (else a
"not converged" error), and descriptors must be uniform across the warpgroup. A
wgmma.mma_async computes its result when issued (16-bit operands: exact products summed in
float64 and C added, rounded once to f32, as mma.sync; FP8 operands: the tensor cores' own
13-bit-aligned sum, fp8.accumulate, which reproduces the H200 to the bit) and writes the
accumulator registers, but the operation stays *in flight* until the wgmma.wait_group that
retires its commit group:

* its accumulator and A registers must not be read or written by any other instruction of the
  issuing threads until then (other wgmma.mma_async of the chain may use the accumulator);
* the shared memory it reads must not be written until then (stores and cp.async to it fail),
  and a write by another warp must be ordered after its completion: the wait_group that
  retires it reads the operands again for the race tracker (_reread_at_completion);
* a register accessed by any non-wgmma instruction must be followed by a wgmma.fence before a
  wgmma.mma_async uses it (and a wgmma.fence must precede a warpgroup's first wgmma).

Since nothing may observe the registers or change the operands while it is in flight, computing
at issue gives exactly the values the hardware produces at any legal observation point.
"""

from __future__ import annotations

import functools
import re

import numpy as np

from ptxc.emu.fp8 import FORMATS as FP8_KINDS
from ptxc.emu.fp8 import accumulate as fp8_accumulate
from ptxc.emu.decode import NORMAL, Mods, Op, expect_operands, register
from ptxc.emu.operands import TYPES, DecodeError, Fault, dst_plan, src_plan
from ptxc.emu.ops_warp import elements_to_f64
from ptxc.emu.ptx_ast import Imm, Reg, Vec
from ptxc.emu.uninit import _regs
from ptxc.emu.wgmma_layout import (
    Descriptor, a_register_map, accumulator_map, chunk_coefficients, swizzle_address)

U64, B32, F32, PRED = TYPES["u64"], TYPES["b32"], TYPES["f32"], TYPES["pred"]
_N_SIZES = tuple(range(8, 257, 8))


def wgmma_registers(ops) -> tuple:
    """Registers used as accumulator or A fragment by the program's wgmma.mma_async."""
    names = []
    for op in ops:
        ins = op.ins
        if ins.opcode == "wgmma" and "mma_async" in ins.mods:
            for operand in ins.operands[:2]:
                if isinstance(operand, Vec):
                    _regs(operand, names)
    return tuple(dict.fromkeys(names))


class WgmmaState:
    """Per batch: commit counters, in-flight operations, per-register in-flight counts and
    'accessed since the last wgmma.fence' flags for the registers wgmma uses."""

    def __init__(self, ctx, regs):
        n = ctx.n
        self.commits = np.zeros(n, np.int64)
        self.records = []       # (threads (G,128), gid (G,), regs, smem chunk rows (G, c), line)
        self.busy = {r: np.zeros(n, np.int16) for r in regs}
        self.touched = {r: np.ones(n, np.bool_) for r in regs}

    def retire(self, ctx, idx, keep: int):
        flag = ctx.scratch_flag
        flag[idx] = True
        left = []
        try:
            for thr, gid, regs, rows, line in self.records:
                lead = thr[:, 0]
                done = flag[lead] & (gid < self.commits[lead] - keep)
                if done.any():
                    who = thr[done].reshape(-1)
                    for r in regs:
                        self.busy[r][who] -= 1
                    np.subtract.at(ctx.smem.async_readers, rows[done].reshape(-1), 1)
                    ctx.smem.async_live -= int(done.sum())
                    if ctx.race is not None:
                        _reread_at_completion(ctx, thr[done], rows[done], line)
                    keep_g = ~done
                    thr, gid, rows = thr[keep_g], gid[keep_g], rows[keep_g]
                if thr.size:
                    left.append((thr, gid, regs, rows, line))
        finally:
            flag[idx] = False
        self.records = left


def _reread_at_completion(ctx, thr, rows, line):
    """The race tracker sees the operands' shared memory read again by the issuing threads when
    the wait_group retires them (the chunks spread over the warpgroup's threads as at issue):
    a refill (a store, cp.async or TMA copy by a producer) must be ordered after the wgmma's
    *completion* -- the consumers' wait_group, then their arrival on the stage's "empty"
    barrier -- not merely after its issue. The in-flight count (smem.async_readers) catches a
    refill before the wait_group in the emulator's schedule; this one a consumer that arrives
    before its wait_group, whatever the schedule."""
    who = thr[:, np.arange(rows.shape[1]) % thr.shape[1]].reshape(-1)
    chunks = rows.reshape(-1)
    stride = ctx.smem.stride
    ctx.race.read(chunks, 16, who, line, lambda k: int(chunks[k]) * 16 % stride)


def bind_wgmma_checks(program, ctx, ops, bound):
    """Create ctx.wgmma for programs with wgmma and wrap every other op touching a wgmma
    register with the in-flight check and the fence bookkeeping (free for other kernels)."""
    regs = wgmma_registers(ops)
    if not regs:
        return
    state = ctx.wgmma = WgmmaState(ctx, regs)
    if ctx.smem.async_readers is None:
        ctx.smem.async_readers = np.zeros(ctx.smem.data.size // 16 + 1, np.int32)
    tracked = set(regs)
    for pc, op in enumerate(ops):
        if bound[pc] is None or op.ins.opcode == "wgmma":
            continue
        names = []
        for operand in op.ins.operands:
            _regs(operand, names)
        used = [r for r in dict.fromkeys(names) if r in tracked]
        if used:
            bound[pc] = _with_inflight_check(bound[pc], state, used)


def _with_inflight_check(run, state, used):
    busy = [(r, state.busy[r]) for r in used]
    touched = [state.touched[r] for r in used]

    def checked(sel):
        for name, b in busy:
            hit = b[sel] > 0
            if hit.any():
                k = int(np.flatnonzero(hit)[0])
                raise Fault(f"register {name} belongs to a wgmma.mma_async still in flight: "
                            f"it may not be read or written before the wgmma.wait_group that "
                            f"retires the operation", k if isinstance(sel, slice) else int(sel[k]))
        for t in touched:
            t[sel] = True
        run(sel)
    return checked


def warpgroups(ctx, sel, what: str):
    """The executing threads as (G, 128) whole warpgroups, or a Fault."""
    idx = ctx.all_index if isinstance(sel, slice) else np.asarray(sel)
    ok = idx.size % 128 == 0 and ctx.tpad % 128 == 0
    if ok:
        g = idx.reshape(-1, 128)
        ok = bool(((ctx.lin[g[:, 0]] & 127) == 0).all() and ((g[:, 127] - g[:, 0]) == 127).all())
        ok = ok and (isinstance(sel, slice) or ctx.nthreads % 128 == 0)
        if ok:
            return g
    groups = idx >> 7 if ctx.tpad % 128 == 0 else idx
    first = int(idx[0])
    if ctx.tpad % 128:
        raise Fault(f"{what} needs whole warpgroups of 4 warps, but the block has "
                    f"{ctx.nthreads} threads (not a multiple of 128)", first)
    vals, counts = np.unique(groups, return_counts=True)
    bad = int(vals[np.flatnonzero(counts != 128)[0]]) if (counts != 128).any() else int(vals[0])
    first = int(idx[np.flatnonzero(groups == bad)[0]])
    raise Fault(f"{what} needs all 128 threads of the warpgroup (warps "
                f"{4 * ((ctx.lin[first] >> 7))}-{4 * ((ctx.lin[first] >> 7)) + 3}) converged on "
                f"it, but only {int(np.count_nonzero(groups == bad))} execute it (exited, "
                f"diverged or beyond the block)", first)


@register("wgmma")
def decode_wgmma(ins, env):
    m = Mods(ins)
    if not (m.flag("sync") and m.flag("aligned")):
        raise DecodeError("needs .sync.aligned")
    kind = m.need("mma_async", "fence", "commit_group", "wait_group")
    if kind != "mma_async":
        m.done()
        return _decode_control(ins, kind)
    shape = m.left[0] if m.left else ""
    dims = re.fullmatch(r"m64n(\d+)k(16|32)", shape)
    n, k = (int(dims[1]), int(dims[2])) if dims else (0, 0)
    if n not in _N_SIZES:
        raise DecodeError("supported shapes: .m64nNk16 (f16, bf16) and .m64nNk32 (e4m3, e5m2) "
                          "with N = 8, 16, ..., 256")
    m.left.pop(0)
    narrow = [x for x in m.left if x in FP8_KINDS]     # 8-bit types are not register types
    for x in narrow:
        m.left.remove(x)
    types = [t.name for t in m.types()]
    m.done()
    if k == 16:
        if narrow or len(types) != 3 or types[0] != "f32" or types[1] != types[2] or \
                types[1] not in ("f16", "bf16"):
            raise DecodeError("supported types: .f32.f16.f16 and .f32.bf16.bf16 (k16)")
        kinds = (types[1], types[1])
    else:
        if types != ["f32"] or len(narrow) != 2:
            raise DecodeError("supported types: .f32 with .e4m3 / .e5m2 A and B (k32)")
        kinds = tuple(narrow)
    return _decode_mma_async(ins, env, n, kinds)


def _decode_control(ins, kind):
    if kind == "wait_group":
        expect_operands(ins, 1)
        keep = ins.operands[0]
        if not isinstance(keep, Imm) or keep.kind != "int" or keep.value < 0:
            raise DecodeError("wait_group needs a non-negative integer constant")
    else:
        expect_operands(ins, 0)
    what = f"wgmma.{kind}"

    def bind(ctx):
        def run(sel):
            thr = warpgroups(ctx, sel, what)
            state = ctx.wgmma
            if state is None:
                return
            idx = thr.reshape(-1)
            if kind == "fence":
                for t in state.touched.values():
                    t[idx] = False
            elif kind == "commit_group":
                state.commits[idx] += 1
            else:
                state.retire(ctx, idx, keep.value)
        return run
    return Op(NORMAL, ins, bind)


def _imm(operand, allowed, what):
    if not isinstance(operand, Imm) or operand.kind != "int" or operand.value not in allowed:
        raise DecodeError(f"{what} must be one of {', '.join(map(str, allowed))}")
    return operand.value


def _decode_mma_async(ins, env, n, kinds):
    ops = ins.operands
    a_regs = isinstance(ops[1], Vec) if len(ops) > 1 else False
    narrow = kinds[0] in FP8_KINDS       # 8-bit operands: K-major only, no transpose operands
    expect_operands(ins, *((6,) if narrow else (6, 7) if a_regs else (6, 8)))
    d = ops[0]
    if not isinstance(d, Vec) or len(d.items) != n // 2:
        raise DecodeError(f"the accumulator of m64n{n}.f32 is {{{n // 2}}} .f32 registers")
    if a_regs and len(ops[1].items) != 4:
        raise DecodeError("register operand A is {4} .b32 registers")
    scale_a = _imm(ops[4], (1, -1), "imm-scale-a")
    scale_b = _imm(ops[5], (1, -1), "imm-scale-b")
    trans = [_imm(x, (0, 1), "imm-trans") for x in ops[6:]]
    if a_regs:
        trans_a, trans_b = 0, (trans[0] if trans else 0)
    else:
        trans_a, trans_b = trans if trans else (0, 0)
    sd = ops[3]
    if isinstance(sd, Imm):
        scale_d_plan = (lambda v: (lambda ctx: (lambda sel: v)))(bool(sd.value))
    else:
        scale_d_plan = src_plan(env, sd, PRED)
    dplans = [dst_plan(env, x, F32) for x in d.items]
    cplans = [src_plan(env, x, F32) for x in d.items]
    aplans = [src_plan(env, x, B32) for x in ops[1].items] if a_regs else \
        [src_plan(env, ops[1], U64)]
    bplan = src_plan(env, ops[2], U64)
    d_names = [x.name for x in d.items if isinstance(x, Reg)]
    a_names = [x.name for x in ops[1].items if isinstance(x, Reg)] if a_regs else []
    acc_row, acc_col = accumulator_map(n)
    ar_row, ar_col = a_register_map(narrow)
    depth = 32 if narrow else 16
    line = ins.line
    sign = float(scale_a * scale_b)

    def bind(ctx):
        writers = [p(ctx) for p in dplans]
        creaders = [p(ctx) for p in cplans]
        areaders = [p(ctx) for p in aplans]
        bread, sdread = bplan(ctx), scale_d_plan(ctx)

        def run(sel):
            thr = warpgroups(ctx, sel, "wgmma.mma_async")
            state = ctx.wgmma
            G, idx = thr.shape[0], thr.reshape(-1)
            _check_fenced(state, d_names + a_names, idx)
            if a_names:
                for r in a_names:
                    if (state.busy[r][idx] > 0).any():
                        raise Fault(f"register {r} (operand A) belongs to a wgmma.mma_async "
                                    f"still in flight", int(idx[0]))
            # readers give one value per selected thread (or a scalar); sel is either every
            # thread of the batch or the index array `idx`, so thr's order is sel's order
            local = lambda r, dt: np.broadcast_to(  # noqa: E731
                np.asarray(r(sel), dt), (idx.size,)).reshape(G, 128)
            bdesc = _uniform_desc(local(bread, np.uint64), thr, "B")
            B, brows = _operand(ctx, thr, bdesc, n, bool(trans_b), line, kinds[1], "B")
            rows = [brows]
            if a_regs:
                words = np.stack([local(r, np.uint32) for r in areaders], axis=2)
                vals = elements_to_f64(words, kinds[0])          # (G, 128, 8 or 16)
                A = np.zeros((G, 64, depth))
                A[:, ar_row, ar_col] = vals
            else:
                adesc = _uniform_desc(local(areaders[0], np.uint64), thr, "A")
                A, arows = _operand(ctx, thr, adesc, 64, bool(trans_a), line, kinds[0], "A")
                rows.append(arows)
            scale_d = local(sdread, np.bool_)
            C = np.zeros((G, 64, n))
            cvals = np.stack([local(r, np.float32) for r in creaders], axis=2)
            C[:, acc_row, acc_col] = np.where(scale_d[:, :, None], cvals.astype(np.float64), 0)
            if narrow:      # FP8: the tensor cores' own accumulation (fp8.accumulate)
                D = fp8_accumulate(A[:, :, None, :] * B[:, None, :, :] * sign, C)
            else:
                D = np.einsum("gmk,gnk->gmn", A, B) * sign + C
            out = D.astype(np.float32)[:, acc_row, acc_col].reshape(-1, n // 2)
            for i, w in enumerate(writers):
                w(sel, out[:, i])
            _record(ctx, state, thr, d_names + a_names, np.concatenate(rows, axis=1), line)
        return run
    return Op(NORMAL, ins, bind)


def _operand(ctx, thr, desc_values, rows, mn_major, line, kind, which):
    descs = [Descriptor(int(v)) for v in desc_values]
    raw, chunk_rows = read_operand(ctx, thr, descs, rows, mn_major, line, which)
    return elements_to_f64(raw.view(np.uint32), kind), chunk_rows


def _check_fenced(state, names, idx):
    for r in names:
        t = state.touched[r][idx]
        if t.any():
            k = int(np.flatnonzero(t)[0])
            raise Fault(f"register {r} was accessed since the last wgmma.fence: a wgmma.fence "
                        f"must separate register accesses (and the start of the kernel) from a "
                        f"wgmma.mma_async that uses the register", int(idx[k]))


def _uniform_desc(values, thr, which):
    bad = (values != values[:, :1]).any(axis=1)
    if bad.any():
        g = int(np.flatnonzero(bad)[0])
        k = int(np.flatnonzero(values[g] != values[g, 0])[0])
        raise Fault(f"matrix descriptor of {which} differs between the threads of a warpgroup",
                    int(thr[g, k]))
    return values[:, 0]


@functools.lru_cache(maxsize=64)
def _coefficients(rows, mn_major, swizzle):
    return chunk_coefficients(rows, mn_major, swizzle)


def read_operand(ctx, thr, descs, rows, mn_major, line, which):
    """The (G, rows, 16) raw 16-bit elements of each group's operand (descs: one decoded
    descriptor per group, `wgmma_layout.Descriptor` or `tcgen05_layout.SmemDescriptor`) and its
    16-byte chunk rows; thr (G, T) are the issuing threads (T = 128 for a warpgroup, 1 for a
    single-thread tcgen05.mma), charged with the reads."""
    G, T = thr.shape
    out = np.zeros((G, rows, 16), np.uint16)
    chunk_rows = []
    for g, dsc in enumerate(descs):
        if dsc.base_offset:
            raise Fault(f"unsupported: matrix descriptor with a non-zero base offset "
                        f"({dsc!r})", int(thr[g, 0]))
        c0, cl, cs, er, ek = _coefficients(rows, mn_major, dsc.swizzle)
        addr = swizzle_address(dsc.start + c0 + cl * dsc.lbo + cs * dsc.sbo, dsc.swizzle)
        who = thr[g, np.arange(addr.size) % T]
        flat = ctx.smem.offsets(ctx.cta_of[who], addr, 16, 16, "MMA operand read", who)
        crow = flat >> 4
        addr_of = lambda k, a=addr: int(a[k])  # noqa: E731
        ctx.smem.check_readable(crow, 16, who, addr_of)
        tags = ctx.smem.tma_swizzle
        if tags is not None:
            wrong = (tags[crow] >= 0) & (tags[crow] != dsc.swizzle)
            if wrong.any():
                k = int(np.flatnonzero(wrong)[0])
                said = lambda w: f"a {w}-byte swizzle" if w else "no swizzle"  # noqa: E731
                raise Fault(f"the {which} descriptor ({dsc!r}) reads with {said(dsc.swizzle)} a "
                            f"tile that TMA wrote with {said(int(tags[crow[k]]))} (shared "
                            f"address 0x{int(addr[k]):x})", int(who[k]), int(addr[k]))
        if ctx.race is not None:
            ctx.race.read(crow, 16, who, line, addr_of)
            ctx.race.async_read(crow, 16, who, line, f"the {which} operand", addr_of)
        out[g, er, ek] = ctx.smem.rows.gather(crow, 16, 2, 8)
        chunk_rows.append(crow)
    return out, np.stack(chunk_rows)


def _record(ctx, state, thr, names, rows, line):
    idx = thr.reshape(-1)
    for r in names:
        state.busy[r][idx] += 1
    np.add.at(ctx.smem.async_readers, rows.reshape(-1), 1)
    ctx.smem.async_live += thr.shape[0]
    state.records.append((thr, state.commits[thr[:, 0]].copy(), tuple(names), rows, line))
