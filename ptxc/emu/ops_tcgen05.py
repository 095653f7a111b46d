"""Blackwell tcgen05 (sm_100a / sm_103a): tensor-memory allocation, tcgen05.mma (kind::f16 and
kind::tf32, cta_group::1), tcgen05.commit to an mbarrier, tcgen05.ld / tcgen05.st and their
waits, tcgen05.fence.

Model (PTX ISA, "TensorCore 5th Generation Family Instructions"; layouts in tcgen05_layout.py,
the tensor memory and what it checks in tmem.py):
* tcgen05.alloc / dealloc / relinquish_alloc_permit are executed by whole warps; alloc writes
  the allocation's address (lane 0, first column) to shared memory.
* tcgen05.mma is issued by each thread that executes it (kernels elect one): D[M x N] (+)=
  A[M x K] . B[K x N] with K = 16 (f16/bf16) or 8 (tf32), exact products summed in float64 with
  D, rounded once to f32 (as wgmma). A comes from a shared-memory descriptor or from tensor
  memory, B from a descriptor, D is tensor memory; `enable_input_d` false overwrites D. The
  result is written at issue and stays in flight (tmem.py) until a wait observes the mbarrier
  phase that a later tcgen05.commit of the same thread arrives on; until then the shared
  memory it read may not be written either.
* tcgen05.commit...mbarrier::arrive::one makes the mbarrier track the thread's MMAs since its
  previous commit and arrives once on it -- as the tensor cores (syncorder's pseudo warp), so
  that a read of D is ordered after the completion only for warps that waited on the phase or
  follow such a wait through barriers (tmem.py's ordering rules).
* tcgen05.ld / st are warp-collective (.sync.aligned): a warp reaches the 32 lanes of its
  sub-partition. An st's cells may not be read (by ld or mma) before the warp's
  tcgen05.wait::st. An ld's registers are *not* held until tcgen05.wait::ld: Triton 3.9's
  sm_100a attention (validated on B200s) packs them before its wait, so ptxas evidently
  orders the uses; requiring the wait would reject a correct peer.
* tcgen05.fence::before_thread_sync / after_thread_sync order tcgen05 operations around a
  thread synchronisation; the orders they give are the ones the rules above already require,
  so they are accepted without further effect.
"""

from __future__ import annotations

import functools

import numpy as np

from ptxc.emu.decode import NORMAL, Mods, Op, expect_operands, register
from ptxc.emu.operands import TYPES, DecodeError, Fault, dst_plan, src_plan
from ptxc.emu.ops_mbarrier import _smem_flat
from ptxc.emu.ops_mem import address_plan
from ptxc.emu.ops_warp import _halves_to_f64, _tf32_to_f64, whole_warps
from ptxc.emu.ops_wgmma import read_operand
from ptxc.emu.ptx_ast import Addr, Imm, Reg, Vec
from ptxc.emu.tcgen05_layout import (
    LANES, LD_SHAPES, InstrDescriptor, SmemDescriptor, fragment_cells, row_lanes)
from ptxc.emu.tmem import PENDING, MmaRecord, TensorMemory, flat_cells

U32, U64, B32, PRED = TYPES["u32"], TYPES["u64"], TYPES["b32"], TYPES["pred"]


def tensor_memory(ctx) -> TensorMemory:
    if ctx.tmem is None:
        ctx.tmem = TensorMemory(ctx)
    return ctx.tmem


def _values(reader, sel, n, dtype):
    return np.broadcast_to(np.asarray(reader(sel), dtype), (n,))


def _taddr_plan(env, operand):
    """A tensor-memory address operand `[%r + off]` (or a register) -> bind(ctx) -> reader."""
    if isinstance(operand, Addr) and isinstance(operand.base, Reg):
        base, off = src_plan(env, operand.base, U32), operand.offset
    elif isinstance(operand, Reg):
        base, off = src_plan(env, operand, U32), 0
    else:
        raise DecodeError("a tensor-memory address is a register, optionally + offset")

    def bind(ctx):
        r = base(ctx)
        return lambda sel: (np.asarray(r(sel), np.int64) + off) & 0xFFFF_FFFF
    return bind


def _warp_uniform(ctx, values, idx, what):
    w = values.reshape(-1, 32)
    bad = (w != w[:, :1]).any(axis=1)
    if bad.any():
        t = int(idx[32 * int(np.flatnonzero(bad)[0])])
        raise Fault(f"{what} differs between the lanes of warp {int(ctx.lin[t]) >> 5}", t)
    return w[:, 0]


