"""Predication, divergence and reconvergence, loops, exit, barriers, special registers,
partial warps and CTA batching."""

import numpy as np
import pytest

from .helpers import HEADER, run

DIVERGE = HEADER + r"""
// x = tid; for i in 0 .. n-1: if ((tid + i) % 3 == 0) x += i; else x ^= i * tid;
// then a per-thread trip-count loop: repeat (tid % 5) times: x = x * 3 + 1
.visible .entry diverge(.param .u64 out_p, .param .u32 n)
{
	.reg .pred %p<4>;
	.reg .b32 %r<16>;
	.reg .b64 %rd<4>;
	ld.param.u64 %rd1, [out_p];
	ld.param.u32 %r1, [n];
	mov.u32 %r2, %tid.x;
	mov.u32 %r3, %r2;                    // x
	mov.u32 %r4, 0;                      // i
$L__loop:
	add.u32 %r5, %r2, %r4;
	rem.u32 %r6, %r5, 3;
	setp.eq.u32 %p1, %r6, 0;
	@!%p1 bra $L__else;
	add.u32 %r3, %r3, %r4;
	bra $L__join;
$L__else:
	mul.lo.u32 %r7, %r4, %r2;
	xor.b32 %r3, %r3, %r7;
$L__join:
	add.u32 %r4, %r4, 1;
	setp.lt.u32 %p2, %r4, %r1;
	@%p2 bra $L__loop;
	rem.u32 %r8, %r2, 5;
$L__trip:
	setp.eq.u32 %p3, %r8, 0;
	@%p3 bra $L__done;
	mad.lo.u32 %r3, %r3, 3, 1;
	sub.u32 %r8, %r8, 1;
	bra $L__trip;
$L__done:
	mul.wide.u32 %rd2, %r2, 4;
	add.s64 %rd3, %rd1, %rd2;
	st.global.u32 [%rd3], %r3;
	ret;
}
"""


def test_if_else_in_loop_and_per_thread_trip_counts():
    out = np.zeros(96, np.uint32)
    stats = run(DIVERGE, "diverge", (1,), (96,), [out, np.uint32(20)])
    for t in range(96):
        x = t
        for i in range(20):
            x = (x + i) if (t + i) % 3 == 0 else x ^ (i * t)
        for _ in range(t % 5):
            x = (x * 3 + 1) & 0xFFFFFFFF
        assert out[t] == x, t
    assert stats.thread_instructions < 96 * 20 * 12     # diverged paths are not all executed


PRED = HEADER + r"""
.visible .entry pred(.param .u64 out_p)
{
	.reg .pred %p<3>;
	.reg .b32 %r<8>;
	.reg .b64 %rd<4>;
	ld.param.u64 %rd1, [out_p];
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, 100;
	and.b32 %r3, %r1, 1;
	setp.eq.u32 %p1, %r3, 1;
	@%p1 add.u32 %r2, %r2, %r1;          // odd threads
	@!%p1 sub.u32 %r2, %r2, %r1;         // even threads
	setp.gt.u32 %p2, %r1, 40;
	@%p2 exit;                            // threads 41.. leave early
	mul.wide.u32 %rd2, %r1, 4;
	add.s64 %rd3, %rd1, %rd2;
	st.global.u32 [%rd3], %r2;
	ret;
}
"""


def test_guarded_instructions_and_early_exit_with_a_partial_warp():
    out = np.zeros(50, np.uint32)
    run(PRED, "pred", (1,), (50,), [out])          # 50 threads: the last warp is partial
    t = np.arange(50)
    want = np.where(t % 2 == 1, 100 + t, 100 - t).astype(np.uint32)
    want[41:] = 0
    np.testing.assert_array_equal(out, want)


BARRIERS = HEADER + r"""
// Warps 0-1 and warps 2-3 synchronise on different named barriers (count 64), then all
// threads on barrier 0. Threads of warp 3 with lane >= 16 have exited before barrier 0:
// exited threads are not waited for.
.visible .entry barriers(.param .u64 out_p)
{
	.reg .pred %p<4>;
	.reg .b32 %r<12>;
	.reg .b64 %rd<4>;
	.shared .align 4 .b8 sm[512];
	ld.param.u64 %rd1, [out_p];
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, sm;
	shl.b32 %r3, %r1, 2;
	add.s32 %r4, %r2, %r3;
	st.shared.u32 [%r4], %r1;
	setp.lt.u32 %p1, %r1, 64;
	@%p1 bra $L__low;
	bar.sync 2, 64;
	xor.b32 %r5, %r1, 32;                 // partner in the other warp of the same pair
	bra $L__joined;
$L__low:
	bar.sync 1, 64;
	xor.b32 %r5, %r1, 32;
$L__joined:
	shl.b32 %r6, %r5, 2;
	add.s32 %r7, %r2, %r6;
	ld.shared.u32 %r8, [%r7];
	setp.ge.u32 %p2, %r1, 112;
	@%p2 exit;
	bar.sync 0;
	mul.wide.u32 %rd2, %r1, 4;
	add.s64 %rd3, %rd1, %rd2;
	st.global.u32 [%rd3], %r8;
	ret;
}
"""


