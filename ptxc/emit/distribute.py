"""Shipping generation spread over CI jobs: `ptxc merge` (the output directories of `--shard`
builds, pipeline/shard.py) and `ptxc pack`.
"""

from __future__ import annotations

import gzip
import io
import tarfile
from pathlib import Path

from ..pipeline.artifacts import MANIFEST, ensure_output_dir, inside_artifact_set, kernel_dir, update_manifest
from ..files import atomic_write, sha256, write_if_changed
from ..pipeline.artifact_files import read_artifact_file
from ..pipeline.checked import load_checked, read_manifest_checked
from ..errors import UserError, VerifyError


def merge(inputs: list[Path], out: Path) -> dict:
    """Copy every artifact of several output directories into one; the same name with
    different contents in two inputs (or already in `out`) is a conflict."""
    seen: dict[str, tuple[str, Path]] = {}
    owner = inside_artifact_set(out)
    if owner is not None:     # an artifact directory, or inside one
        raise UserError(f"--out {out}: inside the artifact directory {owner}; merge into an output directory")
    existing = read_manifest_checked(out)["artifacts"] if (out / MANIFEST).exists() else {}
    checked: dict[tuple[Path, str], dict] = {}
    for src in inputs:
        manifest = read_manifest_checked(src)
        for name, entry in sorted(manifest["artifacts"].items()):
            checked[(src, name)] = load_checked(kernel_dir(src, name))   # schema, hashes, files
            digest = entry["metadata_sha256"]
            other = seen.get(name) or ((existing[name]["metadata_sha256"], out)
                                       if name in existing else None)
            if other and other[0] != digest:
                raise UserError(f"conflict: artifact {name!r} differs between {other[1]} and {src}")
            seen[name] = (digest, src)
    metas = []
    ensure_output_dir(out)
    for name, (_, src) in sorted(seen.items()):
        d_src, d_out = kernel_dir(src, name), kernel_dir(out, name)
        d_out.mkdir(exist_ok=True)
        meta = checked[(src, name)]
        files = [f"{name}.json"] + [t[kind] for t in meta["targets"].values()
                                    for kind in ("ptx", "cubin") if kind in t]
        for f in files:   # exactly the files the metadata names, each a checked regular file
            write_if_changed(d_out / f, read_artifact_file(d_src, f))
        metas.append(meta)
    update_manifest(out, metas)
    return {"out": str(out), "artifacts": len(seen), "inputs": [str(p) for p in inputs]}


def pack(src: Path, dest: Path) -> dict:
    """A reproducible .tar.gz of an output directory's artifact set: the manifest and exactly
    the files each listed (checked) artifact's metadata names -- nothing else in the directory
    (a leftover, an earlier archive, an interrupted build's unlisted artifact, which is refused
    as `verify` refuses it) -- with sorted entries, mtime 0, uid/gid 0, no user names, fixed
    modes, gzip header without a timestamp. A symlink or special file anywhere is refused."""
    from ..pipeline.verify import is_artifact_dir
    manifest = read_manifest_checked(src)
    files = [src / MANIFEST]
    for name in sorted(manifest["artifacts"]):
        d = kernel_dir(src, name)
        meta = load_checked(d)      # schema, hashes, files
        named = [f"{name}.json"] + [t[kind] for t in meta["targets"].values() for kind in ("ptx", "cubin")
                                    if kind in t] + ([meta["fatbin"]["file"]] if meta.get("fatbin") else [])
        files += [d / f for f in sorted(named)]
    for p in sorted(src.rglob("*")):
        rel = p.relative_to(src)
        if any(part.startswith(".") for part in rel.parts):
            continue
        if p.is_symlink() or not (p.is_file() or p.is_dir()):
            raise VerifyError(f"{p}: not a regular file (symlinks and special files are never packed)")
        if len(rel.parts) == 1 and p.is_dir() and p.name not in manifest["artifacts"] and is_artifact_dir(p):
            raise VerifyError(f"{src / MANIFEST}: does not list artifact directory {p.name!r} "
                              f"(an interrupted build?); rebuild or remove it before packing")
    files.sort()
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for p in files:
            info = tarfile.TarInfo(p.relative_to(src).as_posix())
            data = read_artifact_file(p.parent, p.name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    gz = io.BytesIO()
    with gzip.GzipFile(fileobj=gz, mode="wb", mtime=0, filename="") as f:
        f.write(raw.getvalue())
    atomic_write(dest, gz.getvalue())
    return {"archive": str(dest), "files": len(files), "sha256": sha256(gz.getvalue())}