def _sync_aligned(m):
    if not (m.flag("sync") and m.flag("aligned")):
        raise DecodeError("needs .sync.aligned")


def _cta_group_one(m):
    if m.need("cta_group::1", "cta_group::2") != "cta_group::1":
        raise DecodeError("only .cta_group::1 is supported (no CTA pairs)")


@register("tcgen05")
def decode_tcgen05(ins, env):
    m = Mods(ins)
    kind = m.need("alloc", "dealloc", "relinquish_alloc_permit", "mma", "commit", "ld", "st",
                  "wait::ld", "wait::st", "fence::before_thread_sync",
                  "fence::after_thread_sync")
    return _DECODERS[kind.split("::")[0] if kind.startswith("wait") else kind](ins, env, m,
                                                                                  kind)


# ----------------------------------------------------------------------------- allocation

def _decode_alloc(ins, env, m, kind):
    _cta_group_one(m)
    _sync_aligned(m)
    if kind == "alloc":
        m.need("shared::cta")
    if kind != "relinquish_alloc_permit" and m.one_type().name != "b32":
        raise DecodeError("needs .b32")
    m.done()
    expect_operands(ins, {"alloc": 2, "dealloc": 2, "relinquish_alloc_permit": 0}[kind])
    what = f"tcgen05.{kind}"
    ops = ins.operands
    aplan = address_plan(env, ops[0], "shared") if kind == "alloc" else None
    tplan = _taddr_plan(env, ops[0]) if kind == "dealloc" else None
    nplan = src_plan(env, ops[1], U32) if ops else None
    line = ins.line

    def bind(ctx):
        tm = tensor_memory(ctx)
        where = aplan(ctx) if aplan else tplan(ctx) if tplan else None
        count = nplan(ctx) if nplan else None

        def run(sel):
            idx = whole_warps(ctx, sel, what)
            leads = idx[::32]
            ctas = ctx.cta_of[leads]
            if kind == "relinquish_alloc_permit":
                tm.relinquished[ctas] = True
                return
            n = idx.size
            cols = _warp_uniform(ctx, _values(count, sel, n, np.int64), idx, "the column count")
            addr = _warp_uniform(ctx, _values(where, sel, n, np.int64), idx,
                                 "the destination address" if kind == "alloc" else
                                 "the tensor-memory address")
            for w, t in enumerate(leads.tolist()):
                cta = int(ctas[w])
                if kind == "dealloc":
                    tm.dealloc(cta, int(addr[w]), int(cols[w]), t)
                    continue
                col = tm.alloc(cta, int(cols[w]), t)
                ctx.smem.store(ctas[w:w + 1], addr[w:w + 1], 4,
                               np.array([[col]], np.uint32), np.array([t]), line)
        return run
    return Op(NORMAL, ins, bind)


# ----------------------------------------------------------------------------- mma

@functools.lru_cache(maxsize=256)
def _idesc(value: int, kind: str) -> InstrDescriptor:
    return InstrDescriptor(value, kind)


@functools.lru_cache(maxsize=1024)
def _sdesc(value: int) -> SmemDescriptor:
    return SmemDescriptor(value)


def _decode_mma(ins, env, m, kind):
    _cta_group_one(m)
    mma_kind = m.need("kind::f16", "kind::tf32").split("::")[1]
    m.done()
    ops = ins.operands
    if len(ops) != 5:
        raise DecodeError("supported form: [d], a, b, idesc, enable_input_d (no disable-"
                          "output-lane mask, no scale_input_d)")
    dplan = _taddr_plan(env, ops[0])
    a_tmem = isinstance(ops[1], Addr)
    aplan = _taddr_plan(env, ops[1]) if a_tmem else src_plan(env, ops[1], U64)
    bplan, iplan = src_plan(env, ops[2], U64), src_plan(env, ops[3], U32)
    en = ops[4]
    if isinstance(en, Imm):
        enplan = (lambda v: (lambda ctx: (lambda sel: v)))(bool(en.value))
    else:
        enplan = src_plan(env, en, PRED)
    line = ins.line
    k = 8 if mma_kind == "tf32" else 16

    def bind(ctx):
        tm = tensor_memory(ctx)
        rd, ra, rb, ri, ren = dplan(ctx), aplan(ctx), bplan(ctx), iplan(ctx), enplan(ctx)

        def run(sel):
            idx = ctx.all_index if isinstance(sel, slice) else sel
            n = idx.size
            vals = [_values(r, sel, n, dt) for r, dt in
                    ((rd, np.int64), (ra, np.int64 if a_tmem else np.uint64),
                     (rb, np.uint64), (ri, np.int64), (ren, np.bool_))]
            for j, t in enumerate(idx.tolist()):
                _mma_one(ctx, tm, t, *(int(v[j]) for v in vals[:4]), bool(vals[4][j]),
                         mma_kind, a_tmem, k, line)
        return run
    return Op(NORMAL, ins, bind)


