"""PTX types, per-thread register storage, and operand read/write plans.

Registers hold raw bits, one numpy array per register over all threads of a batch
(uint16/uint32/uint64, bool for predicates). An instruction's type picks a *view* of those bits
(float32 for .f32, int32 for .s32, ...), chosen once at decode time.

Operand plans are built at decode time (so a bad operand is reported before any thread runs)
and bound to a batch's storage later: ``plan(ctx) -> reader(sel)`` / ``writer(sel, value)``.
``sel`` selects the executing threads: ``slice(None)`` (all threads of the batch, the fast path
that makes every read a cheap view) or a sorted int64 index array.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ptxc.emu.ptx_ast import Imm, Reg, Sink, Sym

SHARED_BASE = 0x400          # first shared-window address (sm_80+ reserve the first 1 KB too)
# `mov.u64 %rd, param` / cvta.param: kernel parameters' addresses (only TMA reads through them)
PARAM_BASE = 0x7E00_0000_0000
ALL = slice(None)


class Fault(Exception):
    """Raised inside an executing instruction; the executor adds kernel/line/thread context."""

    def __init__(self, message: str, thread: int | None = None, address: int | None = None):
        super().__init__(message)
        self.message, self.thread, self.address = message, thread, address


class DecodeError(Exception):
    """An instruction the emulator cannot run; decode.py adds the kernel and line."""


# ----------------------------------------------------------------------------- types

@dataclass(frozen=True)
class PtxType:
    name: str
    kind: str       # 'u' 's' 'b' 'f' 'bf' 'p'
    bits: int

    @property
    def dtype(self):
        return _DTYPE[(self.kind, self.bits)]

    @property
    def nbytes(self) -> int:
        return max(self.bits // 8, 1)

    @property
    def signed(self) -> bool:
        return self.kind == "s"

    @property
    def is_float(self) -> bool:
        return self.kind in ("f", "bf")


_UINT = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}
_SINT = {8: np.int8, 16: np.int16, 32: np.int32, 64: np.int64}
_DTYPE = {("p", 1): np.bool_, ("bf", 16): np.uint16,
          ("f", 16): np.float16, ("f", 32): np.float32, ("f", 64): np.float64}
for _b in (8, 16, 32, 64):
    _DTYPE[("u", _b)] = _DTYPE[("b", _b)] = _UINT[_b]
    _DTYPE[("s", _b)] = _SINT[_b]

TYPES = {"pred": PtxType("pred", "p", 1), "f16": PtxType("f16", "f", 16),
         "f32": PtxType("f32", "f", 32), "f64": PtxType("f64", "f", 64),
         "bf16": PtxType("bf16", "bf", 16),
         # packed pairs are plain 32-bit containers for the ops that accept them
         "f16x2": PtxType("f16x2", "b", 32), "bf16x2": PtxType("bf16x2", "b", 32),
         "f32x2": PtxType("f32x2", "b", 64),        # sm_100+ packed f32 add/sub/mul/fma
         # FP8 pairs (cvt only): two bytes in 16 bits, element 0 in the low byte
         "e4m3x2": PtxType("e4m3x2", "b", 16), "e5m2x2": PtxType("e5m2x2", "b", 16)}
for _k in "bus":
    for _b in (8, 16, 32, 64):
        TYPES[f"{_k}{_b}"] = PtxType(f"{_k}{_b}", _k, _b)

uint_of = _UINT.__getitem__
sint_of = _SINT.__getitem__


def ptype(name: str) -> PtxType:
    try:
        return TYPES[name]
    except KeyError:
        raise DecodeError(f"unsupported type .{name}") from None


# ----------------------------------------------------------------------------- registers

# Registers start with a poison pattern, not zero: a read of a never-written register gives
# NaN as a float and a wildly out-of-bounds value as an address, so such bugs surface loudly.
_POISON = {8: 0xAD, 16: 0x7EAD, 32: 0x7FF0DEAD, 64: 0x7FF8DEAD7FF8DEAD}


class RegStorage:
    """One register for all threads: raw bits plus typed views of the same memory."""

    __slots__ = ("width", "bits", "views")

    def __init__(self, decl_type: PtxType, n: int):
        if decl_type.kind == "p":
            self.width, self.bits = 1, np.zeros(n, np.bool_)
            self.views = {"p": self.bits}
            return
        w = decl_type.bits
        self.width = w
        self.bits = np.full(n, _POISON[w], _UINT[w])
        self.views = {"u": self.bits, "b": self.bits, "s": self.bits.view(_SINT[w])}
        if w in (16, 32, 64):
            self.views["f"] = self.bits.view(_DTYPE[("f", w)])
        if w == 16:
            self.views["bf"] = self.bits


SPECIAL_REGS = {f"%{n}.{c}" for n in ("tid", "ntid", "ctaid", "nctaid") for c in "xyz"}
SPECIAL_REGS |= {"%laneid", "%warpid", "%nwarpid", "%lanemask_eq", "%lanemask_lt",
                 "%lanemask_le", "%lanemask_gt", "%lanemask_ge"}


# ----------------------------------------------------------------------------- plans

def imm_scalar(imm: Imm, ty: PtxType):
    """An immediate as a numpy scalar of `ty`'s compute dtype."""
    if ty.kind == "p":
        if imm.kind != "int":
            raise DecodeError("a predicate immediate must be an integer (0 false, else true)")
        return np.bool_(imm.value != 0)         # e.g. `mov.pred %p, -1` (Triton sm_90a)
    if ty.kind == "f":
        if imm.kind == "f32bits":
            v = float(np.uint32(imm.value).view(np.float32))
        elif imm.kind == "f64bits":
            v = float(np.uint64(imm.value).view(np.float64))
        else:
            v = float(imm.value)
        return ty.dtype(v)
    if imm.kind == "float":
        raise DecodeError(f"a decimal float immediate cannot have type .{ty.name}")
    width = ty.bits
    if imm.kind in ("f32bits", "f64bits") and (32 if imm.kind == "f32bits" else 64) != width:
        raise DecodeError(f"float-bits immediate does not fit type .{ty.name}")
    return np.array(int(imm.value) & ((1 << width) - 1), _UINT[width]).view(ty.dtype)[()]


