"""shfl.sync in every mode against a pure-Python transcription of the PTX ISA pseudocode."""

import numpy as np
import pytest

from .helpers import HEADER, run

MODES = ["up", "down", "bfly", "idx"]


def isa_shfl(mode, lane, b, c):
    """PTX ISA, shfl.sync: returns (source lane j, predicate)."""
    bval = b & 0x1F
    cval = c & 0x1F
    segmask = (c >> 8) & 0x1F
    max_lane = (lane & segmask) | (cval & ~segmask)
    min_lane = lane & segmask
    if mode == "up":
        j = lane - bval
        pval = j >= max_lane
    elif mode == "down":
        j = lane + bval
        pval = j <= max_lane
    elif mode == "bfly":
        j = lane ^ bval
        pval = j <= max_lane
    else:
        j = min_lane | (bval & ~segmask)
        pval = j <= max_lane
    if not pval:
        j = lane
    return j, pval


def shfl_kernel(shfls: list) -> str:
    """shfls: list of (mode, b operand, c operand) written to out[k][tid]."""
    lines = [HEADER,
             ".visible .entry shfl_k(.param .u64 in_p, .param .u64 bc_p, .param .u64 out_p)",
             "{", "\t.reg .pred %p<2>;", "\t.reg .b32 %r<12>;", "\t.reg .b64 %rd<12>;",
             "\tld.param.u64 %rd1, [in_p];", "\tld.param.u64 %rd2, [bc_p];",
             "\tld.param.u64 %rd3, [out_p];", "\tmov.u32 %r1, %tid.x;", "\tmov.u32 %r2, %ctaid.x;",
             "\tmov.u32 %r3, %ntid.x;", "\tmad.lo.s32 %r4, %r2, %r3, %r1;",
             "\tmul.wide.u32 %rd4, %r4, 4;", "\tadd.s64 %rd5, %rd1, %rd4;",
             "\tld.global.u32 %r5, [%rd5];",                       # a: this lane's value
             "\tmul.wide.u32 %rd6, %r4, 8;", "\tadd.s64 %rd7, %rd2, %rd6;",
             "\tld.global.v2.u32 {%r6, %r7}, [%rd7];",             # per-thread b, c
             "\tmov.u32 %r10, %nctaid.x;", "\tmul.lo.s32 %r10, %r10, %r3;"]  # total threads
    for k, (mode, b, c) in enumerate(shfls):
        lines += [f"\tshfl.sync.{mode}.b32 %r8|%p1, %r5, {b}, {c}, -1;",
                  "\tselp.u32 %r9, 0x80000000, 0, %p1;", "\tor.b32 %r9, %r9, %r8;",
                  f"\tmad.lo.s32 %r11, %r10, {k}, %r4;", "\tmul.wide.u32 %rd8, %r11, 4;",
                  "\tadd.s64 %rd9, %rd3, %rd8;", "\tst.global.u32 [%rd9], %r9;"]
    lines += ["\tret;", "}", ""]
    return "\n".join(lines)


