"""mbarrier + cp.async.bulk: a tile copied global -> shared under an mbarrier's transaction
count is visible after the phase completes, to threads that wait on the same code path and to
consumer warps that spin at a lower pc than their producer (they yield); missing waits, wrong
transaction counts and uninitialised barriers are errors."""

import numpy as np
import pytest

from ptxc.errors import EmulationError

from .helpers import run

HEADER = ".version 8.0\n.target sm_90a\n.address_size 64\n"

PRODUCE = r"""
	@%p1 mbarrier.arrive.expect_tx.shared::cta.b64 %rd2, [%r2], %r9;
	@%p1 cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%r3], [%rd1], %r4, [%r2];
"""


def kernel(specialised=False, wait=True, init=True):
    produce = "" if specialised else PRODUCE
    tail = ("PRODUCE:\n" + PRODUCE + "\tbra.uni WAIT;\n") if specialised else ""
    return HEADER + f"""
.visible .entry bulk_k(.param .u64 in_p, .param .u64 out_p, .param .u32 bytes_p,
                       .param .u32 tx_p)
{{
	.reg .b32 %r<16>;
	.reg .b64 %rd<8>;
	.reg .pred %p<4>;
	.shared .align 128 .b8 buf[512];
	.shared .align 8 .b64 bar;
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, bar;
	mov.u32 %r3, buf;
	ld.param.u32 %r4, [bytes_p];
	ld.param.u32 %r9, [tx_p];
	ld.param.u64 %rd1, [in_p];
	setp.eq.u32 %p1, %r1, 0;
	{"@%p1 mbarrier.init.shared::cta.b64 [%r2], 1;" if init else ""}
	bar.sync 0;
	setp.lt.u32 %p3, %r1, 32;
	{"@%p3 bra PRODUCE;" if specialised else ""}
{produce}
WAIT:
	{"mbarrier.try_wait.parity.shared::cta.b64 %p2, [%r2], 0;" if wait else ""}
	{"@!%p2 bra WAIT;" if wait else ""}
	shl.b32 %r5, %r1, 2;
	add.u32 %r6, %r3, %r5;
	ld.shared.u32 %r7, [%r6];
	ld.param.u64 %rd3, [out_p];
	mul.wide.u32 %rd4, %r1, 4;
	add.s64 %rd5, %rd3, %rd4;
	st.global.u32 [%rd5], %r7;
	ret;
{tail}}}
"""


def launch_bulk(ptx, tx=512):
    src = np.arange(128, dtype=np.uint32) * 3 + 1
    out = np.zeros(128, np.uint32)
    run(ptx, "bulk_k", (2,), (128,), [src, out, np.uint32(512), np.uint32(tx)])
    return src, out


@pytest.mark.parametrize("specialised", [False, True])
def test_bulk_copy_visible_after_the_phase(specialised):
    src, out = launch_bulk(kernel(specialised))
    np.testing.assert_array_equal(out, src)


def test_read_before_the_wait_is_an_error():
    with pytest.raises(EmulationError, match="cp.async.bulk destination before a wait"):
        launch_bulk(kernel(wait=False))


def test_transaction_count_never_reached_is_a_deadlock():
    with pytest.raises(EmulationError, match="mbarrier deadlock"):
        launch_bulk(kernel(specialised=True), tx=528)


def test_uninitialised_mbarrier_is_an_error():
    with pytest.raises(EmulationError, match="no initialised mbarrier"):
        launch_bulk(kernel(init=False))


