"""cp.async.bulk.tensor (TMA) shared -> global, tile mode, completed by bulk groups:

    cp.async.bulk.tensor.Nd.global.shared::cta{.tile}.bulk_group [map, {c0, ..., cN-1}], [src];
    cp.async.bulk.commit_group;
    cp.async.bulk.wait_group{.read} N;

The box at coordinates c (innermost first) is read from shared memory in the layout a TMA load
of the same map writes (row-major box order, each row swizzled like the map says; the source
128-byte aligned) and written to the tensor; elements outside it are not written (the
hardware clips the box). The copy reads shared memory through the async proxy: every byte the
threads wrote (st.shared, stmatrix) must be ordered before it by a fence.proxy.async
(racecheck's async_read, as for a wgmma operand). It reads until the issuing thread's
`wait_group.read` retires its group: a write to those bytes before then is an error (by any
thread: the race tracker sees the issuing thread read them again at the retirement, so another
thread's write must be ordered after it), and so is a CTA whose threads all exited with a
store still reading. The global bytes are written when the copy is issued (the emulator has
no reader of them within the launch that could tell; `wait_group` without `.read` waits for
the writes as well, and retires the same way here).
"""

from __future__ import annotations

import numpy as np

from ptxc.emu.decode import NORMAL, Mods, Op, expect_operands
from ptxc.emu.operands import TYPES, DecodeError, Fault, src_plan
from ptxc.emu.ops_mem import address_plan
from ptxc.emu.ops_tma import box_elements, map_plan, tensor_map_of
from ptxc.emu.ptx_ast import Imm, TensorAddr
from ptxc.emu.wgmma_layout import swizzle_address

S32 = TYPES["s32"]
STORE = "a TMA store (cp.async.bulk.tensor to global)"   # the async-proxy reader, for messages


