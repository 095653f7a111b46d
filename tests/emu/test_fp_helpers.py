"""fp.py rounding helpers against an exact rational reference (hypothesis)."""

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ptxc.emu import fp

from .helpers import ref_round

# fp's helpers run under np.errstate(all="ignore") inside launch(); here they are called bare.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

MODES = ["rn", "rz", "rm", "rp"]
FMTS = {"f16": fp.F16, "bf16": fp.BF16, "f32": fp.F32}
finite64 = st.floats(allow_nan=False, allow_infinity=False, width=64)
finite32 = st.floats(allow_nan=False, allow_infinity=False, width=32)


def _check(s: float, e: float, mode: str, fmt: str):
    got = float(fp.round_to_format(np.array([s]), np.array([e]), mode, FMTS[fmt])[0])
    exact = Fraction(s) + Fraction(e)
    want = s if exact == 0 else ref_round(exact, mode, fmt)     # signed zero stays as is
    assert got == want and math.copysign(1, got) == math.copysign(1, want), (s, e, mode, fmt)


@settings(max_examples=300, deadline=None)
@given(finite64, st.sampled_from([0.0, 1.0, -1.0]), st.sampled_from(MODES),
       st.sampled_from(sorted(FMTS)))
def test_round_to_format_random(s, err_sign, mode, fmt):
    if s == 0:
        err_sign = 0.0
    _check(s, err_sign * abs(s) * 2.0 ** -60, mode, fmt)


@settings(max_examples=300, deadline=None)
@given(finite32, st.sampled_from([0.0, 1.0, -1.0]), st.sampled_from(MODES))
def test_round_to_format_on_f32_ties_and_grid_points(v, err_sign, mode):
    """s exactly on an f32 value or exactly halfway between two: the error's side decides."""
    v32 = np.float32(v)
    nxt = np.nextafter(v32, np.float32(np.inf))
    if not np.isfinite(nxt) or v32 == 0:
        return
    for s in (float(v32), (float(v32) + float(nxt)) / 2):
        _check(s, err_sign * abs(s) * 2.0 ** -70, mode, "f32")


@pytest.mark.parametrize("mode", MODES)
def test_stepping_down_from_a_power_of_two(mode):
    for s in (1.0, -1.0, 2.0 ** 100, -(2.0 ** -120), 2.0 ** -126):
        for e in (s * 2.0 ** -80, -s * 2.0 ** -80):
            _check(s, e, mode, "f32")
            _check(s, e, mode, "f16")


def test_overflow_and_underflow_per_mode():
    for mode in MODES:
        for s in (3.5e38, -3.5e38, 65520.0, -65520.0, 1e-46, -1e-46, 2.0 ** -150):
            for fmt in FMTS:
                _check(s, 0.0, mode, fmt)


def test_fast_f16_and_bf16_paths_match_generic():
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    bits[:8] = [0x477FF000, 0x477FEFFF, 0x477FF001, 0x33800000, 0x33800001, 0x7F7FFFFF,
                0x7F800000, 0x00000001]
    x = bits.view(np.float32)
    ok = ~np.isnan(x)
    generic16 = fp.encode_f16(fp.round_to_format(x.astype(np.float64), None, "rn", fp.F16))
    np.testing.assert_array_equal(fp.f32_to_f16_rn(x)[ok], generic16[ok])
    genericb = fp.encode_bf16(fp.round_to_format(x.astype(np.float64), None, "rn", fp.BF16))
    np.testing.assert_array_equal(fp.f32_to_bf16_rn(x)[ok], genericb[ok])
    assert (fp.f32_to_f16_rn(x)[~ok] == 0x7FFF).all()
    assert (fp.f32_to_bf16_rn(x)[~ok] == 0x7FFF).all()


@settings(max_examples=200, deadline=None)
@given(st.floats(width=64), st.sampled_from(["rni", "rzi", "rmi", "rpi"]),
       st.sampled_from([np.int8, np.uint8, np.int32, np.uint32, np.int64, np.uint64]))
def test_float_to_int_saturates(x, irnd, dtype):
    got = int(fp.float_to_int(np.array([x]), irnd, dtype)[0])
    info = np.iinfo(dtype)
    if math.isnan(x):
        want = 0
    elif math.isinf(x):
        want = info.max if x > 0 else info.min
    else:
        f = Fraction(x)
        r = {"rzi": math.trunc, "rmi": math.floor, "rpi": math.ceil,
             "rni": lambda v: round(v)}[irnd](f)        # Python round() is ties-to-even
        want = min(max(r, info.min), info.max)
    assert got == want


@settings(max_examples=200, deadline=None)
@given(st.integers(-(2**63), 2**64 - 1), st.sampled_from(MODES),
       st.sampled_from(["f16", "bf16", "f32", "f64"]))
def test_int_to_float_pair_is_exact(v, mode, fmt):
    arr = np.array([v], np.int64 if v < 2**63 else np.uint64)
    s, e = fp.int_to_pair(arr)
    assert Fraction(float(s[0])) + Fraction(float(e[0]) if e is not None else 0) == v
    fmt_obj = {"f16": fp.F16, "bf16": fp.BF16, "f32": fp.F32, "f64": fp.F64}[fmt]
    got = float(fp.round_to_format(s, e, mode, fmt_obj)[0])
    assert got == ref_round(Fraction(v), mode, fmt)
