"""cvt: float<->float rounding (RNE ties, overflow, subnormals, NaN), packed f16x2/bf16x2
order, float->int saturation, int->float rounding and int->int truncation/saturation."""

import math
from fractions import Fraction

import numpy as np
import pytest

from .helpers import ew_kernel, ref_round, run_ew

MODES = ["rn", "rz", "rm", "rp"]
RNG = np.random.default_rng(5)


def f16_bits(v: float) -> int:
    return int(np.array(v, np.float16).view(np.uint16))


def bf16_bits(v: float) -> int:
    return int(np.array(v, np.float32).view(np.uint32)) >> 16


def interesting_f32():
    vals = [0.0, -0.0, 1.0, -1.0, 65504.0, 65519.99, 65520.0, -65520.0, 1e10, -1e10,
            2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 2.0 ** -14, 2.0 ** -15 + 2.0 ** -25,
            1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8,  # exact ties
            1 + 2.0 ** -11 + 2.0 ** -20, 3.3895314e38, 3.4028235e38, 1e-40, -1e-40,
            np.inf, -np.inf]
    r = RNG.standard_normal(300) * np.exp2(RNG.integers(-30, 20, 300))
    return np.array(vals + list(r), np.float32)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("half", ["f16", "bf16"])
def test_f32_to_half_every_rounding(mode, half):
    x = interesting_f32()
    k = ew_kernel("k", [("a", "f32")], [("h", "b16")], f"\tcvt.{mode}.{half}.f32 %h, %a;")
    (h,) = run_ew(k, "k", [x], ["b16"])
    enc = f16_bits if half == "f16" else bf16_bits
    for v, got in zip(x.tolist(), h.tolist()):
        want = v if math.isinf(v) or v == 0 else ref_round(Fraction(v), mode, half)
        assert got == enc(want), (half, mode, v, hex(got), hex(enc(want)))


def test_half_nan_is_canonical_and_relu_satfinite():
    x = np.array([np.nan, -2.5, 1e6, -1e6, np.inf, 3.0], np.float32)
    k = ew_kernel("k", [("a", "f32")], [("h", "b16"), ("r", "b16"), ("s", "b16"), ("b", "b16")],
                  "\tcvt.rn.f16.f32 %h, %a;\n\tcvt.rn.relu.f16.f32 %r, %a;\n"
                  "\tcvt.rn.satfinite.f16.f32 %s, %a;\n\tcvt.rz.relu.satfinite.bf16.f32 %b, %a;",
                  version="8.1")
    h, r, s, b = run_ew(k, "k", [x], ["b16"] * 4)
    assert h[0] == 0x7FFF and r[0] == 0x7FFF and s[0] == 0x7FFF
    assert r[1] == 0 and r[2] == 0x7C00 and r[3] == 0 and r[5] == f16_bits(3.0)
    assert s[2] == 0x7BFF and s[3] == 0xFBFF and s[4] == 0x7BFF
    assert b[1] == 0 and b[4] == 0x7F7F and b[5] == bf16_bits(3.0)


@pytest.mark.parametrize("pair", ["f16x2", "bf16x2"])
def test_packed_pair_order_a_is_upper_half(pair):
    a = np.array([1.0, -2.0, 65520.0, 0.333], np.float32)
    b = np.array([3.0, 0.5, -0.0, 1e-8], np.float32)
    k = ew_kernel("k", [("a", "f32"), ("b", "f32")], [("d", "b32")],
                  f"\tcvt.rn.{pair}.f32 %d, %a, %b;")
    (d,) = run_ew(k, "k", [a, b], ["b32"])
    enc = f16_bits if pair == "f16x2" else bf16_bits
    half = pair[:-2]
    for x, y, got in zip(a.tolist(), b.tolist(), d.tolist()):
        hi = enc(x if x == 0 else ref_round(Fraction(x), "rn", half))
        lo = enc(y if y == 0 else ref_round(Fraction(y), "rn", half))
        assert got == (hi << 16) | lo


