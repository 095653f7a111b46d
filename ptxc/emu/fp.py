"""Floating-point helpers: exact rounding to f16/bf16/f32/f64 in every PTX rounding mode.

The core is `round_to_format(s, e, mode, fmt)`: round the exact value ``s + e`` (``s`` a float64,
``e`` a float64 whose *sign* says on which side of ``s`` the exact value lies, zero when ``s`` is
exact) to a binary format with the given rounding. Because only the sign of ``e`` is needed, the
callers can supply error terms that are exact (TwoSum / TwoProduct) or merely sign-correct
(division and square-root residuals), and every conversion / arithmetic rounding in the emulator
is correctly rounded, not double-rounded.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np


class Fmt:
    """A binary floating-point format: precision p (with hidden bit), emin, emax."""

    def __init__(self, name: str, p: int, emin: int, emax: int):
        self.name, self.p, self.emin, self.emax = name, p, emin, emax
        self.max_finite = math.ldexp(2.0 - math.ldexp(1.0, 1 - p), emax)


F16 = Fmt("f16", 11, -14, 15)
BF16 = Fmt("bf16", 8, -126, 127)
F32 = Fmt("f32", 24, -126, 127)
F64 = Fmt("f64", 53, -1022, 1023)

FLOAT_ROUNDINGS = ("rn", "rz", "rm", "rp")
F16_NAN, BF16_NAN, F32_NAN = 0x7FFF, 0x7FFF, 0x7FFFFFFF   # NVIDIA canonical NaNs
F64_NAN = 0x7FFFFFFFFFFFFFFF


def round_to_format(s, e, mode: str, fmt: Fmt):
    """Round the exact value s + e (see module doc) to `fmt`; returns float64 values that are
    exactly representable in `fmt`. NaN/inf pass through; overflow follows IEEE per mode."""
    s = np.asarray(s, np.float64)
    finite_nz = np.isfinite(s) & (s != 0)
    x = np.where(finite_nz, s, 1.0)
    _, E = np.frexp(x)
    q = np.maximum(E - 1, fmt.emin) - (fmt.p - 1)          # exponent of the target's ulp
    scaled = np.ldexp(x, -q)                               # exact: a power-of-two scaling
    has_err = e is not None
    if has_err:
        e = np.where(finite_nz, np.asarray(e, np.float64), 0.0)
    if mode == "rn":
        r = np.rint(scaled)
        if has_err:   # a tie in s is broken by the side the exact value lies on
            fl = np.floor(scaled)
            tie = (scaled - fl) == 0.5
            r = np.where(tie & (e != 0), fl + (e > 0), r)
    else:
        r = {"rz": np.trunc, "rm": np.floor, "rp": np.ceil}[mode](scaled)
        if has_err:
            # s itself is on the target grid: the exact value's side decides a one-step move.
            direction = {"rz": np.where(np.sign(e) == -np.sign(x), -np.sign(x), 0.0),
                         "rm": np.where(e < 0, -1.0, 0.0),
                         "rp": np.where(e > 0, 1.0, 0.0)}[mode]
            move = (r == scaled) & (direction != 0)
            # stepping down in magnitude from a power of two lands in the finer binade below
            finer = (np.abs(scaled) == 2.0 ** (fmt.p - 1)) & (E - 1 > fmt.emin)
            step = np.where(finer & (np.sign(direction) == -np.sign(x)), 0.5, 1.0)
            r = np.where(move, r + direction * step, r)
    res = np.ldexp(r, q)
    big = np.abs(res) > fmt.max_finite
    if big.any():
        to_inf = {"rn": np.ones_like(big), "rz": np.zeros_like(big),
                  "rm": x < 0, "rp": x > 0}[mode]
        sat = np.where(to_inf, np.inf, fmt.max_finite)
        res = np.where(big, np.copysign(sat, x), res)
    res = np.where(res == 0, np.copysign(0.0, x), res)     # underflow keeps the sign
    return np.where(finite_nz, res, s)


# ----------------------------------------------------------------------------- encodings

def f16_bits_to_f32(bits):
    return np.asarray(bits, np.uint16).view(np.float16).astype(np.float32)


def bf16_bits_to_f32(bits):
    return (np.asarray(bits, np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def encode_f16(v64):
    """float64 values exactly representable in f16 -> uint16 bits (NaN -> canonical)."""
    v64 = np.asarray(v64, np.float64)
    bits = v64.astype(np.float16).view(np.uint16)
    return np.where(np.isnan(v64), np.uint16(F16_NAN), bits)


def encode_bf16(v64):
    v64 = np.asarray(v64, np.float64)
    bits = (v64.astype(np.float32).view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    return np.where(np.isnan(v64), np.uint16(BF16_NAN), bits)


def f32_to_f16_rn(x32):
    """Fast path: numpy's float32->float16 cast is IEEE round-to-nearest-even (tested against
    `round_to_format`), including subnormals and overflow to infinity."""
    return encode_f16(np.asarray(x32, np.float32))


def f32_to_bf16_rn(x32):
    """Fast path: round-to-nearest-even on the upper 16 bits (bf16 shares f32's exponent
    range, so subnormals and overflow need no special case)."""
    u = np.asarray(x32, np.float32).view(np.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(nan, np.uint16(BF16_NAN), rounded.astype(np.uint16))


def flush_f32(x):
    """.ftz: subnormal f32 values become zero of the same sign."""
    x = np.asarray(x, np.float32)
    u = x.view(np.uint32)
    # (|bits| - 1) < 0x7FFFFF holds exactly for the subnormals (0 wraps around to 0xFFFFFFFF)
    sub = ((u & np.uint32(0x7FFFFFFF)) - np.uint32(1)) < np.uint32(0x007FFFFF)
    if not sub.any():
        return x
    return np.where(sub, u & np.uint32(0x80000000), u).view(np.float32)


def saturate(x):
    """.sat: clamp to [0, 1]; NaN -> +0."""
    x = np.asarray(x)
    return np.where(np.isnan(x), x.dtype.type(0), np.clip(x, 0, 1) + x.dtype.type(0))


# ----------------------------------------------------------------------------- error-free ops

def two_sum(a, b):
    """s = fl(a + b) and the exact error e (a + b == s + e) for float64 arrays."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _split(a):
    c = 134217729.0 * a            # Veltkamp split: 2**27 + 1
    hi = c - (c - a)
    return hi, a - hi


