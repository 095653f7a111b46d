"""FP8 KV caches in the attention families (decode, varlen): spec keys, interface, scale
parameters, and the reference/inputs side. The conversion arithmetic is fp8.py's.

    kv_dtype = "e4m3" | "e5m2"   the cache holds FP8 bytes (default: dtype, no conversion)
    kv_scale = "tensor"          k_scale, v_scale: two f32 runtime scalars (kernel parameters)
             | "device"          k_scale, v_scale: [1] f32 device tensors, one scale per cache
                                 read by the kernel (vLLM's layer._k_scale: a captured CUDA
                                 graph sees the current value)
             | "head"            k_scale, v_scale: [num_kv_heads] f32 tensors
    dequantised K = fp8(k) * k_scale, V = fp8(v) * v_scale.

The kernels never multiply an element by its scale: k_scale folds into the per-CTA query
multiplier (s = (q * softmax_scale * log2e * k_scale) . fp8(k)) and v_scale into the final
normalisation (o = acc * v_scale / l), one multiply per CTA or output chunk each.

A latent cache (MLA) may instead hold FlashMLA's / vLLM's fp8_ds_mla rows (kv_dtype =
"e4m3_ds", `GroupScaledRows`): per row the e4m3 latent in groups of 128 columns, one f32 scale
per group, then the RoPE columns in bf16, unquantised. The scale varies per row and group, so
it cannot fold into a per-CTA multiplier: the staged conversion (kv_fp8_stage.py) multiplies
each element by its group's scale and rounds to bf16 once. No k_scale parameter exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import SpecError
from ...ir import F32, S64, Addr, KernelBuilder, Reg
from ...spec.fields import Field
from ...spec.model import KernelSpec
from ...targets import Target
from .. import common as C
from ..base import ParamSource, TensorInfo
from ..math import fp8
from .kv_access import latent_cache

SCALE_MODES = ("tensor", "device", "head")
KV_SCALE_FIELD = Field("kv_scale", "str", "FP8 scales: one f32 runtime scalar per cache (k_scale, "
                       "v_scale), one f32 in device memory per cache ([1] tensors), or [num_kv_heads] "
                       "f32 tensors (FP8 only; default \"tensor\")", default=None, choices=SCALE_MODES)
FIELDS = (
    Field("kv_dtype", "str", "cache element type (default: dtype); FP8 caches are read as bytes and "
          "dequantised in registers", default=None, choices=("f32", "f16", "bf16") + fp8.KINDS),
    KV_SCALE_FIELD,
)


GROUP_SCALED = "e4m3_ds"     # the kv_dtype of GroupScaledRows (latent caches only)


@dataclass(frozen=True)
class GroupScaledRows:
    """FlashMLA's fp8_ds_mla latent row, byte by byte (rank 512, RoPE 64: 656 bytes):
    [0, rank) the e4m3 latent, column c in group c // 128; [rank, rank + 4 * groups) one f32
    scale per group (dequantised = e4m3 x scale); then the RoPE columns in bf16."""

    rank: int
    rope: int
    group: int = 128

    @property
    def groups(self) -> int:
        return self.rank // self.group

    @property
    def scales_at(self) -> int:
        return self.rank

    @property
    def rope_at(self) -> int:
        return self.scales_at + 4 * self.groups

    @property
    def row_bytes(self) -> int:
        return self.rope_at + 2 * self.rope


def group_scaled(spec: KernelSpec) -> GroupScaledRows | None:
    """The row format of an e4m3_ds latent cache (mla, mla_append, or mla's varlen view, whose
    head_dim_v is the rank), else None."""
    o = dict(spec.options)
    if o.get("kv_dtype") != GROUP_SCALED:
        return None
    rank = o.get("kv_lora_rank") or o["head_dim_v"]
    return GroupScaledRows(rank, spec.head_dim - rank)


def kind(spec: KernelSpec) -> str | None:
    """The cache's FP8 kind (e4m3_ds: e4m3), or None for a cache of the dtype itself."""
    k = dict(spec.options).get("kv_dtype")
    return "e4m3" if k == GROUP_SCALED else k if k in fp8.KINDS else None


def scale_mode(spec: KernelSpec) -> str | None:
    """"tensor" | "device" | "head", "group" for e4m3_ds (scales inside the rows), None without FP8."""
    if group_scaled(spec):
        return "group"
    return (dict(spec.options).get("kv_scale") or "tensor") if kind(spec) else None


def kv_dtype(spec: KernelSpec) -> str:
    """The cache tensor's dtype: FP8 bytes, u8 for group-scaled rows (mixed fields), else the dtype."""
    return "u8" if group_scaled(spec) else kind(spec) or spec.dtype


