"""Warp-collective instructions: shfl.sync, mma.sync (f16 / bf16 / tf32, and e4m3 / e5m2 at
m16n8k32), ldmatrix (bar.warp.sync: ops_ctrl.py; lane masks: ops_vote.py).

Threads are numbered so that lane = thread index % 32 and a warp is 32 consecutive threads
(each CTA is padded to whole warps; padding threads count as exited). Collectives check that
the lanes they need are executing the same instruction now; anything else is undefined
behaviour in PTX and raises a Fault naming the first offending thread.
"""

from __future__ import annotations

import functools

import numpy as np

from ptxc.emu.decode import NORMAL, Mods, Op, expect_operands, register
from ptxc.emu.fp8 import FORMATS as FP8_KINDS, to_f16_bits
from ptxc.emu.fp8 import accumulate as fp8_accumulate
from ptxc.emu.memory import GENERIC_SHARED_BASE
from ptxc.emu.operands import TYPES, DecodeError, Fault, dst_plan, src_plan
from ptxc.emu.ops_mem import address_plan
from ptxc.emu.ptx_ast import Imm, Pair, Vec

U32, B32, F32, PRED = TYPES["u32"], TYPES["b32"], TYPES["f32"], TYPES["pred"]
FULL_MASK = 0xFFFFFFFF


def executing_lanes(ctx, idx):
    """Per executing thread: the bitmask of lanes of its warp that execute with it."""
    flag = ctx.scratch_flag
    flag[idx] = True
    packed = np.packbits(flag.reshape(-1, 32), axis=1, bitorder="little").view("<u4")[:, 0]
    flag[idx] = False
    return packed[idx >> 5]


def complete_warps(idx) -> bool:
    """Whether the sorted, distinct thread indices `idx` are a union of whole warps."""
    if idx.size % 32:
        return False
    w = idx.reshape(-1, 32)
    # 32 distinct sorted indices spanning exactly 31 from a multiple of 32: one whole warp
    return bool(((w[:, 0] & 31) == 0).all() and ((w[:, 31] - w[:, 0]) == 31).all())


def whole_warps(ctx, sel, what: str):
    """Index array of `sel`, checked to consist of complete warps."""
    if isinstance(sel, slice):
        return ctx.all_index          # sel == ALL only when every thread is live and here
    idx = sel
    if complete_warps(idx):
        return idx
    warps, counts = np.unique(idx >> 5, return_counts=True)
    bad_warp = int(warps[np.flatnonzero(counts != 32)[0]])
    present = executing_lanes(ctx, idx[(idx >> 5) == bad_warp][:1])[0]
    missing = [lane for lane in range(32) if not (int(present) >> lane) & 1]
    first = int(idx[np.flatnonzero((idx >> 5) == bad_warp)[0]])
    raise Fault(f"{what} needs all 32 lanes of the warp converged on it, but lane(s) "
                f"{_lanes(missing)} are not executing it (exited, diverged or beyond the block)",
                first)


def _lanes(lanes) -> str:
    return ", ".join(str(x) for x in lanes[:8]) + (" ..." if len(lanes) > 8 else "")


# ----------------------------------------------------------------------------- shfl.sync

