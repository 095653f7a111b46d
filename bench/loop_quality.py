"""Loop quality of the example specs, from the SASS (no GPU): `ptxc report`'s loop analysis
(ptxc.report.loops / loop_model) as one table per target.

    python bench/loop_quality.py [--out DIR] [--targets sm_80,sm_90] [--json]
    python bench/loop_quality.py --out DIR --targets sm_100a --issue-loops

Builds specs/ into a temporary directory (or reads the artifacts already in --out) and prints,
per attention launch: registers, CTAs/SM, shared memory, the main loop's steady-state
instructions per warp and its longest path (any warp's iteration taking every branch region:
a mask, a tail, a rescale, a table refill -- the steady figure's bound from above), HMMA-equivalents (mma.m16n8k16 units: an HGMMA.64xNx16 is N/8 per
warp), instructions per HMMA-equivalent, warp-instructions per KV row, KV bytes in
flight per CTA and per SM (mean over the iteration), and the estimated bound with the fraction
of DRAM bandwidth on each GPU model of the target. Needs ptxas and nvdisasm (PTXAS, NVDISASM).

--issue-loops prints the loops of the warp-specialised kernels' issuing warps instead: per
kernel, the largest loop that issues tensor-core MMAs (UTC*MMA) and the largest that issues
TMA boxes (UTMALDG) without softmax work in it (no MUFU), with its instructions per iteration
and per MMA or box (an unrolled loop covers several tiles; per MMA is what compares).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ptxc.report.analysis import build_report  # noqa: E402


def rows_of(report: dict, targets: list[str]) -> list[dict]:
    out = []
    for k in report["kernels"]:
        for t in k["targets"]:
            if targets and t["target"] not in targets:
                continue
            for L in t["launches"]:
                lp = L.get("loop")
                if not lp or not lp["kv_rows_per_iteration"]:
                    continue
                out.append({
                    "kernel": k["name"], "target": t["target"], "entry": L["entry"],
                    "registers": L["registers"], "spill_bytes": L["spill_bytes"],
                    "ctas_per_sm": (L["occupancy"] or {}).get("ctas_per_sm"),
                    "smem_kib": round(L["smem_bytes"] / 1024, 1),
                    "instructions": lp["instructions"], "hmma": lp["mma_equivalents"],
                    # the longest path of any warp: a tile taking every branch region
                    "instructions_longest": lp.get("instructions_longest", lp["instructions"]),
                    # where warps take different paths (TMA issue blocks): every warp's count;
                    # "instructions" and the ratios are the worst warp's
                    "warp_instructions": lp.get("warp_instructions"),
                    # MLA's dequantising warpgroup: its warps' own loop, per tile
                    "dequant_instructions": lp.get("dequant_instructions"),
                    "per_hmma": lp["instructions_per_mma_equivalent"], "per_kv_row": lp["instructions_per_kv_row"],
                    "inflight_kib_cta": round(lp["inflight_bytes_per_cta"] / 1024, 1),
                    "inflight_kib_sm": round(lp["inflight_bytes_per_sm"] / 1024, 1),
                    "bounds": {b["gpu"]: {"bound": b["bound"], "bandwidth_fraction": b["bandwidth_fraction"]}
                               for b in lp["bounds"]},
                })
    return out


def _instructions(r: dict) -> str:
    """The worst warp's count, and the range over the warps where their paths differ; a
    dequantising warpgroup's warps' count after it."""
    counts = (r.get("warp_instructions") or {}).values()
    text = f"{r['instructions']} ({min(counts)}-{max(counts)})" if counts else str(r["instructions"])
    return text + (f"; dequantising {r['dequant_instructions']}" if r.get("dequant_instructions") else "")


def print_table(rows: list[dict]) -> None:
    head = ("kernel", "target", "regs", "CTA/SM", "smem KiB", "instr (worst warp)", "longest path", "HMMA-eq",
            "instr/HMMA-eq",
            "instr/KV row", "KiB fly/CTA", "KiB fly/SM", "bound (DRAM BW share)")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        bounds = "; ".join(f"{g}: {b['bound']}" + (f" ({b['bandwidth_fraction']:.0%})"
                                                    if b["bandwidth_fraction"] is not None else "")
                           for g, b in r["bounds"].items()) or "-"
        cells = (r["kernel"], r["target"], r["registers"], r["ctas_per_sm"], r["smem_kib"],
                 _instructions(r), r["instructions_longest"], r["hmma"], r["per_hmma"] or "-", r["per_kv_row"],
                 r["inflight_kib_cta"], r["inflight_kib_sm"], bounds)
        print("| " + " | ".join(map(str, cells)) + " |")


def issue_loops(out: Path, targets: list[str]) -> list[dict]:
    """The MMA warp's and the load warp's loops of every cubin under `out` (see --issue-loops)."""
    from ptxc.report.loops import issue_loops as loops_of
    from ptxc.report.sass import disassembly_text, find_nvdisasm
    rows = []
    for cubin in sorted(out.glob("*/*.cubin")):
        target = cubin.suffixes[-2].lstrip(".")
        if targets and target not in targets:
            continue
        for fn, roles in loops_of(disassembly_text(find_nvdisasm(), cubin.read_bytes())).items():
            rows += [{"kernel": cubin.parent.name, "target": target, "entry": fn, "role": r, **roles[r]}
                     for r in ("mma", "load") if r in roles]
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="built artifacts to read (default: build specs/ now)")
    ap.add_argument("--targets", default="sm_80,sm_90", help="comma-separated, '' for all")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--issue-loops", action="store_true",
                    help="the issuing warps' loops (MMA, TMA) instead of the main loop (needs --out)")
    args = ap.parse_args(argv)
    targets = [t for t in args.targets.split(",") if t]
    if args.issue_loops:
        if args.out is None:
            ap.error("--issue-loops reads built artifacts: give --out")
        rows = issue_loops(args.out, targets)
        if args.json:
            print(json.dumps(rows, indent=1))
            return 0
        print("| kernel | target | warp | instr/iteration | MMAs or TMA boxes | instr per issue |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['kernel']} | {r['target']} | {r['role']} | {r['instructions']} | "
                  f"{r['issues']} | {r['per_issue']} |")
        return 0
    with tempfile.TemporaryDirectory(prefix="ptxc-loops-") as tmp:
        out = args.out
        if out is None:
            from ptxc.pipeline.build import run_build
            out = Path(tmp) / "out"
            summary = run_build([ROOT / "specs"], out, verify=True, progress=False)
            if summary["problems"]:
                print("\n".join(summary["problems"]), file=sys.stderr)
                return 1
        report = build_report([out])
    if not report["sass"]["available"]:
        print(f"SASS unavailable: {report['sass']['reason']}", file=sys.stderr)
        return 1
    rows = rows_of(report, targets)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
