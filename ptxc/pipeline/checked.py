"""Checked loading of artifacts: the one place that decides whether metadata may be used.

Metadata files are input like any other: a crafted or edited `<name>.json` would otherwise make
`run` launch out of bounds, `emit-c-header` paste code into C, and `report` crash. Every consumer
(run, launch-test, inspect, report, emit-*, pack, merge, verify and `ptxc.runtime.load`) goes
through `load_checked`, which accepts an artifact only when all of these hold:

  * the artifact directory is a real directory (not a symlink) named like a kernel, and every
    file read from it is a regular file directly inside it (no symlinks, no `/`, no `..`),
    read with a size cap (so a FIFO or /dev/zero cannot hang or exhaust us);
  * the metadata parses (bounded nesting) and matches the JSON Schema, which restricts every
    name that reaches generated code to an identifier and every expression to the
    launch-expression alphabet; every expression then parses under the bounded grammar and
    names only declared dims;
  * the output directory's manifest lists the artifact with the metadata's sha256;
  * every ptx/cubin file has exactly the name ptxc gives it and the recorded sha256;
  * the parameter ABI is self-consistent and each PTX declares exactly the recorded entries
    and parameters;
  * re-deriving from the recorded normalised spec (validated by the spec rules, and recorded
    in normal form) gives the same tensors, dims, dim rules, scalars, target list, config,
    launch list (grid, block, shared memory and every parameter's source) and PTX (so an edited
    `softmax_scale`, window or any other value compiled into the kernel is refused); `verified`
    agrees with the cubins present, each `occupancy` with its `resources`;
  * a fatbin holds exactly one ELF image per target, byte-identical to that target's (hash-
    checked) cubin, and one PTX image per target equal to its PTX up to comments and
    indentation (which `fatbinary` strips) — nothing else.

Every field of the schema is in TRUST below: re-derived, checked, or not trusted (read only for
display, or checked by `ptxc verify` against ptxas); tests/pipeline/test_hardening_artifacts.py walks the
schema so a new field cannot be added without deciding which.

Anything else is a VerifyError (exit 1) naming the file and the first problem.
"""

from __future__ import annotations

import json
import re
import stat
from pathlib import Path
from typing import Any

from ..errors import PtxcError, SpecError, UserError, VerifyError
from . import exprs
from ..files import sha256
from .artifact_files import fatbin_problems, file_problems, read_artifact_file, short
from .metadata import schema_errors
from ..ir.values import PARAM_ALIGN

MANIFEST = "manifest.json"
MAX_METADATA_BYTES = 16 << 20
ARTIFACT_NAME = re.compile(r"[a-z][a-z0-9_]{0,127}")
PARAM_SIZE = {"u32": 4, "s32": 4, "f32": 4, "u64": 8, "s64": 8, "tmap": 128}

