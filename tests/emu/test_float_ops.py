"""Floating-point instructions against exact rational references (every rounding mode)."""

import math
from fractions import Fraction

import numpy as np
import pytest

from .helpers import ew_kernel, ref_round, run_ew

MODES = ["rn", "rz", "rm", "rp"]
RNG = np.random.default_rng(99)


def f32_samples(n=256):
    special = [0.0, -0.0, 1.0, -1.0, 1.5, 3.0, 1e-45, -1e-45, 1.17549435e-38, 3.4028235e38,
               -3.4028235e38, 1e30, 1e-30, 2.0 ** -140, 0.1, -7.25]
    r = RNG.standard_normal(n - len(special)) * np.exp2(RNG.integers(-30, 30, n - len(special)))
    return np.array(special + list(r), np.float32)


def exact_zero(x: float, y: float, mode: str) -> float:
    """IEEE sign of an exact-zero sum x + y."""
    if x == 0 and y == 0 and math.copysign(1, x) == math.copysign(1, y):
        return x
    return -0.0 if mode == "rm" else 0.0


def same(got, want) -> bool:
    if math.isnan(want):
        return math.isnan(got)
    return got == want and math.copysign(1, got) == math.copysign(1, want)


def ref_f32(op: str, mode: str, a: float, b: float, c: float = 0.0, fmt="f32") -> float:
    vals = (a, b, c)
    if not all(math.isfinite(v) for v in vals) or (op == "div" and b == 0):
        with np.errstate(all="ignore"):
            f = np.float64
            return float({"add": lambda: f(a) + f(b), "sub": lambda: f(a) - f(b),
                          "mul": lambda: f(a) * f(b), "div": lambda: f(a) / f(b),
                          "fma": lambda: f(a) * f(b) + f(c)}[op]())
    fa, fb, fc = Fraction(a), Fraction(b), Fraction(c)
    exact = {"add": lambda: fa + fb, "sub": lambda: fa - fb, "mul": lambda: fa * fb,
             "div": lambda: fa / fb, "fma": lambda: fa * fb + fc}[op]()
    if exact == 0:
        if op == "mul" or op == "div":
            return math.copysign(0.0, a) * math.copysign(1.0, b)
        if op == "fma":
            return exact_zero(math.copysign(0.0, a) * math.copysign(1.0, b) if a * b == 0
                              else a * b, c, mode)
        return exact_zero(a, b if op == "add" else -b, mode)
    return ref_round(exact, mode, fmt)


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
@pytest.mark.parametrize("mode", MODES)
def test_f32_binary_all_roundings(op, mode):
    a = f32_samples()
    b = np.roll(f32_samples(), 17)
    k = ew_kernel("k", [("a", "f32"), ("b", "f32")], [("d", "f32")],
                  f"\t{op}.{mode}.f32 %d, %a, %b;")
    (d,) = run_ew(k, "k", [a, b], ["f32"])
    for x, y, r in zip(a.tolist(), b.tolist(), d.tolist()):
        assert same(r, ref_f32(op, mode, x, y)), (op, mode, x, y, r)


def fma_cases():
    a, b, c = f32_samples(), np.roll(f32_samples(), 5), np.roll(f32_samples(), 11)
    # a*b lands exactly halfway between two f32 values; a tiny c decides the rounding and
    # f64 double rounding would get it wrong.
    t = np.float32(1 + 2 ** -12)
    a[:6] = t
    b[:6] = [t, t, t, -t, t, t]
    c[:6] = [2.0 ** -60, -(2.0 ** -60), 0.0, 2.0 ** -60, -(1 + 2 ** -11), 1e-45]
    return a, b, c


