"""Tensor maps (TMA descriptors) for launch parameters of kind "tensor_map" (docs/metadata.md).

The metadata names the tensor, the box (innermost first) and the swizzle; the launcher encodes
the rest from the tensor itself, the same way in every backend and loader:

  dims           the tensor's shape reversed (innermost first)
  global strides the byte strides of dims 1.. (dim 0 is the packed innermost axis)
  element strides 1; interleave none; L2 promotion 128 B; out-of-bound fill none (zeros)
  data type      f16 -> FLOAT16, bf16 -> BFLOAT16, f32 -> FLOAT32 (others: the unsigned type
                 of their width)

`encode_tensor_map` is that derivation as a pure function (the cuda backend hands its result to
cuTensorMapEncodeTiled; tests check it without a GPU); `emu_tensor_map` builds the emulator's
`ptxc.emu.TensorMap` for the same parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InputError
from ..pipeline.metadata import ELEMENT_BYTES

DATA_TYPES = {"f16": "FLOAT16", "bf16": "BFLOAT16", "f32": "FLOAT32", "i32": "INT32", "i64": "INT64",
              "u64": "UINT64", "e4m3": "UINT8", "e5m2": "UINT8", "u8": "UINT8"}
SWIZZLES = {0: "NONE", 32: "32B", 64: "64B", 128: "128B"}
MAX_DIM = 1 << 32          # globalDim[i] <= 2^32
MAX_STRIDE = 1 << 40       # globalStrides[i] < 2^40
ALIGN = 16                 # global address and strides: multiples of 16 bytes


@dataclass(frozen=True)
class TensorMapEncoding:
    """The arguments of cuTensorMapEncodeTiled (enum names without their CU_TENSOR_MAP_ prefix
    group, e.g. data_type "FLOAT16" is CU_TENSOR_MAP_DATA_TYPE_FLOAT16)."""

    data_type: str
    rank: int
    address: int
    dims: tuple[int, ...]             # innermost first
    strides: tuple[int, ...]          # bytes, dims 1 .. rank-1
    box: tuple[int, ...]
    element_strides: tuple[int, ...]
    interleave: str = "NONE"
    swizzle: str = "NONE"
    l2_promotion: str = "L2_128B"
    oob_fill: str = "NONE"


def encode_tensor_map(where: str, dtype: str, shape, byte_strides, address: int, box,
                      swizzle: int) -> TensorMapEncoding:
    """The encoding of a tensor-map parameter over a tensor of `dtype` with `shape` and
    `byte_strides` (outermost first, as numpy) at `address`; InputError (one line) when TMA
    cannot describe it. A dim of size 0 is encoded as 1 (the driver refuses 0; a kernel visits
    no tile of an empty sequence), and the stride of a dim of size <= 1 as the packed one (it
    is never stepped)."""
    import numpy as np
    shape, byte_strides, box = list(shape), list(byte_strides), [int(x) for x in box]
    rank, esize = len(shape), ELEMENT_BYTES[dtype]
    if not 1 <= rank <= 5 or len(box) != rank:
        raise InputError(f"{where}: a tensor map needs 1-5 dims and one box size per dim; got "
                         f"shape {shape}, box {box}")
    if swizzle not in SWIZZLES or any(not 1 <= x <= 256 for x in box) or \
            (box[0] * esize) % ALIGN or (swizzle and box[0] * esize > swizzle):
        raise InputError(f"{where}: box {box} with swizzle {swizzle}: boxes are 1..256 per dim, "
                         f"the innermost a multiple of 16 bytes and at most the swizzle width")
    if address % ALIGN:
        raise InputError(f"{where}: address {address:#x} is not 16-byte aligned (TMA)")
    if 0 in shape:             # an empty tensor: numpy's strides are arbitrary, none is stepped
        shape = [x if x else 1 for x in shape]
        byte_strides = [esize * int(np.prod(shape[a + 1:])) for a in range(rank)]
    if shape[-1] > 1 and byte_strides[-1] != esize:
        raise InputError(f"{where}: the innermost axis must be packed (stride {esize} bytes), "
                         f"got {byte_strides[-1]}")
    dims = tuple(int(x) for x in reversed(shape))
    packed, strides = esize, []
    for axis in range(rank - 2, -1, -1):          # dims 1.. innermost first
        packed *= dims[rank - 2 - axis]
        stride = int(byte_strides[axis]) if shape[axis] > 1 else packed
        if stride % ALIGN or not 0 < stride < MAX_STRIDE:
            raise InputError(f"{where}: byte stride {stride} along axis {axis} is not a positive "
                             f"multiple of 16 below 2^40 (TMA)")
        strides.append(stride)
        packed = stride
    if any(x > MAX_DIM for x in dims):
        raise InputError(f"{where}: shape {shape} has a dim above 2^32 (TMA)")
    return TensorMapEncoding(DATA_TYPES[dtype], rank, int(address), dims, tuple(strides),
                             tuple(box), (1,) * rank, swizzle=SWIZZLES[swizzle])


def emu_tensor_map(meta: dict):
    """-> tensor_map(name, array, source) for pack_args on the emulator: checks the encoding
    (address 0: the emulator places the array itself) and passes a ptxc.emu.TensorMap of the
    array -- a C-ordered array or a strided view of one (a TMA store writes into it, and into
    the same buffer as the threads when the array is a pointer argument too); another layout
    gets a C-ordered copy, which only a load may be given."""
    import numpy as np

    from .. import emu

    def tensor_map(name: str, arr, source: dict):
        where = f"{meta['name']}: tensor map of {name}"
        encode_tensor_map(where, meta["tensors"][name]["dtype"], arr.shape, arr.strides, 0,
                          source["box"], source["swizzle"])
        view = arr if emu.tensormap.tensor_map_base(arr)[0] is not None else np.ascontiguousarray(arr)
        return emu.TensorMap(view, tuple(source["box"]), source["swizzle"])
    return tensor_map