def test_named_barriers_with_counts_and_exited_threads():
    out = np.zeros(128, np.uint32)
    run(BARRIERS, "barriers", (2,), (128,), [out])
    t = np.arange(128)
    want = (t ^ 32).astype(np.uint32)
    want[112:] = 0
    np.testing.assert_array_equal(out, want)


SPECIAL = HEADER + r"""
.visible .entry special(.param .u64 out_p)
{
	.reg .b32 %r<20>;
	.reg .b64 %rd<4>;
	ld.param.u64 %rd1, [out_p];
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, %tid.y;
	mov.u32 %r3, %tid.z;
	mov.u32 %r4, %ntid.x;
	mov.u32 %r5, %ntid.y;
	mov.u32 %r6, %ntid.z;
	mov.u32 %r7, %ctaid.x;
	mov.u32 %r8, %ctaid.y;
	mov.u32 %r9, %ctaid.z;
	mov.u32 %r10, %nctaid.x;
	mov.u32 %r11, %nctaid.y;
	mov.u32 %r12, %nctaid.z;
	mov.u32 %r13, %laneid;
	mov.u32 %r14, %warpid;
	// linear CTA and thread ids -> output row
	mad.lo.u32 %r15, %r9, %r11, %r8;
	mad.lo.u32 %r15, %r15, %r10, %r7;
	mad.lo.u32 %r16, %r3, %r5, %r2;
	mad.lo.u32 %r16, %r16, %r4, %r1;
	mul.lo.u32 %r17, %r4, %r5;
	mul.lo.u32 %r17, %r17, %r6;
	mad.lo.u32 %r18, %r15, %r17, %r16;
	mul.wide.u32 %rd2, %r18, 64;
	add.s64 %rd3, %rd1, %rd2;
	st.global.v4.u32 [%rd3], {%r1, %r2, %r3, %r4};
	st.global.v4.u32 [%rd3+16], {%r5, %r6, %r7, %r8};
	st.global.v4.u32 [%rd3+32], {%r9, %r10, %r11, %r12};
	st.global.v4.u32 [%rd3+48], {%r13, %r14, %r15, %r16};
	ret;
}
"""


@pytest.mark.parametrize("batch_threads", [32768, 64])
def test_special_registers_in_3d(batch_threads):
    grid, block = (2, 3, 2), (8, 4, 3)
    nb = 8 * 4 * 3
    out = np.zeros((12 * nb, 16), np.uint32)
    run(SPECIAL, "special", grid, block, [out], batch_threads=batch_threads)
    row = 0
    for cz in range(2):
        for cy in range(3):
            for cx in range(2):
                for tz in range(3):
                    for ty in range(4):
                        for tx in range(8):
                            lin = tx + 8 * ty + 32 * tz
                            cta = cx + 2 * cy + 6 * cz
                            want = [tx, ty, tz, 8, 4, 3, cx, cy, cz, 2, 3, 2, lin % 32, lin // 32,
                                    cta, lin]
                            assert out[cta * nb + lin].tolist() == want
                            row += 1
    assert row == len(out)


ISOLATION = HEADER + r"""
// Every CTA writes its ctaid into its shared memory, then reads it back after a barrier:
// CTAs that run in the same batch must not see each other's shared memory.
.visible .entry isolation(.param .u64 out_p)
{
	.reg .b32 %r<8>;
	.reg .b64 %rd<4>;
	.shared .align 4 .b32 slot;
	ld.param.u64 %rd1, [out_p];
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, %ctaid.x;
	mov.u32 %r3, %ntid.x;
	mad.lo.u32 %r4, %r2, %r3, %r1;
	st.shared.u32 [slot], %r2;
	bar.sync 0;
	ld.shared.u32 %r5, [slot];
	mul.wide.u32 %rd2, %r4, 4;
	add.s64 %rd3, %rd1, %rd2;
	st.global.u32 [%rd3], %r5;
	ret;
}
"""


def test_shared_memory_is_per_cta():
    out = np.zeros(8 * 64, np.uint32)
    run(ISOLATION, "isolation", (8,), (64,), [out])
    np.testing.assert_array_equal(out, np.repeat(np.arange(8), 64))


