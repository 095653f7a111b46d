"""cp.async.bulk.tensor (TMA) with the emulator's TensorMap: a 2-D box at odd coordinates
(partly outside the tensor: zero fill) lands in shared memory in box order, swizzled per the
ISA's address-bit XOR (computed here per element), after an mbarrier wait."""

import numpy as np
import pytest

from ptxc.emu import TensorMap
from ptxc.errors import EmulationError

from .helpers import run

HEADER = ".version 8.0\n.target sm_90a\n.address_size 64\n"

KERNEL = HEADER + r"""
.visible .entry tma_k(.param .align 64 .b8 tmap[128], .param .u64 out_p, .param .s32 c0_p,
                      .param .s32 c1_p, .param .u32 bytes_p)
{
	.reg .b32 %r<16>;
	.reg .b64 %rd<8>;
	.reg .pred %p<4>;
	.shared .align 1024 .b8 buf[2048];
	.shared .align 8 .b64 bar;
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, bar;
	mov.u32 %r3, buf;
	ld.param.s32 %r4, [c0_p];
	ld.param.s32 %r5, [c1_p];
	ld.param.u32 %r6, [bytes_p];
	setp.eq.u32 %p1, %r1, 0;
	@%p1 mbarrier.init.shared::cta.b64 [%r2], 1;
	bar.sync 0;
	@%p1 mbarrier.arrive.expect_tx.shared::cta.b64 %rd1, [%r2], %r6;
	mov.u64 %rd5, tmap;
	cvta.param.u64 %rd5, %rd5;
	@%p1 cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%r3], [%rd5, {%r4, %r5}], [%r2];
WAIT:
	mbarrier.try_wait.parity.shared::cta.b64 %p2, [%r2], 0;
	@!%p2 bra WAIT;
	shl.b32 %r7, %r1, 4;
	setp.ge.u32 %p3, %r7, %r6;           // only the box's bytes were written
	@%p3 bra DONE;
	add.u32 %r8, %r3, %r7;
	ld.shared.v4.u32 {%r9, %r10, %r11, %r12}, [%r8];
	ld.param.u64 %rd2, [out_p];
	mul.wide.u32 %rd3, %r1, 16;
	add.s64 %rd4, %rd2, %rd3;
	st.global.v4.u32 [%rd4], {%r9, %r10, %r11, %r12};
DONE:
	ret;
}
"""


def expected_image(t, box, c0, c1, swizzle):
    rows, cols = box[1], box[0]
    img = np.zeros(rows * cols * 2, np.uint8)
    for r in range(rows):
        for c in range(cols):
            y, x = c1 + r, c0 + c
            v = t[y, x] if 0 <= y < t.shape[0] and 0 <= x < t.shape[1] else 0
            a = (r * cols + c) * 2
            if swizzle:
                a ^= ((a >> 7) % (swizzle // 16)) << 4
            img[a:a + 2] = np.frombuffer(np.uint16(v).tobytes(), np.uint8)
    return img


@pytest.mark.parametrize("swizzle, box, c0, c1", [(128, (64, 16), 3, 30), (0, (24, 8), -5, -2),
                                                  (64, (32, 16), 40, 0)])
def test_tma_box_zero_fill_and_swizzle(swizzle, box, c0, c1):
    t = np.random.default_rng(1).integers(1, 65535, (37, 50), dtype=np.uint16)
    nbytes = box[0] * box[1] * 2
    out = np.zeros(128 * 16, np.uint8)
    run(KERNEL, "tma_k", (1,), (128,), [TensorMap(t, box, swizzle), out, np.int32(c0),
                                         np.int32(c1), np.uint32(nbytes)])
    np.testing.assert_array_equal(out[:nbytes], expected_image(t, box, c0, c1, swizzle))


def test_tma_needs_a_tensor_map_and_a_valid_box():
    t = np.zeros((8, 64), np.uint16)
    with pytest.raises(EmulationError, match="TensorMap"):
        run(KERNEL, "tma_k", (1,), (128,), [bytes(128), np.zeros(2048, np.uint8), np.int32(0),
                                             np.int32(0), np.uint32(1024)])
    with pytest.raises(Exception, match="equal to the swizzle width"):
        run(KERNEL, "tma_k", (1,), (128,), [TensorMap(t, (32, 8), 128),
                                             np.zeros(2048, np.uint8), np.int32(0),
                                             np.int32(0), np.uint32(512)])
