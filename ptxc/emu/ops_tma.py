"""cp.async.bulk.tensor (TMA) global -> shared, tile mode, with mbarrier::complete_tx:

    cp.async.bulk.tensor.Nd.shared::cluster.global{.tile}.mbarrier::complete_tx::bytes
        [dst], [map, {c0, ..., cN-1}], [mbar];

The tensor map is the emulator's TensorMap (tensormap.py) in a kernel parameter, named directly
(`[map_param, {...}]`) or through a 64-bit register holding its generic address (`mov.u64 %rd,
map_param; cvta.param.u64 %rd, %rd;` as nvcc emits for a __grid_constant__ CUtensorMap), or
in global memory. The box at coordinates c (s32,
innermost first; elements outside the tensor read as zero) lands in shared memory in row-major
box order, innermost dimension contiguous, each W-byte row swizzled like a wgmma operand (the
16-byte chunk index XOR address bits [7, 7+b)); the destination must be 128-byte aligned. The
full box size counts towards the mbarrier's transaction count, as on hardware. The data lands
like any bulk copy (ops_mbarrier.py): when a wait first observes the completed phase.
"""

from __future__ import annotations

import numpy as np

from ptxc.emu.decode import NORMAL, Mods, Op, expect_operands
from ptxc.emu.memory import PARAM_BASE
from ptxc.emu.operands import TYPES, DecodeError, Fault, src_plan
from ptxc.emu.ops_mbarrier import _smem_flat, issue_copy
from ptxc.emu.ops_mem import address_plan
from ptxc.emu.ptx_ast import Reg, Sym, TensorAddr
from ptxc.emu.tensormap import NBYTES, decode_map
from ptxc.emu.wgmma_layout import swizzle_address

S32, U64 = TYPES["s32"], TYPES["u64"]


def decode_cp_bulk_tensor(ins, env):
    m = Mods(ins)
    for need in ("async", "bulk", "tensor", "global", "mbarrier::complete_tx::bytes"):
        m.need(need)
    m.need("shared::cluster", "shared::cta")
    rank = m.need("1d", "2d", "3d", "4d", "5d")
    m.flag("tile")
    m.done()
    expect_operands(ins, 3)
    dst, src, bar = ins.operands
    rank = int(rank[0])
    if not isinstance(src, TensorAddr) or len(src.coords) != rank:
        raise DecodeError(f"the source is [tensor-map, {{{rank} coordinates}}]")
    map_reader = map_plan(env, src.map)
    cplans = [src_plan(env, c, S32) for c in src.coords]
    dplan, bplan = address_plan(env, dst, "shared"), address_plan(env, bar, "shared")
    line = ins.line

    def bind(ctx):
        read_map, coords = map_reader(ctx), [p(ctx) for p in cplans]
        daddr, baddr = dplan(ctx), bplan(ctx)

        def run(sel):
            idx = ctx.all_index if isinstance(sel, slice) else sel
            n = idx.size
            da = np.broadcast_to(np.asarray(daddr(sel), np.int64), (n,))
            ba = np.broadcast_to(np.asarray(baddr(sel), np.int64), (n,))
            cs = [np.broadcast_to(np.asarray(c(sel), np.int64), (n,)) for c in coords]
            bflat = _smem_flat(ctx, idx, ba, "mbarrier (cp.async.bulk.tensor)")
            for k in range(n):
                t = int(idx[k])
                tmap = tensor_map_of(read_map(sel, k, t), rank, t)
                cols, data = _box(ctx, t, tmap, [int(c[k]) for c in cs], int(da[k]), line)
                issue_copy(ctx, t, cols, data, int(da[k]), int(bflat[k]), int(ba[k]), line,
                           tmap[3])
        return run
    return Op(NORMAL, ins, bind)


