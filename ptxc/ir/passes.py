"""IR passes run on every entry between the kernel builders and the printer (compiler.lower).

strength_reduce: unsigned division and remainder by a power-of-two immediate become a shift
and a mask. ptxas does not always do this itself: a `rem.u32 j, 2` inside prefill's KV loop
came out as a ~20-instruction integer division in the SASS (issue 13). Signed division is left
alone: `div.s32 -3, 2` is -1 where an arithmetic shift gives -2.
"""

from __future__ import annotations

from dataclasses import replace

from .builder import EntryIR, Instr
from .values import B32, B64, U32, Imm

_UNSIGNED = {"u32": B32, "u64": B64}


def _power_of_two(v) -> int | None:
    """log2 of an immediate that is a positive power of two, else None."""
    if isinstance(v, Imm) and isinstance(v.value, int) and v.value > 0 and v.value & (v.value - 1) == 0:
        return v.value.bit_length() - 1
    return None


def _reduce(i: Instr) -> Instr:
    if i.op not in ("div", "rem") or len(i.mods) != 1 or i.mods[0] not in _UNSIGNED:
        return i
    k = _power_of_two(i.srcs[1])
    if k is None:
        return i
    if i.op == "div":
        return replace(i, op="shr", srcs=(i.srcs[0], Imm(k, U32)))
    bits = _UNSIGNED[i.mods[0]]
    return replace(i, op="and", mods=(bits.name,), srcs=(i.srcs[0], Imm((1 << k) - 1, bits)))


def strength_reduce(entry: EntryIR) -> EntryIR:
    return replace(entry, body=[_reduce(i) for i in entry.body])


PASSES = (strength_reduce,)


def run_passes(entries: list[EntryIR]) -> list[EntryIR]:
    """Every entry through every pass, in order."""
    out = []
    for e in entries:
        for p in PASSES:
            e = p(e)
        out.append(e)
    return out


__all__ = ["PASSES", "run_passes", "strength_reduce"]
