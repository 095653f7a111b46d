"""`ptxc tune SPEC`: try every legal tile configuration of a target on the GPU, keep the fastest
per (family, head_dim, causal, dtype), and write it to a tuned table (ptxc/tuned/).

Candidates are the cartesian product of the family's [kernel.tile] choices, each checked the
way a build would check it (family validation, tile resolution: shared memory, register and
shape limits), de-duplicated by the configuration it resolves to. Specs that share a key are
tuned together: a candidate's score is the sum of its median times over those specs, so one
tile serves all of them. The spec's own (heuristic) tile is always timed too, as `default_ms`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import tempfile
from pathlib import Path
from typing import Any

from ..errors import SpecError, UserError
from ..kernels import FAMILIES
from ..spec import KernelSpec
from ..targets import get_target

MAX_CANDIDATES = 400   # the prefill product is 500 raw combinations; legal ones are far fewer
# Tile keys every candidate keeps at the spec's value: prefill's warp_rows and smem_layout change the
# kernel's structure, not its tile, and tuned tables record (and apply) only the tile shape
# (kernels.common.tuned_tile); a tuned 32-row tile would be applied as a 16-row one. kv_loads
# (sm_90a's TMA or cp.async loads) and warp_specialize are structural in the same way.
NOT_TUNED = frozenset({"warp_rows", "smem_layout", "kv_loads", "warp_specialize"})


def tune_key(spec: KernelSpec) -> dict[str, Any]:
    opts = dict(spec.options)
    return {"family": spec.family, "head_dim": spec.head_dim, "causal": bool(opts.get("causal", False)),
            "dtype": spec.dtype}


def candidate_tiles(spec: KernelSpec, target: str) -> list[dict[str, Any]]:
    """Legal tiles for `spec` on `target`: [{"tile": given keys, "resolved": config}], one per
    distinct resolved configuration, the spec's default first."""
    family = FAMILIES[spec.family]
    t = get_target(target)
    fields = [f for f in family.fields.tile if f.choices and f.name not in NOT_TUNED]
    # the target alone, unless the family sizes a target's tile by the others (MLA's latent
    # tile fits every target of the kernel): then the spec's own list, as the build sees it
    targets = spec.targets if family.ptx_reads_all_targets(spec) else (target,)
    base = dataclasses.replace(spec, targets=targets, tile=())
    out, seen = [], set()

    def consider(tile: dict) -> None:
        s = dataclasses.replace(base, tile=tuple(sorted(tile.items())))
        try:
            family.validate(s)
            resolved = family.resolve_tile(s, t)
        except SpecError:
            return
        key = json.dumps(resolved, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append({"tile": dict(tile), "resolved": resolved})

    consider(spec.tile_dict())     # the spec's own choice (usually the heuristic default)
    fixed = {k: v for k, v in spec.tile_dict().items() if k in NOT_TUNED}
    for group in family.tile_groups or (tuple(f.name for f in fields),):
        chosen = [f for f in fields if f.name in group]
        for combo in itertools.product(*(f.choices for f in chosen)):
            consider({**fixed, **dict(zip((f.name for f in chosen), combo))})
    return out[:MAX_CANDIDATES]


def group_specs(specs: list[KernelSpec]) -> dict[tuple, list[KernelSpec]]:
    groups: dict[tuple, list[KernelSpec]] = {}
    for s in specs:
        groups.setdefault(tuple(tune_key(s).values()), []).append(s)
    return groups


def pick_target(specs: list[KernelSpec], device_sm: int, target: str | None) -> str:
    if target:
        get_target(target)
        return target
    for s in specs:
        exact = [t for t in s.targets if get_target(t).sm == device_sm]
        if exact:
            return exact[0]
    raise UserError(f"no target of the spec matches this device (sm_{device_sm}); pass --target sm_{device_sm}")


def _time_variant(spec: KernelSpec, tile: dict, target: str, dims_of, device, timer_args, tc, workdir: Path,
                  index: int) -> tuple[float, dict] | None:
    """(median ms, dims) of `spec` built with `tile`; None if it spills or fails to build."""
    from ..pipeline.artifacts import write_kernel
    from .bench import bench_inputs, timing_stats
    from ..pipeline.cache import Cache
    from ..pipeline.compiler import build_all, check_resources
    from .timing import LaunchListTimer
    from ..errors import PtxcError
    from ..runtime import Artifact, prepare_buffers, split_scalars
    reads_all = FAMILIES[spec.family].ptx_reads_all_targets(spec)   # as candidate_tiles resolved it
    variant = dataclasses.replace(spec, name=f"{spec.name}__tune{index}",
                                  targets=spec.targets if reads_all else (target,),
                                  tile=tuple(sorted(tile.items())))
    try:
        build = build_all([variant], Cache(enabled=False), tc, jobs=1)[0]
    except PtxcError:
        return None
    if any(check_resources(variant, tb) for tb in build.targets):   # spills: not a candidate
        return None
    # Metadata this process just made (never read back from disk), so no load_checked here.
    meta, _ = write_kernel(workdir, build, verified=True)
    art = Artifact(workdir / variant.name, meta)
    dims = dims_of(art.meta)
    inputs = bench_inputs(art.meta, dims)
    buffers = prepare_buffers(art.meta, inputs, dims)
    launch_dims = {**dims, **split_scalars(art.meta, inputs, {})[1]}   # + runtime scalars
    with LaunchListTimer(device, art, target, buffers, launch_dims, timer_args["flush"](art.meta)) as timer:
        return timing_stats(timer.time(timer_args["warmup"], timer_args["repeat"]))["median_ms"], dims


def run_tune(paths, *, shapes: dict[str, int], target: str | None = None, out_dir: Path | None = None,
             warmup: int = 5, repeat: int = 20, limit: int | None = None) -> dict[str, Any]:
    from .bench import l2_flush_bytes, require_device, should_flush
    from ..report.costs import resolve_dims
    from .timing import l2_cache_bytes, sm_count
    from ..report.gpus import match_device
    from ..pipeline.ptxas import toolchain
    from ..kernels import load_paths
    from ..tuned import TUNED_DIR, write_table
    device = require_device()
    specs = load_paths(paths)
    tname = pick_target(specs, device.sm, target)
    tc = toolchain()
    l2, sms = l2_cache_bytes(device), sm_count(device)
    timer_args = {"warmup": warmup, "repeat": repeat,
                  "flush": lambda meta: l2_flush_bytes(l2) if should_flush(meta["family"], None) else 0}
    def dims_of(meta):
        return resolve_dims(meta, shapes, num_sms=sms, target=tname)

    entries, log = [], []
    with tempfile.TemporaryDirectory(prefix="ptxc-tune-") as tmp:
        for key, group in group_specs(specs).items():
            cands = candidate_tiles(group[0], tname)[:limit] if limit else candidate_tiles(group[0], tname)
            if len(cands) < 2:   # nothing to choose between (kv_append has no tile keys)
                continue
            scores = []
            for i, cand in enumerate(cands):
                runs = [_time_variant(s, cand["tile"], tname, dims_of, device, timer_args, tc, Path(tmp), i)
                        for s in group]
                total = None if None in runs else sum(ms for ms, _ in runs)
                if total is not None:
                    scores.append((total, i, cand, runs[0][1]))
                log.append({"key": dict(zip(("family", "head_dim", "causal", "dtype"), key)),
                            "resolved": cand["resolved"], "ms": total})
            if not scores:
                continue
            best_ms, _, best, dims = min(scores, key=lambda x: (x[0], x[1]))
            default_ms = next((ms for ms, i, _, _ in scores if i == 0), None)
            entries.append({**tune_key(group[0]), "tile": _tile_keys(group[0], best["resolved"]),
                            "median_ms": round(best_ms, 5),
                            "default_ms": None if default_ms is None else round(default_ms, 5),
                            "candidates": len(cands), "specs": [s.name for s in group], "dims": dims})
    gpu = match_device(device.name)
    path = write_table(out_dir or TUNED_DIR, target=tname, sm=device.sm, device_name=device.name,
                       entries=entries, gpu_model=gpu.key if gpu else None, ptxas_version=tc.version)
    return {"device": device.name, "target": tname, "table": str(path), "entries": entries, "tried": log}


def _tile_keys(spec: KernelSpec, resolved: dict) -> dict:
    """The spec-settable tile keys of a resolved config (drops derived fields like `path`); for
    a family with tile groups, only the keys of the group (code path) the config belongs to."""
    family = FAMILIES[spec.family]
    names = {f.name for f in family.fields.tile}
    for group in family.tile_groups:
        if set(group) <= resolved.keys():
            names = set(group)
            break
    return {k: v for k, v in resolved.items() if k in names}


__all__ = ["candidate_tiles", "group_specs", "pick_target", "run_tune", "tune_key"]
