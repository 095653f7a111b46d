"""`ptxc bench`: time artifacts on a GPU and put the numbers next to the device's peaks.

    ptxc bench specs/llama3_8b.toml --shape batch=32,max_seq_len=8192 [--json]

Per artifact: the launch list at the shape (cost from ptxc.report.costs), CUDA-event timing of
`warmup` untimed then `repeat` timed runs, median and spread; decode runs flush L2 before each
run (its KV cache must come from DRAM, as in serving). Prefill is reported in TFLOP/s
(% of the tensor or f32 peak, whichever its math uses), decode in GB/s (% of DRAM bandwidth),
against the row of ptxc/report/gpus.py that matches the device's name. With torch importable, the
same shapes through torch's scaled_dot_product_attention (and flash-attn if installed) are
timed the same way (bench_torch.py).

The pure parts (statistics, throughput and percent-of-peak, flush sizing, input shapes) are
here and tested without a GPU; everything that touches a device is behind `require_device()`.
"""

from __future__ import annotations

import math
import statistics
import tempfile
from pathlib import Path
from typing import Any

from ..report.costs import Cost, launch_cost, resolve_dims
from ..report.gpus import GpuModel, match_device
from ..runtime import pick_target

WARMUP, REPEAT = 10, 50
MIN_FLUSH_BYTES = 64 * 1024 * 1024   # when the device does not report its L2 size


def timing_stats(samples_ms: list[float]) -> dict[str, float]:
    """Median (the reported figure: robust to a stray slow run), spread and extremes."""
    if not samples_ms:
        raise ValueError("no timing samples")
    xs = sorted(samples_ms)

    def pct(p: float) -> float:   # linear interpolation between closest ranks
        k = (len(xs) - 1) * p
        lo, hi = math.floor(k), math.ceil(k)
        return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)

    return {"n": len(xs), "median_ms": statistics.median(xs), "mean_ms": statistics.fmean(xs),
            "min_ms": xs[0], "max_ms": xs[-1], "p10_ms": pct(0.10), "p90_ms": pct(0.90),
            "stdev_ms": statistics.stdev(xs) if len(xs) > 1 else 0.0}


def throughput(cost: Cost, family: str, median_ms: float, gpu: GpuModel | None) -> dict[str, Any]:
    """Achieved TFLOP/s and GB/s, and each as % of the GPU model's peak (None when the device
    is not in the table). `metric` names the figure that matters for the family: compute for
    prefill, bandwidth for the memory-bound ones (decode, kv_append)."""
    secs = median_ms / 1e3
    tflops = cost.flops / secs / 1e12
    gbs = cost.bytes / secs / 1e9
    out = {"tflops": tflops, "gbs": gbs, "intensity": cost.intensity,
           "metric": "TFLOP/s" if family == "prefill" else "GB/s",
           "pct_peak_flops": None, "pct_peak_bandwidth": None, "peak_unit": cost.unit}
    if gpu is not None:
        out["pct_peak_flops"] = 100.0 * tflops * 1e12 / gpu.peak_flops(cost.unit)
        out["pct_peak_bandwidth"] = 100.0 * gbs * 1e9 / gpu.bandwidth
    return out


