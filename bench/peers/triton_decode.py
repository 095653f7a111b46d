"""Triton GQA decode over a paged KV cache, the shape of SGLang's / vLLM's grouped decode kernel
(`_fwd_grouped_kernel_stage1`): one program per (sequence, KV head, KV split); the group's query
heads padded to BLOCK_H = 16 rows so q·Kᵀ and P·V are `tl.dot`s on the tensor cores; BLOCK_N
cache rows per iteration gathered through the block table (page ids loaded per tile); online
softmax in exp2; f32 partial output and log-sum-exp per split (the merge is a second kernel,
not analysed). Cache layout as FlashInfer's NHD paged cache: [pages, PAGE, kv_heads, HEAD_DIM].
Defaults (SGLang's for sm_80): BLOCK_H 16, BLOCK_N 32, 4 warps, 2 stages.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gqa_paged_decode(Q, K_cache, V_cache, Out, Lse, Block_table, Seq_lens, sm_scale, stride_bt,
                     GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_N: tl.constexpr, PAGE: tl.constexpr, NUM_KV_HEADS: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(Seq_lens + b)
    chunk = tl.cdiv(seq_len, tl.num_programs(2))
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + offs_h
    head_ok = offs_h < GROUP
    q = tl.load(Q + (b * NUM_KV_HEADS * GROUP + heads)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=head_ok[:, None], other=0.0)
    scale = sm_scale * 1.44269504
    m_i = tl.full([BLOCK_H], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        valid = offs_n < end
        page = tl.load(Block_table + b * stride_bt + offs_n // PAGE, mask=valid, other=0)
        row = (page.to(tl.int64) * PAGE + offs_n % PAGE) * NUM_KV_HEADS + kvh
        k = tl.load(K_cache + row[None, :] * HEAD_DIM + offs_d[:, None], mask=valid[None, :], other=0.0)
        s = tl.dot(q, k) * scale
        s = tl.where(valid[None, :], s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V_cache + row[:, None] * HEAD_DIM + offs_d[None, :], mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out_row = (b * NUM_KV_HEADS * GROUP + heads) * tl.num_programs(2) + split
    tl.store(Out + out_row[:, None] * HEAD_DIM + offs_d[None, :], acc / l_i[:, None], mask=head_ok[:, None])
    tl.store(Lse + out_row, m_i + tl.math.log2(l_i), mask=head_ok)


SIGNATURE = {"Q": "*fp16", "K_cache": "*fp16", "V_cache": "*fp16", "Out": "*fp32", "Lse": "*fp32",
             "Block_table": "*i32", "Seq_lens": "*i32", "sm_scale": "fp32", "stride_bt": "i32"}
CONSTEXPRS = {"GROUP": 4, "BLOCK_H": 16, "HEAD_DIM": 128, "BLOCK_N": 32, "PAGE": 16, "NUM_KV_HEADS": 8}
NUM_WARPS, NUM_STAGES = 4, 2
