"""cp.async: zero-fill, commit/wait_group ordering, wait_all, and read-before-wait errors."""

import numpy as np
import pytest

from ptxc.emu import EmulationError

from .helpers import HEADER, line_of, run

ZERO_FILL = HEADER + r"""
// Thread i copies SIZE bytes from src + SIZE*i into shared with src-size ssz[i], then
// stores the shared bytes to out.
.visible .entry zero_fill(.param .u64 src_p, .param .u64 ssz_p, .param .u64 out_p)
{
	.reg .b32 %r<12>;
	.reg .b64 %rd<12>;
	.shared .align 16 .b8 sm[1024];
	ld.param.u64 %rd1, [src_p];
	ld.param.u64 %rd2, [ssz_p];
	ld.param.u64 %rd3, [out_p];
	mov.u32 %r1, %tid.x;
	mul.wide.u32 %rd4, %r1, 4;
	add.s64 %rd5, %rd2, %rd4;
	ld.global.u32 %r2, [%rd5];
	mul.wide.u32 %rd6, %r1, SIZE;
	add.s64 %rd7, %rd1, %rd6;
	mov.u32 %r3, sm;
	mad.lo.u32 %r4, %r1, SIZE, %r3;
	cp.async.LEVEL.shared.global [%r4], [%rd7], SIZE, %r2;
	cp.async.commit_group;
	cp.async.wait_group 0;
	add.s64 %rd8, %rd3, %rd6;
	LOADSTORE
	ret;
}
"""

_MOVE = {4: "ld.shared.u32 %r5, [%r4];\n\tst.global.u32 [%rd8], %r5;",
         8: "ld.shared.v2.u32 {%r5, %r6}, [%r4];\n\tst.global.v2.u32 [%rd8], {%r5, %r6};",
         16: "ld.shared.v4.u32 {%r5, %r6, %r7, %r8}, [%r4];\n"
             "\tst.global.v4.u32 [%rd8], {%r5, %r6, %r7, %r8};"}


@pytest.mark.parametrize("size, level", [(16, "cg"), (16, "ca"), (8, "ca"), (4, "ca")])
def test_src_size_zero_fills_the_rest(size, level):
    n = 64
    src = np.arange(n * size, dtype=np.uint8) % 251 + 1
    ssz = (np.arange(n) % (size // 4 + 1) * 4).astype(np.uint32)      # 0, 4, ..., size
    out = np.full(n * size, 0xEE, np.uint8)
    ptx = (ZERO_FILL.replace("SIZE", str(size)).replace("LEVEL", level)
           .replace("LOADSTORE", _MOVE[size]))
    run(ptx, "zero_fill", (1,), (n,), [src, ssz, out])
    for i in range(n):
        k = int(ssz[i])
        row = out[i * size:(i + 1) * size]
        np.testing.assert_array_equal(row[:k], src[i * size:i * size + k])
        assert not row[k:].any(), (i, k)


GROUPS = HEADER + r"""
// Two groups; wait_group 1 completes only the first. The source of the second copy is
// overwritten before its wait: the copy reads its source when the wait completes it.
.visible .entry groups(.param .u64 src_p, .param .u64 out_p)
{
	.reg .b32 %r<12>;
	.reg .b64 %rd<12>;
	.shared .align 16 .b8 sm[64];
	ld.param.u64 %rd1, [src_p];
	ld.param.u64 %rd2, [out_p];
	mov.u32 %r1, sm;
	cp.async.ca.shared.global [%r1], [%rd1], 4;
	cp.async.commit_group;
	cp.async.ca.shared.global [%r1+4], [%rd1+4], 4;
	cp.async.commit_group;
	cp.async.commit_group;                   // an empty group is complete at once
	cp.async.wait_group 2;
	ld.shared.u32 %r2, [%r1];                // first group: done
	mov.u32 %r3, 77;
	st.global.u32 [%rd1+4], %r3;             // second copy's source changes before its wait
	cp.async.wait_group 0;
	ld.shared.u32 %r4, [%r1+4];
	cp.async.ca.shared.global [%r1+8], [%rd1+8], 4;
	cp.async.wait_all;                       // commits the open copy and waits for it
	ld.shared.u32 %r5, [%r1+8];
	st.global.v4.u32 [%rd2], {%r2, %r4, %r5, %r5};
	ret;
}
"""


def test_commit_and_wait_group_ordering():
    src = np.array([11, 22, 33, 44], np.uint32)
    out = np.zeros(4, np.uint32)
    run(GROUPS, "groups", (1,), (1,), [src, out])
    assert out.tolist() == [11, 77, 33, 33]


def test_reading_a_pending_group_is_an_error():
    early = GROUPS.replace("cp.async.wait_group 2;\n\tld.shared.u32 %r2, [%r1];",
                           "cp.async.wait_group 2;\n\tld.shared.u32 %r2, [%r1+4];")
    with pytest.raises(EmulationError) as exc:
        run(early, "groups", (1,), (32,), [np.zeros(4, np.uint32), np.zeros(4, np.uint32)])
    msg = str(exc.value)
    assert "read of cp.async destination before cp.async.wait_group" in msg
    assert f"line {line_of(early, 'ld.shared.u32 %r2, [%r1+4]')}:" in msg
    assert "ctaid=(0, 0, 0)" in msg and "tid=(0, 0, 0)" in msg and "0x404" in msg
    assert exc.value.address == 0x404