def test_half_to_f32_is_exact_for_every_bit_pattern():
    bits = np.arange(65536, dtype=np.uint16)
    k = ew_kernel("k", [("h", "b16")], [("f", "f32"), ("g", "f32"), ("d", "f64")],
                  "\tcvt.f32.f16 %f, %h;\n\tcvt.f32.bf16 %g, %h;\n\tcvt.f64.f16 %d, %h;")
    f, g, d = run_ew(k, "k", [bits], ["f32", "f32", "f64"], block=256)
    ref16 = bits.view(np.float16).astype(np.float32)
    ok = ~np.isnan(ref16)
    np.testing.assert_array_equal(f[ok], ref16[ok])
    assert np.isnan(f[~ok]).all()
    refb = (bits.astype(np.uint32) << 16).view(np.float32)
    okb = ~np.isnan(refb)
    np.testing.assert_array_equal(g[okb], refb[okb])
    np.testing.assert_array_equal(d[ok], ref16[ok].astype(np.float64))


@pytest.mark.parametrize("mode", MODES)
def test_f64_narrowing_rounds_once(mode):
    x = np.concatenate([interesting_f32().astype(np.float64) * (1 + 2.0 ** -40),
                        [1 + 2.0 ** -11 + 2.0 ** -40, 1e300, -1e-300]])
    k = ew_kernel("k", [("a", "f64")], [("f", "f32"), ("h", "b16")],
                  f"\tcvt.{mode}.f32.f64 %f, %a;\n\tcvt.{mode}.f16.f64 %h, %a;")
    f, h = run_ew(k, "k", [x], ["f32", "b16"])
    for v, gf, gh in zip(x.tolist(), f.tolist(), h.tolist()):
        if math.isinf(v) or v == 0:
            continue
        assert gf == ref_round(Fraction(v), mode, "f32"), (mode, v)
        assert gh == f16_bits(ref_round(Fraction(v), mode, "f16")), (mode, v)


INT_TYPES = ["s8", "u8", "s16", "u16", "s32", "u32", "s64", "u64"]


@pytest.mark.parametrize("irnd", ["rni", "rzi", "rmi", "rpi"])
def test_float_to_int_rounds_and_saturates(irnd):
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.7, 2.7, 127.6, -128.6, 255.5, 300.0, -300.0,
                  4e9, -4e9, 1e19, 2e19, -1e19, np.nan, np.inf, -np.inf, 1e-40, 65535.5],
                 np.float32)
    outs = [(f"o{t}", t if int(t[1:]) >= 32 else t[0] + "32") for t in INT_TYPES]
    body = "\n".join(f"\tcvt.{irnd}.{t}.f32 %o{t}, %a;" for t in INT_TYPES)
    k = ew_kernel("k", [("a", "f32")], outs, body)
    res = run_ew(k, "k", [x], [t for _, t in outs])
    rnd = {"rni": round, "rzi": math.trunc, "rmi": math.floor, "rpi": math.ceil}[irnd]
    for t, col in zip(INT_TYPES, res):
        info = np.iinfo(np.dtype(("int" if t[0] == "s" else "uint") + t[1:]))
        for v, got in zip(x.tolist(), col.tolist()):
            if math.isnan(v):
                want = 0
            elif math.isinf(v):
                want = info.max if v > 0 else info.min
            else:
                want = min(max(rnd(Fraction(v)), info.min), info.max)
            assert got == want, (irnd, t, v)   # sub-32-bit results are sign/zero-extended


@pytest.mark.parametrize("mode", MODES)
def test_int_to_float_rounding(mode):
    vals = [0, 1, -1, 16777217, -16777217, 2**31 - 1, -(2**31), 2**53 + 1, 2**63 - 1,
            -(2**63), 65520, 65519, 33554435, 2**24 + 3]
    s64 = np.array(vals + [int(v) for v in RNG.integers(-(2**62), 2**62, 50)], np.int64)
    s32 = np.clip(s64, -(2**31), 2**31 - 1).astype(np.int32)
    u64 = s64.view(np.uint64)
    body = "\n".join([f"\tcvt.{mode}.f32.s64 %a, %x;", f"\tcvt.{mode}.f32.u64 %b, %y;",
                      f"\tcvt.{mode}.f32.s32 %c, %z;", f"\tcvt.{mode}.f16.s32 %h, %z;",
                      f"\tcvt.{mode}.bf16.s64 %g, %x;", f"\tcvt.{mode}.f64.u64 %d, %y;"])
    k = ew_kernel("k", [("x", "s64"), ("y", "u64"), ("z", "s32")],
                  [("a", "f32"), ("b", "f32"), ("c", "f32"), ("h", "b16"), ("g", "b16"),
                   ("d", "f64")], body, target="sm_90")   # cvt to .bf16 from ints: sm_90
    a, b, c, h, g, d = run_ew(k, "k", [s64, u64, s32], ["f32", "f32", "f32", "b16", "b16", "f64"])
    for i in range(len(s64)):
        x, y, z = int(s64[i]), int(u64[i]), int(s32[i])
        r = lambda v, f: ref_round(Fraction(v), mode, f) if v else 0.0  # noqa: E731
        assert a[i] == r(x, "f32") and b[i] == r(y, "f32") and c[i] == r(z, "f32"), (mode, x)
        assert h[i] == f16_bits(r(z, "f16")) and g[i] == bf16_bits(r(x, "bf16")), (mode, z, x)
        assert d[i] == r(y, "f64")


