"""Orchestration behind `ptxc build` and `ptxc verify`: load specs, compile (in parallel, through
the cache), write artifacts, update the manifest, and summarise."""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .artifacts import ensure_output_dir, ensure_writable_set, locked, update_manifest, write_kernel
from .cache import Cache
from .compiler import build_all, check_resources
from ..errors import SpecError, UserError
from ..kernels import FAMILIES
from ..spec import KernelSpec
from ..kernels import load_paths
from ..targets import get_target


def _retarget(specs: list[KernelSpec], targets: list[str]) -> list[KernelSpec]:
    for t in targets:
        get_target(t)
    if len(set(targets)) != len(targets):   # the spec loader's rule: each target once
        raise UserError(f"--target {' '.join(targets)}: a target is repeated; give each once")
    out = []
    for s in specs:
        s2 = dataclasses.replace(s, targets=tuple(targets))
        try:
            FAMILIES[s.family].validate(s2)
        except SpecError as e:
            raise SpecError(f"with --target {' '.join(targets)}: {e.detail}", key=e.key,
                            kernel=repr(s.name), file=s.source) from None
        out.append(s2)
    return out


def _progress(total: int, enabled: bool):
    """A rich progress bar on a terminal; plain lines otherwise (CI logs); nothing if disabled."""
    if not enabled:
        return None, lambda spec, target: None
    if sys.stderr.isatty():
        from rich.progress import Progress
        bar = Progress(transient=True, console=None)
        task = bar.add_task("compiling", total=total)
        bar.start()
        return bar, lambda spec, target: bar.advance(task)
    return None, lambda spec, target: print(f"  built {spec.name} [{target}]", file=sys.stderr, flush=True)


def run_build(paths, out: Path, *, targets: list[str] | None = None, verify: bool = True,
              jobs: int | None = None, use_cache: bool = True, progress: bool = True,
              cache_dir: Path | None = None, shard: tuple[int, int] | None = None,
              fatbin: bool = False) -> dict[str, Any]:
    t0 = time.perf_counter()
    specs = load_paths(paths)
    if shard is not None:
        from .shard import in_shard
        specs = [s for s in specs if in_shard(s.name, shard)]
    if targets:
        specs = _retarget(specs, targets)
    if fatbin and not verify:
        from ..errors import UserError
        raise UserError("--fatbin packs the cubins, which --no-verify does not build")
    for s in specs:  # resolve tiles for every target before any work: config errors come first
        for t in s.targets:
            FAMILIES[s.family].resolve_tile(s, get_target(t))
    ensure_output_dir(out)   # before any work: a bad --out is one line, not a late traceback
    ensure_writable_set(out, [s.name for s in specs])
    tc = None
    if verify:
        from .ptxas import toolchain
        tc = toolchain()
    cache = Cache(cache_dir, enabled=use_cache)
    bar, on_done = _progress(sum(len(s.targets) for s in specs), progress)
    try:
        builds = build_all(specs, cache, tc, jobs=jobs, on_done=on_done)
    finally:
        if bar is not None:
            bar.stop()
    metas, changed, problems, kernels = [], 0, [], []
    with locked(out):   # another build writing the same kernel names waits: no mixed artifacts
        for b in builds:
            meta, n = write_kernel(out, b, verified=tc is not None, fatbin=fatbin)
            metas.append(meta)
            changed += n
            problems += [p for tb in b.targets for p in check_resources(b.spec, tb)]
            kernels.append({"name": b.spec.name, "family": b.spec.family, "dir": str(out / b.spec.name),
                            "targets": {t: _target_summary(meta["targets"][t]) for t in meta["targets"]}})
        changed += update_manifest(out, metas, lock=False)
    return {"out": str(out), "kernels": kernels, "files_changed": changed, "problems": problems,
            "verified": tc is not None, "ptxas_version": tc.version if tc else None,
            "cache": {"path": str(cache.root), "enabled": cache.enabled, "hits": cache.hits,
                      "misses": cache.misses},
            "shard": list(shard) if shard else None, "seconds": round(time.perf_counter() - t0, 3)}


def _target_summary(t: dict) -> dict:
    ks = t["kernels"]
    res = [k.get("resources") or {} for k in ks]
    return {"entries": [k["entry"] for k in ks],
            "registers": max((r.get("registers", 0) for r in res), default=None) if res[0] else None,
            "spill_bytes": sum(r.get("spill_stores", 0) + r.get("spill_loads", 0) for r in res),
            "smem_bytes": max(k["static_smem_bytes"] + k["dynamic_smem_bytes"] for k in ks),
            "occupancy": min((k["occupancy"]["occupancy"] for k in ks if "occupancy" in k), default=None)}


def run_verify(paths, rebuild: bool = False, allow_other_ptxas: bool = False):
    from .ptxas import toolchain
    from .verify import Report, is_artifact_dir, is_output_dir, verify_artifact, verify_output_dir
    tc = toolchain()
    report = Report(allow_other_ptxas=allow_other_ptxas)
    for p in map(Path, paths):
        if p.is_file() or (p.is_dir() and not is_artifact_dir(p) and not is_output_dir(p)):
            with tempfile.TemporaryDirectory(prefix="ptxc-verify-") as tmp:
                summary = run_build([p], Path(tmp), jobs=None, use_cache=False, progress=False)
                report.problems += summary["problems"]
                verify_output_dir(Path(tmp), report, tc)
        elif is_artifact_dir(p):
            verify_artifact(p, report, tc)
            if rebuild:
                _rebuild(p, report, tc)
        else:
            verify_output_dir(p, report, tc)
            if rebuild:
                for d in sorted(c for c in p.iterdir() if is_artifact_dir(c)):
                    _rebuild(d, report, tc)
    return report


def _rebuild(d: Path, report, tc) -> None:
    """Rebuild from the recorded spec even when the checks above refused the artifact: the
    rebuild names the exact files and JSON paths that differ. Only metadata that could not be
    read or fails the schema is skipped (verify_artifact has reported it)."""
    from ..errors import PtxcError
    from .checked import check_artifact
    from .rebuild import rebuild_artifact
    try:
        meta, _ = check_artifact(d, manifest=False, rederive=False)
    except PtxcError:
        return
    if meta is not None:
        rebuild_artifact(d, meta, tc, report.problems)
