"""sm_90 warp helpers: elect.sync (leader = lowest lane of the mask), setmaxnreg (the CTA's
register pool, operand and warpgroup checks), stmatrix (the inverse of ldmatrix, checked by reading rows back)."""

import numpy as np
import pytest

from ptxc.emu import launch
from ptxc.errors import EmulationError

from .helpers import run

HEADER = ".version 8.0\n.target sm_90a\n.address_size 64\n"

ELECT = HEADER + r"""
.visible .entry elect_k(.param .u64 out_p, .param .u32 mask_p)
{
	.reg .b32 %r<8>;
	.reg .b64 %rd<4>;
	.reg .pred %p<2>;
	mov.u32 %r1, %tid.x;
	ld.param.u32 %r2, [mask_p];
	and.b32 %r3, %r1, 31;
	shr.u32 %r4, %r2, %r3;
	and.b32 %r4, %r4, 1;
	setp.eq.u32 %p1, %r4, 0;
	@%p1 bra DONE;
	elect.sync %r5|%p0, %r2;
	selp.u32 %r6, 1000, 0, %p0;
	add.u32 %r6, %r6, %r5;
	ld.param.u64 %rd1, [out_p];
	mul.wide.u32 %rd2, %r1, 4;
	add.s64 %rd3, %rd1, %rd2;
	st.global.u32 [%rd3], %r6;
DONE:
	ret;
}
"""


@pytest.mark.parametrize("mask", [0xFFFFFFFF, 0xF0F00000, 0x80000000])
def test_elect_sync_elects_the_lowest_lane(mask):
    out = np.full(64, 7, np.uint32)
    run(ELECT, "elect_k", (1,), (64,), [out, np.uint32(mask)])
    lanes = np.arange(64) % 32
    member = ((mask >> lanes) & 1) == 1
    leader = (mask & -mask).bit_length() - 1
    expect = np.where(member, leader + 1000 * (lanes == leader), 7)
    np.testing.assert_array_equal(out, expect)


def test_elect_sync_names_absent_lanes():
    bad = ELECT.replace("elect.sync %r5|%p0, %r2;", "elect.sync %r5|%p0, -1;")
    with pytest.raises(EmulationError, match="not executing it"):
        run(bad, "elect_k", (1,), (32,), [np.zeros(32, np.uint32), np.uint32(0xFFFF)])


SETMAXNREG = HEADER + r"""
.visible .entry regs_k()
{
	.reg .b32 %r<2>;
	.reg .pred %p<2>;
	mov.u32 %r1, %tid.x;
	setp.ge.u32 %p1, %r1, LAST;
	@%p1 bra $RELEASE;
	setmaxnreg.inc.sync.aligned.u32 INC;    // before the release in program order: it waits
	ret;
$RELEASE:
	setmaxnreg.dec.sync.aligned.u32 DEC;
	ret;
}
"""


def regs_kernel(last: int, inc: int, dec: int) -> str:
    """Warpgroups below thread `last` raise their count to `inc`, the rest lower it to `dec`."""
    return SETMAXNREG.replace("LAST", str(last)).replace("INC", str(inc)).replace("u32 DEC;", f"u32 {dec};")


def test_setmaxnreg_moves_registers_through_the_pool():
    """CUTLASS's budget at 384 threads (168 each at entry): a producer warpgroup at 24 gives
    two consumer warpgroups 240 -- exactly the pool; the consumers' .inc, reached first,
    waits for the producer's .dec. One register more a consumer thread, or a producer that
    keeps 32, and the last .inc waits for ever: reported with the pool, not as a pass."""
    run(regs_kernel(256, 240, 24), "regs_k", (2,), (384,), [])
    run(regs_kernel(128, 256, 40), "regs_k", (1,), (256,), [])      # 255 at entry: 256 held
    for inc, dec in ((248, 24), (240, 32)):
        with pytest.raises(EmulationError, match="setmaxnreg.inc waits for ever: the CTA's "
                                                 "register pool holds"):
            run(regs_kernel(256, inc, dec), "regs_k", (1,), (384,), [])
    with pytest.raises(EmulationError, match="may only raise the count"):   # 168 at entry
        run(regs_kernel(256, 160, 24), "regs_k", (1,), (384,), [])
    # every warpgroup converged on one .dec, then one .inc back: what it released suffices
    both = HEADER + ".visible .entry regs_k()\n{\n\tsetmaxnreg.dec.sync.aligned.u32 40;\n" \
        "\tsetmaxnreg.inc.sync.aligned.u32 160;\n\tret;\n}\n"
    run(both, "regs_k", (2,), (384,), [])


