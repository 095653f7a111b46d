"""Spreading generation over CI jobs and shipping the result: `--shard i/N`, `ptxc merge`,
`ptxc pack`.

A kernel's shard is decided by a hash of its name, so adding or removing kernels never moves
the others between shards, and every job computes the same split without talking to the rest.
"""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from pathlib import Path

from ..pipeline.artifacts import MANIFEST, kernel_dir, read_manifest, update_manifest
from ..pipeline.cache import atomic_write, sha256, write_if_changed
from ..errors import UserError, VerifyError


def parse_shard(text: str) -> tuple[int, int]:
    """'i/N' with 1 <= i <= N."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise UserError(f"--shard {text!r}: expected i/N, e.g. 2/8") from None
    if not (n >= 1 and 1 <= i <= n):
        raise UserError(f"--shard {text!r}: need 1 <= i <= N")
    return i, n


def in_shard(name: str, shard: tuple[int, int]) -> bool:
    i, n = shard
    return int(sha256(name.encode())[:12], 16) % n == i - 1


def merge(inputs: list[Path], out: Path) -> dict:
    """Copy every artifact of several output directories into one; the same name with
    different contents in two inputs (or already in `out`) is a conflict."""
    seen: dict[str, tuple[str, Path]] = {}
    existing = (read_manifest(out) or {}).get("artifacts", {}) if out.exists() else {}
    for src in inputs:
        manifest = read_manifest(src)
        if manifest is None:
            raise UserError(f"{src}: no readable {MANIFEST}; is it a `ptxc build` output directory?")
        for name, entry in sorted(manifest.get("artifacts", {}).items()):
            meta_file = kernel_dir(src, name) / f"{name}.json"
            try:
                digest = sha256(meta_file.read_bytes())
            except OSError:
                raise VerifyError(f"{src}: manifest lists {name!r} but {meta_file} is missing") from None
            if digest != entry.get("metadata_sha256"):
                raise VerifyError(f"{meta_file}: sha256 differs from {src / MANIFEST}; run ptxc verify")
            other = seen.get(name) or ((existing[name]["metadata_sha256"], out)
                                       if name in existing else None)
            if other and other[0] != digest:
                raise UserError(f"conflict: artifact {name!r} differs between {other[1]} and {src}")
            seen[name] = (digest, src)
    metas = []
    out.mkdir(parents=True, exist_ok=True)
    for name, (_, src) in sorted(seen.items()):
        d_src, d_out = kernel_dir(src, name), kernel_dir(out, name)
        d_out.mkdir(exist_ok=True)
        meta = json.loads((d_src / f"{name}.json").read_bytes())
        for f in sorted(p for p in d_src.iterdir() if p.is_file() and not p.name.startswith(".")):
            write_if_changed(d_out / f.name, f.read_bytes())
        metas.append(meta)
    update_manifest(out, metas)
    return {"out": str(out), "artifacts": len(seen), "inputs": [str(p) for p in inputs]}


def pack(src: Path, dest: Path) -> dict:
    """A reproducible .tar.gz of an output directory: sorted entries, mtime 0, uid/gid 0, no
    user names, fixed modes, gzip header without a timestamp; dotfiles (locks, temps) left out."""
    if read_manifest(src) is None:
        raise UserError(f"{src}: no readable {MANIFEST}; pack takes a `ptxc build` output directory")
    files = sorted(p for p in src.rglob("*") if p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(src).parts))
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for p in files:
            info = tarfile.TarInfo(p.relative_to(src).as_posix())
            data = p.read_bytes()
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    gz = io.BytesIO()
    with gzip.GzipFile(fileobj=gz, mode="wb", mtime=0, filename="") as f:
        f.write(raw.getvalue())
    atomic_write(dest, gz.getvalue())
    return {"archive": str(dest), "files": len(files), "sha256": sha256(gz.getvalue())}