ARRIVE = HEADER + r"""
.visible .entry arrive_k(.param .u64 out_p)
{
	.reg .b32 %r<8>;
	.reg .b64 %rd<8>;
	.reg .pred %p<4>;
	.shared .align 8 .b64 bar;
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, bar;
	setp.eq.u32 %p1, %r1, 0;
	@%p1 mbarrier.init.shared::cta.b64 [%r2], 64;
	bar.sync 0;
	mbarrier.arrive.shared::cta.b64 %rd1, [%r2];
	mbarrier.test_wait.shared::cta.b64 %p2, [%r2], %rd1;
	mbarrier.test_wait.parity.shared::cta.b64 %p3, [%r2], 1;
	selp.u32 %r3, 1, 0, %p2;
	selp.u32 %r4, 2, 0, %p3;
	add.u32 %r3, %r3, %r4;
	ld.param.u64 %rd2, [out_p];
	mul.wide.u32 %rd3, %r1, 4;
	add.s64 %rd4, %rd2, %rd3;
	st.global.u32 [%rd4], %r3;
	ret;
}
"""


def test_arrivals_complete_a_phase_and_tokens_and_parity_see_it():
    out = np.zeros(64, np.uint32)
    run(ARRIVE, "arrive_k", (1,), (64,), [out])
    # 64 arrivals complete phase 0: the token (phase 0) and parity 1 (phase 1 is current,
    # not completed) -> test_wait true, test_wait.parity 1 false
    np.testing.assert_array_equal(out, np.full(64, 1))
    with pytest.raises(EmulationError, match="arrivals on an mbarrier phase expecting"):
        run(ARRIVE.replace("[%r2], 64;", "[%r2], 32;").replace(
            "mbarrier.test_wait.shared", "mbarrier.arrive.shared::cta.b64 %rd5, [%r2];\n\t"
            "mbarrier.test_wait.shared"), "arrive_k", (1,), (64,), [out])


RELEASE = HEADER + r"""
.visible .entry release_k()
{
	.reg .b32 %r<8>;
	.reg .b64 %rd<4>;
	.reg .pred %p<8>;
	.shared .align 4 .b8 buf[16];
	.shared .align 8 .b64 bar;
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, bar;
	mov.u32 %r3, buf;
	setp.eq.u32 %p1, %r1, 0;
	@%p1 mbarrier.init.shared::cta.b64 [%r2], COUNT;
	@%p1 st.shared.u32 [%r3], 7;
	bar.sync 0;
	setp.ge.u32 %p2, %r1, 64;
	@%p2 bra WRITER;
	ld.shared.u32 %r4, [%r3];
	and.b32 %r5, %r1, 31;
	setp.eq.u32 %p3, %r5, 0;
	setp.lt.u32 %p4, %r1, LIMIT;
	and.pred %p3, %p3, %p4;
	@%p3 mbarrier.arrive.shared::cta.b64 %rd1, [%r2];
	ret;
WRITER:
	mbarrier.try_wait.parity.shared::cta.b64 %p5, [%r2], 0;
	@!%p5 bra WRITER;
	setp.eq.u32 %p6, %r1, 64;
	@%p6 st.shared.u32 [%r3], 9;
	ret;
}
"""


def test_a_buffer_read_by_several_warps_is_free_once_each_released_it():
    """Warps 0 and 1 read a word, lane 0 of each arrives on an mbarrier, warp 2 waits on it and
    overwrites the word (a producer refilling a stage two consumer warpgroups read): ordered
    when both reader warps arrived; a write-after-read race when only warp 0 did."""
    run(RELEASE.replace("COUNT", "2").replace("LIMIT", "64"), "release_k", (1,), (96,), [])
    with pytest.raises(EmulationError, match=r"race \(write after read\)"):
        run(RELEASE.replace("COUNT", "1").replace("LIMIT", "32"), "release_k", (1,), (96,), [])


ORDER = HEADER + r"""
.visible .entry order_k()
{
	.reg .b32 %r<8>;
	.reg .b64 %rd<4>;
	.reg .pred %p<8>;
	.shared .align 4 .b8 buf[16];
	.shared .align 8 .b64 bar;
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, bar;
	mov.u32 %r3, buf;
	setp.eq.u32 %p1, %r1, 0;
	@%p1 mbarrier.init.shared::cta.b64 [%r2], 1;
	bar.sync 0;
	@%p1 st.shared.u32 [%r3], 7;
	@%p1 mbarrier.arrive.shared::cta.b64 %rd1, [%r2];
	AFTER_ARRIVE
	setp.lt.u32 %p2, %r1, 32;
	@%p2 bra DONE;
WAIT:
	mbarrier.try_wait.parity.shared::cta.b64 %p5, [%r2], 0;
	@!%p5 bra WAIT;
	WAITERS
DONE:
	ret;
}
"""
READ = "setp.eq.u32 %p6, %r1, 32;\n\t@%p6 ld.shared.u32 %r4, [%r3];"


