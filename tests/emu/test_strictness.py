"""Planted bugs that the emulator must catch, naming the thread and the line: barrier divergence
inside a warp, shared-memory races (between warps, inside a warp, cp.async data read by
another thread without a barrier), a missing cp.async wait, and uninitialised registers used
as an address, a stored value or a branch condition. Each bug has a fixed twin that passes."""

import numpy as np
import pytest

from ptxc.emu import EmulationError, launch

from .helpers import HEADER, line_of, run
from .test_memcheck import expect_error

# ----------------------------------------------------------------------------- barriers

HALF_WARP_BAR = HEADER + r"""
.visible .entry half_bar(.param .u64 out_p)
{
	.reg .pred %p<2>;
	.reg .b32 %r<4>;
	mov.u32 %r1, %tid.x;
	and.b32 %r2, %r1, 31;
	setp.lt.u32 %p1, %r2, 16;
	@%p1 bra $L__past;
	bar.sync 0;
$L__past:
	add.u32 %r3, %r1, 1;
	ret;
}
"""


def test_half_warp_skipping_a_barrier_is_divergence():
    msg = expect_error(HALF_WARP_BAR, "half_bar", (2,), (64,), [np.zeros(1, np.uint32)],
                       "bar.sync 0", "barrier divergence", (0, 0, 0), (16, 0, 0))
    assert "lanes 16-31 of warp 0" in msg and "lanes 0-15 of the same warp" in msg, msg
    assert "tid=(0, 0, 0)" in msg                                   # the other side
    assert f"line {line_of(HALF_WARP_BAR, 'add.u32 %r3')}" in msg   # where they are


WARP_EXIT_BAR = HEADER + r"""
.visible .entry warp_exit(.param .u64 out_p)
{
	.reg .pred %p<2>;
	.reg .b32 %r<4>;
	.reg .b64 %rd<4>;
	ld.param.u64 %rd1, [out_p];
	mov.u32 %r1, %tid.x;
	setp.ge.u32 %p1, %r1, 32;           // warp 1 leaves as a whole
	@%p1 exit;
	bar.sync 0;
	mul.wide.u32 %rd2, %r1, 4;
	add.s64 %rd3, %rd1, %rd2;
	st.global.u32 [%rd3], %r1;
	ret;
}
"""


def test_whole_warp_exit_before_a_barrier_is_legal():
    out = np.zeros(64, np.uint32)
    run(WARP_EXIT_BAR, "warp_exit", (1,), (64,), [out])
    np.testing.assert_array_equal(out[:32], np.arange(32))


UNALIGNED_BAR = HALF_WARP_BAR.replace("bar.sync 0;", "barrier.sync 0;")


def test_non_aligned_barrier_may_be_reached_by_part_of_a_warp():
    # barrier.sync without .aligned allows divergent arrival; lanes 0-15 exit, so it completes
    launch(UNALIGNED_BAR, "half_bar", (1,), (32,), [np.zeros(1, np.uint32)])


# ----------------------------------------------------------------------------- races

def exchange(sync: str, partner: str) -> str:
    """Thread t writes sm[t], runs `sync`, reads sm[partner(t)] and stores it."""
    return HEADER + rf"""
.visible .entry exchange(.param .u64 out_p)
{{
	.reg .b32 %r<12>;
	.reg .b64 %rd<4>;
	.shared .align 4 .b8 sm[256];
	ld.param.u64 %rd1, [out_p];
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, sm;
	shl.b32 %r3, %r1, 2;
	add.s32 %r4, %r2, %r3;
	st.shared.u32 [%r4], %r1;
	{sync}
	{partner}
	shl.b32 %r6, %r5, 2;
	add.s32 %r7, %r2, %r6;
	ld.shared.u32 %r8, [%r7];
	mul.wide.u32 %rd2, %r1, 4;
	add.s64 %rd3, %rd1, %rd2;
	st.global.u32 [%rd3], %r8;
	ret;
}}
"""


OTHER_WARP = "xor.b32 %r5, %r1, 32;"
SAME_WARP = "xor.b32 %r5, %r1, 1;"


def test_missing_barrier_between_warps_is_a_race():
    ptx = exchange("", OTHER_WARP)
    msg = expect_error(ptx, "exchange", (1,), (64,), [np.zeros(64, np.uint32)],
                       "ld.shared.u32 %r8, [%r7]", "shared-memory race: read of shared address",
                       (0, 0, 0), (0, 0, 0), 0x400 + 32 * 4)
    assert f"tid=(32, 0, 0) (another warp) wrote at line " \
           f"{line_of(ptx, 'st.shared.u32 [%r4], %r1')}" in msg, msg


