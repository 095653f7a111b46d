"""Markdown for docs/performance.md from a bench/gpu_lease.py results folder:

    python bench/gpu_lease_summary.py DIR

The checks (passed, failed, could not run, with the reason), then the timings table.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path


def main() -> int:
    lines = [json.loads(t) for t in (Path(sys.argv[1]) / "results.jsonl").read_text().splitlines()]
    checks = [x for x in lines if x["kind"] == "check"]
    verdict = Counter((x["target"], "pass" if x["status"] == "ok" and x["pass"] else
                       "FAIL" if x["status"] == "ok" else x["status"]) for x in checks)
    print("Checks: " + ", ".join(f"{t} {v}: {n}" for (t, v), n in sorted(verdict.items())) + "\n")
    for x in checks:
        if x["status"] != "ok" or not x["pass"]:
            print(f"- {x['kernel']} [{x['target']}]: {x.get('error') or 'over tolerance'}")
    print("\n| kernel | impl | target | shape | median | p10–p90 | TFLOP/s | GB/s | % HBM |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    for x in lines:
        if x["kind"] != "bench" or x["status"] != "ok":
            continue
        for r in x["rows"]:
            shape = ",".join(f"{k}={v}" for k, v in r["dims"].items())
            bw = "-" if r["pct_peak_bandwidth"] is None else f"{r['pct_peak_bandwidth']:.0f} %"
            print(f"| {r['kernel']} | {r['impl']} | {r['target'] or '-'} | {shape} | {r['median_ms']:.4g} ms | "
                  f"{r['p10_ms']:.4g}–{r['p90_ms']:.4g} | {r['tflops']:.3g} | {r['gbs']:.4g} | {bw} |")
    failed = [x for x in lines if x["kind"] == "bench" and x["status"] != "ok"]
    for x in failed:
        print(f"note: {x['kernel']} [{x['target']}] not timed: {x['error'][:200]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
