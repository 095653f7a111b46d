"""The whole-launch model (ptxc.report.launch_model) against the H100 medians recorded in
bench/calibration/ (the sm_90 cubins of the commits that were timed, rebuilt by
bench/calibration/collect.py, and measurements.json). In-sample: the constants were fitted to
these points, so this pins the fit and the sign of the recorded changes, not a forecast."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest

from ptxc.report.gpus import GPUS
from ptxc.report.launch_model import H100_MMA_SYNC, launch_list_seconds
from ptxc.report.sass import SassUnavailable, find_nvdisasm, sass_profile

CALIB = Path(__file__).resolve().parents[1] / "bench" / "calibration"
ORDER = ("b26fd24", "c889eb4", "3357c2c")


def _nvdisasm():
    try:
        return find_nvdisasm()
    except SassUnavailable as e:
        pytest.skip(f"nvdisasm unavailable: {e}")


@pytest.fixture(scope="module")
def predictions():
    _nvdisasm()
    points = json.loads((CALIB / "measurements.json").read_text())["points"]
    profiles: dict[str, dict] = {}
    out = []
    for p in points:
        meta = json.loads((CALIB / p["commit"] / f"{p['kernel']}.json").read_text())
        cubin = (CALIB / p["commit"] / f"{p['kernel']}.sm_90.cubin").read_bytes()
        digest = hashlib.sha256(cubin).hexdigest()
        if digest not in profiles:
            profiles[digest] = sass_profile(cubin)
        t = meta["targets"]["sm_90"]
        loops = {}
        for k in t["kernels"]:
            fn = profiles[digest].get(k["entry"], {}).get("loops", {})
            loops[k["entry"]] = fn["loops"][fn["main"]] if fn.get("main") is not None else None
        dims = {"num_splits": 1, "num_new": 1, **p["shape"]}
        got = launch_list_seconds(meta["family"], meta["spec"], t["config"], t["kernels"], loops,
                                  dims, GPUS["h100-sxm"], H100_MMA_SYNC)
        out.append({**p, "predicted_ms": got["seconds"] * 1e3, "cubin": digest})
    return out


def test_every_point_within_45_percent_and_most_within_35(predictions):
    ratios = {(p["commit"], p["kernel"]): p["predicted_ms"] / p["median_ms"] for p in predictions}
    assert len(ratios) == 45
    worst = max(ratios.items(), key=lambda kv: abs(math.log(kv[1])))
    assert all(1 / 1.45 <= r <= 1.45 for r in ratios.values()), worst
    within = [k for k, r in ratios.items() if 1 / 1.35 <= r <= 1.35]
    assert len(within) >= 41, sorted(set(ratios) - set(within))
    # no systematic lean: the median ratio is within 10 % of 1
    assert 0.9 <= sorted(ratios.values())[len(ratios) // 2] <= 1.1


def test_recorded_changes_keep_their_sign(predictions):
    """Every kernel timed at two commits with a different cubin: a change the H100 measured
    beyond its noise (>= 5 %) has the model's sign; one within the noise is modelled under 25 %."""
    by_kernel: dict[str, list[dict]] = {}
    for p in predictions:
        by_kernel.setdefault(p["kernel"], []).append(p)
    checked = 0
    for runs in by_kernel.values():
        runs.sort(key=lambda p: ORDER.index(p["commit"]))
        for a, b in zip(runs, runs[1:]):
            if a["cubin"] == b["cubin"]:
                continue
            measured = b["median_ms"] / a["median_ms"] - 1
            modelled = b["predicted_ms"] / a["predicted_ms"] - 1
            if abs(measured) >= 0.05:
                assert math.copysign(1, measured) == math.copysign(1, modelled), (a["kernel"], measured, modelled)
            else:
                assert abs(modelled) < 0.25, (a["kernel"], a["commit"], measured, modelled)
            checked += 1
    assert checked >= 7
