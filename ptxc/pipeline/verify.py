"""`ptxc verify`: re-check an artifact set against itself, against its spec and against ptxas.

For each artifact directory, everything `load_checked` checks (ptxc/pipeline/checked.py: regular
files inside the directory, schema, manifest hash, file hashes, parameter ABI, PTX signatures,
and the tensors/dims/config/launch list re-derived from the recorded normalised spec) — every
problem is reported, not just the first. Then ptxas (re-run) must accept every PTX with no
spills and its cubin must equal the recorded one byte for byte. The comparison is made with
the ptxas installed now, whatever the metadata records: when the recorded `ptxas_version`
differs from it, the cubin cannot be byte-compared and verify FAILS, unless the user passes
`--allow-other-ptxas` (then the PTX is still re-assembled and checked for spills and entries, and
the report says which cubins were not compared). An editable field never turns a check off.
A fatbin is checked by checked.py: its images must be exactly the verified cubins and PTX.
For an output directory, the manifest must list exactly the artifact directories present, each
with its metadata's sha256.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import PtxcError
from ..files import sha256
from .artifact_files import read_artifact_file, short
from .checked import MANIFEST, check_artifact, read_manifest_checked


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)              # checks not made, and why
    allow_other_ptxas: bool = False   # --allow-other-ptxas: a recorded ptxas other than ours is a note
    rows: list[dict[str, Any]] = field(default_factory=list)   # one per (kernel, target, entry)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_artifact(d: Path, report: Report, tc=None, manifest: bool = True) -> None:
    try:
        meta, problems = check_artifact(d, manifest=manifest)
    except PtxcError as e:
        report.problems.append(str(e))
        return
    report.problems += problems
    if meta is None or problems or tc is None:
        return
    for target, t in meta["targets"].items():
        ptx = read_artifact_file(d, t["ptx"]).decode("utf-8", "replace")
        cubin = read_artifact_file(d, t["cubin"]) if "cubin" in t else None
        _reassemble(meta, target, t, ptx, cubin, tc, report)


def _reassemble(meta: dict, target: str, t: dict, ptx: str, cubin: bytes | None, tc,
                report: Report) -> None:
    from .ptxas import assemble
    from ..targets import get_target, occupancy
    where = f"{meta['name']} [{target}]"
    try:
        new_cubin, res, _ = assemble(ptx, target, tc, meta["name"])
    except PtxcError as e:
        report.problems.append(str(e))
        return
    same_ptxas = t.get("ptxas_version") == tc.version
    if cubin is not None and not same_ptxas:
        why = (f"{where}: recorded cubin {t['cubin']} was made by ptxas "
               f"{short(t.get('ptxas_version'))}, installed is {tc.version}: it cannot be "
               f"byte-compared")
        if report.allow_other_ptxas:
            report.notes.append(why + " (not compared: --allow-other-ptxas)")
        else:
            report.problems.append(why + " (install that ptxas and set PTXAS=, or pass "
                                   "--allow-other-ptxas to accept an uncompared cubin)")
    if cubin is not None and same_ptxas and new_cubin != cubin:
        report.problems.append(f"{where}: recorded cubin {t['cubin']} is not what ptxas makes of "
                               f"the recorded PTX (sha256 {sha256(cubin)[:16]}... vs {sha256(new_cubin)[:16]}...)")
    entries = sorted(k["entry"] for k in t["kernels"])
    if sorted(res) != entries:
        report.problems.append(f"{where}: ptxas reports entries {sorted(res)}, metadata {entries}")
    for k in t["kernels"]:
        got = res.get(k["entry"])
        if got is None:
            continue
        got = got.to_dict()
        if got["spill_stores"] or got["spill_loads"]:
            report.problems.append(f"{where} {k['entry']}: spills "
                                   f"({got['spill_stores']} B stores, {got['spill_loads']} B loads)")
        if got.get("performance_notes"):
            report.problems.append(f"{where} {k['entry']}: ptxas reports a potential performance "
                                   f"loss ({got['performance_notes']} C75xx note(s))")
        if "resources" in k and same_ptxas and k["resources"] != got:
            report.problems.append(f"{where} {k['entry']}: resources {got} differ "
                                   f"from metadata {k['resources']}")
        threads = k["block"][0] * k["block"][1] * k["block"][2]
        occ = occupancy(get_target(target), threads, got["registers"],
                        k["static_smem_bytes"] + k["dynamic_smem_bytes"], k.get("tmem_columns", 0))
        report.rows.append({"kernel": meta["name"], "target": target, "entry": k["entry"], **got, **occ})


def verify_output_dir(out: Path, report: Report, tc=None) -> None:
    try:
        manifest = read_manifest_checked(out)
        listed = manifest["artifacts"]
    except PtxcError as e:
        report.problems.append(str(e))
        manifest, listed = None, {}
    dirs = []
    for p in sorted(out.iterdir()):
        if p.name.startswith(".") or p.name == MANIFEST:
            continue
        if p.is_symlink():
            report.problems.append(f"{p}: a symlink in the output directory")
        elif is_artifact_dir(p):
            dirs.append(p.name)
    for name in sorted(set(listed) - set(dirs)):
        report.problems.append(f"{out / MANIFEST}: lists {name!r}, which is not in {out}")
    for name in sorted(set(dirs) - set(listed)):
        if manifest is not None:
            report.problems.append(f"{out / MANIFEST}: does not list artifact directory {name!r}")
    for name in dirs:
        if name in listed:
            try:
                raw = read_artifact_file(out / name, f"{name}.json")
                if sha256(raw) != listed[name]["metadata_sha256"]:
                    report.problems.append(f"{out / name / (name + '.json')}: sha256 differs from {out / MANIFEST}")
            except PtxcError as e:
                report.problems.append(str(e))
        verify_artifact(out / name, report, tc, manifest=False)


def is_artifact_dir(p: Path) -> bool:
    return p.is_dir() and (p / f"{p.name}.json").exists()


def is_output_dir(p: Path) -> bool:
    return p.is_dir() and ((p / MANIFEST).exists() or any(is_artifact_dir(c) for c in p.iterdir()))
