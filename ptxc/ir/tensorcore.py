"""Tensor-core and asynchronous-copy instructions of `KernelBuilder` (sm_80+): mma.m16n8k16,
mma.m16n8k32 over FP8 (sm_89+), ldmatrix and cp.async (with commit/wait groups), type-checked
like the rest of the builder. Fragment layouts and address patterns: docs/kernels.md (prefill)
and the PTX ISA sections "Matrix Fragments for mma.m16n8k16 / mma.m16n8k32", "ldmatrix" and
"cp.async"."""

from __future__ import annotations

from typing import Sequence

from ..errors import IRError
from .values import (B32, BF16, BF16X2, E4M3, E5M2, F16, F16X2, F32, U32, Addr, Imm, PtxType, Reg, Vec,
                     check_space)


class TensorCoreOps:
    """Mixed into KernelBuilder (uses its reg/emit/_out/_operand)."""

    def mma_m16n8k16(self, a: Sequence[Reg], b: Sequence[Reg], c: Sequence[Reg], in_type: PtxType,
                     out: Sequence[Reg] | None = None) -> list[Reg]:
        """D = A·B + C on one m16n8k16 tile (row.col, f32 accumulate): a is 4 packed-pair
        registers, b 2, c and the result 4 f32 registers (fragment layouts: docs/kernels.md)."""
        if in_type not in (F16, BF16):
            raise IRError(f"mma.m16n8k16: input type {in_type} is not f16 or bf16")
        pair = F16X2 if in_type == F16 else BF16X2
        return self._mma("m16n8k16", a, b, c, (in_type, in_type), (B32, pair), f"b32 or {pair}", out)

    def mma_m16n8k32(self, a: Sequence[Reg], b: Sequence[Reg], c: Sequence[Reg], a_type: PtxType,
                     b_type: PtxType | None = None, out: Sequence[Reg] | None = None) -> list[Reg]:
        """D = A·B + C on one m16n8k32 tile over 8-bit floats (row.col, f32 accumulate; sm_89+,
        PTX ISA 8.4): a is 4 b32 registers of 4 e4m3 / e5m2 bytes each (rows g, g + 8, g, g + 8
        at k 4t.., 4t.., 16 + 4t.., 16 + 4t..), b 2 (k 4t.. and 16 + 4t.. of column g), c and
        the result 4 f32 registers. `b_type` defaults to `a_type` (the two may differ)."""
        b_type = a_type if b_type is None else b_type
        for name, ty in (("a", a_type), ("b", b_type)):
            if ty not in (E4M3, E5M2):
                raise IRError(f"mma.m16n8k32: {name} type {ty} is not e4m3 or e5m2")
        return self._mma("m16n8k32", a, b, c, (a_type, b_type), (B32,), "b32", out)

    def _mma(self, shape: str, a, b, c, types: tuple[PtxType, PtxType], frag_types: tuple,
             frag_text: str, out) -> list[Reg]:
        """mma.sync.aligned.<shape>.row.col.f32.<A>.<B>.f32 after the fragment checks: a 4
        registers, b 2 (of `frag_types`), c and the result 4 f32."""
        what = f"mma.{shape}"
        for name, regs, n in (("a", a, 4), ("b", b, 2)):
            _check_frag(what, name, regs, n, frag_types, frag_text)
        _check_frag(what, "c", c, 4, (F32,), "f32")
        if out is not None and len(out) != 4:
            raise IRError(f"{what}: {len(out)} destination registers, expected 4")
        dsts = [self._out(F32, o, f"{what} d") for o in (out if out is not None else [None] * 4)]
        self.emit("mma", ("sync", "aligned", shape, "row", "col", "f32", types[0].name, types[1].name, "f32"),
                  (Vec(tuple(dsts)),), (Vec(tuple(a)), Vec(tuple(b)), Vec(tuple(c))))
        return dsts

    def ldmatrix(self, addr: Addr, count: int, trans: bool = False) -> list[Reg]:
        """ldmatrix.sync.aligned.m8n8.x{count}: `count` 8x8 b16 matrices from shared memory,
        one b32 register per matrix; lanes 8m..8m+7 give the 16-byte row addresses of matrix m."""
        if count not in (1, 2, 4):
            raise IRError(f"ldmatrix: count {count} is not 1, 2 or 4")
        check_space("shared", addr, "ldmatrix")
        dsts = [self.reg(B32) for _ in range(count)]
        mods = ("sync", "aligned", "m8n8", f"x{count}") + (("trans",) if trans else ()) + ("shared", "b16")
        self.emit("ldmatrix", mods, (Vec(tuple(dsts)),), (addr,))
        return dsts

    def cp_async(self, dst: Addr, src: Addr, size: int = 16, src_size: "Reg | Imm | int | None" = None,
                 cache: str = "cg") -> None:
        """Asynchronous global -> shared copy of `size` bytes; with `src_size` < size only that
        many bytes are read and the rest of the destination is zero-filled."""
        if cache not in ("ca", "cg"):
            raise IRError(f"cp.async: cache level {cache!r} is not 'ca' or 'cg'")
        if size not in (4, 8, 16):
            raise IRError(f"cp.async: size {size} is not 4, 8 or 16")
        if cache == "cg" and size != 16:
            raise IRError(f"cp.async.cg: size {size}; .cg copies 16 bytes (use cache='ca')")
        check_space("shared", dst, "cp.async dst")
        check_space("global", src, "cp.async src")
        srcs = (dst, src, Imm(size, U32))
        if src_size is not None:
            if isinstance(src_size, int) and not isinstance(src_size, bool) and not 0 <= src_size <= size:
                raise IRError(f"cp.async: src_size {src_size} outside 0..{size}")
            srcs += (self._operand(src_size, U32, "cp.async src_size"),)
        self.emit("cp_async", (cache, "shared", "global"), (), srcs)

    def cp_async_commit(self) -> None:
        self.emit("cp_async", ("commit_group",))

    def cp_async_wait(self, n: int) -> None:
        """Wait until at most `n` of this thread's committed cp.async groups are pending."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise IRError(f"cp.async.wait_group: {n!r} is not a non-negative integer")
        self.emit("cp_async", ("wait_group",), (), (Imm(n, U32),))


def _check_frag(what: str, name: str, regs, n: int, types, allowed: str) -> None:
    regs = list(regs)
    if len(regs) != n:
        raise IRError(f"{what}: operand {name} has {len(regs)} registers, expected {n}")
    for i, r in enumerate(regs):
        if not isinstance(r, Reg):
            raise IRError(f"{what}: {name}[{i}] = {r!r} is not a register")
        if r.type not in types:
            raise IRError(f"{what}: {name}[{i}] {r} has type {r.type}, expected {allowed}")
