"""The dependency structure of ptxc: layers, no import circles, a lean runtime import.

The import graph is built with ``ast`` from every module under ``ptxc/``: module-level and
function-level imports, absolute and relative alike (a lazy import inside a function is still an
arrow; it only changes *when* the target is loaded, which ``test_runtime_import_is_lean`` checks
separately).

Layer order (an arrow may only point to the same or an earlier layer)::

    base -> spec -> ir -> kernels -> pipeline -> runtime -> emit/report/gpu -> cli

``base`` is what every module may import: ``ptxc`` itself, ``ptxc.errors`` (the one exception
tree), ``ptxc.files`` (hashing, bounded reads, atomic writes) and ``ptxc.targets`` (the sm/ptx
table), plus ``ptxc.tuned`` (a data table). ``ptxc.emu`` (the
numpy PTX emulator) and the fp64 references are leaves: they import base modules and themselves only.

What is not true yet is listed in LAYER_ALLOWLIST / CIRCLE_ALLOWLIST below; both lists are checked
to be *exact*: an entry that stopped being a violation fails the test, so the lists only shrink.
docs/architecture.md explains each entry and the move that would remove it.
"""

import ast
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2] / "ptxc"

BASE = {"ptxc", "ptxc.errors", "ptxc.env", "ptxc.files", "ptxc.targets", "ptxc.tuned"}
LAYERS = {"spec": 1, "ir": 2, "kernels": 3, "pipeline": 4, "runtime": 5,
          "emit": 6, "report": 6, "gpu": 6, "cli": 7}
LEAVES = ("ptxc.emu", "ptxc.reference")


def modules():
    """{dotted module name: path} for every source module of ptxc (tests excluded)."""
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        rel = p.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1].startswith(("test_", "conftest")):
            continue
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _resolve(name, mods):
    """The longest prefix of `name` that is a ptxc module (`from x import f` names x.f)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph():
    mods = modules()
    graph = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        package = mod if is_pkg else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module
                # `from pkg import sub` is an arrow to pkg.sub only (as grimp / import-linter
                # count it); `from mod import name` is an arrow to mod
                targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in mods else stem
                           for a in node.names]
            for t in targets:
                if t.split(".")[0] != "ptxc":
                    continue
                r = _resolve(t, mods)
                if r and r != mod:
                    graph[mod].add(r)
    return graph


def layer(mod):
    if mod in BASE:
        return 0
    return LAYERS[mod.split(".")[1]]


def is_leaf(mod):
    return any(mod == p or mod.startswith(p + ".") for p in LEAVES)


def layer_violations(graph):
    bad = set()
    for src, dsts in graph.items():
        for dst in dsts:
            if dst in BASE:
                continue
            if is_leaf(src):
                # a leaf package may import itself only (besides base modules)
                if not any(src.startswith(p) and dst.startswith(p) for p in LEAVES if src.startswith(p)):
                    bad.add((src, dst))
            elif is_leaf(dst):
                continue
            elif layer(dst) > layer(src):
                bad.add((src, dst))
    return bad


def circles(graph):
    """The strongly connected components with more than one module (Tarjan, iterative-safe size)."""
    sys.setrecursionlimit(10000)
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return set(out)

# Arrows against the layer order that remain, each with the move that removes it
# (docs/architecture.md, "Dependency structure"). Exact: a fixed entry fails the test.
LAYER_ALLOWLIST: set[tuple[str, str]] = set()   # none left: keep it that way

# Import circles that remain (none: keep it that way).
CIRCLE_ALLOWLIST: set[frozenset[str]] = set()

def test_graph_sees_relative_and_function_level_imports():
    g = import_graph()
    assert "ptxc.pipeline.exprs" in g["ptxc.runtime.abi"]      # module level, relative
    assert "ptxc.pipeline.checked" in g["ptxc.runtime.artifact"]   # function level, relative
    assert "ptxc.kernels" in g["ptxc.pipeline.metadata"]       # function level (make_metadata)
    assert "ptxc.emu.ops_int" in g["ptxc.emu.op_table"]        # `from pkg import submodule`


def test_no_new_layer_violations():
    bad = layer_violations(import_graph())
    assert bad - LAYER_ALLOWLIST == set(), "arrows against the layer order"
    assert LAYER_ALLOWLIST - bad == set(), "fixed: remove these from LAYER_ALLOWLIST"


def test_no_new_import_circles():
    found = circles(import_graph())
    assert found - CIRCLE_ALLOWLIST == set(), f"new or changed circles: {sorted(map(sorted, found - CIRCLE_ALLOWLIST))}"
    assert CIRCLE_ALLOWLIST - found == set(), "fixed or shrunk: update CIRCLE_ALLOWLIST"


def test_leaves_import_only_base_modules():
    g = import_graph()
    for leaf in ("ptxc.reference",):
        assert g[leaf] <= BASE, g[leaf]
    for mod, dsts in g.items():
        if mod.startswith("ptxc.emu"):
            assert all(d in BASE or d.startswith("ptxc.emu") for d in dsts), (mod, dsts)


def test_runtime_import_is_lean():
    """`import ptxc.runtime` (what a serving process loads) pulls no kernel, no compiler, no ptxas."""
    code = "import sys, json, ptxc.runtime; print(json.dumps(sorted(m for m in sys.modules if m.startswith('ptxc'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT.parent)
    loaded = json.loads(out.stdout)
    assert [m for m in loaded if m == "ptxc.kernels" or m.startswith("ptxc.kernels.")] == []
    assert "ptxc.pipeline.compiler" not in loaded and "ptxc.pipeline.ptxas" not in loaded
    assert "ptxc.emu" not in loaded and "ptxc.ir" not in loaded


if __name__ == "__main__":  # print the current state, to refresh the allowlists by hand
    g = import_graph()
    print(json.dumps(sorted(map(list, layer_violations(g))), indent=1))
    for c in sorted(circles(g), key=sorted):
        print(sorted(c))
