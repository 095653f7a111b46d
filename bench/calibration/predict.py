"""The whole-launch model at every recorded point of measurements.json: shared by table.py and
tests/report/test_calibration.py, so the table printed and the figures pinned are the same numbers.

Each point names the GPU it was timed on (`gpu`, a ptxc/report/gpus.py key) and the target whose
cubin ran; the model uses the H100-fitted constants of the kernel's path on that GPU's row
(`calibration.calibration_for`: `H100_MMA_SYNC` for mma.sync / SIMT, `H100_WGMMA` for the
sm_90a wgmma kernels). The points each set of constants was fitted to (`FITTED`,
`WGMMA_FITTED`) are in-sample (`in_sample`); every other point -- another GPU, or a later run
of later kernels -- is out-of-sample. A path without fitted constants (tcgen05) gets no
prediction (`predicted_ms` None).
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ptxc.report.calibration import calibration_for
from ptxc.report.costs import launch_cost, resolve_dims
from ptxc.report.gpus import GPUS
from ptxc.report.launch_model import SplitRows, launch_list_seconds
from ptxc.report.loop_model import COPY_FAMILIES, main_loop
from ptxc.report.sass import sass_profile

HERE = Path(__file__).resolve().parent
FITTED = {("h100-sxm", c) for c in ("b26fd24", "c889eb4", "3357c2c")}   # (gpu, commit): mma.sync
WGMMA_FITTED = {("h100-sxm", c) for c in ("89432c6", "f7ee845")}          # and wgmma


def _auto_rule(waves: int = 1, even: str = "", spread: bool = False):
    """A split-KV chunk rule of the timed commits' split_plan.py for num_splits = "auto": the
    `total` term aiming at `waves` busy CTAs per resident slot, then with `even` the longest
    row's splits evened out ("up": cdiv(units, chunk) of them; "down": units // chunk), with
    `spread` a row left whole spread over the S splits instead."""
    cd = lambda a, d: -(-a // d)

    def chunk(s: SplitRows) -> int:
        floor = max(1, cd(s.units, s.splits))
        c = max(floor, cd(s.work * s.seqs, max(1, cd(s.splits * s.rows * waves, 4))))
        if spread and c >= s.units:
            return floor
        if even:
            n = max(1, cd(s.units, c) if even == "up" else s.units // c)
            c = max(cd(s.units, n), floor)
        return c
    return chunk


def _even_shares(s: SplitRows) -> int:
    return max(1, -(-s.units // s.splits))


def chunk_rule(commit: str, family: str, kernel: str, spec: dict):
    """The split-KV chunk the cubin of `kernel` at `commit` computes (None: this ptxc's,
    launch_model.kernel_chunk_rule): each row's even share before split_plan.py (cd97613);
    "auto" as it was (the `total` term alone) from 53a4762; dd55dec's A/B variants
    `<kernel>_w<waves>e<0|1>` (AUTO_WAVES, EQUAL_SPLITS); 4d6b7c7's per-family rule (decode four
    waves evened up, MLA evened down); 621d27f's, which is this ptxc's."""
    if commit in ("b26fd24", "c889eb4", "3357c2c"):
        return _even_shares
    if commit == "621d27f" or spec.get("num_splits", (spec.get("options") or {}).get("num_splits")) != "auto":
        return None
    if commit == "dd55dec" and "_w" in kernel:
        waves, even = kernel.rsplit("_w", 1)[1].split("e")
        return _auto_rule(int(waves), "up" if even == "1" else "")
    if commit == "4d6b7c7":
        return {"decode": _auto_rule(4, "up"), "mla": _auto_rule(even="down")}.get(family, _auto_rule())
    return _auto_rule()


def points(calib: Path = HERE) -> list[dict]:
    return json.loads((calib / "measurements.json").read_text())["points"]


def _profiles(calib: Path, pts: list[dict]) -> dict[str, dict]:
    """The SASS profile of every distinct cubin, by sha256: nvdisasm runs in parallel (it is
    most of the time: 140 cubins, 40 s one at a time on 2 cores)."""
    cubins: dict[str, bytes] = {}
    for p in pts:
        cubin = (calib / p["commit"] / f"{p['kernel']}.{p['target']}.cubin").read_bytes()
        cubins.setdefault(hashlib.sha256(cubin).hexdigest(), cubin)
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        return dict(zip(cubins, pool.map(sass_profile, cubins.values())))


def model_inputs(calib: Path = HERE):
    """Per recorded point: (point with `path`, `in_sample` and `cubin`, the launch model's
    arguments but the constants -- (family, spec, config, launches, loops, dims, GPU row,
    the cubin's split-KV chunk rule, a copy family's bytes) --
    or None where no constants were fitted for the kernel's path (tcgen05))."""
    pts = points(calib)
    profiles = _profiles(calib, pts)
    for p in pts:
        meta = json.loads((calib / p["commit"] / f"{p['kernel']}.json").read_text())
        cubin = (calib / p["commit"] / f"{p['kernel']}.{p['target']}.cubin").read_bytes()
        digest = hashlib.sha256(cubin).hexdigest()
        t = meta["targets"][p["target"]]
        wgmma = str(t["config"].get("path", "")).startswith("wgmma")
        p = {**p, "path": "wgmma" if wgmma else "mma.sync", "cubin": digest,
             "in_sample": (p["gpu"], p["commit"]) in (WGMMA_FITTED if wgmma else FITTED)}
        if calibration_for("h100-sxm", t["config"]) is None:
            yield p, None
            continue
        loops = {k["entry"]: main_loop(profiles[digest].get(k["entry"]), k, meta, t["config"])
                 for k in t["kernels"]}
        copy = launch_cost(meta, p["target"], resolve_dims(meta, {"num_new": 1, **p["shape"]})).bytes \
            if meta["family"] in COPY_FAMILIES else 0
        yield p, (meta["family"], meta["spec"], t["config"], t["kernels"], loops,
                  {"num_splits": 1, "num_new": 1, **p["shape"]}, GPUS[p["gpu"]],
                  chunk_rule(p["commit"], meta["family"], p["kernel"], meta["spec"]), copy)


def modelled(args: tuple, cal) -> dict:
    """launch_list_seconds over model_inputs' arguments under the constants `cal`."""
    *inputs, rule, copy = args
    return launch_list_seconds(*inputs, cal, chunk_rule=rule, copy_bytes=copy)


def predictions(calib: Path = HERE) -> list[dict]:
    out = []
    for p, args in model_inputs(calib):
        if args is None:
            out.append({**p, "predicted_ms": None, "bound": "no model"})
            continue
        # the H100's constants on this GPU's row: the same model, checked on another GPU
        got = modelled(args, calibration_for("h100-sxm", args[2])[0])
        bound = max(got["launches"], key=lambda x: x["seconds"])["bound"]
        out.append({**p, "predicted_ms": got["seconds"] * 1e3, "bound": bound})
    return out