# Every metadata field (a path through the schema; `*` is any key or list index) and why a
# consumer may rely on it. "re-derived": recomputed from the recorded spec (or from other
# checked fields) and compared; "checked": validated against the files or by the schema's own
# constraints; "not trusted": read only for display or by `ptxc verify`, which re-derives it with
# ptxas, and never used to size, launch or skip anything. docs/reliability.md has the table.
TRUST = {
    "schema_version": "checked", "ptxc_version": "not trusted", "name": "re-derived",
    "family": "re-derived", "spec": "re-derived", "tensors": "re-derived", "dims": "re-derived",
    "dim_rules": "re-derived", "scalars": "re-derived", "verified": "re-derived",
    "fatbin.file": "checked", "fatbin.sha256": "checked", "fatbin.fatbinary_version": "not trusted",
    "targets": "re-derived",
    "targets.*.ptx": "checked", "targets.*.ptx_sha256": "re-derived",
    "targets.*.ptx_version": "re-derived", "targets.*.cubin": "checked",
    "targets.*.cubin_sha256": "checked", "targets.*.ptxas_version": "not trusted",
    "targets.*.register_floor": "checked",
    "targets.*.config": "re-derived", "targets.*.kernels": "re-derived",
    "targets.*.kernels.*.entry": "re-derived", "targets.*.kernels.*.params": "re-derived",
    "targets.*.kernels.*.params.*.name": "re-derived", "targets.*.kernels.*.params.*.type": "re-derived",
    "targets.*.kernels.*.params.*.size": "re-derived", "targets.*.kernels.*.params.*.offset": "re-derived",
    "targets.*.kernels.*.params.*.source": "re-derived",
    "targets.*.kernels.*.param_bytes": "re-derived", "targets.*.kernels.*.grid": "re-derived",
    "targets.*.kernels.*.block": "re-derived", "targets.*.kernels.*.dynamic_smem_bytes": "re-derived",
    "targets.*.kernels.*.static_smem_bytes": "re-derived",
    "targets.*.kernels.*.needs_smem_opt_in": "re-derived",
    "targets.*.kernels.*.tmem_columns": "re-derived",
    "targets.*.kernels.*.resources": "not trusted", "targets.*.kernels.*.occupancy": "re-derived",
    "fatbin": "checked", "graph": "re-derived",
    **{f"graph.{k}": "re-derived" for k in ("capture_dims", "per_step_inputs", "targets",
                                             "targets.*.class", "targets.*.grid_depends_on",
                                             "workspaces_rewritten")},
    **{f"targets.*.kernels.*.params.*.source.{k}": "re-derived"
       for k in ("kind", "tensor", "axis", "name", "value", "box", "swizzle")},
    "scalars.*.dtype": "re-derived", "scalars.*.doc": "re-derived",
    **{f"tensors.*.{k}": "re-derived"
       for k in ("shape", "dtype", "role", "doc", "passed_as", "derived_from", "device_resident",
                 "element_access", "prefix_sums", "preconditions", "preconditions.align_bytes",
                 "preconditions.stride_multiple", "preconditions.strided_axes")},
}


def _decode_json(data: bytes, where: Path) -> Any:
    try:     # UTF-8 only, as ptxc writes it (json.loads of bytes would take UTF-16/32 and a BOM)
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise VerifyError(f"{where}: not UTF-8 text (byte {e.start})") from None
    if text.startswith("\ufeff"):
        raise VerifyError(f"{where}: starts with a byte-order mark; ptxc writes plain UTF-8 JSON")
    try:
        return json.loads(text)
    except RecursionError:
        raise VerifyError(f"{where}: not valid JSON (nested too deeply)") from None
    except ValueError as e:
        raise VerifyError(f"{where}: not valid JSON ({str(e)[:100]})") from None


def read_manifest_checked(out: Path) -> dict[str, Any]:
    """The output directory's manifest, with every listed name a valid artifact name and every
    entry well-formed; UserError when there is none, VerifyError when it is malformed."""
    path = out / MANIFEST
    if not path.exists() and not path.is_symlink():
        raise UserError(f"{out}: no {MANIFEST}; expected a `ptxc build` output directory")
    manifest = _decode_json(read_artifact_file(out, MANIFEST, MAX_METADATA_BYTES), path)
    arts = manifest.get("artifacts") if isinstance(manifest, dict) else None
    if not isinstance(arts, dict):
        raise VerifyError(f"{path}: malformed (no 'artifacts' table)")
    for name, e in arts.items():
        if not ARTIFACT_NAME.fullmatch(name):
            raise VerifyError(f"{path}: artifact name {short(name)} is not a kernel name "
                              f"([a-z][a-z0-9_]*)")
        if not (isinstance(e, dict) and e.get("metadata") == f"{name}/{name}.json"
                and isinstance(e.get("metadata_sha256"), str)):
            raise VerifyError(f"{path}: entry {name!r} is malformed (metadata must be "
                              f"'{name}/{name}.json' with its sha256)")
    return manifest


