"""IR -> PTX text. Instruction text comes from a table keyed by op; the module scaffolding
(version, target, entry signature, register and shared declarations) from one jinja2 template.

The printer makes no decisions: anything that changes semantics or legality happens in the
builder or in a pass before this point, so the same IR always prints the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from .. import __version__
from .builder import EntryIR, Instr
from .values import STORAGE_DECL, STORAGE_ORDER, param_decl


def _generic(i: Instr) -> str:
    ops = ", ".join(map(str, i.dsts + i.srcs))
    return f"{i.mnemonic} {ops};" if ops else f"{i.mnemonic};"


def _store(i: Instr) -> str:
    return f"{i.mnemonic} {i.srcs[0]}, {i.srcs[1]};"


# One entry per op whose text is not "mnemonic dsts, srcs;".
PRINTERS: dict[str, Callable[[Instr], str]] = {
    "label": lambda i: f"{i.srcs[0]}:",
    "comment": lambda i: f"// {i.srcs[0]}",
    "st": _store,
    "bra": lambda i: f"bra {i.srcs[0]};",
    "elect": lambda i: f"elect.sync {i.dsts[0]}|{i.dsts[1]}, {i.srcs[0]};",
    "cp_async": lambda i: f"cp.async.{'.'.join(i.mods)}" + (f" {', '.join(map(str, i.srcs))};" if i.srcs else ";"),
}


def render_instr(i: Instr) -> str:
    text = PRINTERS.get(i.op, _generic)(i)
    if i.op == "label":
        return text
    if i.guard:
        return f"\t@{'!' if i.guard[1] else ''}{i.guard[0]} {text}"
    return "\t" + text


@dataclass(frozen=True)
class _RegDecl:
    cls: str
    type: str
    count: int


@lru_cache(maxsize=1)
def _template():
    import jinja2  # deferred: keeps `ptxc --help` fast
    env = jinja2.Environment(loader=jinja2.PackageLoader("ptxc", "ir"), keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined, autoescape=False)
    return env.get_template("module.ptx.j2")


def render_module(entries: list[EntryIR], *, kernel: str, family: str, target: str,
                  ptx_version: str, maxntid: dict[str, int] | None = None,
                  minnctapersm: dict[str, int] | None = None) -> str:
    views = []
    for e in entries:
        decls = [_RegDecl(c, STORAGE_DECL[c], e.reg_counts[c] + 1)
                 for c in STORAGE_ORDER if e.reg_counts.get(c)]
        views.append({"name": e.name, "params": [param_decl(p.type, p.name) for p in e.params],
                      "reg_decls": decls, "shared": e.shared,
                      "body": "".join([render_instr(i) + "\n" for i in e.body]),
                      "maxntid": (maxntid or {}).get(e.name),
                      "minnctapersm": (minnctapersm or {}).get(e.name)})
    return _template().render(ptxc_version=__version__, kernel=kernel, family=family, target=target,
                               ptx_version=ptx_version, entries=views)
