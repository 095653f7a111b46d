"""Writing artifact sets: per kernel a directory `<out>/<name>/` with `<name>.json`, and per
target `<name>.<target>.ptx` and `.cubin`; plus `<out>/manifest.json` listing every artifact.

Every file is written to a temp path and `os.replace`d, and only when its bytes change, so a
warm rebuild rewrites nothing (mtimes unchanged) and a reader never sees half a file. The
manifest's read-modify-write holds an advisory lock so concurrent builds into one directory
merge rather than overwrite each other; the same lock is held while a build writes its artifact
directories, so two builds of one kernel name never interleave their files.

Nothing here follows a symlink: an artifact directory or lock file that is a symlink is refused,
and files are replaced (renamed over), never written through. Reading artifacts back is
ptxc/pipeline/checked.py's job (`load_checked`).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator

from .. import __version__
from ..files import sha256, write_if_changed
from ..errors import UserError
from .metadata import SCHEMA_VERSION, artifact_files, dumps, make_metadata
from .checked import load_checked, read_manifest_checked  # noqa: F401  (the checked read side)

MANIFEST = "manifest.json"


def kernel_dir(out: Path, name: str) -> Path:
    """`out/name`, refusing any name that would land outside `out` (names are validated
    earlier too; this is the last line of defence for path-like names)."""
    root = out.resolve()
    path = (root / name).resolve()
    if path.parent != root or name in ("", ".", "..") or "/" in name or "\\" in name:
        raise UserError(f"artifact name {name!r} would escape the output directory {out}")
    if (out / name).is_symlink():
        raise UserError(f"{out / name}: is a symlink; ptxc writes artifacts only into real "
                        f"directories inside the output directory")
    return out / name


def ensure_output_dir(out: Path) -> None:
    """Create `out` (and parents) or fail with one line saying why."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot create ({e.strerror})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise UserError(f"--out {out}: directory is not writable")


def ensure_writable_set(out: Path, names: list[str]) -> None:
    """Before any artifact is written: a manifest already in `out` is ptxc's and well-formed (a
    foreign or damaged one is neither overwritten nor carried forward), and nothing that is not
    a directory stands where an artifact's directory goes."""
    from ..errors import VerifyError
    if (out / MANIFEST).exists() or (out / MANIFEST).is_symlink():
        try:
            read_manifest_checked(out)
        except VerifyError as e:
            raise UserError(f"--out {out}: {e}; remove it or choose another directory") from None
    for name in names:
        d = kernel_dir(out, name)
        if d.exists() and not d.is_dir():
            raise UserError(f"--out {out}: {d} exists and is not a directory; artifact {name} "
                            f"is written there")


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
        from .fatbin import make_fatbin
        data, record = make_fatbin(d, name, make_metadata(build, verified)["targets"])
        changed += write_if_changed(d / record["file"], data)
    meta = make_metadata(build, verified, record)
    changed += write_if_changed(d / f"{name}.json", dumps(meta))
    return meta, changed


def inside_artifact_set(path: Path) -> Path | None:
    """The artifact directory (a directory D holding D.json) at or above `path`, or the output
    directory whose manifest `path` is: what no output option may overwrite or write into."""
    resolved = path.resolve()
    if resolved.name == MANIFEST and resolved.is_file():
        return resolved.parent
    for d in ([resolved] if resolved.is_dir() else []) + list(resolved.parents):
        if (d / f"{d.name}.json").is_file():
            return d
    return None


def ensure_output_file(path: Path, option: str) -> None:
    """Before any work: `path` can be written (parent an existing writable directory, path
    itself not a directory, not inside an artifact set); otherwise one line naming the option."""
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise UserError(f"{option} {path}: is a directory; give a file path")
    owner = inside_artifact_set(path)
    if owner is not None:
        raise UserError(f"{option} {path}: inside the artifact set {owner}; ptxc never writes over "
                        f"its artifacts: give a path outside it")
    if not parent.is_dir():
        raise UserError(f"{option} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{option} {path}: directory {parent} is not writable")


@contextlib.contextmanager
def locked(out: Path) -> Iterator[None]:
    """An exclusive flock on `out/.manifest.lock` (re-entrant per thread is not needed: callers
    take it once). O_NOFOLLOW: a planted symlink cannot make us create files elsewhere."""
    import fcntl
    try:
        fd = os.open(out / ".manifest.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as e:
        raise UserError(f"{out / '.manifest.lock'}: cannot open the lock file ({e.strerror}; "
                        f"it must be a regular file, not a symlink)") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)   # releases the lock


def update_manifest(out: Path, metas: list[dict[str, Any]], *, lock: bool = True) -> bool:
    """Add/refresh the built artifacts; keep earlier entries whose metadata file still exists
    (the earlier manifest read by the checked rules: ensure_writable_set refused a malformed
    one before anything was written). `lock=False` when the caller already holds `locked(out)`."""
    with (locked(out) if lock else contextlib.nullcontext()):
        old = read_manifest_checked(out) if (out / MANIFEST).exists() else {}
        entries = {}
        for name, e in (old.get("artifacts") or {}).items():
            if (out / e["metadata"]).is_file():
                entries[name] = e
        for meta in metas:
            name = meta["name"]
            entries[name] = {"family": meta["family"], "metadata": f"{name}/{name}.json",
                             "metadata_sha256": sha256(dumps(meta)),
                             "targets": sorted(meta["targets"])}
        manifest = {"schema_version": SCHEMA_VERSION, "ptxc_version": __version__,
                    "artifacts": dict(sorted(entries.items()))}
        return write_if_changed(out / MANIFEST, dumps(manifest))
