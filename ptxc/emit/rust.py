"""`ptxc emit-rust OUT_DIR [-o PATH]`: a self-contained Rust module for an artifact set — raw
`extern "C"` declarations of the driver calls it uses, every image embedded with include_bytes!,
and per artifact a `Kernel` (image picked at load time, shared-memory opt-in once) and a typed
`launch_<artifact>` that does what the C loader does. Fixed code lives in templates/loaders.rs.j2."""

from __future__ import annotations

import os
from pathlib import Path

from .. import __version__
from ..errors import UserError
from ..pipeline.artifacts import MANIFEST
from ..runtime.dispatch import variant_keys
from ..files import write_if_changed
from .view import (ArtifactView, KernelView, TargetView, ctas_per_sm, dim_ranges, expr_code, image_facts, output_view,
                   rule_code, variant_text)

SIGNED = {"u32": "false", "s32": "true", "u64": "false", "s64": "true"}


def rs_expr(text, dims) -> str:
    return expr_code(text, dims, "d.{}", "{}i64", "ptxc_{}")


def rs_string(text: str) -> str:
    if any(c in text for c in '"\\\n') or not text.isascii():
        raise UserError(f"{text!r}: cannot be embedded in the Rust module (quote, backslash or non-ASCII)")
    return f'"{text}"'


TMAP_DTYPE = {"f16": 6, "bf16": 9, "f32": 7, "i32": 3, "i64": 5, "u64": 4, "e4m3": 0, "e5m2": 0, "u8": 0}  # CU_TENSOR_MAP_DATA_TYPE_*
TMAP_SWIZZLE = {0: 0, 32: 1, 64: 2, 128: 3}                                                # CU_TENSOR_MAP_SWIZZLE_*


def _tensor_map_line(a: ArtifactView, k: KernelView, p: dict) -> str:
    """Encode a tensor_map parameter (put_tensor_map) from the tensor's pointer, strides and
    shape (its dims evaluated over `d`); the enums as cuda.h numbers them."""
    src = p["source"]
    t = a.tensor(src["tensor"])
    shape = ", ".join(rs_expr(s, a.dims) if isinstance(s, str) else f"{int(s)}i64" for s in t.shape)
    box = ", ".join(f"{int(b)}u32" for b in src["box"])
    return (f"    put_tensor_map(&mut p, {p['offset']}, t.{t.name}.ptr, &t.{t.name}.strides, &[{shape}], "
            f"{t.element_bytes}, {TMAP_DTYPE[t.dtype]}, &[{box}], {TMAP_SWIZZLE[src['swizzle']]}, "
            f"{rs_string(k.entry)}, {rs_string(p['name'])})?;")


def _param_line(k: KernelView, p: dict, a: ArtifactView | None = None) -> str:
    src, kind = p["source"], p["source"]["kind"]
    if kind == "tensor_map":
        return _tensor_map_line(a, k, p)
    if p["type"] == "f32":
        value = f"{float(src['value'])!r}f32" if kind == "const" else f"d.{src['name']} as f32"
        return f"    p[{p['offset']}..{p['offset'] + 4}].copy_from_slice(&({value}).to_le_bytes());"
    if kind in ("pointer", "workspace"):
        value = f"t.{src['tensor']}.ptr as i64"
    elif kind == "stride":
        value = f"t.{src['tensor']}.strides[{src['axis']}]"
    elif kind == "dim":
        value = f"d.{src['name']}"
    elif kind == "const":
        value = f"{int(src['value'])}i64"
    else:
        raise UserError(f"{k.entry}: parameter {p['name']} has unknown source {kind!r}")
    return (f"    put(&mut p, {p['offset']}, {value}, {p['size']}, {SIGNED[p['type']]}, "
            f"{rs_string(k.entry)}, {rs_string(p['name'])})?;")


