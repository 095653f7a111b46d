"""The whole-launch model at every recorded point of measurements.json: shared by table.py and
tests/report/test_calibration.py, so the table printed and the figures pinned are the same numbers.

Each point names the GPU it was timed on (`gpu`, a ptxc/report/gpus.py key) and the target whose
cubin ran; the model always uses the H100-fitted constants (`H100_MMA_SYNC`) on that GPU's row.
The points of the runs the constants were fitted to (`FITTED`) are in-sample (`in_sample`);
every other point -- another GPU, or a later H100 run of later kernels -- is out-of-sample. A
wgmma path (sm_90a) gets no prediction (`predicted_ms` None): the model does not describe it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ptxc.report.gpus import GPUS
from ptxc.report.launch_model import H100_MMA_SYNC, launch_list_seconds
from ptxc.report.sass import sass_profile

HERE = Path(__file__).resolve().parent
FITTED = {("h100-sxm", c) for c in ("b26fd24", "c889eb4", "3357c2c")}   # (gpu, commit)


def points(calib: Path = HERE) -> list[dict]:
    return json.loads((calib / "measurements.json").read_text())["points"]


def predictions(calib: Path = HERE) -> list[dict]:
    profiles: dict[str, dict] = {}
    out = []
    for p in points(calib):
        meta = json.loads((calib / p["commit"] / f"{p['kernel']}.json").read_text())
        cubin = (calib / p["commit"] / f"{p['kernel']}.{p['target']}.cubin").read_bytes()
        digest = hashlib.sha256(cubin).hexdigest()
        t = meta["targets"][p["target"]]
        p = {**p, "in_sample": (p["gpu"], p["commit"]) in FITTED}
        if str(t["config"].get("path", "")).startswith("wgmma"):
            out.append({**p, "predicted_ms": None, "bound": "no model (wgmma)", "cubin": digest})
            continue
        if digest not in profiles:
            profiles[digest] = sass_profile(cubin)
        loops = {}
        for k in t["kernels"]:
            fn = profiles[digest].get(k["entry"], {}).get("loops", {})
            loops[k["entry"]] = fn["loops"][fn["main"]] if fn.get("main") is not None else None
        got = launch_list_seconds(meta["family"], meta["spec"], t["config"], t["kernels"], loops,
                                  {"num_splits": 1, "num_new": 1, **p["shape"]}, GPUS[p["gpu"]],
                                  H100_MMA_SYNC)
        bound = max(got["launches"], key=lambda x: x["seconds"])["bound"]
        out.append({**p, "predicted_ms": got["seconds"] * 1e3, "bound": bound, "cubin": digest})
    return out
