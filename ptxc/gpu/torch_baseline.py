"""Reference timings for `ptxc bench`: the same shapes and inputs through PyTorch's
scaled_dot_product_attention and, when installed, flash-attn — timed like ptxc's kernels
(CUDA events, same warm-up and repeat count, same L2 flush).

Layouts: ptxc tensors are [batch, seq, heads, d]; SDPA takes [batch, heads, seq, d], so it
gets transposed views (no copy, as a serving stack holding BSHD tensors would pass them).
Causal masking in ptxc is aligned bottom-right (query i sees keys <= i + seq_k - seq_q);
SDPA's is_causal is top-left, so for seq_q != seq_k the lower-right causal bias is used.
Every import is optional: a missing package is a note in the results, never an error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _time(torch, fn: Callable[[], Any], warmup: int, repeat: int, flush_bytes: int) -> list[float]:
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    scratch = torch.empty(flush_bytes, dtype=torch.uint8, device="cuda") if flush_bytes else None
    samples = []
    for i in range(warmup + repeat):
        if scratch is not None:
            scratch.fill_(i & 0xFF)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        if i >= warmup:
            samples.append(float(start.elapsed_time(stop)))
    return samples


def _bshd(torch, inputs: dict, meta: dict, dtype):
    """q, k, v as [batch, seq, heads, d] CUDA tensors (decode's q gets a length-1 seq axis)."""
    names = ("q", "k_cache", "v_cache") if meta["family"] == "decode" else ("q", "k", "v")
    q, k, v = (torch.from_numpy(inputs[n]).to("cuda").to(dtype) for n in names)
    if meta["family"] == "decode":
        q = q[:, None]
    return q, k, v


def compare_rows(meta: dict, dims: dict, inputs: dict, cost, warmup: int, repeat: int,
                 flush_bytes: int) -> tuple[list[tuple[str, list[float]]], list[str]]:
    """[(impl name, samples)] for every reference implementation that runs, and notes on the
    ones that do not."""
    if meta["family"] not in ("decode", "prefill"):
        return [], [f"no reference implementation for family {meta['family']}"]
    if "block_table" in meta["tensors"]:
        return [], ["paged KV cache: torch SDPA has no paged form to compare with"]
    try:
        import torch
    except ImportError:
        return [], ["torch not importable: no scaled_dot_product_attention comparison"]
    if not torch.cuda.is_available():
        return [], ["torch has no CUDA device: no comparison"]
    spec = meta["spec"]
    dtype = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[spec["dtype"]]
    causal = bool(spec.get("causal", False))
    scale = spec["softmax_scale"]
    q, k, v = _bshd(torch, inputs, meta, dtype)
    sq, sk = q.shape[1], k.shape[1]
    rows, notes = [], []

    import torch.nn.functional as F
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    kwargs: dict[str, Any] = {"scale": scale}
    if spec["num_heads"] != spec["num_kv_heads"]:
        if "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or ""):
            kwargs["enable_gqa"] = True
        else:   # older torch: expand K/V to every query head, outside the timed region
            g = spec["num_heads"] // spec["num_kv_heads"]
            kt, vt = (x.repeat_interleave(g, dim=1) for x in (kt, vt))
            notes.append("torch without enable_gqa: K/V expanded to all heads before timing")
    if causal and sq != sk:
        try:
            from torch.nn.attention.bias import causal_lower_right
            kwargs["attn_mask"] = causal_lower_right(sq, sk)
        except ImportError:
            notes.append("torch lacks causal_lower_right: no SDPA row for causal seq_q != seq_k")
            kwargs = {}
    elif causal:
        kwargs["is_causal"] = True
    if kwargs:
        try:
            rows.append(("torch-sdpa", _time(torch, lambda: F.scaled_dot_product_attention(qt, kt, vt, **kwargs),
                                             warmup, repeat, flush_bytes)))
        except RuntimeError as e:
            notes.append(f"torch sdpa failed: {str(e).splitlines()[0]}")

    if spec["dtype"] in ("f16", "bf16"):
        try:
            from flash_attn import flash_attn_func
        except ImportError:
            notes.append("flash-attn not installed")
        else:   # BSHD, GQA and bottom-right causal natively
            def fa():
                return flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)
            rows.append(("flash-attn", _time(torch, fa, warmup, repeat, flush_bytes)))
    return rows, notes


__all__ = ["compare_rows"]