@pytest.mark.parametrize("after_arrive,waiters,race", [
    ("", READ, None),                                          # written before the arrival
    ("@%p1 st.shared.u32 [%r3+4], 8;", READ.replace("[%r3]", "[%r3+4]"),
     "read of shared address"),                                 # written after it
    # two waiters of one phase are not ordered with each other: warp 1 writes, warp 2 reads
    ("", "setp.eq.u32 %p6, %r1, 32;\n\t@%p6 st.shared.u32 [%r3+8], 3;\n\t"
         "setp.eq.u32 %p7, %r1, 64;\n\t@%p7 ld.shared.u32 %r4, [%r3+8];", "shared-memory race"),
])
def test_an_mbarrier_phase_orders_what_came_before_each_arrival(after_arrive, waiters, race):
    """The arrivals of a phase order the arriving threads' accesses up to their arrival before
    the waiters' later ones -- not what an arriver does after arriving, and not one waiter's
    accesses before another's (a CTA barrier would)."""
    ptx = ORDER.replace("AFTER_ARRIVE", after_arrive).replace("WAITERS", waiters)
    if race is None:
        run(ptx, "order_k", (1,), (96,), [])
        return
    with pytest.raises(EmulationError, match=race):
        run(ptx, "order_k", (1,), (96,), [])


CHAIN = HEADER + r"""
.visible .entry chain_k()
{
	.reg .b32 %r<8>;
	.reg .b64 %rd<4>;
	.reg .pred %p<8>;
	.shared .align 4 .b8 buf[16];
	.shared .align 8 .b64 bar_a;
	.shared .align 8 .b64 bar_b;
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, bar_a;
	mov.u32 %r5, bar_b;
	mov.u32 %r3, buf;
	setp.eq.u32 %p1, %r1, 0;
	@%p1 mbarrier.init.shared::cta.b64 [%r2], 1;
	@%p1 mbarrier.init.shared::cta.b64 [%r5], 1;
	bar.sync 0;
	@%p1 st.shared.u32 [%r3], 7;
	@%p1 mbarrier.arrive.shared::cta.b64 %rd1, [%r2];
	setp.eq.u32 %p2, %r1, 32;
	@!%p2 bra PASSED;
HANDOFF
	mbarrier.arrive.shared::cta.b64 %rd1, [%r5];
PASSED:
	setp.eq.u32 %p3, %r1, 64;
	@!%p3 bra DONE;
WAIT_B:
	mbarrier.try_wait.parity.shared::cta.b64 %p5, [%r5], 0;
	@!%p5 bra WAIT_B;
	ld.shared.u32 %r4, [%r3];
DONE:
	ret;
}
"""
RELAY_WAIT = """WAIT_A:
	mbarrier.try_wait.parity.shared::cta.b64 %p5, [%r2], 0;
	@!%p5 bra WAIT_A;"""


def test_ordering_is_transitive_through_a_relaying_warp():
    """Thread 0 writes and arrives on bar_a; thread 32 waits on bar_a and arrives on bar_b;
    thread 64 waits on bar_b and reads: ordered (release / acquire chains are cumulative) --
    a race when thread 32 arrives on bar_b without waiting on bar_a."""
    run(CHAIN.replace("HANDOFF", RELAY_WAIT), "chain_k", (1,), (96,), [])
    with pytest.raises(EmulationError, match="read of shared address"):
        run(CHAIN.replace("HANDOFF", ""), "chain_k", (1,), (96,), [])
