"""How a persistent grid deals its tiles, in `ptxc report`'s launch model (no GPU): the default
grid (the hardware's first-free-slot dispatch) against the persistent kernel's snake
(prefill_tile.PersistentTiles, launch_model.persistent_cta) and, for comparison, CTA c taking
tiles c, c + P, ... (striding). Each tile costs what the model charges it (its iterations and
`cta_fixed_s`), whichever CTA runs it, so the figures compare the orders' balance only; the
overlap persistence is for is not modelled.

    python bench/persistent_order.py [--shape batch=4,seq_q=4096,seq_k=4096 ...]

Builds llama3_8b's prefill heads (bf16 d128, 32 / 8, causal) for sm_90a with and without
tile.persistent into a temporary directory and prints the H100 estimate of each."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ptxc.pipeline.build import run_build  # noqa: E402
from ptxc.report import launch_model  # noqa: E402
from ptxc.report.analysis import build_report  # noqa: E402

SPEC = """
[[kernel]]
name = "{name}"
family = "prefill"
dtype = "bf16"
head_dim = 128
num_heads = 32
num_kv_heads = 8
causal = true
targets = ["sm_90a"]
{tile}
"""
SHAPES = ("batch=4,seq_q=4096,seq_k=4096", "batch=1,seq_q=16384,seq_k=16384",
          "batch=4,seq_q=1000,seq_k=1000")
ORDERS = {"snake": launch_model.persistent_cta,
          "stride": lambda t, ctas: t % ctas}


def estimate(art: Path, shape: str) -> float:
    dims = {k: int(v) for k, v in (kv.split("=") for kv in shape.split(","))}
    report = build_report([art], dims, gpus=["h100-sxm"])
    [target] = report["kernels"][0]["targets"]
    return target["estimate"][0]["seconds"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", help="dims, e.g. batch=4,seq_q=4096,seq_k=4096")
    args = ap.parse_args(argv)
    shapes = args.shape or list(SHAPES)
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "s.toml"
        spec.write_text(SPEC.format(name="grid", tile="") +
                        SPEC.format(name="pers", tile="[kernel.tile]\npersistent = true"))
        run_build([spec], Path(tmp) / "out", verify=True, progress=False)
        print("| shape | default grid | persistent, snake | persistent, striding |")
        print("|---|---:|---:|---:|")
        for shape in shapes:
            row = [estimate(Path(tmp) / "out" / "grid", shape)]
            for deal in ORDERS.values():
                launch_model.persistent_cta, saved = deal, launch_model.persistent_cta
                try:
                    row.append(estimate(Path(tmp) / "out" / "pers", shape))
                finally:
                    launch_model.persistent_cta = saved
            print(f"| {shape} | " + " | ".join(f"{s * 1e3:.3f} ms" for s in row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
