"""Writing artifact sets: per kernel a directory `<out>/<name>/` with `<name>.json`, and per
target `<name>.<target>.ptx` and `.cubin`; plus `<out>/manifest.json` listing every artifact.

Every file is written to a temp path and `os.replace`d, and only when its bytes change, so a
warm rebuild rewrites nothing (mtimes unchanged) and a reader never sees half a file. The
manifest's read-modify-write holds an advisory lock so concurrent builds into one directory
merge rather than overwrite each other.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterator

from .. import __version__
from .cache import sha256, write_if_changed
from ..errors import UserError
from .metadata import SCHEMA_VERSION, artifact_files, dumps, make_metadata

MANIFEST = "manifest.json"


def kernel_dir(out: Path, name: str) -> Path:
    """`out/name`, refusing any name that would land outside `out` (names are validated
    earlier too; this is the last line of defence for path-like names)."""
    root = out.resolve()
    path = (root / name).resolve()
    if path.parent != root or name in ("", ".", "..") or "/" in name or "\\" in name:
        raise UserError(f"artifact name {name!r} would escape the output directory {out}")
    return out / name


def write_kernel(out: Path, build, verified: bool, fatbin: bool = False) -> tuple[dict[str, Any], int]:
    """Write one kernel's artifact directory (with `fatbin`, also `<name>.fatbin` of every
    target's cubin and PTX); returns (metadata, number of files changed)."""
    name = build.spec.name
    d = kernel_dir(out, name)
    d.mkdir(parents=True, exist_ok=True)
    changed = 0
    for tb in build.targets:
        files = artifact_files(name, tb.target)
        changed += write_if_changed(d / files["ptx"], tb.ptx.encode())
        if tb.cubin is not None:
            changed += write_if_changed(d / files["cubin"], tb.cubin)
    record = None
    if fatbin:
        from ..emit.fatbin import make_fatbin
        data, record = make_fatbin(d, name, make_metadata(build, verified)["targets"])
        changed += write_if_changed(d / record["file"], data)
    meta = make_metadata(build, verified, record)
    changed += write_if_changed(d / f"{name}.json", dumps(meta))
    return meta, changed


@contextlib.contextmanager
def _locked(out: Path) -> Iterator[None]:
    import fcntl
    with open(out / ".manifest.lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def read_manifest(out: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def update_manifest(out: Path, metas: list[dict[str, Any]]) -> bool:
    """Add/refresh the built artifacts; keep earlier entries whose metadata file still exists."""
    with _locked(out):
        old = read_manifest(out) or {}
        entries = {}
        for name, e in (old.get("artifacts") or {}).items():
            if isinstance(e, dict) and (out / str(e.get("metadata", ""))).is_file():
                entries[name] = e
        for meta in metas:
            name = meta["name"]
            entries[name] = {"family": meta["family"], "metadata": f"{name}/{name}.json",
                             "metadata_sha256": sha256(dumps(meta)),
                             "targets": sorted(meta["targets"])}
        manifest = {"schema_version": SCHEMA_VERSION, "ptxc_version": __version__,
                    "artifacts": dict(sorted(entries.items()))}
        return write_if_changed(out / MANIFEST, dumps(manifest))
