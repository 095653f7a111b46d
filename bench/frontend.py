"""Front-end benchmark: spec -> PTX time per kernel, cold build of specs/ (with ptxas), warm
rebuild, and `ptxc --help` start-up. Prints a markdown table for docs/performance.md.

    .venv/bin/python bench/frontend.py [--repeat 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    from ptxc.build import run_build
    from ptxc.compiler import lower
    from ptxc.spec import load_paths

    specs = load_paths([ROOT / "specs"])
    rows = []
    lower(specs[0], specs[0].targets[0])  # warm imports and template
    for s in specs:
        t = s.targets[0]
        secs = median_time(lambda: lower(s, t), args.repeat)
        ptx = lower(s, t)[0]
        rows.append((f"spec -> PTX: {s.name} [{t}]", secs, f"{len(ptx.splitlines())} PTX lines"))
    load = median_time(lambda: load_paths([ROOT / "specs"]), args.repeat)
    rows.append(("load + validate all specs", load, f"{len(specs)} kernels"))

    with tempfile.TemporaryDirectory() as tmp:
        cache, out = Path(tmp, "cache"), Path(tmp, "out")
        t0 = time.perf_counter()
        s1 = run_build([ROOT / "specs"], out, progress=False, cache_dir=cache)
        cold = time.perf_counter() - t0
        n = sum(len(k["targets"]) for k in s1["kernels"])
        rows.append(("cold build of specs/ (ptxas, -j CPUs)", cold, f"{n} PTX+cubin, {os.cpu_count()} CPUs"))
        warm = median_time(lambda: run_build([ROOT / "specs"], out, progress=False, cache_dir=cache), 5)
        s2 = run_build([ROOT / "specs"], out, progress=False, cache_dir=cache)
        rows.append(("warm rebuild of specs/ (in-process)", warm, f"{s2['files_changed']} files written"))
        env = {**os.environ, "PTXC_CACHE_DIR": str(cache)}
        ptxc = str(Path(sys.executable).with_name("ptxc"))
        warm_cli = median_time(lambda: subprocess.run([ptxc, "build", str(ROOT / "specs"), "--out", str(out)],
                                                      env=env, capture_output=True, check=True), 5)
        rows.append(("warm rebuild of specs/ (`ptxc build`, whole process)", warm_cli, ""))
    help_t = median_time(lambda: subprocess.run([sys.executable, "-m", "ptxc.cli", "--help"],
                                                capture_output=True, check=True), 10)
    rows.append(("`ptxc --help` start-up", help_t, "numpy, jinja2, cuda imported lazily"))
    bare = median_time(lambda: subprocess.run([sys.executable, "-c", "pass"], capture_output=True), 10)
    rows.append(("(python -c pass, for scale)", bare, ""))

    print("| measurement | median | note |\n|---|---:|---|")
    for name, secs, note in rows:
        print(f"| {name} | {secs * 1000:.1f} ms | {note} |")


if __name__ == "__main__":
    main()
