"""What an FP8 latent cache can gain over bf16 in the dense MLA decode, from the roofline alone
(no GPU, no kernel timing): each step's FLOPs and DRAM bytes are `ptxc report`'s cost model
(ptxc/report/costs.py mla_cost) for DeepSeek-style rows (576 = 512 latent + 64 RoPE) at 16, 64
and 128 query heads, over bf16, e4m3 and e4m3_ds (656-byte rows) caches. A step can take no
less than max(bytes / bandwidth, FLOPs / tensor peak); with the FP8 values converted to 16-bit
products (what ptxc builds: the tensor cores see f16 / bf16) the tensor term is the bf16
kernel's, so the FP8 cache's gain is capped by it; with e4m3 products (Q quantised to e4m3:
Hopper's wgmma e4m3 runs at twice the 16-bit rate) it would not be. The ratios are ceilings,
not forecasts: a kernel reaches neither peak.

    python bench/mla_roofline.py [--shape batch=64,total_q=64,max_pages_per_seq=64,num_pages=4096]

Builds the nine specs for sm_90a into a temporary directory (PTX only, no ptxas) and prints one
table row per GPU and head count."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ptxc.pipeline.build import run_build  # noqa: E402
from ptxc.report.analysis import build_report  # noqa: E402
from ptxc.report.gpus import get_gpu  # noqa: E402

SPEC = """
[[kernel]]
name = "h{heads}_{kv}"
family = "mla"
dtype = "bf16"
num_heads = {heads}
kv_lora_rank = 512
qk_rope_head_dim = 64
softmax_scale = 0.1352
kv_layout = "paged"
page_size = 64
num_splits = "auto"
{kv_dtype}targets = ["sm_90a"]
"""
HEADS = (16, 64, 128)
CACHES = ("bf16", "e4m3", "e4m3_ds")
SHAPE = "batch=64,total_q=64,max_pages_per_seq=64,num_pages=4096"   # batch 64 x 4096 keys
GPUS = ("h100-sxm", "h200")


def cost(art: Path, dims: dict) -> tuple[float, float]:
    """(FLOPs, DRAM bytes) of one launch list at `dims`."""
    report = build_report([art], dims, sass=False)
    [target] = report["kernels"][0]["targets"]
    return target["cost"]["flops"], target["cost"]["bytes"]


def bound(flops: float, nbytes: float, gpu, product_rate: float = 1.0) -> float:
    return max(nbytes / gpu.bandwidth, flops / (gpu.peak_flops("tensor") * product_rate))


def ceilings(dims: dict) -> list[dict]:
    """One row per GPU and head count: the bf16 step's bound and what bounds it, its FLOP per
    byte beside e4m3_ds's and the ridge, and the ceilings bf16 time / FP8 time for e4m3 and
    e4m3_ds with 16-bit products ("wide") and with e4m3 products ("narrow")."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "mla.toml"
        spec.write_text("".join(
            SPEC.format(heads=h, kv=kv, kv_dtype="" if kv == "bf16" else f'kv_dtype = "{kv}"\n')
            for h in HEADS for kv in CACHES))
        run_build([spec], Path(tmp) / "out", verify=False, progress=False)
        costs = {(h, kv): cost(Path(tmp) / "out" / f"h{h}_{kv}", dims) for h in HEADS for kv in CACHES}
    rows = []
    for key in GPUS:
        gpu = get_gpu(key)
        for h in HEADS:
            f16, b16 = costs[(h, "bf16")]
            base = bound(f16, b16, gpu)
            rows.append(dict(
                gpu=gpu.name, heads=h, intensity=(f16 / b16, costs[(h, "e4m3_ds")][0] / costs[(h, "e4m3_ds")][1]),
                ridge=gpu.peak_flops("tensor") / gpu.bandwidth, bound_s=base,
                bound_by="bandwidth" if b16 / gpu.bandwidth >= f16 / gpu.peak_flops("tensor") else "tensor",
                wide={kv: base / bound(*costs[(h, kv)], gpu) for kv in CACHES[1:]},
                narrow={kv: base / bound(*costs[(h, kv)], gpu, 2.0) for kv in CACHES[1:]}))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default=SHAPE, help=f"dims (default {SHAPE})")
    args = ap.parse_args(argv)
    dims = {k: int(v) for k, v in (kv.split("=") for kv in args.shape.split(","))}
    print(f"shape {args.shape}; ceilings of bf16 time / FP8 time (1.00x: no gain possible)")
    print("| GPU | heads | FLOP / byte (bf16, e4m3_ds) | ridge | bf16 bound | "
          "e4m3 / e4m3_ds, 16-bit products | e4m3 / e4m3_ds, e4m3 products |")
    print("|---|---:|---|---:|---|---|---|")
    for r in ceilings(dims):
        print(f"| {r['gpu']} | {r['heads']} | {r['intensity'][0]:.0f}, {r['intensity'][1]:.0f} | "
              f"{r['ridge']:.0f} | {r['bound_s'] * 1e3:.3f} ms ({r['bound_by']}) | "
              + " / ".join(f"{x:.2f}x" for x in r["wide"].values()) + " | "
              + " / ".join(f"{x:.2f}x" for x in r["narrow"].values()) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
