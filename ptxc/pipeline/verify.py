"""`ptxc verify`: re-check an artifact set against itself and against ptxas.

For each artifact directory: the metadata parses and matches the JSON Schema; every ptx/cubin
file exists and matches its sha256; each PTX declares the entries the metadata names with
exactly the recorded parameter names and types, in order; ptxas (re-run) accepts every PTX and
reports the recorded resources (when the recorded ptxas version is the one installed) and no
spills. For an output directory, the manifest must list exactly the artifact directories present,
each with its metadata's sha256.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .artifacts import MANIFEST, read_manifest
from .cache import sha256
from ..errors import PtxcError
from .metadata import schema_errors

_ENTRY = re.compile(r"\.entry\s+([\w$]+)\s*\(([^)]*)\)", re.S)
_PARAM = re.compile(r"\.param\s+\.(\w+)\s+([\w$]+)")


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)   # one per (kernel, target, entry)

    @property
    def ok(self) -> bool:
        return not self.problems


def ptx_signatures(ptx: str) -> dict[str, list[tuple[str, str]]]:
    """Entry name -> [(param type, param name)] as declared in the PTX text."""
    return {m.group(1): [(t, n) for t, n in _PARAM.findall(m.group(2))] for m in _ENTRY.finditer(ptx)}


def verify_artifact(d: Path, report: Report, tc=None) -> None:
    name = d.name
    meta_path = d / f"{name}.json"
    try:
        meta = json.loads(meta_path.read_text())
    except OSError:
        report.problems.append(f"{meta_path}: missing")
        return
    except ValueError as e:
        report.problems.append(f"{meta_path}: not valid JSON ({e})")
        return
    errs = schema_errors(meta)
    report.problems += [f"{meta_path}: schema: {e}" for e in errs]
    if errs:
        return
    if meta["name"] != name:
        report.problems.append(f"{meta_path}: name {meta['name']!r} does not match directory {name!r}")
    if "fatbin" in meta:
        _checked_file(d / meta["fatbin"]["file"], meta["fatbin"]["sha256"], report)
    for target, t in meta["targets"].items():
        ptx = _checked_file(d / t["ptx"], t["ptx_sha256"], report)
        if "cubin" in t:
            _checked_file(d / t["cubin"], t["cubin_sha256"], report)
        if ptx is None:
            continue
        text = ptx.decode("utf-8", "replace")
        sigs = ptx_signatures(text)
        if f".target {target}" not in text:
            report.problems.append(f"{d / t['ptx']}: does not declare .target {target}")
        for k in t["kernels"]:
            want = [(p["type"], p["name"]) for p in k["params"]]
            have = sigs.get(k["entry"])
            if have is None:
                report.problems.append(f"{d / t['ptx']}: entry {k['entry']!r} not found")
            elif have != want:
                report.problems.append(f"{d / t['ptx']}: entry {k['entry']} parameters {have} "
                                       f"differ from metadata {want}")
            _check_abi(k, d / f"{name}.json", report)
        if tc is not None:
            _reassemble(d, meta, target, t, text, tc, report)


def _checked_file(path: Path, want: str, report: Report) -> bytes | None:
    try:
        data = path.read_bytes()
    except OSError:
        report.problems.append(f"{path}: missing")
        return None
    if sha256(data) != want:
        report.problems.append(f"{path}: sha256 {sha256(data)[:16]}... differs from metadata {want[:16]}...")
    return data


def _check_abi(k: dict, where: Path, report: Report) -> None:
    offset = 0
    for p in k["params"]:
        offset = -(-offset // p["size"]) * p["size"]
        if p["offset"] != offset or p["size"] != {"u32": 4, "s32": 4, "f32": 4}.get(p["type"], 8):
            report.problems.append(f"{where}: {k['entry']} parameter {p['name']} has offset/size "
                                   f"{p['offset']}/{p['size']}, expected {offset}/{p['size']}")
        offset += p["size"]
    if k["param_bytes"] != offset:
        report.problems.append(f"{where}: {k['entry']} param_bytes {k['param_bytes']} != {offset}")


def _reassemble(d: Path, meta: dict, target: str, t: dict, ptx: str, tc, report: Report) -> None:
    from .ptxas import assemble
    from ..targets import get_target, occupancy
    try:
        _, res, _ = assemble(ptx, target, tc, meta["name"])
    except PtxcError as e:
        report.problems.append(str(e))
        return
    for k in t["kernels"]:
        got = res.get(k["entry"])
        if got is None:
            report.problems.append(f"{meta['name']} [{target}]: ptxas reports no entry {k['entry']}")
            continue
        got = got.to_dict()
        if got["spill_stores"] or got["spill_loads"]:
            report.problems.append(f"{meta['name']} [{target}] {k['entry']}: spills "
                                   f"({got['spill_stores']} B stores, {got['spill_loads']} B loads)")
        if "resources" in k and t.get("ptxas_version") == tc.version and k["resources"] != got:
            report.problems.append(f"{meta['name']} [{target}] {k['entry']}: resources {got} differ "
                                   f"from metadata {k['resources']}")
        threads = k["block"][0] * k["block"][1] * k["block"][2]
        occ = occupancy(get_target(target), threads, got["registers"],
                        k["static_smem_bytes"] + k["dynamic_smem_bytes"])
        report.rows.append({"kernel": meta["name"], "target": target, "entry": k["entry"], **got, **occ})


def verify_output_dir(out: Path, report: Report, tc=None) -> None:
    manifest = read_manifest(out)
    dirs = sorted(p.name for p in out.iterdir() if p.is_dir() and (p / f"{p.name}.json").exists())
    if manifest is None:
        report.problems.append(f"{out / MANIFEST}: missing or not valid JSON")
        listed = {}
    else:
        listed = manifest.get("artifacts") or {}
    for name in sorted(set(listed) - set(dirs)):
        report.problems.append(f"{out / MANIFEST}: lists {name!r}, which is not in {out}")
    for name in sorted(set(dirs) - set(listed)):
        if manifest is not None:
            report.problems.append(f"{out / MANIFEST}: does not list artifact directory {name!r}")
    for name in dirs:
        meta_file = out / name / f"{name}.json"
        if name in listed and sha256(meta_file.read_bytes()) != listed[name].get("metadata_sha256"):
            report.problems.append(f"{meta_file}: sha256 differs from {out / MANIFEST}")
        verify_artifact(out / name, report, tc)


def is_artifact_dir(p: Path) -> bool:
    return p.is_dir() and (p / f"{p.name}.json").is_file()


def is_output_dir(p: Path) -> bool:
    return p.is_dir() and ((p / MANIFEST).is_file() or any(is_artifact_dir(c) for c in p.iterdir()))
