"""Problems the Triton peer tests run on every architecture they compile for: the argument
signatures, the inputs, the launch and the float64 reference -- one definition, whether the
PTX came out as mma.sync (sm_80) or wgmma (sm_90a)."""

import os

import numpy as np

from ptxc.emu import launch

SCRATCH = [np.zeros(0, np.uint8), np.zeros(0, np.uint8)]   # Triton's global/profile scratch

MATMUL_SIG = {"M": "i32", "N": "i32", "K": "i32", "stride_am": "i32", "stride_bk": "i32",
              "stride_cm": "i32"}
ATTENTION_SIG = {"q_ptr": "*fp16", "k_ptr": "*fp16", "v_ptr": "*fp16", "o_ptr": "*fp16",
                 "seq_q": "i32", "seq_k": "i32", "scale": "fp32"}


def run(compiled, grid, num_warps, args):
    ptx, name, shared = compiled
    assert ".section" in ptx or "TRITON_DISABLE_LINE_INFO" in os.environ
    return launch(ptx, name, grid, (32 * num_warps,), args + SCRATCH, dynamic_smem_bytes=shared)


def bf16(x):
    """float64 -> bf16 bits (round to nearest even) and the values they hold."""
    b = np.asarray(x, np.float32).view(np.uint32)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    return b, (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def matmul_signature(dtype: str) -> dict:
    return {"a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "c_ptr": "*fp32", **MATMUL_SIG}


def tf32(x):
    """float64 -> float32 bits and the tf32 values a tensor core reads from them (the low 13
    mantissa bits ignored)."""
    f = np.asarray(x, np.float32)
    return f, (f.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)


def matmul_inputs(dtype: str, M: int, N: int, K: int, seed: int):
    """(a, b) arrays of `dtype` (fp16, bf16, fp32 read as tf32) and their float64 values."""
    rng = np.random.default_rng(seed)
    a64, b64 = rng.standard_normal((M, K)), rng.standard_normal((K, N))
    if dtype == "fp16":
        a, b = a64.astype(np.float16), b64.astype(np.float16)
        return a, b, a.astype(np.float64), b.astype(np.float64)
    (a, av), (b, bv) = (bf16(a64), bf16(b64)) if dtype == "bf16" else (tf32(a64), tf32(b64))
    return a, b, av, bv


def check_matmul(compiled, dtype: str, K: int, seed: int, M: int = 70, N: int = 80,
                 bm: int = 64, bn: int = 64):
    """Run a (bm x bn)-tiled matmul kernel on (M, K) @ (K, N) and compare with float64."""
    a, b, av, bv = matmul_inputs(dtype, M, N, K, seed)
    out = np.zeros((M, N), np.float32)
    run(compiled, (-(-M // bm), -(-N // bn)), 4,
        [a, b, out] + [np.uint32(v) for v in (M, N, K, K, N, N)])
    np.testing.assert_allclose(out, av @ bv, rtol=1e-5, atol=1e-4)


def check_attention(compiled, causal: bool, seq_q: int, seq_k: int, D: int = 64,
                    scale: float = 0.125, bm: int = 64):
    """Run a FlashAttention forward kernel of bm-row query tiles and compare with float64
    (bottom-right causal alignment, as the kernel defines it)."""
    rng = np.random.default_rng(seq_q)
    q, k, v = (rng.standard_normal((n, D)).astype(np.float16) for n in (seq_q, seq_k, seq_k))
    out = np.zeros((seq_q, D), np.float16)
    run(compiled, (-(-seq_q // bm),), 4,
        [q, k, v, out, np.uint32(seq_q), np.uint32(seq_k), np.float32(scale)])
    s = q.astype(np.float64) @ k.astype(np.float64).T * scale
    if causal:
        s = np.where(np.arange(seq_k)[None] <= np.arange(seq_q)[:, None] + seq_k - seq_q, s,
                     -np.inf)
    p = np.exp(s - s.max(1, keepdims=True))
    ref = (p / p.sum(1, keepdims=True)) @ v.astype(np.float64)
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=2e-3, rtol=2e-3)
