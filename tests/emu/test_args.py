"""Launch arguments: counts and types are checked, buffers are copied back in place."""

import numpy as np
import pytest

from ptxc.emu import LaunchStats, launch
from ptxc.errors import InputError

from .helpers import HEADER, run

KERNEL = HEADER + r"""
.visible .entry fill(
	.param .u64 out,
	.param .u32 n,
	.param .s64 bias,
	.param .f32 scale
)
{
	.reg .pred %p<2>;
	.reg .b32 %r<4>;
	.reg .b64 %rd<6>;
	.reg .f32 %f<3>;
	ld.param.u64 %rd1, [out];
	ld.param.u32 %r1, [n];
	ld.param.s64 %rd2, [bias];
	ld.param.f32 %f1, [scale];
	cvta.to.global.u64 %rd1, %rd1;
	mov.u32 %r2, %tid.x;
	setp.ge.u32 %p1, %r2, %r1;
	@%p1 bra $L__end;
	cvt.rn.f32.u32 %f2, %r2;
	mul.rn.f32 %f2, %f2, %f1;
	cvt.rn.f32.s64 %f0, %rd2;
	add.rn.f32 %f2, %f2, %f0;
	mul.wide.u32 %rd3, %r2, 4;
	add.s64 %rd4, %rd1, %rd3;
	st.global.f32 [%rd4], %f2;
$L__end:
	ret;
}
"""


def good_args(out):
    return [out, np.uint32(10), np.int64(-3), np.float32(0.5)]


def test_buffers_are_copied_back_in_place_and_stats_returned():
    out = np.full((2, 8), -1.0, np.float32)
    view = out[0]
    stats = run(KERNEL, "fill", (1,), (16,), good_args(out))
    expect = np.full(16, -1.0, np.float32)
    expect[:10] = np.arange(10) * 0.5 - 3
    np.testing.assert_array_equal(out.reshape(-1), expect)
    assert view[1] == -2.5                      # same memory, updated in place
    assert isinstance(stats, LaunchStats) and stats.thread_instructions > 0
    assert stats.wall_time_s > 0 and stats.thread_instructions_per_s > 0


def test_non_contiguous_buffer():
    base = np.zeros(32, np.float32)
    out = base[::2]
    run(KERNEL, "fill", (1,), (16,), good_args(out))
    assert out[4] == pytest.approx(-1.0) and base[1] == 0


@pytest.mark.parametrize("args, pattern", [
    (lambda o: [o, np.uint32(1), np.int64(0)], r"takes 4 parameter\(s\) .*got 3"),
    (lambda o: [o, 10, np.int64(0), np.float32(1)],
     r"param 1 'n' \(\.u32\) expects a numpy\.uint32 scalar, got int 10"),
    (lambda o: [o, np.int32(10), np.int64(0), np.float32(1)],
     r"param 1 'n' \(\.u32\) expects a numpy\.uint32 scalar, got numpy\.int32"),
    (lambda o: [o, np.uint32(10), np.int64(0), np.float64(1)],
     r"param 3 'scale' \(\.f32\) expects a numpy\.float32 scalar, got numpy\.float64"),
    (lambda o: [o, np.uint32(10), np.int64(0), 1.0], r"param 3 'scale'.*got float 1\.0"),
    (lambda o: [np.uint64(0), o, np.int64(0), np.float32(1)],
     r"param 1 'n' \(\.u32\) is not a pointer \(\.u64\) parameter, got a numpy array"),
    (lambda o: [o, np.uint32(10), np.int64(0), np.array(1.0, np.float32)],
     r"param 3 'scale' \(\.f32\) is not a pointer"),
])
def test_argument_errors(args, pattern):
    out = np.zeros(16, np.float32)
    with pytest.raises(InputError, match=pattern):
        launch(KERNEL, "fill", (1,), (16,), args(out))


@pytest.mark.parametrize("grid, block, pattern", [
    ((0,), (16,), "grid must be a tuple of 1 to 3 positive ints"),
    ([1], (16,), "grid must be a tuple"),
    ((1,), (1, 2, 3, 4), "block must be a tuple"),
    ((1,), (64, 32), "more than 1024"),
])
def test_launch_shape_errors(grid, block, pattern):
    with pytest.raises(InputError, match=pattern):
        launch(KERNEL, "fill", grid, block, good_args(np.zeros(16, np.float32)))


def test_read_only_input_is_allowed_but_not_writable():
    out = np.zeros(16, np.float32)
    out.flags.writeable = False
    with pytest.raises(InputError, match="wrote to arg 0, a read-only numpy array"):
        launch(KERNEL, "fill", (1,), (16,), good_args(out))


def test_dynamic_shared_memory_limit():
    with pytest.raises(InputError, match="more than the 166912 bytes a CTA may have on sm_80"):
        launch(KERNEL, "fill", (1,), (16,), good_args(np.zeros(16, np.float32)),
               dynamic_smem_bytes=200_000)
