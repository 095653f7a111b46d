"""Tensor-core and async-copy builder ops: exact text, precise type errors, ptxas acceptance, and
one mma fed by ldmatrix computed in the emulator against numpy (fragment layouts end to end)."""

import numpy as np
import pytest

from ptxc.errors import IRError
from ptxc.ir import (B32, BF16, BF16X2, E4M3, E5M2, F16, F16X2, F32, U32, U64, Addr, KernelBuilder,
                     render_module)
from ptxc.ir.printer import render_instr


def text(b: KernelBuilder, last: int = 1) -> list[str]:
    return [render_instr(i) for i in b.entry.body[-last:]]


def regs(b, n, type):
    return [b.mov(0.0, type) if type == F32 else b.mov(0, type) for _ in range(n)]


def test_mma_text_and_in_place_accumulate():
    b = KernelBuilder("k")
    a, bb, c = regs(b, 4, B32), regs(b, 2, B32), regs(b, 4, F32)
    d = b.mma_m16n8k16(a, bb, c, F16)
    assert text(b) == ["\tmma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f5, %f6, %f7, %f8}, "
                       "{%r1, %r2, %r3, %r4}, {%r5, %r6}, {%f1, %f2, %f3, %f4};"]
    assert [str(x) for x in d] == ["%f5", "%f6", "%f7", "%f8"]
    pairs = [b.mov(0, BF16X2) for _ in range(4)]
    assert b.mma_m16n8k16(pairs, bb, d, BF16, out=d) == d
    assert text(b)[0].startswith("\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f5, %f6, %f7, %f8}")


@pytest.mark.parametrize("mutate,message", [
    (lambda a, bb, c: dict(in_type=F32), "input type f32 is not f16 or bf16"),
    (lambda a, bb, c: dict(a=a[:3]), "operand a has 3 registers, expected 4"),
    (lambda a, bb, c: dict(b=bb + bb), "operand b has 4 registers, expected 2"),
    (lambda a, bb, c: dict(c=a), r"c\[0\] %r1 has type b32, expected f32"),
    (lambda a, bb, c: dict(a=c), r"a\[0\] %f1 has type f32, expected b32 or f16x2"),
    (lambda a, bb, c: dict(in_type=BF16, a=[a[0]] * 3 + ["x"]), r"a\[3\] = 'x' is not a register"),
    (lambda a, bb, c: dict(out=c[:2]), "2 destination registers, expected 4"),
])
def test_mma_rejects_bad_operands(mutate, message):
    b = KernelBuilder("k")
    a, bb, c = regs(b, 4, B32), regs(b, 2, B32), regs(b, 4, F32)
    kw = dict(a=a, b=bb, c=c, in_type=F16)
    kw.update(mutate(a, bb, c))
    with pytest.raises(IRError, match="mma.m16n8k16: " + message):
        b.mma_m16n8k16(**kw)


def test_mma_pair_type_must_match_input_type():
    b = KernelBuilder("k")
    halves = [b.mov(0, F16X2) for _ in range(4)]
    with pytest.raises(IRError, match=r"a\[0\] %r1 has type f16x2, expected b32 or bf16x2"):
        b.mma_m16n8k16(halves, regs(b, 2, B32), regs(b, 4, F32), BF16)


def test_mma_k32_fp8_text_and_errors():
    b = KernelBuilder("k")
    a, bb, c = regs(b, 4, B32), regs(b, 2, B32), regs(b, 4, F32)
    d = b.mma_m16n8k32(a, bb, c, E4M3)
    assert text(b) == ["\tmma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%f5, %f6, %f7, %f8}, "
                       "{%r1, %r2, %r3, %r4}, {%r5, %r6}, {%f1, %f2, %f3, %f4};"]
    assert b.mma_m16n8k32(a, bb, d, E4M3, E5M2, out=d) == d
    assert text(b)[0].startswith("\tmma.sync.aligned.m16n8k32.row.col.f32.e4m3.e5m2.f32 {%f5, %f6, %f7, %f8}")
    with pytest.raises(IRError, match="mma.m16n8k32: a type f16 is not e4m3 or e5m2"):
        b.mma_m16n8k32(a, bb, c, F16)
    with pytest.raises(IRError, match=r"mma.m16n8k32: a\[0\] %r7 has type f16x2, expected b32"):
        b.mma_m16n8k32([b.mov(0, F16X2) for _ in range(4)], bb, c, E4M3)
    with pytest.raises(IRError, match="operand b has 1 registers, expected 2"):
        b.mma_m16n8k32(a, bb[:1], c, E4M3)


def test_ldmatrix_text_and_errors():
    b = KernelBuilder("k")
    base = b.mov(0, U32)
    out = b.ldmatrix(Addr(base, 32), 4, trans=True)
    assert len(out) == 4 and all(r.type == B32 for r in out)
    assert text(b) == ["\tldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%r2, %r3, %r4, %r5}, [%r1+32];"]
    b.ldmatrix(Addr(base), 1)
    assert text(b) == ["\tldmatrix.sync.aligned.m8n8.x1.shared.b16 {%r6}, [%r1];"]
    with pytest.raises(IRError, match="ldmatrix: count 3 is not 1, 2 or 4"):
        b.ldmatrix(Addr(base), 3)
    with pytest.raises(IRError, match="ldmatrix.shared: address register %rd1 is u64, expected 32-bit"):
        b.ldmatrix(Addr(b.mov(0, U64)), 2)