def _mma_one(ctx, tm, t, d_addr, a_val, b_val, i_val, enable_d, mma_kind, a_tmem, k, line):
    cta = int(ctx.cta_of[t])
    idesc = _idesc(i_val, mma_kind)
    if idesc.problem:
        raise Fault(f"tcgen05.mma instruction descriptor 0x{i_val:08x}: unsupported "
                    f"{idesc.problem}", t)
    M, N = idesc.m, idesc.n
    tf32 = mma_kind == "tf32"
    bf16 = idesc.a_type == "bf16"
    if tf32 and (idesc.b_mn_major or (idesc.a_mn_major and not a_tmem)):
        raise Fault("tcgen05.mma kind::tf32 with an MN-major operand: unsupported", t)
    thr = np.array([[t]])
    lanes = row_lanes(M)
    if d_addr >> 16:
        raise Fault(f"tcgen05.mma D address 0x{d_addr:08x} names lane {d_addr >> 16}: D starts "
                    f"at lane 0", t)
    d_cols = (d_addr & 0xFFFF) + np.arange(N)
    # the same cells as basic slices where they are contiguous (the ordering checks' gathers)
    lane_idx = slice(0, LANES) if M == LANES else lanes
    d_cells = (lane_idx, slice(int(d_cols[0]), int(d_cols[0]) + N))
    tm.cells(cta, lanes, d_cols, t, "tcgen05.mma D")
    rows = []

    def smem_operand(value, nrows, mn_major, which):
        dsc = _sdesc(value)
        if dsc.problem:
            raise Fault(f"tcgen05.mma {which} descriptor 0x{value:016x}: unsupported "
                        f"{dsc.problem}", t)
        raw, chunk_rows = read_operand(ctx, thr, [dsc], nrows, mn_major, line, which)
        rows.append(chunk_rows.reshape(-1))
        words = raw[0].view(np.uint32)                      # (nrows, 8)
        return _tf32_to_f64(words) if tf32 else _halves_to_f64(words, bf16)

    B = smem_operand(b_val, N, idesc.b_mn_major, "B")
    me = int(ctx.lin[t]) >> 5
    a_cells = None
    if a_tmem:
        if a_val >> 16:
            raise Fault(f"tcgen05.mma A address 0x{a_val:08x} names lane {a_val >> 16}: A "
                        f"starts at lane 0", t)
        a_cols = (a_val & 0xFFFF) + np.arange(8)
        a_cells = (lane_idx, slice(int(a_cols[0]), int(a_cols[0]) + 8))
        tm.cells(cta, lanes, a_cols, t, "tcgen05.mma A")
        tm.check_read(cta, lanes, a_cols, t, "tcgen05.mma A", in_flight_ok=True)
        tm.check_ordered(tm.puts, cta, a_cells, me, t, "tcgen05.mma A reads", own_pending=True)
        words = tm.data[cta][np.ix_(lanes, a_cols)]
        A = _tf32_to_f64(words) if tf32 else _halves_to_f64(words, bf16)
    else:
        A = smem_operand(a_val, M, idesc.a_mn_major, "A")
    assert A.shape == (M, k) and B.shape == (N, k)
    sign = (-1.0 if idesc.neg_a else 1.0) * (-1.0 if idesc.neg_b else 1.0)
    D = (A @ B.T) * sign
    block = np.ix_(lanes, d_cols)
    if enable_d:
        # an earlier MMA of this thread may still be writing D: MMAs of one issuer run in order
        tm.check_read(cta, lanes, d_cols, t, "tcgen05.mma (enable_input_d) D",
                      in_flight_ok=True)
        tm.check_ordered(tm.puts, cta, d_cells, me, t,
                         "tcgen05.mma (enable_input_d) D reads", own_pending=True)
        D = D + tm.data[cta][block].view(np.float32).astype(np.float64)
    else:
        tm.check_stored(cta, lanes, d_cols, t, "tcgen05.mma D overwrites")
        tm.check_ordered(tm.puts, cta, d_cells, me, t,
                         "tcgen05.mma D overwrites", own_pending=True)
    tm.check_ordered(tm.loads, cta, d_cells, me, t,
                     "tcgen05.mma D overwrites", own_pending=True)
    tm.check_ordered(tm.mma_reads, cta, d_cells, me, t, "tcgen05.mma D overwrites")
    tm.data[cta][block] = D.astype(np.float32).view(np.uint32)
    tm.written[cta][block] = True
    tm.puts.forget(cta, d_cells)
    tm.mma_reads.forget(cta, d_cells)
    for log, cells in ((tm.mmas, d_cells), (tm.mma_reads, a_cells)):
        if cells is not None:       # stamped by the issuing thread's next commit
            log.by[cta][cells], log.at[cta][cells], log.line[cta][cells] = me + 1, PENDING, line
    smem_rows = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    tm.issue(MmaRecord(cta, lanes, d_cols, smem_rows, t, line, d_cells, a_cells))


