"""TMA builder ops (ptxc/ir/hopper.py): the tensor-map parameter type (`.param .align 64 .b8
NAME[128]`), cp.async.bulk.tensor with an mbarrier and prefetch.tensormap -- exact text, precise
errors, ptxas acceptance for sm_90a, and a probe kernel (one elected thread loads a swizzled 3-D
box partly outside the tensor, every thread waits on the mbarrier and copies the shared image
out) run in the emulator against a numpy image."""

import numpy as np
import pytest

from ptxc.errors import IRError
from ptxc.ir import S32, TMAP, U32, U64, Addr, KernelBuilder, render_module
from ptxc.ir.printer import render_instr


def test_tensor_map_param_and_copy_text():
    b = KernelBuilder("k")
    tmap = b.param("k_tmap", TMAP)
    b.param("n", U32)
    dst, bar = b.mov(1024, U32), b.mov(8, U32)
    c = b.bitcast(b.mov(3, U32), S32)
    addr = b.tensor_map_address(tmap)
    b.prefetch_tensormap(addr)
    b.tma_load(Addr(dst), addr, [0, c, 7], Addr(bar))
    lines = [render_instr(i) for i in b.entry.body[-4:]]
    assert lines == [
        "\tmov.u64 %rd1, k_tmap;", "\tcvta.param.u64 %rd1, %rd1;",
        "\tprefetch.tensormap [%rd1];",
        "\tcp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
        "[%r1], [%rd1, {0, %r3, 7}], [%r2];"]
    ptx = render_module([b.entry], kernel="t", family="test", target="sm_90a", ptx_version="8.0")
    assert "\t.param .align 64 .b8 k_tmap[128],\n\t.param .u32 n\n" in ptx


@pytest.mark.parametrize("call,message", [
    (lambda b, t, r: b.tensor_map_address(b.param("p", U64)), "is not a tensor-map parameter"),
    (lambda b, t, r: b.tma_load(Addr(r), r, [0], Addr(r)), "tensor map: operand %r1 has type u32"),
    (lambda b, t, r: b.tma_load(Addr(r), t, [0], Addr(r)), "tensor map: operand m has type tmap"),
    (lambda b, t, r: b.tma_load(Addr(r), b.tensor_map_address(t), [0] * 6, Addr(r)), "6 coordinates"),
    (lambda b, t, r: b.tma_load(Addr(r), b.tensor_map_address(t), [r], Addr(r)),
     "coordinate 0: operand %r1 has type u32"),
    (lambda b, t, r: b.tma_load(r, b.tensor_map_address(t), [0], Addr(r)), "destination: .* is not an Addr"),
    (lambda b, t, r: b.tma_load(Addr(r), b.tensor_map_address(t), [0], Addr(b.mov(0, U64))),
     "mbarrier: shared address"),
    (lambda b, t, r: b.prefetch_tensormap(r), "prefetch.tensormap: .* is not a u64 register"),
    (lambda b, t, r: b.load_param(t), "a tensor map is a parameter, not a register"),
])
def test_tma_ops_reject_bad_operands(call, message):
    b = KernelBuilder("k")
    t = b.param("m", TMAP)
    r = b.mov(0, U32)
    with pytest.raises(IRError, match=message):
        call(b, t, r)


BOX = (64, 5, 2)   # 64 f16 (128 B, the swizzle width) x 5 rows x 2 planes


def _probe_kernel(prefetch: bool = False) -> str:
    """prefetch: with prefetch.tensormap (ptxas only: the emulator does not model the
    descriptor cache)."""
    b = KernelBuilder("tma_probe")
    tmap = b.param("src_tmap", TMAP)
    pout = b.to_global(b.load_param(b.param("out", U64)))
    c1, c2 = (b.load_param(b.param(n, S32)) for n in ("row0", "plane0"))
    tid = b.special("%tid.x")
    nbytes = 2 * BOX[0] * BOX[1] * BOX[2]
    smem = b.address_of(b.shared("probe_smem", 2048 + 8, align=1024))
    bar = Addr(smem, 2048)
    addr = b.tensor_map_address(tmap)
    if prefetch:
        b.prefetch_tensormap(addr)
    leader = b.setp("eq", tid, 0)
    with b.predicate(leader):
        b.mbarrier_init(bar, 1)
    b.bar_sync()
    with b.if_then(leader):
        b.mbarrier_arrive_expect_tx(bar, nbytes)
        b.tma_load(Addr(smem), addr, [0, c1, c2], bar)
    b.mbarrier_wait_parity(bar, 0)
    with b.if_then(b.setp("lt", tid, nbytes // 16)):
        vals = b.ld("shared", U32, Addr(b.add(smem, b.shl(tid, 4))), vec=4)
        b.st("global", U32, Addr(b.add(pout, b.mul_wide(tid, 16))), vals)
    b.ret()
    return render_module([b.entry], kernel="probe", family="test", target="sm_90a", ptx_version="8.0")


def test_tma_probe_in_emulator():
    emu = pytest.importorskip("ptxc.emu")
    t = np.random.default_rng(3).integers(1, 65535, (3, 9, 64), dtype=np.uint16)
    out = np.zeros(2 * np.prod(BOX), np.uint8)
    row0, plane0 = 6, 1          # rows 9, 10 and plane 3 lie outside: zeros
    emu.launch(_probe_kernel(), "tma_probe", (1,), (128,),
               [emu.TensorMap(t, BOX, 128), out, np.int32(row0), np.int32(plane0)])
    img = np.zeros(out.size, np.uint8)
    for p in range(BOX[2]):
        for r in range(BOX[1]):
            for c in range(BOX[0]):
                z, y = plane0 + p, row0 + r
                v = t[z, y, c] if z < t.shape[0] and y < t.shape[1] else 0
                a = ((p * BOX[1] + r) * BOX[0] + c) * 2
                a ^= ((a >> 7) % 8) << 4          # the 128-byte swizzle
                img[a:a + 2] = np.frombuffer(np.uint16(v).tobytes(), np.uint8)
    np.testing.assert_array_equal(out, img)


def test_tma_ops_assemble_for_sm90a(toolchain):
    from ptxc.pipeline.ptxas import assemble
    _, res, _ = assemble(_probe_kernel(prefetch=True), "sm_90a", toolchain, "probe")
    assert res["tma_probe"].spill_stores == 0