def test_cp_async_text_and_errors():
    b = KernelBuilder("k")
    dst, src = b.mov(0, U32), b.mov(0, U64)
    b.cp_async(Addr(dst, 16), Addr(src), 16, b.mov(8, U32))
    b.cp_async(Addr(dst), Addr(src, 64), 8, cache="ca")
    b.cp_async(Addr(dst), Addr(src), 16, 0)
    b.cp_async_commit()
    b.cp_async_wait(2)
    assert text(b, 5) == ["\tcp.async.cg.shared.global [%r1+16], [%rd1], 16, %r2;",
                          "\tcp.async.ca.shared.global [%r1], [%rd1+64], 8;",
                          "\tcp.async.cg.shared.global [%r1], [%rd1], 16, 0;",
                          "\tcp.async.commit_group;", "\tcp.async.wait_group 2;"]
    for kw, message in [(dict(size=8), r"cp.async.cg: size 8; .cg copies 16 bytes"),
                        (dict(size=12, cache="ca"), "size 12 is not 4, 8 or 16"),
                        (dict(cache="cs"), "cache level 'cs' is not 'ca' or 'cg'"),
                        (dict(src_size=17), "src_size 17 outside 0..16"),
                        (dict(src_size=b.mov(1.0, F32)), "src_size: operand %f1 has type f32, expected u32")]:
        with pytest.raises(IRError, match=message):
            b.cp_async(Addr(dst), Addr(src), **kw)
    with pytest.raises(IRError, match="address register %rd1 is u64, expected 32-bit"):
        b.cp_async(Addr(src), Addr(src))
    with pytest.raises(IRError, match="address register %r1 is u32, expected 64-bit"):
        b.cp_async(Addr(dst), Addr(dst))
    with pytest.raises(IRError, match="wait_group: -1 is not a non-negative integer"):
        b.cp_async_wait(-1)


def _mma_kernel(in_type) -> str:
    """A[16x16] and Bᵀ[8x16] (row-major halves) -> shared by cp.async -> ldmatrix -> mma -> D."""
    b = KernelBuilder("mma_probe")
    pa, pd = (b.to_global(b.load_param(b.param(n, U64))) for n in ("ab", "d"))
    smem = b.address_of(b.shared("tile", 768))
    lane = b.special("%tid.x")
    # 48 chunks of 16 bytes: A rows 0-15 x 2 chunks, then Bt rows 0-7 x 2 chunks.
    for pass_ in range(2):
        chunk = b.add(lane, 32 * pass_)
        ok = b.setp("lt", chunk, 48)
        off = b.mul(chunk, 16)
        with b.predicate(ok):
            b.cp_async(Addr(b.add(smem, off)), Addr(b.add(pa, b.cvt(U64, off))))
    b.cp_async_commit()
    b.cp_async_wait(0)
    b.bar_sync()
    row_addr = b.add(smem, b.mad(b.and_(lane, 15), 32, b.mul(b.shr(lane, 4), 16)))
    a = b.ldmatrix(Addr(row_addr), 4)
    bt_addr = b.add(smem, b.add(512, b.mad(b.and_(lane, 7), 32, b.mul(b.and_(b.shr(lane, 3), 1), 16))))
    bfr = b.ldmatrix(Addr(bt_addr), 2)
    d = b.mma_m16n8k16(a, bfr, [b.mov(0.0, F32) for _ in range(4)], in_type)
    g, t = b.shr(lane, 2), b.and_(lane, 3)
    for half in range(2):   # d0,d1 -> row g; d2,d3 -> row g + 8; cols 2t, 2t+1
        idx = b.mad(b.add(g, 8 * half), 8, b.shl(t, 1))
        b.st("global", F32, Addr(b.add(pd, b.mul_wide(idx, 4))), d[2 * half:2 * half + 2])
    b.ret()
    return render_module([b.entry], kernel="probe", family="test", target="sm_80", ptx_version="7.1")


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_ldmatrix_mma_matches_numpy_in_emulator(dtype):
    emu = pytest.importorskip("ptxc.emu")
    from ptxc.reference import round_to, to_device
    ptx = _mma_kernel(F16 if dtype == "f16" else BF16)
    rng = np.random.default_rng(1)
    a, bt = round_to(rng.standard_normal((16, 16)), dtype), round_to(rng.standard_normal((8, 16)), dtype)
    packed = to_device(np.concatenate([a.reshape(-1), bt.reshape(-1)]), dtype)
    out = np.full((16, 8), np.nan, np.float32)
    emu.launch(ptx, "mma_probe", (1,), (32,), [packed, out])
    np.testing.assert_allclose(out, a @ bt.T, rtol=1e-5, atol=1e-5)


def test_tensor_core_ops_assemble(toolchain):
    from ptxc.pipeline.ptxas import assemble
    ptx = _mma_kernel(BF16)
    _, res, _ = assemble(ptx, "sm_80", toolchain, "probe")
    assert res["mma_probe"].spill_stores == 0
