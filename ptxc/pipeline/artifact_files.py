"""The files of an artifact directory, for checked.py: bounded reads of plain names inside it
(never a symlink), each PTX and cubin under the name ptxc gives it with the recorded sha256, the
entries and parameters its PTX declares, the cubin's target and kernels, and a fatbin holding
exactly the artifact's per-target images."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from ..errors import VerifyError
from ..files import read_regular_file, sha256
from .cubin_elf import cubin_sm, has_kernel
from .dim_rules import sm_number
from .fatbin import fatbin_images
from .metadata import artifact_files

MAX_IMAGE_BYTES = 512 << 20
_ENTRY = re.compile(r"\.entry\s+([\w$]+)\s*\(([^)]*)\)", re.S)
# `.param .u64 name`, or a tensor map `.param .align 64 .b8 name[128]` (read as type "tmap")
_PARAM = re.compile(r"\.param\s+(?:\.align\s+64\s+\.b8\s+([\w$]+)\[128\]|\.(\w+)\s+([\w$]+))")


def short(value: Any, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters: error lines never echo unbounded input."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def ptx_signatures(ptx: str) -> dict[str, list[tuple[str, str]]]:
    """Entry name -> [(param type, param name)] as declared in the PTX text."""
    return {m.group(1): [("tmap", tm) if tm else (t, n) for tm, t, n in _PARAM.findall(m.group(2))]
            for m in _ENTRY.finditer(ptx)}


def read_artifact_file(d: Path, name: str, limit: int = MAX_IMAGE_BYTES) -> bytes:
    """The bytes of file `name` directly inside artifact directory `d`; VerifyError unless
    `name` is a plain file name and the file a regular file (never a symlink)."""
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", "..") \
            or os.path.isabs(name) or "\0" in name:
        raise VerifyError(f"{d}: file name {short(name)} is not a plain name inside the artifact directory")
    path = d / name
    try:
        return read_regular_file(path, limit)
    except FileNotFoundError:
        raise VerifyError(f"{path}: missing") from None
    except OSError as e:
        why = "a symlink" if path.is_symlink() else (e.strerror or str(e))
        raise VerifyError(f"{path}: not readable as a regular file ({why})") from None


def file_problems(d: Path, name: str, target: str, t: dict) -> list[str]:
    problems = []
    want = artifact_files(name, target)
    for kind in ("ptx", "cubin"):
        if kind in t and t[kind] != want[kind]:
            problems.append(f"{d}: {target} {kind} file {short(t[kind])} is not {want[kind]!r}")
    if problems:
        return problems
    texts = {}
    for kind in ("ptx", "cubin"):
        if kind not in t:
            continue
        try:
            data = read_artifact_file(d, t[kind])
        except VerifyError as e:
            problems.append(str(e))
            continue
        if sha256(data) != t[f"{kind}_sha256"]:
            problems.append(f"{d / t[kind]}: sha256 {sha256(data)[:16]}... differs from metadata "
                            f"{t[kind + '_sha256'][:16]}...")
        texts[kind] = data
    if "ptx" in texts:
        text = texts["ptx"].decode("utf-8", "replace")
        if f".target {target}" not in text:
            problems.append(f"{d / t['ptx']}: does not declare .target {target}")
        sigs = ptx_signatures(text)
        if sorted(sigs) != sorted(k["entry"] for k in t["kernels"]):
            problems.append(f"{d / t['ptx']}: entries {sorted(sigs)} differ from metadata "
                            f"{sorted(k['entry'] for k in t['kernels'])}")
        for k in t["kernels"]:
            have, want_sig = sigs.get(k["entry"]), [(p["type"], p["name"]) for p in k["params"]]
            if have is not None and have != want_sig:
                problems.append(f"{d / t['ptx']}: entry {k['entry']} parameters differ from metadata")
    if "cubin" in texts:     # the cubin is this target's and holds these kernels (cubin_elf.py)
        sm, want_sm = cubin_sm(texts["cubin"]), sm_number(target)
        missing = [k["entry"] for k in t["kernels"] if not has_kernel(texts["cubin"], k["entry"])]
        if sm != want_sm:
            problems.append(f"{d / t['cubin']}: " + ("not a CUDA ELF" if sm is None else
                                                   f"assembled for sm_{sm}, not {target}"))
        elif missing:
            problems.append(f"{d / t['cubin']}: holds no kernel {missing[0]}")
    return problems


def fatbin_problems(d: Path, name: str, fatbin: dict, targets: dict) -> list[str]:
    if fatbin["file"] != f"{name}.fatbin":
        return [f"{d}: fatbin file {short(fatbin['file'])} is not {name + '.fatbin'!r}"]
    try:
        data = read_artifact_file(d, fatbin["file"])
    except VerifyError as e:
        return [str(e)]
    if sha256(data) != fatbin["sha256"]:
        return [f"{d / fatbin['file']}: sha256 {sha256(data)[:16]}... differs from metadata {fatbin['sha256'][:16]}..."]
    # The hash only says the file is the one the metadata names, and both are editable: the
    # loaders prefer the fatbin, so its images must be the (checked) per-target files.
    where = d / fatbin["file"]
    try:
        images = fatbin_images(data)
    except ValueError as e:
        return [f"{where}: not a fatbin ptxc makes ({e})"]
    want = {}
    for target, t in targets.items():
        sm = int("".join(c for c in target[3:] if c.isdigit()))
        if "cubin" not in t:
            return [f"{where}: the metadata records no cubin for {target}; a fatbin packs cubins"]
        want[("elf", sm)] = read_artifact_file(d, t["cubin"])
        want[("ptx", sm)] = _ptx_tokens(read_artifact_file(d, t["ptx"]))
    have = {}
    for kind, sm, payload in images:
        if (kind, sm) in have:
            return [f"{where}: two {kind} images for sm_{sm}"]
        have[(kind, sm)] = payload if kind == "elf" else _ptx_tokens(payload)
    if sorted(have) != sorted(want):
        return [f"{where}: holds images {sorted(have)}, the metadata's targets give {sorted(want)}"]
    for key in sorted(want):
        got, cubin = have[key], want[key]
        if key[0] == "elf":   # the cubin, then at most alignment padding of NULs
            same = got[:len(cubin)] == cubin and len(got) - len(cubin) < 64 and not got[len(cubin):].strip(b"\0")
        else:
            same = got == cubin
        if not same:
            what = "cubin" if key[0] == "elf" else "PTX"
            return [f"{where}: its {key[0]} image for sm_{key[1]} is not the artifact's {what} for "
                    f"that target (a fatbin from another build?)"]
    return []


def _ptx_tokens(ptx: bytes) -> list[str]:
    """PTX text without comments and indentation: what `fatbinary` keeps of a module."""
    text = re.sub(r"/\*.*?\*/", " ", ptx.decode("utf-8", "replace"), flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return [line.strip() for line in text.splitlines() if line.strip()]
