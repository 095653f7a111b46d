"""`ptxc report`: a static performance report of built artifacts, no GPU needed.

Per kernel and target: resources from ptxas (registers, spills, shared memory, barriers), the
theoretical occupancy (ptxc.targets.occupancy over the per-SM limits table), FLOPs and bytes
of one launch list at a shape (ptxc.report.costs), arithmetic intensity, the roofline-bound time on
each GPU model of the target's SM (or the ones asked for), and, when nvdisasm is available,
the SASS instruction mix and the main loop's steady-state iteration with its estimated bound
(ptxc.report.loops, ptxc.report.loop_model). The result is plain JSON data; report_table.py prints it, report_html.py
renders it as one self-contained HTML page.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .. import __version__
from ..pipeline import exprs
from .costs import launch_cost, resolve_dims, roofline
from ..errors import InputError, UserError
from .gpus import GPUS, get_gpu, models_for_target, sm_of_target
from .loop_model import COPY_FAMILIES, kv_reuse, kv_rows_per_iteration, loop_figures, loop_warps, main_loop
from .calibration import COPY_CALIBRATION_ERROR, calibration_for
from .launch_model import launch_list_seconds
from ..targets import get_target, occupancy


def artifact_dirs(paths) -> list[Path]:
    """Artifact directories named directly or found one level inside output directories."""
    from ..pipeline.verify import is_artifact_dir, is_output_dir
    found: list[Path] = []
    for p in map(Path, paths):
        if is_artifact_dir(p):
            found.append(p)
        elif p.is_dir() and is_output_dir(p):
            found += [c for c in sorted(p.iterdir()) if is_artifact_dir(c)]
        else:
            raise UserError(f"{p}: not an artifact directory or build output directory "
                            f"(build specs first: ptxc build SPEC --out DIR)")
    if not found:
        raise UserError("no artifacts found in " + ", ".join(map(str, paths)))
    return found


def _load_meta(d: Path) -> dict:
    from ..pipeline.checked import load_checked
    return load_checked(d)


def _sass_mixes(jobs: list[tuple[Path, str, dict]], enabled: bool) -> tuple[dict, dict]:
    """Instruction mix per (artifact dir, target) -> (mix or None, reason or None), run in
    parallel (nvdisasm is a process per cubin) and cached; plus the report-wide status."""
    from concurrent.futures import ThreadPoolExecutor

    from ..errors import VerifyError
    from ..pipeline.cache import Cache
    from ..pipeline.artifact_files import read_artifact_file
    from .sass import SassUnavailable, find_nvdisasm, sass_profile
    status = {"available": False, "reason": None}
    if not enabled:
        status["reason"] = "skipped (--no-sass)"
        return {(d, t): (None, status["reason"]) for d, t, _ in jobs}, status
    try:
        find_nvdisasm()
    except SassUnavailable as e:
        status["reason"] = str(e)
        return {(d, t): (None, str(e)) for d, t, _ in jobs}, status
    cache = Cache(warn=lambda msg: None)

    def one(job):
        d, _target, tinfo = job
        if "cubin" not in tinfo:
            return None, "no cubin (built with --no-verify)"
        try:
            return sass_profile(read_artifact_file(d, tinfo["cubin"]), cache), None
        except VerifyError as e:
            return None, f"cannot read {tinfo['cubin']}: {e}"
        except SassUnavailable as e:
            return None, str(e)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = dict(zip(((d, t) for d, t, _ in jobs), pool.map(one, jobs)))
    if any(mix is not None for mix, _ in results.values()):
        status["available"] = True
    else:
        status["reason"] = next((why for _, why in results.values() if why), "no cubins")
    return results, status


def _target_for_sm(targets: dict, sm: int) -> str | None:
    """The target a device of `sm` runs: its own SM's cubin, else the newest older target's PTX."""
    exact = [t for t in targets if sm_of_target(t) == sm]
    if exact:
        return min(exact)
    older = sorted((t for t in targets if sm_of_target(t) < sm), key=lambda t: (sm_of_target(t), t))
    return older[-1] if older else None


def _loop_row(profile: dict | None, k: dict, meta: dict, config: dict, occ: dict | None,
              gpus, dims: dict) -> dict | None:
    """The main loop's figures (ptxc.report.loop_model) for one launch, or None without one."""
    loop = main_loop(profile, k, meta, config)
    if loop is None:
        return None
    rows = kv_rows_per_iteration(meta["family"], config, k["entry"])
    reuse = kv_reuse(meta["family"], config, meta["spec"], dims) if rows else 1
    return loop_figures(loop, loop_warps(config, k), (occ or {}).get("ctas_per_sm", 0), rows, gpus, reuse)


