"""Undefined behaviour is reported with the kernel, PTX line and text, block, thread and
address of the first offending thread."""

import numpy as np
import pytest

from ptxc.emu import EmulationError

from .helpers import HEADER, line_of, run

GLOBAL_BASE = 0x1_0000_0000     # the first buffer's address (see ptxc/emu/memory.py)


def expect_error(ptx, entry, grid, block, args, line_text, pattern, ctaid, tid, address=None,
                 **kw):
    with pytest.raises(EmulationError) as exc:
        run(ptx, entry, grid, block, args, **kw)
    err = exc.value
    msg = str(err)
    line = line_of(ptx, line_text)
    assert f"kernel '{entry}'" in msg
    assert f"line {line}: `{line_text}" in msg, msg
    assert pattern in msg, msg
    assert f"ctaid=({ctaid[0]}, {ctaid[1]}, {ctaid[2]})" in msg, msg
    assert f"tid=({tid[0]}, {tid[1]}, {tid[2]})" in msg, msg
    assert (err.kernel, err.line, err.ctaid, err.tid) == (entry, line, ctaid, tid)
    if address is not None:
        assert f"0x{address:x}" in msg and err.address == address, msg
    return msg


COPY = HEADER + r"""
.visible .entry copy(.param .u64 src_p, .param .u64 dst_p, .param .u32 shift)
{
	.reg .b32 %r<8>;
	.reg .b64 %rd<8>;
	.reg .f32 %f<2>;
	ld.param.u64 %rd1, [src_p];
	ld.param.u64 %rd2, [dst_p];
	ld.param.u32 %r5, [shift];
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, %ctaid.x;
	mov.u32 %r3, %ntid.x;
	mad.lo.s32 %r4, %r2, %r3, %r1;
	mul.wide.u32 %rd3, %r4, 4;
	add.s64 %rd4, %rd1, %rd3;
	ld.global.f32 %f1, [%rd4];
	add.u32 %r6, %r4, %r5;
	mul.wide.u32 %rd5, %r6, 4;
	add.s64 %rd6, %rd2, %rd5;
	st.global.f32 [%rd6], %f1;
	ret;
}
"""


def test_global_out_of_bounds_read():
    src, dst = np.zeros(100, np.float32), np.zeros(200, np.float32)
    msg = expect_error(COPY, "copy", (2,), (64,), [src, dst, np.uint32(0)],
                       "ld.global.f32 %f1, [%rd4]", "out-of-bounds global load of 4 bytes",
                       (1, 0, 0), (36, 0, 0), GLOBAL_BASE + 400)
    assert "arg 0 'src_p'" in msg and "starts 0 bytes past the end" in msg


def test_global_out_of_bounds_write():
    src, dst = np.zeros(128, np.float32), np.zeros(128, np.float32)
    msg = expect_error(COPY, "copy", (2,), (64,), [src, dst, np.uint32(8)],
                       "st.global.f32 [%rd6], %f1", "out-of-bounds global store of 4 bytes",
                       (1, 0, 0), (56, 0, 0), GLOBAL_BASE + 768 + 512)
    assert "arg 1 'dst_p'" in msg


SHARED_OOB = HEADER + r"""
.visible .entry shared_oob(.param .u64 out_p)
{
	.reg .b32 %r<6>;
	.shared .align 4 .b8 buf[64];
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, buf;
	shl.b32 %r3, %r1, 2;
	add.s32 %r4, %r2, %r3;
	st.shared.u32 [%r4], %r1;
	ret;
}
"""


def test_shared_out_of_bounds():
    expect_error(SHARED_OOB, "shared_oob", (3,), (32,), [np.zeros(1, np.uint32)],
                 "st.shared.u32 [%r4], %r1", "out-of-bounds shared store of 4 bytes",
                 (0, 0, 0), (16, 0, 0), 0x400 + 64)


