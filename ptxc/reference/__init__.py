"""fp64 numpy references, the "naive same-dtype" computation, and the tolerance rule.

Tolerance rule (FlashAttention-2's tests): a kernel passes when

    max|kernel - ref64|  <=  2 * max|naive_same_dtype - ref64|  +  1e-5

where the naive computation stores every intermediate (scores, probabilities, output) in the
output's dtype: the spec's dtype for o, f32 for the f32 lse output (computed from f32 scores).
It scales the allowed error with what the dtype itself makes unavoidable. A kernel that sums
each row's probabilities on the tensor cores (prefill's and varlen's mma path, as FlashInfer
does) takes them in the spec's dtype, so its lse baseline is `Precision("f32", probs=dtype)`:
f32 scores, probabilities rounded to the dtype before the row sum. Those kernels take the
probabilities against a lazily updated running max (up to RESCALE_SLACK in log2 below the
true one, anywhere in between), so their rounding grid is shifted by an arbitrary factor and
their rounding noise is another draw of the same distribution; the max over a few thousand
rows of one draw is a noisy statistic (ratios above 2 between two draws occur), so that
baseline is the largest of `PROBS_SHIFTS` draws: the probabilities rounded after scaling by
2^0, 2^(1/4), 2^(1/2), 2^(3/4) (a power of two leaves the rounding unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TOLERANCE_RULE = ("max|kernel - fp64| <= 2 * max|naive - fp64| + 1e-5, naive = every intermediate "
                  "rounded to the output's dtype (o: the spec dtype; lse: f32, with probabilities "
                  "in the spec dtype where the kernel sums them on tensor cores, the largest of 4 "
                  "rounding grids)")
ABS_SLACK = 1e-5
PROBS_SHIFTS = (1.0, 2 ** 0.25, 2 ** 0.5, 2 ** 0.75)   # rounding grids of the probabilities


# ---- dtype exchange ------------------------------------------------------------------------
def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round to `dtype` and return as float64 (bf16 by round-to-nearest-even on f32 bits)."""
    x = np.asarray(x)
    if dtype == "f32":
        return x.astype(np.float32).astype(np.float64)
    if dtype == "f16":
        return x.astype(np.float16).astype(np.float64)
    if dtype == "bf16":
        return bf16_bits_to_f32(f32_to_bf16_bits(x)).astype(np.float64)
    raise ValueError(dtype)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round to nearest even; a NaN keeps its top bits, made quiet. In place on one u32
    temporary (the bench's inputs are gigabytes: five whole-array temporaries took 8 s a GB)."""
    f = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    bits = f.view(np.uint32)
    r = bits >> 16
    r &= 1
    r += 0x7FFF
    r += bits                   # wraps only for NaNs, which are redone below
    r >>= 16
    out = r.astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        out[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
    return out


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint32) << 16).view(np.float32)


def to_device(x: np.ndarray, dtype: str) -> np.ndarray:
    """Host array -> a fresh contiguous copy in the bytes a kernel reads (bf16 exchanged as f32
    arrays, stored as bits). Always a copy: kernels write inout buffers in place, and the
    caller's arrays must stay untouched."""
    np_type = {"f32": np.float32, "f16": np.float16, "i32": np.int32, "i64": np.int64, "u64": np.uint64,
               "e4m3": np.uint8, "e5m2": np.uint8, "u8": np.uint8}   # FP8: the raw bytes
    if dtype == "bf16":
        return f32_to_bf16_bits(x)
    if dtype not in np_type:
        raise ValueError(dtype)
    return np.array(x, dtype=np_type[dtype], order="C", copy=True)


def from_device(x: np.ndarray, dtype: str) -> np.ndarray:
    """Device bytes -> host array (bf16 comes back as float32)."""
    return bf16_bits_to_f32(x) if dtype == "bf16" else x


# tanh.approx.f32's maximum relative error is about 2^-11 (PTX ISA): the naive same-dtype
# computation rounds tanh to 11 mantissa bits, so a soft-capped f32 kernel is held to what its
# hardware primitive can give (f16/bf16 score rounding dominates anyway).
TANH_APPROX_BITS = 11


def round_mantissa(x: np.ndarray, bits: int) -> np.ndarray:
    """x rounded to `bits` significant bits (relative error <= 2^-bits)."""
    m, e = np.frexp(np.asarray(x, dtype=np.float64))
    return np.ldexp(np.round(m * 2.0 ** bits) / 2.0 ** bits, e)


@dataclass(frozen=True)
class Precision:
    """A naive computation's rounding points: `scores` and the output in `dtype`; with `probs`,
    the probabilities are also rounded to `probs` before the row sum (tensor-core row sums)."""

    dtype: str
    probs: str | None = None
    probs_scale: float = 1.0   # probabilities rounded as p * probs_scale (a shifted grid)


