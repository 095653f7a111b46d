"""sm_100a instructions of `KernelBuilder`: tensor memory and the fifth-generation tensor core
(tcgen05), type-checked like the rest of the builder (PTX ISA: "TensorCore 5th Generation
Family Instructions").

    tcgen05_alloc(slot, ncols) / tcgen05_dealloc(taddr, ncols) / tcgen05_relinquish()
    umma_descriptor(addr, lbo, sbo, swizzle)                  a 64-bit shared-memory descriptor
    umma_instr_descriptor(m, n, in_type, b_mn_major)          the 32-bit kind::f16 descriptor
    tcgen05_mma(d, a, b_desc, idesc, accumulate)              D (+)= A·B, one issuing thread
    tcgen05_commit(bar)                                       the issuer's MMAs -> an mbarrier
    tcgen05_ld(shape, reps, taddr) / tcgen05_st(shape, taddr, regs)
    tcgen05_wait(kind) / tcgen05_fence(before)

alloc, dealloc, relinquish, ld, st and the waits are warp-collective (.sync.aligned): they may
not sit under a predicate block (a whole warp branches around them instead). mma and commit
are issued by each thread that executes them: callers elect one.
"""

from __future__ import annotations

from typing import Sequence

from ..errors import IRError
from .values import B32, BF16, F16, U32, U64, Addr, Imm, PtxType, Reg, Vec

# layout type (bits 61-63) of a tcgen05 shared-memory descriptor, by swizzle width in bytes
UMMA_LAYOUT = {0: 0, 128: 2, 64: 4, 32: 6}
# tcgen05.ld/st shapes: registers per thread per repetition
LD_SHAPES = {"32x32b": 1, "16x64b": 1, "16x128b": 2, "16x256b": 4}


