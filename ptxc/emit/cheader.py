"""`ptxc emit-c-header`: a self-contained C header for an artifact set (params structs that are
the exact parameter buffers, grid helpers from the launch expressions, driver-API launchers)."""

from __future__ import annotations

from pathlib import Path

from .. import __version__
from ..pipeline import exprs
from ..pipeline.checked import read_manifest_checked
from ..pipeline.cache import write_if_changed
from ..errors import UserError
from ..runtime import load

CTYPES = {"u32": "uint32_t", "s32": "int32_t", "u64": "uint64_t", "s64": "int64_t", "f32": "float"}


def c_expr(text: str | int, dims: list[str]) -> str:
    """A launch expression as C over the dims struct `d`."""
    def emit(node) -> str:
        kind = node[0]
        if kind == "int":
            return str(node[1])
        if kind == "name":
            if node[1] not in dims:
                raise UserError(f"launch expression {text!r} names {node[1]!r}, which is not a dim")
            return f"d->{node[1]}"
        if kind == "call":
            return f"ptxc_{node[1]}(" + ", ".join(emit(a) for a in node[2]) + ")"
        return f"({emit(node[1])} {'/' if kind == '//' else kind} {emit(node[2])})"
    return str(text) if isinstance(text, int) else emit(exprs.parse(text))


def _doc(source: dict) -> str:
    kind = source["kind"]
    return {"pointer": f"device address of {source.get('tensor')}",
            "stride": f"{source.get('tensor')} stride along axis {source.get('axis')}, in elements",
            "dim": f"runtime dim {source.get('name')}",
            "scalar": f"runtime scalar {source.get('name')} (f32)",
            "const": f"constant {source.get('value')}"}.get(kind, kind)


def render(out_dir: Path) -> str:
    # Only checked metadata reaches the template: names are identifiers (schema) and every
    # expression parsed (c_expr below), so nothing from the JSON can inject C.
    manifest = read_manifest_checked(out_dir)
    artifacts = []
    for name in sorted(manifest["artifacts"]):
        art = load(out_dir / name)
        meta, dims = art.meta, art.meta["dims"]
        _, first = art.target()
        kernels = []
        for k in first["kernels"]:
            width = max(len(p["name"]) for p in k["params"]) if k["params"] else 0
            kernels.append({
                "entry": k["entry"], "cname": k["entry"].removeprefix("ptxc_"),
                "macro": k["entry"].removeprefix("ptxc_").upper(), "param_bytes": k["param_bytes"],
                "dynamic_smem": k["dynamic_smem_bytes"], "needs_opt_in": k["needs_smem_opt_in"],
                "grid": [c_expr(g, dims) for g in k["grid"]], "block": k["block"],
                "params": [{"name": p["name"], "ctype": CTYPES[p["type"]], "offset": p["offset"],
                            "pad": width + 8 - len(p["name"]) - len(CTYPES[p["type"]]), "doc": _doc(p["source"])} for p in k["params"]]})
        artifacts.append({
            "name": name, "family": meta["family"], "dims": dims, "kernels": kernels,
            "targets": [{"name": t, "ptx": f"{name}/{v['ptx']}", "cubin": f"{name}/{v['cubin']}" if "cubin" in v else None}
                        for t, v in sorted(meta["targets"].items())],
            "tensors": [{"name": t, "dtype": v["dtype"], "shape": ", ".join(map(str, v["shape"])),
                         "role": v["role"]} for t, v in meta["tensors"].items()]})
    import jinja2
    env = jinja2.Environment(loader=jinja2.PackageLoader("ptxc", "templates"), keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined, autoescape=False)
    return env.get_template("kernels.h.j2").render(
        version=__version__, manifest_name="manifest.json", artifacts=artifacts, guard="PTXC_KERNELS_H")


def emit(out_dir: Path, dest: Path | None = None) -> Path:
    dest = dest or out_dir / "ptxc_kernels.h"
    write_if_changed(dest, render(out_dir).encode())
    return dest
