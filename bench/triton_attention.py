"""Triton side of the front-end benchmark: compile a FlashAttention-2 forward kernel (the
algorithm and tile sizes of Triton's fused-attention tutorial, python/tutorials/06-fused-attention.py:
BLOCK_M 128, BLOCK_N 64, 8 warps, 3 stages, exp2 online softmax, causal mask on the diagonal
blocks) for sm_80 with an explicit GPUTarget, so no GPU is needed.

Measured per compile (median over runs, Triton's cache bypassed and cleared every run):
  to PTX    source -> TTIR -> TTGIR -> LLVM IR -> PTX (the stages before ptxas)
  to cubin  the whole triton.compile, ptxas included
Stage times come from Triton's compilation listener (knobs.compilation.listener); when this
Triton has none, only the total is reported.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")   # silence 3.9's default-change warning

HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES = 128, 128, 64, 8, 3
SIGNATURE = {"Q": "*fp16", "K": "*fp16", "V": "*fp16", "Out": "*fp16", "sm_scale": "fp32",
             "stride_h": "i32", "stride_m": "i32", "N_CTX": "i32"}
CONSTEXPRS = {"HEAD_DIM": HEAD_DIM, "BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "CAUSAL": True}


def available() -> str | None:
    """None if triton can compile here, else the reason it cannot."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except Exception as e:   # ImportError, or a broken install raising anything at import
        return f"triton not importable ({e.__class__.__name__}: {e})"
    return None


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def attn_fwd(Q, K, V, Out, sm_scale, stride_h, stride_m, N_CTX,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr):
        # One program per (BLOCK_M query rows, batch*head); Q/K/V/O are [batch*heads, N_CTX, d].
        start_m = tl.program_id(0)
        head = tl.program_id(1).to(tl.int64) * stride_h
        rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + head + rows[:, None] * stride_m + dims[None, :])
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        scale = sm_scale * 1.44269504   # scores in log2 units: exp2 instead of exp
        diag = start_m * BLOCK_M if CAUSAL else N_CTX
        end = (start_m + 1) * BLOCK_M if CAUSAL else N_CTX
        for start_n in range(0, end, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            kt = tl.load(K + head + (start_n + cols)[None, :] * stride_m + dims[:, None])
            s = tl.dot(q, kt)
            if start_n >= diag:   # only blocks crossing the diagonal need the mask
                s = s * scale + tl.where(rows[:, None] >= (start_n + cols[None, :]), 0, -1.0e6)
                m_new = tl.maximum(m_i, tl.max(s, 1))
                s -= m_new[:, None]
            else:
                m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
                s = s * scale - m_new[:, None]
            p = tl.math.exp2(s)
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + head + (start_n + cols)[:, None] * stride_m + dims[None, :])
            acc = tl.dot(p.to(tl.float16), v, acc * alpha[:, None])
            m_i = m_new
        tl.store(Out + head + rows[:, None] * stride_m + dims[None, :], (acc / l_i[:, None]).to(tl.float16))

    return attn_fwd


def compile_once(arch: int = 80) -> dict:
    """One uncached compile; returns {"total": s, "to_ptx": s or None, "ptx_lines": n}."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _kernel()
    sig = {**SIGNATURE, **{k: "constexpr" for k in CONSTEXPRS}}
    consts = CONSTEXPRS
    stage_times: dict = {}

    def listener(*, times, **_):
        stage_times["init"] = times.ir_initialization
        stage_times["stages"] = dict(times.lowering_stages)

    cache_dir = tempfile.mkdtemp(prefix="ptxc-bench-triton-cache-")
    old_dir = knobs.cache.dir
    try:
        knobs.cache.dir = cache_dir
        knobs.compilation.always_compile = True
        has_listener = hasattr(knobs.compilation, "listener")
        if has_listener:
            knobs.compilation.listener = listener
        t0 = time.perf_counter()
        compiled = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": NUM_WARPS, "num_stages": NUM_STAGES})
        total = time.perf_counter() - t0
    finally:
        if hasattr(knobs.compilation, "listener"):
            knobs.compilation.listener = None
        knobs.cache.dir = old_dir
        shutil.rmtree(cache_dir, ignore_errors=True)
    to_ptx = None
    if stage_times.get("stages"):   # microseconds: IR init + every stage before ptxas
        us = stage_times["init"] + sum(v for k, v in stage_times["stages"].items() if k != "cubin")
        to_ptx = us / 1e6
    return {"total": total, "to_ptx": to_ptx, "ptx_lines": len(compiled.asm["ptx"].splitlines()),
            "cubin_bytes": len(compiled.asm["cubin"]), "version": triton.__version__}


def measure(repeat: int, arch: int = 80) -> dict:
    """Median over `repeat` uncached compiles, after one untimed warm-up compile (which pays
    for loading LLVM and the backend; reported separately as `first`)."""
    first = compile_once(arch)
    runs = [compile_once(arch) for _ in range(repeat)]
    to_ptx = [r["to_ptx"] for r in runs if r["to_ptx"] is not None]
    return {"first": first["total"], "total": statistics.median(r["total"] for r in runs),
            "to_ptx": statistics.median(to_ptx) if to_ptx else None, "ptx_lines": runs[-1]["ptx_lines"],
            "version": runs[-1]["version"], "runs": repeat}


if __name__ == "__main__":
    # `--once`: one compile in this fresh process (the cold, whole-process figure); else a median.
    import json
    import sys
    why = available()
    if why:
        sys.exit(f"triton unavailable: {why}")
    print(json.dumps(compile_once() if "--once" in sys.argv else measure(5)))
