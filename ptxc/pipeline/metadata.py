"""Launch metadata (`<name>.json`) and the output directory's `manifest.json`.

Both are plain JSON with sorted keys and no timestamps, absolute paths or host names, so the
same spec and ptxc version give byte-identical files. docs/metadata.md documents every field;
ptxc/schema/metadata.schema.json is the machine-checkable form.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from .. import __version__
from ..files import sha256
from ..targets import get_target, occupancy

SCHEMA_VERSION = 1
FILE_SUFFIX = {"ptx": ".ptx", "cubin": ".cubin"}


def dumps(data: Any) -> bytes:
    return (json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n").encode()


def artifact_files(name: str, target: str) -> dict[str, str]:
    return {kind: f"{name}.{target}{suffix}" for kind, suffix in FILE_SUFFIX.items()}


def make_metadata(build, verified: bool, fatbin: dict | None = None) -> dict[str, Any]:
    spec = build.spec
    # the kernel families load here, at call time: the runtime imports this module for its
    # tables (ELEMENT_BYTES, schema checks) and must not load the compiler or any kernel
    from ..kernels import FAMILIES
    from .compiler import module_ptx_version

    iface = FAMILIES[spec.family].interface(spec)
    targets = {}
    for tb in build.targets:
        files = artifact_files(spec.name, tb.target)
        target = get_target(tb.target)
        kernels = []
        for launch in tb.launches:
            k = dict(launch)
            if tb.resources is not None:
                res = tb.resources[launch["entry"]]
                k["resources"] = res
                threads = launch["block"][0] * launch["block"][1] * launch["block"][2]
                k["occupancy"] = occupancy(target, threads, res["registers"],
                                           launch["static_smem_bytes"] + launch["dynamic_smem_bytes"],
                                           launch.get("tmem_columns", 0))
            kernels.append(k)
        entry = {"ptx": files["ptx"], "ptx_sha256": sha256(tb.ptx.encode()),
                 "ptx_version": module_ptx_version(tb.ptx), "config": tb.config, "kernels": kernels}
        if tb.cubin is not None:
            entry.update(cubin=files["cubin"], cubin_sha256=sha256(tb.cubin),
                         ptxas_version=tb.ptxas_version)
        if tb.register_floor:    # entries the register-floor pass gave .minnctapersm 1
            entry["register_floor"] = list(tb.register_floor)
        targets[tb.target] = entry
    tensors = {t.name: t.to_dict() for t in iface.tensors}
    for name, t in tensors.items():
        t["preconditions"] = tensor_preconditions(name, t, tensors, targets)
    meta = {
        "schema_version": SCHEMA_VERSION,
        "ptxc_version": __version__,
        "name": spec.name,
        "family": spec.family,
        "spec": spec.to_dict(),
        "tensors": tensors,
        "dims": list(iface.dims),
        "dim_rules": iface.dim_rules,
        "scalars": iface.scalars,
        "verified": verified,
        "targets": targets,
    }
    from .graph import graph_contract
    meta["graph"] = graph_contract(spec.family, tensors, meta["dims"], iface.dim_rules, targets)
    if fatbin is not None:
        meta["fatbin"] = fatbin
    return meta


ELEMENT_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "i32": 4, "i64": 8, "u64": 8, "e4m3": 1, "e5m2": 1, "u8": 1}   # every tensor dtype
VECTOR_BYTES = 16  # the kernels move whole rows with 16-byte vector loads/stores and cp.async


def tensor_preconditions(name: str, tensor: dict, tensors: dict, targets: dict) -> dict:
    """What a launcher must guarantee about a tensor's address and strides.

    Rows (the innermost axis) that are whole 16-byte vectors are moved with 16-byte vector
    accesses, so the base address must be 16-byte aligned and every free stride a whole number
    of vectors; other tensors need natural alignment. An axis is free (any stride) only when
    every launch that reaches the tensor takes that axis's stride as a parameter; every other
    axis, the innermost included, must have the packed stride (product of the inner sizes).
    A tensor with `element_access` is read and written element by element: natural alignment."""
    size = ELEMENT_BYTES[tensor["dtype"]]
    row = tensor["shape"][-1] if tensor["shape"] else 1
    vector = isinstance(row, int) and tensor["dtype"] != "u64" and (row * size) % VECTOR_BYTES == 0 \
        and not tensor.get("element_access")
    handles = {name} | {n for n, t in tensors.items() if t.get("derived_from") == name}
    free: set[int] | None = None
    for t in targets.values():
        for k in t["kernels"]:
            sources = [p["source"] for p in k["params"]]
            if not any(s.get("tensor") in handles and s["kind"] in ("pointer", "workspace") for s in sources):
                continue
            axes = {s["axis"] for s in sources if s["kind"] == "stride" and s.get("tensor") == name}
            free = axes if free is None else free & axes
    if tensor.get("passed_as") and free is not None:
        free |= {0}  # reached through per-row pointers: rows may lie anywhere
    return {"align_bytes": VECTOR_BYTES if vector else size,
            "stride_multiple": VECTOR_BYTES // size if vector else 1,
            "strided_axes": sorted(free or ())}


@lru_cache(maxsize=1)
def schema() -> dict:
    return json.loads((Path(__file__).resolve().parent.parent / "schema" / "metadata.schema.json").read_text())


def schema_errors(meta: Any) -> list[str]:
    """Messages for every way `meta` departs from the JSON Schema (empty when valid)."""
    import jsonschema
    validator = jsonschema.Draft202012Validator(schema())
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
            for e in sorted(validator.iter_errors(meta), key=lambda e: list(map(str, e.absolute_path)))]