def src_plan(env, operand, ty: PtxType):
    """Validate a source operand now; return bind(ctx) -> reader(sel)."""
    if isinstance(operand, Imm):
        value = imm_scalar(operand, ty)
        return lambda ctx: (lambda sel: value)
    if isinstance(operand, Sym):
        glob = env.global_address(operand.name)
        if glob is not None:
            if ty.kind not in "usb" or ty.bits != 64:
                raise DecodeError(f"address of {operand.name} needs a 64-bit integer type")
            return lambda ctx: (lambda v: (lambda sel: v.view(ty.dtype)))(glob(ctx))
        if operand.name in env.params and ty.kind in "usb" and ty.bits in (32, 64):
            # a parameter's address: its generic one as 64 bits (nvcc's `mov.u64; cvta.param`),
            # its offset in the parameter space as 32 bits (Triton's `mov.b32; cvt; cvta.param`)
            off = env.params[operand.name][0]
            value = imm_scalar(Imm(off + (PARAM_BASE if ty.bits == 64 else 0), "int"), ty)
            return lambda ctx: (lambda sel: value)
        addr = env.symbol_address(operand.name)
        if ty.kind not in "usb" or ty.bits < 32:
            raise DecodeError(f"address of {operand.name} needs a 32/64-bit integer type")
        value = imm_scalar(Imm(addr, "int"), ty)
        return lambda ctx: (lambda sel: value)
    if not isinstance(operand, Reg):
        raise DecodeError(f"expected a register or immediate, got {operand}")
    if operand.name in SPECIAL_REGS:
        if ty.bits != 32 or ty.kind not in "usb":
            raise DecodeError(f"special register {operand.name} is read as .u32/.s32/.b32")
        name, dt = operand.name, ty.dtype
        return lambda ctx: _view_reader(ctx.special(name).view(dt))
    decl = env.reg_type(operand.name)
    neg = operand.neg
    if ty.kind == "p" or decl.kind == "p":
        if ty.kind != decl.kind:
            raise DecodeError(f"{operand.name} is .{decl.name}, instruction needs .{ty.name}")
        name = operand.name
        if neg:
            return lambda ctx: (lambda arr: (lambda sel: ~arr[sel]))(ctx.regs[name].bits)
        return lambda ctx: _view_reader(ctx.regs[name].bits)
    if neg:
        raise DecodeError(f"'!' applies to predicates only, not {operand.name}")
    if decl.bits < ty.bits:
        raise DecodeError(f"register {operand.name} (.{decl.name}) is narrower than .{ty.name}")
    name, kind = operand.name, ty.kind
    if decl.bits == ty.bits:
        return lambda ctx: _view_reader(ctx.regs[name].views[kind])
    narrow, dt = _UINT[ty.bits], ty.dtype   # wider register: use its low bits (PTX truncates)

    def bind(ctx):
        bits = ctx.regs[name].bits
        return lambda sel: bits[sel].astype(narrow).view(dt)
    return bind


def _view_reader(arr):
    return lambda sel: arr[sel]


def dst_plan(env, operand, ty: PtxType):
    """Validate a destination operand now; return bind(ctx) -> writer(sel, value)."""
    if isinstance(operand, Sink):
        return lambda ctx: (lambda sel, v: None)
    if not isinstance(operand, Reg) or operand.neg or operand.name in SPECIAL_REGS:
        raise DecodeError(f"destination must be a writable register, got {operand}")
    decl = env.reg_type(operand.name)
    name = operand.name
    if ty.kind == "p" or decl.kind == "p":
        if ty.kind != decl.kind:
            raise DecodeError(f"{operand.name} is .{decl.name}, instruction writes .{ty.name}")
        return lambda ctx: _view_writer(ctx.regs[name].bits)
    if decl.bits < ty.bits:
        raise DecodeError(f"register {operand.name} (.{decl.name}) is narrower than .{ty.name}")
    kind = ty.kind
    if decl.bits == ty.bits:
        return lambda ctx: _view_writer(ctx.regs[name].views[kind])
    # A wider destination register: sign-extend signed types, zero-extend everything else.
    dt, wide = ty.dtype, decl.bits
    if ty.signed:
        def bind(ctx):
            bits = ctx.regs[name].bits
            wide_t = _SINT[wide]

            def write(sel, v):
                bits[sel] = np.asarray(v, dt).astype(wide_t).view(_UINT[wide])
            return write
        return bind
    narrow_u = _UINT[ty.bits]

    def bind_u(ctx):
        bits = ctx.regs[name].bits

        def write(sel, v):
            bits[sel] = np.asarray(v, dt).view(narrow_u).astype(_UINT[wide])
        return write
    return bind_u


def _view_writer(arr):
    def write(sel, v):
        arr[sel] = v
    return write

