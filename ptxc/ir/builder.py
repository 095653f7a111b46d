"""KernelBuilder: build one PTX entry as typed IR, checking operands as instructions are made.

Kernel code reads as an algorithm: values are returned from calls (`s = b.fma(q, k, s)`),
control flow uses `with b.if_then(p):`, `with b.else_():`, `with b.for_range(lo, hi) as i:` and
`with b.predicate(p):` rather than hand-placed labels, and any operand mismatch raises `IRError`
naming the instruction, the operand and both types.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Sequence

from ..errors import IRError
from .blackwell import BlackwellOps
from .control import ControlFlowOps
from .collectives import CollectiveOps
from .convert import ConvertOps
from .hopper import HopperOps
from .tensorcore import TensorCoreOps
from .values import (
    F16, F32, F64, B16, B32, B64, BF16, PRED, S32, S64, SPECIAL_REGS, U32, U64, Addr, Imm, Label,
    PtxType, Reg, Special, Sym, Value, Vec, check_space, storage_of)

INT_CMPS = ("eq", "ne", "lt", "le", "gt", "ge")
FLOAT_CMPS = INT_CMPS + ("equ", "neu", "ltu", "leu", "gtu", "geu", "num", "nan")


def _fits_f32(v: float) -> bool:
    """A finite float that rounds to a finite f32 (inf and NaN are meant as they are)."""
    if not math.isfinite(v):
        return True
    try:
        struct.pack("<f", v)
    except OverflowError:
        return False
    return True


@dataclass(frozen=True)
class Instr:
    op: str                          # "add", "ld", "label", ...
    mods: tuple[str, ...] = ()       # ".global", ".v4", ".f32" ... in mnemonic order, without dots
    dsts: tuple = ()
    srcs: tuple = ()
    guard: tuple[Reg, bool] | None = None  # (predicate, negated)

    @property
    def mnemonic(self) -> str:
        return ".".join((self.op,) + self.mods)


@dataclass(frozen=True)
class Param:
    name: str
    type: PtxType


@dataclass(frozen=True)
class SharedDecl:
    name: str
    nbytes: int          # 0 for the dynamic (extern) region
    align: int = 16


@dataclass
class EntryIR:
    name: str
    params: list[Param] = field(default_factory=list)
    body: list[Instr] = field(default_factory=list)
    reg_counts: dict[str, int] = field(default_factory=dict)
    shared: list[SharedDecl] = field(default_factory=list)

    @property
    def static_smem_bytes(self) -> int:
        total = 0
        for s in self.shared:
            total = -(-total // s.align) * s.align + s.nbytes
        return total




class KernelBuilder(ControlFlowOps, CollectiveOps, TensorCoreOps, ConvertOps, HopperOps, BlackwellOps):
    """Typed instruction methods; structured control flow comes from `ControlFlowOps`, shuffles,
    ballots and barriers from `CollectiveOps`, tensor-core and cp.async ones from `TensorCoreOps`,
    cvt, prmt and the FP8 conversions from `ConvertOps`, wgmma and mbarriers (sm_90a) from
    `HopperOps`, tensor memory and tcgen05 (sm_100a) from `BlackwellOps`."""

    def __init__(self, name: str):
        self.entry = EntryIR(name)
        self._guard: tuple[Reg, bool] | None = None
        self._labels = 0
        self._pending_else: Label | None = None

    # ---- declarations -------------------------------------------------------------------
    def param(self, name: str, type: PtxType) -> Sym:
        if any(p.name == name for p in self.entry.params):
            raise IRError(f"{self.entry.name}: parameter {name!r} declared twice")
        self.entry.params.append(Param(name, type))
        return Sym(name, type)

    def shared(self, name: str, nbytes: int, align: int = 16) -> Sym:
        self.entry.shared.append(SharedDecl(name, nbytes, align))
        return Sym(name, U32)

    def reg(self, type: PtxType) -> Reg:
        if type.kind == "tmap":
            raise IRError(f"{self.entry.name}: a tensor map is a parameter, not a register value")
        cls = storage_of(type)
        n = self.entry.reg_counts.get(cls, 0) + 1  # index 0 unused, like nvcc's output
        self.entry.reg_counts[cls] = n
        return Reg(type, cls, n)

    def label(self, hint: str = "L") -> Label:
        self._labels += 1
        return Label(f"$L__{hint}_{self._labels}")

    # ---- emission -----------------------------------------------------------------------
    def emit(self, op: str, mods: Sequence[str] = (), dsts: Sequence = (), srcs: Sequence = ()) -> None:
        self.entry.body.append(Instr(op, tuple(mods), tuple(dsts), tuple(srcs), self._guard))

    def place(self, label: Label) -> None:
        self.entry.body.append(Instr("label", (), (), (label,)))

    def comment(self, text: str) -> None:
        self.entry.body.append(Instr("comment", (), (), (text,)))

    def _operand(self, v: Value, type: PtxType, what: str) -> Reg | Imm | Special | Sym:
        if v.__class__ in _TYPED:    # the common case first: a register or a typed value
            if v.type is not type and not _compatible(v.type, type):
                raise IRError(f"{what}: operand {v} has type {v.type}, expected {type}")
            return v
        if isinstance(v, bool):
            raise IRError(f"{what}: a Python bool is not an operand; use a predicate register")
        if isinstance(v, int):
            if type.is_float:
                return Imm(float(v), type)
            return Imm(v, type)
        if isinstance(v, float):
            if not type.is_float:
                raise IRError(f"{what}: float immediate {v} where {type} is expected")
            if type.name == "f32" and not _fits_f32(v):
                raise IRError(f"{what}: float immediate {v} overflows f32")
            return Imm(v, type)
        if isinstance(v, (Reg, Imm, Special, Sym)):
            if not _compatible(v.type, type):
                raise IRError(f"{what}: operand {v} has type {v.type}, expected {type}")
            return v
        raise IRError(f"{what}: {v!r} is not an operand")

    def _out(self, type: PtxType, out: Reg | None, what: str) -> Reg:
        if out is None:
            return self.reg(type)
        if out.__class__ is not Reg or out.type is not type and not _compatible(out.type, type):
            raise IRError(f"{what}: destination {out} has type "
                          f"{getattr(out, 'type', '?')}, expected {type}")
        return out

    @staticmethod
    def _type_of(*vals: Value, what: str) -> PtxType:
        typed = [v.type for v in vals if isinstance(v, _TYPED)]
        if not typed:
            raise IRError(f"{what}: cannot infer a type from immediates alone; pass type=")
        first = typed[0]
        for t in typed[1:]:
            if t != first:
                raise IRError(f"{what}: operands have types {first} and {t}; both must be one type")
        return first

    # ---- data movement ------------------------------------------------------------------
    def mov(self, src: Value, type: PtxType | None = None, out: Reg | None = None) -> Reg:
        type = type or self._type_of(src, what="mov")
        d = self._out(type, out, "mov")
        self.emit("mov", (_movtype(type),), (d,), (self._operand(src, type, "mov"),))
        return d

    def bitcast(self, src: Reg, type: PtxType) -> Reg:
        """The same bits viewed as another type of equal width (no instruction when the
        register class is shared, e.g. u64 <-> s64; a `mov.bN` otherwise, e.g. b32 -> f32)."""
        if src.type.bits != type.bits:
            raise IRError(f"bitcast: {src} is {src.type.bits}-bit, {type} is {type.bits}-bit")
        if storage_of(type) == src.cls:
            return Reg(type, src.cls, src.index)
        d = self.reg(type)
        self.emit("mov", (f"b{type.bits}",), (d,), (src,))
        return d

    def special(self, name: str) -> Reg:
        if name not in SPECIAL_REGS:
            raise IRError(f"unknown special register {name!r}")
        return self.mov(Special(name), U32)

    def load_param(self, p: Sym) -> Reg:
        d = self.reg(p.type)
        self.emit("ld", ("param", p.type.name), (d,), (Addr(p),))
        return d

    def address_of(self, shared: Sym) -> Reg:
        """The 32-bit shared-window address of a shared variable."""
        d = self.reg(U32)
        self.emit("mov", ("u32",), (d,), (shared,))
        return d

    def to_global(self, ptr: Reg) -> Reg:
        d = self.reg(U64)
        self.emit("cvta", ("to", "global", "u64"), (d,), (self._operand(ptr, U64, "cvta"),))
        return d

    def ld(self, space: str, type: PtxType, addr: Addr, vec: int = 1, nc: bool = False,
           out: Sequence[Reg] | None = None) -> Reg | list[Reg]:
        check_space(space, addr, "ld")
        # A byte (u8) lands zero-extended in a 32-bit register (PTX has no 8-bit registers)
        dsts = list(out) if out is not None else \
            [self.reg(U32 if type.bits == 8 else type) for _ in range(vec)]
        if len(dsts) != vec or any(not (_compatible(d.type, type) or
                                        type.bits == 8 and d.type.bits in (16, 32)) for d in dsts):
            raise IRError(f"ld: destinations {dsts} do not match {vec} x {type}")
        mods = [space] + (["nc"] if nc else []) + ([f"v{vec}"] if vec > 1 else []) + [type.name]
        self.emit("ld", mods, (dsts[0] if vec == 1 else Vec(tuple(dsts)),), (addr,))
        return dsts[0] if vec == 1 else dsts

    def st(self, space: str, type: PtxType, addr: Addr, values: Sequence[Value]) -> None:
        check_space(space, addr, "st")
        vals = [self._operand(v, type, "st") for v in values]
        if len(vals) not in (1, 2, 4):
            raise IRError(f"st: {len(vals)} values; a store takes 1, 2 or 4")
        mods = [space] + ([f"v{len(vals)}"] if len(vals) > 1 else []) + [type.name]
        self.emit("st", mods, (), (addr, vals[0] if len(vals) == 1 else Vec(tuple(vals))))

    def red(self, space: str, op: str, type: PtxType, addr: Addr, value: Value) -> None:
        """red.space.op.type [addr], value: an atomic read-modify-write whose old value is unused."""
        check_space(space, addr, "red")
        if op not in ("add", "and", "or", "xor", "min", "max"):
            raise IRError(f"red: unknown operation {op!r}")
        self.emit("red", (space, op, type.name), (), (addr, self._operand(value, type, "red")))

    def pack(self, type: PtxType, parts: Sequence[Reg]) -> Reg:
        """Pack halves (element 0 in the low bits) into one b32, or two b32 into one b64."""
        part_type = {32: B16, 64: B32}[type.bits]
        for p in parts:
            if p.type.bits != part_type.bits:
                raise IRError(f"pack: part {p} is {p.type}, expected {part_type.bits}-bit values")
        d = self.reg(type)
        self.emit("mov", (f"b{type.bits}",), (d,), (Vec(tuple(parts)),))
        return d

    def unpack(self, src: Reg, part_type: PtxType) -> list[Reg]:
        parts = [self.reg(part_type) for _ in range(src.type.bits // part_type.bits)]
        self.emit("mov", (f"b{src.type.bits}",), (Vec(tuple(parts)),), (src,))
        return parts

    # ---- arithmetic ---------------------------------------------------------------------
    def _binary(self, op: str, a: Value, b: Value, out: Reg | None, mods: tuple = (),
                type: PtxType | None = None, allow: str = "usfb") -> Reg:
        type = type or self._type_of(a, b, what=op)
        if type.kind not in allow and not (type.kind == "pred" and "p" in allow):
            raise IRError(f"{op}: type {type} not allowed (needs {allow!r} kinds)")
        d = self._out(type, out, op)
        self.emit(op, mods + (_arith_type(op, type),), (d,),
                  (self._operand(a, type, op), self._operand(b, type, op)))
        return d

    def add(self, a, b, out=None): return self._binary("add", a, b, out, allow="usf")
    def sub(self, a, b, out=None): return self._binary("sub", a, b, out, allow="usf")
    def min(self, a, b, out=None): return self._binary("min", a, b, out, allow="usf")
    def max(self, a, b, out=None): return self._binary("max", a, b, out, allow="usf")
    def and_(self, a, b, out=None): return self._binary("and", a, b, out, allow="usbp")
    def or_(self, a, b, out=None): return self._binary("or", a, b, out, allow="usbp")
    def xor(self, a, b, out=None): return self._binary("xor", a, b, out, allow="usbp")

    def mul(self, a, b, out=None):
        t = self._type_of(a, b, what="mul")
        return self._binary("mul", a, b, out, mods=("lo",) if t.is_int else (), allow="usf")

    def div(self, a, b, out=None, approx: bool = False):
        t = self._type_of(a, b, what="div")
        mods = (("approx",) if approx else ("rn",)) if t.is_float else ()
        return self._binary("div", a, b, out, mods=mods, allow="usf")

    def rem(self, a, b, out=None): return self._binary("rem", a, b, out, allow="us")

    def shl(self, a: Value, n: Value, out=None) -> Reg:
        return self._shift("shl", a, n, out)

    def shr(self, a: Value, n: Value, out=None) -> Reg:
        return self._shift("shr", a, n, out)

    def _shift(self, op, a, n, out):
        t = self._type_of(a, what=op)
        d = self._out(t, out, op)
        mod = f"b{t.bits}" if op == "shl" else t.name
        self.emit(op, (mod,), (d,), (self._operand(a, t, op), self._operand(n, U32, op)))
        return d

    def mul_wide(self, a: Value, b: Value, out=None) -> Reg:
        t = self._type_of(a, b, what="mul.wide")
        if t not in (U32, S32):
            raise IRError(f"mul.wide: operands are {t}, expected u32 or s32")
        d = self._out(U64 if t == U32 else S64, out, "mul.wide")
        self.emit("mul", ("wide", t.name), (d,), (self._operand(a, t, "mul.wide"),
                                                   self._operand(b, t, "mul.wide")))
        return d

    def mad(self, a: Value, b: Value, c: Value, out=None) -> Reg:
        """a*b + c: `mad.lo` for integers, `fma.rn` (one rounding) for floats."""
        t = self._type_of(a, b, c, what="mad")
        d = self._out(t, out, "mad")
        op, mods = ("fma", ("rn", t.name)) if t.is_float else ("mad", ("lo", t.name))
        self.emit(op, mods, (d,), tuple(self._operand(x, t, op) for x in (a, b, c)))
        return d

    fma = mad

    def _unary(self, op: str, mods: tuple, a: Value, type: PtxType, out=None) -> Reg:
        d = self._out(type, out, op)
        self.emit(op, mods, (d,), (self._operand(a, type, op),))
        return d

    def neg(self, a, out=None):
        t = self._type_of(a, what="neg")
        return self._unary("neg", (t.name,), a, t, out)

    def abs(self, a, out=None):
        t = self._type_of(a, what="abs")
        return self._unary("abs", (t.name,), a, t, out)

    def not_(self, a, out=None):
        t = self._type_of(a, what="not")
        return self._unary("not", ("pred" if t == PRED else f"b{t.bits}",), a, t, out)

    def popc(self, a, out=None):
        """The set bits of a 32-bit value (popc.b32; the count is u32)."""
        return self._unary("popc", ("b32",), a, U32, out)

    def ex2(self, a, out=None):
        """2**a (ex2.approx.ftz: <= 2 ulp; -inf -> +0)."""
        return self._unary("ex2", ("approx", "ftz", "f32"), a, F32, out)

    def tanh(self, a, out=None):
        """tanh(a) (tanh.approx.f32, sm_75+: relative error about 2^-11)."""
        return self._unary("tanh", ("approx", "f32"), a, F32, out)

    def lg2(self, a, out=None):
        return self._unary("lg2", ("approx", "ftz", "f32"), a, F32, out)

    def rcp(self, a, out=None):
        return self._unary("rcp", ("rn", "f32"), a, F32, out)

    # ---- predicates ---------------------------------------------------------------------
    def setp(self, cmp: str, a: Value, b: Value) -> Reg:
        t = self._type_of(a, b, what=f"setp.{cmp}")
        allowed = FLOAT_CMPS if t.is_float else INT_CMPS
        if cmp not in allowed:
            raise IRError(f"setp: comparison {cmp!r} not valid for {t}; allowed: {allowed}")
        p = self.reg(PRED)
        self.emit("setp", (cmp, t.name), (p,), (self._operand(a, t, "setp"), self._operand(b, t, "setp")))
        return p

    def selp(self, a: Value, b: Value, p: Reg, type: PtxType | None = None) -> Reg:
        """p ? a : b (`type` is needed only when both are immediates)."""
        t = type or self._type_of(a, b, what="selp")
        if not isinstance(p, Reg) or p.type != PRED:
            raise IRError(f"selp: selector {p} is not a predicate register")
        d = self.reg(t)
        self.emit("selp", (t.name,), (d,), (self._operand(a, t, "selp"), self._operand(b, t, "selp"), p))
        return d

_TYPED = (Reg, Imm, Special, Sym)   # operands that carry their type


def _compatible(have: PtxType, want: PtxType) -> bool:
    if have is want or have == want:
        return True
    # Untyped bits match any type of the same width (PTX's relaxed type-checking rule).
    return (have.kind == "b" or want.kind == "b") and have.bits == want.bits


def _movtype(t: PtxType) -> str:
    if t == PRED:
        return "pred"
    if t.kind == "b" or t in (F16, BF16):
        return f"b{t.bits}"
    return t.name


def _arith_type(op: str, t: PtxType) -> str:
    if op in ("and", "or", "xor"):
        return "pred" if t == PRED else f"b{t.bits}"
    return t.name


__all__ = ["KernelBuilder", "EntryIR", "Instr", "Param", "SharedDecl", "B16", "B32", "B64", "BF16",
           "F16", "F32", "F64", "U32", "U64", "S32", "S64", "PRED"]
