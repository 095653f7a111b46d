"""tcgen05 (sm_100a) beyond what Triton's kernels exercise: every tcgen05.ld shape against the
PTX ISA's fragment tables (written here per shape, independently of tcgen05_layout.py), an
MMA from hand-placed shared memory for each swizzle and major-ness, and the tensor-memory
mistakes -- leaks, double frees, allocating after relinquishing, another warp's lanes, reading
a store before its wait, an MMA's cells before the wait on its commit. Every kernel is
assembled by ptxas for sm_100a."""

import numpy as np
import pytest

from ptxc.emu.tcgen05_layout import encode_instr_descriptor, encode_smem_descriptor
from ptxc.errors import EmulationError

from .helpers import run
from .test_wgmma import halves, place, strides

HEADER = ".version 8.7\n.target sm_100a\n.address_size 64\n"


def kernel(body: str, ncols: int = 64, dealloc: bool = True, params: str = "",
           smem: int = 0) -> str:
    """4 warps; warp 0 allocates `ncols` columns (address in %r3 for every thread) and, with
    `dealloc`, frees them at the end. `body` runs between."""
    shared = f"\t.shared .align 1024 .b8 img[{smem}];\n" if smem else ""
    free = "\t@%p1 tcgen05.dealloc.cta_group::1.sync.aligned.b32 %r3, {n};\n".format(n=ncols) \
        if dealloc else ""
    return HEADER + f""".visible .entry k(.param .u64 out_p{params})
{{
\t.reg .b32 %r<300>;
\t.reg .b64 %rd<16>;
\t.reg .pred %p<8>;
\t.shared .align 16 .b32 slot;
{shared}\tmov.u32 %r1, %tid.x;
\tshr.u32 %r2, %r1, 5;
\tsetp.eq.u32 %p1, %r2, 0;
\t@%p1 tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [slot], {ncols};
\tbar.sync 0;
\tld.shared.b32 %r3, [slot];
\tld.param.u64 %rd1, [out_p];
\tcvta.to.global.u64 %rd1, %rd1;
{body}
\tbar.sync 0;
{free}\t@%p1 tcgen05.relinquish_alloc_permit.cta_group::1.sync.aligned;
\tret;
}}
"""


def regs(first: int, n: int) -> str:
    return "{" + ", ".join(f"%r{first + i}" for i in range(n)) + "}"


# A warp's base address: lane 32 * (warp % 4) << 16 on top of the allocation (%r3).
WARP_BASE = "\tshl.b32 %r4, %r2, 21;\n\tadd.s32 %r5, %r3, %r4;\n"
# Fill columns 0..15 of every lane: cell (lane, col) = lane * 1000 + col.
FILL = WARP_BASE + "\tmul.lo.u32 %r6, %r1, 1000;\n" + "".join(
    f"\tadd.s32 %r{100 + c}, %r6, {c};\n" for c in range(16)) + \
    f"\ttcgen05.st.sync.aligned.32x32b.x16.b32 [%r5], {regs(100, 16)};\n" \
    "\ttcgen05.wait::st.sync.aligned;\n"


def store_out(n: int) -> str:
    """out[tid, 0..n) = %r200.. (u32)."""
    lines = [f"\tmul.wide.u32 %rd2, %r1, {4 * n};", "\tadd.s64 %rd3, %rd1, %rd2;"]
    lines += [f"\tst.global.u32 [%rd3+{4 * i}], %r{200 + i};" for i in range(n)]
    return "\n".join(lines) + "\n"