def tensor_map_of(raw: bytes, rank: int, thread: int):
    """The decoded map (tensormap.decode_map) of a rank-`rank` TMA copy, or a Fault."""
    tmap = decode_map(raw)
    if tmap is None:
        raise Fault("the tensor-map operand does not hold an emulator TensorMap "
                    "(pass ptxc.emu.TensorMap for the 128-byte map parameter)", thread)
    if tmap[0] != rank:
        raise Fault(f"a {rank}d tensor copy with a rank-{tmap[0]} tensor map", thread)
    return tmap


def map_plan(env, addr):
    """bind(ctx) -> read(sel, k, thread) giving the 128 map bytes."""
    if isinstance(addr.base, Sym) and addr.base.name in env.params:
        off = env.params[addr.base.name][0] + addr.offset
        return lambda ctx: (lambda sel, k, t: bytes(ctx.param_bytes[off:off + NBYTES]))
    if not isinstance(addr.base, Reg):
        raise DecodeError("the tensor map must be a kernel parameter or a 64-bit register")
    reader = src_plan(env, addr.base, U64)

    def bind(ctx):
        r = reader(ctx)

        def read(sel, k, t):
            a = np.atleast_1d(np.asarray(r(sel), np.uint64))
            a = a[k if a.size > 1 else 0] + np.uint64(addr.offset)
            rel = int(a) - PARAM_BASE
            if 0 <= rel <= len(ctx.param_bytes) - NBYTES:      # cvta.param of a parameter
                return bytes(ctx.param_bytes[rel:rel + NBYTES])
            off = int(ctx.gmem.offsets(np.array([a]), NBYTES, 64, "tensor-map read",
                                       np.array([t]))[0])
            return ctx.gmem.heap[off:off + NBYTES].tobytes()
        return read
    return bind


def box_elements(tmap, coords):
    """(inside, byte offsets from the map's address) of each element of the box at `coords`,
    in row-major box order; an element outside the tensor gets a clamped offset and
    inside False."""
    rank, _, _, _, dims, box, strides = tmap
    grid = np.indices(box[::-1]).reshape(rank, -1)[::-1]        # per dim (innermost first)
    inside = np.ones(grid.shape[1], np.bool_)
    offsets = np.zeros(grid.shape[1], np.int64)
    for d in range(rank):
        pos = coords[d] + grid[d]
        inside &= (pos >= 0) & (pos < dims[d])
        offsets += np.clip(pos, 0, dims[d] - 1) * strides[d]
    return inside, offsets


def _box(ctx, thread, tmap, coords, dst_addr, line):
    """(flat shared byte offsets, bytes) of one box, zero-filled outside the tensor. The
    elements inside the tensor are global reads like any other: each must lie in an
    allocation (a map whose dims overstate its buffer faults instead of reading a neighbour)
    and they count as the line's traffic."""
    _, esize, gaddr, swizzle, _, box, _ = tmap
    if dst_addr % 128:
        raise Fault(f"cp.async.bulk.tensor destination 0x{dst_addr:x} is not 128-byte "
                    f"aligned", thread, dst_addr)
    nbytes = int(np.prod(box)) * esize
    dflat = int(ctx.smem.offsets(ctx.cta_of[[thread]], np.array([dst_addr]), nbytes, 16,
                                 "cp.async.bulk.tensor write", np.array([thread]))[0])
    inside, src = box_elements(tmap, coords)
    base = int(ctx.gmem.offsets(np.array([gaddr], np.uint64), 1, 1, "tensor map base",
                                np.array([thread]))[0])
    read = np.uint64(gaddr) + src[inside].astype(np.uint64)
    if read.size:
        ctx.gmem.offsets(read, esize, 1, "cp.async.bulk.tensor read", np.full(read.size, thread))
        if ctx.traffic is not None:
            ctx.traffic.bulk_read(line, "cp.async.bulk.tensor", read, esize)
    lanes = np.arange(esize)
    data = ctx.gmem.heap[base + src[:, None] + lanes]
    data = np.where(inside[:, None], data, 0).astype(np.uint8).reshape(-1)
    rel = np.arange(nbytes, dtype=np.int64)
    addr = swizzle_address(dst_addr + rel, swizzle) if swizzle else dst_addr + rel
    return dflat + (addr - dst_addr), data
