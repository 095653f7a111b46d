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
from .cache import sha256
from .compiler import module_ptx_version
from ..kernels import FAMILIES
from ..targets import get_target, occupancy

SCHEMA_VERSION = 1
FILE_SUFFIX = {"ptx": ".ptx", "cubin": ".cubin"}


def dumps(data: Any) -> bytes:
    return (json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n").encode()


def artifact_files(name: str, target: str) -> dict[str, str]:
    return {kind: f"{name}.{target}{suffix}" for kind, suffix in FILE_SUFFIX.items()}


def make_metadata(build, verified: bool) -> dict[str, Any]:
    spec = build.spec
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
                                           launch["static_smem_bytes"] + launch["dynamic_smem_bytes"])
            kernels.append(k)
        entry = {"ptx": files["ptx"], "ptx_sha256": sha256(tb.ptx.encode()),
                 "ptx_version": module_ptx_version(tb.ptx), "config": tb.config, "kernels": kernels}
        if tb.cubin is not None:
            entry.update(cubin=files["cubin"], cubin_sha256=sha256(tb.cubin),
                         ptxas_version=tb.ptxas_version)
        targets[tb.target] = entry
    return {
        "schema_version": SCHEMA_VERSION,
        "ptxc_version": __version__,
        "name": spec.name,
        "family": spec.family,
        "spec": spec.to_dict(),
        "tensors": {t.name: t.to_dict() for t in iface.tensors},
        "dims": list(iface.dims),
        "dim_rules": iface.dim_rules,
        "scalars": iface.scalars,
        "verified": verified,
        "targets": targets,
    }


@lru_cache(maxsize=1)
def schema() -> dict:
    return json.loads((Path(__file__).resolve().parent.parent / "schema" / "metadata.schema.json").read_text())


def schema_errors(meta: Any) -> list[str]:
    """Messages for every way `meta` departs from the JSON Schema (empty when valid)."""
    import jsonschema
    validator = jsonschema.Draft202012Validator(schema())
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
            for e in sorted(validator.iter_errors(meta), key=lambda e: list(map(str, e.absolute_path)))]
