"""Measured anchors for issue 13: the kernels engineers would otherwise use, compiled here for
the jobs of ptxc's Llama-3-8B kernels and read by ptxc's own SASS loop analysis
(ptxc.report.loops / loop_model), printed next to ptxc's.

    python bench/anchors.py [--targets sm_80,sm_90] [--flashinfer WHEEL] [--work DIR]
                            [--ptxc-out DIR] [--json]

Jobs: decode f16, head_dim 128, GQA 32/8, paged cache of 16-row pages; prefill f16, head_dim 128,
causal, 4096 x 4096, GQA 4. Peers, all compiled without a GPU:
  FlashInfer 0.7.2  BatchDecodeWithPagedKVCacheKernel and SinglePrefillWithKVCacheKernel (FA2),
                    from its wheel's headers with nvcc (bench/peers/fi_build.py, *.cu)
  Triton            GQA paged decode with tl.dot (bench/peers/triton_decode.py) and the fused-
                    attention tutorial's forward (bench/triton_attention.py), with the 16-byte
                    divisibility hints a real launch specialises on
ptxc's rows: llama3_8b_paged_decode (its split kernel, GQA-packed on tensor cores),
llama3_8b_serve (varlen: the decode job with 4 queries per sequence) and llama3_8b_prefill, built from
specs/ (or read from --ptxc-out). A peer whose compiler is missing is skipped with one line.
Needs PTXAS and NVDISASM like bench/loop_quality.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "bench" / "peers"))

from ptxc.report.gpus import models_for_target  # noqa: E402
from ptxc.report.loop_model import loop_figures  # noqa: E402
from ptxc.report.sass import sass_profile  # noqa: E402
from ptxc.targets import get_target, occupancy  # noqa: E402

HEAD_DIM, KV_BYTES = 128, 2
# prefill: a K/V tile is read by every 128-query block of every query head of its KV head
# (4096 / 128 x GQA 4); all but the first read are assumed to hit L2 (loop_model.kv_reuse)
PREFILL_REUSE = 4096 // 128 * 4
PTXC_KERNELS = {"llama3_8b_paged_decode": "decode", "llama3_8b_serve": "decode",
                "llama3_8b_prefill": "prefill"}
PTXC_SPECS = ("vllm_paged.toml", "serve_varlen.toml", "llama3_8b_prefill.toml")


@dataclass(frozen=True)
class Peer:
    impl: str
    kernel: str
    job: str              # "decode" | "prefill"
    threads: int          # per CTA
    kv_rows: int          # K/V rows one CTA consumes per iteration of the SASS main loop
    driver: str = ""      # FlashInfer: bench/peers/fi_build.DRIVERS key (default: job)
    targets: tuple[str, ...] = ("sm_80", "sm_90")
    loop_warps: int = 0   # warps running the main loop (0: all; warp-specialised kernels fewer)
    tma: bool = False     # K/V arrive by TMA (not modelled: no bytes in flight, no row check)


PEERS = (
    # bdx 16 x bdy 4 (the group's heads) x bdz 2; 8 rows per tile, `#pragma unroll 2`
    Peer("flashinfer", "BatchDecodeWithPagedKVCacheKernel", "decode", 128, 16),
    # CTA_TILE_Q 128 (4 warps x 2 x 16 rows), NUM_MMA_KV 4 x 16 = 64 K/V rows per tile
    Peer("flashinfer", "SinglePrefillWithKVCacheKernel", "prefill", 128, 64),
    # FA3 (sm_90a): 1 producer warpgroup (TMA) + 2 consumer warpgroups (wgmma), 128 x 128 tiles
    Peer("flashinfer", "PrefillWithKVCacheKernel (FA3)", "prefill", 384, 128, "prefill_fa3",
         ("sm_90",), loop_warps=8, tma=True),
    Peer("triton", "gqa_paged_decode", "decode", 4 * 32, 32),          # BLOCK_N 32, 4 warps
    Peer("triton", "attn_fwd (tutorial)", "prefill", 8 * 32, 64),      # BLOCK_N 64, 8 warps
)


def _flashinfer(peer: Peer, arch: str, args) -> dict:
    import fi_build
    kind = peer.driver or peer.job
    arch = "sm_90a" if kind == "prefill_fa3" else arch    # TMA and wgmma need the a-variant
    got = fi_build.compile_kernel(kind, arch, fi_build.find_source(args.flashinfer), args.work)
    # dynamic shared memory as the dispatchers size it (static_asserts in the .cu files):
    # decode  max(2 stages x (K+V) x 8 rows x 128 x 2 B, 8 x 128 x 4 B) + 128 row offsets x 8 B
    # prefill sizeof(SharedStorage): Q 128 x 128 + K, V 64 x 128, f16
    # FA3     sizeof(SharedStorage): Q 128 x 128 + K 2 x 128 x 128 + (V 2 x 128 x 128 | O) + barriers
    smem = {"decode": 2 * 2 * 8 * HEAD_DIM * KV_BYTES + 128 * 8, "prefill": 64 * 1024,
            "prefill_fa3": 163920}[kind]
    return {"cubin": got["cubin"], "entry": got["entry"], "dynamic_smem": smem,
            "how": f"nvcc -arch={arch} -O3 -use_fast_math, {got['version']}"}


def _triton(peer: Peer, arch: str, args) -> dict:
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    if peer.job == "decode":
        import triton_decode as mod
        fn, sig, consts = mod.gqa_paged_decode, mod.SIGNATURE, mod.CONSTEXPRS
        warps, stages, divisible = mod.NUM_WARPS, mod.NUM_STAGES, ("stride_bt",)
    else:
        import triton_attention as mod
        fn, sig, consts = mod._kernel(), mod.SIGNATURE, mod.CONSTEXPRS
        warps, stages, divisible = mod.NUM_WARPS, mod.NUM_STAGES, ("stride_h", "stride_m", "N_CTX")
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(sig.items())
             if t.startswith("*") or n in divisible}
    src = ASTSource(fn, {**sig, **{k: "constexpr" for k in consts}}, consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", int(arch[3:]), 32),
                       options={"num_warps": warps, "num_stages": stages})
    assert warps * 32 == peer.threads
    return {"cubin": k.asm["cubin"], "entry": k.metadata.name, "dynamic_smem": int(k.metadata.shared),
            "how": f"triton {triton.__version__}, {warps} warps, {stages} stages"}


def peer_row(peer: Peer, arch: str, args) -> dict:
    from cubin_info import registers
    got = (_flashinfer if peer.impl == "flashinfer" else _triton)(peer, arch, args)
    profile = sass_profile(got["cubin"])       # nvdisasm + ptxc.report.loops, per function
    [(entry, loops)] = [(fn, a["loops"]) for fn, a in profile.items()
                        if fn == got["entry"] or got["entry"] is None]
    regs = registers(got["cubin"])[entry]
    occ = occupancy(get_target(arch), peer.threads, regs, got["dynamic_smem"])
    loop = loops["loops"][loops["main"]]
    warps = peer.loop_warps or peer.threads // 32
    # the declared K/V rows must be what the iteration loads: its vector (>= 8-byte) global
    # loads and copies are K and V (page ids and indices are 4-byte)
    loaded = 32 * sum(n * int(w) for kind in ("ldg_bytes", "ldgsts_bytes")
                      for w, n in loop[kind].items() if int(w) >= 8)
    if loaded * warps != (0 if peer.tma else peer.kv_rows * 2 * HEAD_DIM * KV_BYTES):
        raise SystemExit(f"{peer.impl} {peer.kernel} {arch}: declared {peer.kv_rows} K/V rows per "
                         f"iteration, but its loop loads {loaded * warps} bytes of K and V per CTA")
    fig = loop_figures(loop, warps, occ["ctas_per_sm"], peer.kv_rows, models_for_target(arch),
                       PREFILL_REUSE if peer.job == "prefill" else 1)
    return _row(peer.impl, peer.kernel, peer.job, arch, regs, occ, got["dynamic_smem"], fig, got["how"])


def _row(impl, kernel, job, target, regs, occ, smem, fig, how) -> dict:
    mma = fig["mma_flops"] / 4096      # in m16n8k16 HMMA (HGMMA counted by its FLOPs)
    return {"impl": impl, "kernel": kernel, "job": job, "target": target, "registers": regs,
            "ctas_per_sm": occ["ctas_per_sm"], "limited_by": occ["limited_by"],
            "smem_kib": round(smem / 1024, 1), "instructions": fig["instructions"],
            "tensor": fig["classes"]["tensor"], "per_hmma": round(fig["instructions"] / mma, 2) if mma else None,
            "per_kv_row": fig["instructions_per_kv_row"], "kv_rows": fig["kv_rows_per_iteration"],
            "inflight_kib_cta": round(fig["inflight_bytes_per_cta"] / 1024, 1),
            "inflight_kib_sm": round(fig["inflight_bytes_per_sm"] / 1024, 1),
            "bounds": {b["gpu"]: [b["bound"], b["bandwidth_fraction"]] for b in fig["bounds"]},
            "how": how}


def ptxc_rows(targets: list[str], out: Path | None) -> list[dict]:
    from ptxc.report.analysis import build_report
    with tempfile.TemporaryDirectory(prefix="ptxc-anchors-") as tmp:
        if out is None:
            from ptxc.pipeline.build import run_build
            out = Path(tmp) / "out"
            summary = run_build([ROOT / "specs" / s for s in PTXC_SPECS], out, targets=targets,
                                verify=True, progress=False)
            if summary["problems"]:
                raise SystemExit("\n".join(summary["problems"]))
        report = build_report([out])
    if not report["sass"]["available"]:
        raise SystemExit(f"SASS unavailable: {report['sass']['reason']}")
    rows = []
    for k in report["kernels"]:
        for t in k["targets"]:
            for L in t["launches"] if k["name"] in PTXC_KERNELS and t["target"] in targets else ():
                lp = L.get("loop")
                if lp and lp["kv_rows_per_iteration"]:
                    rows.append(_row("ptxc", k["name"], PTXC_KERNELS[k["name"]], t["target"],
                                     L["registers"], L["occupancy"], L["smem_bytes"], lp, "this tree"))
    return rows


def collect(args) -> tuple[list[dict], list[str]]:
    from fi_build import Unavailable
    rows, notes = ptxc_rows(args.targets, args.ptxc_out), []
    for peer in PEERS:
        for arch in (t for t in args.targets if t in peer.targets):
            try:
                rows.append(peer_row(peer, arch, args))
            except (ImportError, Unavailable) as e:   # no triton; no nvcc, wheel or curand
                # one line per reason: a whole peer's, or one kernel's (FA3 without curand)
                if not any(n.endswith(f"skipped ({e})") for n in notes):
                    who = f"{peer.impl} {peer.kernel}" if peer.driver else peer.impl
                    notes.append(f"{who}: skipped ({e})")
    order = {"decode": 0, "prefill": 1}
    rows.sort(key=lambda r: (order[r["job"]], r["target"], r["impl"] != "ptxc", r["impl"], r["kernel"]))
    return rows, notes


def print_table(rows: list[dict]) -> None:
    head = ("job", "impl", "kernel", "target", "regs", "CTA/SM", "smem KiB", "instr", "MMA",
            "instr/HMMA", "instr/KV row", "KiB fly/CTA", "KiB fly/SM", "bound (DRAM BW share)")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        bounds = "; ".join(f"{g}: {b}" + (f" ({f:.0%})" if f is not None else "")
                           for g, (b, f) in r["bounds"].items()) or "-"
        cells = (r["job"], r["impl"], r["kernel"], r["target"], r["registers"],
                 f"{r['ctas_per_sm']} ({r['limited_by']})", r["smem_kib"], r["instructions"], r["tensor"],
                 r["per_hmma"] or "-", r["per_kv_row"], r["inflight_kib_cta"], r["inflight_kib_sm"], bounds)
        print("| " + " | ".join(map(str, cells)) + " |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default="sm_80,sm_90", help="comma-separated (sm_80, sm_90)")
    ap.add_argument("--flashinfer", help="flashinfer-python wheel or flashinfer/data directory")
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "anchors",
                    help="extracted headers and cached cubins (default build/anchors)")
    ap.add_argument("--ptxc-out", type=Path, help="built ptxc artifacts (default: build the specs now)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    args.targets = [t for t in args.targets.split(",") if t]
    args.work.mkdir(parents=True, exist_ok=True)
    rows, notes = collect(args)
    if args.json:
        print(json.dumps({"rows": rows, "notes": notes}, indent=1))
    else:
        for n in notes:
            print(n)
        print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
