"""`ptxc verify --rebuild`: rebuild each artifact from the normalised spec its metadata records
and compare every file byte for byte. Builds are reproducible, so any difference is an edit —
a grid, a shared-memory size, a PTX constant, a tensor shape — even when every sha256 in the
metadata and the manifest was re-computed to match."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from .. import __version__
from ..errors import PtxcError, VerifyError
from .artifacts import write_kernel
from .cache import Cache
from .artifact_files import read_artifact_file
from .compiler import build_all


def json_differences(old, new, path: str = "", limit: int = 3) -> list[str]:
    """The first few JSON paths where two documents differ, with both values."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new), key=str):
            if old.get(key, ...) != new.get(key, ...):
                out += json_differences(old.get(key, "<absent>"), new.get(key, "<absent>"), f"{path}/{key}", limit)
            if len(out) >= limit:
                break
        return out[:limit]
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        out = []
        for i, (a, b) in enumerate(zip(old, new)):
            if a != b:
                out += json_differences(a, b, f"{path}/{i}", limit)
            if len(out) >= limit:
                break
        return out[:limit]
    return [f"{path or '/'}: {json.dumps(old)[:60]} (rebuilt: {json.dumps(new)[:60]})"]


def rebuild_artifact(d: Path, meta: dict, tc, problems: list[str]) -> None:
    """Append a problem for every file of artifact directory `d` that a rebuild does not reproduce.
    The recorded spec passes the spec rules first (a spec no spec file could give is not built)."""
    from ..kernels import spec_from_record
    name = d.name
    if meta.get("ptxc_version") != __version__:
        problems.append(f"{d}: built by ptxc {meta.get('ptxc_version')}, this is {__version__}: "
                        f"--rebuild compares only builds of the same version")
        return
    verified = bool(meta.get("verified"))
    built_with = sorted({t.get("ptxas_version") for t in meta.get("targets", {}).values() if "cubin" in t})
    if verified and tc is not None and built_with != [tc.version]:
        problems.append(f"{d}: built with ptxas {', '.join(map(str, built_with))}, installed is {tc.version}: "
                        f"--rebuild compares only builds by the same ptxas (set PTXAS=)")
        return
    try:
        spec = spec_from_record(meta.get("spec"), f"{d / (name + '.json')}: spec")
    except PtxcError as e:
        problems.append(f"{d}: --rebuild: the recorded spec is invalid ({e})")
        return
    if spec.name != name:
        problems.append(f"{d}: --rebuild: the recorded spec names {spec.name!r}, not {name!r}")
        return
    try:
        [build] = build_all([spec], Cache(None, enabled=False), tc if verified else None, jobs=1)
    except (PtxcError, KeyError, TypeError, ValueError, AttributeError, IndexError, AssertionError) as e:
        problems.append(f"{d}: --rebuild: the recorded spec does not build ({type(e).__name__}: {e})")
        return
    with tempfile.TemporaryDirectory(prefix="ptxc-rebuild-") as tmp:
        rebuilt_meta, _ = write_kernel(Path(tmp), build, verified=verified, fatbin="fatbin" in meta)
        rebuilt = Path(tmp) / name
        for f in sorted(rebuilt.iterdir()):
            mine = d / f.name
            want = f.read_bytes()
            try:   # never through a symlink, never a FIFO/device, never more than a rebuild is
                data = read_artifact_file(d, f.name, limit=2 * len(want) + (1 << 20))
            except VerifyError as e:
                if "missing" in str(e):
                    problems.append(f"{mine}: missing (a rebuild from the recorded spec writes it)")
                elif "larger than" in str(e):
                    problems.append(f"{mine}: differs from a rebuild of its recorded spec (far larger)")
                else:
                    problems.append(str(e))
                continue
            if data != want:
                detail = ""
                if f.suffix == ".json":
                    try:
                        detail = "; " + "; ".join(json_differences(json.loads(data), rebuilt_meta))
                    except (ValueError, RecursionError):
                        detail = "; not valid JSON"
                if not detail.strip("; "):      # equal as JSON: the bytes differ (encoding, spacing)
                    detail = "; the same JSON written differently (ptxc writes canonical UTF-8)"
                problems.append(f"{mine}: differs from a rebuild of its recorded spec{detail}")

