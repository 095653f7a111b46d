"""Kernel IR: typed virtual registers and instructions, built with `KernelBuilder`, printed to PTX."""

from .builder import EntryIR, Instr, KernelBuilder
from .printer import render_module
from .values import (
    B16, B32, B64, BF16, BF16X2, E4M3, E4M3X2, E5M2, E5M2X2, F16, F16X2, F32, F64, PRED, S32, S64,
    TMAP, U8, U32, U64, Addr, Imm, Label, PtxType, Reg, Sym, Vec)

__all__ = ["KernelBuilder", "EntryIR", "Instr", "render_module", "Addr", "Imm", "Label", "PtxType",
           "Reg", "Sym", "Vec", "B16", "B32", "B64", "BF16", "BF16X2", "E4M3", "E4M3X2", "E5M2",
           "E5M2X2", "F16", "F16X2", "F32", "F64", "PRED", "S32", "S64", "TMAP", "U8", "U32", "U64"]
