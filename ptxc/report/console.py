"""Human-readable output for the CLI (rich tables; rich honours NO_COLOR and non-TTY output)."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table


def plural(n: int, one: str, many: str | None = None) -> str:
    """'1 kernel', '2 kernels', '0 kernels' (irregular plurals passed as `many`)."""
    return f"{n} {one if n == 1 else (many or one + 's')}"


def _console() -> Console:
    """On a terminal: rich tables fitted to its width. Piped or logged: a plain form (no colour,
    no box-drawing characters), wide enough that no cell is cut."""
    c = Console(highlight=False)
    if not c.is_terminal:
        c = Console(highlight=False, width=200, color_system=None)
    return c


def _table(title: str, console: Console) -> Table:
    if console.is_terminal:
        return Table(title=title, title_justify="left")
    return Table(title=title, title_justify="left", box=None, padding=(0, 2), header_style=None,
                 title_style=None)


def print_build_summary(summary: dict) -> None:
    c = _console()
    table = _table(f"ptxc build -> {summary['out']}", c)
    for col in ("kernel", "target", "entries", "regs", "spill B", "smem B", "occupancy"):
        table.add_column(col, justify="right" if col not in ("kernel", "target", "entries") else "left")
    for k in summary["kernels"]:
        for t, s in k["targets"].items():
            occ = f"{s['occupancy']:.0%}" if s["occupancy"] is not None else "-"
            table.add_row(k["name"], t, ", ".join(s["entries"]), str(s["registers"] or "-"),
                          str(s["spill_bytes"]), str(s["smem_bytes"]), occ)
    c.print(table)
    cache = summary["cache"]
    c.print(f"{plural(len(summary['kernels']), 'kernel')}, "
            f"{plural(summary['files_changed'], 'file')} written, "
            f"cache {plural(cache['hits'], 'hit')} / {plural(cache['misses'], 'miss', 'misses')}, "
            f"{'verified with ptxas ' + summary['ptxas_version'] if summary['verified'] else 'NOT verified (--no-verify)'}"
            f", {summary['seconds']:.2f} s")
    for p in summary["problems"]:
        c.print(f"[red]problem:[/red] {escape(p)}")


def print_verify_report(report) -> None:
    c = _console()
    if report.rows:
        table = _table("resources", c)
        for col in ("kernel", "target", "entry", "regs", "spill B", "stack", "smem B", "barriers",
                    "CTAs/SM", "occupancy", "limited by"):
            table.add_column(col)
        for r in report.rows:
            table.add_row(r["kernel"], r["target"], r["entry"], str(r["registers"]),
                          str(r["spill_stores"] + r["spill_loads"]), str(r["stack"]),
                          str(r["shared_bytes"]), str(r["barriers"]), str(r["ctas_per_sm"]),
                          f"{r['occupancy']:.0%}", r["limited_by"])
        c.print(table)
    for n in report.notes:
        c.print(f"[yellow]not checked:[/yellow] {escape(n)}")
    for p in report.problems:
        c.print(f"[red]mismatch:[/red] {escape(p)}")
    c.print("verify: OK" if report.ok else f"verify: FAILED ({plural(len(report.problems), 'problem')})")


def print_inspect(d: Path, as_json: bool = False) -> None:
    from ..pipeline.checked import load_checked
    meta = load_checked(d)
    if as_json:   # the checked metadata itself: the documented contract (docs/metadata.md)
        print(json.dumps(meta, indent=2, sort_keys=True))
        return
    c = _console()
    spec = meta["spec"]
    c.print(f"[bold]{meta['name']}[/bold]  family={meta['family']}  ptxc {meta['ptxc_version']}  "
            f"verified={meta['verified']}")
    c.print("spec: " + escape(", ".join(f"{k}={v}" for k, v in spec.items() if k not in ("name", "family"))))
    t = _table("tensors", c)
    for col in ("name", "dtype", "shape", "role"):
        t.add_column(col)
    for name, info in meta["tensors"].items():
        t.add_row(name, info["dtype"], escape("[" + ", ".join(map(str, info["shape"])) + "]"),
                  info["role"] + (" (device-resident scalars)" if info.get("device_resident") else ""))
    for name, info in (meta.get("scalars") or {}).items():   # runtime scalar parameters
        t.add_row(name, info["dtype"], "scalar", "input (kernel parameter)")
    c.print(t)
    for target, tinfo in meta["targets"].items():
        c.print(f"\n[bold]{target}[/bold]  {tinfo['ptx']}  (PTX ISA {tinfo['ptx_version']})"
                + (f"  {tinfo['cubin']}  (ptxas {tinfo['ptxas_version']})" if "cubin" in tinfo else "")
                + escape(f"\n  config: {tinfo['config']}"))
        for k in tinfo["kernels"]:
            res = k.get("resources")
            c.print(f"  launch {k['entry']}: grid=({', '.join(map(str, k['grid']))}) "
                    f"block=({', '.join(map(str, k['block']))}) smem={k['static_smem_bytes']}+"
                    f"{k['dynamic_smem_bytes']} B" + (" [needs opt-in]" if k["needs_smem_opt_in"] else ""))
            if res:
                c.print(f"    registers={res['registers']} spills={res['spill_stores']}/"
                        f"{res['spill_loads']} B stack={res['stack']} barriers={res['barriers']} "
                        f"occupancy={k['occupancy']['occupancy']:.0%} ({k['occupancy']['limited_by']})")
            pt = Table(show_header=True, box=None, padding=(0, 2))
            for col in ("offset", "size", "type", "param", "source"):
                pt.add_column(col)
            for p in k["params"]:
                src = p["source"]
                desc = {"pointer": f"&{src.get('tensor')}", "stride": f"{src.get('tensor')}.stride({src.get('axis')})",
                        "dim": f"dim {src.get('name')}", "const": f"= {src.get('value')}"}.get(src["kind"], str(src))
                pt.add_row(str(p["offset"]), str(p["size"]), p["type"], p["name"], desc)
            c.print(pt)


def families_data() -> dict:
    """`ptxc list --json`: every family's keys with default, allowed values and meaning."""
    from ..kernels import FAMILIES
    from ..spec import COMMON_FIELDS
    from ..spec.fields import REQUIRED

    def fields(fs):
        return [{"key": f.name, "required": f.default is REQUIRED,
                 "default": None if f.default is REQUIRED else f.default,
                 "allowed": f.describe_allowed() if f.name != "family" else " | ".join(FAMILIES),
                 "meaning": f.doc} for f in fs]
    return {"common": fields(COMMON_FIELDS),
            "families": {fam.name: {"doc": fam.doc, "keys": fields(fam.fields.fields),
                                    "tile": fields(fam.fields.tile)} for fam in FAMILIES.values()}}