MISALIGNED = HEADER + r"""
.visible .entry misaligned(.param .u64 src_p)
{
	.reg .b64 %rd<4>;
	.reg .f32 %f<5>;
	ld.param.u64 %rd1, [src_p];
	ld.global.v4.f32 {%f1, %f2, %f3, %f4}, [%rd1+8];
	ret;
}
"""


def test_misaligned_vector_load():
    expect_error(MISALIGNED, "misaligned", (1,), (32,), [np.zeros(16, np.float32)],
                 "ld.global.v4.f32 {%f1, %f2, %f3, %f4}, [%rd1+8]",
                 "misaligned global load of 16 bytes", (0, 0, 0), (0, 0, 0), GLOBAL_BASE + 8)


UNINIT = HEADER + r"""
.visible .entry uninit(.param .u64 out_p)
{
	.reg .pred %p<2>;
	.reg .b32 %r<6>;
	.reg .b64 %rd<4>;
	.shared .align 4 .b8 buf[128];
	ld.param.u64 %rd1, [out_p];
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, buf;
	shl.b32 %r3, %r1, 2;
	add.s32 %r4, %r2, %r3;
	setp.ne.u32 %p1, %r1, 5;
	@%p1 st.shared.u32 [%r4], %r1;        // thread 5 forgets its slot
	bar.sync 0;
	xor.b32 %r5, %r3, 4;
	add.s32 %r5, %r2, %r5;
	ld.shared.u32 %r5, [%r5];             // read the neighbour's slot
	ret;
}
"""


def test_read_of_never_written_shared_memory():
    expect_error(UNINIT, "uninit", (1,), (32,), [np.zeros(1, np.uint32)],
                 "ld.shared.u32 %r5, [%r5]", "read of never-written shared memory",
                 (0, 0, 0), (4, 0, 0), 0x400 + 20)


NO_WAIT = HEADER + r"""
.visible .entry no_wait(.param .u64 src_p)
{
	.reg .b32 %r<4>;
	.reg .b64 %rd<4>;
	.shared .align 16 .b8 buf[512];
	ld.param.u64 %rd1, [src_p];
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, buf;
	shl.b32 %r3, %r1, 4;
	add.s32 %r2, %r2, %r3;
	cp.async.cg.shared.global [%r2], [%rd1], 16;
	cp.async.commit_group;
	bar.sync 0;
	ld.shared.u32 %r3, [%r2+12];
	ret;
}
"""


def test_read_of_cp_async_destination_without_wait():
    expect_error(NO_WAIT, "no_wait", (2,), (32,), [np.zeros(4, np.uint32)],
                 "ld.shared.u32 %r3, [%r2+12]",
                 "read of cp.async destination before cp.async.wait_group",
                 (0, 0, 0), (0, 0, 0), 0x400 + 12)


BAR_IN_IF = HEADER + r"""
.visible .entry bar_in_if(.param .u64 out_p)
{
	.reg .pred %p<2>;
	.reg .b32 %r<4>;
	mov.u32 %r1, %tid.x;
	and.b32 %r2, %r1, 1;
	setp.eq.u32 %p1, %r2, 1;
	@%p1 bra $L__skip;
	// only even threads get to this barrier
	bar.sync 0;
$L__skip:
	bar.sync 0;
	ret;
}
"""


def test_barrier_divergence():
    msg = expect_error(BAR_IN_IF, "bar_in_if", (1,), (64,), [np.zeros(1, np.uint32)],
                       "bar.sync 0",
                       "barrier divergence", (0, 0, 0), (0, 0, 0))
    assert f"line {line_of(BAR_IN_IF, '$L__skip:') + 1}" in msg   # the other barrier


SHFL_EXITED = HEADER + r"""
.visible .entry shfl_exited(.param .u64 out_p)
{
	.reg .pred %p<2>;
	.reg .b32 %r<4>;
	mov.u32 %r1, %tid.x;
	and.b32 %r2, %r1, 31;
	setp.eq.u32 %p1, %r2, 31;
	@%p1 exit;
	shfl.sync.down.b32 %r3, %r1, 1, 0x1f, 0x7fffffff;
	shfl.sync.bfly.b32 %r3, %r1, 1, 0x1f, 0xffffffff;
	ret;
}
"""


