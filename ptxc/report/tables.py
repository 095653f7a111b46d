"""`ptxc report` on a terminal: rich tables (resources + SASS mix; main loop; cost + roofline)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .sass import MIX_CLASSES


def _console() -> Console:
    c = Console(highlight=False)
    return c if c.is_terminal else Console(highlight=False, width=220)  # logs: no truncation


def fmt_seconds(s: float) -> str:
    if s >= 1e-1:
        return f"{s:.3g} s"
    if s >= 1e-4:
        return f"{s * 1e3:.3g} ms"
    if s >= 1e-6:
        return f"{s * 1e6:.3g} µs"
    return f"{s * 1e9:.3g} ns"


def fmt_count(n: float, unit: str = "") -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {prefix}{unit}"
    return f"{n:.3g} {unit}".rstrip()


def _num(v) -> str:
    return "-" if v is None else str(v)


def print_report(report: dict) -> None:
    c = _console()
    res = Table(title="resources (ptxas) and theoretical occupancy", title_justify="left")
    for col in ("kernel", "target", "entry", "regs", "spill B", "smem B", "barriers", "CTAs/SM",
                "occupancy", "limited by", *MIX_CLASSES):
        res.add_column(col, justify="left" if col in ("kernel", "target", "entry", "limited by") else "right")
    for k in report["kernels"]:
        for t in k["targets"]:
            for L in t["launches"]:
                occ = L["occupancy"] or {}
                mix = L["sass"] or {}
                res.add_row(k["name"], t["target"], L["entry"], _num(L["registers"]),
                            _num(L["spill_bytes"]), str(L["smem_bytes"]), _num(L["barriers"]),
                            _num(occ.get("ctas_per_sm")),
                            f"{occ['occupancy']:.1%}" if occ else "-", occ.get("limited_by", "-"),
                            *(_num(mix.get(m)) for m in MIX_CLASSES))
    c.print(res)
    if not report["sass"]["available"]:
        c.print(f"SASS mix unavailable: {escape(report['sass']['reason'] or 'unknown reason')}")

    print_loops(c, report)

    roof = Table(title="cost per launch list and roofline bound", title_justify="left")
    for col in ("kernel", "target", "shape", "FLOPs", "bytes", "FLOP/B", "unit", "GPU", "bound time",
                "bound by"):
        roof.add_column(col, justify="right" if col in ("FLOPs", "bytes", "FLOP/B", "bound time") else "left")
    for k in report["kernels"]:
        shape = ",".join(f"{n}={v}" for n, v in k["dims"].items())
        for t in k["targets"]:
            cost = t["cost"]
            if cost is None:
                roof.add_row(k["name"], t["target"], shape, "-", "-", "-", "-", escape(t["cost_note"]), "-", "-")
                continue
            first = [k["name"], t["target"], shape, fmt_count(cost["flops"]), fmt_count(cost["bytes"], "B"),
                     f"{cost['intensity']:.3g}", cost["unit"]]
            if not t["roofline"]:
                roof.add_row(*first, "(no model of this SM)", "-", "-")
            for i, r in enumerate(t["roofline"]):
                name = report["gpus"][r["gpu"]]["name"]
                roof.add_row(*(first if i == 0 else [""] * len(first)), name,
                             fmt_seconds(r["seconds"]), r["bound"])
    c.print(roof)
    estimates = [(k["name"], t["target"], e) for k in report["kernels"] for t in k["targets"]
                 for e in t.get("estimate") or []]
    if estimates:
        est = Table(title="whole launch list, calibrated estimate (ptxc.report.launch_model)",
                    title_justify="left")
        for col in ("kernel", "target", "GPU", "estimate", "binding term"):
            est.add_column(col, justify="right" if col == "estimate" else "left")
        for name, target, e in estimates:
            bound = max(e["launches"], key=lambda x: x["seconds"])["bound"]
            gpu = report["gpus"][e["gpu"]]["name"] if e["gpu"] in report["gpus"] else e["gpu"]
            est.add_row(name, target, gpu, fmt_seconds(e["seconds"]), bound)
        c.print(est)
        for source, error in dict.fromkeys((e["calibration"], e["error"]) for _, _, e in estimates):
            c.print(f"estimate error: {error} ({source})")   # one line per fit (mma.sync, wgmma)
    c.print("peaks: " + "; ".join(f"{g['name']} {g['tensor_tflops']:g} TFLOP/s tensor, "
                                   f"{g['f32_tflops']:g} f32, {g['bandwidth_gbs']:g} GB/s"
                                   for g in report["gpus"].values()))


LOOP_COLUMNS = (("HMMA", "tensor"), ("LDSM", "ldsm"), ("LDGSTS", "ldgsts"), ("LDG", "ldg"),
                ("STG", "stg"), ("LDS", "lds"), ("STS", "sts"), ("MUFU", "mufu"), ("FP32", "fp32"),
                ("CVT", "cvt"), ("SHFL", "shfl"), ("BAR", "bar"), ("INT", "int"), ("MOV", "move"))


def fmt_bound(report: dict, b: dict) -> str:
    name = report["gpus"][b["gpu"]]["name"] if b["gpu"] in report["gpus"] else b["gpu"]
    frac = f", {b['bandwidth_fraction']:.0%} BW" if b["bandwidth_fraction"] is not None else ""
    return f"{name}: {b['bound']}{frac}"


def print_loops(c: Console, report: dict) -> None:
    rows = [(k, t, L) for k in report["kernels"] for t in k["targets"] for L in t["launches"] if L.get("loop")]
    if not rows:
        return
    table = Table(title="main loop, one steady-state iteration per warp (SASS; instrs: the steady path, "
                        "(the longest) where a tile taking every branch region issues more)", title_justify="left")
    for col in ("kernel", "target", "entry", "instrs", *(h for h, _ in LOOP_COLUMNS), "LDG widths B",
                "instr/HMMA-eq", "instr/KV row", "KiB in flight /CTA", "/SM", "bound (estimate)"):
        table.add_column(col, justify="left" if col in ("kernel", "target", "entry", "LDG widths B",
                                                        "bound (estimate)") else "right")
    for k, t, L in rows:
        lp = L["loop"]
        widths = " ".join(f"{w}x{n}" for w, n in lp["ldg_bytes"].items()) or "-"
        longest = lp.get("instructions_longest", lp["instructions"])
        instrs = str(lp["instructions"]) + (f" ({longest})" if longest > lp["instructions"] else "")
        table.add_row(k["name"], t["target"], L["entry"], instrs,
                      *(str(lp["classes"][c]) for _, c in LOOP_COLUMNS), widths,
                      _num(lp["instructions_per_mma_equivalent"]), _num(lp["instructions_per_kv_row"]),
                      f"{lp['inflight_bytes_per_cta'] / 1024:.1f}", f"{lp['inflight_bytes_per_sm'] / 1024:.1f}",
                      "; ".join(fmt_bound(report, b) for b in lp["bounds"]) or "-")
    c.print(table)


def print_bench(result: dict) -> None:
    c = _console()
    t = Table(title=f"ptxc bench on {result['device']} (sm_{result['sm']}), median of {result['repeat']} "
                    f"after {result['warmup']} warm-up runs", title_justify="left")
    for col in ("kernel", "impl", "target", "shape", "median", "p10-p90", "TFLOP/s", "% peak", "GB/s",
                "% BW", "L2 flushed"):
        t.add_column(col, justify="left" if col in ("kernel", "impl", "target", "shape") else "right")
    for r in result["results"]:
        pct = lambda v: "-" if v is None else f"{v:.1f}%"
        t.add_row(r["kernel"], r["impl"], r["target"] or "", ",".join(f"{k}={v}" for k, v in r["dims"].items()),
                  f"{r['median_ms']:.4g} ms", f"{r['p10_ms']:.4g}-{r['p90_ms']:.4g}", f"{r['tflops']:.3g}",
                  pct(r["pct_peak_flops"]), f"{r['gbs']:.4g}", pct(r["pct_peak_bandwidth"]),
                  "yes" if r["l2_flushed"] else "no")
    c.print(t)
    for n in result.get("notes", []):
        c.print(f"note: {escape(n)}")


def print_tune(result: dict) -> None:
    c = _console()
    t = Table(title=f"ptxc tune on {result['device']} [{result['target']}] -> {result['table']}",
              title_justify="left")
    for col in ("family", "head_dim", "causal", "dtype", "best tile", "best", "default", "candidates"):
        t.add_column(col)
    for e in result["entries"]:
        t.add_row(e["family"], str(e["head_dim"]), str(e["causal"]), e["dtype"],
                  escape(", ".join(f"{k}={v}" for k, v in e["tile"].items())), f"{e['median_ms']:.4g} ms",
                  "-" if e["default_ms"] is None else f"{e['default_ms']:.4g} ms", str(e["candidates"]))
    c.print(t)


__all__ = ["LOOP_COLUMNS", "fmt_bound", "fmt_count", "fmt_seconds", "print_loops", "print_bench", "print_report", "print_tune"]
