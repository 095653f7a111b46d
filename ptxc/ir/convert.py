"""Conversions, byte permutes and FP8 conversions of `KernelBuilder`, type-checked like the rest.

    cvt(to, a, rnd), cvt_pack(to, hi, lo)   type conversions (float narrowing rounds to nearest)
    prmt(a, b, selector)           prmt.b32: pick 4 of the 8 bytes of {b, a} (docs: PTX ISA "prmt")
    cvt_from_fp8x2(src, kind)      cvt.rn.f16x2.{e4m3x2,e5m2x2}: two FP8 bytes -> f16x2 (sm_89+)
    cvt_to_fp8x2(hi, lo, kind)     cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32: two f32 -> two bytes (sm_89+)
    add_rn(a, b), mul_rn(a, b)     f32 add/mul with an explicit .rn, which ptxas may not contract
                                   into an fma (for results a float32 model must reproduce exactly)
    add_rm(a, b)                   f32 add rounded toward -inf
    f32x2(op, *srcs, mode)         add/sub/mul/fma on two f32 packed in a .b64 (sm_100+; pack and
                                   unpack with KernelBuilder.pack / unpack)

The FP8 pairs live in 16-bit registers with element 0 in the low byte (the same order as
f16x2). Whether a target has the instructions is the caller's decision (ptxc/kernels/math/fp8.py
emits an exact software path below sm_89); ptxas rejects them on older targets.
"""

from __future__ import annotations

from ..errors import IRError
from .values import B16, B32, B64, BF16X2, E4M3X2, E5M2X2, F16X2, F32, U32, PtxType

FP8X2 = {"e4m3": E4M3X2, "e5m2": E5M2X2}


class ConvertOps:
    """Mixed into KernelBuilder (uses its reg/emit/_out/_operand/_type_of)."""

    def cvt(self, to: PtxType, a: Value, rnd: str | None = None, out=None) -> Reg:
        src = self._type_of(a, what="cvt")
        if rnd is None and to.is_float and src.is_float and to.bits < src.bits:
            rnd = "rn"  # narrowing float conversions require a rounding mode
        if rnd is None and to.is_int and src.is_float:
            rnd = "rzi"
        if rnd is None and to.is_float and src.is_int:
            rnd = "rn"
        mods = ((rnd,) if rnd else ()) + (to.name, src.name)
        d = self._out(to, out, "cvt")
        self.emit("cvt", mods, (d,), (self._operand(a, src, "cvt"),))
        return d

    def cvt_pack(self, to: PtxType, hi: Value, lo: Value, out: Reg | None = None) -> Reg:
        """Round two f32 into one f16x2/bf16x2 register: element 0 (low bits) = lo."""
        if to not in (F16X2, BF16X2):
            raise IRError(f"cvt_pack: target {to} is not f16x2 or bf16x2")
        d = self._out(to, out, "cvt_pack")
        self.emit("cvt", ("rn", to.name, "f32"), (d,),
                  (self._operand(hi, F32, "cvt_pack"), self._operand(lo, F32, "cvt_pack")))
        return d

    def prmt(self, a, b, selector) -> "Reg":  # noqa: F821
        """Bytes of the result: byte i = byte (selector nibble i) of the 8-byte value {b, a}."""
        d = self.reg(B32)
        self.emit("prmt", ("b32",), (d,), (self._operand(a, B32, "prmt"), self._operand(b, B32, "prmt"),
                                           self._operand(selector, U32, "prmt")))
        return d

    def add_rn(self, a, b) -> "Reg":  # noqa: F821
        return self._float_rn("add", a, b)

    def mul_rn(self, a, b) -> "Reg":  # noqa: F821
        return self._float_rn("mul", a, b)

    def add_rm(self, a, b) -> "Reg":  # noqa: F821
        """f32 add rounded toward -inf (a magic-number floor: x + 1.5·2^23 keeps floor(x) in
        the low mantissa bits, on the FMA pipe rather than a conversion unit)."""
        return self._float_rn("add", a, b, "rm")

    def f32x2(self, op: str, *srcs, mode: str = "rn") -> "Reg":  # noqa: F821
        """One FP32-pipe instruction on two f32 lanes packed in .b64 registers (the low half is
        element 0): add/sub/mul take two operands, fma three. Blackwell's f32x2 forms (sm_100+;
        the caller decides that the target has them)."""
        arity = {"add": 2, "sub": 2, "mul": 2, "fma": 3}
        if op not in arity:
            raise IRError(f"f32x2: {op!r} has no f32x2 form (add, sub, mul, fma do)")
        if len(srcs) != arity[op]:
            raise IRError(f"f32x2: {op} takes {arity[op]} operands, got {len(srcs)}")
        if mode not in ("rn", "rz", "rm", "rp"):
            raise IRError(f"f32x2: rounding {mode!r} not one of rn, rz, rm, rp")
        d = self.reg(B64)
        self.emit(op, (mode, "f32x2"), (d,), tuple(self._operand(x, B64, f"{op}.f32x2") for x in srcs))
        return d

    def _float_rn(self, op: str, a, b, mode: str = "rn") -> "Reg":  # noqa: F821
        d = self.reg(F32)
        self.emit(op, (mode, "f32"), (d,), (self._operand(a, F32, op), self._operand(b, F32, op)))
        return d

    def cvt_from_fp8x2(self, src, kind: str) -> "Reg":  # noqa: F821
        """Two FP8 values (a 16-bit register, element 0 low) -> f16x2, exactly."""
        t = _fp8x2(kind)
        d = self.reg(F16X2)
        self.emit("cvt", ("rn", "f16x2", t.name), (d,), (self._operand(src, B16, "cvt_from_fp8x2"),))
        return d

    def cvt_to_fp8x2(self, hi, lo, kind: str) -> "Reg":  # noqa: F821
        """Round two f32 to FP8 (nearest-even, NaN kept, overflow and inf to max finite):
        element 0 (low byte) = lo."""
        t = _fp8x2(kind)
        d = self.reg(t)
        self.emit("cvt", ("rn", "satfinite", t.name, "f32"), (d,),
                  (self._operand(hi, F32, "cvt_to_fp8x2"), self._operand(lo, F32, "cvt_to_fp8x2")))
        return d


def _fp8x2(kind: str):
    if kind not in FP8X2:
        raise IRError(f"FP8 kind {kind!r} is not one of {', '.join(FP8X2)}")
    return FP8X2[kind]
