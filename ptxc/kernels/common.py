"""Building blocks shared by the kernel families: element formats, 128-bit row loads and stores,
warp reductions. (The online softmax is attention/softmax.py.)

Softmax runs in base 2: scores are pre-multiplied by scale * log2(e) so every exponential is one
`ex2.approx`; LSE converts back with ln(2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from ..errors import SpecError
from .base import LaunchParam
from ..ir import B32, F16X2, BF16X2, F32, S64, U32, U64, Addr, KernelBuilder, Reg

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
NEG_INF = float("-inf")
POS_INF = float("inf")   # split-KV: the mark of a row split 0 finished whole (split_reduce)
VEC_BYTES = 16  # one 128-bit load/store


@dataclass(frozen=True)
class ElemFormat:
    """How one dtype travels through registers: 16-byte vectors of `per_vec` elements."""

    name: str
    bytes: int

    @property
    def per_vec(self) -> int:
        return VEC_BYTES // self.bytes

    @property
    def load_type(self):
        return F32 if self.name == "f32" else B32   # halves stay packed two per b32 register


FORMATS = {"f32": ElemFormat("f32", 4), "f16": ElemFormat("f16", 2), "bf16": ElemFormat("bf16", 2)}


def check_dtype_target(dtype: str, targets) -> None:
    from ..targets import TARGETS
    for t in targets:
        if dtype == "bf16" and not TARGETS[t].has_bf16:
            raise SpecError(f"dtype bf16 needs sm_80 or newer, but targets include {t}; "
                            f"use f16/f32 for {t} or drop it", key="targets")


def path_key_fix(targets, takers) -> str:
    """The advice ending a refusal of a tile key only some paths take (`takers`: the targets
    whose path could): add one of them -- or, where the kernel lists one already, its shapes
    (dtype, head sizes, cache) are what keeps the path off."""
    listed = [t for t in targets if t in takers]
    if listed:
        return (f"{', '.join(listed)} is listed, but this kernel's dtype, head sizes or cache keep "
                f"it off that path: change them or drop the key")
    return f"add {' or '.join(takers)} or drop the key"


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def load_vec(b: KernelBuilder, fmt: ElemFormat, addr: Addr, pred: Reg | None = None) -> list[Reg]:
    """One 128-bit global load (`ld.global.nc.v4`); with `pred`, lanes where it is false get zeros."""
    if pred is None:
        return b.ld("global", fmt.load_type, addr, vec=4, nc=True)
    regs = [b.mov(0, fmt.load_type) for _ in range(4)]
    with b.predicate(pred):
        b.ld("global", fmt.load_type, addr, vec=4, nc=True, out=regs)
    return regs


def to_f32(b: KernelBuilder, fmt: ElemFormat, regs: list[Reg]) -> list[Reg]:
    """Unpack a loaded vector to f32 values (element order preserved)."""
    if fmt.name == "f32":
        return list(regs)
    out = []
    for r in regs:
        if fmt.name == "bf16":
            # bf16 is the top half of an f32: a shift and a mask, no conversion instruction.
            out += [b.bitcast(b.shl(r, 16), F32), b.bitcast(b.and_(r, -65536), F32)]
        else:
            lo, hi = b.unpack(r, fmt_half(fmt))
            out += [b.cvt(F32, lo), b.cvt(F32, hi)]
    return out


def fmt_half(fmt: ElemFormat):
    from ..ir import BF16, F16
    return {"f16": F16, "bf16": BF16}[fmt.name]


def from_f32(b: KernelBuilder, fmt: ElemFormat, vals: list[Reg], target=None) -> list[Reg]:
    """Round f32 values to the storage format, packed for a vector store. With a `target`
    below sm_80 (no cvt.rn.f16x2.f32), f16 pairs are rounded one by one and packed."""
    if fmt.name == "f32":
        return list(vals)
    if target is not None and target.sm < 80 and fmt.name == "f16":
        from ..ir import F16
        return [b.pack(B32, [b.cvt(F16, vals[i]), b.cvt(F16, vals[i + 1])]) for i in range(0, len(vals), 2)]
    pair = F16X2 if fmt.name == "f16" else BF16X2
    return [b.cvt_pack(pair, vals[i + 1], vals[i]) for i in range(0, len(vals), 2)]


def store_vec(b: KernelBuilder, fmt: ElemFormat, addr: Addr, packed: list[Reg]) -> None:
    b.st("global", fmt.load_type, addr, packed)


def element_offset(b: KernelBuilder, base: Reg, index: Reg, stride_bytes: Reg) -> Reg:
    """base + index * stride_bytes as a 64-bit address (index u32 or s64, stride s64)."""
    idx = b.cvt(S64, index) if index.type == U32 else index
    return b.mad(idx, stride_bytes, b.bitcast(base, S64))


def byte_stride(b: KernelBuilder, stride_elems: Reg, fmt: ElemFormat) -> Reg:
    return b.mul(stride_elems, fmt.bytes)


@dataclass(frozen=True)
class LateValue:
    """A value loaded where it is used rather than at entry (a parameter only a split kernel's
    epilogue may need: loaded at entry, ptxas holds its registers across the main loop)."""

    load: Callable[[], Reg]


def late(x):
    """x, or what a LateValue loads (emitted at this point)."""
    return x.load() if isinstance(x, LateValue) else x


def param_loader(b: KernelBuilder, params: list[LaunchParam]):
    """A kernel's `param(name, type, source, then=..., late=False)`: declares the launch
    parameter (appended to `params`, the launch's order) and loads it at entry -- or, with
    `late`, where it is used (a LateValue) -- passing the loaded register through `then`."""
    def param(name, type, source, then=lambda r: r, late=False):
        params.append(LaunchParam(name, type, source))
        sym = b.param(name, type)
        if late:
            return LateValue(lambda: then(b.load_param(sym)))
        return then(b.load_param(sym))
    return param


def warp_sum(b: KernelBuilder, x: Reg, offsets) -> Reg:
    """Butterfly all-reduce over the lanes that differ in the bits of `offsets`."""
    for off in offsets:
        x = b.add(x, b.shfl("bfly", x, off))
    return x


def param_u64(b: KernelBuilder, name: str) -> Reg:
    return b.load_param(b.param(name, U64))


def tuned_tile(family: str, spec, target, keys: tuple[str, ...], causal: bool = False) -> dict:
    """The tile `ptxc tune` measured fastest for this (family, head_dim, causal, dtype) on this
    target (tables in ptxc/tuned/), restricted to `keys`; {} when there is none."""
    if target is None:
        return {}
    from ..tuned import lookup
    found = lookup(target.name, family, spec.head_dim, causal, spec.dtype) or {}
    return {k: v for k, v in found.items() if k in keys}