def _launch_fn(a: ArtifactView, t: TargetView, i: int, k: KernelView) -> str:
    lines = [f"    /// {t.name} launch {i}: {k.entry}, block {list(k.block)}, {k.dynamic_smem} B dynamic shared memory",
             f"    fn {t.name}_launch{i}(f: CUfunction, d: &Dims, t: &Tensors, stream: CUstream, dry: bool) -> Result<(), Error> {{",
             f"        let mut p = [0u8; {k.param_bytes}];"]
    lines += ["    " + _param_line(k, p, a) for p in k.params]
    lines.append("        let grid = [" + ", ".join(rs_expr(g, a.dims) for g in k.grid) + "];")
    lines.append(f"        launch(f, {rs_string(k.entry)}, grid, [{', '.join(f'{b}u32' for b in k.block)}], "
                 f"{k.dynamic_smem}, &mut p, stream, dry)")
    return "\n".join(lines) + "\n    }\n"


def _include(path: Path, base: Path) -> str:
    return rs_string(os.path.relpath(path.resolve(), base).replace(os.sep, "/"))


def _targets(a: ArtifactView, base: Path) -> list[str]:
    out = []
    for t in a.targets:
        tag = t.name.upper()
        out.append(f"    const {tag}_PTX: &[u8] = concat!(include_str!({_include(a.path / t.ptx, base)}), \"\\0\").as_bytes();")
        for kind, name in (("CUBIN", t.cubin), ("FATBIN", t.fatbin)):
            if name:
                out.append(f"    const {tag}_{kind}: &Aligned<[u8]> = &Aligned(*include_bytes!({_include(a.path / name, base)}));")
    rows = []
    for t in a.targets:
        tag = t.name.upper()
        cubin = f"Some(&{tag}_CUBIN.0)" if t.cubin else "None"
        fatbin = f"Some(&{tag}_FATBIN.0)" if t.fatbin else "None"
        images = ", ".join(f"({n}, {c:#010x})" for n, c in image_facts(a, t))
        rows.append(f"        Target {{ name: {rs_string(t.name)}, sm: {t.sm}, arch_specific: {str(t.arch_specific).lower()}, "
                    f"ptx: {tag}_PTX, cubin: {cubin}, fatbin: {fatbin}, images: [{images}] }},")
        entries = ", ".join(f"({rs_string(k.entry)}, {k.dynamic_smem}, {str(k.needs_opt_in).lower()})" for k in t.kernels)
        out.append(f"    const ENTRIES_{tag}: [(&str, u32, bool); {len(t.kernels)}] = [{entries}];")
    out.append(f"    /// Targets in numeric order.\n    pub static TARGETS: [Target; {len(a.targets)}] = [\n"
               + "\n".join(rows) + "\n    ];")
    return out


