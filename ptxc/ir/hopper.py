"""sm_90a instructions of `KernelBuilder`: warpgroup MMA (wgmma), the async-proxy fence and
mbarriers, type-checked like the rest of the builder (PTX ISA: "Asynchronous Warpgroup Level
Matrix Multiply-Accumulate", "mbarrier", "Parallel Synchronization: fence").

    wgmma_fence(), wgmma_commit(), wgmma_wait(n)
    wgmma(acc, a, b_desc, in_type, scale_d, trans_a, trans_b)   D (+)= A·B on m64nNk16
    matrix_descriptor(addr, lbo, sbo, swizzle)                   a 64-bit shared-memory descriptor
    fence_proxy_async()                                          generic -> async proxy (shared)
    mbarrier_init / mbarrier_arrive / mbarrier_arrive_expect_tx / mbarrier_try_wait_parity
    setmaxnreg(inc, count)
    elect_sync()                                                 the warp's leader lane, as a predicate
    tensor_map_address(tmap)                                     generic address of a map param
    tma_load(dst, tmap_addr, coords, bar)                        TMA box copy global -> shared
    stmatrix(addr, regs)                                         four 8x8 b16 matrices to shared
    tma_store(src, tmap_addr, coords)                            TMA box copy shared -> global
    bulk_commit(), bulk_wait_read(n)                             the TMA stores' bulk groups
    prefetch_tensormap(tmap_addr)                                the descriptor into the cache

Every wgmma instruction is warpgroup-wide (all 128 threads converged), so none may be placed
under a predicate block. The accumulator is named once as the destination: wgmma reads it as C
(when scale_d is true) and writes D in place.
"""

from __future__ import annotations

from typing import Sequence

from ..errors import IRError
from .values import (
    B64, BF16, E4M3, E5M2, F16, F32, PRED, S32, TMAP, U32, U64, Addr, Imm, PtxType, Reg, Sym,
    TensorCoords, Vec)

SWIZZLE_MODE = {0: 0, 128: 1, 64: 2, 32: 3}   # swizzle width in bytes -> descriptor bits [63:62]


