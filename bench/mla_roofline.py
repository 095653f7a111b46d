"""What an FP8 latent cache can gain over bf16 in the dense MLA decode, from the roofline alone
(no GPU, no kernel timing): each step's FLOPs and DRAM bytes are `ptxc report`'s cost model
(ptxc/report/costs.py mla_cost) for DeepSeek-style rows (576 = 512 latent + 64 RoPE) at 16, 64
and 128 query heads, over bf16, e4m3 and e4m3_ds (656-byte rows) caches. A step can take no
less than max(bytes / bandwidth, FLOPs / tensor peak); with the FP8 values converted to 16-bit
products (ptxc's default: the tensor cores see f16 / bf16) the tensor term is the bf16
kernel's, so the FP8 cache's gain is capped by it. With e4m3 products (Q quantised to e4m3:
Hopper's wgmma e4m3 runs at twice the 16-bit rate) it is not: "S on e4m3" is what ptxc builds
with qk_products = "e4m3" and tile.fp8_scores (Q·Kᵀ on e4m3, P·V 16-bit; e4m3 caches, 64 head
rows: not at 16 heads), "all e4m3" both products. The ratios are ceilings, not forecasts: a
kernel reaches neither peak.

    python bench/mla_roofline.py [--shape batch=64,total_q=64,max_pages_per_seq=64,num_pages=4096]

Builds the specs for sm_90a into a temporary directory (PTX only, no ptxas) and prints one
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
{tile}"""
HEADS = (16, 64, 128)
CACHES = ("bf16", "e4m3", "e4m3_ds")
NARROW_S = "e4m3_qk"   # e4m3 rows with qk_products = "e4m3" (64 head rows: 64 and 128 heads)
NARROW_HEADS = (64, 128)
SHAPE = "batch=64,total_q=64,max_pages_per_seq=64,num_pages=4096"   # batch 64 x 4096 keys
GPUS = ("h100-sxm", "h200")


def cost(art: Path, dims: dict) -> tuple[float, float, float]:
    """(FLOPs, DRAM bytes, FLOPs on FP8 products) of one launch list at `dims`."""
    report = build_report([art], dims, sass=False)
    [target] = report["kernels"][0]["targets"]
    c = target["cost"]
    return c["flops"], c["bytes"], c.get("fp8_flops", 0)


def bound(flops: float, nbytes: float, fp8: float, gpu, product_rate: float = 1.0) -> float:
    """The roofline's time: FP8 products (`fp8` of the FLOPs) at twice the 16-bit rate, every
    product at `product_rate` times it."""
    return max(nbytes / gpu.bandwidth, (flops - fp8 / 2) / (gpu.peak_flops("tensor") * product_rate))


def ceilings(dims: dict) -> list[dict]:
    """One row per GPU and head count: the bf16 step's bound and what bounds it, its FLOP per
    byte beside e4m3_ds's and the ridge, and the ceilings bf16 time / FP8 time for e4m3 and
    e4m3_ds with 16-bit products ("wide"), e4m3 rows with S on e4m3 as built ("s_narrow", None
    at 16 heads), and with every product on e4m3 ("narrow")."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "mla.toml"
        kinds = {**{kv: "" if kv == "bf16" else f'kv_dtype = "{kv}"\n' for kv in CACHES},
                 NARROW_S: 'kv_dtype = "e4m3"\nqk_products = "e4m3"\n'}
        built = [(h, kv) for h in HEADS for kv in kinds if kv != NARROW_S or h in NARROW_HEADS]
        spec.write_text("".join(SPEC.format(heads=h, kv=kv, kv_dtype=kinds[kv],
                                            tile="[kernel.tile]\nfp8_scores = true\n" if kv == NARROW_S else "")
                                for h, kv in built))
        run_build([spec], Path(tmp) / "out", verify=False, progress=False)
        costs = {(h, kv): cost(Path(tmp) / "out" / f"h{h}_{kv}", dims) for h, kv in built}
    rows = []
    for key in GPUS:
        gpu = get_gpu(key)
        for h in HEADS:
            f16, b16, _ = costs[(h, "bf16")]
            base = bound(f16, b16, 0, gpu)
            s_narrow = costs.get((h, NARROW_S))
            rows.append(dict(
                gpu=gpu.name, heads=h, intensity=(f16 / b16, costs[(h, "e4m3_ds")][0] / costs[(h, "e4m3_ds")][1]),
                ridge=gpu.peak_flops("tensor") / gpu.bandwidth, bound_s=base,
                bound_by="bandwidth" if b16 / gpu.bandwidth >= f16 / gpu.peak_flops("tensor") else "tensor",
                wide={kv: base / bound(*costs[(h, kv)], gpu) for kv in CACHES[1:]},
                s_narrow=base / bound(*s_narrow, gpu) if s_narrow else None,
                narrow={kv: base / bound(*costs[(h, kv)], gpu, 2.0) for kv in CACHES[1:]}))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default=SHAPE, help=f"dims (default {SHAPE})")
    args = ap.parse_args(argv)
    dims = {k: int(v) for k, v in (kv.split("=") for kv in args.shape.split(","))}
    print(f"shape {args.shape}; ceilings of bf16 time / FP8 time (1.00x: no gain possible)")
    print("| GPU | heads | FLOP / byte (bf16, e4m3_ds) | ridge | bf16 bound | "
          "e4m3 / e4m3_ds, 16-bit products | e4m3, S on e4m3 (qk_products) | "
          "e4m3 / e4m3_ds, all e4m3 products |")
    print("|---|---:|---|---:|---|---|---|---|")
    for r in ceilings(dims):
        s_narrow = "-" if r["s_narrow"] is None else f"{r['s_narrow']:.2f}x"
        print(f"| {r['gpu']} | {r['heads']} | {r['intensity'][0]:.0f}, {r['intensity'][1]:.0f} | "
              f"{r['ridge']:.0f} | {r['bound_s'] * 1e3:.3f} ms ({r['bound_by']}) | "
              + " / ".join(f"{x:.2f}x" for x in r["wide"].values()) + f" | {s_narrow} | "
              + " / ".join(f"{x:.2f}x" for x in r["narrow"].values()) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
