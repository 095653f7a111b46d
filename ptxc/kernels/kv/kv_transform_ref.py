"""Inputs and references of the transforming kv_append (kv_transform.py): RoPE tables (plain
and llama3-scaled, in vLLM's cos_sin_cache layout), RoPE in fp64 and as the kernel's exact f32
operation sequence, and the OCP FP8 quantiser of ptxc.reference.

Reference rules: the rotated queries and non-FP8 caches are compared with an fp64 rotation under
the tolerance rule (naive: the fp64 result rounded to the dtype). FP8 caches are compared byte
for byte with the kernel's own arithmetic replayed in numpy float32 (every product and sum
rounded separately, then x / scale as an f32 division, then satfinite RNE), whose agreement with
fp64 the tests check separately.
"""

from __future__ import annotations

import numpy as np

from ...reference import fp8_quantize, round_to
from ...spec.model import KernelSpec
from .kv_rows import by_slot
from .kv_transform import options


def rope_cos_sin_cache(max_position: int, rotary_dim: int, base: float = 10000.0,
                       llama3: dict | None = None) -> np.ndarray:
    """[max_position, rotary_dim] f32: cos of the rotary_dim/2 frequencies, then their sin.
    `llama3`: {"factor", "low_freq_factor", "high_freq_factor", "original_max_position"} scales
    the frequencies as Llama 3.1 does (vLLM's Llama3RotaryEmbedding)."""
    inv_freq = base ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    if llama3:
        low_wl = llama3["original_max_position"] / llama3["low_freq_factor"]
        high_wl = llama3["original_max_position"] / llama3["high_freq_factor"]
        wavelen = 2 * np.pi / inv_freq
        smooth = (llama3["original_max_position"] / wavelen - llama3["low_freq_factor"]) / (
            llama3["high_freq_factor"] - llama3["low_freq_factor"])
        scaled = np.where(wavelen > low_wl, inv_freq / llama3["factor"],
                          (1 - smooth) * inv_freq / llama3["factor"] + smooth * inv_freq)
        inv_freq = np.where(wavelen < high_wl, inv_freq, scaled)
    angles = np.arange(max_position, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str, rotary_dim: int) -> np.ndarray:
    """RoPE over the last axis of x (cos/sin: [..., rotary_dim/2], broadcast). In x's dtype:
    float64 for the reference, float32 for the kernel's exact sequence (products, then a sum)."""
    out = x.copy()
    h = rotary_dim // 2
    if style == "neox":
        a, b = x[..., :h], x[..., h:rotary_dim]
        out[..., :h] = a * cos - b * sin
        out[..., h:rotary_dim] = b * cos + a * sin
    else:
        a, b = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
        out[..., 0:rotary_dim:2] = a * cos - b * sin
        out[..., 1:rotary_dim:2] = b * cos + a * sin
    return out


def add_inputs(spec, dims: dict, inputs: dict, rng) -> None:
    """Scales (runtime scalars or per-head tensors), q and a cos_sin_cache; FP8 specs also get
    values that saturate, an infinity and a NaN in v_new."""
    opts = options(spec)
    slots = "num_tokens" in dims
    new = (dims["num_tokens"],) if slots else (dims["batch"], dims["num_new"])
    Hk, d = spec.num_kv_heads, spec.head_dim
    if opts["fp8"]:
        top = 448.0 if opts["fp8"] == "e4m3" else 57344.0
        if opts["kv_scale"] == "tensor":
            inputs["k_scale"], inputs["v_scale"] = np.float32(3.1 / top * 8), np.float32(2.7 / top * 64)
        elif opts["kv_scale"] == "device":
            inputs["k_scale"] = np.array([3.1 / top * 8], np.float32)
            inputs["v_scale"] = np.array([2.7 / top * 64], np.float32)
        else:
            for t in "kv":
                inputs[f"{t}_scale"] = (np.exp(rng.uniform(-4, 1, Hk)) / top * 64).astype(np.float32)
        flat = inputs["v_new"].reshape(-1)        # a view: edits land in v_new
        if flat.size >= 4:
            flat[:2] = [np.inf, np.nan]            # -> max finite, NaN byte
            flat[2:4] *= 1e4                       # saturates to +-max finite
    if opts["rope"]:
        H = spec.num_heads
        inputs["q"] = round_to(rng.standard_normal((*new, H, d)), spec.dtype).astype(np.float32)
        inputs["cos_sin_cache"] = rope_cos_sin_cache(dims["max_position"], opts["rotary_dim"])
        if slots:   # positions of their own: in range, one past max_position, negative
            T, top = new[0], dims["max_position"]
            pos = rng.integers(0, top, T).astype(np.int64)
            pos[1:T:5] = top
            pos[3:T:5] = -3
            inputs["positions"] = pos


