"""Markdown tables from a bench/gpu_suite.sh results folder, ready for docs/performance.md.

    python bench/gpu_summary.py gpu-results/<run>
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _pct(v) -> str:
    return "-" if v is None else f"{v:.0f}%"


def bench_table(out: Path) -> list[str]:
    lines = []
    for f in sorted((out / "bench").glob("*.json")):
        try:
            data = json.loads(f.read_text())
        except ValueError:
            continue
        if not lines:
            model = data["gpu_model"] or "not in ptxc/report/gpus.py"
            lines += [f"Device: {data['device']} (sm_{data['sm']}, model {model}); "
                      f"median of {data['repeat']} runs after {data['warmup']} warm-up, CUDA events.", "",
                      "| kernel | impl | shape | median | TFLOP/s | % peak | GB/s | % BW | L2 flushed |",
                      "|---|---|---|---:|---:|---:|---:|---:|---|"]
        for r in data["results"]:
            shape = ",".join(f"{k}={v}" for k, v in r["dims"].items())
            lines.append(f"| {r['kernel']} | {r['impl']} | {shape} | {r['median_ms']:.4g} ms | {r['tflops']:.3g} | "
                         f"{_pct(r['pct_peak_flops'])} | {r['gbs']:.4g} | {_pct(r['pct_peak_bandwidth'])} | "
                         f"{'yes' if r['l2_flushed'] else 'no'} |")
        lines += [f"note: {n}" for n in data.get("notes", [])]
    return lines or ["(no bench results)"]


def tune_table(out: Path) -> list[str]:
    lines = ["| family | head_dim | causal | dtype | best tile | best | heuristic default | candidates |",
             "|---|---:|---|---|---|---:|---:|---:|"]
    for f in sorted((out / "tuned").glob("*.json")):
        table = json.loads(f.read_text())
        for e in table["entries"]:
            tile = ", ".join(f"{k}={v}" for k, v in e["tile"].items())
            default = "-" if e.get("default_ms") is None else f"{e['default_ms']:.4g} ms"
            lines.append(f"| {e['family']} | {e['head_dim']} | {e['causal']} | {e['dtype']} | {tile} | "
                         f"{e['median_ms']:.4g} ms | {default} | {e['candidates']} |")
    return lines if len(lines) > 2 else ["(no tuned tables)"]


def main() -> None:
    out = Path(sys.argv[1])
    print("### Kernel timings\n")
    print("\n".join(bench_table(out)))
    print("\n### Tuned tiles\n")
    print("\n".join(tune_table(out)))


if __name__ == "__main__":
    main()