# PTX ISA, "Matrix fragments for tcgen05.ld / tcgen05.st": register r of lane l holds
# (row, column) of the shape's block, repeated along the columns.
FRAGMENTS = {
    "32x32b.x4": (4, lambda l, r: (l, r)),
    "16x64b.x2": (2, lambda l, r: (l // 4 + 8 * (l % 2), l // 2 % 2 + 2 * r)),
    "16x128b.x2": (4, lambda l, r: (l // 4 + 8 * (r % 2), l % 4 + 4 * (r // 2))),
    "16x256b.x2": (8, lambda l, r: (l // 4 + 8 * (r // 2 % 2), r % 2 + 2 * (l % 4) + 8 * (r // 4))),
    "16x32bx2.x2": (2, lambda l, r: (l % 16, r + 8 * (l // 16))),       # half offset 8
}


@pytest.mark.parametrize("shape, upper_half", [(s, u) for s in FRAGMENTS for u in (0, 1)
                                                if not (u and s.startswith("32x32b"))])
def test_ld_shapes_follow_the_fragment_tables(shape, upper_half):
    """A 16-lane shape reads either half of the warp's 32 lanes."""
    nregs, where = FRAGMENTS[shape]
    lane_add = 16 if upper_half else 0
    half = ", 8" if shape.startswith("16x32bx2") else ""
    body = FILL + f"\tadd.s32 %r7, %r5, {lane_add << 16};\n" + \
        f"\ttcgen05.ld.sync.aligned.{shape}.b32 {regs(200, nregs)}, [%r7]{half};\n" \
        "\ttcgen05.wait::ld.sync.aligned;\n" + store_out(nregs)
    out = np.zeros((128, nregs), np.uint32)
    run(kernel(body), "k", (1,), (128,), [out])
    tid = np.arange(128)[:, None]
    r = np.arange(nregs)[None, :]
    row, col = where(tid % 32, r)
    lane = 32 * (tid // 32) + lane_add + row
    np.testing.assert_array_equal(out, lane * 1000 + col)


def _error(body: str, match: str, **kw) -> EmulationError:
    ptx = kernel(body, **kw)
    with pytest.raises(EmulationError, match=match) as e:
        run(ptx, "k", (1,), (128,), [np.zeros(128 * 16, np.uint32)],
            dynamic_smem_bytes=0)
    return e.value


def test_leak_is_reported_at_the_end_of_the_kernel():
    e = _error("", "tensor memory leak: the CTA exited with 64 columns", dealloc=False)
    assert "end of kernel" in str(e)


def test_double_free():
    body = "\tbar.sync 0;\n\t@%p1 tcgen05.dealloc.cta_group::1.sync.aligned.b32 %r3, 64;\n"
    e = _error(body, "no live allocation of this CTA \\(double free")
    deallocs = [i for i, t in enumerate(kernel(body).splitlines(), 1) if "dealloc" in t]
    assert e.line == deallocs[1]


def test_alloc_after_relinquish():
    body = "\t@%p1 tcgen05.relinquish_alloc_permit.cta_group::1.sync.aligned;\n" \
        "\t@%p1 tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [slot], 32;\n"
    _error(body, "tcgen05.alloc after this CTA's tcgen05.relinquish_alloc_permit")


def test_unallocated_columns():
    body = WARP_BASE + "\tadd.s32 %r7, %r5, 64;\n" \
        "\ttcgen05.ld.sync.aligned.32x32b.x1.b32 {%r200}, [%r7];\n"
    _error(body, "tcgen05.ld of column 64, which this CTA has not allocated")


def test_never_written_tensor_memory():
    body = WARP_BASE + "\ttcgen05.ld.sync.aligned.32x32b.x1.b32 {%r200}, [%r5];\n"
    _error(body, "reads never-written tensor memory \\(lane 0, column 0\\)")


def test_another_warps_lanes():
    body = FILL + "\ttcgen05.ld.sync.aligned.32x32b.x1.b32 {%r200}, [%r3];\n"   # lane 0
    e = _error(body, "warp 1 reaches lanes 32-63")
    assert e.tid == (32, 0, 0)


def test_read_of_a_store_before_its_wait():
    body = WARP_BASE + "\ttcgen05.st.sync.aligned.32x32b.x1.b32 [%r5], {%r1};\n" \
        "\ttcgen05.ld.sync.aligned.32x32b.x1.b32 {%r200}, [%r5];\n"
    _error(body, "a tcgen05.st has not completed")


# ----------------------------------------------------------------------------- mma

def mma_kernel(idesc: int, adesc: int, bdesc: int, image_bytes: int, n: int,
               wait: bool = True) -> str:
    """Copy the operand image to shared memory, one elected thread issues one MMA (D at
    column 0, overwriting) and commits to an mbarrier; every warp waits, reads its 32 rows of
    D (n columns) and stores them to out[row, col]."""
    words = image_bytes // 4
    copy = f"""\tld.param.u64 %rd4, [img_p];
\tcvta.to.global.u64 %rd4, %rd4;
\tmov.u32 %r10, %r1;
$copy:
\tmul.wide.u32 %rd5, %r10, 4;
\tadd.s64 %rd6, %rd4, %rd5;
\tld.global.u32 %r11, [%rd6];
\tmov.u32 %r12, img;
\tshl.b32 %r13, %r10, 2;
\tadd.s32 %r12, %r12, %r13;
\tst.shared.u32 [%r12], %r11;
\tadd.s32 %r10, %r10, 128;
\tsetp.lt.u32 %p2, %r10, {words};
\t@%p2 bra $copy;
\tfence.proxy.async.shared::cta;
\tmov.u32 %r14, bar_mma;
\tsetp.eq.u32 %p3, %r1, 0;
\t@%p3 mbarrier.init.shared::cta.b64 [%r14], 1;
\tbar.sync 0;
"""
    issue = f"""\t@%p3 tcgen05.mma.cta_group::1.kind::f16 [%r3], %rd7, %rd8, %r15, 0;
\t@%p3 tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [%r14];
"""
    waiting = """$wait:
\tmbarrier.try_wait.parity.shared::cta.b64 %p4, [%r14], 0;
\t@!%p4 bra $wait;
""" if wait else ""
    # a descriptor's start address is img's shared address (+ B's offset) >> 4, added here
    body = copy + "\tmov.u32 %r20, img;\n\tshr.u32 %r20, %r20, 4;\n" \
        "\tcvt.u64.u32 %rd9, %r20;\n" \
        f"\tmov.b64 %rd7, {adesc};\n\tadd.s64 %rd7, %rd7, %rd9;\n" \
        f"\tmov.b64 %rd8, {bdesc};\n\tadd.s64 %rd8, %rd8, %rd9;\n" \
        f"\tmov.b32 %r15, {idesc};\n" + issue + waiting + WARP_BASE + \
        f"\ttcgen05.ld.sync.aligned.32x32b.x{n}.b32 {regs(200, n)}, [%r5];\n" \
        "\ttcgen05.wait::ld.sync.aligned;\n" + store_out(n)
    ptx = kernel(body, ncols=max(32, n), params=",\n\t.param .u64 img_p", smem=image_bytes)
    return ptx.replace("\t.shared .align 16 .b32 slot;",
                       "\t.shared .align 16 .b32 slot;\n\t.shared .align 8 .b64 bar_mma;")


def _mma_case(n, kind, trans_a, trans_b, swizzle_a, swizzle_b, wait=True):
    rng = np.random.default_rng(n + 7 * swizzle_a + swizzle_b)
    a_bits, A = halves(rng.standard_normal((128, 16)), kind)
    b_bits, B = halves(rng.standard_normal((n, 16)), kind)          # B as N x K
    lbo_a, sbo_a, size_a = strides(128, trans_a, swizzle_a)
    lbo_b, sbo_b, size_b = strides(n, trans_b, swizzle_b)
    base_b = -(-size_a // 1024) * 1024
    total = base_b + -(-size_b // 1024) * 1024
    image = np.zeros(total, np.uint8)
    place(image, 0, a_bits, trans_a, swizzle_a, lbo_a, sbo_a)
    place(image, base_b, b_bits, trans_b, swizzle_b, lbo_b, sbo_b)
    idesc = encode_instr_descriptor(128, n, "bf16" if kind == "bf16" else "f16",
                                    bool(trans_a), bool(trans_b))
    ptx = mma_kernel(idesc, encode_smem_descriptor(0, lbo_a, sbo_a, swizzle_a),
                     encode_smem_descriptor(base_b, lbo_b, sbo_b, swizzle_b), total, n, wait)
    out = np.zeros((128, n), np.uint32)
    run(ptx, "k", (1,), (128,), [out, image.view(np.uint32)])
    return out.view(np.float32), A @ B.T


@pytest.mark.parametrize("swizzle", [0, 32, 64, 128])
@pytest.mark.parametrize("trans_a, trans_b", [(0, 0), (0, 1), (1, 0)])
def test_mma_from_shared_memory_every_swizzle(swizzle, trans_a, trans_b):
    got, want = _mma_case(32, "f16", trans_a, trans_b, swizzle, swizzle)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)


def test_mma_bf16_n64():
    got, want = _mma_case(64, "bf16", 0, 1, 128, 64)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)


def test_mma_cells_before_the_wait_on_its_commit():
    with pytest.raises(EmulationError, match="a tcgen05.mma still writes") as e:
        _mma_case(32, "f16", 0, 0, 128, 128, wait=False)
    assert "tcgen05.ld" in e.value.text


# ------------------------------------------------------------------------ ordering across warps

def order_kernel(scenario: str) -> str:
    """Every warp fills columns 0-15 and 32-47 of its lanes (a CTA barrier orders the fills);
    `scenario` then runs with %r20 = the warp's base address, %rd8 / %r15 the B descriptor and
    instruction descriptor of an M128 N32 f16 MMA whose A is columns 0-7 (%r3) and D columns
    32-63 (%r21), mbarriers bar_a / bar_b / bar_mma (count 1) at %r16 / %r17 / %r14, %p3 for
    thread 0 and %p5 for lane 0 of each warp. B (32 x 16 halves, K-major, no swizzle) is
    zeros in shared memory."""
    lbo, sbo, size = strides(32, 0, 0)
    zero = "".join(f"\tst.shared.u32 [%r31+{512 * k}], 0;\n" for k in range(-(-size // 512)))
    setup = f"""\tmov.u32 %r30, img;
\tshl.b32 %r31, %r1, 2;
\tadd.s32 %r31, %r31, %r30;
{zero}\tfence.proxy.async.shared::cta;
\tmov.u32 %r14, bar_mma;
\tmov.u32 %r16, bar_a;
\tmov.u32 %r17, bar_b;
\tsetp.eq.u32 %p3, %r1, 0;
\tand.b32 %r32, %r1, 31;
\tsetp.eq.u32 %p5, %r32, 0;
\t@%p3 mbarrier.init.shared::cta.b64 [%r14], 1;
\t@%p3 mbarrier.init.shared::cta.b64 [%r16], 1;
\t@%p3 mbarrier.init.shared::cta.b64 [%r17], 1;
""" + FILL + "\tadd.s32 %r7, %r5, 32;\n" \
        f"\ttcgen05.st.sync.aligned.32x32b.x16.b32 [%r7], {regs(100, 16)};\n" \
        "\ttcgen05.wait::st.sync.aligned;\n" \
        "\ttcgen05.fence::before_thread_sync;\n\tbar.sync 0;\n" \
        "\ttcgen05.fence::after_thread_sync;\n" \
        f"\tshr.u32 %r33, %r30, 4;\n\tcvt.u64.u32 %rd9, %r33;\n" \
        f"\tmov.b64 %rd8, {encode_smem_descriptor(0, lbo, sbo, 0)};\n" \
        "\tadd.s64 %rd8, %rd8, %rd9;\n" \
        f"\tmov.b32 %r15, {encode_instr_descriptor(128, 32, 'f16')};\n" \
        "\tadd.s32 %r21, %r3, 32;\n\tmov.u32 %r20, %r5;\n"
    ptx = kernel(setup + scenario, ncols=64, smem=-(-size // 512) * 512)
    return ptx.replace("\t.shared .align 16 .b32 slot;",
                       "\t.shared .align 16 .b32 slot;\n\t.shared .align 8 .b64 bar_mma;\n"
                       "\t.shared .align 8 .b64 bar_a;\n\t.shared .align 8 .b64 bar_b;")


MMA = "\t@%p3 tcgen05.mma.cta_group::1.kind::f16 [%r21], [%r3], %rd8, %r15, 0;\n" \
    "\t@%p3 tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [%r14];\n"


def wait_on(bar: str, label: str, who: str = "") -> str:
    """Wait for phase 0 of the mbarrier at `bar`; `who`: a guard predicate (e.g. "@%p3 ")."""
    if who:
        return f"\t{who}bra ${label}_go;\n\tbra ${label}_end;\n${label}_go:\n" + \
            wait_on(bar, label) + f"${label}_end:\n"
    return f"${label}:\n\tmbarrier.try_wait.parity.shared::cta.b64 %p4, [{bar}], 0;\n" \
        f"\t@!%p4 bra ${label};\n"


def in_warp(w: int, code: str, label: str) -> str:
    """`code` run by warp w only."""
    return f"\tsetp.ne.u32 %p6, %r2, {w};\n\t@%p6 bra ${label};\n{code}${label}:\n"


FINISH = wait_on("%r14", "mma_done") + "\ttcgen05.fence::after_thread_sync;\n"
ARRIVE_A = "\t@%p5 mbarrier.arrive.shared::cta.b64 %rd10, [%r16];\n"
LD_D = "\tadd.s32 %r7, %r20, 32;\n" \
    f"\ttcgen05.ld.sync.aligned.32x32b.x16.b32 {regs(200, 16)}, [%r7];\n"
WAIT_LD = "\ttcgen05.wait::ld.sync.aligned;\n"
BEFORE = "\ttcgen05.fence::before_thread_sync;\n"
# thread 0 issues the MMA, commits, then arrives on bar_a (which says nothing of completion)
ISSUE_THEN_ARRIVE = MMA + "\t@%p3 mbarrier.arrive.shared::cta.b64 %rd10, [%r16];\n"


def completed_elsewhere(action: str) -> str:
    """Warp 1 waits on the MMA's commit (completing it in the emulator); warp 2 runs `action`
    after the issuing thread's arrival on bar_a only: nothing orders the completion before it."""
    return in_warp(1, wait_on("%r14", "w1_done"), "w1") + \
        in_warp(2, wait_on("%r16", "w2_issued") + action, "w2")


def _order_run(scenario: str):
    run(order_kernel(scenario), "k", (1,), (128,), [np.zeros(128 * 16, np.uint32)])


def test_ordered_read_then_mma_overwrite():
    """FlashAttention-4's "S free": warp 1 reads D's cells, waits for its loads, fences and
    arrives; the issuing thread waits on that mbarrier before its MMA overwrites them."""
    _order_run(in_warp(1, LD_D + WAIT_LD + BEFORE + ARRIVE_A, "w1") +
               wait_on("%r16", "s_free", "@%p3 ") + MMA + FINISH)


@pytest.mark.parametrize("reader", [
    LD_D + ARRIVE_A + WAIT_LD,          # arrives before its tcgen05.wait::ld
    LD_D + WAIT_LD + BEFORE,            # never arrives: the MMA waits on nothing of warp 1's
])
def test_mma_overwriting_cells_a_warp_read_unordered(reader):
    sync = wait_on("%r16", "s_free", "@%p3 ") if "arrive" in reader else "\tbar.sync 1, 64;\n"
    if "arrive" not in reader:      # warps 0 and 2 meet (a barrier that leaves warp 1 out)
        reader = reader + "\tbra $w1_out;\n"
        scenario = in_warp(1, reader, "w1") + \
            "\tsetp.eq.u32 %p6, %r2, 3;\n\t@%p6 bra $w1_out;\n" + sync + MMA + \
            "$w1_out:\n" + FINISH
    else:
        scenario = in_warp(1, reader, "w1") + sync + MMA + FINISH
    with pytest.raises(EmulationError, match="tcgen05.mma D overwrites tensor memory .* that "
                       "warp 1 accessed with tcgen05.ld at PTX line") as e:
        _order_run(scenario)
    assert e.value.tid == (0, 0, 0)


def test_store_over_an_mma_operand_in_flight():
    """P in tensor memory: the softmax warps may write the next P only once the P·V that reads
    the current one has completed (a wait on its commit)."""
    overwrite = "\ttcgen05.st.sync.aligned.32x32b.x1.b32 [%r20], {%r1};\n" \
        "\ttcgen05.wait::st.sync.aligned;\n"
    issue = ISSUE_THEN_ARRIVE + wait_on("%r16", "issued")
    _order_run(issue + FINISH + overwrite)
    with pytest.raises(EmulationError, match="tcgen05.st overwrites tensor memory .* that warp "
                       "0 accessed with tcgen05.mma \\(as its A operand\\) at PTX line \\d+, "
                       "not ordered after it: warp 0 did not wait"):
        _order_run(issue + overwrite + FINISH)
    # warp 1 completed the MMA (its wait), but warp 2, which never waited, then overwrites P
    with pytest.raises(EmulationError, match="tcgen05.st overwrites .* warp 2 did not wait"):
        _order_run(ISSUE_THEN_ARRIVE + completed_elsewhere(overwrite) + FINISH)


def test_mma_reading_a_store_of_another_warp():
    """P full: an MMA reading cells warp 1 stored is ordered after that warp's wait::st --
    directly (warp 1 arrives, thread 0 waits) or through a third warp (warp 1 -> warp 2 ->
    thread 0: release / acquire chains are transitive); not when warp 1 arrived first."""
    store = f"\ttcgen05.st.sync.aligned.32x32b.x8.b32 [%r20], {regs(100, 8)};\n"
    handed = in_warp(1, store + "\ttcgen05.wait::st.sync.aligned;\n" + BEFORE + ARRIVE_A, "w1")
    relay = in_warp(2, wait_on("%r16", "relay") +
                    "\t@%p5 mbarrier.arrive.shared::cta.b64 %rd10, [%r17];\n", "w2")
    _order_run(handed + relay + wait_on("%r17", "p_full", "@%p3 ") + MMA + FINISH)
    early = in_warp(1, ARRIVE_A + store + "\ttcgen05.wait::st.sync.aligned;\n", "w1")
    with pytest.raises(EmulationError, match="tcgen05\\.(mma A reads|st overwrites) tensor "
                       "memory"):
        _order_run(early + wait_on("%r16", "p_full", "@%p3 ") + MMA + FINISH)


def test_reading_an_mma_result_needs_its_commit_observed_by_the_reader():
    """Warp 2 reads D after a wait on its commit's phase, or after a chain from a warp that
    waited (warp 1 waits, then arrives on bar_b) -- not after an arrival the issuing thread
    made once it had committed (warp 1's wait completed the MMA in the emulator, but nothing
    orders that completion before warp 2's read: on hardware it may read stale cells)."""
    lanes_of_warp2 = "\tadd.s32 %r7, %r20, 32;\n" + \
        f"\ttcgen05.ld.sync.aligned.32x32b.x16.b32 {regs(200, 16)}, [%r7];\n" + WAIT_LD
    relayed = in_warp(1, wait_on("%r14", "w1_mma") + BEFORE +
                      "\t@%p5 mbarrier.arrive.shared::cta.b64 %rd10, [%r17];\n", "w1") + \
        in_warp(2, wait_on("%r17", "w2_relay") + "\ttcgen05.fence::after_thread_sync;\n" +
                lanes_of_warp2, "w2")
    _order_run(ISSUE_THEN_ARRIVE + relayed + FINISH)
    with pytest.raises(EmulationError, match="tcgen05.ld reads tensor memory .* that warp 0 "
                       "accessed with tcgen05.mma at PTX line \\d+, not ordered after it: warp 2 "
                       "did not wait on the mbarrier phase its tcgen05.commit arrives on"):
        _order_run(ISSUE_THEN_ARRIVE + completed_elsewhere(lanes_of_warp2) + FINISH)


def test_refilling_shared_memory_an_mma_read_needs_its_completion():
    """A K/V stage is refilled only once the MMA that read it completed, for the writing warp:
    warp 2 waits on the commit itself -- or a race when it only follows the issuing thread's
    arrival after the commit, though warp 1's wait completed the MMA in the emulator."""
    refill = "\tst.shared.u32 [%r30], 5;\n"
    _order_run(ISSUE_THEN_ARRIVE + in_warp(2, wait_on("%r14", "w2_done") + refill, "w2") +
               FINISH)
    with pytest.raises(EmulationError, match="write to shared memory \\(shared address 0x[0-9a-f]+"
                       "\\) that the tcgen05.mma at PTX line \\d+ \\(warp 0\\) read, not ordered "
                       "after its completion: warp 2 did not wait"):
        _order_run(ISSUE_THEN_ARRIVE + completed_elsewhere(refill) + FINISH)
