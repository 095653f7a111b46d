"""The address and stride preconditions of an artifact's tensors (metadata `preconditions`),
checked before a launch: the kernels move rows with 16-byte vector loads and cp.async, so a
misaligned base or stride would fault (or, worse, read the wrong bytes) on the GPU."""

from __future__ import annotations

from ..errors import InputError
from ..pipeline import exprs


def packed_strides(shape: list[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return strides[::-1]


def tensor_shape(info: dict, dims: dict[str, int]) -> list[int]:
    return [s if isinstance(s, int) else exprs.evaluate(s, dims) for s in info["shape"]]


def check_tensor(meta: dict, name: str, address: int, strides: list[int], shape: list[int]) -> None:
    """Raise InputError (one line) when `address`/`strides` (in elements) break `name`'s rules."""
    info = meta["tensors"][name]
    rules = info.get("preconditions")
    if rules is None:  # metadata written before preconditions were recorded
        return
    where = f"{meta['name']}: tensor {name}"
    if not address:
        raise InputError(f"{where}: null device address")
    if address % rules["align_bytes"]:
        raise InputError(f"{where}: address {address:#x} is not {rules['align_bytes']}-byte aligned "
                         f"(the kernels use {rules['align_bytes']}-byte accesses)")
    packed = packed_strides(shape)
    for axis, (got, want) in enumerate(zip(strides, packed)):
        if shape[axis] <= 1:
            continue  # a stride over a single index is never used
        if axis in rules["strided_axes"]:
            if got % rules["stride_multiple"]:
                raise InputError(f"{where}: stride {got} along axis {axis} is not a multiple of "
                                 f"{rules['stride_multiple']} elements")
        elif got != want:
            raise InputError(f"{where}: stride {got} along axis {axis} must be {want} (packed; "
                             f"only axes {rules['strided_axes']} may be strided)")


def check_buffers(meta: dict, buffers: dict, dims: dict[str, int], address) -> None:
    """Check every buffer of a launch list; `address(name, array)` gives its base address."""
    for name, arr in buffers.items():
        if arr.size:
            check_tensor(meta, name, int(address(name, arr)),
                         [s // arr.itemsize for s in arr.strides], tensor_shape(meta["tensors"][name], dims))