@pytest.mark.parametrize("sync, partner", [("bar.sync 0;", OTHER_WARP),
                                           ("bar.sync 0;", SAME_WARP),
                                           ("bar.warp.sync -1;", SAME_WARP),
                                           ("barrier.sync.aligned 0;", OTHER_WARP)])
def test_synchronised_exchange_passes(sync, partner):
    out = np.zeros(64, np.uint32)
    run(exchange(sync, partner), "exchange", (2,), (64,), [out])
    t = np.arange(64)
    np.testing.assert_array_equal(out, t ^ (32 if partner == OTHER_WARP else 1))


def test_missing_warp_sync_inside_a_warp_is_a_race():
    ptx = exchange("", SAME_WARP)
    msg = expect_error(ptx, "exchange", (1,), (32,), [np.zeros(32, np.uint32)],
                       "ld.shared.u32 %r8, [%r7]", "shared-memory race",
                       (0, 0, 0), (0, 0, 0), 0x404)
    assert "tid=(1, 0, 0) (the same warp)" in msg and "bar.warp.sync" in msg, msg


def test_a_warp_sync_does_not_order_other_warps():
    ptx = exchange("bar.warp.sync -1;", OTHER_WARP)
    expect_error(ptx, "exchange", (1,), (64,), [np.zeros(64, np.uint32)],
                 "ld.shared.u32 %r8, [%r7]", "shared-memory race", (0, 0, 0), (0, 0, 0))


def test_racecheck_can_be_switched_off():
    out = np.zeros(64, np.uint32)
    launch(exchange("", OTHER_WARP), "exchange", (1,), (64,), [out], racecheck=False)
    np.testing.assert_array_equal(out[:32], np.arange(32, 64))   # lower pc runs first


WAW = HEADER + r"""
.visible .entry waw(.param .u64 out_p)
{
	.reg .b32 %r<6>;
	.shared .align 4 .b8 sm[8];
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, sm;
	st.shared.u32 [%r2], %r1;           // every thread writes the same word
	ret;
}
"""

WAW_SEQ = WAW.replace("	st.shared.u32 [%r2], %r1;           // every thread writes the same word",
                      "	setp.eq.u32 %p1, %r1, 0;\n	@%p1 st.shared.u32 [%r2], %r1;\n"
                      "	st.shared.u32 [%r2+4], %r1;\n	@!%p1 st.shared.u32 [%r2], %r1;") \
    .replace(".reg .b32 %r<6>;", ".reg .b32 %r<6>;\n	.reg .pred %p<2>;")


def test_write_after_another_threads_write_is_a_race():
    msg = expect_error(WAW_SEQ, "waw", (1,), (64,), [np.zeros(1, np.uint32)],
                       "@!%p1 st.shared.u32 [%r2], %r1", "shared-memory race: write",
                       (0, 0, 0), (1, 0, 0), 0x400)
    assert "tid=(0, 0, 0) (the same warp)" in msg


CP_ASYNC_SHARE = HEADER + r"""
// Thread t copies 16 bytes into row t, waits for its own copy, then reads row t ^ 1.
.visible .entry cp_share(.param .u64 src_p, .param .u64 out_p)
{
	.reg .b32 %r<8>;
	.reg .b64 %rd<8>;
	.shared .align 16 .b8 buf[1024];
	ld.param.u64 %rd1, [src_p];
	ld.param.u64 %rd2, [out_p];
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, buf;
	shl.b32 %r3, %r1, 4;
	add.s32 %r4, %r2, %r3;
	mul.wide.u32 %rd3, %r1, 16;
	add.s64 %rd4, %rd1, %rd3;
	cp.async.cg.shared.global [%r4], [%rd4], 16;
	cp.async.commit_group;
	cp.async.wait_group 0;
	SYNC
	xor.b32 %r5, %r3, 16;
	add.s32 %r6, %r2, %r5;
	ld.shared.u32 %r7, [%r6];
	mul.wide.u32 %rd5, %r1, 4;
	add.s64 %rd6, %rd2, %rd5;
	st.global.u32 [%rd6], %r7;
	ret;
}
"""


def test_cp_async_data_needs_a_barrier_before_another_thread_reads_it():
    ptx = CP_ASYNC_SHARE.replace("SYNC", "")
    src = np.arange(64 * 4, dtype=np.uint32)
    msg = expect_error(ptx, "cp_share", (1,), (64,), [src, np.zeros(64, np.uint32)],
                       "ld.shared.u32 %r7, [%r6]", "shared-memory race", (0, 0, 0), (0, 0, 0))
    assert f"line {line_of(ptx, 'cp.async.cg')}" in msg and "tid=(1, 0, 0)" in msg, msg