def test_setmaxnreg_pool_follows_minnctapersm():
    """.minnctapersm 2 at 256 threads: 128 registers on entry (varlen's warp-specialised packed
    tile): a producer at 56 gives the consumers 200 -- exactly the pool; 208 waits for ever,
    and the .minnctapersm 1 entry count (255) would make 200 a decrease."""
    two = lambda inc, dec: regs_kernel(128, inc, dec).replace(     # noqa: E731
        ".visible .entry regs_k()", ".visible .entry regs_k()\n.maxntid 256, 1, 1\n.minnctapersm 2")
    run(two(200, 56), "regs_k", (2,), (256,), [])
    with pytest.raises(EmulationError, match="setmaxnreg.inc waits for ever: .* started with 128 a thread"):
        run(two(208, 56), "regs_k", (1,), (256,), [])
    with pytest.raises(EmulationError, match="may only raise the count"):     # 256 at entry
        run(regs_kernel(128, 200, 56), "regs_k", (1,), (256,), [])


def test_setmaxnreg_checks_its_operand_and_warpgroups():
    with pytest.raises(EmulationError, match="whole warpgroups"):
        run(regs_kernel(64, 240, 40), "regs_k", (1,), (96,), [])
    with pytest.raises(EmulationError, match="multiple of 8"):     # ptxas refuses it too
        launch(regs_kernel(128, 241, 40), "regs_k", (1,), (256,), [])


STMATRIX = HEADER + r"""
.visible .entry stm_k(.param .u64 in_p, .param .u64 out_p)
{
	.reg .b32 %r<16>;
	.reg .b64 %rd<8>;
	.shared .align 16 .b8 tile[512];
	mov.u32 %r1, %tid.x;
	ld.param.u64 %rd1, [in_p];
	mul.wide.u32 %rd2, %r1, 16;
	add.s64 %rd3, %rd1, %rd2;
	ld.global.v4.u32 {%r2, %r3, %r4, %r5}, [%rd3];
	mov.u32 %r6, tile;
	shl.b32 %r7, %r1, 4;
	add.u32 %r8, %r6, %r7;               // lane l gives row l (16 bytes) of the 4 matrices
	stmatrix.sync.aligned.m8n8.x4{TRANS}.shared.b16 [%r8], {%r2, %r3, %r4, %r5};
	bar.warp.sync -1;
	ld.shared.v4.u32 {%r9, %r10, %r11, %r12}, [%r8];
	ld.param.u64 %rd4, [out_p];
	add.s64 %rd5, %rd4, %rd2;
	st.global.v4.u32 [%rd5], {%r9, %r10, %r11, %r12};
	ret;
}
"""


@pytest.mark.parametrize("trans", [False, True])
def test_stmatrix_x4(trans):
    rng = np.random.default_rng(5)
    frags = rng.integers(0, 65536, (32, 4, 2), dtype=np.uint16)   # [lane, register, half]
    out = np.zeros((32, 8), np.uint16)
    ptx = STMATRIX.replace("{TRANS}", ".trans" if trans else "")
    run(ptx, "stm_k", (1,), (32,), [frags.copy(), out])
    mats = np.zeros((4, 8, 8), np.uint16)       # the PTX ISA fragment figure for m8n8.b16
    for lane in range(32):
        for i in range(4):
            for h in range(2):
                r, c = lane // 4, 2 * (lane % 4) + h
                if trans:
                    mats[i, c, r] = frags[lane, i, h]
                else:
                    mats[i, r, c] = frags[lane, i, h]
    np.testing.assert_array_equal(out.reshape(4, 8, 8), mats)
