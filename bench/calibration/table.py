"""Print the whole-launch model against every recorded H100 median (the table in
bench/calibration/README.md and docs/performance.md):

    python bench/calibration/table.py          # needs nvdisasm (NVDISASM or the test extra)
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from ptxc.report.gpus import GPUS  # noqa: E402
from ptxc.report.launch_model import H100_MMA_SYNC, launch_list_seconds  # noqa: E402
from ptxc.report.sass import sass_profile  # noqa: E402


def main() -> int:
    points = json.loads((HERE / "measurements.json").read_text())["points"]
    profiles: dict[str, dict] = {}
    print("| commit | kernel | shape | measured ms | model ms | model / measured | binding term |")
    print("|---|---|---|---:|---:|---:|---|")
    logs = []
    for p in points:
        meta = json.loads((HERE / p["commit"] / f"{p['kernel']}.json").read_text())
        cubin = (HERE / p["commit"] / f"{p['kernel']}.sm_90.cubin").read_bytes()
        key = hashlib.sha256(cubin).hexdigest()
        profiles.setdefault(key, sass_profile(cubin))
        t = meta["targets"]["sm_90"]
        loops = {}
        for k in t["kernels"]:
            fn = profiles[key].get(k["entry"], {}).get("loops", {})
            loops[k["entry"]] = fn["loops"][fn["main"]] if fn.get("main") is not None else None
        got = launch_list_seconds(meta["family"], meta["spec"], t["config"], t["kernels"], loops,
                                  {"num_splits": 1, "num_new": 1, **p["shape"]}, GPUS["h100-sxm"],
                                  H100_MMA_SYNC)
        ms = got["seconds"] * 1e3
        logs.append(math.log(ms / p["median_ms"]))
        bound = max(got["launches"], key=lambda x: x["seconds"])["bound"]
        shape = ",".join(f"{k}={v}" for k, v in p["shape"].items())
        print(f"| {p['commit']} | {p['kernel']} | {shape} | {p['median_ms']:.4g} | {ms:.4g} | "
              f"{ms / p['median_ms']:.2f} | {bound} |")
    within = sum(abs(x) <= math.log(1.35) for x in logs)
    print(f"\n{within} of {len(logs)} within ±35 %; worst ratio "
          f"{math.exp(max(logs, key=abs)):.2f}; median {math.exp(sorted(logs)[len(logs) // 2]):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
