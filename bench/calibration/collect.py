"""Rebuild the calibration set: the cubins (of the target each point ran) and launch metadata of
every kernel in measurements.json, built at the commit it was measured at, with that commit's
own ptxc.

    python bench/calibration/collect.py          # from the repository root; needs git and ptxas

Each commit is checked out in a temporary git worktree and built with `python -m ptxc.cli build
specs/ --target <the commit's points' targets>` (PYTHONPATH = the worktree, this venv's packages); the measured kernels'
`<kernel>.json` and `<kernel>.<target>.cubin` are copied to bench/calibration/<commit>/. The H100
runs assembled on the device with CUDA 13.0's ptxas; this machine's wheel is 13.5, so a cubin
here can differ from the one timed in scheduling details (the test reads the SASS of these).
The H200 run (53a4762) timed cubins assembled by this wheel's ptxas and carried to the device:
those are the very cubins timed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def main() -> int:
    points = json.loads((HERE / "measurements.json").read_text())["points"]
    for commit in sorted({p["commit"] for p in points}):
        kernels = sorted({p["kernel"] for p in points if p["commit"] == commit})
        targets = sorted({p["target"] for p in points if p["commit"] == commit})
        with tempfile.TemporaryDirectory(prefix=f"ptxc-calib-{commit}-") as tmp:
            wt, out = Path(tmp) / "src", Path(tmp) / "out"
            subprocess.run(["git", "worktree", "add", "-q", "--detach", str(wt), commit], cwd=ROOT, check=True)
            try:
                env = {**os.environ, "PYTHONPATH": str(wt), "PTXC_CACHE_DIR": str(Path(tmp) / "cache")}
                subprocess.run([sys.executable, "-m", "ptxc.cli", "build", "specs/", "--out", str(out),
                                *(a for t in targets for a in ("--target", t))], cwd=wt, env=env, check=True)
                dest = HERE / commit
                shutil.rmtree(dest, ignore_errors=True)
                dest.mkdir()
                for p in (p for p in points if p["commit"] == commit):
                    for name in (f"{p['kernel']}.json", f"{p['kernel']}.{p['target']}.cubin"):
                        shutil.copyfile(out / p["kernel"] / name, dest / name)
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", str(wt)], cwd=ROOT, check=False)
        print(f"{commit}: {len(kernels)} kernels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