def check(shfls, b_arr, c_arr, nthreads=128, block=64):
    a = (np.arange(nthreads, dtype=np.uint32) * 7 + 1000) & 0x7FFFFFFF
    bc = np.stack([b_arr, c_arr], axis=1).astype(np.uint32)
    out = np.zeros((len(shfls), nthreads), np.uint32)
    run(shfl_kernel(shfls), "shfl_k", (nthreads // block,), (block,), [a, bc, out])
    for k, (mode, b, c) in enumerate(shfls):
        for t in range(nthreads):
            lane = t % 32
            bb = int(b_arr[t]) if b == "%r6" else int(b, 0) & 0xFFFFFFFF
            cc = int(c_arr[t]) if c == "%r7" else int(c, 0) & 0xFFFFFFFF
            j, p = isa_shfl(mode, lane, bb, cc)
            want = int(a[t - lane + j]) | (0x80000000 if p else 0)
            assert int(out[k, t]) == want, (mode, b, c, t, bb, cc)


@pytest.mark.parametrize("mode", MODES)
def test_register_b_and_c_random_per_thread(mode):
    rng = np.random.default_rng(hash(mode) % 1000)
    for _ in range(3):
        b = rng.integers(0, 64, 128)                       # includes values >= 32 (masked)
        c = rng.integers(0, 1 << 14, 128)                  # random clamp and segmask bits
        widths = np.array([1, 2, 4, 8, 16, 32])[rng.integers(0, 6, 128)]
        usual = np.where(rng.random(128) < 0.5, ((32 - widths) << 8) | 0x1F, (32 - widths) << 8)
        c = np.where(rng.random(128) < 0.5, c, usual)
        check([(mode, "%r6", "%r7")], b, c)


def test_immediate_patterns_used_by_cuda():
    shfls = []
    for w in (2, 4, 8, 16, 32):
        cw = f"{((32 - w) << 8) | 0x1F:#x}"
        for b in ("1", "2", "5", "16", "31"):
            shfls += [("bfly", b, cw), ("down", b, cw), ("idx", b, cw),
                      ("up", b, f"{(32 - w) << 8:#x}")]
    zeros = np.zeros(128)
    check(shfls, zeros, zeros)


PARTIAL = HEADER + r"""
// Lanes 0-15 shuffle among themselves with membermask 0xffff; lanes 16-31 go elsewhere.
.visible .entry half_warp(.param .u64 out_p)
{
	.reg .pred %p<3>;
	.reg .b32 %r<8>;
	.reg .b64 %rd<4>;
	ld.param.u64 %rd1, [out_p];
	mov.u32 %r1, %tid.x;
	mul.lo.u32 %r2, %r1, 10;
	mov.u32 %r3, 0;
	setp.ge.u32 %p1, %r1, 16;
	@%p1 bra $L__upper;
	shfl.sync.down.b32 %r3, %r2, 1, 0x0f, 0xffff;
	bra.uni $L__store;
$L__upper:
	shfl.sync.idx.b32 %r3, %r2, 19, 0x1f, 0xffff0000;
$L__store:
	mul.wide.u32 %rd2, %r1, 4;
	add.s64 %rd3, %rd1, %rd2;
	st.global.u32 [%rd3], %r3;
	ret;
}
"""


def test_partial_membermask_in_diverged_halves():
    out = np.zeros(32, np.uint32)
    run(PARTIAL, "half_warp", (1,), (32,), [out])
    lanes = np.arange(32)
    lower = np.where(lanes[:16] < 15, (lanes[:16] + 1) * 10, lanes[:16] * 10)
    np.testing.assert_array_equal(out[:16], lower)
    np.testing.assert_array_equal(out[16:], 190)        # every upper lane reads lane 19


VOTE = HEADER + r"""
// Each warp's ballot of (value % 3 == 0); then lanes 0-15 vote among themselves (0xffff).
.visible .entry vote_k(.param .u64 in_p, .param .u64 out_p)
{
	.reg .pred %p<3>;
	.reg .b32 %r<10>;
	.reg .b64 %rd<6>;
	ld.param.u64 %rd1, [in_p];
	ld.param.u64 %rd2, [out_p];
	mov.u32 %r1, %tid.x;
	mul.wide.u32 %rd3, %r1, 4;
	add.s64 %rd4, %rd1, %rd3;
	ld.global.u32 %r2, [%rd4];
	rem.u32 %r3, %r2, 3;
	setp.eq.u32 %p1, %r3, 0;
	vote.sync.ballot.b32 %r4, %p1, -1;
	mov.u32 %r5, 0;
	and.b32 %r6, %r1, 31;
	setp.ge.u32 %p2, %r6, 16;
	@%p2 bra $L__store;
	vote.sync.ballot.b32 %r5, %p1, 0xffff;
$L__store:
	mul.wide.u32 %rd3, %r1, 8;
	add.s64 %rd5, %rd2, %rd3;
	st.global.v2.u32 [%rd5], {%r4, %r5};
	ret;
}
"""


def test_vote_ballot_whole_and_partial_warps():
    """vote.sync.ballot: bit i is lane i's predicate, within each warp (and, with a 16-lane
    membermask, among those lanes only)."""
    rng = np.random.default_rng(5)
    a = rng.integers(0, 1000, 96).astype(np.uint32)
    out = np.zeros((96, 2), np.uint32)
    run(VOTE, "vote_k", (1,), (96,), [a, out])
    for w in range(3):
        bits = [int(a[32 * w + lane] % 3 == 0) << lane for lane in range(32)]
        whole, half = sum(bits), sum(bits[:16])
        np.testing.assert_array_equal(out[32 * w:32 * w + 32, 0], whole)
        np.testing.assert_array_equal(out[32 * w:32 * w + 16, 1], half)
        np.testing.assert_array_equal(out[32 * w + 16:32 * w + 32, 1], 0)


def test_vote_with_an_absent_member_is_a_fault():
    """A membermask naming lanes that took the other branch: undefined in PTX, a Fault here."""
    from ptxc.errors import EmulationError
    bad = VOTE.replace("vote.sync.ballot.b32 %r5, %p1, 0xffff;", "vote.sync.ballot.b32 %r5, %p1, -1;")
    with pytest.raises(EmulationError, match="vote.sync membermask .* not executing it"):
        run(bad, "vote_k", (1,), (32,), [np.zeros(32, np.uint32), np.zeros((32, 2), np.uint32)])
