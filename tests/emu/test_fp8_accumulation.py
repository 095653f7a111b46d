"""The FP8 tensor cores' accumulation (emu/fp8.accumulate), the rule wgmma and mma.sync over
e4m3 / e5m2 follow in the emulator: the properties the public probes describe, each on numbers
small enough to read. That the rule reproduces the H200 is
tests/families/test_mla_qk_e4m3.py::test_fp8_wgmma_scores_fail_as_on_the_h200."""

import numpy as np

from ptxc.emu.fp8 import accumulate


def test_c_keeps_thirteen_mantissa_bits():
    """Zero products: D is C with f32's lowest 10 mantissa bits zeroed (SageAttention2's probe),
    toward zero for either sign."""
    c = np.array([1 + 2**-13 + 2**-14 + 2**-23, -(1 + 2**-13 + 2**-20), 2.0**-126 * 3])
    got = accumulate(np.zeros((3, 32)), c)
    np.testing.assert_array_equal(got, [1 + 2**-13, -(1 + 2**-13), 2.0**-126 * 3])


def test_terms_align_to_the_largest_and_truncate_toward_zero():
    """Each term keeps the bits down to 2^-13 of the largest term's leading bit: a product
    below that grid vanishes whatever its sign, and one astride it loses its tail."""
    p = np.zeros((1, 32))
    p[0, :3] = [1.0, 2**-14, -(2**-12 + 2**-15)]
    np.testing.assert_array_equal(accumulate(p, np.zeros(1)), [1.0 - 2**-12])
    np.testing.assert_array_equal(accumulate(p, np.zeros(1), mode="exact"),
                                  [1.0 + 2**-14 - 2**-12 - 2**-15])


def test_a_chain_shrinks_toward_zero_and_non_finite_sums_propagate():
    """Ten steps through C lose more than one step of the same products (the reason promotion
    helps); NaN and inf come out as float64 gives them."""
    rng = np.random.default_rng(0)
    p = rng.standard_normal((10, 32)) * 4 + 1
    chained = np.zeros(1)
    for step in p:
        chained = accumulate(step[None], chained).astype(np.float32).astype(np.float64)
    promoted = sum(accumulate(step[None], np.zeros(1)) for step in p)
    exact = p.sum()
    assert abs(chained[0] - exact) > abs(promoted[0] - exact)
    q = np.zeros((2, 32))
    q[0, 0], q[1, 0] = np.nan, np.inf
    got = accumulate(q, np.zeros(2))
    assert np.isnan(got[0]) and got[1] == np.inf