def row_elems(spec: KernelSpec) -> int:
    """A cache row's last-axis extent: head_dim elements, or a group-scaled row's bytes."""
    rows = group_scaled(spec)
    return rows.row_bytes if rows else spec.head_dim


def validate(spec: KernelSpec) -> None:
    """kv_dtype is the dtype itself or FP8; kv_scale only with FP8."""
    o = dict(spec.options)
    kd = o.get("kv_dtype")
    if kd is not None and kd not in fp8.KINDS and kd != spec.dtype:
        raise SpecError(f"got {kd!r} with dtype {spec.dtype!r}; allowed: {spec.dtype!r} "
                        f"(the dtype itself) or an FP8 type ({', '.join(fp8.KINDS)})", key="kv_dtype")
    if o.get("kv_scale") is not None and kd not in fp8.KINDS:
        raise SpecError(f"kv_scale = {o['kv_scale']!r} applies only to FP8 caches (kv_dtype is "
                        f"{kd or spec.dtype!r}); allowed: kv_dtype = \"e4m3\" or \"e5m2\"",
                        key="kv_scale")


def kv_format(spec: KernelSpec) -> C.ElemFormat:
    """How the cache's elements are addressed: one byte each for FP8."""
    k = kind(spec)
    return C.ElemFormat(k, 1) if k else C.FORMATS[spec.dtype]


def scaled_caches(spec: KernelSpec) -> str:
    """Which caches have a scale: "kv" (k_scale, v_scale), or "k" for a latent cache (MLA),
    whose V columns are K's and dequantise with k_scale."""
    return "k" if latent_cache(spec) else "kv"


def interface_extras(spec: KernelSpec) -> tuple[list[TensorInfo], dict[str, dict]]:
    """(scale tensors, runtime scalars) the interface adds for an FP8 cache."""
    mode = scale_mode(spec)
    if mode == "group":   # the scales travel inside the rows
        return [], {}
    if mode == "tensor":
        return [], {f"{t}_scale": {"dtype": "f32", "doc": f"dequantised {t.upper()} = fp8 x {t}_scale"}
                    for t in scaled_caches(spec)}
    return scale_tensors(spec, mode, "dequantised = fp8 x scale"), {}


def scale_tensors(spec: KernelSpec, mode: str | None, what: str) -> list[TensorInfo]:
    """The scale inputs of kv_scale = "head" ([num_kv_heads]) and "device" ([1])."""
    if mode == "head":
        return [TensorInfo(f"{t}_scale", "f32", (spec.num_kv_heads,), "input", f"per-KV-head scale of "
                           f"the {t.upper()} cache: {what}[head]") for t in scaled_caches(spec)]
    if mode == "device":
        return [TensorInfo(f"{t}_scale", "f32", (1,), "input", f"scale of the {t.upper()} cache in "
                           f"device memory, read by the kernel (a captured graph sees its current "
                           f"value): {what}[0]", device_resident_scalars=True) for t in scaled_caches(spec)]
    return []


@dataclass(frozen=True)
class KVDequant:
    """An FP8 cache as one kernel reads it: kind, target, and its scale parameters (f32 scalar
    registers for "tensor", global pointers for "device" and "head"; none for "group", whose
    scales are in the rows and applied where the tile is converted)."""

    kind: str
    target: Target
    mode: str
    k_scale: Reg | None
    v_scale: Reg | None

    def scales(self, b: KernelBuilder, kv_head: Reg) -> tuple[Reg, Reg]:
        """(k_scale, v_scale) of this KV head: the scalars, or one ld.global.nc.f32 each;
        (None, None) for "group" (nothing to fold: the tiles arrive dequantised)."""
        if self.mode == "group":
            return None, None
        if self.mode == "tensor":
            return self.k_scale, self.v_scale
        if self.mode == "device":
            k = b.ld("global", F32, Addr(self.k_scale), nc=True)
            if self.v_scale is self.k_scale:   # a latent cache: one scale
                return k, k
            return k, b.ld("global", F32, Addr(self.v_scale), nc=True)
        four = b.mov(4, S64)
        return tuple(b.ld("global", F32, Addr(C.element_offset(b, p, kv_head, four)), nc=True)
                     for p in (self.k_scale, self.v_scale))

    def load(self, b: KernelBuilder, addr: Addr, elems: int, pred: Reg | None) -> list[Reg]:
        return fp8.load_words(b, addr, elems, pred)

    def widen(self, b: KernelBuilder, words: list[Reg]) -> list[Reg]:
        return fp8.dequantize(b, words, self.kind, self.target)


