"""The parsed form of a PTX module: frozen dataclasses for operands, instructions, entries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from ptxc.errors import EmulationError

# ----------------------------------------------------------------------------- operands


@dataclass(frozen=True)
class Reg:
    """A register or special register (``%r1``, ``%tid.x``); ``neg`` for ``!%p`` sources."""
    name: str
    neg: bool = False


@dataclass(frozen=True)
class Imm:
    """An immediate. ``kind`` is 'int', 'f32bits' (0fXXXXXXXX), 'f64bits' (0d...) or 'float'."""
    value: Union[int, float]
    kind: str


@dataclass(frozen=True)
class Sym:
    """A bare identifier: a shared variable, a parameter or a label."""
    name: str


@dataclass(frozen=True)
class Addr:
    """``[base+offset]``; base is a Reg, a Sym (variable/param) or None (absolute address)."""
    base: Union[Reg, Sym, None]
    offset: int


@dataclass(frozen=True)
class TensorAddr:
    """``[map, {c0, c1, ...}]``: a tensor map's address and box coordinates (TMA)."""
    map: Addr
    coords: tuple


@dataclass(frozen=True)
class Vec:
    """``{a, b, ...}``: a vector operand (ld/st.v*, mov pack/unpack, mma fragments)."""
    items: tuple


@dataclass(frozen=True)
class Pair:
    """``d|p``: a destination with a second (predicate) destination."""
    first: object
    second: object


@dataclass(frozen=True)
class Sink:
    """``_``: a destination whose value is discarded."""


Operand = Union[Reg, Imm, Sym, Addr, TensorAddr, Vec, Pair, Sink]

# ----------------------------------------------------------------------------- structure


@dataclass(frozen=True)
class Instruction:
    line: int
    text: str                   # the statement as written (without the trailing ';')
    guard: Union[Reg, None]     # @%p / @!%p (neg=True)
    opcode: str                 # 'ld', 'mma', 'cp', ...
    mods: tuple                 # ('global', 'nc', 'v4', 'b32')
    operands: tuple


@dataclass(frozen=True)
class Param:
    name: str
    ptype: str                  # 'u64', 'f32', ...; 'b8' for a by-value struct (byte array)
    line: int
    nbytes: Union[int, None] = None    # by-value struct `.param .align A .b8 name[nbytes]`
    align: int = 1


@dataclass(frozen=True)
class GlobalVar:
    """A module-scope `.global` / `.const` variable; `init` holds the initialiser's items
    (Imm operands, flattened) or is empty."""
    name: str
    space: str                  # 'global' or 'const'
    align: int
    elem: str                   # element type name ('b8', 'u32', 'f32', ...)
    count: int
    init: tuple
    line: int


@dataclass(frozen=True)
class SharedVar:
    name: str
    align: int
    nbytes: Union[int, None]    # None for `.extern` (the dynamic shared memory window)
    line: int


@dataclass(frozen=True)
class Entry:
    name: str
    line: int
    params: tuple               # of Param
    regs: tuple                 # of (name, ptype), ranges expanded
    shared: tuple               # of SharedVar, in declaration order (module scope first)
    body: tuple                 # of Instruction
    labels: tuple               # of (label, pc)
    reqntid: Union[tuple, None]
    maxntid: Union[tuple, None]
    minnctapersm: Union[int, None] = None    # the CTAs per SM ptxas keeps registers for


@dataclass(frozen=True)
class Module:
    version: str
    target: str
    address_size: int
    entries: tuple              # of Entry
    globals: tuple = ()         # of GlobalVar, in declaration order

    def entry(self, name: str) -> Entry:
        for e in self.entries:
            if e.name == name:
                return e
        names = ", ".join(e.name for e in self.entries) or "none"
        raise EmulationError(f"kernel '{name}' is not an .entry of this module (entries: {names})")
