"""Hopper wgmma operand layouts: the 64-bit shared-memory matrix descriptor and the register
fragments of wgmma.mma_async.m64nNk16 (PTX ISA, "Asynchronous Warpgroup Level Matrix
Multiply-Accumulate": "Matrix Descriptor Format", "Shared Memory Matrix Layout", "Register
Fragments").

Descriptor bits: [13:0] start address >> 4, [29:16] leading dimension byte offset (LBO) >> 4,
[45:32] stride dimension byte offset (SBO) >> 4, [51:49] matrix base offset, [63:62] swizzle
mode (0 none, 1 128B, 2 64B, 3 32B). Addresses are shared-window addresses.

An operand is an R x 16 matrix X[r, k] of 16-bit elements (A: R = 64 rows m; B: R = N columns
n, so D = A @ X_B^T) built from 16-byte chunks of 8 consecutive elements -- or, for 8-bit
types (k32, K-major only), R x 32 one-byte elements in the same chunks of 16 consecutive k:
the byte layout is the same, so the offsets below serve both. K-major (transpose
flag 0): a chunk holds 8 consecutive k of one r; MN-major (flag 1): 8 consecutive r of one k.
Chunk offsets from the start address (W = swizzle width in bytes):

  K-major,  no swizzle: (r//8)*SBO + (r%8)*16 + (k//8)*LBO
  K-major,  swizzle W : (r//8)*SBO + (r%8)*W  + (k//8)*16          (LBO unused)
  MN-major, no swizzle: (r//8)*SBO + (k%8)*16 + (k//8)*LBO
  MN-major, swizzle W : (r//8 % (W/16))*16 + (r//8 // (W/16))*LBO + (k%8)*W + (k//8)*SBO

A swizzle permutes the 16-byte chunks inside each W-byte row by XOR-ing address bits [4, 4+b)
with bits [7, 7+b) (b = 1, 2, 3 for 32/64/128B): the pattern is a function of the absolute
shared address, repeating every 8 x W bytes. A non-zero matrix base offset (for patterns whose
repeat does not start at an aligned address) is refused as unsupported.
"""

from __future__ import annotations

import numpy as np

SWIZZLE_BYTES = {0: 0, 1: 128, 2: 64, 3: 32}       # descriptor mode -> swizzle width
_XOR_MASK = {0: 0, 32: 0x10, 64: 0x30, 128: 0x70}   # address bits [4, 4+b) after >> 3


class Descriptor:
    """The decoded fields of one descriptor value (all byte quantities)."""

    __slots__ = ("start", "lbo", "sbo", "base_offset", "swizzle")

    def __init__(self, value: int):
        value = int(value) & 0xFFFF_FFFF_FFFF_FFFF
        self.start = (value & 0x3FFF) << 4
        self.lbo = ((value >> 16) & 0x3FFF) << 4
        self.sbo = ((value >> 32) & 0x3FFF) << 4
        self.base_offset = (value >> 49) & 0x7
        self.swizzle = SWIZZLE_BYTES[(value >> 62) & 0x3]

    def __repr__(self):
        return (f"Descriptor(start=0x{self.start:x}, lbo={self.lbo}, sbo={self.sbo}, "
                f"base_offset={self.base_offset}, swizzle={self.swizzle or 'none'})")


def encode_descriptor(start: int, lbo: int, sbo: int, swizzle: int = 0,
                      base_offset: int = 0) -> int:
    """The inverse of Descriptor (swizzle: 0/32/64/128 bytes); for tests and kernels."""
    mode = {0: 0, 128: 1, 64: 2, 32: 3}[swizzle]
    return (((start >> 4) & 0x3FFF) | (((lbo >> 4) & 0x3FFF) << 16) |
            (((sbo >> 4) & 0x3FFF) << 32) | ((base_offset & 7) << 49) | (mode << 62))


def chunk_coefficients(rows: int, mn_major: bool, swizzle: int):
    """Per chunk (c0, c_lbo, c_sbo) with offset = c0 + c_lbo*LBO + c_sbo*SBO, and the chunk's
    element coordinates (r, k) of shape (nchunks, 8). Chunks are ordered (r//8, ...) so that
    a chunk list reshapes to the matrix."""
    if not mn_major:                       # chunks (r, kc): 8 consecutive k
        r, kc = np.meshgrid(np.arange(rows), np.arange(2), indexing="ij")
        r, kc = r.reshape(-1), kc.reshape(-1)
        if swizzle:
            c0, cl, cs = (r % 8) * swizzle + kc * 16, np.zeros_like(r), r // 8
        else:
            c0, cl, cs = (r % 8) * 16, kc, r // 8
        er = np.repeat(r[:, None], 8, axis=1)
        ek = kc[:, None] * 8 + np.arange(8)[None, :]
    else:                                  # chunks (rg, k): 8 consecutive r
        rg, k = np.meshgrid(np.arange(rows // 8), np.arange(16), indexing="ij")
        rg, k = rg.reshape(-1), k.reshape(-1)
        if swizzle:
            per = swizzle // 16
            c0 = (rg % per) * 16 + (k % 8) * swizzle
            cl, cs = rg // per, k // 8
        else:
            c0, cl, cs = (k % 8) * 16, k // 8, rg
        er = rg[:, None] * 8 + np.arange(8)[None, :]
        ek = np.repeat(k[:, None], 8, axis=1)
    return (c0.astype(np.int64), cl.astype(np.int64), cs.astype(np.int64),
            er.astype(np.int64), ek.astype(np.int64))


def swizzle_address(addr, swizzle: int):
    """Apply a W-byte swizzle to shared addresses (numpy int64)."""
    mask = _XOR_MASK[swizzle]
    return addr ^ ((addr >> 3) & mask) if mask else addr


def accumulator_map(n: int):
    """(row, col) in the 64 x n accumulator of register i of a thread, for (lin % 128, i):
    warp w of the warpgroup holds rows 16w..16w+15 laid out like mma.m16n8 C fragments,
    one n8 block per 4 registers."""
    lin = np.arange(128)
    w, g, t = lin >> 5, (lin & 31) >> 2, lin & 3
    i = np.arange(n // 2)
    j, q = i >> 2, i & 3
    row = 16 * w[:, None] + g[:, None] + 8 * (q[None, :] >> 1)
    col = 8 * j[None, :] + 2 * t[:, None] + (q[None, :] & 1)
    return row, col


def a_register_map(narrow: bool = False):
    """(row, col) in the 64 x K A matrix of element e of each thread (lin % 128), per warp 16
    rows: 16-bit (K 16) e = 0..7, register e//2, low half first -- the mma.m16n8k16 A
    fragment; 8-bit (K 32) e = 0..15, register e//4, lowest byte first -- mma.m16n8k32's:
    registers 0..3 hold rows g, g + 8, g, g + 8 at columns 4t.. and 16 + 4t.. ."""
    lin = np.arange(128)
    w, g, t = lin >> 5, (lin & 31) >> 2, lin & 3
    per = 4 if narrow else 2                  # elements a register
    e = np.arange(4 * per)
    row = 16 * w[:, None] + g[:, None] + 8 * ((e[None, :] // per) & 1)
    col = per * t[:, None] + (e[None, :] % per) + 4 * per * (e[None, :] // (2 * per))
    return row, col
