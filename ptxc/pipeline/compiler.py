"""The compilation stages, in order, for one (spec, target):

    spec --family.build--> IR --ir.passes--> IR --render_module--> PTX --ptxas--> cubin + resources
                                                     (spills: the register-floor pass, PTX --ptxas--> again)

Stage 1+2 ("ptx") and stage 3 ("cubin") are cached separately: the PTX entry is keyed by the
spec, target and code-generation sources; the cubin entry by the PTX text itself, the target and
the ptxas version and options — so a ptxc change that leaves the PTX alone reuses the cubin.
Each stage's output is kept: the normalised spec (in the metadata), the .ptx files, the cubins.
"""

from __future__ import annotations

import base64
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from .cache import Cache, canonical_json, make_key
from ..files import sha256
from ..errors import PtxcError
from ..ir import render_module
from ..ir.values import PARAM_ALIGN
from ..ir.passes import run_passes
from ..kernels import FAMILIES
from ..kernels.base import Launch
from .ptxas import Resources, Toolchain, assemble
from .register_floor_pass import apply_floor, floorable, spill_bytes
from ..spec import KernelSpec
from ..targets import DEFAULT_SMEM_PER_CTA, get_target


@dataclass
class TargetBuild:
    target: str
    ptx: str
    launches: list[dict[str, Any]]
    config: dict[str, Any]
    cubin: bytes | None = None
    resources: dict[str, dict] | None = None
    ptxas_version: str | None = None
    cached: dict[str, bool] = field(default_factory=dict)
    # entries given .minnctapersm 1 after ptxas reported spills (pipeline/register_floor_pass.py)
    register_floor: list[str] = field(default_factory=list)


