"""File helpers every layer may use (a base module, like `ptxc.errors`): content hashes, reading
a file that must be regular and bounded, and writing through a temp file and `os.replace` so no
reader ever sees half a file. The cache, the artifact writer, spec loading, the tuned tables and
the emitters all write and read through these."""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from pathlib import Path


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_regular_file(path: Path, limit: int) -> bytes:
    """The bytes of `path` if it is a regular file (not a symlink, FIFO or device) of at most
    `limit` bytes; OSError otherwise. Opening non-blocking means a FIFO cannot hang us."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(0, "not a regular file", str(path))
        if st.st_size > limit:
            raise OSError(0, f"larger than {limit} bytes", str(path))
        # Read what the file holds (one byte more to see it grew since the fstat), never the
        # whole budget: a 30 KB input must not need `limit` bytes of address space.
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(min(st.st_size, limit) + 1)
        if len(data) > limit:
            raise OSError(0, f"larger than {limit} bytes", str(path))
        return data
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` via a unique temp file in the same directory and os.replace.
    The file gets the usual permissions (0666 less the umask), not mkstemp's 0600."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError) and e.filename is None:
            # A failed write (ENOSPC, EDQUOT, EIO) names no file; the user needs the path.
            raise OSError(e.errno, e.strerror or str(e), str(path)) from None
        raise


def _read_umask() -> int:
    mask = os.umask(0o022)   # reading the umask means setting it; put it straight back at once
    os.umask(mask)
    return mask


_UMASK = _read_umask()   # once, at import, before any worker threads exist


def write_if_changed(path: Path, data: bytes) -> bool:
    """Atomically write `data` unless the file already holds exactly it (mtime then untouched)."""
    try:
        st = path.lstat()   # a symlink is never "unchanged": it is replaced, not followed
        if stat.S_ISREG(st.st_mode) and st.st_size == len(data) and path.read_bytes() == data:
            return False
    except OSError:
        pass
    atomic_write(path, data)
    return True