@pytest.mark.parametrize("mode", MODES)
def test_fma_f32_single_rounding(mode):
    a, b, c = fma_cases()
    k = ew_kernel("k", [("a", "f32"), ("b", "f32"), ("c", "f32")], [("d", "f32"), ("m", "f32")],
                  f"\tfma.{mode}.f32 %d, %a, %b, %c;\n\tmad.{mode}.f32 %m, %a, %b, %c;")
    d, m = run_ew(k, "k", [a, b, c], ["f32", "f32"])
    for x, y, z, r, s in zip(a.tolist(), b.tolist(), c.tolist(), d.tolist(), m.tolist()):
        want = ref_f32("fma", mode, x, y, z)
        assert same(r, want) and same(s, want), (mode, x, y, z, r, want)


def test_sqrt_and_rcp_all_roundings():
    a = np.abs(f32_samples())
    a[0] = 2.0
    body = "\n".join(f"\tsqrt.{m}.f32 %s{m}, %a;\n\trcp.{m}.f32 %r{m}, %a;" for m in MODES)
    outs = [(f"s{m}", "f32") for m in MODES] + [(f"r{m}", "f32") for m in MODES]
    k = ew_kernel("k", [("a", "f32")], outs, body)
    res = dict(zip([n for n, _ in outs], run_ew(k, "k", [a], ["f32"] * 8)))
    for i, x in enumerate(a.tolist()):
        for m in MODES:
            want = ref_f32("div", m, 1.0, x)
            assert same(res[f"r{m}"][i], want), ("rcp", m, x)
        s_rn = float(np.sqrt(np.float32(x)))          # IEEE sqrt: correctly rounded
        assert same(res["srn"][i], s_rn)
        if x == 0 or not math.isfinite(x):
            continue
        fx = Fraction(x)
        for m in ("rz", "rm", "rp"):
            r = float(res[f"s{m}"][i])
            lo, hi = np.nextafter(np.float32(r), np.float32(0)), np.nextafter(np.float32(r),
                                                                               np.float32(np.inf))
            if m in ("rz", "rm"):    # largest r with r*r <= x
                assert Fraction(r) ** 2 <= fx < Fraction(float(hi)) ** 2, (m, x, r)
            else:                    # smallest r with r*r >= x
                assert Fraction(float(lo)) ** 2 < fx <= Fraction(r) ** 2, (m, x, r)


def test_ftz_and_sat():
    sub = np.float32(1e-40)
    a = np.array([sub, -sub, 2.0, -0.5, 0.75, np.nan, 1e-38], np.float32)
    b = np.array([1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.25], np.float32)
    k = ew_kernel("k", [("a", "f32"), ("b", "f32")],
                  [("m", "f32"), ("f", "f32"), ("s", "f32"), ("g", "f32")],
                  "\tmul.rn.f32 %m, %a, %b;\n\tmul.rn.ftz.f32 %f, %a, %b;\n"
                  "\tadd.rn.sat.f32 %s, %a, %b;\n\tfma.rn.ftz.sat.f32 %g, %a, %b, %b;")
    m, f, s, g = run_ew(k, "k", [a, b], ["f32"] * 4)
    assert m[0] == sub and f[0] == 0 and math.copysign(1, f[1]) == -1 and f[1] == 0
    assert f[6] == 0                                 # 1e-38 * 0.25 underflows to subnormal
    np.testing.assert_array_equal(s[:5], [1.0, 1.0, 1.0, 0.0, 0.75])
    assert s[5] == 0                                 # .sat turns NaN into +0
    assert g[0] == 1.0 and g[3] == 0.0


