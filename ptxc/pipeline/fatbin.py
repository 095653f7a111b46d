"""`ptxc build --fatbin`: one `<name>.fatbin` per artifact holding every target's cubin and PTX
(the PTX keeps the fatbin loadable on GPUs newer than every target, by JIT), made by NVIDIA's
`fatbinary` tool (nvidia-cuda-nvcc wheel; `FATBINARY=/path` overrides). Uncompressed, so the
bytes are reproducible and every entry name is visible to tools; `fatbin_images` reads such a
file back (the checked loader compares its images with the artifact's own files)."""

from __future__ import annotations

import re
import struct
import subprocess
from functools import lru_cache
from pathlib import Path

from ..errors import ToolchainError, UserError
from ..files import sha256

HINT = "install it with `pip install nvidia-cuda-nvcc`, or set FATBINARY=/path/to/fatbinary"


@lru_cache(maxsize=4)
def fatbinary_version(path: str) -> str:
    out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"V(\d+\.\d+\.\d+)", out)
    return m.group(1) if m else "unknown"


def make_fatbin(artifact_dir: Path, name: str, targets: dict[str, dict]) -> tuple[bytes, dict]:
    """(fatbin bytes, metadata record) from the artifact's files; every target needs a cubin."""
    from .ptxas import find_nvidia_tool   # the toolchain, only where a fatbin is made
    tool = find_nvidia_tool("fatbinary", "FATBINARY", HINT)
    images = []
    for target, t in sorted(targets.items()):
        if "cubin" not in t:
            raise UserError(f"{name} [{target}]: --fatbin needs cubins; build without --no-verify")
        sm = "".join(c for c in target[3:] if c.isalnum())
        images += [f"--image3=kind=elf,sm={sm},file={t['cubin']}", f"--image3=kind=ptx,sm={sm},file={t['ptx']}"]
    dest = f".{name}.fatbin.tmp"
    try:
        proc = subprocess.run([tool, f"--create={dest}", "--64", "--compress=false", *images],
                              cwd=artifact_dir, capture_output=True, text=True)
        if proc.returncode != 0:
            first = (proc.stderr or proc.stdout).strip().splitlines()
            raise ToolchainError(f"{name}: fatbinary failed: {first[0] if first else proc.returncode}")
        data = (artifact_dir / dest).read_bytes()
    finally:
        (artifact_dir / dest).unlink(missing_ok=True)
    record = {"file": f"{name}.fatbin", "sha256": sha256(data), "fatbinary_version": fatbinary_version(tool)}
    return data, record


FATBIN_MAGIC = 0xBA55ED50
FATBIN_KINDS = {1: "ptx", 2: "elf"}


def fatbin_images(data: bytes) -> list[tuple[str, int, bytes]]:
    """(kind, sm, payload) for every image of an uncompressed fatbin (`fatbinary --compress=false`
    layout: a 16-byte header {magic u32, version u16, header size u16, body size u64}, then per
    image {kind u16, version u16, header size u32, padded payload size u64, ..., sm u32 at byte
    28}); ValueError on anything else. Padding (NULs) after a payload is dropped from PTX
    (an ELF payload keeps it: the caller compares it with the cubin plus padding)."""
    if len(data) < 16:
        raise ValueError("shorter than a fatbin header")
    magic, _, head, body = struct.unpack_from("<IHHQ", data, 0)
    if magic != FATBIN_MAGIC or head < 16 or head + body != len(data):
        raise ValueError("bad header or size")
    images, off = [], head
    while off < len(data):
        if off + 32 > len(data):
            raise ValueError("truncated image header")
        kind, _, ihead, size = struct.unpack_from("<HHIQ", data, off)
        (sm,) = struct.unpack_from("<I", data, off + 28)
        if kind not in FATBIN_KINDS or ihead < 32 or off + ihead + size > len(data):
            raise ValueError(f"bad image header at byte {off}")
        payload = data[off + ihead: off + ihead + size]
        if FATBIN_KINDS[kind] == "ptx":
            payload = payload.rstrip(b"\0")
        images.append((FATBIN_KINDS[kind], sm, payload))
        off += ihead + size
    return images