def _helpers(a: ArtifactView) -> list[str]:
    out = []
    for t in a.tensors:
        out.append(f"    pub fn shape_{t.name}(d: &Dims) -> [i64; {len(t.shape)}] {{ "
                   f"[{', '.join(rs_expr(s, a.dims) for s in t.shape)}] }}")
        out.append(f"    pub fn bytes_{t.name}(d: &Dims) -> usize {{ "
                   f"shape_{t.name}(d).iter().map(|&s| s.max(0)).product::<i64>() as usize * {t.element_bytes} }}")
    for t in a.tensors:
        if t.derived_from:
            src = a.tensor(t.derived_from)
            out.append(f"    /// {t.name}: entry b = device address of {src.name}[b] when {src.name} is one tensor; copy\n"
                       f"    /// it to `{t.name}.ptr`. (Rows in separate allocations: build it yourself, 16-byte aligned.)\n"
                       f"    pub fn row_pointers_{t.name}(t: &Tensors, d: &Dims) -> Vec<u64> {{\n"
                       f"        (0..shape_{t.name}(d)[0].max(0)).map(|b| t.{src.name}.ptr + (b * t.{src.name}.strides[0] * "
                       f"{src.element_bytes}) as u64).collect()\n    }}")
    work = [t for t in a.tensors if t.role == "workspace"]
    out.append("    /// Bytes of one allocation holding every workspace tensor, each 256-byte aligned.\n"
               "    pub fn workspace_bytes(d: &Dims) -> usize {\n        0"
               + "".join(f" + ((bytes_{w.name}(d) + 255) & !255)" for w in work) + "\n    }")
    out.append("    pub fn bind_workspace(t: &mut Tensors, base: CUdeviceptr, d: &Dims) {\n        let mut base = base;\n"
               + "".join(f"        t.{w.name}.ptr = base;\n        base += ((bytes_{w.name}(d) + 255) & !255) as u64;\n"
                         for w in work) + "    }")
    out.append("    /// Packed (C-order) strides for every tensor.\n    pub fn packed_strides(t: &mut Tensors, d: &Dims) {\n"
               + "".join(f"        packed(&mut t.{t.name}, &shape_{t.name}(d));\n" for t in a.tensors) + "    }")
    rules = []
    for name, rule in sorted(a.dim_rules.items()):
        if "value" in rule:
            rules.append(f"        d.{name} = {int(rule['value'])};")
        else:   # the metadata's rule over AUTO_RULE_NAMES (ptxc.runtime.apply_dim_rule)
            auto = rule["auto"]
            per_target = ", ".join(f"{ctas_per_sm(a, t, rule)}i64" for t in a.targets)
            rules.append(f"        if d.{name} == 0 {{  // auto: {auto['rule']}\n"
                         f"            // CTAs per SM of {auto.get('occupancy_of', 'the launch')} on each target\n"
                         f"            const CTAS_PER_SM: [i64; {len(a.targets)}] = [{per_target}];\n"
                         f"            let rule_max = {int(auto['max'])}i64;\n"
                         f"            let rule_num_sms = ptxc_max(1, num_sms as i64);\n"
                         f"            let rule_ctas = ptxc_max(1, {rs_expr(auto['ctas'], a.dims)});\n"
                         f"            let rule_ctas_per_sm = CTAS_PER_SM.get(target).copied().unwrap_or(1);\n"
                         f"            d.{name} = ptxc_min(rule_max, ptxc_max(1, "
                         f"{rule_code(auto['rule'], 'rule_{}', '{}i64', 'ptxc_{}')}));\n"
                         "        }")
    negative = "".join(f"        if d.{dim} < 0 {{ return fail(CUDA_ERROR_INVALID_VALUE, "
                       f"\"{a.name}: dim {dim} is negative\".into()); }}\n" for dim in a.dims)
    given = "".join(f"        check_dim(NAME, {rs_string(dim)}, d.{dim}, {lo}, {hi}, \"\")?;\n"
                    for dim, (lo, hi, _) in dim_ranges(a).items() if dim not in a.dim_rules)
    out.append("    /// Dims no tensor shape determines (0 = auto) for the target at index `target` (see\n"
               "    /// Kernel::resolve_dims), after a check that the given ones lie in 0 .. 2^31 - 1 (before\n"
               "    /// any arithmetic on them), and a check that every dim is >= 0.\n"
               "    pub fn resolve_dims(d: &mut Dims, num_sms: i32, target: usize) -> Result<(), Error> {\n"
               + given + "\n".join(rules + [""]) + negative + "        let _ = (num_sms, target);\n        Ok(())\n    }")
    from .cheader import passed_tensors
    passed = passed_tensors(a)
    checks = "".join(f"        check_tensor(NAME, {rs_string(t.name)}, &t.{t.name}, &shape_{t.name}(d), {t.align_bytes}, "
                     f"{t.stride_multiple}, &{list(t.strided_axes)})?;\n" for t in a.tensors if t.name in passed)
    dims = "".join(f"        check_dim(NAME, {rs_string(dim)}, d.{dim}, {lo}, {hi}, {rs_string(hint)})?;\n"
                   for dim, (lo, hi, hint) in dim_ranges(a).items())
    out.append("    /// The metadata's preconditions: dims in range (rules resolved), tensors non-null, aligned,\n"
               "    /// packed/free strides.\n"
               "    pub fn check(d: &Dims, t: &Tensors) -> Result<(), Error> {\n" + dims + checks + "        Ok(())\n    }")
    return out