def l2_flush_bytes(l2_bytes: int | None) -> int:
    """A scratch size that evicts all of L2: twice its size (L2 is not strictly LRU, and on
    parts with two L2 partitions a line can live in either), at least MIN_FLUSH_BYTES,
    rounded up to 1 MiB."""
    want = max(2 * (l2_bytes or 0), MIN_FLUSH_BYTES)
    return -(-want // (1 << 20)) * (1 << 20)


def should_flush(family: str, flag: bool | None) -> bool:
    """Flush L2 between runs for the memory-bound families unless told otherwise: a decode
    step reads a KV cache far larger than L2 that the previous step did not leave there."""
    return flag if flag is not None else family != "prefill"


RANDOM_BLOCK = 1 << 22   # values drawn per tensor; larger ones repeat them (input generation
                         # took minutes for a 3 GB cache, longer than the timing itself)


def bench_inputs(meta: dict, dims: dict[str, int], seed: int = 0) -> dict:
    """Host inputs at `dims`: normal random values (bf16 kept as f32, rounded on upload);
    every sequence full length (so the cost model's L holds), each owning its own pages
    (block_table row b = pages b*P .. b*P+P-1), new rows appended at the end of the cache;
    per-sequence pointer arrays are placeholders the timer fills with device addresses."""
    import numpy as np

    from ..pipeline import exprs
    from ..report.costs import kv_length, page_size
    rng = np.random.default_rng(seed)
    capacity = kv_length(meta, dims) if "max_seq_len" in dims or "max_pages_per_seq" in dims else 0
    out = {}
    for name, info in meta["tensors"].items():
        if info["role"] not in ("input", "inout"):
            continue
        shape = tuple(exprs.evaluate(s, dims) if isinstance(s, str) else s for s in info["shape"])
        if info["dtype"] == "u64":
            out[name] = np.zeros(shape, dtype=np.uint64)
        elif name == "block_table":
            out[name] = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
        elif name == "cu_seqlens_q":   # varlen: total_q queries spread evenly over the batch
            b = np.arange(shape[0], dtype=np.int64)
            out[name] = (b * dims["total_q"] // max(1, shape[0] - 1)).astype(np.int32)
        elif name == "slot_mapping":   # kv_append by slot: distinct slots spread over the cache
            total = dims["num_pages"] * page_size(meta)
            out[name] = (np.arange(shape[0], dtype=np.int64) * max(1, total // max(1, shape[0]))) % total
        elif name == "positions" and info["dtype"] == "i64":   # by slot: RoPE positions
            out[name] = np.arange(shape[0], dtype=np.int64) % max(1, dims.get("max_position", 1))
        elif name == "positions":
            # the new rows are the last ones; a decode with append_kv appends exactly one
            out[name] = np.full(shape, max(0, capacity - dims.get("num_new", 1)), dtype=np.int32)
        elif info["dtype"] == "u8":    # custom / tree mask bits: all set (the cost model's dense bits)
            out[name] = np.full(shape, 0xFF, dtype=np.uint8)
        elif name.endswith("_indptr"):  # mask segments: the buffer split evenly over the batch
            bytes_dim = next(exprs.evaluate(t["shape"][0], dims) for t in meta["tensors"].values()
                             if t["dtype"] == "u8")
            per = bytes_dim // max(1, shape[0] - 1)
            out[name] = (np.arange(shape[0], dtype=np.int64) * per).astype(np.int32)
        elif name == "indices":        # sparse MLA: N distinct slots per token over the whole cache
            total = dims["num_pages"] * page_size(meta)
            out[name] = np.stack([rng.choice(total, shape[1], replace=total < shape[1])
                                  for _ in range(shape[0])]).astype(np.int32)
        elif name == "topk_length":    # every token uses all N of its slots (the cost model's N)
            out[name] = np.full(shape, meta["spec"]["sparse_topk"], dtype=np.int32)
        elif info["dtype"] == "i32":   # seq_lens
            out[name] = np.full(shape, capacity, dtype=np.int32)
        elif info["dtype"] in ("e4m3", "e5m2"):   # FP8 bytes: random finite codes
            out[name] = rng.integers(0, 0x7B, shape, dtype=np.uint8) | rng.choice(
                np.array([0, 0x80], np.uint8), shape)
        elif name.endswith("_scale"):             # per-head FP8 scales
            out[name] = np.full(shape, 0.05, np.float32)
        else:   # a large tensor repeats one random block: timings do not depend on the values
            size = int(np.prod(shape))
            x = rng.standard_normal(min(size, RANDOM_BLOCK), dtype=np.float32)
            x = np.resize(x, size).reshape(shape) if size > RANDOM_BLOCK else x.reshape(shape)
            out[name] = x.astype(np.float16) if info["dtype"] == "f16" else x
    for name in meta.get("scalars") or {}:        # runtime scalars (FP8 k_scale / v_scale)
        out[name] = np.float32(0.05)
    return out


def result_row(impl: str, meta: dict, target: str | None, cost: Cost, samples: list[float],
               gpu: GpuModel | None, flushed: bool) -> dict[str, Any]:
    stats = timing_stats(samples)
    return {"impl": impl, "kernel": meta["name"], "family": meta["family"], "target": target,
            "dims": dict(cost.dims), "gpu": gpu.key if gpu else None, "flops": cost.flops,
            "bytes": cost.bytes, "l2_flushed": flushed, **stats,
            **throughput(cost, meta["family"], stats["median_ms"], gpu)}


def require_device():
    """The CUDA device, or a ToolchainError (exit code 2) with a one-line reason."""
    from ..errors import ToolchainError
    from ..runtime.cuda import CudaDevice
    try:
        return CudaDevice.open()
    except ToolchainError as e:
        raise ToolchainError(f"this command needs a CUDA GPU: {e}") from None


def run_bench(paths, *, shapes: dict[str, int], target: str | None = None, warmup: int = WARMUP,
              repeat: int = REPEAT, flush: bool | None = None, compare: bool = True) -> dict[str, Any]:
    from .timing import LaunchListTimer, l2_cache_bytes, sm_count
    from ..runtime.launch_test import artifacts_for
    from ..runtime import prepare_buffers, split_scalars  # uploads bf16 as rounded f32 bits
    device = require_device()
    gpu = match_device(device.name)
    l2, sms = l2_cache_bytes(device), sm_count(device)
    rows, notes = [], []
    with tempfile.TemporaryDirectory(prefix="ptxc-bench-") as tmp:
        for art in artifacts_for(paths, Path(tmp), verify=True):
            meta = art.meta
            picked = target or (pick_target(meta["targets"], device.sm) or (None,))[0]
            dims = resolve_dims(meta, shapes, num_sms=sms, target=picked)   # auto splits: its occupancy
            inputs = bench_inputs(meta, dims)
            flushed = should_flush(meta["family"], flush)
            fbytes = l2_flush_bytes(l2) if flushed else 0
            buffers = prepare_buffers(meta, inputs, dims)
            launch_dims = {**dims, **split_scalars(meta, inputs, {})[1]}   # + runtime scalars
            with LaunchListTimer(device, art, target, buffers, launch_dims, fbytes) as timer:
                samples = timer.time(warmup, repeat)
                tname = timer.target
            cost = launch_cost(meta, tname, dims)
            rows.append(result_row("ptxc", meta, tname, cost, samples, gpu, flushed))
            if compare:
                from .torch_baseline import compare_rows
                more, why = compare_rows(meta, dims, inputs, cost, warmup, repeat, fbytes)
                rows += [result_row(impl, meta, None, cost, s, gpu, flushed) for impl, s in more]
                notes += [f"{meta['name']}: {w}" for w in why]
    return {"device": device.name, "sm": device.sm, "gpu_model": gpu.key if gpu else None,
            "l2_bytes": l2, "sm_count": sms, "warmup": warmup, "repeat": repeat, "results": rows,
            "notes": notes + ([] if gpu else [f"{device.name} is not in ptxc/report/gpus.py: no % of peak"])}


__all__ = [
    "REPEAT",
    "WARMUP",
    "bench_inputs",
    "l2_flush_bytes",
    "require_device",
    "result_row",
    "run_bench",
    "should_flush",
    "throughput",
    "timing_stats",
]
