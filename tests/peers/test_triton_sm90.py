"""Triton's default sm_90a PTX (GPUTarget("cuda", 90, 32)): `tl.dot` becomes
wgmma.mma_async with shared-memory matrix descriptors (swizzled, K- and MN-major) and, for
P·V in attention, A from registers; the tiles still arrive through cp.async with
fence.proxy.async. It runs unmodified in the emulator and matches numpy, which anchors the
emulator's Hopper model (descriptor decoding, swizzles, fragment layouts, wgmma groups) to a
code generator validated on H100s."""

import pytest

from tests.peers.cases import ATTENTION_SIG, check_attention, check_matmul, matmul_signature

tk = pytest.importorskip("tests.peers.triton_kernels", reason="triton not installed",
                         exc_type=ImportError)


@pytest.mark.parametrize("dtype, stages, K", [("fp16", 2, 96), ("bf16", 3, 96),
                                               ("fp16", 2, 113)])
def test_matmul_sm90a(triton_ptx, dtype, stages, K):
    aligned = K % 16 == 0
    c = triton_ptx(tk.matmul_kernel, matmul_signature(dtype), {"BM": 64, "BN": 64, "BK": 32},
                   num_stages=stages, arch=90,
                   divisible=("K", "stride_am", "stride_bk", "stride_cm") if aligned else ())
    ptx = c[0]
    assert ".target sm_90a" in ptx and "wgmma.mma_async" in ptx and "mma.sync" not in ptx
    check_matmul(c, dtype, K, seed=stages + K)


@pytest.mark.parametrize("causal, seq_q, seq_k", [(False, 70, 90), (True, 70, 90),
                                                  (True, 1, 17)])
def test_flash_attention_forward_sm90a(triton_ptx, causal, seq_q, seq_k):
    c = triton_ptx(tk.attention_kernel, ATTENTION_SIG,
                   {"D": 64, "BM": 64, "BN": 32, "CAUSAL": causal}, arch=90)
    ptx = c[0]
    assert "wgmma.mma_async.sync.aligned.m64n32k16" in ptx          # S = Q K^T
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {" in ptx and \
        "}, {%r" in ptx                                              # O += P V, P in registers
    check_attention(c, causal, seq_q, seq_k)