def test_cp_async_data_read_after_wait_and_barrier_passes():
    src = np.arange(64 * 4, dtype=np.uint32)
    out = np.zeros(64, np.uint32)
    run(CP_ASYNC_SHARE.replace("SYNC", "bar.sync 0;"), "cp_share", (1,), (64,), [src, out])
    np.testing.assert_array_equal(out, src.reshape(64, 4)[np.arange(64) ^ 1, 0])


def test_missing_wait_group_is_caught():
    ptx = CP_ASYNC_SHARE.replace("cp.async.wait_group 0;", "").replace("SYNC", "bar.sync 0;")
    src = np.arange(64 * 4, dtype=np.uint32)
    expect_error(ptx, "cp_share", (1,), (64,), [src, np.zeros(64, np.uint32)],
                 "ld.shared.u32 %r7, [%r6]", "read of cp.async destination before "
                 "cp.async.wait_group", (0, 0, 0), (0, 0, 0))


# ----------------------------------------------------------------------------- registers

def uninit(body: str) -> str:
    return HEADER + rf"""
.visible .entry uninit(.param .u64 out_p)
{{
	.reg .pred %p<3>;
	.reg .b32 %r<8>;
	.reg .b64 %rd<8>;
	ld.param.u64 %rd1, [out_p];
	mov.u32 %r1, %tid.x;
	setp.lt.u32 %p1, %r1, 16;
	mul.wide.u32 %rd3, %r1, 4;
{body}
	ret;
}}
"""


def test_uninitialised_register_used_as_an_address():
    ptx = uninit("\tadd.s64 %rd4, %rd1, %rd3;\n\tst.global.u32 [%rd5], %r1;")
    expect_error(ptx, "uninit", (1,), (32,), [np.zeros(32, np.uint32)],
                 "st.global.u32 [%rd5], %r1",
                 "register %rd5 is read before any write (uninitialised) and is used as an "
                 "address", (0, 0, 0), (0, 0, 0))


def test_address_computed_from_a_register_written_on_some_paths_only():
    ptx = uninit("\t@%p1 mov.u64 %rd2, %rd1;\n\tadd.s64 %rd4, %rd2, %rd3;\n"
                 "\tst.global.u32 [%rd4], %r1;")
    expect_error(ptx, "uninit", (1,), (32,), [np.zeros(32, np.uint32)],
                 "st.global.u32 [%rd4], %r1",
                 "register %rd4 holds a value computed from a never-written", (0, 0, 0),
                 (16, 0, 0))


def test_uninitialised_value_stored_and_branch_condition():
    ptx = uninit("\tadd.s64 %rd4, %rd1, %rd3;\n\tst.global.u32 [%rd4], %r2;")
    expect_error(ptx, "uninit", (1,), (32,), [np.zeros(32, np.uint32)],
                 "st.global.u32 [%rd4], %r2", "register %r2 is read before any write "
                 "(uninitialised) and is stored to memory", (0, 0, 0), (0, 0, 0))
    ptx = uninit("\t@%p2 bra $L__end;\n$L__end:")
    expect_error(ptx, "uninit", (1,), (32,), [np.zeros(32, np.uint32)],
                 "@%p2 bra $L__end", "register %p2 is read before any write (uninitialised) "
                 "and is used as a branch condition", (0, 0, 0), (0, 0, 0))


def test_predicated_definition_and_use_under_the_same_predicate_pass():
    ptx = uninit("\t@%p1 mov.u64 %rd2, %rd1;\n\t@%p1 add.s64 %rd4, %rd2, %rd3;\n"
                 "\t@%p1 st.global.u32 [%rd4], %r1;")
    out = np.zeros(32, np.uint32)
    run(ptx, "uninit", (1,), (32,), [out])
    np.testing.assert_array_equal(out[:16], np.arange(16))


def test_ptxc_style_kernels_track_no_registers():
    from ptxc.emu.op_table import decode_program
    prog = decode_program(WARP_EXIT_BAR, "warp_exit")
    assert not prog.init.tracked


def test_error_is_an_emulation_error_with_attributes():
    ptx = uninit("\tst.global.u32 [%rd5], %r1;")
    with pytest.raises(EmulationError) as exc:
        launch(ptx, "uninit", (1,), (32,), [np.zeros(32, np.uint32)])
    assert exc.value.line == line_of(ptx, "st.global.u32 [%rd5]")


def refill(sync: str, partner: str) -> str:
    """Two rounds of exchange(): the second round overwrites sm[t] after `sync`, while the
    partner may still be reading it (the missing barrier before refilling a buffer)."""
    return exchange("bar.sync 0;", partner).replace(
        "\tmul.wide.u32 %rd2, %r1, 4;",
        f"\t{sync}\n\tst.shared.u32 [%r4], %r8;\n\tmul.wide.u32 %rd2, %r1, 4;")