PING_PONG = HEADER + r"""
// FlashAttention-3's ping-pong between two groups (here warps 0 and 1): warp w waits on named
// barrier 1 + w (count 64), takes its turn, then arrives on the other warp's barrier. A turn
// passes a counter: warp 0 reads a (written by warp 1) and writes b = a + 1, warp 1 reads b
// and writes a = b + 1. Warp 1 primes warp 0's barrier first and skips its last arrival
// (warp 0 waits no more). out[4 w + i] = the value warp w read at step i.
.visible .entry ping_pong(.param .u64 out_p)
{
	.reg .pred %p<4>;
	.reg .b32 %r<12>;
	.reg .b64 %rd<4>;
	.shared .align 4 .b32 a;
	.shared .align 4 .b32 b;
	ld.param.u64 %rd1, [out_p];
	mov.u32 %r1, %tid.x;
	shr.u32 %r2, %r1, 5;                  // warp
	and.b32 %r3, %r1, 31;
	setp.eq.u32 %p1, %r3, 0;              // lane 0
	setp.eq.u32 %p2, %r2, 1;
	mov.u32 %r4, 0;
	@%p1 st.shared.u32 [a], %r4;
	bar.sync 0;
	@!%p2 bra $L__loop;
	bar.arrive 1, 64;                     // warp 1 primes warp 0's first turn
	$L__loop:
	@%p2 bra $L__turn1;
	bar.sync 1, 64;
	mov.u32 %r5, 0;
	@%p1 ld.shared.u32 %r5, [a];
	add.u32 %r6, %r5, 1;
	@%p1 st.shared.u32 [b], %r6;
	bra $L__record;
	$L__turn1:
	bar.sync 2, 64;
	mov.u32 %r5, 0;
	@%p1 ld.shared.u32 %r5, [b];
	add.u32 %r6, %r5, 1;
	@%p1 st.shared.u32 [a], %r6;
	$L__record:
	shl.b32 %r7, %r2, 2;
	add.u32 %r7, %r7, %r4;
	mul.wide.u32 %rd2, %r7, 4;
	add.s64 %rd3, %rd1, %rd2;
	@%p1 st.global.u32 [%rd3], %r5;
	@%p2 bra $L__signal0;
	bar.arrive 2, 64;                     // warp 0: warp 1's turn
	bra $L__next;
	$L__signal0:
	setp.eq.u32 %p3, %r4, 3;
	@%p3 bra $L__next;                    // warp 1's last turn: warp 0 waits no more
	bar.arrive 1, 64;
	$L__next:
	add.u32 %r4, %r4, 1;
	setp.lt.u32 %p3, %r4, 4;
	@%p3 bra $L__loop;
	ret;
}
"""


def test_bar_arrive_ping_pong():
    """bar.arrive counts toward a named barrier's phase without waiting, per barrier id (warp 0
    waits at one bar.sync 1, warp 1 arrives from two places); the turns alternate, and the
    shared counter's handoff is ordered for the race checker by the arrive -> sync edges."""
    out = np.zeros(8, np.uint32)
    run(PING_PONG, "ping_pong", (3,), (64,), [out])
    np.testing.assert_array_equal(out, [0, 2, 4, 6, 1, 3, 5, 7])


def test_bar_arrive_mistakes_are_caught():
    from ptxc.emu import EmulationError
    unprimed = PING_PONG.replace("\tbar.arrive 1, 64;                     // warp 1 primes", "\t// no prime")
    with pytest.raises(EmulationError, match=r"barrier deadlock: threads of one CTA wait on named "
                                             r"barriers 1 \(32 waiting, 0 arrived, count 64\), 2 "):
        run(unprimed, "ping_pong", (1,), (64,), [np.zeros(8, np.uint32)])
    # two arrivals of one warp in a phase: the hardware counts 64 and completes it early
    twice = PING_PONG.replace("\tbar.arrive 1, 64;                     // warp 1 primes",
                              "\tbar.arrive 1, 64;\n\tbar.arrive 1, 64;                     // warp 1 primes")
    with pytest.raises(EmulationError, match="arrives twice at barrier 1 in one phase"):
        run(twice, "ping_pong", (1,), (64,), [np.zeros(8, np.uint32)])
    # warp 1 writes warp 0's input right after arriving: the arrival orders warp 1's earlier
    # accesses before warp 0's later ones, not the ones after it
    racy = PING_PONG.replace("\tbar.arrive 1, 64;                     // warp 1 primes warp 0's first turn",
                             "\tbar.arrive 1, 64;\n\t@%p1 st.shared.u32 [a], %r4;")
    with pytest.raises(EmulationError, match="race"):
        run(racy, "ping_pong", (1,), (64,), [np.zeros(8, np.uint32)])


MISMATCHED = HEADER + r"""
.visible .entry mismatched(.param .u64 out_p)
{
	.reg .pred %p<2>;
	.reg .b32 %r<4>;
	mov.u32 %r1, %tid.x;
	setp.lt.u32 %p1, %r1, 32;
	@%p1 bra $L__low;
	bar.sync 1, 96;
	ret;
	$L__low:
	bar.sync 1, 64;
	ret;
}
"""


def test_waiters_of_one_barrier_must_agree_on_its_count():
    from ptxc.emu import EmulationError
    with pytest.raises(EmulationError, match=r"wait on barrier 1 with different thread counts \(64, 96\)"):
        run(MISMATCHED, "mismatched", (1,), (64,), [np.zeros(1, np.uint32)])
