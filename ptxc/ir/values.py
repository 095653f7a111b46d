"""IR types and operands: typed virtual registers, immediates, symbols, addresses.

A virtual register is named by its storage class and a counter (`%r7`, `%f12`), and each class
is declared once per entry as `.reg .b32 %r<N>;` — ptxas does the real allocation. The IR type
(u32 vs s32 vs b32, f16 vs bf16) is tracked separately from the storage class so the builder
can type-check instructions, while the PTX declares only a handful of register arrays.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from ..errors import IRError


@dataclass(frozen=True)
class PtxType:
    name: str   # "u32", "f16x2", "pred"
    bits: int
    kind: str   # "u" unsigned, "s" signed, "f" float, "b" untyped bits, "pred"

    @property
    def is_int(self) -> bool:
        return self.kind in ("u", "s")

    @property
    def is_float(self) -> bool:
        return self.kind == "f"

    @property
    def bytes(self) -> int:
        return self.bits // 8

    def __str__(self) -> str:
        return self.name


PRED = PtxType("pred", 1, "pred")
B16, B32, B64 = PtxType("b16", 16, "b"), PtxType("b32", 32, "b"), PtxType("b64", 64, "b")
U8 = PtxType("u8", 8, "u")   # memory type only: ld.u8 into a 32-bit register
U16, U32, U64 = PtxType("u16", 16, "u"), PtxType("u32", 32, "u"), PtxType("u64", 64, "u")
S16, S32, S64 = PtxType("s16", 16, "s"), PtxType("s32", 32, "s"), PtxType("s64", 64, "s")
F16, BF16 = PtxType("f16", 16, "f"), PtxType("bf16", 16, "f")
F32, F64 = PtxType("f32", 32, "f"), PtxType("f64", 64, "f")
# A pair of halves packed in 32 bits: element 0 in bits [15:0].
F16X2, BF16X2 = PtxType("f16x2", 32, "b"), PtxType("bf16x2", 32, "b")
# One FP8 element: an operand type of 8-bit wgmma (never a register's type).
E4M3, E5M2 = PtxType("e4m3", 8, "b"), PtxType("e5m2", 8, "b")
# A pair of FP8 bytes packed in 16 bits: element 0 in bits [7:0].
E4M3X2, E5M2X2 = PtxType("e4m3x2", 16, "b"), PtxType("e5m2x2", 16, "b")
# A CUtensorMap kernel parameter (TMA descriptor): 128 opaque bytes, 64-byte aligned, declared
# `.param .align 64 .b8 NAME[128]`. Only a parameter has this type (never a register).
TMAP = PtxType("tmap", 1024, "tmap")
PARAM_ALIGN = {"tmap": 64}   # parameter alignment where it is not the size


def param_decl(type: PtxType, name: str) -> str:
    """A kernel parameter's declaration text after `.param`."""
    if type is TMAP:
        return f".align 64 .b8 {name}[{TMAP.bytes}]"
    return f".{type.name} {name}"

TYPES = {t.name: t for t in (PRED, B16, B32, B64, U16, U32, U64, S16, S32, S64, F16, BF16, F32,
                             F64, F16X2, BF16X2, E4M3X2, E5M2X2)}

# Storage class per IR type: (register prefix, declared PTX type).
_STORAGE = {"pred": ("p", "pred"), 16: ("h", "b16"), 32: ("r", "b32"), 64: ("rd", "b64")}
_FLOAT_STORAGE = {"f32": ("f", "f32"), "f64": ("fd", "f64")}
STORAGE_ORDER = ("p", "h", "r", "rd", "f", "fd")
STORAGE_DECL = {"p": "pred", "h": "b16", "r": "b32", "rd": "b64", "f": "f32", "fd": "f64"}


def storage_of(t: PtxType) -> str:
    if t.name in _FLOAT_STORAGE:
        return _FLOAT_STORAGE[t.name][0]
    return _STORAGE["pred" if t is PRED else t.bits][0]


@dataclass(frozen=True)
class Reg:
    type: PtxType
    cls: str      # storage prefix: "r", "rd", "f", ...
    index: int
    # The register's name, made once: a kernel prints each register many times
    text: str = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "text", f"%{self.cls}{self.index}")

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class Imm:
    value: int | float
    type: PtxType

    def __str__(self) -> str:
        t = self.type
        if t.name == "f32":
            return "0f%08X" % struct.unpack("<I", struct.pack("<f", self.value))[0]
        if t.name == "f64":
            return "0d%016X" % struct.unpack("<Q", struct.pack("<d", self.value))[0]
        return str(int(self.value))


@dataclass(frozen=True)
class Special:
    """A special register such as %tid.x (always u32 in ptxc's use)."""

    name: str
    type: PtxType = U32

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Sym:
    """A named address: a kernel parameter or a shared-memory variable."""

    name: str
    type: PtxType = U64

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class TensorCoords:
    """The source of a TMA copy `[tmap, {c0, c1, ...}]`: the tensor map's generic address (a
    u64 register) and s32 coordinates, innermost dimension first."""

    tmap: Reg
    coords: tuple

    def __str__(self) -> str:
        return f"[{self.tmap}, {{{', '.join(map(str, self.coords))}}}]"


@dataclass(frozen=True)
class Addr:
    """A memory operand `[base+offset]`; base is a register or a symbol."""

    base: Reg | Sym
    offset: int = 0

    def __str__(self) -> str:
        if self.offset:
            return f"[{self.base}+{self.offset}]" if self.offset > 0 else f"[{self.base}{self.offset}]"
        return f"[{self.base}]"


@dataclass(frozen=True)
class Vec:
    """A brace list `{a, b, c, d}` (vector loads/stores, packing, mma fragments)."""

    items: tuple

    def __str__(self) -> str:
        return "{" + ", ".join(map(str, self.items)) + "}"


@dataclass(frozen=True)
class Label:
    name: str

    def __str__(self) -> str:
        return self.name


Operand = Reg | Imm | Special | Sym | Addr | Vec | Label
SPECIAL_REGS = {f"%{n}.{a}" for n in ("tid", "ntid", "ctaid", "nctaid") for a in "xyz"} | {
    "%laneid", "%warpid"}


# An operand as the builder takes it: a register, an immediate, a special register, a symbol,
# or a Python number (made an immediate of the instruction's type).
Value = Reg | Imm | Special | Sym | int | float


def check_space(space: str, addr: Addr, op: str) -> None:
    if space not in ("global", "shared", "param", "local"):
        raise IRError(f"{op}: unknown state space {space!r}")
    if not isinstance(addr, Addr):
        raise IRError(f"{op}: address {addr!r} is not an Addr")
    base = addr.base
    want = U32 if space == "shared" else U64
    if isinstance(base, Reg) and base.type.bits != want.bits:
        raise IRError(f"{op}.{space}: address register {base} is {base.type}, expected {want.bits}-bit")