def emit_params(spec: KernelSpec, target: Target, b: KernelBuilder, param) -> KVDequant | None:
    """Declare the scale parameters (`param(name, type, source)`), after all the others."""
    k = kind(spec)
    if not k:
        return None
    from ...ir import U64
    mode = scale_mode(spec)
    if mode == "group":
        return KVDequant(k, target, mode, None, None)
    if mode == "tensor":
        regs = [param(f"{t}_scale", F32, ParamSource("scalar", name=f"{t}_scale"))
                for t in scaled_caches(spec)]
    else:
        regs = [b.to_global(param(f"{t}_scale", U64, ParamSource("pointer", tensor=f"{t}_scale")))
                for t in scaled_caches(spec)]
    return KVDequant(k, target, mode, regs[0], regs[-1])   # a latent cache: V's scale is K's


def stage_rows_dequant(b: KernelBuilder, slot, row_address, row0: Reg, nvalid: Reg, smem: Reg,
                       quant: KVDequant, pair: str) -> None:
    """tiles.load_tile_rows for an FP8 cache feeding an f16/bf16 shared-memory tile (varlen
    when head_dim or head_dim_v is not a multiple of 16; otherwise kv_fp8_stage.py moves the
    bytes by cp.async): each 16-byte chunk of the tile is 8 FP8 bytes in global memory, one
    ld.global.nc.v2 into registers; every pass's load is issued before any is converted
    (`pair`: "f16x2" | "bf16x2", exact) and stored with st.shared.v4. Rows at or past `nvalid`
    are zeros. `row_address(row, valid)` gives the FP8 chunk address (column col / 2)."""
    from ...ir import B32, S32
    geom = slot.geom
    rem = b.sub(nvalid, b.bitcast(slot.r0, S32))
    dst = b.add(smem, slot.soff)
    loaded = []
    for i in range(geom.passes):
        valid = b.setp("gt", rem, i * geom.rows_per_pass)
        addr, ok = row_address(b.add(row0, b.add(slot.r0, i * geom.rows_per_pass)), valid)
        loaded.append(fp8.load_words(b, Addr(addr), 8, ok))
    for i, words in enumerate(loaded):
        vals = fp8.dequantize(b, words, quant.kind, quant.target, to=pair)
        guard = slot.guard(b, i)
        doff = i * geom.rows_per_pass * geom.stride
        if guard is None:
            b.st("shared", B32, Addr(dst, doff), vals)
        else:
            with b.predicate(guard):
                b.st("shared", B32, Addr(dst, doff), vals)


# ---- inputs and reference --------------------------------------------------------------------
def add_inputs(spec: KernelSpec, inputs: dict, rng) -> None:
    """Replace float caches by FP8 bytes of the same values over a scale (the bytes a
    quantising append would have written), and add the scales; caches of the dtype stay."""
    import numpy as np

    from ...reference import fp8_quantize
    k = kind(spec)
    if not k:
        return
    Hk = spec.num_kv_heads
    if scale_mode(spec) == "tensor":
        scales = {"k": np.float32(0.37), "v": np.float32(1.9)}
    elif scale_mode(spec) == "device":
        scales = {"k": np.array([0.37], np.float32), "v": np.array([1.9], np.float32)}
    else:
        scales = {t: np.exp(rng.uniform(-2, 1, Hk)).astype(np.float32) for t in "kv"}
    for t in "kv":
        s = scales[t] if np.ndim(scales[t]) == 0 else scales[t][:, None]
        inputs[f"{t}_cache"] = fp8_quantize(np.asarray(inputs[f"{t}_cache"], np.float32) / s, k)
        inputs[f"{t}_scale"] = scales[t]


def dequantized(spec: KernelSpec, inputs: dict, k_cache, v_cache) -> tuple:
    """fp64 K and V from FP8 bytes (the same bytes the kernel reads) times their scales; caches
    of the dtype come back unchanged. Head axis: -2."""
    import numpy as np

    from ...reference import fp8_decode
    k = kind(spec)
    if not k:
        return k_cache, v_cache
    out = []
    for t, cache in (("k", k_cache), ("v", v_cache)):
        s = np.asarray(inputs[f"{t}_scale"], np.float64)
        out.append(fp8_decode(cache, k) * (s if s.ndim == 0 else s[:, None]))
    return tuple(out)


__all__ = ["FIELDS", "KV_SCALE_FIELD", "SCALE_MODES", "scale_tensors", "KVDequant", "kind", "scale_mode",
           "GROUP_SCALED", "GroupScaledRows", "group_scaled", "row_elems", "kv_dtype", "validate", "kv_format", "interface_extras", "emit_params", "stage_rows_dequant", "add_inputs", "dequantized"]