class BlackwellOps:
    """Mixed into KernelBuilder (uses its reg/emit/_operand/_guard)."""

    def _warp_wide(self, what: str) -> None:
        if self._guard is not None:
            raise IRError(f"{what} under a predicate: all 32 lanes of the warp must execute it")

    def _taddr(self, taddr, what: str) -> Addr:
        if not isinstance(taddr, Reg) or taddr.type.bits != 32:
            raise IRError(f"{what}: tensor-memory address {taddr!r} is not a 32-bit register")
        return Addr(taddr)

    # ---- allocation ------------------------------------------------------------------------
    def tcgen05_alloc(self, slot: Addr, ncols: int) -> None:
        """Allocate `ncols` columns (a power of two, 32..512); the address is written to the
        shared 4-byte `slot`."""
        what = "tcgen05.alloc"
        self._warp_wide(what)
        self._columns(ncols, what)
        if not isinstance(slot, Addr):
            raise IRError(f"{what}: {slot!r} is not a shared Addr")
        self.emit("tcgen05", ("alloc", "cta_group::1", "sync", "aligned", "shared::cta", "b32"),
                  (), (slot, Imm(ncols, U32)))

    def tcgen05_dealloc(self, taddr: Reg, ncols: int) -> None:
        what = "tcgen05.dealloc"
        self._warp_wide(what)
        self._columns(ncols, what)
        self._taddr(taddr, what)
        self.emit("tcgen05", ("dealloc", "cta_group::1", "sync", "aligned", "b32"), (),
                  (taddr, Imm(ncols, U32)))

    def tcgen05_relinquish(self) -> None:
        self._warp_wide("tcgen05.relinquish_alloc_permit")
        self.emit("tcgen05", ("relinquish_alloc_permit", "cta_group::1", "sync", "aligned"))

    @staticmethod
    def _columns(ncols: int, what: str) -> None:
        if isinstance(ncols, bool) or not isinstance(ncols, int) or ncols < 32 or ncols > 512 \
                or ncols & (ncols - 1):
            raise IRError(f"{what}: {ncols!r} columns is not a power of two in 32..512")

    # ---- descriptors -----------------------------------------------------------------------
    def umma_descriptor(self, addr: Reg, lbo: int, sbo: int, swizzle: int) -> Reg:
        """The u64 tcgen05 shared-memory descriptor of the operand at shared address `addr`:
        start >> 4 in [13:0], LBO >> 4 in [29:16], SBO >> 4 in [45:32], the version 0b001 in
        [48:46], layout type in [63:61]; base offset 0 (tiles start swizzle-period aligned).
        Adding k << 4 bytes to the result moves the start address by k bytes."""
        return self._descriptor("umma descriptor", addr, lbo, sbo, swizzle, UMMA_LAYOUT,
                                lambda layout: (1 << 46) | (layout << 61))

    @staticmethod
    def umma_instr_descriptor(m: int, n: int, in_type: PtxType, b_mn_major: bool = False) -> int:
        """kind::f16 with an f32 D, A K-major: M (64 or 128), N (a multiple of 16 up to 256 for
        M = 128, of 8 for M = 64), f16/bf16 A and B, B K-major or MN-major."""
        if in_type not in (F16, BF16):
            raise IRError(f"tcgen05.mma: input type {in_type} is not f16 or bf16")
        step = 16 if m == 128 else 8
        if m not in (64, 128) or not step <= n <= 256 or n % step:
            raise IRError(f"tcgen05.mma: M = {m}, N = {n} is not a kind::f16 shape (M 64 or 128, "
                          f"N a multiple of {step} up to 256)")
        fmt = 1 if in_type == BF16 else 0
        return ((1 << 4) | (fmt << 7) | (fmt << 10) | (int(b_mn_major) << 16) | ((n >> 3) << 17)
                | ((m >> 4) << 24))

    # ---- mma and commit --------------------------------------------------------------------
    def tcgen05_mma(self, d: Reg, a, b_desc, idesc: int, accumulate) -> None:
        """D (at tensor-memory address d) = A·B, + D when `accumulate` (a Python bool or a
        predicate): tcgen05.mma.cta_group::1.kind::f16. `a` is a u64 descriptor or a 32-bit
        tensor-memory address (A in tensor memory), `b_desc` a u64 descriptor, `idesc` from
        umma_instr_descriptor."""
        what = "tcgen05.mma"
        d_op = self._taddr(d, f"{what} D")
        if isinstance(a, Reg) and a.type.bits == 32:
            a_op = Addr(a)
        else:
            a_op = self._operand(a, U64, f"{what} A descriptor")
        b_op = self._operand(b_desc, U64, f"{what} B descriptor")
        if isinstance(idesc, bool) or not isinstance(idesc, int) or not 0 <= idesc < 1 << 32:
            raise IRError(f"{what}: instruction descriptor {idesc!r} is not a 32-bit constant")
        i_reg = self.mov(idesc, U32)
        acc = self._flag(accumulate, f"{what}: accumulate")
        self.emit("tcgen05", ("mma", "cta_group::1", "kind::f16"), (),
                  (d_op, a_op, b_op, i_reg, acc))

    def tcgen05_commit(self, bar: Addr) -> None:
        """The issuing thread's earlier MMAs arrive once on `bar` when they complete."""
        self._mbar_addr(bar, "tcgen05.commit")
        self.emit("tcgen05", ("commit", "cta_group::1", "mbarrier::arrive::one",
                              "shared::cluster", "b64"), (), (bar,))

    # ---- tensor memory <-> registers ---------------------------------------------------------
    def _shape(self, shape: str, reps: int, what: str) -> int:
        if shape not in LD_SHAPES:
            raise IRError(f"{what}: shape {shape!r} is not one of {', '.join(LD_SHAPES)}")
        if reps not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise IRError(f"{what}: repetition {reps!r} is not a power of two up to 128")
        n = LD_SHAPES[shape] * reps
        if n > 128:
            raise IRError(f"{what}: .{shape}.x{reps} moves {n} registers per thread (at most 128)")
        return n

    def tcgen05_ld(self, shape: str, reps: int, taddr: Reg, type: PtxType = B32) -> list[Reg]:
        """The warp's cells of `shape` repeated `reps` times from `taddr` (registers of the
        32-bit `type`, in the PTX ISA's fragment order); complete after tcgen05_wait("ld")."""
        what = "tcgen05.ld"
        self._warp_wide(what)
        n = self._shape(shape, reps, what)
        if type.bits != 32:
            raise IRError(f"{what}: {type} registers; the cells are 32 bits")
        regs = [self.reg(type) for _ in range(n)]
        self.emit("tcgen05", ("ld", "sync", "aligned", shape, f"x{reps}", "b32"),
                  (Vec(tuple(regs)),), (self._taddr(taddr, what),))
        return regs

    def tcgen05_st(self, shape: str, taddr: Reg, regs: Sequence[Reg]) -> None:
        """Store 32-bit registers to the warp's cells of `shape` (the repetition follows from
        their number); complete after tcgen05_wait("st")."""
        what = "tcgen05.st"
        self._warp_wide(what)
        regs = list(regs)
        per = LD_SHAPES.get(shape)
        if per is None or len(regs) % per:
            raise IRError(f"{what}: {len(regs)} registers do not make whole .{shape} blocks")
        self._shape(shape, len(regs) // per, what)
        for r in regs:
            if not isinstance(r, Reg) or r.type.bits != 32:
                raise IRError(f"{what}: {r!r} is not a 32-bit register")
        self.emit("tcgen05", ("st", "sync", "aligned", shape, f"x{len(regs) // per}", "b32"), (),
                  (self._taddr(taddr, what), Vec(tuple(regs))))

    def tcgen05_wait(self, kind: str) -> None:
        if kind not in ("ld", "st"):
            raise IRError(f"tcgen05.wait: {kind!r} is not 'ld' or 'st'")
        self._warp_wide(f"tcgen05.wait::{kind}")
        self.emit("tcgen05", (f"wait::{kind}", "sync", "aligned"))

    def tcgen05_fence(self, before: bool) -> None:
        """Orders tcgen05 operations before (before=True) or after a thread synchronisation."""
        self.emit("tcgen05", ("fence::before_thread_sync" if before else
                              "fence::after_thread_sync",))


__all__ = ["BlackwellOps", "UMMA_LAYOUT"]