def _launch_row(k: dict, target: str, dims: dict, sass: dict | None, why: str | None,
                meta: dict, config: dict, gpus) -> dict:
    res = k.get("resources") or {}
    threads = k["block"][0] * k["block"][1] * k["block"][2]
    smem = k["static_smem_bytes"] + k["dynamic_smem_bytes"]
    occ = k.get("occupancy")
    if occ is None and res:
        occ = occupancy(get_target(target), threads, res.get("registers", 0), smem,
                        k.get("tmem_columns", 0))
    try:
        grid = [exprs.evaluate(g, dims) for g in k["grid"]]
    except InputError:
        grid = list(k["grid"])
    return {
        "entry": k["entry"], "block": list(k["block"]), "threads": threads, "grid": grid,
        "registers": res.get("registers"), "spill_bytes":
            (res.get("spill_stores", 0) + res.get("spill_loads", 0)) if res else None,
        "stack": res.get("stack"), "smem_bytes": smem, "barriers": res.get("barriers"),
        "occupancy": occ, "sass": ((sass or {}).get(k["entry"]) or {}).get("mix"), "sass_note": why,
        "loop": _loop_row((sass or {}).get(k["entry"]), k, meta, config, occ, gpus, dims),
    }


def _estimates(meta: dict, tinfo: dict, launches: list[dict], dims: dict, models, sass,
               cost=None) -> list[dict]:
    """The calibrated whole-launch estimate (ptxc.report.launch_model) on every GPU model that has
    a calibration for the kernel's path (mma.sync and SIMT; wgmma + TMA; not tcgen05, which never
    ran on hardware), with that calibration's measured error. The copy families (appends, merges:
    no attention loop) take their launch term and `cost`'s bytes over the DRAM share, quoted
    with the error measured on the timed copies (COPY_CALIBRATION_ERROR): no SASS needed."""
    copy = meta["family"] in COPY_FAMILIES
    if (copy and cost is None) or (not copy and not sass):
        return []
    config = tinfo.get("config", {})
    loops = {k["entry"]: None if copy else main_loop(sass.get(k["entry"]), k, meta, config)
             for k in tinfo["kernels"]}
    kernels = [{**k, "occupancy": L["occupancy"] or {"ctas_per_sm": 1}} for k, L in zip(tinfo["kernels"], launches)]
    out = []
    for g in models:
        fitted = calibration_for(g.key, config)
        if fitted is None:
            continue
        cal, error = fitted
        if copy:
            error = COPY_CALIBRATION_ERROR
        try:
            got = launch_list_seconds(meta["family"], meta["spec"], config, kernels, loops, dims, g, cal,
                                      copy_bytes=cost.bytes if copy else 0)
        except (InputError, KeyError, ZeroDivisionError):
            continue
        out.append({"gpu": g.key, "seconds": got["seconds"], "launches": got["launches"],
                    "calibration": cal.source, "error": error})
    return out