def two_prod(a, b):
    """p = fl(a * b) and the exact error (for values far from overflow/underflow)."""
    p = a * b
    ah, al = _split(a)
    bh, bl = _split(b)
    return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl


def residual_sign(num, q, den):
    """Sign-correct (num - q*den) in float64: positive where num/den > q (for den > 0)."""
    p, pe = two_prod(q, den)
    return (num - p) - pe


# ----------------------------------------------------------------------------- int <-> float

def int_to_pair(x):
    """An int array as an exact float64 pair (s, e) with x == s + e."""
    x = np.asarray(x)
    if x.dtype.itemsize <= 4:
        return x.astype(np.float64), None
    hi = (x >> x.dtype.type(32)).astype(np.float64) * 4294967296.0
    lo = (x & x.dtype.type(0xFFFFFFFF)).astype(np.float64)
    return two_sum(hi, lo)


_INT_ROUND = {"rni": np.rint, "rzi": np.trunc, "rmi": np.floor, "rpi": np.ceil}


def round_integral(x, irnd: str):
    return _INT_ROUND[irnd](x)


def float_to_int(x64, irnd: str, dtype):
    """Float -> integer with PTX semantics: round per `irnd`, saturate to the range, NaN -> 0."""
    r = _INT_ROUND[irnd](np.asarray(x64, np.float64))
    info = np.iinfo(dtype)
    bits = info.bits
    hi_f = 2.0 ** (bits - 1) if info.min < 0 else 2.0 ** bits
    lo_f = -(2.0 ** (bits - 1)) if info.min < 0 else 0.0
    over, under, nan = r >= hi_f, r < lo_f, np.isnan(r)
    safe = np.where(over | under | nan, 0.0, r)
    wide = np.int64 if info.min < 0 else np.uint64
    out = safe.astype(wide)
    out = np.where(over, wide(info.max), np.where(under, wide(info.min), out))
    return out.astype(dtype)


# ----------------------------------------------------------------------------- exact f64 path

def round_fraction(fr: Fraction, mode: str) -> float:
    """Correctly round an exact rational to float64 in `mode`."""
    try:
        r = float(fr)           # int/int true division: correctly rounded to nearest
    except OverflowError:
        r = math.inf if fr > 0 else -math.inf
    if mode == "rn":
        return r
    if math.isinf(r):
        toward = {"rz": False, "rm": fr < 0, "rp": fr > 0}[mode]
        return r if toward else math.copysign(F64.max_finite, r)
    rf = Fraction(r)
    if rf == fr:
        return r
    if mode == "rz" and abs(rf) > abs(fr):
        return math.nextafter(r, 0.0)
    if mode == "rm" and rf > fr:
        return math.nextafter(r, -math.inf)
    if mode == "rp" and rf < fr:
        return math.nextafter(r, math.inf)
    return r


def exact_f64(fn, mode: str, fallback, *args):
    """Elementwise exact f64 arithmetic: fn(*Fractions) -> Fraction, rounded per `mode`.

    Used only for the rare f64 forms numpy cannot round correctly (fma, directed rounding).
    `fallback` (numpy's IEEE result) is kept where an input is not finite. Returns the result
    and a mask of exact-zero results (whose sign the caller fixes with `exact_zero_sum`).
    """
    shape = np.shape(fallback)
    args = [np.broadcast_to(np.asarray(a, np.float64), shape).reshape(-1) for a in args]
    out = np.array(fallback, np.float64, copy=True).reshape(-1)
    zero = np.zeros(out.size, np.bool_)
    for i in range(out.size):
        vals = [float(a[i]) for a in args]
        if not all(math.isfinite(v) for v in vals):
            continue
        try:
            fr = fn(*[Fraction(v) for v in vals])
        except ZeroDivisionError:
            continue
        zero[i] = fr == 0
        if fr != 0:            # an exact zero keeps numpy's sign (right for products/quotients)
            out[i] = round_fraction(fr, mode)
    return out.reshape(shape), zero.reshape(shape)


def exact_zero_sum(res, exact_zero, x, y, mode: str):
    """IEEE sign of an exact-zero sum x + y: -0 if both addends are -0, and under
    round-toward-negative -0 unless both are +0; +0 otherwise."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    xz_neg, yz_neg = np.signbit(x), np.signbit(y)
    if mode == "rm":
        both_pos = (x == 0) & (y == 0) & ~xz_neg & ~yz_neg
        zero_val = np.where(both_pos, 0.0, -0.0)
    else:
        both_neg = (x == 0) & (y == 0) & xz_neg & yz_neg
        zero_val = np.where(both_neg, -0.0, 0.0)
    return np.where(exact_zero, zero_val, res)