def _graph_dims(a: ArtifactView) -> str:
    """CUDA graphs: each target's class, and the dims at capture-time maxima (as the C loader's
    ptxc_<a>_graph_dims)."""
    arms = []
    for ti, t in enumerate(a.targets):
        if t.graph_class == "NEVER":
            arms.append(f"            {ti} => fail(CUDA_ERROR_NOT_SUPPORTED, "
                        f"\"{a.name} [{t.name}]: cannot be captured in a CUDA graph (class NEVER: {t.never_reason})\".into()),")
        else:
            checks = "".join(f"                if max.{dim} <= 0 {{ return fail(CUDA_ERROR_INVALID_VALUE, "
                             f"\"{a.name}: maximum {dim} is not positive; capture at the step maxima\".into()); }}\n"
                             for dim in t.grid_dims)
            arms.append(f"            {ti} => {{\n{checks}                Ok(())\n            }}")
    classes = ", ".join(rs_string(t.graph_class) for t in a.targets)
    capture = ", ".join(a.capture_dims) or "none"
    return (f"    /// CUDA graphs: each target's class (metadata graph.targets.T.class, vLLM's AttentionCGSupport).\n"
            f"    pub static GRAPH_CLASS: [&str; {len(a.targets)}] = [{classes}];\n"
            f"    /// The dims of the launch list captured at `max`: every capture dim ({capture}) at its\n"
            f"    /// capture-time maximum, \"auto\" dims (0) resolved from the maxima. Refuses a target whose\n"
            f"    /// graph class is NEVER and a maximum a grid depends on that is not positive.\n"
            f"    pub fn graph_dims(max: &Dims, num_sms: i32, target: usize) -> Result<Dims, Error> {{\n"
            f"        let () = match target {{\n" + "\n".join(arms) + "\n"
            f"            _ => fail(CUDA_ERROR_NOT_INITIALIZED, format!(\"{{}}: not loaded\", NAME)),\n"
            f"        }}?;\n        let mut d = *max;\n        resolve_dims(&mut d, num_sms, target)?;\n        Ok(d)\n    }}")


