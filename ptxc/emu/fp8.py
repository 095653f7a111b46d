"""The OCP 8-bit floating-point formats E4M3 ("e4m3", the FN variant: no infinities, NaN =
S.1111.111, max 448) and E5M2 ("e5m2": IEEE-like, max 57344), as PTX's cvt sees them.

    quantize(f32 values, kind) -> uint8   cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32: round to nearest
                                          even; NaN -> 0x7F; +-inf and overflow -> +-max finite
    to_f16_bits(uint8 codes, kind)        cvt.rn.f16x2.{e4m3x2,e5m2x2}: exact (every FP8 value is
                                          an f16 value); e5m2 is the f16's high byte, e4m3 NaN
                                          -> 0x7FFF

Rounding goes through fp.round_to_format, the emulator's one correctly-rounded core.
"""

from __future__ import annotations

import numpy as np

from ptxc.emu import fp

PAIR_TYPES = ("e4m3x2", "e5m2x2")
NAN_CODE = 0x7F
F16_NAN = 0x7FFF


class Fp8Format(fp.Fmt):
    def __init__(self, name, p, emin, emax, max_finite):
        super().__init__(name, p, emin, emax)
        self.max_finite = max_finite
        self.mbits = p - 1
        self.bias = 1 - emin


E4M3 = Fp8Format("e4m3", 4, -6, 8, 448.0)
E5M2 = Fp8Format("e5m2", 3, -14, 15, 57344.0)
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


def quantize(x, kind: str) -> np.ndarray:
    fmt = FORMATS[kind]
    with np.errstate(invalid="ignore"):
        v = np.asarray(x, np.float32).astype(np.float64)
    r = fp.round_to_format(v, None, "rn", fmt)               # exact value on the FP8 grid
    r = np.where(np.isnan(r), r, np.clip(r, -fmt.max_finite, fmt.max_finite))
    sign = np.signbit(r).astype(np.uint32) << np.uint32(7)
    mag = np.where(np.isfinite(r), np.abs(r), 0.0)
    mant, exp = np.frexp(np.where(mag > 0, mag, 1.0))        # mag = mant * 2**exp, mant in [0.5, 1)
    normal = (exp - 1 >= fmt.emin) & (mag > 0)
    ecode = np.where(normal, exp - 1 + fmt.bias, 0)
    frac = np.where(normal, mag / np.ldexp(1.0, exp - 1) - 1.0, mag / np.ldexp(1.0, fmt.emin))
    code = (ecode.astype(np.uint32) << np.uint32(fmt.mbits)) | np.rint(frac * (1 << fmt.mbits)).astype(np.uint32)
    code = np.where(np.isnan(r), NAN_CODE, code | sign)
    return code.astype(np.uint8)


def to_f16_bits(codes, kind: str) -> np.ndarray:
    c = np.asarray(codes).astype(np.uint32) & np.uint32(0xFF)
    if kind == "e5m2":
        return (c << np.uint32(8)).astype(np.uint16)
    mag = c & np.uint32(0x7F)
    e, m = mag >> np.uint32(3), mag & np.uint32(7)
    val = np.where(e > 0, np.ldexp(1.0 + m / 8.0, e.astype(np.int64) - 7), np.ldexp(m / 8.0, -6))
    bits = fp.encode_f16(val).view(np.uint16).astype(np.uint32) | ((c & np.uint32(0x80)) << np.uint32(8))
    return np.where(mag == 0x7F, F16_NAN, bits).astype(np.uint16)


# FP8 tensor-core accumulation (wgmma and mma.sync over e4m3 / e5m2). The products are exact, but
# the sum is not f32's: the terms of one instruction -- its k products and C -- are aligned to
# the largest one and each keeps ACC_FRACTION_BITS fraction bits below that one's leading bit,
# the rest truncated toward zero, then added exactly (DeepSeek-V3's report and DeepGEMM #50:
# "the highest 14 bits of each mantissa product after sign-fill right shifting"; SageAttention2:
# C keeps 13 mantissa bits, the lowest 10 of f32's zeroed). With truncation toward zero this
# reproduces, bit for bit, the errors the H200 gave in the sm_90a launch-tests of the lease at
# 4078740 (docs/emulator.md "FP8 tensor-core accumulation"); rounding toward minus infinity
# (the two's-complement shift) gives 3-8x those errors. ACC_MODE = "exact" sums in float64.
ACC_FRACTION_BITS = 13
ACC_MODE = "hopper"


def accumulate(products, c, mode: str | None = None):
    """sum(products, axis=-1) + c as an FP8 tensor-core instruction computes it, as float64
    (the caller rounds to f32). `products` (..., k): exact float64; `c` (...): the f32
    accumulator's values. A non-finite sum is float64's (NaN and inf propagate)."""
    exact = products.sum(axis=-1) + c
    if (mode or ACC_MODE) == "exact":
        return exact
    fb = ACC_FRACTION_BITS
    _, ce = np.frexp(c)
    c22 = np.trunc(np.ldexp(c, fb + 1 - ce)) * np.ldexp(1.0, ce - fb - 1)    # C as FP22 (e8m13)
    terms = np.concatenate([products, c22[..., None]], axis=-1)
    finite = np.where(np.isfinite(terms), terms, 0.0)
    _, e = np.frexp(finite)
    top = np.where(finite != 0, e, -1100).max(axis=-1, keepdims=True)    # zeros align nothing
    unit = np.ldexp(1.0, top - 1 - fb)                # the largest term is in [2^(top-1), 2^top)
    with np.errstate(invalid="ignore"):
        total = (np.trunc(terms / unit) * unit).sum(axis=-1)
    return np.where(np.isfinite(exact), total, exact)
