"""Triton's PTX (vector add, softmax, f16/bf16 matmul with cp.async pipelines, FlashAttention
forward) runs unmodified in the emulator and matches numpy. Triton is validated on hardware, so
this anchors the emulator's mma/ldmatrix/cp.async/shfl/cvt semantics to a second code
generator."""

import numpy as np
import pytest

from ptxc.emu import launch

tk = pytest.importorskip("tests.peers.triton_kernels", reason="triton not installed",
                         exc_type=ImportError)

SCRATCH = [np.zeros(0, np.uint8), np.zeros(0, np.uint8)]   # Triton's global/profile scratch


def run(compiled, grid, num_warps, args):
    ptx, name, shared = compiled
    assert ".section" in ptx or "TRITON_DISABLE_LINE_INFO" in __import__("os").environ
    return launch(ptx, name, grid, (32 * num_warps,), args + SCRATCH, dynamic_smem_bytes=shared)


def bf16(x):
    """float64 -> bf16 bits (round to nearest even) and the values they hold."""
    b = np.asarray(x, np.float32).view(np.uint32)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    return b, (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


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
    c = triton_ptx(tk.matmul_kernel,
                   {"a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "c_ptr": "*fp32", "M": "i32",
                    "N": "i32", "K": "i32", "stride_am": "i32", "stride_bk": "i32",
                    "stride_cm": "i32"}, {"BM": 64, "BN": 64, "BK": 32}, num_stages=stages,
                   divisible=("K", "stride_am", "stride_bk", "stride_cm") if aligned else ())
    assert "ldmatrix" in c[0] and "mma.sync" in c[0]
    assert ("cp.async.wait_group" in c[0]) == aligned
    M, N = 70, 80
    rng = np.random.default_rng(stages)
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
def test_flash_attention_forward(triton_ptx, causal, seq_q, seq_k):
    c = triton_ptx(tk.attention_kernel,
                   {"q_ptr": "*fp16", "k_ptr": "*fp16", "v_ptr": "*fp16", "o_ptr": "*fp16",
                    "seq_q": "i32", "seq_k": "i32", "scale": "fp32"},
                   {"D": 64, "BM": 64, "BN": 32, "CAUSAL": causal})
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
