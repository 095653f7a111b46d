"""Smaller features: div.approx/full, f64 rcp/sqrt, activemask, bar.warp.sync,
barrier.sync, lane masks, fences, 64-bit shared addresses, .reqntid/.maxntid."""

import math
from fractions import Fraction

import numpy as np
import pytest

from ptxc.emu import launch
from ptxc.errors import InputError

from .helpers import HEADER, ew_kernel, ref_round, run, run_ew


def test_div_approx_full_and_f64_rcp_sqrt():
    a = np.array([1.0, 10.0, -7.5, 3.0, 1e-3], np.float32)
    b = np.array([3.0, 7.0, 2.5, -9.0, 4.0], np.float32)
    k = ew_kernel("k", [("a", "f32"), ("b", "f32"), ("x", "f64")],
                  [("p", "f32"), ("f", "f32"), ("r", "f64"), ("s", "f64"), ("q", "f64"),
                   ("t", "f64")],
                  "\tdiv.approx.f32 %p, %a, %b;\n\tdiv.full.ftz.f32 %f, %a, %b;\n"
                  "\trcp.rn.f64 %r, %x;\n\tsqrt.rn.f64 %s, %x;\n\tsqrt.rz.f64 %q, %x;\n"
                  "\tsqrt.rp.f64 %t, %x;")
    x = np.array([2.0, 3.0, 10.0, 0.5, 1e300])
    p, f, r, s, q, t = run_ew(k, "k", [a, b, x], ["f32", "f32", "f64", "f64", "f64", "f64"])
    np.testing.assert_array_max_ulp(p, a / b, maxulp=2)      # hardware: within 2 ulp
    np.testing.assert_array_max_ulp(f, a / b, maxulp=2)
    np.testing.assert_array_equal(r, 1.0 / x)
    np.testing.assert_array_equal(s, np.sqrt(x))
    for v, lo, hi in zip(x.tolist(), q.tolist(), t.tolist()):
        assert Fraction(lo) ** 2 <= Fraction(v) <= Fraction(hi) ** 2
        assert hi == lo or hi == math.nextafter(lo, math.inf)
        assert (hi == lo) == (Fraction(lo) ** 2 == Fraction(v))
    assert float(r[1]) == ref_round(Fraction(1, 3), "rn", "f64")


WARP_MISC = HEADER + r"""
.visible .entry warp_misc(.param .u64 out_p)
{
	.reg .pred %p<2>;
	.reg .b32 %r<12>;
	.reg .b64 %rd<6>;
	.shared .align 8 .b8 buf[256];
	ld.param.u64 %rd1, [out_p];
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, %lanemask_lt;
	mov.u32 %r3, %lanemask_ge;
	mov.u32 %r7, %lanemask_eq;
	mov.u32 %r8, %lanemask_le;
	mov.u32 %r9, %lanemask_gt;
	mov.u32 %r10, %nwarpid;
	and.b32 %r4, %r1, 3;
	setp.eq.u32 %p1, %r4, 0;
	mov.u32 %r5, 0;
	@%p1 bra $L__skip;
	activemask.b32 %r5;                  // lanes with tid % 4 != 0
$L__skip:
	bar.warp.sync 0xffffffff;
	membar.cta;
	fence.acq_rel.gpu;
	mov.u64 %rd2, buf;                   // 64-bit shared address register
	mul.wide.u32 %rd3, %r1, 8;
	add.s64 %rd4, %rd2, %rd3;
	st.shared.u32 [%rd4], %r1;
	barrier.sync 0;
	ld.shared.u32 %r6, [%rd4];
	mul.wide.u32 %rd5, %r1, 16;
	add.s64 %rd5, %rd1, %rd5;
	st.global.v4.u32 [%rd5], {%r2, %r3, %r5, %r6};
	st.global.v4.u32 [%rd5+512], {%r7, %r8, %r9, %r10};
	ret;
}
"""


def test_activemask_lanemasks_fences_and_64bit_shared_addresses():
    out = np.zeros((64, 4), np.uint32)
    run(WARP_MISC, "warp_misc", (1,), (32,), [out])
    more, out = out[32:], out[:32]
    lane = np.arange(32, dtype=np.uint64)
    np.testing.assert_array_equal(out[:, 0], (1 << lane) - 1)
    np.testing.assert_array_equal(out[:, 1], 0xFFFFFFFF ^ ((1 << lane) - 1))
    active = sum(1 << i for i in range(32) if i % 4)
    np.testing.assert_array_equal(out[:, 2], np.where(lane % 4 == 0, 0, active))
    np.testing.assert_array_equal(out[:, 3], lane)
    np.testing.assert_array_equal(more[:, 0], 1 << lane)
    np.testing.assert_array_equal(more[:, 1], (2 << lane) - 1)
    np.testing.assert_array_equal(more[:, 2], 0xFFFFFFFF ^ ((2 << lane) - 1))
    assert (more[:, 3] == 1).all()                    # %nwarpid: warps per CTA


REQ = HEADER + r"""
.visible .entry req(.param .u64 out_p)
.reqntid 64, 1, 1
{
	ret;
}

.visible .entry maxn(.param .u64 out_p)
.maxntid 64
{
	ret;
}
"""


def test_reqntid_and_maxntid_are_enforced():
    run(REQ, "req", (1,), (64,), [np.zeros(1)])
    with pytest.raises(InputError, match=r"requires block \(64, 1, 1\) \(\.reqntid\)"):
        launch(REQ, "req", (1,), (32,), [np.zeros(1)])
    launch(REQ, "maxn", (1,), (32, 2), [np.zeros(1)])
    with pytest.raises(InputError, match="at most"):
        launch(REQ, "maxn", (1,), (65,), [np.zeros(1)])
