"""TMA stores (cp.async.bulk.tensor shared -> global, bulk groups) checked against Triton 3.9's
sm_90a PTX, unmodified: an f32 tile loaded by TMA, c = 2 a + 1, staged in shared memory by the threads
and written back by one TMA store per tile -- on shapes whose last tiles cross the tensor's
edge (the store clips them: nothing outside is written). Planted mistakes: the
fence.proxy.async between the threads' shared writes and the store removed (proxy race), the
wait_group.read removed (the CTA exits while the store still reads its shared memory), and a
shared write before the wait_group.read (a write under an in-flight store)."""

import numpy as np
import pytest

from ptxc.emu import TensorMap
from ptxc.errors import EmulationError
from tests.peers.cases import run
from tests.peers.conftest import cached

tk = pytest.importorskip("tests.peers.triton_kernels", reason="triton not installed",
                         exc_type=ImportError)
BM, BN = 64, 32               # f32: 128-byte rows, the widest swizzle


def _kernel(triton):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = {"a_desc": f"tensordesc<fp32[{BM}, {BN}]>", "c_desc": f"tensordesc<fp32[{BM}, {BN}]>",
           "BM": "constexpr", "BN": "constexpr"}

    def build():
        src = ASTSource(fn=tk.scale_tma_store_kernel, signature=sig,
                        constexprs={"BM": BM, "BN": BN})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        swizzles = [{0: 0, 1: 32, 2: 64, 3: 128}[d["swizzle"]]
                    for d in k.metadata.tensordesc_meta]
        return k.asm["ptx"], k.metadata.name, int(k.metadata.shared), swizzles
    return cached(("triton-tma-store", triton.__version__, tk.scale_tma_store_kernel.src), build)


def _run(ptx, name, shared, swizzles, M, N, seed=0):
    a = np.random.default_rng(seed).standard_normal((M, N)).astype(np.float32)
    c = np.full((M, N), -7.0, np.float32)
    u32, u64 = np.uint32, np.uint64
    run((ptx, name, shared), (-(-M // BM), -(-N // BN)), 4,
        [TensorMap(a, (BN, BM), swizzles[0]), u32(M), u32(N), u64(N), u64(1),
         TensorMap(c, (BN, BM), swizzles[1]), u32(M), u32(N), u64(N), u64(1)])
    return a, c


@pytest.fixture(scope="module")
def kernel():
    triton = pytest.importorskip("triton")
    ptx, name, shared, swizzles = _kernel(triton)
    assert "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group" in ptx
    assert "fence.proxy.async.shared::cta" in ptx and "cp.async.bulk.wait_group" in ptx
    return ptx, name, shared, swizzles


@pytest.mark.parametrize("M, N", [(64, 64), (130, 70), (17, 200)])
def test_triton_tma_store(kernel, M, N):
    a, c = _run(*kernel, M, N, seed=M + N)
    np.testing.assert_array_equal(c, a * np.float32(2) + np.float32(1))


@pytest.mark.parametrize("edit, message", [
    (lambda p: p.replace("fence.proxy.async.shared::cta;", ""), "shared-memory proxy race"),
    (lambda p: p.replace("cp.async.bulk.wait_group.read 0;", "")
     .replace("cp.async.bulk.wait_group \t0;", ""), "still reads shared memory when its CTA exits"),
    (lambda p: p.replace("cp.async.bulk.commit_group;",
                         "cp.async.bulk.commit_group;\n\tst.shared.v4.b32 [%r2], {%r3, %r3, %r3, %r3};"),
     "TMA store .* in flight reads"),
])
def test_tma_store_mistakes_are_caught(kernel, edit, message):
    ptx, name, shared, swizzles = kernel
    broken = edit(ptx)
    assert broken != ptx
    with pytest.raises(EmulationError, match=message):
        _run(broken, name, shared, swizzles, 130, 70)
