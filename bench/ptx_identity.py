"""The PTX byte-identity check: every example spec x target x tile/load variant, lowered to PTX
(no ptxas), one sha256 each.

    python bench/ptx_identity.py record FILE     # write {combination: sha256}
    python bench/ptx_identity.py compare FILE    # exit 1 and list every combination that differs

A refactor that must not change code generation records before and compares after each step.
A combination the spec refuses (e.g. warp_specialize where no TMA kernel applies) is recorded as
"refused: <message>", so a change in what is accepted shows up too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ptxc.errors import PtxcError  # noqa: E402
from ptxc.kernels import FAMILIES  # noqa: E402
from ptxc.pipeline.compiler import lower  # noqa: E402
from ptxc.kernels import load_paths  # noqa: E402

TARGETS = ("sm_80", "sm_89", "sm_90", "sm_90a", "sm_100", "sm_100a", "sm_120")
# tile variants applied on top of each spec's own tile: the sm_90a prefill / varlen load
# methods, and on sm_90a and sm_100a both sides of warp_specialize
VARIANTS = {
    "default": {},
    "cp_async": {"kv_loads": "cp_async"},
    "tma": {"kv_loads": "tma"},
    "ws": {"warp_specialize": True},
    "one": {"warp_specialize": False},
}
VARIANT_TARGETS = {"cp_async": ("sm_90a",), "tma": ("sm_90a",), "ws": ("sm_90a", "sm_100a"),
                   "one": ("sm_90a", "sm_100a")}


def combinations():
    specs = load_paths(sorted(str(p) for p in (ROOT / "specs").glob("*.toml")))
    specs += load_paths(sorted(str(p) for p in (ROOT / "bench" / "specs").glob("*.toml")))
    for spec in specs:
        for target in TARGETS:
            for vname, extra in VARIANTS.items():
                if extra and (spec.family not in ("prefill", "varlen")
                              or target not in VARIANT_TARGETS[vname]):
                    continue
                tile = dict(spec.tile)
                tile.update(extra)
                s2 = dataclasses.replace(spec, targets=(target,), tile=tuple(sorted(tile.items())))
                yield f"{spec.name}/{target}/{vname}", s2, target


def digest() -> dict[str, str]:
    out = {}
    for key, spec, target in combinations():
        try:
            FAMILIES[spec.family].validate(spec)
            ptx = lower(spec, target)[0]
            out[key] = hashlib.sha256(ptx.encode()).hexdigest()
        except PtxcError as e:
            out[key] = f"refused: {e}"
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("record", "compare"):
        print(__doc__, file=sys.stderr)
        return 2
    mode, path = argv
    now = digest()
    if mode == "record":
        Path(path).write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
        print(f"recorded {len(now)} combinations "
              f"({sum(not v.startswith('refused') for v in now.values())} lowered) to {path}")
        return 0
    before = json.loads(Path(path).read_text())
    changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
    for k in changed:
        print(f"differs: {k}: {before.get(k, 'absent')[:60]} -> {now.get(k, 'absent')[:60]}")
    print(f"{len(now)} combinations, {len(changed)} differ")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
