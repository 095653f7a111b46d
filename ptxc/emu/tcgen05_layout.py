"""Blackwell tcgen05 operand layouts: the shared-memory matrix descriptor, the instruction
descriptor of `kind::f16` / `kind::tf32`, tensor-memory addresses and the data-path layouts of
tcgen05.ld / tcgen05.st (PTX ISA, "TensorCore 5th Generation Family Instructions": "Shared
Memory Descriptor", "Instruction descriptor", "Tensor Memory Addressing", "Matrix fragments").

Shared-memory descriptor (64 bits): [13:0] start address >> 4, [29:16] leading dimension byte
offset >> 4, [45:32] stride dimension byte offset >> 4, [48:46] the fixed constant 0b001
(version), [51:49] matrix base offset, [52] leading-dimension stride mode (0: relative),
[63:61] swizzle mode (0 none, 1 128-byte with 32-byte atoms, 2 128-byte, 4 64-byte, 6 32-byte).
The canonical layouts the fields describe are Hopper's (`wgmma_layout.chunk_coefficients`), so
the operand read is shared with wgmma; the version field, a base offset, the absolute stride
mode and the 32-byte-atom swizzle are refused.

Instruction descriptor (32 bits, kind::f16 / kind::tf32): [1:0] sparsity selector, [2]
sparsity, [3] saturate, [5:4] D format (0 f16, 1 f32), [9:7] A format and [12:10] B format (0
f16, 1 bf16 for kind::f16; 2 tf32 for kind::tf32), [13] negate A, [14] negate B, [15] A major,
[16] B major (0 K-major, 1 MN-major), [22:17] N >> 3, [28:24] M >> 4, [31:30] max shift (.ws).

Tensor memory: per CTA 128 lanes x 512 columns of 32-bit cells; an address is lane << 16 |
column. A warp reaches the 32 lanes of its sub-partition, 32 * (warp id % 4) onwards. With
cta_group::1, row i of D (and of an A taken from tensor memory) is lane i for M = 128 (data
path layout D) and lane 32 * (i // 16) + i % 16 for M = 64 (layout F: the first half of each
sub-partition); D's f32 element (i, j) is column j; A's 16-bit elements (i, 2c) and (i, 2c + 1)
share column c, low half first (a tf32 element takes a column of its own).
"""

from __future__ import annotations

import numpy as np

from ptxc.emu.wgmma_layout import Descriptor

LANES, COLUMNS = 128, 512
SWIZZLE_MODES = {0: 0, 2: 128, 4: 64, 6: 32}        # layout type -> swizzle width in bytes
_A_FORMATS = {"f16": {0: "f16", 1: "bf16"}, "tf32": {2: "tf32"}}


class SmemDescriptor(Descriptor):
    """The decoded fields of one tcgen05 shared-memory descriptor (byte quantities): wgmma's
    start, LBO, SBO and base offset, its own swizzle field, and `problem`, so operand reads
    take either kind."""

    __slots__ = ("problem",)

    def __init__(self, value: int):
        super().__init__(value)
        value = int(value) & 0xFFFF_FFFF_FFFF_FFFF
        layout = (value >> 61) & 0x7
        self.swizzle = SWIZZLE_MODES.get(layout, 0)
        version, lbo_mode = (value >> 46) & 0x7, (value >> 52) & 1
        self.problem = (
            f"version field {version} (bits 46-48 must hold 0b001)" if version != 1 else
            f"swizzle mode {layout} (supported: 0 none, 2 128B, 4 64B, 6 32B)"
            if layout not in SWIZZLE_MODES else
            "the absolute leading-dimension stride mode (bit 52)" if lbo_mode else
            f"a non-zero matrix base offset {self.base_offset}" if self.base_offset else None)

    def __repr__(self):
        return (f"SmemDescriptor(start=0x{self.start:x}, lbo={self.lbo}, sbo={self.sbo}, "
                f"swizzle={self.swizzle or 'none'})")


def encode_smem_descriptor(start: int, lbo: int, sbo: int, swizzle: int = 0) -> int:
    """The inverse of SmemDescriptor (swizzle: 0/32/64/128 bytes); for tests."""
    layout = {0: 0, 128: 2, 64: 4, 32: 6}[swizzle]
    return (((start >> 4) & 0x3FFF) | (((lbo >> 4) & 0x3FFF) << 16) |
            (((sbo >> 4) & 0x3FFF) << 32) | (1 << 46) | (layout << 61))


