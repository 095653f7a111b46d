"""Triton's PTX (vector add, softmax, f16/bf16 matmul with cp.async pipelines, FlashAttention
forward) runs unmodified in the emulator and matches numpy. Triton is validated on hardware, so
this anchors the emulator's mma/ldmatrix/cp.async/shfl/cvt semantics to a second code
generator."""

import numpy as np
import pytest

from tests.peers.cases import (ATTENTION_SIG, check_attention, check_matmul,
                                matmul_signature, run)

tk = pytest.importorskip("tests.peers.triton_kernels", reason="triton not installed",
                         exc_type=ImportError)


@pytest.mark.parametrize("n", [1, 17, 1000])
def test_vector_add(triton_ptx, n):
    c = triton_ptx(tk.add_kernel, {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32",
                                   "n": "i32"}, {"BLOCK": 256})
    rng = np.random.default_rng(n)
    x, y = rng.random(n, np.float32), rng.random(n, np.float32)
    out = np.zeros(n, np.float32)
    run(c, (-(-n // 256),), 4, [x, y, out, np.uint32(n)])
    np.testing.assert_array_equal(out, x + y)


@pytest.mark.parametrize("rows, cols", [(1, 1), (5, 113)])
def test_softmax(triton_ptx, rows, cols):
    c = triton_ptx(tk.softmax_kernel, {"x_ptr": "*fp32", "out_ptr": "*fp32", "n_cols": "i32",
                                       "stride": "i32"}, {"BLOCK": 128})
    x = np.random.default_rng(cols).standard_normal((rows, cols)).astype(np.float32) * 4
    out = np.zeros_like(x)
    run(c, (rows,), 4, [x, out, np.uint32(cols), np.uint32(cols)])
    e = np.exp(x.astype(np.float64) - x.max(1, keepdims=True))
    np.testing.assert_allclose(out, e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype, stages, K", [("fp16", 2, 96), ("fp16", 3, 96), ("bf16", 3, 96),
                                               ("fp16", 2, 113)])
def test_matmul(triton_ptx, dtype, stages, K):
    aligned = K % 16 == 0         # then Triton pipelines the tiles through cp.async
    c = triton_ptx(tk.matmul_kernel, matmul_signature(dtype), {"BM": 64, "BN": 64, "BK": 32},
                   num_stages=stages,
                   divisible=("K", "stride_am", "stride_bk", "stride_cm") if aligned else ())
    assert "ldmatrix" in c[0] and "mma.sync" in c[0]
    assert ("cp.async.wait_group" in c[0]) == aligned
    check_matmul(c, dtype, K, seed=stages)


@pytest.mark.parametrize("causal, seq_q, seq_k", [(False, 70, 90), (True, 70, 90),
                                                  (True, 1, 17)])
def test_flash_attention_forward(triton_ptx, causal, seq_q, seq_k):
    c = triton_ptx(tk.attention_kernel, ATTENTION_SIG, {"D": 64, "BM": 64, "BN": 32,
                                                         "CAUSAL": causal})
    check_attention(c, causal, seq_q, seq_k)