def test_int_to_int_truncate_extend_and_saturate():
    x = np.array([0, 1, -1, 127, 128, -128, -129, 255, 256, 65535, -65536, 2**31 - 1,
                  -(2**31), 300, -300], np.int32)
    cases = [("cvt.s32.s8", "s32", lambda v: (v + 128) % 256 - 128),
             ("cvt.u32.u8", "u32", lambda v: v % 256),
             ("cvt.u32.s16", "u32", lambda v: ((v + 32768) % 65536 - 32768) % 2**32),
             ("cvt.s64.s32", "s64", lambda v: v),
             ("cvt.u64.u32", "u64", lambda v: v % 2**32),
             ("cvt.sat.u8.s32", "u32", lambda v: min(max(v, 0), 255)),
             ("cvt.sat.s8.s32", "s32", lambda v: min(max(v, -128), 127)),
             ("cvt.sat.u32.s32", "u32", lambda v: max(v, 0)),
             ("cvt.sat.s16.u32", "s32", lambda v: min(v % 2**32, 32767)),
             ("cvt.u8.s32", "u32", lambda v: v % 256),
             ("cvt.s8.s32", "s32", lambda v: (v + 128) % 256 - 128)]
    outs = [(f"o{i}", t) for i, (_, t, _) in enumerate(cases)]
    body = "\n".join(f"\t{op} %o{i}, %x;" for i, (op, _, _) in enumerate(cases))
    k = ew_kernel("k", [("x", "s32")], outs, body)
    res = run_ew(k, "k", [x], [t for _, t in outs])
    for (op, t, ref), col in zip(cases, res):
        bits = int(t[1:])
        for v, got in zip(x.tolist(), col.tolist()):
            want = ref(v)
            if t[0] == "u":
                want %= 2**bits
            assert got == want, (op, v)


def test_float_to_float_integer_rounding_ftz_sat():
    x = np.array([2.5, -2.5, 3.5, 1e-40, -1e-40, 1.5, -0.2, 7.9], np.float32)
    k = ew_kernel("k", [("a", "f32")], [("n", "f32"), ("z", "f32"), ("m", "f32"), ("p", "f32"),
                                        ("f", "f32"), ("s", "f32"), ("d", "f64")],
                  "\tcvt.rni.f32.f32 %n, %a;\n\tcvt.rzi.f32.f32 %z, %a;\n"
                  "\tcvt.rmi.f32.f32 %m, %a;\n\tcvt.rpi.f32.f32 %p, %a;\n"
                  "\tcvt.ftz.f32.f32 %f, %a;\n\tcvt.sat.f32.f32 %s, %a;\n\tcvt.f64.f32 %d, %a;")
    n, z, m, p, f, s, d = run_ew(k, "k", [x], ["f32"] * 6 + ["f64"])
    np.testing.assert_array_equal(n, np.rint(x))
    np.testing.assert_array_equal(z, np.trunc(x))
    np.testing.assert_array_equal(m, np.floor(x))
    np.testing.assert_array_equal(p, np.ceil(x))
    assert f[3] == 0 and math.copysign(1, f[4]) == -1 and f[0] == 2.5
    np.testing.assert_array_equal(s, np.clip(x, 0, 1))
    np.testing.assert_array_equal(d, x.astype(np.float64))