def test_shfl_naming_an_exited_lane():
    # lane 31 exited; its mask leaves it out, but lane 30's `down 1` still reads lane 31
    msg = expect_error(SHFL_EXITED, "shfl_exited", (1,), (64,), [np.zeros(1, np.uint32)],
                       "shfl.sync.down.b32 %r3, %r1, 1, 0x1f, 0x7fffffff",
                       "reads lane 31, which is not executing it", (0, 0, 0), (30, 0, 0))
    # clamping at lane 30 fixes the first shfl; the second names lane 31 in its mask
    fixed = SHFL_EXITED.replace("down.b32 %r3, %r1, 1, 0x1f", "down.b32 %r3, %r1, 1, 0x1e")
    msg = expect_error(fixed, "shfl_exited", (1,), (64,), [np.zeros(1, np.uint32)],
                       "shfl.sync.bfly.b32 %r3, %r1, 1, 0x1f, 0xffffffff",
                       "names lane(s) 31 that are not executing", (0, 0, 0), (0, 0, 0))
    assert msg


MMA_DIVERGED = HEADER + r"""
.visible .entry mma_diverged(.param .u64 out_p)
{
	.reg .pred %p<2>;
	.reg .b32 %r<8>;
	.reg .f32 %f<8>;
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, 0;
	mov.f32 %f0, 0f00000000;
	setp.lt.u32 %p1, %r1, 40;
	@%p1 bra $L__end;
	mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32
		{%f1, %f2, %f3, %f4}, {%r2, %r2, %r2, %r2}, {%r2, %r2}, {%f0, %f0, %f0, %f0};
$L__end:
	ret;
}
"""


def test_mma_in_a_diverged_warp():
    expect_error(MMA_DIVERGED, "mma_diverged", (1,), (64,), [np.zeros(1, np.uint32)],
                 "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
                 "lane(s) 0, 1, 2, 3, 4, 5, 6, 7 ... are not executing it",
                 (0, 0, 0), (40, 0, 0))


DIV_ZERO = HEADER + r"""
.visible .entry div_zero(.param .u64 out_p)
{
	.reg .b32 %r<4>;
	mov.u32 %r1, %tid.x;
	sub.u32 %r2, %r1, 7;
	div.u32 %r3, 100, %r2;
	ret;
}
"""


def test_integer_division_by_zero():
    expect_error(DIV_ZERO, "div_zero", (1,), (32,), [np.zeros(1, np.uint32)],
                 "div.u32 %r3, 100, %r2", "integer division by zero", (0, 0, 0), (7, 0, 0))


UNI = HEADER + r"""
.visible .entry not_uniform(.param .u64 out_p)
{
	.reg .pred %p<2>;
	.reg .b32 %r<4>;
	mov.u32 %r1, %tid.x;
	setp.lt.u32 %p1, %r1, 48;
	@%p1 bra.uni $L__end;
	add.u32 %r1, %r1, 1;
$L__end:
	ret;
}
"""


def test_bra_uni_with_a_divergent_predicate():
    expect_error(UNI, "not_uniform", (1,), (64,), [np.zeros(1, np.uint32)],
                 "@%p1 bra.uni $L__end", "bra.uni with a guard predicate that differs",
                 (0, 0, 0), (32, 0, 0))


LOOP = HEADER + r"""
.visible .entry forever(.param .u64 out_p)
{
$L__top:
	bra $L__top;
}
"""


def test_step_limit_stops_infinite_loops():
    expect_error(LOOP, "forever", (1,), (32,), [np.zeros(1, np.uint32)], "bra $L__top",
                 "step limit of 1000 instruction issues exceeded", (0, 0, 0), (0, 0, 0),
                 step_limit=1000)