def build_report(paths, shapes: dict[str, int] | None = None, gpus: list[str] | None = None,
                 measured: list[dict] | None = None, sass: bool = True) -> dict[str, Any]:
    shapes = shapes or {}
    chosen = [get_gpu(g) for g in gpus] if gpus else None
    metas = [(d, _load_meta(d)) for d in artifact_dirs(paths)]
    mixes, sass_status = _sass_mixes([(d, t, ti) for d, m in metas for t, ti in m["targets"].items()], sass)
    used: dict[str, Any] = {}
    kernels = []
    for d, meta in metas:
        dims = resolve_dims(meta, shapes)
        targets = []
        for target in sorted(meta["targets"], key=lambda t: (get_target(t).sm, t)):
            tinfo = meta["targets"][target]
            try:
                cost, cost_note = launch_cost(meta, target, dims), None
            except UserError as e:   # a family without a cost model still gets its resources
                cost, cost_note = None, str(e)
            mix, why = mixes[(d, target)]
            if chosen is None:
                models = models_for_target(target)
            else:   # each chosen GPU runs the image a CUDA device would pick (runtime.cuda)
                models = [g for g in chosen if _target_for_sm(meta["targets"], g.sm) == target]
            for g in models:
                used[g.key] = g
            launches = [_launch_row(k, target, dims, mix, why, meta, tinfo.get("config", {}),
                                    models) for k in tinfo["kernels"]]
            models = models if cost else []
            targets.append({
                "estimate": _estimates(meta, tinfo, launches, dims, models, mix, cost),
                "target": target, "config": tinfo.get("config", {}),
                "cost": cost.to_dict() if cost else None, "cost_note": cost_note,
                "launches": launches,
                "roofline": [roofline(cost, g) for g in models],
                "measured": [m for m in measured or [] if m.get("kernel") == meta["name"]
                             and m.get("target") == target],
            })
        spec = meta["spec"]
        kernels.append({"name": meta["name"], "family": meta["family"], "path": str(d),
                        "dims": dims, "verified": meta.get("verified", False),
                        "spec": {k: spec[k] for k in ("dtype", "head_dim", "num_heads", "num_kv_heads",
                                                      "causal", "return_lse", "kv_layout") if k in spec},
                        "targets": targets})
    return {
        "ptxc_version": __version__,
        "shapes": shapes,
        "gpus": {k: used[k].to_dict() for k in GPUS if k in used},
        "sass": sass_status,
        "kernels": kernels,
    }


# What a plotted measured point reads of a `ptxc bench --json` row (report/html.py, gpu/bench.py
# result_row): None where the bench had no GPU model or no target
NUMBER = (int, float)
MEASURED_FIELDS = {"kernel": (str,), "target": (str, type(None)), "gpu": (str, type(None)),
                   "intensity": NUMBER, "tflops": NUMBER, "median_ms": NUMBER}


def load_measured(paths) -> list[dict]:
    """Rows of `ptxc bench --json` files, for plotting measured points on the rooflines: a JSON
    object with a `results` list of objects, each ptxc row with the fields a point reads."""
    rows: list[dict] = []
    for p in map(Path, paths):
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"{p}: not a `ptxc bench --json` file ({e})") from None
        results = data.get("results") if isinstance(data, dict) else None
        if not isinstance(results, list) or not all(isinstance(r, dict) for r in results):
            raise UserError(f"{p}: not a `ptxc bench --json` file (expected an object with a "
                            f"'results' list of objects)")
        for i, r in enumerate(results):
            if r.get("impl") != "ptxc":
                continue
            bad = [k for k, t in MEASURED_FIELDS.items()
                   if not isinstance(r.get(k), t) or isinstance(r.get(k), bool)]
            if bad:
                want = "a number" if MEASURED_FIELDS[bad[0]] is NUMBER else "a string"
                raise UserError(f"{p}: results[{i}]: field {bad[0]!r} is missing or not {want}")
            rows.append(r)
    return rows


def write_html(report: dict, path: Path) -> Path:
    from ..files import atomic_write
    from .html import render_html
    atomic_write(path, render_html(report).encode())
    return path


__all__ = ["artifact_dirs", "build_report", "load_measured", "write_html"]