# ---- FP8 (OCP E4M3 / E5M2) ------------------------------------------------------------------
FP8_MAX_CODE = {"e4m3": 0x7E, "e5m2": 0x7B}       # largest finite: 448, 57344
FP8_NAN_CODE = 0x7F


def fp8_decode(codes: np.ndarray, kind: str) -> np.ndarray:
    """FP8 bytes -> float64 values, from the bit fields (e4m3: bias 7, S.1111.111 is NaN, no
    infinities; e5m2: bias 15, IEEE-style infinities and NaNs)."""
    c = np.asarray(codes).astype(np.int64) & 0xFF
    ebits, bias = (4, 7) if kind == "e4m3" else (5, 15)
    mbits = 7 - ebits
    e, m = (c >> mbits) & ((1 << ebits) - 1), c & ((1 << mbits) - 1)
    mag = np.where(e == 0, m * 2.0 ** (1 - bias - mbits), (1 + m / 2 ** mbits) * np.exp2(e - bias))
    if kind == "e4m3":
        mag = np.where((c & 0x7F) == 0x7F, np.nan, mag)
    else:
        mag = np.where(e == 31, np.where(m == 0, np.inf, np.nan), mag)
    return np.where(c & 0x80, -mag, mag)


def fp8_quantize(x: np.ndarray, kind: str) -> np.ndarray:
    """OCP "satfinite" round-to-nearest-even of float32 values to FP8 bytes, by search over the
    format's value table (independent of the emulator's arithmetic rounding): NaN -> 0x7F,
    +-inf and overflow -> +-max finite, ties to the even code, -0 -> 0x80."""
    with np.errstate(invalid="ignore"):      # NaN payloads widen quietly
        x = np.asarray(x, np.float32).astype(np.float64)
    codes = np.arange(FP8_MAX_CODE[kind] + 1)
    grid = fp8_decode(codes, kind)                 # 0 .. max finite, increasing
    mag = np.minimum(np.abs(np.nan_to_num(x, nan=0.0)), grid[-1])
    hi = np.clip(np.searchsorted(grid, mag, side="left"), 0, len(grid) - 1)
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = mag - grid[lo], grid[hi] - mag
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    out = pick | np.where(np.signbit(x), 0x80, 0)
    return np.where(np.isnan(x), FP8_NAN_CODE, out).astype(np.uint8)


def quantize_rows_e4m3(x: np.ndarray) -> np.ndarray:
    """Each row (last axis) of f32 values times 2^k, k = 7 - floor(log2(max |x|)) (clamped to
    +-126; 126 for a row of zeros), rounded to e4m3 and scaled back: the values a kernel with
    e4m3 score products (MLA's qk_products = "e4m3") multiplies. Exact apart from the e4m3
    rounding, since the scale is a power of two."""
    x = np.asarray(x, np.float32).astype(np.float64)
    top = np.max(np.abs(x), axis=-1, keepdims=True)
    _, e = np.frexp(np.where(top > 0, top, 0.0))                 # top = f * 2^e, f in [0.5, 1)
    k = np.clip(np.where(top > 0, 8 - e, 126), -126, 126)        # 7 - (e - 1)
    return fp8_decode(fp8_quantize(np.ldexp(x, k), "e4m3"), "e4m3") * np.exp2(-k.astype(np.float64))