class HopperOps:
    """Mixed into KernelBuilder (uses its reg/emit/_operand/_guard)."""

    def _warpgroup_wide(self, what: str) -> None:
        if self._guard is not None:
            raise IRError(f"{what} under a predicate: all 128 threads of the warpgroup must "
                          f"execute it")

    # ---- wgmma --------------------------------------------------------------------------
    def wgmma_fence(self) -> None:
        """Orders register (and shared) accesses before the next wgmma.mma_async."""
        self._warpgroup_wide("wgmma.fence")
        self.emit("wgmma", ("fence", "sync", "aligned"))

    def wgmma_commit(self) -> None:
        self._warpgroup_wide("wgmma.commit_group")
        self.emit("wgmma", ("commit_group", "sync", "aligned"))

    def wgmma_wait(self, n: int) -> None:
        """Wait until at most `n` of this warpgroup's committed wgmma groups are pending."""
        self._warpgroup_wide("wgmma.wait_group")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise IRError(f"wgmma.wait_group: {n!r} is not a non-negative integer")
        self.emit("wgmma", ("wait_group", "sync", "aligned"), (), (Imm(n, U32),))

    def wgmma(self, acc: Sequence[Reg], a, b_desc, in_type: PtxType, scale_d=True,
              trans_a: int = 0, trans_b: int = 0) -> list[Reg]:
        """acc = A·B (+ acc when scale_d) on wgmma.mma_async.m64nNk16.f32 (f16 / bf16 inputs) or
        m64nNk32.f32 (e4m3 / e5m2: both operands K-major, no transpose operands), N = 2 *
        len(acc): `a` is 4 b32 registers (the mma.m16n8k16 / m16n8k32 A fragment per warp) or a
        u64 descriptor, `b_desc` a u64 descriptor; trans_* = 1 reads that 16-bit operand
        MN-major (not for register A). scale_d: a Python bool (an immediate) or a predicate
        register."""
        what = "wgmma.mma_async"
        self._warpgroup_wide(what)
        narrow = in_type in (E4M3, E5M2)
        if in_type not in (F16, BF16) and not narrow:
            raise IRError(f"{what}: input type {in_type} is not f16, bf16, e4m3 or e5m2")
        if narrow and (trans_a or trans_b):
            raise IRError(f"{what}: {in_type} operands are K-major only (no transpose)")
        acc = list(acc)
        n = 2 * len(acc)
        if not 8 <= n <= 256 or n % 8:
            raise IRError(f"{what}: {len(acc)} accumulator registers give N = {n}; N must be a "
                          f"multiple of 8 in 8..256")
        for i, r in enumerate(acc):
            if not isinstance(r, Reg) or r.type != F32:
                raise IRError(f"{what}: accumulator[{i}] {r} is not an f32 register")
        for t in (trans_a, trans_b):
            if t not in (0, 1) or isinstance(t, bool):
                raise IRError(f"{what}: transpose flag {t!r} is not 0 or 1")
        if isinstance(a, (list, tuple)):
            if len(a) != 4 or any(not isinstance(r, Reg) or r.type.bits != 32 for r in a):
                raise IRError(f"{what}: register operand A is 4 32-bit registers, got {a}")
            if trans_a:
                raise IRError(f"{what}: operand A from registers cannot be transposed")
            a_op = Vec(tuple(a))
        else:
            a_op = self._operand(a, U64, f"{what} A descriptor")
        b_op = self._operand(b_desc, U64, f"{what} B descriptor")
        sd = self._flag(scale_d, f"{what}: scale_d")
        flags = (Imm(1, U32), Imm(1, U32))
        if not narrow:       # 8-bit forms take no transpose operands
            flags += (Imm(trans_b, U32),) if isinstance(a_op, Vec) else \
                (Imm(trans_a, U32), Imm(trans_b, U32))
        shape = f"m64n{n}k{32 if narrow else 16}"
        self.emit("wgmma", ("mma_async", "sync", "aligned", shape, "f32", in_type.name, in_type.name),
                  (Vec(tuple(acc)),), (a_op, b_op, sd) + flags)
        return acc

    def _flag(self, value, what: str):
        """A Python bool (an immediate 0/1) or a predicate register, as an operand."""
        if isinstance(value, bool):
            return Imm(int(value), U32)
        if isinstance(value, Reg) and value.type == PRED:
            return value
        raise IRError(f"{what} {value!r} is not a bool or a predicate register")

    def matrix_descriptor(self, addr: Reg, lbo: int, sbo: int, swizzle: int) -> Reg:
        """The u64 wgmma matrix descriptor of the operand at shared address `addr` (u32):
        start address >> 4 in bits [13:0], LBO >> 4 in [29:16], SBO >> 4 in [45:32], swizzle
        mode in [63:62]; base offset 0 (tiles start 1024-byte aligned). Adding k << 4 bytes to
        the result later moves the start address by k bytes (the field cannot overflow below
        the 228 KiB shared window)."""
        return self._descriptor("matrix descriptor", addr, lbo, sbo, swizzle, SWIZZLE_MODE,
                                lambda mode: mode << 62)

    def _descriptor(self, what: str, addr: Reg, lbo: int, sbo: int, swizzle: int, modes: dict,
                    mode_bits) -> Reg:
        """A shared-memory matrix descriptor (wgmma's or tcgen05's): start >> 4 in [13:0]
        (from `addr`), LBO >> 4 in [29:16], SBO >> 4 in [45:32], and mode_bits(modes[swizzle])
        for the rest of the constant high bits."""
        if swizzle not in modes:
            raise IRError(f"{what}: swizzle {swizzle} is not one of 0, 32, 64, 128 bytes")
        for name, v in (("lbo", lbo), ("sbo", sbo)):
            if v % 16 or not 0 <= v >> 4 < 1 << 14:
                raise IRError(f"{what}: {name} {v} is not a multiple of 16 below 256 KiB")
        const = ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | mode_bits(modes[swizzle])
        start = self.cvt(U64, self.and_(self.shr(addr, 4), 0x3FFF))
        return self.bitcast(self.or_(self.bitcast(start, B64), Imm(const, B64)), U64)

    # ---- proxies and mbarriers ------------------------------------------------------------
    def fence_proxy_async(self) -> None:
        """Makes this thread's generic-proxy shared-memory writes (st.shared, cp.async) visible
        to later async-proxy reads (wgmma operands, TMA stores) and vice versa."""
        self.emit("fence", ("proxy", "async", "shared::cta"))

    def mbarrier_init(self, bar: Addr, count) -> None:
        self._mbar_addr(bar, "mbarrier.init")
        self.emit("mbarrier", ("init", "shared::cta", "b64"), (),
                  (bar, self._operand(count, U32, "mbarrier.init count")))

    def mbarrier_arrive(self, bar: Addr) -> Reg:
        """Arrive once; returns the b64 state token."""
        self._mbar_addr(bar, "mbarrier.arrive")
        d = self.reg(B64)
        self.emit("mbarrier", ("arrive", "shared::cta", "b64"), (d,), (bar,))
        return d

    def mbarrier_arrive_expect_tx(self, bar: Addr, tx_bytes) -> Reg:
        """Arrive once and add `tx_bytes` to the current phase's expected transaction count."""
        self._mbar_addr(bar, "mbarrier.arrive.expect_tx")
        d = self.reg(B64)
        self.emit("mbarrier", ("arrive", "expect_tx", "shared::cta", "b64"), (d,),
                  (bar, self._operand(tx_bytes, U32, "mbarrier.arrive.expect_tx bytes")))
        return d

    def mbarrier_try_wait_parity(self, bar: Addr, parity) -> Reg:
        """Predicate 'the phase with this parity has completed' (may return false spuriously:
        callers loop)."""
        self._mbar_addr(bar, "mbarrier.try_wait.parity")
        p = self.reg(PRED)
        self.emit("mbarrier", ("try_wait", "parity", "shared::cta", "b64"), (p,),
                  (bar, self._operand(parity, U32, "mbarrier.try_wait parity")))
        return p

    def mbarrier_wait_parity(self, bar: Addr, parity) -> None:
        """Spin on try_wait.parity until the phase completes (a structured loop)."""
        head = self.label("mbar_wait")
        self.place(head)
        self.bra(head, self.mbarrier_try_wait_parity(bar, parity), negate=True)

    def _mbar_addr(self, bar: Addr, what: str) -> None:
        if not isinstance(bar, Addr):
            raise IRError(f"{what}: {bar!r} is not an Addr")
        if isinstance(bar.base, Reg) and bar.base.type.bits != 32:
            raise IRError(f"{what}: shared address register {bar.base} is {bar.base.type}, "
                          f"expected 32-bit")

    def setmaxnreg(self, inc: bool, count: int) -> None:
        """Raise (inc) or lower this warpgroup's per-thread register budget to `count`."""
        self._warpgroup_wide("setmaxnreg")
        if isinstance(count, bool) or not isinstance(count, int) or not 24 <= count <= 256 \
                or count % 8:
            raise IRError(f"setmaxnreg: {count!r} is not a multiple of 8 in 24..256")
        self.emit("setmaxnreg", ("inc" if inc else "dec", "sync", "aligned", "u32"), (),
                  (Imm(count, U32),))

    def elect_sync(self) -> Reg:
        """elect.sync over the whole warp: a predicate true in one lane (the lowest). The
        whole warp must execute it. A single-thread issue under it keeps the operands computed
        by the whole warp, which ptxas can then hold in uniform registers (an issue under
        `tid == k` makes it prove each operand warp-uniform or loop over the lanes)."""
        if self._guard is not None:
            raise IRError("elect.sync under a predicate: every lane of the warp must execute it")
        leader, p = self.reg(U32), self.reg(PRED)
        self.emit("elect", ("sync",), (leader, p), (Imm(-1, S32),))
        return p

    # ---- TMA ------------------------------------------------------------------------------
    def tensor_map_address(self, tmap: Sym) -> Reg:
        """The generic address of a tensor-map parameter (mov + cvta.param), the form ptxas
        takes in cp.async.bulk.tensor and prefetch.tensormap (naming the parameter directly is
        refused: "state space mismatch")."""
        if not isinstance(tmap, Sym) or tmap.type != TMAP:
            raise IRError(f"tensor map address: {tmap!r} is not a tensor-map parameter")
        d = self.reg(U64)
        self.emit("mov", ("u64",), (d,), (tmap,))
        self.emit("cvta", ("param", "u64"), (d,), (d,))
        return d

    def tma_load(self, dst: Addr, tmap_addr: Reg, coords: Sequence, bar: Addr) -> None:
        """One box of the tensor behind the map at `tmap_addr` (from tensor_map_address) at
        `coords` (s32, innermost first) into shared memory at `dst` (128-byte aligned for a
        swizzled map), completing `bar`'s transaction count by the box's bytes:
        cp.async.bulk.tensor.Nd.shared::cluster.global.tile.mbarrier::complete_tx::bytes.
        Issued by every thread that executes it (callers elect one)."""
        what = "cp.async.bulk.tensor"
        box = self._tensor_coords(tmap_addr, coords, what)
        self._mbar_addr(dst, f"{what} destination")
        self._mbar_addr(bar, f"{what} mbarrier")
        self.emit("cp", ("async", "bulk", "tensor", f"{len(box.coords)}d", "shared::cluster",
                         "global", "tile", "mbarrier::complete_tx::bytes"), (), (dst, box, bar))

    def _tensor_coords(self, tmap_addr: Reg, coords: Sequence, what: str) -> TensorCoords:
        """A TMA copy's [map, {coords}] operand, checked: a u64 map address, 1 to 5 s32
        coordinates."""
        self._operand(tmap_addr, U64, f"{what} tensor map")
        if not isinstance(tmap_addr, Reg):
            raise IRError(f"{what}: the tensor map is a u64 register from tensor_map_address")
        coords = list(coords)
        if not 1 <= len(coords) <= 5:
            raise IRError(f"{what}: {len(coords)} coordinates; a tensor map has 1 to 5 dimensions")
        return TensorCoords(tmap_addr, tuple(self._operand(c, S32, f"{what} coordinate {i}")
                                             for i, c in enumerate(coords)))

    def stmatrix(self, addr: Addr, regs: Sequence[Reg]) -> None:
        """Four 8x8 matrices of 16-bit elements to shared memory,
        stmatrix.sync.aligned.m8n8.x4.shared.b16: register i of lane l holds row l / 4,
        columns 2 (l % 4) and + 1 of matrix i (the mma.sync C fragment of an n8 block, packed);
        lanes 8i .. 8i + 7 give the addresses of matrix i's rows (16 bytes each). Warp-wide."""
        what = "stmatrix"
        if self._guard is not None:
            raise IRError(f"{what} under a predicate: all 32 lanes of the warp must execute it")
        regs = list(regs)
        if len(regs) != 4 or any(not isinstance(r, Reg) or r.type.bits != 32 for r in regs):
            raise IRError(f"{what}: .x4 takes four 32-bit registers, got {regs!r}")
        self._mbar_addr(addr, f"{what} address")
        self.emit("stmatrix", ("sync", "aligned", "m8n8", "x4", "shared", "b16"), (),
                  (addr, Vec(tuple(regs))))

    def tma_store(self, src: Addr, tmap_addr: Reg, coords: Sequence) -> None:
        """One box of shared memory at `src` (128-byte aligned; the layout a tma_load of the
        same map writes) into the tensor behind the map at `coords`, clipped to the tensor:
        cp.async.bulk.tensor.Nd.global.shared::cta.tile.bulk_group. The caller's
        fence_proxy_async orders the threads' writes of `src` before it, and bulk_commit /
        bulk_wait_read keep `src` alive until it has been read. Callers elect one thread."""
        what = "cp.async.bulk.tensor (store)"
        box = self._tensor_coords(tmap_addr, coords, what)
        self._mbar_addr(src, f"{what} source")
        self.emit("cp", ("async", "bulk", "tensor", f"{len(box.coords)}d", "global", "shared::cta",
                         "tile", "bulk_group"), (), (box, src))

    def bulk_commit(self) -> None:
        """Close this thread's bulk async-group (its TMA stores so far)."""
        self.emit("cp", ("async", "bulk", "commit_group"))

    def bulk_wait_read(self, n: int = 0) -> None:
        """Wait until at most `n` of this thread's bulk groups still read their shared memory."""
        self.emit("cp", ("async", "bulk", "wait_group", "read"), (), (Imm(n, U32),))

    def prefetch_tensormap(self, tmap_addr: Reg) -> None:
        """Bring the tensor map's 128 bytes into the descriptor cache ahead of the first copy."""
        if not isinstance(tmap_addr, Reg) or tmap_addr.type != U64:
            raise IRError(f"prefetch.tensormap: {tmap_addr!r} is not a u64 register from "
                          f"tensor_map_address")
        self.emit("prefetch", ("tensormap",), (), (Addr(tmap_addr),))

__all__ = ["HopperOps", "SWIZZLE_MODE"]