def test_min_max_nan_and_signed_zero():
    nan = np.float32(np.nan)
    a = np.array([1.0, nan, nan, 0.0, -0.0, -3.0, np.inf], np.float32)
    b = np.array([nan, 2.0, nan, -0.0, 0.0, 4.0, -np.inf], np.float32)
    k = ew_kernel("k", [("a", "f32"), ("b", "f32")], [("lo", "f32"), ("hi", "f32"), ("n", "f32")],
                  "\tmin.f32 %lo, %a, %b;\n\tmax.f32 %hi, %a, %b;\n\tmin.NaN.f32 %n, %a, %b;")
    lo, hi, n = run_ew(k, "k", [a, b], ["f32"] * 3)
    assert lo[0] == 1.0 and lo[1] == 2.0 and np.isnan(lo[2]) and hi[0] == 1.0 and hi[1] == 2.0
    assert lo.view(np.uint32)[2] == 0x7FFFFFFF          # canonical NaN
    assert math.copysign(1, lo[3]) == -1 and math.copysign(1, lo[4]) == -1
    assert math.copysign(1, hi[3]) == 1 and math.copysign(1, hi[4]) == 1
    assert lo[5] == -3 and hi[5] == 4 and lo[6] == -np.inf and hi[6] == np.inf
    assert np.isnan(n[:3]).all() and n[5] == -3
    k64 = ew_kernel("k", [("a", "f64"), ("b", "f64")], [("lo", "f64"), ("hi", "f64")],
                    "\tmin.f64 %lo, %a, %b;\n\tmax.f64 %hi, %a, %b;")
    lo, hi = run_ew(k64, "k", [a.astype(np.float64), b.astype(np.float64)], ["f64"] * 2)
    assert lo[0] == 1.0 and hi[1] == 2.0 and lo.view(np.uint64)[2] == 0x7FFFFFFFFFFFFFFF
    assert math.copysign(1, lo[3]) == -1 and math.copysign(1, hi[4]) == 1


def test_neg_abs_flip_only_the_sign_bit():
    a = np.array([1.5, -0.0, 0.0, -np.inf, np.nan, 1e-45], np.float32)
    k = ew_kernel("k", [("a", "f32")], [("n", "f32"), ("b", "f32"), ("z", "f32")],
                  "\tneg.f32 %n, %a;\n\tabs.f32 %b, %a;\n\tneg.ftz.f32 %z, %a;")
    n, b, z = run_ew(k, "k", [a], ["f32"] * 3)
    assert (n.view(np.uint32) == a.view(np.uint32) ^ 0x80000000).all()
    assert (b.view(np.uint32) == a.view(np.uint32) & 0x7FFFFFFF).all()
    assert z.view(np.uint32)[5] == 0x80000000


def test_approx_functions():
    x = np.array([0.0, -0.0, 1.0, -1.0, 0.5, 10.0, -126.5, -150.0, np.inf, -np.inf, np.nan, 3.3],
                 np.float32)
    ops = ["ex2.approx.f32", "ex2.approx.ftz.f32", "lg2.approx.f32", "sin.approx.f32",
           "cos.approx.f32", "tanh.approx.f32", "rsqrt.approx.f32", "rcp.approx.ftz.f32",
           "sqrt.approx.f32"]
    outs = [(f"o{i}", "f32") for i in range(len(ops))]
    body = "\n".join(f"\t{op} %o{i}, %a;" for i, op in enumerate(ops))
    k = ew_kernel("k", [("a", "f32")], outs, body)
    res = run_ew(k, "k", [x], ["f32"] * len(ops))
    x64 = x.astype(np.float64)
    with np.errstate(all="ignore"):
        refs = [np.exp2(x64), np.exp2(x64), np.log2(x64), np.sin(x64), np.cos(x64),
                np.tanh(x64), 1 / np.sqrt(x64), 1 / x64, np.sqrt(x64)]
    for op, got, want in zip(ops, res, refs):
        want32 = want.astype(np.float32)
        if "ftz" in op:
            want32 = np.where(np.abs(want32) < 1.1754944e-38, np.copysign(0, want32), want32)
        np.testing.assert_array_max_ulp(got, want32, maxulp=1)
    assert res[0][0] == 1 and res[0][8] == np.inf and res[0][9] == 0 and np.isnan(res[0][10])
    assert res[0][6] > 0 and res[1][6] == 0       # 2^-126.5 is subnormal: .ftz flushes it


