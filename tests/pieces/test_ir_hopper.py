"""sm_90a builder ops (ptxc/ir/hopper.py): exact text, precise errors, ptxas acceptance for
sm_90a, and a one-warpgroup probe -- an mbarrier round, then a descriptor-fed wgmma -- run in
the emulator against numpy (descriptor encoding and the accumulator layout end to end)."""

import numpy as np
import pytest

from ptxc.errors import IRError
from ptxc.ir import B32, E4M3, E5M2, F16, F32, PRED, U32, U64, Addr, KernelBuilder, render_module
from ptxc.ir.printer import render_instr


def text(b: KernelBuilder, last: int = 1) -> list[str]:
    return [render_instr(i) for i in b.entry.body[-last:]]


def test_wgmma_text():
    b = KernelBuilder("k")
    addr = b.mov(1024, U32)
    desc = b.matrix_descriptor(addr, 16, 1024, 128)
    assert text(b, 4) == ["\tshr.u32 %r2, %r1, 4;", "\tand.b32 %r3, %r2, 16383;",
                          "\tcvt.u64.u32 %rd1, %r3;",
                          f"\tor.b64 %rd2, %rd1, {(1 << 16) | (64 << 32) | (1 << 62)};"]
    assert desc.type == U64
    acc = [b.mov(0.0, F32) for _ in range(4)]
    b.wgmma_fence()
    b.wgmma(acc, desc, desc, F16, scale_d=False)
    b.wgmma(acc, [addr] * 4, desc, F16, scale_d=b.setp("ne", addr, 0), trans_b=1)
    b.wgmma_commit()
    b.wgmma_wait(1)
    assert text(b, 6)[0] == "\twgmma.fence.sync.aligned;"
    assert text(b, 6)[1] == ("\twgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 "
                             "{%f1, %f2, %f3, %f4}, %rd2, %rd2, 0, 1, 1, 0, 0;")
    assert text(b, 6)[3] == ("\twgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 "
                             "{%f1, %f2, %f3, %f4}, {%r1, %r1, %r1, %r1}, %rd2, %p1, 1, 1, 1;")
    assert text(b, 2) == ["\twgmma.commit_group.sync.aligned;", "\twgmma.wait_group.sync.aligned 1;"]
    b.wgmma(acc, desc, desc, E4M3)            # 8-bit: k32, no transpose operands
    b.wgmma(acc, [addr] * 4, desc, E5M2, scale_d=False)
    assert text(b, 2) == [
        "\twgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%f1, %f2, %f3, %f4}, %rd2, %rd2, 1, 1, 1;",
        "\twgmma.mma_async.sync.aligned.m64n8k32.f32.e5m2.e5m2 {%f1, %f2, %f3, %f4}, "
        "{%r1, %r1, %r1, %r1}, %rd2, 0, 1, 1;"]


def test_mbarrier_fence_and_setmaxnreg_text():
    b = KernelBuilder("k")
    bar = Addr(b.mov(0, U32))
    b.mbarrier_init(bar, 2)
    b.mbarrier_arrive(bar)
    b.mbarrier_arrive_expect_tx(bar, 4096)
    b.mbarrier_wait_parity(bar, 1)
    b.fence_proxy_async()
    b.setmaxnreg(False, 40)
    assert text(b, 8) == [
        "\tmbarrier.init.shared::cta.b64 [%r1], 2;",
        "\tmbarrier.arrive.shared::cta.b64 %rd1, [%r1];",
        "\tmbarrier.arrive.expect_tx.shared::cta.b64 %rd2, [%r1], 4096;",
        "$L__mbar_wait_1:",
        "\tmbarrier.try_wait.parity.shared::cta.b64 %p1, [%r1], 1;",
        "\t@!%p1 bra $L__mbar_wait_1;",
        "\tfence.proxy.async.shared::cta;",
        "\tsetmaxnreg.dec.sync.aligned.u32 40;"]


@pytest.mark.parametrize("call,message", [
    (lambda b, acc, d, r: b.wgmma(acc[:3], d, d, F16), "N = 6; N must be a multiple of 8"),
    (lambda b, acc, d, r: b.wgmma([r] * 4, d, d, F16), r"accumulator\[0\] %r1 is not an f32"),
    (lambda b, acc, d, r: b.wgmma(acc, d, d, F32), "input type f32 is not f16, bf16, e4m3 or e5m2"),
    (lambda b, acc, d, r: b.wgmma(acc, d, d, E4M3, trans_b=1), "e4m3 operands are K-major only"),
    (lambda b, acc, d, r: b.wgmma(acc, [r] * 3, d, F16), "register operand A is 4 32-bit"),
    (lambda b, acc, d, r: b.wgmma(acc, [r] * 4, d, F16, trans_a=1), "cannot be transposed"),
    (lambda b, acc, d, r: b.wgmma(acc, d, r, F16), "B descriptor: operand %r1 has type u32"),
    (lambda b, acc, d, r: b.wgmma(acc, d, d, F16, scale_d=1), "scale_d 1 is not a bool"),
    (lambda b, acc, d, r: b.wgmma(acc, d, d, F16, trans_b=2), "transpose flag 2"),
    (lambda b, acc, d, r: b.wgmma_wait(-1), "-1 is not a non-negative integer"),
    (lambda b, acc, d, r: b.matrix_descriptor(r, 16, 1024, 16), "swizzle 16 is not one of"),
    (lambda b, acc, d, r: b.matrix_descriptor(r, 8, 1024, 128), "lbo 8 is not a multiple of 16"),
    (lambda b, acc, d, r: b.setmaxnreg(True, 250), "250 is not a multiple of 8 in 24..256"),
    (lambda b, acc, d, r: b.mbarrier_init(r, 1), "is not an Addr"),
    (lambda b, acc, d, r: b.mbarrier_arrive(Addr(d)), "is u64, expected 32-bit"),
])
def test_hopper_ops_reject_bad_operands(call, message):
    b = KernelBuilder("k")
    r = b.mov(0, U32)
    acc = [b.mov(0.0, F32) for _ in range(4)]
    d = b.mov(0, U64)
    with pytest.raises(IRError, match=message):
        call(b, acc, d, r)


