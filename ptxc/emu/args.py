"""Launch argument kinds that lower modules build too: `StructArg` (a by-value struct), used by
`launch` to pack parameters and by `tensormap.TensorMap.struct_arg` (here, below both, so that
neither imports the other back)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StructArg:
    """A by-value struct parameter (`.param .align N .b8 name[size]`, how nvcc passes a C++
    struct). `data`: the struct's bytes -- `bytes`, or a numpy structured scalar / 0-d array
    (build its dtype with `align=True` to get C layout). `buffers`: {byte offset or field name:
    ndarray}; each array is placed in global memory like a buffer argument (and copied back
    after the launch), and its device address is written as a u64 at that offset of the struct.
    Plain `bytes` or a structured scalar may be passed directly when the struct holds no
    pointers."""

    data: object
    buffers: object = ()

    def __post_init__(self):
        items = self.buffers.items() if isinstance(self.buffers, dict) else self.buffers
        object.__setattr__(self, "buffers", tuple(items))
