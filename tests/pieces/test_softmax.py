"""attention/softmax.py pieces in the emulator: the FMA-polynomial exp2 (FlashAttention-4's
emulation) against numpy's exp2, and exponentials' split between it and ex2.approx."""

import numpy as np
import pytest

from ptxc import emu
from ptxc.ir import F32, U64, Addr, KernelBuilder, render_module
from ptxc.kernels.attention.softmax import exp2_poly, exp2_poly_pairs, exponentials


def _unary_kernel(fn) -> str:
    b = KernelBuilder("unary")
    src, dst = (b.to_global(b.load_param(b.param(n, U64))) for n in ("x", "y"))
    off = b.mul_wide(b.special("%tid.x"), 4)
    y = fn(b, b.ld("global", F32, Addr(b.add(src, off))))
    b.st("global", F32, Addr(b.add(dst, off)), [y])
    b.ret()
    return render_module([b.entry], kernel="unary", family="test", target="sm_100a",
                         ptx_version="8.6")


def _pairs(b, x):
    """exp2_poly_pairs on (x, x + 0.5): the f32x2 form, both lanes checked."""
    lo, hi = exp2_poly_pairs(b, [x, b.add(x, 0.5)])
    return b.add(lo, b.mul(hi, 0.0))   # hi's lane is checked by test_exp2_poly_pairs_both_lanes


@pytest.mark.parametrize("fn", [exp2_poly, _pairs], ids=["scalar", "f32x2"])
def test_exp2_poly_matches_exp2(fn):
    """Relative error below 8.8e-5 over the range a softmax feeds it (scores against a stale max
    reach 2^8), exact powers of two at integers, and exactly +0 from -127 down, -inf included
    (a masked score); the f32x2 pair form gives the same."""
    xs = np.concatenate([np.linspace(-125.9, 8.0, 1000, dtype=np.float32),
                         np.float32([-np.inf, -200.0, -127.0, 0.0, -0.0, 3.0, -7.0, 1e-7, -1e-7, 0.999999])])
    xs = np.pad(xs, (0, 1024 - len(xs)))
    ys = np.zeros(1024, np.float32)
    emu.launch(_unary_kernel(fn), "unary", (1,), (1024,), [xs, ys])
    ref = np.exp2(xs.astype(np.float64))
    live = xs > -126
    assert (np.abs(ys[live] - ref[live]) / ref[live]).max() < 8.8e-5
    assert ys[1000:1003].tolist() == [0.0, 0.0, 0.0]
    assert ys[1003] == ys[1004] == 1.0 and ys[1005] == 8.0 and ys[1006] == 2.0 ** -7


def test_exponentials_spread_the_polynomial():
    """`poly` of every 8 exponentials go through the polynomial, spread evenly; 0 keeps ex2."""
    for poly, expect in ((0, 16), (1, 14), (2, 12), (4, 8), (8, 0)):
        b = KernelBuilder("k")
        vals = [b.mov(float(i), F32) for i in range(16)]
        exponentials(b, vals, b.mov(0.0, F32), 0.5, poly)
        assert sum(i.op == "ex2" for i in b.entry.body) == expect, poly


def test_exp2_poly_pairs_both_lanes():
    """The pair form's high lane (and an odd last value, scalar) match the scalar form exactly."""
    def three(b, x):
        a, c, d = exp2_poly_pairs(b, [x, b.add(x, 0.25), b.sub(x, 0.75)])
        ref = [exp2_poly(b, x), exp2_poly(b, b.add(x, 0.25)), exp2_poly(b, b.sub(x, 0.75))]
        same = b.and_(b.and_(b.setp("eq", a, ref[0]), b.setp("eq", c, ref[1])), b.setp("eq", d, ref[2]))
        return b.selp(1.0, 0.0, same, F32)
    xs = np.linspace(-120.0, 7.9, 1024, dtype=np.float32)
    ys = np.zeros(1024, np.float32)
    emu.launch(_unary_kernel(three), "unary", (1,), (1024,), [xs, ys])
    assert ys.tolist() == [1.0] * 1024