def check_artifact(d: Path, *, manifest: bool = True, rederive: bool = True) -> tuple[dict | None, list[str]]:
    """(metadata, problems) for artifact directory `d`; metadata is None when it could not be
    read or does not match the schema (then nothing else is checked)."""
    d = Path(d)
    try:
        st = d.lstat()
    except OSError:
        raise UserError(f"{d}: no such artifact directory") from None
    if stat.S_ISLNK(st.st_mode):
        return None, [f"{d}: artifact directory is a symlink"]
    if not stat.S_ISDIR(st.st_mode):
        raise UserError(f"{d}: not an artifact directory")
    name = d.resolve().name
    if not ARTIFACT_NAME.fullmatch(name):
        raise UserError(f"{d}: not an artifact directory (name {short(name)} is not a kernel name)")
    meta_path = d / f"{name}.json"
    if not meta_path.exists() and not meta_path.is_symlink():
        raise UserError(f"{d}: not an artifact directory (no {name}.json)")
    try:
        raw = read_artifact_file(d, f"{name}.json", MAX_METADATA_BYTES)
        meta = _decode_json(raw, meta_path)
    except VerifyError as e:
        return None, [str(e)]
    errs = schema_errors(meta)
    if errs:
        more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
        return None, [f"{meta_path}: schema: {errs[0][:200]}{more}"]
    problems: list[str] = []
    if meta["name"] != name:
        problems.append(f"{meta_path}: name {meta['name']!r} does not match directory {name!r}")
    if manifest:
        problems += _manifest_problems(d.resolve().parent, name, raw)
    problems += _reference_problems(meta, meta_path)
    for target, t in meta["targets"].items():
        problems += file_problems(d, name, target, t)
    if "fatbin" in meta and not problems:
        problems += fatbin_problems(d, name, meta["fatbin"], meta["targets"])
    if rederive and not problems:
        problems += _rederive_problems(meta, meta_path)
    return meta, problems


def load_checked(artifact_dir: str | Path, *, manifest: bool = True) -> dict[str, Any]:
    """The validated metadata of an artifact directory, or an error: UserError (exit 2) when
    the path is not an artifact directory at all, VerifyError (exit 1) when it is tampered,
    corrupt or inconsistent. `manifest=False` skips only the manifest-hash check (for an
    output directory being verified as a whole, which checks the manifest itself)."""
    meta, problems = check_artifact(Path(artifact_dir), manifest=manifest)
    if problems:
        more = f" (and {len(problems) - 1} more problems; run `ptxc verify`)" if len(problems) > 1 else ""
        raise VerifyError(f"refusing artifact: {problems[0]}{more}")
    return meta


def _manifest_problems(out: Path, name: str, raw: bytes) -> list[str]:
    try:
        manifest = read_manifest_checked(out)
    except PtxcError as e:
        return [f"cannot check {name}'s metadata hash: {e}"]
    entry = manifest["artifacts"].get(name)
    if entry is None:
        return [f"{out / MANIFEST}: does not list artifact {name!r}"]
    if entry["metadata_sha256"] != sha256(raw):
        return [f"{out / name / (name + '.json')}: sha256 differs from {out / MANIFEST}"]
    return []