@register("shfl")
def decode_shfl(ins, env):
    m = Mods(ins)
    if not m.flag("sync"):
        raise DecodeError("only shfl.sync is supported (legacy shfl needs sm_6x)")
    mode = m.need("up", "down", "bfly", "idx")
    t = m.one_type()
    m.done()
    if t.name != "b32":
        raise DecodeError("shfl.sync needs .b32")
    expect_operands(ins, 5)
    d, a, b, c, mask = ins.operands
    dp = dst_plan(env, d.first if isinstance(d, Pair) else d, B32)
    pp = dst_plan(env, d.second, PRED) if isinstance(d, Pair) else None
    ap, bp, cp, mp = (src_plan(env, a, B32), src_plan(env, b, U32), src_plan(env, c, U32),
                      src_plan(env, mask, U32))
    mask_full = isinstance(mask, Imm) and (mask.value & FULL_MASK) == FULL_MASK
    if isinstance(b, Imm) and isinstance(c, Imm):      # the usual case: a fixed lane pattern
        lane = np.arange(32)
        j_tab, p_tab = shfl_source_lane(mode, lane, b.value, c.value)
        delta_tab = j_tab - lane
    else:
        delta_tab = None

    def bind(ctx):
        write, pwrite = dp(ctx), pp(ctx) if pp else None
        ra, rb, rc, rm = ap(ctx), bp(ctx), cp(ctx), mp(ctx)
        if delta_tab is not None:
            src_all = ctx.all_index + delta_tab[ctx.lane]
            pval_all = p_tab[ctx.lane]

        def run(sel):
            idx = ctx.all_index if isinstance(sel, slice) else sel
            if delta_tab is not None:
                src, pval = src_all[sel], pval_all[sel]
            else:
                lane = ctx.lane[idx]
                j, pval = shfl_source_lane(mode, lane, np.asarray(rb(sel), np.int64),
                                           np.asarray(rc(sel), np.int64))
                src = idx - lane + j
            # with a full mask and whole warps executing, every check below holds
            if not (mask_full and (isinstance(sel, slice) or complete_warps(idx))):
                _check_shfl(ctx, idx, ctx.lane[idx], src, np.asarray(rm(sel), np.int64))
            value = ra(src)
            if ctx.race is not None:
                ctx.race.warp_synced(sel)
            write(sel, value)
            if pwrite:
                pwrite(sel, pval)
        return run
    return Op(NORMAL, ins, bind)


def shfl_source_lane(mode: str, lane, b, c):
    """The PTX ISA pseudocode: (source lane j, predicate p); j = lane when p is false."""
    bval = np.asarray(b, np.int64) & 31
    cval, seg = np.asarray(c, np.int64) & 31, (np.asarray(c, np.int64) >> 8) & 31
    max_lane = (lane & seg) | (cval & ~seg)
    min_lane = lane & seg
    if mode == "up":
        j = lane - bval
        pval = j >= max_lane
    elif mode == "down":
        j = lane + bval
        pval = j <= max_lane
    elif mode == "bfly":
        j = lane ^ bval
        pval = j <= max_lane
    else:
        j = min_lane | (bval & ~seg)
        pval = j <= max_lane
    return np.where(pval, j, lane), pval


def check_membermask(ctx, idx, lane, membermask, what: str):
    """A collective with a membermask (shfl.sync, vote.sync, elect.sync): every executing lane
    must be in it and every lane it names executing it. Returns the executing lanes' masks."""
    not_member = ((membermask >> lane) & 1) == 0
    if not_member.any():
        k = int(np.flatnonzero(not_member)[0])
        raise Fault(f"{what} executed by lane {lane[k]}, which is not in its membermask "
                    f"0x{int(membermask[k]):08x}", int(idx[k]))
    here = executing_lanes(ctx, idx).astype(np.int64)
    absent = membermask & ~here
    if absent.any():
        k = int(np.flatnonzero(absent)[0])
        lanes = [x for x in range(32) if (int(absent[k]) >> x) & 1]
        raise Fault(f"{what} membermask 0x{int(membermask[k]):08x} names lane(s) "
                    f"{_lanes(lanes)} that are not executing it (exited or diverged)", int(idx[k]))
    return here


def _check_shfl(ctx, idx, lane, src, membermask):
    here = check_membermask(ctx, idx, lane, np.broadcast_to(membermask & FULL_MASK, idx.shape), "shfl.sync")
    src_lane = src & 31
    src_here = ((here >> src_lane) & 1) == 1
    if not src_here.all():
        k = int(np.flatnonzero(~src_here)[0])
        raise Fault(f"shfl.sync reads lane {src_lane[k]}, which is not executing it",
                    int(idx[k]))


# ----------------------------------------------------------------------------- mma.sync

def _mma_maps(k: int):
    """(lane, element) -> (row, col) maps for A (16 x k), B (k x 8) and C/D (16 x 8)."""
    lane = np.arange(32)
    g, t = lane >> 2, lane & 3
    na = k // 2                       # A elements per lane: 8 for k16, 4 for k8
    ia = np.arange(na)
    a_row = g[:, None] + 8 * ((ia[None, :] >> 1) & 1)
    a_col = 2 * t[:, None] + (ia[None, :] & 1) + 8 * (ia[None, :] >> 2)
    nb = k // 4
    ib = np.arange(nb)
    b_row = 2 * t[:, None] + (ib[None, :] & 1) + 8 * (ib[None, :] >> 1)
    b_col = np.broadcast_to(g[:, None], (32, nb))
    ic = np.arange(4)
    c_row = g[:, None] + 8 * (ic[None, :] >> 1)
    c_col = 2 * t[:, None] + (ic[None, :] & 1)
    return [x.reshape(-1) for x in (a_row, a_col, b_row, b_col, c_row, c_col)]


