"""`ptxc emit-c-header`: a self-contained C loader for an artifact set.

Per artifact: the dims and tensors structs, one table row per target (numeric order) with that
target's own entries and shared memory, and per target and launch a function that fills the
exact parameter buffer (from the metadata ABI), evaluates that target's grid and launches;
`load` picks the target for the device at load time, `run` checks the preconditions and runs the
whole launch list. The fixed C types and helpers live in templates/kernels_shared.h.j2, defined once
per translation unit whatever the number of headers included (PTXC_LOADER_ABI: a hash of them);
templates/kernels.h.j2 wraps them, each artifact and the header's variant table in guards."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from .. import __version__
from ..errors import UserError
from ..pipeline.artifacts import MANIFEST
from ..runtime.dispatch import variant_keys
from ..files import write_if_changed
from .view import (ArtifactView, KernelView, TargetView, ctas_per_sm, dim_ranges, expr_code, image_facts, output_view,
                   rule_code, variant_text)

SIGNED = {"u32": 0, "s32": 1, "u64": 0, "s64": 1}


def c_expr(text: str | int, dims) -> str:
    """A launch expression as C over the dims struct `d`."""
    return expr_code(text, dims, "d->{}", "(int64_t){}", "ptxc_{}")


def c_string(text: str) -> str:
    return json.dumps(text)  # a JSON string of ASCII identifiers is a valid C string literal


def c_key(text: str) -> str:
    if any(c in text for c in '"\\\n') or not text.isascii():
        raise UserError(f"variant key {text!r} cannot be a C string literal")
    return text


def passed_tensors(a: ArtifactView) -> set[str]:
    """Tensors whose own address some launch receives (pointer-array sources are reached only
    through the per-row pointers the caller builds)."""
    return {p["source"]["tensor"] for t in a.targets for k in t.kernels for p in k.params
            if p["source"]["kind"] in ("pointer", "workspace")}


C_TMAP_DTYPE = {"f16": "FLOAT16", "bf16": "BFLOAT16", "f32": "FLOAT32", "i32": "INT32", "i64": "INT64", "u64": "UINT64",
                "e4m3": "UINT8", "e5m2": "UINT8", "u8": "UINT8"}   # as ptxc/runtime/tensor_maps.py


def _tensor_map_line(a: ArtifactView, k: KernelView, p: dict) -> str:
    """Encode a tensor_map parameter (ptxc_put_tensor_map) from the tensor's pointer, strides
    and shape (its dims evaluated over `d`)."""
    src = p["source"]
    t = a.tensor(src["tensor"])
    shape = ", ".join(c_expr(s, a.dims) if isinstance(s, str) else f"(int64_t){int(s)}" for s in t.shape)
    box = ", ".join(f"{int(b)}u" for b in src["box"])
    swizzle = {0: "NONE", 32: "32B", 64: "64B", 128: "128B"}[src["swizzle"]]
    return (f"    {{ const int64_t shape[{len(t.shape)}] = {{{shape}}}; const cuuint32_t box[{len(src['box'])}] = {{{box}}};\n"
            f"      if ((r = ptxc_put_tensor_map(L, p.bytes, {p['offset']}, t->{t.name}.ptr, t->{t.name}.strides, shape, "
            f"{len(t.shape)}, {t.element_bytes}, CU_TENSOR_MAP_DATA_TYPE_{C_TMAP_DTYPE[t.dtype]}, box, "
            f"CU_TENSOR_MAP_SWIZZLE_{swizzle}, {c_string(k.entry)}, {c_string(p['name'])})) != CUDA_SUCCESS) return r; }}")


def _param_line(a: ArtifactView, k: KernelView, p: dict) -> str:
    src, kind = p["source"], p["source"]["kind"]
    if kind == "tensor_map":
        return _tensor_map_line(a, k, p)
    if p["type"] == "f32":
        value = repr(float(src["value"])) if kind == "const" else f"(float)d->{src['name']}"
        return f"    {{ float v = (float){value}; memcpy(p.bytes + {p['offset']}, &v, 4); }}"
    if kind in ("pointer", "workspace"):
        value = f"(int64_t)t->{src['tensor']}.ptr"
    elif kind == "stride":
        value = f"t->{src['tensor']}.strides[{src['axis']}]"
    elif kind == "dim":
        value = f"d->{src['name']}"
    elif kind == "const":
        value = f"(int64_t){int(src['value'])}"
    else:
        raise UserError(f"{a.name}: {k.entry} parameter {p['name']} has unknown source {kind!r}")
    return (f"    if ((r = ptxc_put(L, p.bytes, {p['offset']}, {value}, {p['size']}, {SIGNED[p['type']]}, "
            f"{c_string(k.entry)}, {c_string(p['name'])})) != CUDA_SUCCESS) return r;")


def _launch_fn(a: ArtifactView, t: TargetView, i: int, k: KernelView) -> str:
    n = max(k.param_bytes, 8)
    lines = [f"/* {t.name} launch {i}: {k.entry}, block {list(k.block)}, {k.dynamic_smem} B dynamic shared memory"
             f" (dry: checks only) */",
             f"static inline CUresult ptxc_{a.name}_{t.name}_launch{i}(ptxc_loader_t *L, CUfunction f, "
             f"const ptxc_{a.name}_dims_t *d, const ptxc_{a.name}_tensors_t *t, CUstream stream, int dry) {{",
             f"    union {{ uint64_t align; unsigned char bytes[{n}]; }} p;",
             "    CUresult r;",
             "    memset(&p, 0, sizeof p);",
             "    (void)d; (void)t; (void)r;"]
    lines += [_param_line(a, k, p) for p in k.params]
    lines.append("    int64_t grid[3] = {" + ", ".join(c_expr(g, a.dims) for g in k.grid) + "};")
    lines.append("    const unsigned block[3] = {" + ", ".join(f"{b}u" for b in k.block) + "};")
    lines.append(f"    return ptxc_launch(L, f, {c_string(k.entry)}, grid, block, {k.dynamic_smem}u, p.bytes, "
                 f"{k.param_bytes}, stream, dry);")
    return "\n".join(lines) + "\n}\n"


def _target_row(a: ArtifactView, t: TargetView) -> str:
    def opt(name):
        return c_string(name) if name else "NULL"
    ks = t.kernels
    if len(ks) > 8:
        raise UserError(f"target {t.name}: {len(ks)} launches, more than the C loader's PTXC_MAX_LAUNCHES (8)")
    facts = image_facts(a, t)
    return (f"    {{{c_string(t.name)}, {t.sm}, {int(t.arch_specific)}, {opt(t.ptx)}, {opt(t.cubin)}, {opt(t.fatbin)}, "
            f"{{{', '.join(f'{n}u' for n, _ in facts)}}}, {{{', '.join(f'{c}u' for _, c in facts)}}}, "
            f"{len(ks)}, {{{', '.join(c_string(k.entry) for k in ks)}}}, "
            f"{{{', '.join(f'{k.dynamic_smem}u' for k in ks)}}}, {{{', '.join(str(int(k.needs_opt_in)) for k in ks)}}}}}")


def _dim_rules(a: ArtifactView) -> list[str]:
    lines = []
    for name, rule in sorted(a.dim_rules.items()):
        if "value" in rule:
            lines.append(f"    d->{name} = {int(rule['value'])};")
        else:  # "auto": the metadata's rule over AUTO_RULE_NAMES (ptxc.runtime.apply_dim_rule)
            auto = rule["auto"]
            per_target = ", ".join(str(ctas_per_sm(a, t, rule)) for t in a.targets)
            lines += [f"    if (d->{name} == 0) {{  /* auto: {auto['rule']} */",
                      f"        static const int64_t ctas_per_sm[{len(a.targets)}] = {{{per_target}}};"
                      f"  /* of {auto.get('occupancy_of', 'the launch')} per target */",
                      f"        int64_t rule_max = {int(auto['max'])}, rule_num_sms = ptxc_max(1, num_sms);",
                      f"        int64_t rule_ctas = ptxc_max(1, {c_expr(auto['ctas'], a.dims)});",
                      f"        int64_t rule_ctas_per_sm = (L->target >= 0 && L->target < {len(a.targets)}) ? "
                      f"ctas_per_sm[L->target] : 1;",
                      f"        d->{name} = ptxc_min(rule_max, ptxc_max(1, {rule_code(auto['rule'], 'rule_{}', '(int64_t){}', 'ptxc_{}')}));",
                      "    }"]
    return lines


def render_artifact(a: ArtifactView) -> str:
    A = a.name
    if not a.dims:
        raise UserError(f"{A}: no runtime dims; nothing for a C loader to take")
    out = [f"/* ==== {A} ({a.family}) ====",
           f" * variant: {variant_text(a.variant)}",
           " * targets: " + ", ".join(f"{t.name} ({'cubin' if t.cubin else 'ptx'})" for t in a.targets)]
    for t in a.tensors:
        out.append(f" * {t.name}: {t.dtype} [{', '.join(map(str, t.shape))}] {t.role}; {t.align_bytes}-byte aligned, "
                   f"strided axes {list(t.strided_axes)} (multiples of {t.stride_multiple}), others packed")
    out.append(" */")
    out.append("typedef struct {\n" + "".join(f"    int64_t {d};\n" for d in a.dims)
               + "".join(f"    float {s};   /* runtime scalar */\n" for s in a.scalars) + f"}} ptxc_{A}_dims_t;\n")
    out.append("typedef struct {\n" + "".join(f"    ptxc_tensor_t {t.name};\n" for t in a.tensors)
               + f"}} ptxc_{A}_tensors_t;\n")
    out.append(f"#define PTXC_{A.upper()}_NUM_TARGETS {len(a.targets)}")
    out.append(f"static const ptxc_target_t ptxc_{A}_targets[{len(a.targets)}] = {{\n"
               + ",\n".join(_target_row(a, t) for t in a.targets) + "\n};\n")
    for t in a.tensors:
        if len(t.shape) > 8:
            raise UserError(f"{A}: tensor {t.name} has rank {len(t.shape)}, more than PTXC_MAX_RANK (8)")
        out.append(f"static inline void ptxc_{A}_shape_{t.name}(const ptxc_{A}_dims_t *d, int64_t shape[]) {{\n"
                   + "".join(f"    shape[{i}] = {c_expr(s, a.dims)};\n" for i, s in enumerate(t.shape))
                   + "    (void)d;\n}\n")
        out.append(f"static inline size_t ptxc_{A}_bytes_{t.name}(const ptxc_{A}_dims_t *d) {{\n"
                   f"    int64_t shape[{len(t.shape)}], n = {t.element_bytes};\n"
                   f"    ptxc_{A}_shape_{t.name}(d, shape);\n"
                   f"    for (int i = 0; i < {len(t.shape)}; i++) n *= shape[i] > 0 ? shape[i] : 0;\n"
                   "    return (size_t)n;\n}\n")
    for t in a.tensors:
        if t.derived_from:
            src = a.tensor(t.derived_from)
            out.append(f"/* {t.name}: entry b = device address of {src.name}[b] when {src.name} is one tensor; copy the\n"
                       f" * table to t->{t.name}.ptr. (Rows in separate allocations: fill it yourself, 16-byte aligned.) */\n"
                       f"static inline void ptxc_{A}_row_pointers_{t.name}(const ptxc_{A}_tensors_t *t, "
                       f"const ptxc_{A}_dims_t *d, uint64_t *host) {{\n"
                       f"    int64_t s[{len(t.shape)}];\n    ptxc_{A}_shape_{t.name}(d, s);\n"
                       f"    for (int64_t b = 0; b < s[0]; b++)\n"
                       f"        host[b] = (uint64_t)t->{src.name}.ptr + (uint64_t)(b * t->{src.name}.strides[0] * {src.element_bytes});\n}}\n")
    work = [t for t in a.tensors if t.role == "workspace"]
    out.append(f"/* Bytes of one allocation holding every workspace tensor, each 256-byte aligned. */\n"
               f"static inline size_t ptxc_{A}_workspace_bytes(const ptxc_{A}_dims_t *d) {{\n    size_t n = 0;\n"
               + "".join(f"    n += (ptxc_{A}_bytes_{t.name}(d) + 255) & ~(size_t)255;\n" for t in work)
               + "    (void)d;\n    return n;\n}\n")
    out.append(f"static inline void ptxc_{A}_bind_workspace(ptxc_{A}_tensors_t *t, CUdeviceptr base, "
               f"const ptxc_{A}_dims_t *d) {{\n"
               + "".join(f"    t->{w.name}.ptr = base;\n    base += (ptxc_{A}_bytes_{w.name}(d) + 255) & ~(size_t)255;\n"
                         for w in work)
               + "    (void)t; (void)base; (void)d;\n}\n")
    out.append(f"/* Packed (C-order) strides for every tensor. */\n"
               f"static inline void ptxc_{A}_packed_strides(ptxc_{A}_tensors_t *t, const ptxc_{A}_dims_t *d) {{\n"
               + "".join(f"    {{ int64_t s[{len(t.shape)}]; ptxc_{A}_shape_{t.name}(d, s); "
                         f"ptxc_packed(&t->{t.name}, {len(t.shape)}, s); }}\n" for t in a.tensors)
               + "}\n")
    given = "".join(f"    if ((r = ptxc_check_dim(L, {c_string(A)}, {c_string(dim)}, d->{dim}, {lo}, {hi}, \"\")) "
                    f"!= CUDA_SUCCESS) return r;\n"
                    for dim, (lo, hi, _) in dim_ranges(a).items() if dim not in a.dim_rules)
    out.append(f"/* Dims no tensor shape determines (0 = auto), after a check that the given ones lie in\n"
               f" * 0 .. 2^31 - 1 (before any arithmetic on them), and a check that every dim is >= 0. */\n"
               f"static inline CUresult ptxc_{A}_resolve_dims(ptxc_loader_t *L, ptxc_{A}_dims_t *d, int num_sms) {{\n"
               f"    CUresult r;\n"
               f"    if (L->target >= 0 && (r = ptxc_holds(L, {c_string(A)})) != CUDA_SUCCESS) return r;\n"
               + given + "\n".join(_dim_rules(a) + [""])
               + "".join(f"    if (d->{dim} < 0) return ptxc_fail(L, CUDA_ERROR_INVALID_VALUE, "
                         f"{c_string(f'{A}: dim {dim} is negative')});\n" for dim in a.dims)
               + "    (void)num_sms;\n    return CUDA_SUCCESS;\n}\n")
    passed = passed_tensors(a)
    checks = []
    for t in a.tensors:
        if t.name not in passed:
            continue
        mask = sum(1 << ax for ax in t.strided_axes)
        checks.append(f"    {{ int64_t s[{len(t.shape)}]; int64_t n = 1; ptxc_{A}_shape_{t.name}(d, s);\n"
                      f"      for (int i = 0; i < {len(t.shape)}; i++) n *= s[i];\n"
                      f"      if (n > 0 && (r = ptxc_check_tensor(L, {c_string(A)}, {c_string(t.name)}, &t->{t.name}, "
                      f"{len(t.shape)}, s, {t.align_bytes}u, {t.stride_multiple}, {mask}u)) != CUDA_SUCCESS) return r; }}")
    dims = [f"    if ((r = ptxc_check_dim(L, {c_string(A)}, {c_string(dim)}, d->{dim}, {lo}, {hi}, "
            f"{c_string(hint)})) != CUDA_SUCCESS) return r;" for dim, (lo, hi, hint) in dim_ranges(a).items()]
    out.append(f"/* The metadata's preconditions: dims in range (rules resolved), tensors non-null, aligned,\n"
               f" * packed/free strides. */\n"
               f"static inline CUresult ptxc_{A}_check(ptxc_loader_t *L, const ptxc_{A}_dims_t *d, "
               f"const ptxc_{A}_tensors_t *t) {{\n    CUresult r;\n" + "\n".join(dims + checks)
               + "\n    (void)r;\n    return CUDA_SUCCESS;\n}\n")
    for t in a.targets:
        for i, k in enumerate(t.kernels):
            out.append(_launch_fn(a, t, i, k))
    built = ", ".join(t.name for t in a.targets)
    out.append(f"static inline CUresult ptxc_{A}_load(ptxc_loader_t *L, CUdevice device, const char *artifact_dir) {{\n"
               f"    return ptxc_load_from_dir(L, {c_string(A)}, ptxc_{A}_targets, {len(a.targets)}, "
               f"{c_string(built)}, device, artifact_dir);\n}}\n")
    out.append(f"/* An image already in memory (cubin, NUL-terminated PTX or fatbin) built for targets[target]. */\n"
               f"static inline CUresult ptxc_{A}_load_image(ptxc_loader_t *L, int target, const void *image, "
               f"const char *kind) {{\n"
               f"    if (target < 0 || target >= {len(a.targets)}) return ptxc_fail(L, CUDA_ERROR_INVALID_VALUE, "
               f"{c_string(f'{A}: no such target index')});\n"
               f"    return ptxc_load_target(L, {c_string(A)}, &ptxc_{A}_targets[target], target, image, kind);\n}}\n")
    cases = []
    for ti, t in enumerate(a.targets):
        body = "".join(f"            if ((r = ptxc_{A}_{t.name}_launch{i}(L, L->functions[{i}], d, t, stream, dry)) != "
                       f"CUDA_SUCCESS) return r;\n" for i in range(len(t.kernels)))
        cases.append(f"    case {ti}:\n        for (int dry = 1; dry >= 0; dry--) {{\n{body}        }}\n"
                     f"        return CUDA_SUCCESS;\n")
    out.append(f"/* The whole launch list of the loaded target, in order, on one stream: every launch checked\n"
               f" * (a dry pass) before the first is enqueued. */\n"
               f"static inline CUresult ptxc_{A}_run(ptxc_loader_t *L, const ptxc_{A}_dims_t *d, "
               f"const ptxc_{A}_tensors_t *t, CUstream stream) {{\n    CUresult r;\n"
               f"    if ((r = ptxc_holds(L, {c_string(A)})) != CUDA_SUCCESS) return r;\n"
               f"    if ((r = ptxc_{A}_check(L, d, t)) != CUDA_SUCCESS) return r;\n"
               f"    switch (L->target) {{\n" + "".join(cases)
               + f"    default:\n        return ptxc_fail(L, CUDA_ERROR_NOT_INITIALIZED, "
               f"{c_string(f'{A}: not loaded (call ptxc_{A}_load first)')});\n    }}\n}}\n")
    out.append(_graph_fns(a))
    return "\n".join(out)


def _graph_fns(a: ArtifactView) -> str:
    """The capture-safe entry: the dims at capture-time maxima (refusing a NEVER target and a
    maximum a grid depends on that is 0), and the launch list at them."""
    A = a.name
    cases = []
    for ti, t in enumerate(a.targets):
        if t.graph_class == "NEVER":
            body = (f"        return ptxc_fail(L, CUDA_ERROR_NOT_SUPPORTED, "
                    f"{c_string(f'{A} [{t.name}]: cannot be captured in a CUDA graph (class NEVER: {t.never_reason})')});\n")
        else:
            body = "".join(f"        if (max->{dim} <= 0) return ptxc_fail(L, CUDA_ERROR_INVALID_VALUE, "
                           f"{c_string(f'{A}: maximum {dim} is not positive; capture at the step maxima')});\n"
                           for dim in t.grid_dims) + "        break;\n"
        cases.append(f"    case {ti}:  /* {t.name}: {t.graph_class} */\n{body}")
    capture = ", ".join(a.capture_dims) or "none"
    rules = ", ".join(f"{r} 0 = auto" for r, rule in sorted(a.dim_rules.items()) if "auto" in rule)
    classes = ", ".join(c_string(t.graph_class) for t in a.targets)
    return (f"/* CUDA graphs: each target's class (metadata graph.targets.T.class, vLLM's AttentionCGSupport). */\n"
            f"static const char *const ptxc_{A}_graph_class[{len(a.targets)}] = {{{classes}}};\n\n"
            f"/* CUDA graphs (metadata `graph`; docs/loaders.md \"Capturing a step in a CUDA graph\").\n"
            f" * The dims of the launch list captured at `max`: every capture dim ({capture}) at its\n"
            f" * capture-time maximum{', ' + rules + ' (resolved from the maxima, so every step gets the same)' if rules else ''}.\n"
            f" * Refuses a target whose graph class is NEVER and a maximum a grid depends on that is not\n"
            f" * positive. Call before capture to size the workspace (ptxc_{A}_workspace_bytes). */\n"
            f"static inline CUresult ptxc_{A}_graph_dims(ptxc_loader_t *L, const ptxc_{A}_dims_t *max, "
            f"int num_sms, ptxc_{A}_dims_t *d) {{\n"
            f"    CUresult r;\n"
            f"    (void)ptxc_{A}_graph_class;   /* the class of each case below */\n"
            f"    if ((r = ptxc_holds(L, {c_string(A)})) != CUDA_SUCCESS) return r;\n"
            f"    switch (L->target) {{\n" + "".join(cases)
            + f"    default:\n        return ptxc_fail(L, CUDA_ERROR_NOT_INITIALIZED, "
            f"{c_string(f'{A}: not loaded (call ptxc_{A}_load first)')});\n    }}\n"
            f"    *d = *max;\n    return ptxc_{A}_resolve_dims(L, d, num_sms);\n}}\n\n"
            f"/* The capture-safe launch: ptxc_{A}_graph_dims, then the launch list at those dims. It makes\n"
            f" * no driver call but cuLaunchKernel (and cuTensorMapEncodeTiled for tensor maps: host work;\n"
            f" * no allocation, copy or synchronisation), so it runs\n"
            f" * inside cuStreamBeginCapture; every step under the same maxima enqueues the same launches\n"
            f" * (tensors sized at the maxima, smaller steps padded), so one graph replays them all. */\n"
            f"static inline CUresult ptxc_{A}_graph_run(ptxc_loader_t *L, const ptxc_{A}_dims_t *max, "
            f"int num_sms, const ptxc_{A}_tensors_t *t, CUstream stream) {{\n"
            f"    ptxc_{A}_dims_t d;\n    CUresult r;\n"
            f"    if ((r = ptxc_{A}_graph_dims(L, max, num_sms, &d)) != CUDA_SUCCESS) return r;\n"
            f"    return ptxc_{A}_run(L, &d, t, stream);\n}}\n")


# What a section defines at file scope: functions and tables, struct typedefs, macros
_DEFINED = re.compile(r"^(?:static (?:inline )?[^=(\[]*?\b(ptxc_\w+)\s*[(\[]|\} (ptxc_\w+);|#define (PTXC_\w+))", re.M)


def check_names(views, sections) -> None:
    """Artifact names whose generated identifiers collide (`x`'s graph_run is `x_graph`'s run;
    `X` and `x` share PTXC_X_NUM_TARGETS) would make a header that does not compile: refused."""
    owner: dict[str, str] = {}
    for a, text in zip(views, sections):
        for groups in _DEFINED.findall(text):
            name = next(g for g in groups if g)
            if owner.setdefault(name, a.name) != a.name:
                raise UserError(f"kernels {owner[name]!r} and {a.name!r} both generate the C identifier {name}; "
                                f"rename one (or emit their headers from separate build directories, included in "
                                f"separate translation units)")


def clashes(a: ArtifactView, section: str, names) -> list[tuple[str, str]]:
    """(artifact, C identifier) for each artifact name of *another* header that would generate an
    identifier of `a`'s (`x`'s graph_run is `x_graph`'s run): its guard turns that header meeting
    this one into one #error. Taken from `a`'s own identifiers, on the rule that every artifact
    defines the suffixes `a` does (load, run, graph_run, ...): a = b_w with b defining w_s where
    `a` defines s, or b = a_w with `a` defining w_s where b defines s. Artifacts of this header are
    left out (check_names refused every real collision among them)."""
    head = f"ptxc_{a.name}_"
    suffixes = {n[len(head):] for groups in _DEFINED.findall(section) for n in groups if n.startswith(head)}
    found = {}
    for s in sorted(suffixes):
        parts = s.split("_")
        for i in range(1, len(parts)):   # s = w_s2, s2 one of a's suffixes: b = a_w defines it as its s2
            if "_".join(parts[i:]) in suffixes:
                found.setdefault(f"{a.name}_{'_'.join(parts[:i])}", head + s)
    words = a.name.split("_")
    for i in range(1, len(words)):       # a = b_w: b's w_s is a's s
        b, w = "_".join(words[:i]), "_".join(words[i:])
        for s in sorted(suffixes):
            if f"{w}_{s}" in suffixes:
                found.setdefault(b, head + s)
                break
    return sorted((b, ident) for b, ident in found.items() if b not in names)


PREFIX_RE = re.compile(r"[a-z][a-z0-9_]{0,63}\Z")
GUARD_SLOT = "PTXC_KERNELS_GUARD_SLOT"


def default_prefix(names) -> str:
    """The name of a header's variant table when no --prefix is given: `set_` and 8 hex digits
    of the SHA-256 of its artifact names (sorted, joined by ','), the same for every header of the
    same set of artifacts -- headers that may be included together have disjoint sets."""
    return "set_" + hashlib.sha256(",".join(sorted(names)).encode()).hexdigest()[:8]


def render(out_dir: Path, prefix: str | None = None) -> str:
    import jinja2
    if prefix is not None and not PREFIX_RE.match(prefix):
        raise UserError(f"--prefix {prefix!r}: a lowercase C identifier is needed ([a-z][a-z0-9_]*, at most 64)")
    views = output_view(out_dir)
    sections = [render_artifact(a) for a in views]
    check_names(views, sections)
    names = {a.name for a in views}
    env = jinja2.Environment(loader=jinja2.PackageLoader("ptxc", "templates"), keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined, autoescape=False)
    shared = env.get_template("kernels_shared.h.j2").render().rstrip("\n")
    text = env.get_template("kernels.h.j2").render(
        version=__version__, manifest_name=MANIFEST,
        artifacts=[(a.name, section, clashes(a, section, names)) for a, section in zip(views, sections)],
        guard=GUARD_SLOT, shared=shared, abi="0x" + hashlib.sha256(shared.encode()).hexdigest()[:8].upper(),
        prefix=default_prefix(names) if prefix is None else prefix, fields=c_key(",".join(variant_keys())),
        variants=[(a.name, c_key(variant_text(a.variant))) for a in views])
    # the include guard names this header's content: the same header twice is one, two differ
    guard = f"PTXC_KERNELS_{hashlib.sha256(text.encode()).hexdigest()[:16].upper()}_H"
    return text.replace(GUARD_SLOT, guard)


def emit(out_dir: Path, dest: Path | None = None, prefix: str | None = None) -> Path:
    dest = dest or out_dir / "ptxc_kernels.h"
    dest.parent.mkdir(parents=True, exist_ok=True)
    write_if_changed(dest, render(out_dir, prefix).encode())
    return dest
