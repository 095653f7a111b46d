"""Add a bench/gpu_lease.py run to the calibration set: its ptxc medians as points of
measurements.json, and the very cubins timed (with their launch metadata) under <commit>/.

    python bench/calibration/add_run.py RESULTS.jsonl --commit C SET_DIR [SET_DIR ...]

RESULTS.jsonl is the run's results file; SET_DIR are the artifact sets it carried (the first set
holding a kernel's cubin for the timed target wins, as in gpu_lease.plan); C is the commit whose
ptxc built them. The GPU key comes from the rows (`gpu`, a ptxc/report/gpus.py key). Left out:
torch rows; items that did not finish; and the sm_90a rows whose code is the sm_90 code
(not a wgmma path: the same mma.sync kernel) where the run timed the sm_90 cubin at that shape
too (kept where only the sm_90a image ran the shape: an mma.sync point like the others). A
point already recorded (same commit, GPU, kernel, target and shape) is replaced.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def timed_rows(results: Path):
    for line in results.read_text().splitlines():
        item = json.loads(line)
        if item["kind"] != "bench" or item["status"] != "ok":
            continue
        for row in item["rows"]:
            if row["impl"] == "ptxc":
                yield row


def find_artifact(sets: list[Path], kernel: str, target: str) -> Path | None:
    for s in sets:
        if (s / kernel / f"{kernel}.{target}.cubin").is_file():
            return s / kernel
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("sets", nargs="+", type=Path)
    ap.add_argument("--commit", required=True)
    args = ap.parse_args()
    path = HERE / "measurements.json"
    data = json.loads(path.read_text())
    key = lambda p: (p["commit"], p["gpu"], p["kernel"], p["target"], json.dumps(p["shape"], sort_keys=True))
    points = {key(p): p for p in data["points"]}
    rows = list(timed_rows(args.results))
    portable = {(r["kernel"], json.dumps(r["dims"], sort_keys=True)) for r in rows if not r["target"].endswith("a")}
    added = 0
    for row in rows:
        art = find_artifact(args.sets, row["kernel"], row["target"])
        if art is None:
            print(f"add_run: no cubin of {row['kernel']} for {row['target']} in the sets", file=sys.stderr)
            return 1
        meta = json.loads((art / f"{row['kernel']}.json").read_text())
        if (row["target"].endswith("a") and (row["kernel"], json.dumps(row["dims"], sort_keys=True)) in portable
                and not str(meta["targets"][row["target"]]["config"].get("path", "")).startswith("wgmma")):
            continue    # the sm_90 mma.sync code assembled for sm_90a: its sm_90 row is the point
        dest = HERE / args.commit
        dest.mkdir(exist_ok=True)
        shutil.copyfile(art / f"{row['kernel']}.{row['target']}.cubin", dest / f"{row['kernel']}.{row['target']}.cubin")
        kept = dest / f"{row['kernel']}.json"     # one file per kernel: the targets of every set
        if kept.is_file():
            old = json.loads(kept.read_text())
            meta = {**meta, "targets": {**old["targets"], row["target"]: meta["targets"][row["target"]]}}
        kept.write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
        p = {"commit": args.commit, "gpu": row["gpu"], "kernel": row["kernel"], "target": row["target"],
             "shape": row["dims"], "median_ms": round(row["median_ms"], 6), "l2_flushed": row["l2_flushed"]}
        points[key(p)] = p
        added += 1
    data["points"] = list(points.values())
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"add_run: {added} points from {args.results} ({len(data['points'])} in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