class BulkStores:
    """Per batch: each thread's TMA stores not yet committed (shared chunk rows), the committed
    groups still reading ((thread, group id, chunk rows, line)), and each thread's commit
    count; smem.store_readers counts the in-flight readers of every 16-byte chunk."""

    def __init__(self, ctx):
        self.open: dict[int, list] = {}
        self.groups: list = []
        self.commits = np.zeros(ctx.n, np.int64)
        if ctx.smem.store_readers is None:
            ctx.smem.store_readers = np.zeros(ctx.smem.data.size // 16 + 1, np.int32)

    def issue(self, ctx, thread: int, chunks, line: int) -> None:
        np.add.at(ctx.smem.store_readers, chunks, 1)
        ctx.smem.store_live += 1
        self.open.setdefault(thread, []).append((chunks, line))

    def commit(self, idx) -> None:
        for t in idx.tolist():
            for chunks, line in self.open.pop(t, []):
                self.groups.append((t, int(self.commits[t]), chunks, line))
        self.commits[idx] += 1

    def wait(self, ctx, idx, keep: int) -> None:
        """Retire the groups of threads `idx` but their `keep` newest."""
        mine = set(idx.tolist())
        left = []
        for t, gid, chunks, line in self.groups:
            if t in mine and gid < self.commits[t] - keep:
                np.subtract.at(ctx.smem.store_readers, chunks, 1)
                ctx.smem.store_live -= 1
                if ctx.race is not None:      # read again at completion (see the docstring)
                    stride = ctx.smem.stride
                    ctx.race.read(chunks, 16, np.full(chunks.size, t), line,
                                  lambda k, c=chunks: int(c[k]) * 16 % stride)
            else:
                left.append((t, gid, chunks, line))
        self.groups = left

    def check_drained(self) -> None:
        """At the end of the launch: no store may still read the shared memory of a CTA that
        has gone (its threads exited without the wait_group.read)."""
        pending = [(t, line) for t, _, _, line in self.groups] + \
            [(t, line) for t, items in self.open.items() for _, line in items]
        if pending:
            t, line = pending[0]
            raise Fault(f"{STORE} issued at line {line} still reads shared memory when its CTA "
                        f"exits: no cp.async.bulk.commit_group and wait_group.read retired it",
                        t)


def stores(ctx) -> BulkStores:
    if ctx.bulk_stores is None:
        ctx.bulk_stores = BulkStores(ctx)
    return ctx.bulk_stores


def decode_cp_bulk_tensor_store(ins, env):
    m = Mods(ins)
    for need in ("async", "bulk", "tensor", "global", "shared::cta", "bulk_group"):
        m.need(need)
    rank = int(m.need("1d", "2d", "3d", "4d", "5d")[0])
    m.flag("tile")
    m.done()
    expect_operands(ins, 2)
    dst, src = ins.operands
    if not isinstance(dst, TensorAddr) or len(dst.coords) != rank:
        raise DecodeError(f"the destination is [tensor-map, {{{rank} coordinates}}]")
    map_reader = map_plan(env, dst.map)
    cplans = [src_plan(env, c, S32) for c in dst.coords]
    splan = address_plan(env, src, "shared")
    line = ins.line

    def bind(ctx):
        read_map, coords, saddr = map_reader(ctx), [p(ctx) for p in cplans], splan(ctx)

        def run(sel):
            idx = ctx.all_index if isinstance(sel, slice) else sel
            n = idx.size
            sa = np.broadcast_to(np.asarray(saddr(sel), np.int64), (n,))
            cs = [np.broadcast_to(np.asarray(c(sel), np.int64), (n,)) for c in coords]
            for k in range(n):
                t = int(idx[k])
                _store_box(ctx, t, tensor_map_of(read_map(sel, k, t), rank, t),
                           [int(c[k]) for c in cs], int(sa[k]), line)
        return run
    return Op(NORMAL, ins, bind)


def _store_box(ctx, thread, tmap, coords, src_addr, line) -> None:
    _, esize, gaddr, swizzle, _, box, _ = tmap
    if src_addr % 128:
        raise Fault(f"cp.async.bulk.tensor source 0x{src_addr:x} is not 128-byte aligned",
                    thread, src_addr)
    nbytes = int(np.prod(box)) * esize
    who = np.array([thread])
    sflat = int(ctx.smem.offsets(ctx.cta_of[who], np.array([src_addr]), nbytes, 16,
                                 "cp.async.bulk.tensor read", who)[0])
    rel = np.arange(nbytes, dtype=np.int64)
    addr = swizzle_address(src_addr + rel, swizzle) if swizzle else src_addr + rel
    flat = sflat + (addr - src_addr)                     # byte k of the box, in shared memory
    chunks = np.unique(flat >> 4)
    items = np.full(chunks.size, thread)
    stride = ctx.smem.stride

    def where(k: int) -> int:
        return int(chunks[k]) * 16 % stride
    ctx.smem.check_readable(chunks, 16, items, where)
    if ctx.race is not None:
        ctx.race.async_read(chunks, 16, items, line, STORE, where)
        ctx.race.read(chunks, 16, items, line, where)
    data = ctx.smem.data[flat].reshape(-1, esize)
    inside, dst = box_elements(tmap, coords)
    write = np.uint64(gaddr) + dst[inside].astype(np.uint64)
    if write.size:
        off = ctx.gmem.offsets(write, esize, 1, "cp.async.bulk.tensor write",
                               np.full(write.size, thread))
        ctx.gmem.heap[off[:, None] + np.arange(esize)] = data[inside]
    stores(ctx).issue(ctx, thread, chunks, line)


def decode_bulk_group(ins, env):
    """cp.async.bulk.commit_group and cp.async.bulk.wait_group{.read} N (the bulk async-groups
    of the TMA stores; a plain wait also waits for the global writes, which land at issue
    here)."""
    m = Mods(ins)
    m.need("async")
    m.need("bulk")
    if m.flag("commit_group"):
        m.done()
        expect_operands(ins, 0)
        return Op(NORMAL, ins, lambda ctx: (lambda sel: stores(ctx).commit(_idx(ctx, sel))))
    m.need("wait_group")
    m.flag("read")
    m.done()
    expect_operands(ins, 1)
    n = ins.operands[0]
    if not isinstance(n, Imm) or n.kind != "int" or n.value < 0:
        raise DecodeError("wait_group needs a non-negative integer constant")
    return Op(NORMAL, ins,
              lambda ctx: (lambda sel: stores(ctx).wait(ctx, _idx(ctx, sel), n.value)))


def _idx(ctx, sel):
    return ctx.all_index if isinstance(sel, slice) else np.asarray(sel)