def launch_to_dict(launch: Launch, static_smem: int) -> dict[str, Any]:
    """The exact parameter ABI: each parameter aligned to its own size (a tensor map: 64),
    offsets in bytes."""
    params, offset = [], 0
    for p in launch.params:
        size = p.type.bytes
        align = PARAM_ALIGN.get(p.type.name, size)
        offset = -(-offset // align) * align
        params.append({"name": p.name, "type": p.type.name, "size": size, "offset": offset,
                       "source": p.source.to_dict()})
        offset += size
    smem = static_smem + launch.dynamic_smem_bytes
    return {"entry": launch.entry, "params": params, "param_bytes": offset,
            "grid": list(launch.grid), "block": list(launch.block),
            "dynamic_smem_bytes": launch.dynamic_smem_bytes, "static_smem_bytes": static_smem,
            "needs_smem_opt_in": smem > DEFAULT_SMEM_PER_CTA,
            **({"tmem_columns": launch.tmem_columns} if launch.tmem_columns else {})}


def lower(spec: KernelSpec, target_name: str) -> tuple[str, list[dict], dict, list]:
    """Stages 1-2: spec -> IR -> PTX. Returns (ptx, launches, resolved config, IR entries)."""
    target = get_target(target_name)
    family = FAMILIES[spec.family]
    program = family.build(spec, target)
    entries = run_passes(program.entries)
    ptx = render_module(entries, kernel=spec.name, family=spec.family, target=target.name,
                        ptx_version=program.ptx_version or target.ptx_version,
                        maxntid={l.entry: l.block[0] * l.block[1] * l.block[2] for l in program.launches},
                        minnctapersm={l.entry: l.min_ctas_per_sm for l in program.launches})
    smem = {e.name: e.static_smem_bytes for e in entries}
    launches = [launch_to_dict(l, smem[l.entry]) for l in program.launches]
    return ptx, launches, program.config, entries


def module_ptx_version(ptx: str) -> str:
    """The `.version` a module declares (a family may need a newer one than its target's)."""
    import re
    found = re.search(r"^\.version\s+(\d+\.\d+)", ptx, re.M)
    return found.group(1) if found else ""


def compile_target(spec: KernelSpec, target: str, cache: Cache, tc: Toolchain | None) -> TargetBuild:
    reads_all = FAMILIES[spec.family].ptx_reads_all_targets(spec)
    key = make_key("ptx", {"spec": spec.for_target_key(target, all_targets=reads_all)})
    data = cache.get_json("ptx", key, _ptx_entry_ok)
    if data is not None:
        tb = TargetBuild(target, data["ptx"], data["launches"], data["config"], cached={"ptx": True})
    else:
        ptx, launches, config, _ = lower(spec, target)
        tb = TargetBuild(target, ptx, launches, config, cached={"ptx": False})
        cache.put("ptx", key, canonical_json({"ptx": ptx, "launches": launches, "config": config}))
    if tc is not None:
        _assemble_cached(spec, tb, cache, tc)
        _floor_pass(spec, tb, cache, tc)
    return tb


def _floor_pass(spec: KernelSpec, tb: TargetBuild, cache: Cache, tc: Toolchain) -> None:
    """ptxas spilled entries without a .minnctapersm of their own: assemble again with
    .minnctapersm 1 on them, keep the result when it spills less (register_floor_pass.py)."""
    entries = floorable(tb.ptx, tb.resources)
    if not entries:
        return
    floored = TargetBuild(tb.target, apply_floor(tb.ptx, entries), tb.launches, tb.config)
    _assemble_cached(spec, floored, cache, tc)
    if spill_bytes(floored.resources) < spill_bytes(tb.resources):
        tb.ptx, tb.cubin, tb.resources, tb.register_floor = floored.ptx, floored.cubin, floored.resources, entries
        tb.cached["cubin"] = tb.cached.get("cubin", False) and floored.cached.get("cubin", False)


def _ptx_entry_ok(data: Any) -> bool:
    return (isinstance(data, dict) and isinstance(data.get("ptx"), str)
            and isinstance(data.get("config"), dict) and isinstance(data.get("launches"), list)
            and all(isinstance(l, dict) and isinstance(l.get("entry"), str) for l in data["launches"]))


def _cubin_entry_ok(data: Any, launches: list[dict]) -> bool:
    """A cubin entry must decode and report resources for every entry of the launch list
    (otherwise it belongs to other PTX: discard and reassemble)."""
    if not (isinstance(data, dict) and isinstance(data.get("cubin"), str)
            and isinstance(data.get("resources"), dict)):
        return False
    base64.b64decode(data["cubin"], validate=True)
    return all(isinstance(data["resources"].get(l["entry"]), dict) for l in launches)


def _assemble_cached(spec: KernelSpec, tb: TargetBuild, cache: Cache, tc: Toolchain) -> None:
    key = make_key("cubin", {"ptx_sha256": sha256(tb.ptx.encode()), "target": tb.target,
                             "ptxas": tc.version, "options": list(tc.options)})
    data = cache.get_json("cubin", key, lambda d: _cubin_entry_ok(d, tb.launches))
    if data is not None:
        tb.cubin, tb.resources = base64.b64decode(data["cubin"]), data["resources"]
        tb.cached["cubin"] = True
    else:
        cubin, res, _ = assemble(tb.ptx, tb.target, tc, spec.name)
        tb.cubin = cubin
        tb.resources = {name: r.to_dict() for name, r in sorted(res.items())}
        tb.cached["cubin"] = False
        cache.put("cubin", key, canonical_json({"cubin": base64.b64encode(cubin).decode(),
                                                "resources": tb.resources}))
    tb.ptxas_version = tc.version
    missing = [l["entry"] for l in tb.launches if l["entry"] not in tb.resources]
    if missing:
        raise PtxcError(f"{spec.name} [{tb.target}]: ptxas reported no resources for {missing}")


@dataclass
class KernelBuild:
    spec: KernelSpec
    targets: list[TargetBuild]


def build_all(specs: list[KernelSpec], cache: Cache, tc: Toolchain | None, jobs: int | None = None,
              target_override: list[str] | None = None,
              on_done: Callable[[KernelSpec, str], None] | None = None) -> list[KernelBuild]:
    """Compile every (spec, target) pair, in parallel; results keep the input order."""
    jobs = jobs or os.cpu_count() or 1
    work = [(s, t) for s in specs for t in (target_override or s.targets)]

    def one(item):
        s, t = item
        result = compile_target(s, t, cache, tc)
        if on_done:
            on_done(s, t)
        return result

    if jobs == 1 or len(work) <= 1:
        results = [one(w) for w in work]
    else:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            results = list(pool.map(one, work))
    builds, i = [], 0
    for s in specs:
        n = len(target_override or s.targets)
        builds.append(KernelBuild(s, results[i:i + n]))
        i += n
    return builds


def check_resources(spec: KernelSpec, tb: TargetBuild) -> list[str]:
    """Problems a user must hear about even when ptxas succeeded: spills, ptxas's
    performance-loss notes, local stacks, and a launch whose shared memory the target cannot
    give one CTA (ptxas does not see dynamic shared memory; the launch would fail there)."""
    problems = []
    limit = get_target(tb.target).max_smem_per_cta
    for launch in tb.launches:
        need = launch["static_smem_bytes"] + launch["dynamic_smem_bytes"]
        if need > limit:
            problems.append(f"{spec.name} [{tb.target}] {launch['entry']}: needs {need} bytes of "
                            f"shared memory per CTA; {tb.target} allows {limit}")
    for entry, r in (tb.resources or {}).items():
        res = Resources(**r)
        if res.spill_stores or res.spill_loads:
            problems.append(f"{spec.name} [{tb.target}] {entry}: {res.spill_stores} bytes spill "
                            f"stores, {res.spill_loads} bytes spill loads")
        if res.performance_notes:
            problems.append(f"{spec.name} [{tb.target}] {entry}: ptxas reports a potential "
                            f"performance loss ({res.performance_notes} C75xx note(s): wgmma "
                            f"serialised, setmaxnreg ignored, ...; `ptxas -v` on the PTX names it)")
    return problems