def test_overwriting_what_another_warp_may_still_read_is_a_race():
    ptx = refill("", OTHER_WARP)
    msg = expect_error(ptx, "exchange", (1,), (64,), [np.zeros(64, np.uint32)],
                       "st.shared.u32 [%r4], %r8", "shared-memory race (write after read): "
                       "write of shared address", (0, 0, 0), (0, 0, 0), 0x400)
    assert f"tid=(32, 0, 0) (another warp) read at line " \
           f"{line_of(ptx, 'ld.shared.u32 %r8, [%r7]')}" in msg, msg


@pytest.mark.parametrize("sync, partner", [("bar.sync 0;", OTHER_WARP),
                                           ("bar.warp.sync -1;", SAME_WARP)])
def test_overwriting_after_the_readers_synchronised_passes(sync, partner):
    out = np.zeros(64, np.uint32)
    run(refill(sync, partner), "exchange", (1,), (64,), [out])
    np.testing.assert_array_equal(out, np.arange(64) ^ (32 if partner == OTHER_WARP else 1))


def test_a_warp_sync_does_not_order_reads_by_other_warps():
    expect_error(refill("bar.warp.sync -1;", OTHER_WARP), "exchange", (1,), (64,),
                 [np.zeros(64, np.uint32)], "st.shared.u32 [%r4], %r8",
                 "write after read", (0, 0, 0), (0, 0, 0))


BROADCAST_THEN_WRITE = exchange("bar.sync 0;", "mov.u32 %r5, 0;").replace(
    "\tmul.wide.u32 %rd2, %r1, 4;",
    "\tsetp.eq.u32 %p1, %r1, 0;\n\tSYNC\n\t@%p1 st.shared.u32 [%r2], %r8;\n"
    "\tmul.wide.u32 %rd2, %r1, 4;").replace(".reg .b32 %r<12>;",
                                             ".reg .b32 %r<12>;\n\t.reg .pred %p<2>;")


def test_a_broadcast_read_then_one_writer_needs_a_barrier():
    ptx = BROADCAST_THEN_WRITE.replace("SYNC", "")
    msg = expect_error(ptx, "exchange", (1,), (64,), [np.zeros(64, np.uint32)],
                       "@%p1 st.shared.u32 [%r2], %r8", "write after read", (0, 0, 0),
                       (0, 0, 0), 0x400)
    assert "and others" in msg or "other threads" in msg, msg
    run(BROADCAST_THEN_WRITE.replace("SYNC", "bar.sync 0;"), "exchange", (1,), (64,),
        [np.zeros(64, np.uint32)])



def reread(sync: str) -> str:
    """Warps 0 and 1 read sm[0] (warp 2 only ever reads sm[1]); `sync`; thread 0 reads sm[0]
    again and writes it."""
    return HEADER + f"""
.visible .entry reread(.param .u64 out_p)
{{
	.reg .b32 %r<12>;
	.reg .pred %p<3>;
	.reg .b64 %rd<4>;
	.shared .align 4 .b32 sm[32];
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, sm;
	setp.eq.u32 %p1, %r1, 0;
	@%p1 st.shared.u32 [%r2], %r1;
	@%p1 st.shared.u32 [%r2+4], %r1;
	bar.sync 0;
	setp.ge.u32 %p2, %r1, 64;
	@%p2 ld.shared.u32 %r8, [%r2+4];
	@%p2 bra DONE;
	ld.shared.u32 %r8, [%r2];
	{sync}
	@%p1 ld.shared.u32 %r9, [%r2];
	add.u32 %r8, %r8, 1;
	@%p1 st.shared.u32 [%r2], %r8;
	ld.param.u64 %rd1, [out_p];
	mul.wide.u32 %rd2, %r1, 4;
	add.s64 %rd3, %rd1, %rd2;
	st.global.u32 [%rd3], %r8;
DONE:
	ret;
}}
"""


def test_a_reread_after_a_named_barrier_does_not_carry_older_reads_past_it():
    """Warps 0 and 1 read a word, a named barrier pairs just them (bar.sync 1, 64 of the CTA's
    96 threads), and thread 0 reads the word again before writing it (a row two warpgroups
    read, then one rewrites: the f16 Q rewrite beside a dequantising warpgroup, where no
    CTA-wide barrier can be used). The re-read is ordered after the other warp's reads, so
    the write is too; without the named barrier it is a race."""
    run(reread("bar.sync 1, 64;"), "reread", (1,), (96,), [np.zeros(96, np.uint32)])
    expect_error(reread(""), "reread", (1,), (96,), [np.zeros(96, np.uint32)],
                 "@%p1 st.shared.u32 [%r2], %r8", "write after read", (0, 0, 0), (0, 0, 0))
