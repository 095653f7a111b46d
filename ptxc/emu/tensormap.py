"""The emulator's stand-in for a CUtensorMap (the driver's opaque 128-byte TMA descriptor made
by cuTensorMapEncodeTiled), passed to `launch()` for a `.param .align 64 .b8 map[128]` kernel
parameter.

`TensorMap(array, box, swizzle=0)` describes a tiled view of a numpy array: a C-order array,
or a strided view of one (its innermost axis packed, its other strides positive: e.g. a
transposed head-major tensor) -- the map then holds the view's strides over its base array,
which is placed in emulated global memory like any buffer (once, when the same array is also
a pointer argument: a TMA store and the threads' stores land in one buffer, as on a GPU).
Dimensions are listed innermost first (dimension 0 is the array's last axis), as in the driver
API and in the coordinates of `cp.async.bulk.tensor` ({c0, c1, ...}); `box` is the box size
per dimension (innermost first); `swizzle` is 0, 32, 64 or 128 bytes. Element strides are 1,
there is no interleave, and out-of-bound elements are filled with zeros (the driver's
FLOAT_OOB_FILL_NONE) by loads and not written by stores.

In the kernel's parameter space the 128 bytes are self-describing (this layout is the
emulator's, not the driver's): 0 magic b"PTXCTMAP", 8 u32 rank, 12 u32 element bytes,
16 u64 global address, 24 u32 swizzle bytes, 32 u32 dims[5], 52 u32 box[5], 72 u64 byte
strides of dims 1..4, 104 u64 byte offset of the view in its base array (added to the
address). Any other 128 bytes are refused by the TMA instruction.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ptxc.errors import InputError

MAGIC = b"PTXCTMAP"
NBYTES = 128


@dataclass(frozen=True)
class TensorMap:
    array: np.ndarray
    box: tuple
    swizzle: int = 0

    def struct_arg(self, where: str):
        """-> (128 bytes, {16: array}) for the launch's by-value struct machinery."""
        from ptxc.emu.args import StructArg
        a, box = self.array, tuple(int(b) for b in self.box)
        base, offset = tensor_map_base(a)
        rank = getattr(a, "ndim", 0)
        ok = base is not None and 1 <= rank <= 5 and len(box) == rank and \
            a.dtype.itemsize in (1, 2, 4, 8) and \
            all(1 <= b <= 256 for b in box) and self.swizzle in (0, 32, 64, 128)
        inner = box[0] * a.dtype.itemsize if ok else 0
        if ok and (inner % 16 or (self.swizzle and inner != self.swizzle)):
            ok = False
        if not ok:
            raise InputError(f"{where}: TensorMap needs a 1-5 dimensional C-contiguous array (or "
                             f"a view of one with its innermost axis packed and positive "
                             f"strides), "
                             f"one box size (1..256) per dimension innermost first, swizzle "
                             f"0/32/64/128, and an innermost box of a multiple of 16 bytes "
                             f"(equal to the swizzle width when swizzled); got array "
                             f"{getattr(a, 'shape', None)} {getattr(a, 'dtype', None)}, box "
                             f"{box}, swizzle {self.swizzle}")
        raw = bytearray(NBYTES)
        raw[0:8] = MAGIC
        dims = a.shape[::-1]
        strides = a.strides[::-1]
        raw[8:16] = np.array([rank, a.dtype.itemsize], np.uint32).tobytes()
        raw[24:28] = np.uint32(self.swizzle).tobytes()
        raw[32:52] = np.array(list(dims) + [1] * (5 - rank), np.uint32).tobytes()
        raw[52:72] = np.array(list(box) + [1] * (5 - rank), np.uint32).tobytes()
        raw[72:104] = np.array(list(strides[1:]) + [0] * (5 - rank), np.uint64).tobytes()
        raw[104:112] = np.uint64(offset).tobytes()
        return StructArg(bytes(raw), {16: base})


def tensor_map_base(a):
    """(the C-contiguous array a TensorMap's buffer is, byte offset of `a` in it), or (None, 0)
    when `a` is neither such an array nor a view of one that TMA can describe."""
    if not isinstance(a, np.ndarray) or a.ndim == 0 or a.dtype.hasobject:
        return None, 0
    if a.flags.c_contiguous:
        return a, 0
    base = a.base
    if not isinstance(base, np.ndarray) or not base.flags.c_contiguous or \
            a.strides[-1] != a.itemsize or any(s <= 0 for s in a.strides):
        return None, 0
    offset = a.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    extent = offset + sum((n - 1) * s for n, s in zip(a.shape, a.strides)) + a.itemsize
    if offset < 0 or extent > base.nbytes or 0 in a.shape:
        return None, 0
    return base, offset


def decode_map(raw: bytes):
    """(rank, elem bytes, global address, swizzle, dims, box, byte strides) or None."""
    if len(raw) != NBYTES or raw[:8] != MAGIC:
        return None
    rank, esize = (int(x) for x in np.frombuffer(raw[8:16], np.uint32))
    gaddr = int(np.frombuffer(raw[16:24], np.uint64)[0]) + \
        int(np.frombuffer(raw[104:112], np.uint64)[0])
    swizzle = int(np.frombuffer(raw[24:28], np.uint32)[0])
    dims = [int(x) for x in np.frombuffer(raw[32:52], np.uint32)[:rank]]
    box = [int(x) for x in np.frombuffer(raw[52:72], np.uint32)[:rank]]
    strides = [esize] + [int(x) for x in np.frombuffer(raw[72:104], np.uint64)[:rank - 1]]
    return rank, esize, gaddr, swizzle, dims, box, strides
