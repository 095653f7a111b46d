"""One read-only view of an artifact set's metadata that every loader emitter (C, Rust, fatbin,
dispatcher) renders from: targets in numeric order, each with its own launch list, the tensors
with their shapes and preconditions, the dim rules, and the variant key of every artifact.

Metadata is read through `ptxc.runtime.load`, the single artifact reader."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..pipeline import exprs
from ..pipeline.checked import read_manifest_checked
from ..pipeline.graph import never_reason
from ..pipeline.metadata import ELEMENT_BYTES
from ..runtime import load, sm_number
from ..runtime.dispatch import key_text, variant_of

def target_order(target: str) -> tuple[int, bool, str]:
    return sm_number(target), target[-1].isalpha(), target


@dataclass(frozen=True)
class KernelView:
    entry: str
    params: tuple          # the metadata param dicts, in ABI order
    param_bytes: int
    grid: tuple            # three launch expressions (str or int)
    block: tuple
    dynamic_smem: int
    needs_opt_in: bool


@dataclass(frozen=True)
class TargetView:
    name: str              # "sm_90"
    sm: int                # 90
    arch_specific: bool    # sm_90a: runs only on exactly that SM, no JIT to others
    ptx: str               # file names in the artifact directory
    cubin: str | None
    fatbin: str | None
    kernels: tuple
    ctas_per_sm: tuple = ()   # (entry, ptxas CTAs per SM) of every launch whose occupancy is recorded
    graph_class: str = "NEVER"      # metadata graph.targets.T.class (vLLM's AttentionCGSupport)
    never_reason: str = ""          # why, when the class is NEVER (ptxc.pipeline.graph.never_reason)
    grid_dims: tuple = ()           # capture dims this target's grids depend on (0: nothing captured)


@dataclass(frozen=True)
class TensorView:
    name: str
    dtype: str
    element_bytes: int
    shape: tuple           # ints and launch expressions over dims
    role: str
    derived_from: str | None
    align_bytes: int
    stride_multiple: int
    strided_axes: tuple


@dataclass(frozen=True)
class ArtifactView:
    name: str
    family: str
    path: Path
    dims: tuple
    dim_rules: dict
    tensors: tuple
    targets: tuple         # numeric order
    variant: tuple         # ((field, value text), ...): ptxc.runtime.dispatch.variant_of
    scalars: tuple = ()    # runtime f32 scalars (k_scale, v_scale): kernel parameters, not dims
    capture_dims: tuple = ()   # metadata graph.capture_dims: fixed at capture-time maxima

    def tensor(self, name: str) -> TensorView:
        return next(t for t in self.tensors if t.name == name)


def artifact_view(path: Path) -> ArtifactView:
    art = load(path)
    meta = art.meta
    targets = []
    for name in sorted(meta["targets"], key=target_order):
        t = meta["targets"][name]
        kernels = tuple(KernelView(k["entry"], tuple(k["params"]), k["param_bytes"], tuple(k["grid"]),
                                   tuple(k["block"]), k["dynamic_smem_bytes"], k["needs_smem_opt_in"])
                        for k in t["kernels"])
        fatbin = (meta.get("fatbin") or {}).get("file")  # one file holding every target's images
        occ = tuple((k["entry"], int(k["occupancy"]["ctas_per_sm"])) for k in t["kernels"] if "occupancy" in k)
        g = meta["graph"]["targets"][name]
        targets.append(TargetView(name, sm_number(name), name[-1].isalpha(), t["ptx"], t.get("cubin"),
                                  fatbin, kernels, occ, g["class"], never_reason(meta["family"], t),
                                  tuple(d for d in g["grid_depends_on"] if d in meta["graph"]["capture_dims"])))
    tensors = []
    for name, t in meta["tensors"].items():
        pre = t.get("preconditions") or {"align_bytes": ELEMENT_BYTES[t["dtype"]], "stride_multiple": 1,
                                          "strided_axes": []}
        tensors.append(TensorView(name, t["dtype"], ELEMENT_BYTES[t["dtype"]], tuple(t["shape"]), t["role"],
                                  t.get("derived_from"), pre["align_bytes"], pre["stride_multiple"],
                                  tuple(pre["strided_axes"])))
    variant = variant_of(meta)
    return ArtifactView(meta["name"], meta["family"], Path(path), tuple(meta["dims"]),
                        dict(meta.get("dim_rules") or {}), tuple(tensors), tuple(targets), variant,
                        tuple(sorted(meta.get("scalars") or {})), tuple(meta["graph"]["capture_dims"]))


def output_view(out_dir: Path) -> list[ArtifactView]:
    """Every artifact the manifest of a `ptxc build` output directory lists, by name."""
    manifest = read_manifest_checked(out_dir)   # names checked before they become paths
    return [artifact_view(out_dir / name) for name in sorted(manifest["artifacts"])]


def expr_code(text, dims, name_fmt: str, int_fmt: str, call_fmt: str) -> str:
    """A launch expression (ptxc/pipeline/exprs.py) as source code of another language."""
    def emit(node) -> str:
        kind = node[0]
        if kind == "int":
            return int_fmt.format(node[1])
        if kind == "name":
            if node[1] not in dims:
                raise UserError(f"launch expression {text!r} names {node[1]!r}, which is not a dim")
            return name_fmt.format(node[1])
        if kind == "call":
            return call_fmt.format(node[1]) + "(" + ", ".join(emit(a) for a in node[2]) + ")"
        return f"({emit(node[1])} {'/' if kind == '//' else kind} {emit(node[2])})"
    return int_fmt.format(text) if isinstance(text, int) else emit(exprs.parse(text))


def ctas_per_sm(a: ArtifactView, t: TargetView, rule: dict) -> int:
    """What ptxc.runtime.rule_ctas_per_sm gives for target `t`: the CTAs per SM of the launch
    an "auto" dim rule names, 1 without one or without a recorded occupancy."""
    entry = rule["auto"].get("occupancy_of")
    return max(1, dict(t.ctas_per_sm).get(entry, 1)) if entry else 1


def rule_code(text: str, name_fmt: str, int_fmt: str, call_fmt: str) -> str:
    """An "auto" dim rule (an expression over ptxc.runtime.AUTO_RULE_NAMES) as source code."""
    from ..runtime import AUTO_RULE_NAMES
    return expr_code(text, AUTO_RULE_NAMES, name_fmt, int_fmt, call_fmt)


def variant_text(variant) -> str:
    return key_text(variant)


def image_facts(a: ArtifactView, t: TargetView) -> list[tuple[int, int]]:
    """(bytes, CRC-32) of the target's PTX, cubin and fatbin files ((0, 0) where none): what a
    loader checks an image against before the driver loads it."""
    facts = []
    for name in (t.ptx, t.cubin, t.fatbin):
        data = (a.path / name).read_bytes() if name else b""
        facts.append((len(data), zlib.crc32(data) if name else 0))
    return facts


# The Python runtime's bound on a dim (runtime.abi): a loader refuses larger values before any
# arithmetic on them
DIM_MAX = 2**31 - 1


def dim_ranges(a: ArtifactView) -> dict[str, tuple[int, int, str]]:
    """Each dim's allowed range when a launch list runs, and a hint for the error: 0..2^31 - 1,
    a rule's fixed value, or an "auto" rule's 1..max (0 must have been resolved first)."""
    out = {}
    for dim in a.dims:
        rule = a.dim_rules.get(dim)
        if rule is None:
            out[dim] = (0, DIM_MAX, "")
        elif "value" in rule:
            out[dim] = (int(rule["value"]), int(rule["value"]), f" (built for {int(rule['value'])})")
        else:
            out[dim] = (1, int(rule["auto"]["max"]), " (0 = auto: resolve_dims first)")
    return out