def _quantize(x32: np.ndarray, scale, kind: str) -> np.ndarray:
    return fp8_quantize(np.asarray(x32, np.float32) / np.float32(scale), kind)


def reference(spec, inputs: dict, dtype: str | None = None) -> dict:
    opts = options(spec)
    kind, style, rd = opts["fp8"], opts["rope"], opts["rotary_dim"]
    h = rd // 2
    cs = inputs.get("cos_sin_cache")
    max_pos = cs.shape[0] if cs is not None else None
    out = {t: np.array(inputs[t], dtype=np.uint8 if kind else np.float64) for t in ("k_cache", "v_cache")}
    # the naive baseline of an FP8 cache output is its bytes (compared exactly): no rounding
    rounding = (lambda x: round_to(x, dtype)) if dtype and dtype not in ("e4m3", "e5m2") else (lambda x: x)
    q_rot = None
    if style:
        q_rot = np.array(inputs["q"], np.float64)
    for src, r, dst in destinations(spec, inputs):
        if style and not 0 <= r < max_pos:
            continue
        rows = {}
        for name, cache in (("k_new", "k_cache"), ("v_new", "v_cache")):
            x = np.asarray(inputs[name][src])
            rotate_it = style and name == "k_new"
            if kind:
                x32 = x.astype(np.float32)
                if rotate_it:
                    x32 = rotate(x32, cs[r, :h], cs[r, h:rd], style, rd)
                scale = inputs[f"{name[0]}_scale"]
                scale = scale if np.ndim(scale) == 0 else scale[:, None]
                rows[cache] = _quantize(x32, scale, kind)
            else:
                x64 = x.astype(np.float64)
                if rotate_it:
                    x64 = rounding(rotate(x64, cs[r, :h].astype(np.float64), cs[r, h:rd].astype(np.float64), style, rd))
                rows[cache] = x64
        for cache, value in rows.items():
            out[cache][dst] = value
    if style:
        for src, r in _rope_rows(spec, inputs):
            if r < max_pos:
                q_rot[src] = rounding(rotate(q_rot[src], cs[r, :h].astype(np.float64),
                                             cs[r, h:rd].astype(np.float64), style, rd))
        out["q_rot"] = q_rot
    return out


def _rope_rows(spec, inputs: dict):
    """(source index, position >= 0) of every token whose queries the kernel rotates: its cache
    row is valid (page ids aside; by slot: its slot is in the cache)."""
    if by_slot(spec):
        total = inputs["k_cache"].shape[0] * inputs["k_cache"].shape[1]
        for t, (slot, p) in enumerate(zip(inputs["slot_mapping"], inputs["positions"])):
            if 0 <= int(slot) < total and int(p) >= 0:
                yield (t,), int(p)
        return
    for bi in range(inputs["q"].shape[0]):
        for t in range(inputs["q"].shape[1]):
            r = int(inputs["positions"][bi]) + t
            if _row_valid(spec, inputs, r):
                yield (bi, t), r


def _row_valid(spec, inputs: dict, r: int) -> bool:
    """Whether row r is inside the cache's capacity (page ids aside)."""
    if spec.opt("kv_layout") == "paged":
        return 0 <= r < inputs["block_table"].shape[1] * (spec.opt("page_size") or 16)
    return 0 <= r < inputs["k_cache"].shape[1]


def destinations(spec: KernelSpec, inputs: dict):
    """(source index, cache row, cache index) of every new row the append writes: source index
    (sequence, token) and cache row positions[sequence] + token, or by slot (token,) and the
    token's RoPE position (its slot when the spec has no RoPE)."""
    paged = spec.opt("kv_layout") == "paged"
    ps = spec.opt("page_size") or 16
    if by_slot(spec):
        pages = inputs["k_cache"].shape[0]
        rope_at = inputs.get("positions")
        for t, slot in enumerate(inputs["slot_mapping"]):
            slot = int(slot)
            if 0 <= slot < pages * ps:
                yield (t,), int(rope_at[t]) if rope_at is not None else slot, (slot // ps, slot % ps)
        return
    B, N = inputs["k_new"].shape[:2]
    rows = inputs["k_cache"].shape[0 if paged else 1]
    for bi in range(B):
        for t in range(N):
            r = int(inputs["positions"][bi]) + t
            if paged:
                table = inputs["block_table"]
                if not (0 <= r < table.shape[1] * ps) or not (0 <= table[bi, r // ps] < rows):
                    continue
                yield (bi, t), r, (table[bi, r // ps], r % ps)
            elif 0 <= r < rows:
                yield (bi, t), r, (bi, r)
