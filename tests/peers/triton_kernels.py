"""Triton kernels for the peer suite (compiled to PTX without a GPU, run in the emulator)."""

import triton
import triton.language as tl


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x + y, mask=mask)


@triton.jit
def softmax_kernel(x_ptr, out_ptr, n_cols, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride + cols, mask=mask, other=-float("inf"))
    x = x - tl.max(x, axis=0)
    e = tl.exp(x)
    tl.store(out_ptr + row * stride + cols, e / tl.sum(e, axis=0), mask=mask)


@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_bk, stride_cm,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        kk = k * BK + rk
        a = tl.load(a_ptr + rm[:, None] * stride_am + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + kk[:, None] * stride_bk + rn[None, :],
                    mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :], c,
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, seq_q, seq_k, scale,
                     D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     CAUSAL: tl.constexpr):
    """One head: o = softmax(q k^T * scale) v, rows of q/k/v/o contiguous (stride D);
    causal masking is bottom-right aligned (query i sees keys <= i + seq_k - seq_q)."""
    start_m = tl.program_id(0) * BM
    rm = start_m + tl.arange(0, BM)
    rd = tl.arange(0, D)
    q = tl.load(q_ptr + rm[:, None] * D + rd[None, :], mask=rm[:, None] < seq_q, other=0.0)
    m_i = tl.full((BM,), -float("inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, D), tl.float32)
    hi = seq_k
    if CAUSAL:
        hi = tl.minimum(seq_k, start_m + BM + seq_k - seq_q)
    for start_n in range(0, hi, BN):
        rn = start_n + tl.arange(0, BN)
        k = tl.load(k_ptr + rn[None, :] * D + rd[:, None], mask=rn[None, :] < seq_k, other=0.0)
        s = tl.dot(q, k) * scale
        valid = rn[None, :] < seq_k
        if CAUSAL:
            valid = valid & (rn[None, :] <= rm[:, None] + seq_k - seq_q)
        s = tl.where(valid, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + rn[:, None] * D + rd[None, :], mask=rn[:, None] < seq_k, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o_ptr + rm[:, None] * D + rd[None, :], out.to(o_ptr.dtype.element_ty),
             mask=rm[:, None] < seq_q)


@triton.jit
def matmul_tma_kernel(a_desc, b_desc, c_ptr, M, N, K, stride_cm,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """C = A @ B with A and B tiles loaded by TMA (host-side tensor descriptors)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        a = a_desc.load([pid_m * BM, k * BK])
        b = b_desc.load([k * BK, pid_n * BN])
        acc = tl.dot(a, b, acc)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :], acc,
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def scale_tma_store_kernel(a_desc, c_desc, BM: tl.constexpr, BN: tl.constexpr):
    """c = 2 a + 1, tile by tile: A's tile loaded by TMA, C's tile written through shared memory
    by a TMA store (st.shared, fence.proxy.async, cp.async.bulk.tensor to global, bulk group)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    a = a_desc.load([pid_m * BM, pid_n * BN])
    c_desc.store([pid_m * BM, pid_n * BN], a * 2 + 1)