def _decode_commit(ins, env, m, kind):
    _cta_group_one(m)
    m.need("mbarrier::arrive::one")
    if m.flag("multicast::cluster"):
        raise DecodeError("multicast commits are not supported")
    m.flag("shared::cluster", "shared::cta")
    if m.one_type().name != "b64":
        raise DecodeError("needs .b64")
    m.done()
    expect_operands(ins, 1)
    aplan = address_plan(env, ins.operands[0], "shared")

    def bind(ctx):
        tm, address = tensor_memory(ctx), aplan(ctx)

        def run(sel):
            idx = ctx.all_index if isinstance(sel, slice) else sel
            addr = np.broadcast_to(np.asarray(address(sel), np.int64), idx.shape)
            flat = _smem_flat(ctx, idx, addr, "mbarrier (tcgen05.commit)")
            for j, t in enumerate(idx.tolist()):
                b = ctx.mbar.get(int(flat[j]), t, int(addr[j]))
                records = tm.commit(t)
                if records:
                    b.tracked.append(functools.partial(tm.retire, records))
                part = ctx.mbar.arrive(ctx, b, np.array([t]), 1, t, int(addr[j]),
                                       cumulative=False)
                tm.committed(records, int(ctx.lin[t]) >> 5, part[1])
        return run
    return Op(NORMAL, ins, bind)


# ----------------------------------------------------------------------------- ld / st