@pytest.mark.parametrize("op", ["add", "mul", "div", "fma"])
@pytest.mark.parametrize("mode", MODES)
def test_f64_all_roundings(op, mode):
    a = f32_samples(64).astype(np.float64) * (1 + 2.0 ** -40)
    b = np.roll(a, 3) * (1 - 2.0 ** -35)
    c = np.roll(a, 7)
    a[:3] = [1 + 2.0 ** -30, 1e300, 0.0]
    b[:3] = [1 + 2.0 ** -30, 1e10, -0.0]
    c[:3] = [2.0 ** -200, -1e300, 0.0]
    args = "%a, %b, %c" if op == "fma" else "%a, %b"
    k = ew_kernel("k", [("a", "f64"), ("b", "f64"), ("c", "f64")], [("d", "f64")],
                  f"\t{op}.{mode}.f64 %d, {args};")
    (d,) = run_ew(k, "k", [a, b, c], ["f64"])
    for x, y, z, r in zip(a.tolist(), b.tolist(), c.tolist(), d.tolist()):
        want = ref_f32(op, mode, x, y, z, fmt="f64")
        assert same(r, want), (op, mode, x, y, z, r, want)


def test_unfused_mul_add_without_rounding_modifier():
    # without .rn, add/mul are still individually rounded here (ptxas may fuse them on
    # hardware; the emulator documents that it does not)
    a = np.array([1 + 2 ** -12], np.float32)
    k = ew_kernel("k", [("a", "f32")], [("d", "f32")],
                  "\tmul.f32 %d, %a, %a;\n\tadd.f32 %d, %d, 0f26000000;")
    (d,) = run_ew(k, "k", [a], ["f32"])
    assert d[0] == np.float32(np.float32(a[0] * a[0]) + np.float32(2.0 ** -51))


def test_sm100_packed_f32x2_and_three_input_min_max():
    """sm_100's add/sub/mul/fma .f32x2 act on both f32 halves of a .b64 (element 0 low), each
    rounded as the scalar op; min/max take a third f32 input."""
    rng = np.random.default_rng(3)
    a, b, c = (rng.standard_normal(128).astype(np.float32) for _ in range(3))
    pack = lambda x: x.view(np.uint64)  # noqa: E731  (pairs of consecutive f32)
    body = "\tadd.rz.f32x2 %s, %a, %b;\n\tsub.f32x2 %d, %a, %b;\n\tmul.rn.f32x2 %m, %a, %b;\n" \
        "\tfma.rn.f32x2 %f, %a, %b, %c;"
    k = ew_kernel("k", [("a", "b64"), ("b", "b64"), ("c", "b64")],
                  [("s", "b64"), ("d", "b64"), ("m", "b64"), ("f", "b64")], body,
                  version="8.7", target="sm_100a")
    s, d, m, f = (o.view(np.float32) for o in
                  run_ew(k, "k", [pack(a), pack(b), pack(c)], ["b64"] * 4))
    exact = [Fraction(float(x)) + Fraction(float(y)) for x, y in zip(a, b)]
    np.testing.assert_array_equal(s, [ref_round(x, "rz", "f32") for x in exact])
    np.testing.assert_array_equal(d, a - b)
    np.testing.assert_array_equal(m, a * b)
    np.testing.assert_array_equal(f, [ref_round(Fraction(float(x)) * Fraction(float(y)) +
                                                 Fraction(float(z)), "rn", "f32")
                                       for x, y, z in zip(a, b, c)])
    k3 = ew_kernel("k", [("a", "f32"), ("b", "f32"), ("c", "f32")], [("lo", "f32"), ("hi", "f32")],
                   "\tmin.f32 %lo, %a, %b, %c;\n\tmax.f32 %hi, %a, %b, %c;",
                   version="8.8", target="sm_100a")
    lo, hi = run_ew(k3, "k", [a, b, c], ["f32"] * 2)
    np.testing.assert_array_equal(lo, np.minimum(np.minimum(a, b), c))
    np.testing.assert_array_equal(hi, np.maximum(np.maximum(a, b), c))
