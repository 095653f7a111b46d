"""Content-addressed cache for stage outputs (PTX + launch list, cubin + resources).

Key = sha256 of a canonical JSON of everything that changes the output: the normalised spec,
the target, ptxc's version, a fingerprint of ptxc's own code-generation sources and, for cubins,
the PTX text, ptxas version and options. An entry is one file
`<root>/<stage>/<key[:2]>/<key>` holding a header line `ptxc-cache 1 <sha256 of payload>` and the
payload; it is written to a unique temp file and `os.replace`d, so readers see a whole entry or
none. On read the payload hash is re-checked: a corrupt or foreign entry is deleted, reported
as a warning, and rebuilt by the caller.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

from .. import __version__

MAGIC = b"ptxc-cache 1 "
# Sources whose change may change generated code; the CLI, docs and emulator are left out.
CODEGEN_DIRS = ("ir", "kernels", "spec", "tuned")   # tuned/*.json steer the tile heuristics
CODEGEN_FILES = ("targets.py", "pipeline/compiler.py", "pipeline/ptxas.py", "pipeline/metadata.py",
                 "pipeline/exprs.py")


def canonical_json(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@lru_cache(maxsize=1)
def codegen_fingerprint() -> str:
    root = Path(__file__).resolve().parent.parent   # the ptxc package
    files = sorted(p for d in CODEGEN_DIRS for p in (root / d).rglob("*") if p.suffix in (".py", ".j2", ".json"))
    files += [root / f for f in CODEGEN_FILES]
    h = hashlib.sha256(__version__.encode())
    for p in files:
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def make_key(stage: str, parts: dict[str, Any]) -> str:
    return sha256(canonical_json({"stage": stage, "ptxc": __version__,
                                  "codegen": codegen_fingerprint(), **parts}))


def default_cache_dir() -> Path:
    env = os.environ.get("PTXC_CACHE_DIR")
    if env:
        return Path(env)
    import platformdirs
    return Path(platformdirs.user_cache_dir("ptxc"))


class Cache:
    """A cache directory; `enabled=False` (or an unusable directory) makes every get a miss."""

    def __init__(self, root: Path | None = None, enabled: bool = True,
                 warn: Callable[[str], None] | None = None):
        self.root = Path(root) if root is not None else default_cache_dir()
        self.warn = warn or (lambda msg: print(f"warning: {msg}", file=sys.stderr))
        self.enabled = enabled and self._usable()
        self.hits = self.misses = 0

    def _usable(self) -> bool:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = tempfile.NamedTemporaryFile(dir=self.root, prefix=".probe-", delete=True)
            probe.close()
            return True
        except OSError as e:
            self.warn(f"cache directory {self.root} is not writable ({e.strerror}); "
                      f"building without the cache")
            return False

    def _path(self, stage: str, key: str) -> Path:
        return self.root / stage / key[:2] / key

    def get(self, stage: str, key: str) -> bytes | None:
        if not self.enabled:
            return None
        path = self._path(stage, key)
        try:
            blob = path.read_bytes()
        except OSError:
            self.misses += 1
            return None
        head, _, payload = blob.partition(b"\n")
        if not head.startswith(MAGIC) or head[len(MAGIC):].decode("ascii", "replace") != sha256(payload):
            self.warn(f"cache entry {path} is corrupt (hash mismatch); discarding and rebuilding")
            try:
                path.unlink()
            except OSError:
                pass
            self.misses += 1
            return None
        self.hits += 1
        return payload

    def put(self, stage: str, key: str, payload: bytes) -> None:
        if not self.enabled:
            return
        path = self._path(stage, key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, MAGIC + sha256(payload).encode() + b"\n" + payload)
        except OSError as e:
            self.warn(f"cannot write cache entry {path} ({e.strerror}); continuing without it")

    def info(self) -> dict[str, Any]:
        entries, size = 0, 0
        if self.root.is_dir():
            for p in self.root.rglob("*"):
                if p.is_file() and not p.name.startswith("."):
                    entries += 1
                    size += p.stat().st_size
        return {"path": str(self.root), "entries": entries, "bytes": size}

    def clear(self) -> int:
        import shutil
        removed = self.info()["entries"]
        for stage_dir in self.root.iterdir() if self.root.is_dir() else ():
            if stage_dir.is_dir():
                shutil.rmtree(stage_dir, ignore_errors=True)
        return removed


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` via a unique temp file in the same directory and os.replace."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_if_changed(path: Path, data: bytes) -> bool:
    """Atomically write `data` unless the file already holds exactly it (mtime then untouched)."""
    try:
        if path.stat().st_size == len(data) and path.read_bytes() == data:
            return False
    except OSError:
        pass
    atomic_write(path, data)
    return True
