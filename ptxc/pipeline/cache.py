"""Content-addressed cache for stage outputs (PTX + launch list, cubin + resources, SASS mix).

Key = sha256 of a canonical JSON of everything that changes the output: the normalised spec,
the target, ptxc's version, a fingerprint of ptxc's own code-generation sources and, for cubins,
the PTX text, ptxas version and options.

The cache only ever touches what it created. Its root holds a marker file (`CACHEDIR.TAG`, the
standard tag backup tools honour, with a line naming ptxc) and one versioned subdirectory; an
entry is the file `<root>/v2/<stage>/<key[:2]>/<key>`, and only names of exactly that shape are
counted, read or removed — `cache clear` on a directory without the marker removes nothing.
An entry starts with the header line `ptxc-cache 2 <stage> <key> <sha256 of payload>`, so an
entry copied or renamed to another key or stage is recognised as foreign. Entries are written
to a unique temp file and `os.replace`d; a corrupt, foreign or unreadable entry (or one whose
payload does not decode) is deleted with a warning and rebuilt by the caller, never an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

from .. import __version__
from ..errors import UserError
from ..files import atomic_write, read_regular_file, sha256

FORMAT = 2
MAGIC = b"ptxc-cache %d " % FORMAT
ENTRIES = f"v{FORMAT}"                    # the versioned subdirectory holding every entry
MARKER = "CACHEDIR.TAG"
MARKER_TEXT = (b"Signature: 8a477f597d28d172789f06886806bc55\n"
               b"# This directory is a ptxc compilation cache (created by ptxc; see `ptxc cache`).\n")
MAX_ENTRY_BYTES = 256 << 20               # larger files are not ours; never read them whole
STAGE_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
KEY_NAME = re.compile(r"[0-9a-f]{64}")
TEMP_NAME = re.compile(r"\.[0-9a-f]{64}\.[A-Za-z0-9_]+\.tmp")
# Sources whose change may change generated code; the CLI, docs and emulator are left out.
CODEGEN_DIRS = ("ir", "kernels", "spec", "tuned")   # tuned/*.json steer the tile heuristics
CODEGEN_FILES = ("targets.py", "pipeline/compiler.py", "pipeline/ptxas.py", "pipeline/metadata.py",
                 "pipeline/exprs.py")


def canonical_json(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode()


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
    from ..env import env_path
    env = env_path("PTXC_CACHE_DIR")
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
            if not self.is_ptxc_cache():
                marker = self.root / MARKER
                if marker.exists() or marker.is_symlink():
                    self.warn(f"{marker} exists and was not written by ptxc; building without "
                              f"the cache (set PTXC_CACHE_DIR to a directory of its own)")
                    return False
                atomic_write(marker, MARKER_TEXT)
            (self.root / ENTRIES).mkdir(exist_ok=True)
            probe = tempfile.NamedTemporaryFile(dir=self.root / ENTRIES, prefix=".probe-", delete=True)
            probe.close()
            return True
        except OSError as e:
            self.warn(f"cache directory {self.root} is not writable ({e.strerror or e}); "
                      f"building without the cache")
            return False

    def is_ptxc_cache(self) -> bool:
        try:
            return read_regular_file(self.root / MARKER, 4096) == MARKER_TEXT
        except OSError:
            return False

    def _path(self, stage: str, key: str) -> Path:
        if not STAGE_NAME.fullmatch(stage) or not KEY_NAME.fullmatch(key):
            raise ValueError(f"bad cache stage/key {stage!r}/{key!r}")   # a bug in the caller
        return self.root / ENTRIES / stage / key[:2] / key

    def _entry_dir_ok(self, path: Path, create: bool) -> bool:
        """Whether every directory between the cache root and entry `path` (`v2`, the stage,
        the key prefix) is a real directory, so an entry is never read or written outside the
        cache. A symlink there (`v2/ptx -> /elsewhere`) is removed with a warning (the link,
        never what it points to) and, when `create`, replaced by a real directory; anything
        else that is not a directory makes the entry unusable (False, with a warning)."""
        d = self.root
        for part in path.relative_to(self.root).parts[:-1]:
            d = d / part
            try:
                mode = d.lstat().st_mode
            except FileNotFoundError:
                if not create:
                    return False
                d.mkdir(exist_ok=True)
                continue
            if stat.S_ISLNK(mode):
                self.warn(f"cache directory {d} is a symlink; removing the link (not its target) "
                          f"so no entry is read or written outside the cache")
                d.unlink()
                if not create:
                    return False
                d.mkdir()
            elif not stat.S_ISDIR(mode):
                self.warn(f"cache path {d} is not a directory; not using the cache entry below it")
                return False
        return True

    def _discard(self, path: Path, why: str) -> None:
        self.warn(f"cache entry {path} is {why}; discarding and rebuilding")
        try:
            if not stat.S_ISDIR(path.lstat().st_mode):   # our own entry name: file, link or FIFO
                path.unlink()
        except OSError:
            pass
        self.misses += 1

    def get(self, stage: str, key: str) -> bytes | None:
        if not self.enabled:
            return None
        path = self._path(stage, key)
        try:
            usable = self._entry_dir_ok(path, create=False)
        except OSError:
            usable = False
        if not usable or (not path.exists() and not path.is_symlink()):
            self.misses += 1
            return None
        try:
            blob = read_regular_file(path, MAX_ENTRY_BYTES)
        except OSError as e:
            self._discard(path, f"unreadable ({e.strerror or e})")
            return None
        head, newline, payload = blob.partition(b"\n")
        fields = head.split(b" ")
        if not newline or len(fields) != 5 or not head.startswith(MAGIC):
            self._discard(path, "corrupt (truncated, or no ptxc-cache header)")
            return None
        if fields[2:4] != [stage.encode(), key.encode()]:
            self._discard(path, f"foreign (its header names another stage or key, not "
                                f"{stage}/{key[:12]}...)")
            return None
        if fields[4].decode("ascii", "replace") != sha256(payload):
            self._discard(path, "corrupt (hash mismatch)")
            return None
        self.hits += 1
        return payload

    def get_json(self, stage: str, key: str, check: Callable[[Any], bool]) -> Any:
        """The decoded JSON payload if it passes `check`; a payload that does not decode or
        check is discarded with a warning (the caller rebuilds it), never an error."""
        blob = self.get(stage, key)
        if blob is None:
            return None
        try:
            data = json.loads(blob)
            ok = check(data)
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            ok = False
        if not ok:
            self.hits -= 1
            self._discard(self._path(stage, key), "malformed (its payload does not decode)")
            return None
        return data

    def put(self, stage: str, key: str, payload: bytes) -> None:
        if not self.enabled:
            return
        path = self._path(stage, key)
        header = MAGIC + f"{stage} {key} {sha256(payload)}\n".encode()
        try:
            if not self._entry_dir_ok(path, create=True):
                return
            atomic_write(path, header + payload)
        except OSError as e:
            self.warn(f"cannot write cache entry {path} ({e.strerror}); continuing without it")

    def _own_files(self):
        """(path, is_temp) for every file under the entries directory whose name the cache
        itself would have made; nothing else is ever looked at, and symlinks are not followed."""
        base = self.root / ENTRIES
        if not self.is_ptxc_cache() or base.is_symlink() or not base.is_dir():
            return
        for stage in sorted(os.listdir(base)):
            sdir = base / stage
            if not STAGE_NAME.fullmatch(stage) or sdir.is_symlink() or not sdir.is_dir():
                continue
            for prefix in sorted(os.listdir(sdir)):
                pdir = sdir / prefix
                if not re.fullmatch(r"[0-9a-f]{2}", prefix) or pdir.is_symlink() or not pdir.is_dir():
                    continue
                for name in sorted(os.listdir(pdir)):
                    p = pdir / name
                    own = KEY_NAME.fullmatch(name) and name.startswith(prefix)
                    temp = TEMP_NAME.fullmatch(name) and name[1:3] == prefix
                    if (own or temp) and stat.S_ISREG(p.lstat().st_mode):
                        yield p, bool(temp)

    def info(self) -> dict[str, Any]:
        entries, size = 0, 0
        for p, temp in self._own_files():
            if not temp:
                entries += 1
                size += p.lstat().st_size
        return {"path": str(self.root), "entries": entries, "bytes": size,
                "is_ptxc_cache": self.is_ptxc_cache()}

    def clear(self) -> int:
        """Remove every entry (and leftover temp file) this cache made; nothing else."""
        if self.root.exists() and not self.is_ptxc_cache():
            raise UserError(f"{self.root}: not a ptxc cache (no {MARKER} written by ptxc); "
                            f"nothing removed")
        removed = 0
        for p, temp in list(self._own_files()):
            try:
                p.unlink()
                removed += not temp
            except OSError:
                pass
        base = self.root / ENTRIES
        for stage in (os.listdir(base) if base.is_dir() and not base.is_symlink() else ()):
            sdir = base / stage
            if STAGE_NAME.fullmatch(stage) and sdir.is_dir() and not sdir.is_symlink():
                for prefix in os.listdir(sdir):
                    try:
                        (sdir / prefix).rmdir()    # only succeeds when empty
                    except OSError:
                        pass
        return removed