# ---- attention ---------------------------------------------------------------------------
def attention(q, k, v, scale: float, *, causal: bool = False, kv_len=None, dtype: str | None = None,
              window: int | None = None, soft_cap: float | None = None, sinks=None,
              alibi_slopes=None, mask=None, chunk: int | None = None):
    """softmax(scale * q k^T + mask) v over the last two axes of [..., heads, seq, d] arrays.

    q: [B, H, Sq, D]; k, v: [B, Hk, Sk, D] (GQA: query head h uses KV head h // (H / Hk)).
    kv_len: optional [B] valid key counts. Queries align bottom-right: query i sits at position
    p = i + L - Sq (L = kv_len[b], or Sk); causal: it sees key j iff j <= p; a sliding `window`
    W: iff p - j < W (with or without causal); an attention `chunk` C: iff j >= C * floor(p / C)
    (the keys of the query's own chunk). Variant order (docs/spec.md): score -> soft-cap
    c*tanh(s/c) -> ALiBi s - slope_h*|p - j| -> masks -> softmax, where `sinks` [H] (natural-log
    logits) join each row's denominator: o = sum e^s v / (e^sink + sum e^s), lse = log(e^sink +
    sum e^s). Rows that see no key give 0 output and lse = -inf (= sink with sinks).
    `mask`: an optional boolean [Sq, Sk] (or broadcastable to [B, H, Sq, Sk]) a key must also
    pass (custom masks: draft trees, packed bits).
    With `dtype`, every intermediate is rounded to it (the naive same-dtype computation).
    Returns (o [B, H, Sq, D], lse [B, H, Sq]) in float64.
    """
    prec = dtype if isinstance(dtype, Precision) else Precision(dtype) if dtype else None
    rnd = (lambda x: round_to(x, prec.dtype)) if prec else (lambda x: x)
    custom = mask
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    B, H, Sq, D = q.shape
    Hk, Sk = k.shape[1], k.shape[2]
    # GQA as a group axis, not a copy of K and V per query head (MLA: 128 heads over one
    # latent head made the copy the reference's whole cost)
    g = H // Hk
    s = rnd(np.einsum("bngqd,bnkd->bngqk", q.reshape(B, Hk, g, Sq, D), k).reshape(B, H, Sq, Sk) * scale)
    if soft_cap is not None:   # the naive path takes tanh at tanh.approx.f32's precision
        t = np.tanh(s / soft_cap)
        s = rnd(soft_cap * (round_mantissa(t, TANH_APPROX_BITS) if prec else t))
    lens = np.full(B, Sk) if kv_len is None else np.asarray(kv_len)
    pos = (np.arange(Sq)[None, :] + lens[:, None] - Sq)[:, None, :, None]      # [B, 1, Sq, 1]
    j = np.arange(Sk)[None, None, None, :]
    if alibi_slopes is not None:
        slopes = np.asarray(alibi_slopes, dtype=np.float64)[None, :, None, None]
        s = rnd(s - slopes * np.abs(pos - j))
    mask = np.ones((B, 1, Sq, Sk), dtype=bool)
    if kv_len is not None:
        mask &= j < lens[:, None, None, None]
    if causal:
        mask &= j <= pos
    if window is not None:
        mask &= pos - j < window
    if chunk is not None:
        mask &= j >= (pos // chunk) * chunk
    if custom is not None:
        mask &= np.asarray(custom, dtype=bool)
    s = np.where(mask, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    sink = None if sinks is None else np.broadcast_to(
        np.asarray(sinks, dtype=np.float64)[None, :, None, None], m.shape)
    if sink is not None:
        m = np.maximum(m, sink)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m_safe)
    if prec and prec.probs:
        l = (round_to(p * prec.probs_scale, prec.probs) / prec.probs_scale).sum(axis=-1, keepdims=True)
    else:
        l = p.sum(axis=-1, keepdims=True)
    if sink is not None:
        l = l + np.exp(sink - m_safe)
    with np.errstate(divide="ignore", invalid="ignore"):
        probs = rnd(p / np.where(l > 0, l, 1.0)).reshape(B, Hk, g, Sq, Sk)
        o = rnd(np.einsum("bngqk,bnkd->bngqd", probs, v).reshape(B, H, Sq, v.shape[-1]))
        lse = np.where(l[..., 0] > 0, m_safe[..., 0] + np.log(l[..., 0]), -np.inf)
    return o, lse


def decode(q, k_cache, v_cache, seq_lens, scale: float, dtype: str | None = None, **variant):
    """Single-token decode: q [B, H, D], caches [B, S, Hk, D], seq_lens [B]; the query sits at
    position L - 1. `variant`: attention()'s window / soft_cap. Returns (o [B, H, D], lse [B, H])."""
    qh = np.asarray(q)[:, :, None, :]
    kh = np.swapaxes(np.asarray(k_cache), 1, 2)
    vh = np.swapaxes(np.asarray(v_cache), 1, 2)
    lens = np.minimum(np.maximum(np.asarray(seq_lens), 0), kh.shape[2])
    o, lse = attention(qh, kh, vh, scale, kv_len=lens, dtype=dtype, **variant)
    return o[:, :, 0, :], lse[:, :, 0]


# ---- comparison --------------------------------------------------------------------------
def max_abs_error(got, ref) -> float:
    """Max |got - ref|, with matching infinities (e.g. lse = -inf) counted as exact."""
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    if got.shape != ref.shape:
        raise ValueError(f"shape {got.shape} != reference {ref.shape}")
    same_inf = np.isinf(got) & np.isinf(ref) & (np.sign(got) == np.sign(ref))
    with np.errstate(invalid="ignore"):
        diff = np.where(same_inf, 0.0, np.abs(got - ref))
    if diff.size == 0:
        return 0.0
    return float(np.nanmax(np.where(np.isnan(diff), np.inf, diff)))


def tolerance(naive, ref) -> float:
    return 2.0 * max_abs_error(naive, ref) + ABS_SLACK
