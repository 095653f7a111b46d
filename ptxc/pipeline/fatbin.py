"""`ptxc build --fatbin`: one `<name>.fatbin` per artifact holding every target's cubin and PTX
(the PTX keeps the fatbin loadable on GPUs newer than every target, by JIT), made by NVIDIA's
`fatbinary` tool (nvidia-cuda-nvcc wheel; `FATBINARY=/path` overrides). Uncompressed, so the
bytes are reproducible and every entry name is visible to tools."""

from __future__ import annotations

import re
import subprocess
from functools import lru_cache
from pathlib import Path

from ..errors import ToolchainError, UserError
from ..files import sha256
from .ptxas import find_nvidia_tool

HINT = "install it with `pip install nvidia-cuda-nvcc`, or set FATBINARY=/path/to/fatbinary"


@lru_cache(maxsize=4)
def fatbinary_version(path: str) -> str:
    out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"V(\d+\.\d+\.\d+)", out)
    return m.group(1) if m else "unknown"


def make_fatbin(artifact_dir: Path, name: str, targets: dict[str, dict]) -> tuple[bytes, dict]:
    """(fatbin bytes, metadata record) from the artifact's files; every target needs a cubin."""
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
