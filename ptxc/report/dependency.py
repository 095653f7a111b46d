"""The dependency program of a warp's steady path: what ptxc.report.issue_sim needs of each
SASS instruction -- its unit, the registers it writes and reads, and the events a warp waits on."""

from __future__ import annotations

import re

from .sass_instr import DEPBAR_KEEP, Instr, access_bytes, classify, mma_flops, shared_bytes

# Registers are numbered R n -> n, UR n -> 256 + n, P n -> 512 + n,
# UP n -> 520 + n (PT, UPT and RZ are constants).
_OPERAND = re.compile(r"\b(U?R)(\d+)(\.64)?\b|\b(U?P)([0-6])\b")
_REG_BASE = {"R": 0, "UR": 256, "P": 512, "UP": 520}
# opcodes whose first operand is read, not written (stores, branches, barriers, async issue)
_NO_DEST = {"ST", "STS", "STG", "STL", "STSM", "RED", "ATOM", "ATOMS", "BAR", "BRA", "BRX", "JMP",
            "EXIT", "RET", "CALL", "LDGSTS", "LDGDEPBAR", "DEPBAR", "WARPSYNC", "HGMMA", "BSSY",
            "BSYNC", "YIELD", "NOP", "SYNCS", "UTMALDG", "UTMAPF", "UBLKCP", "ARRIVES", "MEMBAR",
            "FENCE", "WARPGROUP", "CCTL", "ERRBAR"}


def _operand_width(i: Instr, position: int) -> int | None:
    """Registers a vector operand spans where the text names only the first: HMMA's fragments
    (D, A, B, C of m16n8k16: 4, 4, 2, 4 with f32 accumulators), a wide load's destination and
    a .WIDE multiply's pair."""
    if i.base == "HMMA":
        acc = 4 if ".F32" in i.opcode else 2
        k16 = ".16816" in i.opcode
        return (acc, 4 if k16 else 2, 2 if k16 else 1, acc)[position] if position < 4 else 1
    if position == 0 and i.base == "LDSM":
        n = i.opcode.rsplit(".", 1)[-1]
        return int(n) if n in ("2", "4") else 1
    if position == 0 and i.base in ("LDS", "LDG", "LD", "LDL"):
        return max(1, access_bytes(i.opcode) // 4)
    if position in (0, 3) and ".WIDE" in i.opcode:   # IMAD.WIDE: a 64-bit result and addend
        return 2
    return None


def _unit(i: Instr) -> str:
    """The issue_sim unit of an instruction (its latency and its pipe)."""
    c = classify(i.opcode)
    if c == "tensor":
        return "hmma" if i.base == "HMMA" else "async"
    if i.base == "F2FP":
        return "pack"
    if c in ("cvt", "mufu", "shfl", "lds", "ldsm", "sts"):
        return c
    if c == "fp32":
        return "half" if i.base.startswith("H") else "fp32"
    if c == "ldg":
        return "ldg_wide" if access_bytes(i.opcode) >= 8 else "ldg_index"
    if c == "int" and not i.base.startswith("U"):
        return "int"
    return "alu"


def dependency_program(path: list[Instr]) -> list[list]:
    """One entry per instruction of a warp's steady path (predicated-off ones dropped):
    [unit, registers written, registers read, shared-memory bytes, mma FLOPs, event], the
    event "" or "bar" (a CTA barrier: BAR.SYNC / BAR.RED), "ldgsts" (joins the open copy
    group), "commit" (LDGDEPBAR), "wait<n>" (DEPBAR.LE SB0, n: until n groups remain)."""
    out = []
    for i in path:
        if i.guard == "@!PT":
            continue
        ops = [o.strip() for o in i.operands.split(",")] if i.operands else []
        written: set[int] = set()
        read: set[int] = set()
        for position, text in enumerate(ops):
            regs: list[int] = []
            for m in _OPERAND.finditer(text):
                if m.group(1):
                    n, base = int(m.group(2)), _REG_BASE[m.group(1)]
                    if n == 255:           # RZ / URZ
                        continue
                    width = _operand_width(i, position) or (2 if m.group(3) else 1)
                    regs += [base + n + k for k in range(width)]
                else:
                    regs.append(_REG_BASE[m.group(4)] + int(m.group(5)))
            if position == 0 and i.base not in _NO_DEST and "[" not in text:
                written.update(regs)
            elif position == 1 and i.base.endswith("SETP"):
                written.update(regs)      # ISETP P0, P1, ...: both predicates are results
            else:
                read.update(regs)
        guard = i.guard.lstrip("@!")
        if guard and guard not in ("PT", "UPT"):
            read.add(_REG_BASE["UP" if guard.startswith("UP") else "P"] + int(guard.lstrip("UP")))
        event = ""
        if i.base == "BAR" and not {"ARV", "ARRIVE"} & set(i.opcode.split(".")):
            event = "bar"
        elif i.base == "LDGSTS":
            event = "ldgsts"
        elif i.base == "LDGDEPBAR":
            event = "commit"
        elif i.base == "DEPBAR" and (m := DEPBAR_KEEP.search(i.operands)):
            event = f"wait{int(m.group(1), 0)}"
        out.append([_unit(i), sorted(written), sorted(read), shared_bytes(i),
                    mma_flops(i) if i.base == "HMMA" else 0, event])
    return out


__all__ = ["dependency_program"]