def _reference_problems(meta: dict, where: Path) -> list[str]:
    """Every name an expression, shape or parameter uses must be declared; expressions parse."""
    problems = []
    dims, tensors = set(meta["dims"]), meta["tensors"]

    def expr_ok(text, what):
        try:
            unknown = exprs.names(text) - dims
        except PtxcError as e:
            problems.append(f"{where}: {what}: {e}")
            return
        if unknown:
            problems.append(f"{where}: {what} {short(text)} names {sorted(unknown)[0]!r}, not a dim")

    for tname, info in tensors.items():
        for axis, s in enumerate(info["shape"]):
            if isinstance(s, str):
                expr_ok(s, f"tensor {tname} shape[{axis}]")
        for ref in ("passed_as", "derived_from"):
            if ref in info and info[ref] not in tensors:
                problems.append(f"{where}: tensor {tname} {ref} {info[ref]!r} is not a tensor")
    for sname in meta["scalars"]:   # one name, one meaning: a scalar never shadows a dim or tensor
        if sname in dims or sname in tensors:
            problems.append(f"{where}: scalar {sname!r} is also a {'dim' if sname in dims else 'tensor'}")
    for dname, rule in meta["dim_rules"].items():
        if dname not in dims:
            problems.append(f"{where}: dim_rules names {dname!r}, not a dim")
        if "auto" in rule:
            expr_ok(rule["auto"]["ctas"], f"dim_rules.{dname}.ctas")
            try:   # the rule every loader evaluates: an expression over AUTO_RULE_NAMES only
                from .dim_rules import AUTO_RULE_NAMES
                if not exprs.names(rule["auto"]["rule"]) <= set(AUTO_RULE_NAMES):
                    problems.append(f"{where}: dim_rules.{dname}.rule names something other "
                                    f"than {', '.join(AUTO_RULE_NAMES)}")
            except PtxcError as e:
                problems.append(f"{where}: dim_rules.{dname}.rule: {e}")
            entry = rule["auto"].get("occupancy_of")
            for target, t in meta["targets"].items():
                if entry is not None and entry not in {k["entry"] for k in t["kernels"]}:
                    problems.append(f"{where}: dim_rules.{dname}.occupancy_of {entry!r} is not a "
                                    f"launch of {target}")
    for target, t in meta["targets"].items():
        for k in t["kernels"]:
            for i, g in enumerate(k["grid"]):
                expr_ok(g, f"{target} {k['entry']} grid[{i}]")
            offset = 0
            for p in k["params"]:
                src, label = p["source"], f"{target} {k['entry']} parameter {p['name']}"
                if p["size"] != PARAM_SIZE[p["type"]]:
                    problems.append(f"{where}: {label}: size {p['size']} for type {p['type']}")
                align = PARAM_ALIGN.get(p["type"], p["size"])
                offset = -(-offset // align) * align
                if p["offset"] != offset:
                    problems.append(f"{where}: {label}: offset {p['offset']}, expected {offset}")
                offset += p["size"]
                kind = src["kind"]
                if (kind == "tensor_map") != (p["type"] == "tmap"):
                    problems.append(f"{where}: {label}: a tensor_map source needs type tmap and "
                                    f"type tmap a tensor_map source")
                if kind in ("pointer", "workspace", "stride", "tensor_map") and src.get("tensor") not in tensors:
                    problems.append(f"{where}: {label}: source tensor {short(src.get('tensor'))} is not a tensor")
                elif kind == "stride" and not 0 <= src.get("axis", -1) < len(tensors[src["tensor"]]["shape"]):
                    problems.append(f"{where}: {label}: stride axis {short(src.get('axis'))} out of range")
                elif kind == "dim" and src.get("name") not in dims:
                    problems.append(f"{where}: {label}: source dim {short(src.get('name'))} is not a dim")
                elif kind == "tensor_map" and (len(src.get("box", ())) != len(tensors[src["tensor"]]["shape"])
                                               or "swizzle" not in src):
                    problems.append(f"{where}: {label}: box {short(src.get('box'))} needs one size "
                                    f"per axis of {src['tensor']} and a swizzle")
                elif kind == "const" and not isinstance(src.get("value"), (int, float)):
                    problems.append(f"{where}: {label}: const without a value")
                if kind in ("pointer", "workspace") and p["type"] != "u64":
                    problems.append(f"{where}: {label}: a pointer must be u64, not {p['type']}")
            if k["param_bytes"] != offset:
                problems.append(f"{where}: {target} {k['entry']}: param_bytes {k['param_bytes']} != {offset}")
    return problems


def derived_launch_metadata(spec, target: str, register_floor=()) -> dict[str, Any]:
    """What the metadata of `spec` must say for one target, re-derived by lowering it (and
    giving the entries of a recorded `register_floor` their .minnctapersm 1: ValueError when
    the record does not fit the PTX)."""
    from .compiler import lower, module_ptx_version
    from .register_floor_pass import apply_floor
    ptx, launches, config, _ = lower(spec, target)
    if register_floor:
        ptx = apply_floor(ptx, register_floor)
    return {"config": config, "kernels": launches, "ptx_sha256": sha256(ptx.encode()),
            "ptx_version": module_ptx_version(ptx)}


def _differs(where: Path, field: str, recorded: Any, derived: Any) -> str:
    """The one line naming a field whose recorded value is not what the spec gives."""
    if isinstance(recorded, dict) and isinstance(derived, dict) and set(recorded) != set(derived):
        recorded, derived = sorted(recorded), sorted(derived)   # the names say most
    return (f"{where}: {field} differ from what the recorded spec gives "
            f"(recorded {short(recorded, 60)}, derived {short(derived, 60)})")


def _rederive_problems(meta: dict, where: Path) -> list[str]:
    from ..kernels import FAMILIES
    from .metadata import tensor_preconditions
    from ..kernels import spec_from_record
    from ..targets import TARGETS, get_target, occupancy
    try:
        spec = spec_from_record(meta["spec"], f"{where}: spec")
    except SpecError as e:
        return [f"{where}: recorded spec is invalid: {str(e)[:200]}"]
    if (spec.name, spec.family) != (meta["name"], meta["family"]):
        return [f"{where}: spec names {spec.name!r}/{spec.family!r}, metadata {meta['name']!r}/{meta['family']!r}"]
    normal = json.loads(json.dumps(spec.to_dict()))
    if meta["spec"] != normal:   # what consumers read is the normal form the build records
        diff = next(k for k in sorted(set(normal) | set(meta["spec"]))
                    if normal.get(k, "<absent>") != meta["spec"].get(k, "<absent>"))
        return [_differs(where, f"spec.{diff}", meta["spec"].get(diff, "<absent>"), normal.get(diff, "<absent>"))]
    if sorted(meta["targets"]) != sorted(spec.targets):
        return [_differs(where, "targets", sorted(meta["targets"]), sorted(spec.targets))]
    iface = FAMILIES[spec.family].interface(spec)
    tensors = {t.name: t.to_dict() for t in iface.tensors}
    # preconditions follow from the launch lists, which are re-derived and compared below
    for name, tensor in tensors.items():
        tensor["preconditions"] = tensor_preconditions(name, tensor, tensors, meta["targets"])
    derived = {"tensors": tensors, "dims": list(iface.dims), "dim_rules": iface.dim_rules,
               "scalars": iface.scalars}
    problems = [_differs(where, key, meta[key], value)
                for key, value in derived.items() if meta[key] != json.loads(json.dumps(value))]
    cubins = {target: "cubin" in t for target, t in meta["targets"].items()}
    if meta["verified"] != all(cubins.values()) or len(set(cubins.values())) > 1:
        problems.append(f"{where}: verified is {meta['verified']}, but cubins are recorded for "
                        f"{sorted(k for k, v in cubins.items() if v) or 'no target'}")
    for target, t in meta["targets"].items():
        if target not in TARGETS:
            problems.append(f"{where}: unknown target {target!r}")
            continue
        try:
            want = json.loads(json.dumps(derived_launch_metadata(spec, target, t.get("register_floor", ()))))
        except PtxcError as e:
            problems.append(f"{where}: {target}: the recorded spec does not lower: {str(e)[:200]}")
            continue
        except ValueError as e:      # a register_floor the lowered PTX does not take
            problems.append(f"{where}: {target} register_floor does not fit the recorded spec's PTX ({e})")
            continue
        if t["config"] != want["config"]:
            problems.append(_differs(where, f"{target} config", t["config"], want["config"]))
        for key in ("ptx_sha256", "ptx_version"):   # the PTX file matches ptx_sha256 (checked above)
            if t[key] != want[key]:
                problems.append(f"{where}: {target} PTX is not what the recorded spec compiles to "
                                f"({key} recorded {short(t[key], 24)}, derived {short(want[key], 24)}): "
                                f"an edited spec value (softmax_scale, window, ...) or PTX")
        have = [{k: v for k, v in launch.items() if k not in ("resources", "occupancy")}
                for launch in t["kernels"]]
        if have != want["kernels"]:
            problems.append(f"{where}: {target} launch list (grid, block, shared memory or "
                            f"parameters) differs from what the recorded spec gives")
            continue
        for k in t["kernels"]:   # occupancy follows from resources (which verify checks with ptxas)
            if ("resources" in k) != ("occupancy" in k) or ("resources" in k) != cubins[target]:
                problems.append(f"{where}: {target} {k['entry']}: resources and occupancy are "
                                f"recorded exactly when a cubin is")
            elif "resources" in k:
                threads = k["block"][0] * k["block"][1] * k["block"][2]
                occ = occupancy(get_target(target), threads, k["resources"]["registers"],
                                k["static_smem_bytes"] + k["dynamic_smem_bytes"],
                                k.get("tmem_columns", 0))
                if k["occupancy"] != json.loads(json.dumps(occ)):
                    problems.append(_differs(where, f"{target} {k['entry']} occupancy",
                                             k["occupancy"], occ))
    # the graph contract follows from the (just compared) launch lists and the interface
    from .graph import graph_contract
    graph = graph_contract(spec.family, tensors, list(iface.dims), iface.dim_rules, meta["targets"])
    if meta.get("graph") != json.loads(json.dumps(graph)):
        problems.append(f"{where}: graph differs from what the recorded spec gives")
    return problems