def test_warpgroup_ops_refuse_a_predicate():
    b = KernelBuilder("k")
    p = b.setp("eq", b.mov(0, U32), 0)
    assert p.type == PRED
    with b.predicate(p):
        for op in (b.wgmma_fence, b.wgmma_commit, lambda: b.wgmma_wait(0),
                   lambda: b.setmaxnreg(True, 240)):
            with pytest.raises(IRError, match="under a predicate: all 128 threads"):
                op()


def test_elect_sync_text_and_emulation():
    """elect.sync over the whole warp: `elect.sync %r|%p, -1;`, refused under a predicate; in
    the emulator exactly one lane (the lowest) of each warp gets the predicate."""
    b = KernelBuilder("elect_probe")
    out = b.to_global(b.load_param(b.param("out", U64)))
    tid = b.special("%tid.x")
    leader = b.elect_sync()
    assert render_instr(b.entry.body[-1]) == "\telect.sync %r2|%p1, -1;"
    flag = b.selp(1, 0, leader, U32)
    b.st("global", U32, Addr(b.add(out, b.mul_wide(tid, 4))), [flag])
    b.ret()
    with b.predicate(leader):
        with pytest.raises(IRError, match="elect.sync under a predicate"):
            b.elect_sync()
    ptx = render_module([b.entry], kernel="elect_probe", family="test", target="sm_90a",
                        ptx_version="8.0")
    from ptxc import emu
    res = np.zeros(64, np.uint32)
    emu.launch(ptx, "elect_probe", (1,), (64,), [res])
    assert res.tolist() == [1] + [0] * 31 + [1] + [0] * 31


def _probe_kernel() -> str:
    """One warpgroup: an mbarrier every thread arrives on (then waits for phase 0), A (64 x 16)
    and B (8 x 16) f16 staged with st.shared in the no-swizzle K-major layout (core matrices of
    8 rows x 16 B: A SBO 256 / LBO 128, B SBO 256 / LBO 128), D = A·Bᵀ on one wgmma m64n8k16."""
    b = KernelBuilder("wgmma_probe")
    pin, pout = (b.to_global(b.load_param(b.param(n, U64))) for n in ("ab", "d"))
    tid = b.special("%tid.x")
    smem = b.address_of(b.shared("probe_smem", 2048 + 256 + 8, align=1024))
    bar = Addr(smem, 2048 + 256)
    with b.predicate(b.setp("eq", tid, 0)):
        b.mbarrier_init(bar, 128)
    b.bar_sync()
    b.mbarrier_arrive(bar)
    b.mbarrier_wait_parity(bar, 0)
    # chunk c (16 B) of the 80 x 16 row-major source: row c // 2, k-chunk c % 2
    for base_chunk, rows_base, rows in ((0, 0, 64), (128, 2048, 8)):
        with b.if_then(b.setp("lt", tid, 2 * rows)):
            c = b.add(tid, base_chunk)
            vals = b.ld("global", B32, Addr(b.add(pin, b.mul_wide(c, 16))), vec=4)
            r, kc = b.shr(tid, 1), b.and_(tid, 1)
            off = b.add(b.mad(b.shr(r, 3), 256, b.mad(kc, 128, b.mul(b.and_(r, 7), 16))), rows_base)
            b.st("shared", B32, Addr(b.add(smem, off)), vals)
    b.fence_proxy_async()
    b.bar_sync()
    a_desc = b.matrix_descriptor(smem, 128, 256, 0)
    b_desc = b.matrix_descriptor(b.add(smem, 2048), 128, 256, 0)
    acc = [b.mov(0.0, F32) for _ in range(4)]
    b.wgmma_fence()
    b.wgmma(acc, a_desc, b_desc, F16, scale_d=False)
    b.wgmma_commit()
    b.wgmma_wait(0)
    lane, w = b.and_(tid, 31), b.shr(tid, 5)
    g, t = b.shr(lane, 2), b.and_(lane, 3)
    for half in range(2):   # acc 0,1 -> row 16w + g; 2,3 -> row 16w + g + 8; cols 2t, 2t + 1
        row = b.add(b.mad(w, 16, g), 8 * half)
        idx = b.mad(row, 8, b.shl(t, 1))
        b.st("global", F32, Addr(b.add(pout, b.mul_wide(idx, 4))), acc[2 * half:2 * half + 2])
    b.ret()
    return render_module([b.entry], kernel="probe", family="test", target="sm_90a", ptx_version="8.0")


def test_wgmma_probe_matches_numpy_in_emulator():
    emu = pytest.importorskip("ptxc.emu")
    rng = np.random.default_rng(7)
    a = rng.standard_normal((64, 16)).astype(np.float16)
    bt = rng.standard_normal((8, 16)).astype(np.float16)
    out = np.full((64, 8), np.nan, np.float32)
    emu.launch(_probe_kernel(), "wgmma_probe", (1,), (128,), [np.concatenate([a, bt]), out])
    np.testing.assert_allclose(out, a.astype(np.float64) @ bt.astype(np.float64).T,
                               rtol=1e-5, atol=1e-5)


def test_hopper_ops_assemble_for_sm90a(toolchain):
    from ptxc.pipeline.ptxas import assemble
    _, res, _ = assemble(_probe_kernel(), "sm_90a", toolchain, "probe")
    assert res["wgmma_probe"].spill_stores == 0
