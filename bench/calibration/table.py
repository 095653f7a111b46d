"""Print the whole-launch model against every recorded median (the tables in
bench/calibration/README.md and docs/performance.md), one table per GPU, path (mma.sync or
wgmma: each has its own constants) and sample:

    python bench/calibration/table.py          # needs nvdisasm (NVDISASM or the test extra)
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

from predict import predictions  # noqa: E402


def main() -> int:
    rows = predictions()
    for gpu, path, fitted in dict.fromkeys((p["gpu"], p["path"], p["in_sample"]) for p in rows):
        print(f"\n{gpu}, {path}, {'in-sample (fitted)' if fitted else 'out-of-sample'}:\n")
        print("| commit | kernel | target | shape | measured ms | model ms | model / measured | binding term |")
        print("|---|---|---|---|---:|---:|---:|---|")
        logs = []
        for p in (p for p in rows if (p["gpu"], p["path"], p["in_sample"]) == (gpu, path, fitted)):
            shape = ",".join(f"{k}={v}" for k, v in p["shape"].items())
            if p["predicted_ms"] is None:
                print(f"| {p['commit']} | {p['kernel']} | {p['target']} | {shape} | {p['median_ms']:.4g} | - | - | "
                      f"{p['bound']} |")
                continue
            ms = p["predicted_ms"]
            logs.append(math.log(ms / p["median_ms"]))
            print(f"| {p['commit']} | {p['kernel']} | {p['target']} | {shape} | {p['median_ms']:.4g} | {ms:.4g} | "
                  f"{ms / p['median_ms']:.2f} | {p['bound']} |")
        within = sum(abs(x) <= math.log(1.35) for x in logs)
        print(f"\n{within} of {len(logs)} within ±35 %; ratios {math.exp(min(logs)):.2f} to "
              f"{math.exp(max(logs)):.2f}; median {math.exp(sorted(logs)[len(logs) // 2]):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