def print_families() -> None:
    from ..kernels import FAMILIES
    from ..spec import COMMON_FIELDS
    from ..spec.fields import REQUIRED
    c = _console()

    def fields_table(title, fields, prefix=""):
        t = _table(title, c)
        for col in ("key", "default", "allowed", "meaning"):
            t.add_column(col)
        for f in fields:
            default = "required" if f.default is REQUIRED else ("derived (see meaning)" if f.default is None
                                                                else json.dumps(f.default))
            allowed = f.describe_allowed() if f.name != "family" else " | ".join(FAMILIES)
            t.add_row(prefix + f.name, escape(default), escape(allowed), escape(f.doc))
        return t

    c.print(fields_table("keys of every family", COMMON_FIELDS))
    for fam in FAMILIES.values():
        c.print(f"\n[bold]{fam.name}[/bold]: {fam.doc}")
        c.print(fields_table(f"{fam.name} keys", fam.fields.fields))
        if fam.fields.tile:
            c.print(fields_table(escape(f"{fam.name} [kernel.tile] keys"), fam.fields.tile, "tile."))


def print_launch_test(rows, rule: str) -> None:
    c = _console()
    table = _table(f"launch-test (pass: {rule})", c)
    for col in ("kernel", "target", "backend", "shape", "tensor", "max abs error", "tolerance", "result", "time"):
        table.add_column(col)
    for r in rows:
        when = f"{r.ms:.3f} ms" if r.ms is not None else f"{r.seconds:.2f} s (emulated)" if r.backend == "emu" else ""
        table.add_row(r.kernel, r.target, r.backend, r.shape, r.tensor, f"{r.max_error:.3e}",
                      f"{r.tol:.3e}", "[green]pass[/green]" if r.ok else "[red]FAIL[/red]", when)
    c.print(table)
    seen = {}
    for r in rows:   # once per kernel: what its default (or given) shapes exercised
        seen.setdefault(r.kernel, r.features)
    for kernel, feats in seen.items():
        if feats:
            c.print(f"{kernel} exercised: {', '.join(feats)}", markup=False, highlight=False)
    for r in rows:
        if r.note:
            c.print(f"{r.kernel} [{r.target}] {r.tensor}: {r.note}", markup=False, highlight=False)
    failed = sum(not r.ok for r in rows)
    c.print(f"{len(rows) - failed} passed, {failed} failed")   # "N passed" reads right for any N
