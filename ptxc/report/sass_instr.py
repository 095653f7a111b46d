"""One SASS instruction (nvdisasm output) as the loop analysis and the dependency program read it:
the parsed line (`Instr`, `parse_functions`), its class in the report's mix (`classify`), the
bytes it moves (`access_bytes`, `shared_bytes`), its tensor-core FLOPs (`mma_flops`) and what
its shared-memory operands cost beyond them (`operand_stall_flops`), and the registers it names
(`registers`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Instruction classes, in report order: name -> predicate on (base opcode, full opcode).
CLASSES = ("tensor", "umma", "ldsm", "ldgsts", "ldg", "stg", "lds", "sts", "tmem", "mufu", "fp32",
           "cvt", "shfl", "bar", "int", "move", "control", "other")
_TENSOR = {"HMMA", "QMMA", "HGMMA", "IMMA", "DMMA", "QGMMA", "IGMMA", "BMMA"}
_FP = {"FADD", "FMUL", "FFMA", "FMNMX", "FSEL", "FSETP", "FSET", "FCHK", "FSWZADD", "HADD2",
       "HMUL2", "HFMA2", "HMNMX2", "HSET2", "HSETP2", "FMUL2", "FADD2", "FFMA2"}
_CVT = {"F2F", "F2I", "I2F", "F2FP", "I2FP", "F2IP", "FRND", "I2I", "I2IP"}
_BAR = {"BAR", "DEPBAR", "LDGDEPBAR", "WARPSYNC", "MEMBAR", "SYNCS", "ARRIVES", "ERRBAR", "CCTL",
        "UTCBAR",
        "WARPGROUP", "FENCE"}
_INT = {"IADD3", "IADD", "IMAD", "LEA", "LOP3", "LOP", "SHF", "ISETP", "IMNMX", "IABS", "POPC",
        "FLO", "BFE", "BFI", "PRMT", "SEL", "PLOP3", "P2R", "R2P", "VIADD", "VIMNMX", "IDP",
        "BREV", "BMSK", "SGXT", "ISCADD", "XMAD", "LEA.HI", "IMUL", "FSETP.INT", "VIADDMNMX"}
_MOVE = {"MOV", "MOV32I", "CS2R", "S2R", "S2UR", "R2UR", "LDC", "ULDC", "UMOV", "SHFL.IDX.MOVE"}
_CONTROL = {"BRA", "BRX", "JMP", "BSSY", "BSYNC", "EXIT", "CALL", "RET", "NOP", "YIELD", "BPT",
            "BMOV", "KILL", "ELECT", "VOTE", "VOTEU", "NANOSLEEP", "USETMAXREG"}
GLOBAL_LOADS = {"LDG", "LD"}
# Bulk-copy issue (TMA boxes, bulk copies, their prefetches): the instruction that feeds a tile
# whose bytes are not in the SASS (the box lives in the tensor map). It is tile work wherever it
# stands, so a region holding one is never a table refill and the steady path keeps it.
# Blackwell's tcgen05.mma (UTC*MMA, class "umma") is issued the same way, by one thread for the
# CTA, with its shape in an instruction-descriptor register: no FLOPs from the SASS (the report
# takes them from the launch's tile, loop_model.with_umma_flops), and issue work like a box.
_UMMA = {"UTCHMMA", "UTCQMMA", "UTCIMMA", "UTCOMMA", "UTCMMA"}
BULK_ISSUE = {"UTMALDG", "UBLKCP", "UTMAPF", "UBLKPF"} | _UMMA
_GLOBAL_STORES = {"STG", "ST", "RED", "ATOMG", "ATOM"}

_LABEL = re.compile(r"^\s*(\.L_x_\d+|\.L_\w+):")
# (opcode parts may hold a lower-case shape: HGMMA.64x128x16.F32)
_LINE = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_][A-Za-z0-9_]*)*)"
                   r"\s*([^;]*);")
_SECTION = re.compile(r"^\s*\.section\s+\.text\.([\w$]+)")
REGISTER = re.compile(r"\bR(\d+)(\.64)?\b")
DEPBAR_KEEP = re.compile(r"SB0\s*,\s*(0x[0-9a-f]+|\d+)")
_GMMA_SHAPE = re.compile(r"\.(\d+)x(\d+)x(\d+)")
# One warp's mma.m16n8k16 (HMMA.16816): the unit "instructions per HMMA-equivalent" counts in,
# so a warp's quarter of an HGMMA.64xNx16 is N/8 of them (64*N*16 / (16*8*16) per warpgroup).
HMMA_16816_FLOPS = 2 * 16 * 8 * 16


@dataclass(frozen=True)
class Instr:
    addr: int
    guard: str          # "" or "@P0", "@!PT", ...
    opcode: str         # full: "LDG.E.128"
    operands: str       # text between the opcode and ';'
    # the opcode without modifiers ("LDG"), made once: the analyses ask it of every instruction
    base: str = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "base", self.opcode.split(".")[0])


def parse_functions(text: str) -> dict[str, tuple[list[Instr], dict[str, int]]]:
    """Per function of `nvdisasm -c` output: its instructions and label -> address."""
    out: dict[str, tuple[list[Instr], dict[str, int]]] = {}
    instrs: list[Instr] | None = None
    labels: dict[str, int] = {}
    pending: list[str] = []
    for line in text.splitlines():
        if m := _SECTION.match(line):
            instrs, labels, pending = [], {}, []
            out[m.group(1)] = (instrs, labels)
        elif instrs is None:
            continue
        elif m := _LABEL.match(line):
            pending.append(m.group(1))
        elif m := _LINE.match(line):
            addr = int(m.group(1), 16)
            for name in pending:
                labels[name] = addr
            pending = []
            instrs.append(Instr(addr, (m.group(2) or "").strip(), m.group(3), m.group(4).strip()))
    return out


def classify(opcode: str) -> str:
    parts = opcode.split(".")
    base = parts[0]
    if base in _TENSOR:
        return "tensor"
    if base in _UMMA:
        return "umma"
    if base in ("LDTM", "STTM"):
        return "tmem"     # tcgen05.ld / st: tensor memory <-> registers
    if base in ("LDSM", "LDGSTS", "LDS", "STS", "MUFU", "SHFL"):
        return base.lower()
    if base == "STSM":
        return "sts"    # sm_90 stmatrix: a store to shared memory
    if base in GLOBAL_LOADS:
        return "ldg"
    if base in _GLOBAL_STORES:
        return "stg"
    if base == "IMAD" and len(parts) > 1 and parts[1] == "MOV":
        return "move"   # ptxas's register move on the integer pipe
    if base in _MOVE:
        return "move"
    if base in _FP:
        return "fp32"
    if base in _CVT:
        return "cvt"
    if base in _BAR:
        return "bar"
    if base in _CONTROL:
        return "control"
    if base in _INT or (base.startswith("U") and base[1:] in _INT):
        return "int"
    if base.startswith("U") and base[1:] in _MOVE:
        return "move"
    return "other"


def access_bytes(opcode: str) -> int:
    """Bytes per lane of a memory instruction, from its width suffix (32-bit when none)."""
    sizes = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}
    for part in reversed(opcode.split(".")[1:]):
        if part in sizes:
            return sizes[part]
    return 4


def shared_bytes(instr: Instr) -> int:
    """Bytes one warp's instruction moves through the shared-memory pipe (128 B per clock per
    SM): LDS/STS/STSM and the landing of an LDGSTS by width x 32 lanes, LDSM by its matrix
    count (.x1/.x2/.x4: 128/256/512 B)."""
    if instr.base == "LDSM":
        n = instr.opcode.rsplit(".", 1)[-1]
        return 128 * (int(n) if n in ("2", "4") else 1)
    if instr.base in ("LDS", "STS", "LDGSTS"):
        return access_bytes(instr.opcode) * 32
    if instr.base == "STSM":
        n = instr.opcode.rsplit(".", 1)[-1]
        return 128 * (int(n) if n in ("2", "4") else 1)
    return 0


def empty_group(instr: Instr) -> bool:
    """The placeholder ptxas issues for a wgmma commit group holding no wgmma (`HGMMA.64x8x16
    RZ, gdesc[URZ], RZ, !UPT, gsb0`: a loop's first tile, which has no P·V yet): no math."""
    return instr.base.endswith("GMMA") and instr.operands.startswith("RZ,")


def mma_flops(instr: Instr) -> int:
    """FLOPs of one warp's tensor-core instruction (HGMMA: a quarter of the warpgroup's), in
    16-bit-equivalent FLOPs -- the unit of the tensor term, which divides by the 16-bit peak:
    QGMMA over 8-bit inputs (E4M3 / E5M2) runs at twice that rate, so it counts half; so does
    QMMA.16832 (mma.m16n8k32 over FP8 on sm_89 / sm_120: one HMMA.16816's time). An empty
    group's placeholder counts none."""
    op = instr.opcode
    if empty_group(instr):
        return 0
    if instr.base == "QMMA" and ".16832" in op:
        return 2 * 16 * 8 * 32 // 2
    if instr.base == "HMMA":
        if ".16816" in op:
            return HMMA_16816_FLOPS
        if ".1688" in op:
            return 2 * 16 * 8 * 8
        if ".884" in op:
            return 2 * 8 * 8 * 4
    if m := _GMMA_SHAPE.search(op):
        mm, n, k = map(int, m.groups())
        narrow = instr.base == "QGMMA" and (".E4M3" in op or ".E5M2" in op)
        return 2 * mm * n * k // (8 if narrow else 4)
    return 0


# A Hopper SM's dense 16-bit tensor rate over its shared-memory bandwidth: 4096 FLOPs and 128
# bytes a clock (989 TFLOP/s over 132 SMs at 1.83 GHz; 33 TB/s of L1 over the same)
TENSOR_FLOPS_PER_SHARED_BYTE = 4096 // 128


def wgmma_operand_bytes(instr: Instr) -> int:
    """Shared-memory bytes one warp's share (a quarter) of a wgmma reads through descriptors:
    B (N x K) always, A (M x K) too in the SS form (`Rd, gdesc[UR], Rc`: one descriptor pair
    names both), not in the RS form (`Rd, Ra, gdesc[UR], Rc`: A from registers). Element size
    from the input type (E4M3 / E5M2 / S8 / U8: 1 byte, TF32: 4, else 2)."""
    if not instr.base.endswith("GMMA") or empty_group(instr):
        return 0
    m = _GMMA_SHAPE.search(instr.opcode)
    if not m:
        return 0
    mm, n, k = map(int, m.groups())
    parts = instr.opcode.split(".")
    size = 1 if {"E4M3", "E5M2", "S8", "U8"} & set(parts) else 4 if "TF32" in parts else 2
    operands = instr.operands.split(",")
    ss = len(operands) > 1 and operands[1].strip().startswith("gdesc")
    return ((mm * k if ss else 0) + n * k) * size // 4


def operand_stall_flops(instr: Instr) -> int:
    """The FLOPs of tensor time a wgmma costs beyond its own because its shared-memory operands
    take longer to stream than its math (`TENSOR_FLOPS_PER_SHARED_BYTE`): an SS m64nNk16 reads
    (64 + N) x 32 bytes for 2048 N FLOPs, so below N = 64 the operands pace it -- at N = 32
    1.5x its FLOPs (the S = Q.K^T of block_n 32 tiles), at N = 16 2.5x. RS forms never stall."""
    return max(0, wgmma_operand_bytes(instr) * TENSOR_FLOPS_PER_SHARED_BYTE - mma_flops(instr))


def registers(operands: str) -> set[int]:
    out: set[int] = set()
    for m in REGISTER.finditer(operands):
        n = int(m.group(1))
        out.update((n, n + 1) if m.group(2) else (n,))
    return out


__all__ = ["BULK_ISSUE", "CLASSES", "DEPBAR_KEEP", "GLOBAL_LOADS", "HMMA_16816_FLOPS", "Instr", "REGISTER",
           "TENSOR_FLOPS_PER_SHARED_BYTE", "access_bytes", "classify", "mma_flops", "operand_stall_flops",
           "parse_functions", "registers", "shared_bytes", "wgmma_operand_bytes"]