def render_artifact(a: ArtifactView, base: Path) -> str:
    out = [f"/// {a.name} ({a.family}): {variant_text(a.variant)}", f"pub mod {a.name} {{", "    use super::*;",
           f"    pub const NAME: &str = {rs_string(a.name)};"]
    out += _targets(a, base)
    eq = "" if a.scalars else ", Eq"   # f32 runtime scalars are not Eq
    out.append(f"    #[derive(Debug, Clone, Copy, Default, PartialEq{eq})]\n    pub struct Dims {{\n"
               + "".join(f"        pub {d}: i64,\n" for d in a.dims)
               + "".join(f"        /// runtime scalar\n        pub {s}: f32,\n" for s in a.scalars) + "    }")
    out.append("    #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]\n    pub struct Tensors {\n"
               + "".join(f"        /// {t.dtype} [{', '.join(map(str, t.shape))}] {t.role}\n        pub {t.name}: Tensor,\n"
                         for t in a.tensors) + "    }")
    out += _helpers(a)
    out.append(_graph_dims(a))
    for t in a.targets:
        for i, k in enumerate(t.kernels):
            out.append(_launch_fn(a, t, i, k))
    entries = "".join(f"                {i} => &ENTRIES_{t.name.upper()},\n" for i, t in enumerate(a.targets))
    runs = "".join(f"                {ti} => {{\n" + "".join(f"                    {t.name}_launch{i}(f[{i}], d, t, stream, dry)?;\n"
                                                            for i in range(len(t.kernels))) + "                }\n"
                   for ti, t in enumerate(a.targets))
    out.append(f"""    pub struct Kernel {{
        pub loaded: Loaded,
    }}

    impl Kernel {{
        /// Load the image for `device`'s SM (see pick_target).
        pub fn load(device: CUdevice) -> Result<Kernel, Error> {{
            let (index, kind, image) = pick_target(NAME, &TARGETS, device_sm(device)?)?;
            Self::load_target(index, kind, image)
        }}

        /// Load a given image (e.g. read at run time) as the module of TARGETS[index].
        pub fn load_target(index: usize, kind: &'static str, image: &[u8]) -> Result<Kernel, Error> {{
            let entries: &[(&str, u32, bool)] = match index {{
{entries}                _ => return fail(CUDA_ERROR_INVALID_VALUE, format!("{{}}: no target index {{}}", NAME, index)),
            }};
            Ok(Kernel {{ loaded: load_image(NAME, &TARGETS[index], index, kind, image, entries)? }})
        }}

        pub fn target(&self) -> &'static str {{ TARGETS[self.loaded.target].name }}

        /// resolve_dims for the loaded target ("auto" rules use its occupancy).
        pub fn resolve_dims(&self, d: &mut Dims, num_sms: i32) -> Result<(), Error> {{
            resolve_dims(d, num_sms, self.loaded.target)
        }}

        /// CUDA graphs: the dims of the launch list captured at `max` (graph_dims for the loaded
        /// target).
        pub fn graph_dims(&self, max: &Dims, num_sms: i32) -> Result<Dims, Error> {{
            graph_dims(max, num_sms, self.loaded.target)
        }}

        /// The capture-safe launch: graph_dims, then the launch list at those dims. No driver call
        /// but cuLaunchKernel (no allocation, copy or synchronisation), so it runs inside
        /// cuStreamBeginCapture; every step under the same maxima enqueues the same launches.
        pub fn graph_run(&self, max: &Dims, num_sms: i32, t: &Tensors, stream: CUstream) -> Result<Dims, Error> {{
            let d = self.graph_dims(max, num_sms)?;
            self.run(&d, t, stream)?;
            Ok(d)
        }}

        /// Check the preconditions and every launch (a dry pass), then launch the loaded target's
        /// whole launch list on `stream`: a refused run enqueues nothing.
        pub fn run(&self, d: &Dims, t: &Tensors, stream: CUstream) -> Result<(), Error> {{
            check(d, t)?;
            let f = &self.loaded.functions;
            for dry in [true, false] {{
                match self.loaded.target {{
{runs}                _ => return fail(CUDA_ERROR_NOT_INITIALIZED, format!("{{}}: not loaded", NAME)),
                }}
            }}
            Ok(())
        }}
    }}
}}

/// {a.name}: check the preconditions and run the launch list (device pointers in `tensors`).
pub fn launch_{a.name}(kernel: &{a.name}::Kernel, dims: &{a.name}::Dims, tensors: &{a.name}::Tensors,
{" " * (len(a.name) + 14)}stream: CUstream) -> Result<(), Error> {{
    kernel.run(dims, tensors, stream)
}}
""")
    return "\n".join(out)


def render(out_dir: Path, dest: Path) -> str:
    import jinja2
    views = output_view(out_dir)
    base = dest.resolve().parent
    sections = [render_artifact(a, base) for a in views]
    env = jinja2.Environment(loader=jinja2.PackageLoader("ptxc", "templates"), keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined, autoescape=False)
    return env.get_template("loaders.rs.j2").render(
        version=__version__, manifest_name=MANIFEST, count=len(views), artifacts=sections,
        variants=[(a.name, rs_string(variant_text(a.variant))[1:-1]) for a in views],
        fields=[rs_string(f)[1:-1] for f in variant_keys()])


def emit(out_dir: Path, dest: Path | None = None) -> Path:
    dest = dest or out_dir / "ptxc_kernels.rs"
    dest.parent.mkdir(parents=True, exist_ok=True)
    write_if_changed(dest, render(out_dir, dest).encode())
    return dest