def _halves_to_f64(words, is_bf16: bool):
    """(..., r) uint32 packed pairs -> (..., 2r) float64, lower half first."""
    h = np.ascontiguousarray(words).view(np.uint16)
    if is_bf16:
        return (h.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)
    return h.view(np.float16).astype(np.float64)


def _tf32_maps(k: int):
    """(lane, element) -> (row, col) maps of the tf32 shapes m16n8k8 / m16n8k4: one element
    per register (PTX ISA, "Matrix fragments for mma.m16n8k8 / m16n8k4 with .tf32")."""
    lane = np.arange(32)
    g, t = lane >> 2, lane & 3
    ia, ib, ic = np.arange(k // 2), np.arange(k // 4), np.arange(4)
    a_row = g[:, None] + 8 * (ia[None, :] & 1)
    a_col = t[:, None] + 4 * (ia[None, :] >> 1)
    b_row = t[:, None] + 4 * ib[None, :]
    b_col = np.broadcast_to(g[:, None], (32, k // 4))
    c_row = g[:, None] + 8 * (ic[None, :] >> 1)
    c_col = 2 * t[:, None] + (ic[None, :] & 1)
    return [x.reshape(-1) for x in (a_row, a_col, b_row, b_col, c_row, c_col)]


def _fp8_maps():
    """(lane, element) -> (row, col) maps of m16n8k32 over 8-bit operands (PTX ISA, "Matrix
    fragments for mma.m16n8k32"): a register holds 4 consecutive k, the lowest byte first.
    A (16 x 32): registers 0..3 at rows g, g + 8, g, g + 8 and columns 4t.., 4t.., 16 + 4t..,
    16 + 4t..; B (32 x 8): registers 0, 1 at rows 4t.. and 16 + 4t.., column g."""
    lane = np.arange(32)
    g, t = lane >> 2, lane & 3
    ia, ib, ic = np.arange(16), np.arange(8), np.arange(4)
    a_row = g[:, None] + 8 * ((ia[None, :] >> 2) & 1)
    a_col = 4 * t[:, None] + (ia[None, :] & 3) + 16 * (ia[None, :] >> 3)
    b_row = 4 * t[:, None] + (ib[None, :] & 3) + 16 * (ib[None, :] >> 2)
    b_col = np.broadcast_to(g[:, None], (32, 8))
    c_row = g[:, None] + 8 * (ic[None, :] >> 1)
    c_col = 2 * t[:, None] + (ic[None, :] & 1)
    return [x.reshape(-1) for x in (a_row, a_col, b_row, b_col, c_row, c_col)]


def elements_to_f64(words, kind: str):
    """(..., r) uint32 words -> their elements as float64, the lowest bits first: 2r halves
    (f16, bf16) or 4r bytes (e4m3, e5m2: every FP8 value is an f16 value, NaN stays NaN). The
    operand chunks' bytes are in k order either way (a 16-byte chunk: 8 or 16 consecutive k)."""
    if kind in FP8_KINDS:
        codes = np.ascontiguousarray(words).view(np.uint8)
        return to_f16_bits(codes, kind).view(np.float16).astype(np.float64)
    return _halves_to_f64(words, kind == "bf16")


def _tf32_to_f64(words):
    """tf32 operands: the upper 19 bits of each 32-bit register (the rest is ignored)."""
    w = np.ascontiguousarray(words, np.uint32) & np.uint32(0xFFFFE000)
    return w.view(np.float32).astype(np.float64)


@register("mma")
def decode_mma(ins, env):
    m = Mods(ins)
    if not (m.flag("sync") and m.flag("aligned")):
        raise DecodeError("needs .sync.aligned")
    shape = m.need("m16n8k32", "m16n8k16", "m16n8k8", "m16n8k4")
    if not (m.flag("row") and m.flag("col")):
        raise DecodeError("only the .row.col layout is supported")
    tf32 = m.left.count("tf32")
    m.left = [x for x in m.left if x != "tf32"]
    narrow = [x for x in m.left if x in FP8_KINDS]     # 8-bit types are not register types
    m.left = [x for x in m.left if x not in FP8_KINDS]
    types = [t.name for t in m.types()]
    m.done()
    k = {"m16n8k32": 32, "m16n8k16": 16, "m16n8k8": 8, "m16n8k4": 4}[shape]
    kinds = None
    if k == 32 or narrow:     # sm_89+: e4m3 / e5m2 A and B (mixed allowed), f32 accumulate
        if k != 32 or tf32 or len(narrow) != 2 or types != ["f32", "f32"]:
            raise DecodeError("8-bit mma is .m16n8k32 .f32.{e4m3,e5m2}.{e4m3,e5m2}.f32")
        counts, maps, elem, kinds = (4, 4, 2, 4), _fp8_maps(), "fp8", tuple(narrow)
    elif tf32:
        if tf32 != 2 or types != ["f32", "f32"] or k == 16:
            raise DecodeError("tf32 mma is .m16n8k8/.m16n8k4 .f32.tf32.tf32.f32")
        counts, maps, elem = (4, k // 2, k // 4, 4), _tf32_maps(k), "tf32"
    else:
        if len(types) != 4 or types[0] != "f32" or types[3] != "f32" or \
                types[1] != types[2] or types[1] not in ("f16", "bf16") or k == 4:
            raise DecodeError("supported: .m16n8k16/.m16n8k8 .f32.{f16,bf16}.{f16,bf16}.f32 "
                              "and .m16n8k8/.m16n8k4 .f32.tf32.tf32.f32")
        counts, maps, elem = (4, k // 4, k // 8, 4), _mma_maps(k), types[1]
    expect_operands(ins, 4)
    groups = []
    for op, n, ty in zip(ins.operands, counts, (F32, B32, B32, F32)):
        if not isinstance(op, Vec) or len(op.items) != n:
            raise DecodeError(f"mma.{shape} fragments are {{{counts[0]}}}, {{{counts[1]}}}, "
                              f"{{{counts[2]}}}, {{{counts[3]}}} registers")
        groups.append(op.items)
    dplans = [dst_plan(env, x, F32) for x in groups[0]]
    splans = [[src_plan(env, x, ty) for x in grp]
              for grp, ty in zip(groups[1:], (B32, B32, F32))]
    a_row, a_col, b_row, b_col, c_row, c_col = maps
    if elem == "tf32":
        to_a = to_b = _tf32_to_f64
    else:       # f16 / bf16 pairs or FP8 bytes (A and B may differ)
        to_a, to_b = (functools.partial(elements_to_f64, kind=x) for x in (kinds or (elem, elem)))

    def bind(ctx):
        writers = [p(ctx) for p in dplans]
        ra, rb, rc = ([p(ctx) for p in grp] for grp in splans)

        def run(sel):
            idx = whole_warps(ctx, sel, "mma.sync")
            nw = idx.size // 32
            if ctx.race is not None:
                ctx.race.warp_synced(sel)

            def frag(readers, dt):
                cols = [np.broadcast_to(np.asarray(r(sel), dt), idx.shape) for r in readers]
                return np.stack(cols, axis=1).reshape(nw, 32, len(readers))
            A = np.zeros((nw, 16, k))
            A[:, a_row, a_col] = to_a(frag(ra, np.uint32)).reshape(nw, -1)
            B = np.zeros((nw, k, 8))
            B[:, b_row, b_col] = to_b(frag(rb, np.uint32)).reshape(nw, -1)
            C = np.zeros((nw, 16, 8))
            C[:, c_row, c_col] = frag(rc, np.float32).astype(np.float64).reshape(nw, -1)
            if kinds:   # FP8: the tensor cores' own accumulation (fp8.accumulate)
                D = fp8_accumulate(A[:, :, None, :] * np.swapaxes(B, 1, 2)[:, None, :, :], C)
            else:       # float64 accumulation of exact f16/bf16/tf32 products, rounded once to f32
                D = A @ B + C
            D = D.astype(np.float32)[:, c_row, c_col].reshape(nw, 32, 4)
            for i, w in enumerate(writers):
                w(sel, D[:, :, i].reshape(-1))
        return run
    return Op(NORMAL, ins, bind)


# ----------------------------------------------------------------------------- ldmatrix

def decode_matrix(ins, env, name: str, plan):
    """ldmatrix / stmatrix .sync.aligned.m8n8.{x1,x2,x4}[.trans][.shared].b16 [a], {r..}:
    (matrices, trans, in the shared space, the register plans `plan(env, reg, B32)` of the
    vector operand, the address plan)."""
    m = Mods(ins)
    if not (m.flag("sync") and m.flag("aligned")):
        raise DecodeError("needs .sync.aligned")
    if not m.flag("m8n8"):
        raise DecodeError("only .m8n8 is supported")
    nmat = {"x1": 1, "x2": 2, "x4": 4}[m.need("x1", "x2", "x4")]
    trans = bool(m.flag("trans"))
    space = m.flag("shared", "shared::cta")
    if m.one_type().name != "b16":
        raise DecodeError("only .b16 is supported")
    m.done()
    expect_operands(ins, 2)
    vec, a = ins.operands if name == "ldmatrix" else ins.operands[::-1]
    if not isinstance(vec, Vec) or len(vec.items) != nmat:
        role = "destination" if name == "ldmatrix" else "source"
        raise DecodeError(f"needs {{{nmat}}} {role} registers")
    return (nmat, trans, space, [plan(env, x, B32) for x in vec.items],
            address_plan(env, a, "shared" if space else None))


def matrix_rows(ctx, sel, address, nmat: int, space, name: str, what: str):
    """The 16-byte shared rows an ldmatrix / stmatrix of the selected (whole) warps touches:
    (thread indices, warps, row addresses [w, 8 nmat], the threads that give them, flat row
    indices, addr_of for messages). Lanes 0 .. 8 nmat - 1 give one row address each."""
    idx = whole_warps(ctx, sel, name)
    nw = idx.size // 32
    addr = np.broadcast_to(address(sel), idx.shape).reshape(nw, 32)[:, :8 * nmat]
    if not space:   # generic address: must point into the shared window
        addr = addr.astype(np.int64) - GENERIC_SHARED_BASE
    who = idx.reshape(nw, 32)[:, :8 * nmat].reshape(-1)
    flat = ctx.smem.offsets(ctx.cta_of[who], addr.reshape(-1), 16, 16, what, who)
    return idx, nw, addr, who, flat >> 4, lambda k: int(addr.reshape(-1)[k])


# a lane's two b16 values of each 8 x 8 matrix: row lane / 4, columns 2 (lane % 4) and + 1
_LANE = np.arange(32)
MATRIX_ROW, MATRIX_COL = _LANE >> 2, 2 * (_LANE & 3)


@register("ldmatrix")
def decode_ldmatrix(ins, env):
    nmat, trans, space, dplans, aplan = decode_matrix(ins, env, "ldmatrix", dst_plan)
    row, col, line = MATRIX_ROW, MATRIX_COL, ins.line

    def bind(ctx):
        writers = [p(ctx) for p in dplans]
        address = aplan(ctx)

        def run(sel):
            idx, nw, addr, who, rows, addr_of = matrix_rows(ctx, sel, address, nmat, space,
                                                            "ldmatrix", "ldmatrix row load")
            if ctx.traffic is not None:
                ctx.traffic.ldmatrix(line, addr)
            ctx.smem.check_readable(rows, 16, who, addr_of)
            if ctx.race is not None:     # converged on .sync.aligned: the warp is synchronised
                ctx.race.warp_synced(sel)
                ctx.race.read(rows, 16, who, line, addr_of)
            M = ctx.smem.rows.gather(rows, 16, 2, 8).reshape(nw, nmat, 8, 8)  # [w, m, row, col]
            for i, w in enumerate(writers):
                mat = M[:, i]
                if trans:
                    lo, hi = mat[:, col, row], mat[:, col + 1, row]
                else:
                    lo, hi = mat[:, row, col], mat[:, row, col + 1]
                w(sel, (lo.astype(np.uint32) | (hi.astype(np.uint32) << np.uint32(16)))
                  .reshape(-1))
        return run
    return Op(NORMAL, ins, bind)