def _decode_ld_st(ins, env, m, kind):
    _sync_aligned(m)
    shape = m.need(*LD_SHAPES)
    rep = [x for x in m.left if x.startswith("x") and x[1:].isdigit()]
    if len(rep) != 1 or int(rep[0][1:]) not in (1, 2, 4, 8, 16, 32, 64, 128):
        raise DecodeError("needs a repetition .x1, .x2, ..., .x128")
    m.left.remove(rep[0])
    reps = int(rep[0][1:])
    if m.flag("pack::16b", "unpack::16b"):
        raise DecodeError("16-bit packing (.pack::16b / .unpack::16b) is not supported")
    if m.one_type().name != "b32":
        raise DecodeError("needs .b32")
    m.done()
    ops = ins.operands
    half = shape == "16x32bx2"
    expect_operands(ins, 3 if half else 2)
    regs_op, addr_op = (ops[0], ops[1]) if kind == "ld" else (ops[-1], ops[0])
    half_offset = 0
    if half:
        imm = ops[2] if kind == "ld" else ops[1]
        if not isinstance(imm, Imm) or imm.kind != "int" or imm.value < 0:
            raise DecodeError("16x32bx2 needs a non-negative immediate half offset")
        half_offset = imm.value
    lane_off, col_off = fragment_cells(shape, reps, half_offset)
    nregs = lane_off.shape[1]
    if not isinstance(regs_op, Vec) or len(regs_op.items) != nregs:
        raise DecodeError(f".{shape}.x{reps} moves {{{nregs}}} .b32 registers per thread")
    tplan = _taddr_plan(env, addr_op)
    span_lanes = LD_SHAPES[shape][1]
    rplans = [(dst_plan if kind == "ld" else src_plan)(env, x, B32) for x in regs_op.items]
    what, line = f"tcgen05.{kind}", ins.line

    def bind(ctx):
        tm, where = tensor_memory(ctx), tplan(ctx)
        regs = [p(ctx) for p in rplans]

        def run(sel):
            idx = whole_warps(ctx, sel, what)
            taddr = _warp_uniform(ctx, _values(where, sel, idx.size, np.int64), idx,
                                  "the tensor-memory address")
            out = np.zeros((idx.size, nregs), np.uint32)
            if kind == "st":
                for i, r in enumerate(regs):
                    out[:, i] = _values(r, sel, idx.size, np.uint32)
            for w, t in enumerate(idx[::32].tolist()):
                cta, warp = int(ctx.cta_of[t]), int(ctx.lin[t]) >> 5
                lane0, col0 = int(taddr[w]) >> 16, int(taddr[w]) & 0xFFFF
                part = 32 * (warp % 4)
                if not part <= lane0 <= part + 32 - span_lanes or \
                        (lane0 - part) % span_lanes:
                    raise Fault(f"{what}.{shape} at lane {lane0}: warp {warp} reaches lanes "
                                f"{part}-{part + 31} (its sub-partition, warp id % 4)", t)
                lanes, cols = lane0 + lane_off, col0 + col_off
                ul, uc = np.unique(lanes), np.unique(cols)
                tm.cells(cta, ul, uc, t, what)
                rows = slice(32 * w, 32 * w + 32)
                gwarp, warp = int(t) >> 5, int(ctx.lin[t]) >> 5
                flat = flat_cells(cta, lanes, cols)
                if kind == "ld":
                    _check_cells(tm, cta, lanes, cols, t, what)
                    tm.check_ordered(tm.puts, cta, flat, warp, t, f"{what} reads")
                    tm.check_ordered(tm.mmas, cta, flat, warp, t, f"{what} reads",
                                     own_ordered=False)
                    out[rows] = tm.data[cta, lanes, cols]
                    tm.loads.record(flat, warp, line, gwarp)
                else:
                    tm.check_write(cta, ul, uc, t, what)
                    for log in (tm.loads, tm.mmas, tm.mma_reads):
                        tm.check_ordered(log, cta, flat, warp, t, f"{what} overwrites",
                                         own_ordered=log is tm.loads)
                    tm.mmas.forget(cta, flat)
                    tm.mma_reads.forget(cta, flat)
                    tm.puts.record(flat, warp, line, gwarp)
                    tm.data[cta, lanes, cols] = out[rows]
                    tm.written[cta, lanes, cols] = True
                    tm.stored[cta, lanes, cols] += 1
                    tm.stores.setdefault(int(t) >> 5, []).append((cta, lanes, cols))
            if kind == "ld":
                for i, write in enumerate(regs):
                    write(sel, out[:, i])
        return run
    return Op(NORMAL, ins, bind)


def _check_cells(tm, cta, lanes, cols, t, what):
    """check_read over the exact (scattered) cells of a fragment: its message for the first
    cell that fails."""
    bad = (tm.in_flight[cta, lanes, cols] > 0) | (tm.stored[cta, lanes, cols] > 0) | \
        ~tm.written[cta, lanes, cols]
    if bad.any():
        i, j = np.argwhere(bad)[0]
        tm.check_read(cta, lanes[i, j:j + 1], cols[i, j:j + 1], t, what)


def _decode_wait(ins, env, m, kind):
    _sync_aligned(m)
    m.done()
    expect_operands(ins, 0)
    what = f"tcgen05.{kind}"

    def bind(ctx):
        tm = tensor_memory(ctx)

        def run(sel):
            idx = whole_warps(ctx, sel, what)
            stamp = ctx.race.serial if ctx.race is not None else 0
            log = tm.loads if kind == "wait::ld" else tm.puts
            for t in idx[::32].tolist():
                log.complete(int(t) >> 5, int(ctx.lin[t]) >> 5, stamp)
                if kind == "wait::ld":
                    continue
                for cta, lanes, cols in tm.stores.pop(int(t) >> 5, []):
                    tm.stored[cta, lanes, cols] -= 1
        return run
    return Op(NORMAL, ins, bind)


def _decode_fence(ins, env, m, kind):
    m.done()
    expect_operands(ins, 0)
    return Op(NORMAL, ins, lambda ctx: (lambda sel: None))


_DECODERS = {"alloc": _decode_alloc, "dealloc": _decode_alloc,
             "relinquish_alloc_permit": _decode_alloc, "mma": _decode_mma,
             "commit": _decode_commit, "ld": _decode_ld_st, "st": _decode_ld_st,
             "wait": _decode_wait, "fence::before_thread_sync": _decode_fence,
             "fence::after_thread_sync": _decode_fence}
