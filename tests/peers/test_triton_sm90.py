"""Triton's default sm_90a PTX (GPUTarget("cuda", 90, 32)): `tl.dot` becomes
wgmma.mma_async with shared-memory matrix descriptors (swizzled, K- and MN-major) and, for
P·V in attention, A from registers; the tiles still arrive through cp.async with
fence.proxy.async. It runs unmodified in the emulator and matches numpy, which anchors the
emulator's Hopper model (descriptor decoding, swizzles, fragment layouts, wgmma groups) to a
code generator validated on H100s."""

import numpy as np
import pytest

from tests.peers.test_triton import bf16, run

tk = pytest.importorskip("tests.peers.triton_kernels", reason="triton not installed",
                         exc_type=ImportError)


@pytest.mark.parametrize("dtype, stages, K", [("fp16", 2, 96), ("bf16", 3, 96),
                                               ("fp16", 2, 113)])
def test_matmul_sm90a(triton_ptx, dtype, stages, K):
    aligned = K % 16 == 0
    c = triton_ptx(tk.matmul_kernel,
                   {"a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "c_ptr": "*fp32", "M": "i32",
                    "N": "i32", "K": "i32", "stride_am": "i32", "stride_bk": "i32",
                    "stride_cm": "i32"}, {"BM": 64, "BN": 64, "BK": 32}, num_stages=stages,
                   arch=90, divisible=("K", "stride_am", "stride_bk", "stride_cm") if aligned
                   else ())
    ptx = c[0]
    assert ".target sm_90a" in ptx and "wgmma.mma_async" in ptx and "mma.sync" not in ptx
    M, N = 70, 80
    rng = np.random.default_rng(stages + K)
    a64, b64 = rng.standard_normal((M, K)), rng.standard_normal((K, N))
    if dtype == "fp16":
        a, b = a64.astype(np.float16), b64.astype(np.float16)
        av, bv = a.astype(np.float64), b.astype(np.float64)
    else:
        (a, av), (b, bv) = bf16(a64), bf16(b64)
    out = np.zeros((M, N), np.float32)
    run(c, (-(-M // 64), -(-N // 64)), 4,
        [a, b, out] + [np.uint32(v) for v in (M, N, K, K, N, N)])
    np.testing.assert_allclose(out, av @ bv, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("causal, seq_q, seq_k", [(False, 70, 90), (True, 70, 90),
                                                  (True, 1, 17)])
def test_flash_attention_forward_sm90a(triton_ptx, causal, seq_q, seq_k):
    c = triton_ptx(tk.attention_kernel,
                   {"q_ptr": "*fp16", "k_ptr": "*fp16", "v_ptr": "*fp16", "o_ptr": "*fp16",
                    "seq_q": "i32", "seq_k": "i32", "scale": "fp32"},
                   {"D": 64, "BM": 64, "BN": 32, "CAUSAL": causal}, arch=90)
    ptx = c[0]
    assert "wgmma.mma_async.sync.aligned.m64n32k16" in ptx          # S = Q K^T
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {" in ptx and \
        "}, {%r" in ptx                                              # O += P V, P in registers
    D, scale = 64, 0.125
    rng = np.random.default_rng(seq_q)
    q, k, v = (rng.standard_normal((n, D)).astype(np.float16) for n in (seq_q, seq_k, seq_k))
    out = np.zeros((seq_q, D), np.float16)
    run(c, (-(-seq_q // 64),), 4,
        [q, k, v, out, np.uint32(seq_q), np.uint32(seq_k), np.float32(scale)])
    s = q.astype(np.float64) @ k.astype(np.float64).T * scale
    if causal:
        s = np.where(np.arange(seq_k)[None] <= np.arange(seq_q)[:, None] + seq_k - seq_q, s,
                     -np.inf)
    p = np.exp(s - s.max(1, keepdims=True))
    ref = (p / p.sum(1, keepdims=True)) @ v.astype(np.float64)
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=2e-3, rtol=2e-3)