class InstrDescriptor:
    """kind::f16 / kind::tf32 instruction descriptor fields; `problem` names the first field
    the emulator does not model (None when it is supported)."""

    __slots__ = ("m", "n", "a_type", "b_type", "d_f32", "neg_a", "neg_b", "a_mn_major",
                 "b_mn_major", "problem")

    def __init__(self, value: int, kind: str):
        v = int(value) & 0xFFFF_FFFF
        field = lambda lo, bits: (v >> lo) & ((1 << bits) - 1)  # noqa: E731
        self.m, self.n = field(24, 5) << 4, field(17, 6) << 3
        formats = _A_FORMATS[kind]
        self.a_type, self.b_type = formats.get(field(7, 3)), formats.get(field(10, 3))
        self.d_f32 = field(4, 2) == 1
        self.neg_a, self.neg_b = bool(field(13, 1)), bool(field(14, 1))
        self.a_mn_major, self.b_mn_major = bool(field(15, 1)), bool(field(16, 1))
        step = 16 if self.m == 128 else 8
        n_ok = step <= self.n <= 256 and self.n % step == 0
        self.problem = (
            "sparsity (bit 2)" if field(2, 1) else
            "saturation (bit 3)" if field(3, 1) else
            f"D format {field(4, 2)} (supported: 1, f32)" if not self.d_f32 else
            f"A/B formats {field(7, 3)}/{field(10, 3)} (kind::{kind} supports "
            f"{', '.join(f'{k} {t}' for k, t in formats.items())}, A and B alike)"
            if self.a_type is None or self.a_type != self.b_type else
            f"M = {self.m} (supported with cta_group::1: 64, 128)" if self.m not in (64, 128)
            else f"N = {self.n} (M = {self.m} needs N = {step}, {2 * step}, ..., 256)"
            if not n_ok else
            "a max shift (bits 30-31, .ws only)" if field(30, 2) else None)


def encode_instr_descriptor(m: int, n: int, ab: str = "f16", a_mn_major: bool = False,
                            b_mn_major: bool = False) -> int:
    """A kind::f16 (ab f16/bf16) or kind::tf32 (ab tf32) descriptor with an f32 D; for tests."""
    code = {"f16": 0, "bf16": 1, "tf32": 2}[ab]
    return ((1 << 4) | (code << 7) | (code << 10) | (int(a_mn_major) << 15) |
            (int(b_mn_major) << 16) | ((n >> 3) << 17) | ((m >> 4) << 24))


def row_lanes(m: int):
    """The tensor-memory lane of each row of an M-row D or A (cta_group::1)."""
    i = np.arange(m)
    return i if m == 128 else 32 * (i // 16) + i % 16


def split_address(taddr):
    """(lane, column) of tensor-memory addresses."""
    taddr = np.asarray(taddr, np.int64) & 0xFFFF_FFFF
    return taddr >> 16, taddr & 0xFFFF


# tcgen05.ld / tcgen05.st shapes (PTX ISA "Matrix fragments for tcgen05.ld/st"): per
# repetition the columns it spans, the lanes it covers, and for register r of warp lane t its
# (lane offset, column offset). 16x32bx2: lanes 0-15 take lanes 0-15 at the address, lanes
# 16-31 the same lanes `half_offset` columns further (the instruction's immediate).
def _shape(span, lanes, regs, lane_of, col_of):
    t, r = np.arange(32)[:, None], np.arange(regs)[None, :]
    return span, lanes, lane_of(t, r) + 0 * r, col_of(t, r) + 0 * t


LD_SHAPES = {
    "32x32b": _shape(1, 32, 1, lambda t, r: t, lambda t, r: 0 * r),
    "16x64b": _shape(2, 16, 1, lambda t, r: (t >> 2) + 8 * (t & 1), lambda t, r: (t >> 1) & 1),
    "16x128b": _shape(4, 16, 2, lambda t, r: (t >> 2) + 8 * (r & 1),
                      lambda t, r: (t & 3) + 0 * r),
    "16x256b": _shape(8, 16, 4, lambda t, r: (t >> 2) + 8 * ((r >> 1) & 1),
                      lambda t, r: (r & 1) + 2 * (t & 3)),
    "16x32bx2": _shape(1, 16, 1, lambda t, r: t & 15, lambda t, r: 0 * r),
}


def fragment_cells(shape: str, reps: int, half_offset: int = 0):
    """(lane offset, column offset) of every register of every lane, each (32, regs): the
    shape's per-repetition pattern repeated `reps` times along the columns."""
    span, _, lanes, cols = LD_SHAPES[shape]
    k = lanes.shape[1]
    lane = np.tile(lanes, (1, reps))
    col = np.tile(cols, (1, reps)) + span * np.repeat(np.arange(reps), k)[None, :]
    if shape == "16x32bx2":
        col = col + half_offset * (np.arange(32)[:, None] >> 4)
    return lane, col
