"""Front-end benchmark: spec -> PTX time per kernel, cold build of specs/ (with ptxas), warm
rebuild, and `ptxc --help` start-up. Prints a markdown table for docs/performance.md.

With triton importable (the optional `bench` extra), a second table puts ptxc next to Triton
on the same job: a causal d128 f16 FlashAttention-2 forward for sm_80, compiled without a GPU
(bench/triton_attention.py), to PTX and to cubin, median over --triton-repeat uncached
compiles, plus one compile in a fresh process for each; and the ratio Triton / ptxc.

    .venv/bin/python bench/frontend.py [--repeat 20] [--triton-repeat 5] [--no-triton]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--triton-repeat", type=int, default=5)
    ap.add_argument("--no-triton", action="store_true")
    args = ap.parse_args()
    from ptxc.pipeline.build import run_build
    from ptxc.pipeline.compiler import lower
    from ptxc.kernels import load_paths

    specs = load_paths([ROOT / "specs"])
    rows = []
    lower(specs[0], specs[0].targets[0])  # warm imports and template
    for s in specs:
        t = s.targets[0]
        secs = median_time(lambda: lower(s, t), args.repeat)
        ptx = lower(s, t)[0]
        rows.append((f"spec -> PTX: {s.name} [{t}]", secs, f"{len(ptx.splitlines())} PTX lines"))
    load = median_time(lambda: load_paths([ROOT / "specs"]), args.repeat)
    rows.append(("load + validate all specs", load, f"{len(specs)} kernels"))

    with tempfile.TemporaryDirectory() as tmp:
        cache, out = Path(tmp, "cache"), Path(tmp, "out")
        t0 = time.perf_counter()
        s1 = run_build([ROOT / "specs"], out, progress=False, cache_dir=cache)
        cold = time.perf_counter() - t0
        n = sum(len(k["targets"]) for k in s1["kernels"])
        rows.append(("cold build of specs/ (ptxas, -j CPUs)", cold, f"{n} PTX+cubin, {os.cpu_count()} CPUs"))
        warm = median_time(lambda: run_build([ROOT / "specs"], out, progress=False, cache_dir=cache), 5)
        s2 = run_build([ROOT / "specs"], out, progress=False, cache_dir=cache)
        rows.append(("warm rebuild of specs/ (in-process)", warm, f"{s2['files_changed']} files written"))
        env = {**os.environ, "PTXC_CACHE_DIR": str(cache)}
        script = Path(sys.executable).with_name("ptxc")   # absent where ptxc runs from a checkout
        ptxc = [str(script)] if script.exists() else [sys.executable, "-m", "ptxc.cli"]
        warm_cli = median_time(lambda: subprocess.run([*ptxc, "build", str(ROOT / "specs"), "--out", str(out)],
                                                      env=env, capture_output=True, check=True), 5)
        rows.append(("warm rebuild of specs/ (`ptxc build`, whole process)", warm_cli, ""))
    help_t = median_time(lambda: subprocess.run([sys.executable, "-m", "ptxc.cli", "--help"],
                                                capture_output=True, check=True), 10)
    rows.append(("`ptxc --help` start-up", help_t, "numpy, jinja2, cuda imported lazily"))
    bare = median_time(lambda: subprocess.run([sys.executable, "-c", "pass"], capture_output=True), 10)
    rows.append(("(python -c pass, for scale)", bare, ""))

    print("| measurement | median | note |\n|---|---:|---|")
    for name, secs, note in rows:
        print(f"| {name} | {secs * 1000:.1f} ms | {note} |")
    if not args.no_triton:
        print()
        print_triton_comparison(args.triton_repeat)


# The same kernel as bench/triton_attention.py: causal FA2 forward, d128, f16, sm_80, the
# tutorial's tile (BLOCK_M 128, BLOCK_N 64, 8 warps, 3 stages). Heads only size the grid.
PREFILL_SPEC = """
[[kernel]]
name = "frontend_prefill_d128_causal"
family = "prefill"
dtype = "f16"
head_dim = 128
num_heads = 32
causal = true
targets = ["sm_80"]
[kernel.tile]
block_m = 128
block_n = 64
num_warps = 8
num_stages = 3
"""


def print_triton_comparison(repeat: int) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import triton_attention as tri
    why = tri.available()
    if why:
        print(f"Triton side by side skipped: {why}")
        return
    from ptxc.pipeline.compiler import lower
    from ptxc.pipeline.ptxas import assemble, toolchain
    from ptxc.kernels import load_text
    spec = load_text(PREFILL_SPEC)[0]
    tc = toolchain()
    lower(spec, "sm_80")
    p_ptx = median_time(lambda: lower(spec, "sm_80"), max(repeat, 10))
    p_cubin = median_time(lambda: assemble(lower(spec, "sm_80")[0], "sm_80", tc, spec.name), repeat)
    lines = len(lower(spec, "sm_80")[0].splitlines())
    try:
        t = tri.measure(repeat)
    except Exception as e:   # report, do not hide, a Triton that cannot compile here
        print(f"Triton side by side skipped: triton.compile failed ({e.__class__.__name__}: "
              f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})")
        return
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp, "prefill.toml")
        spec_path.write_text(PREFILL_SPEC)
        ptxc = str(Path(sys.executable).with_name("ptxc"))
        p_cold = median_time(lambda: subprocess.run(
            [ptxc, "build", str(spec_path), "--out", str(Path(tmp, "out")), "--no-cache", "-j", "1"],
            capture_output=True, check=True), 3)
    t_cold = median_time(lambda: subprocess.run([sys.executable, str(ROOT / "bench" / "triton_attention.py"),
                                                 "--once"], capture_output=True, check=True), 3)

    def ratio(a, b):
        return f"{a / b:.0f}x" if a is not None and b else "-"

    print(f"Causal FA2 forward, d128, f16, sm_80 (ptxc {lines} PTX lines, Triton {t['version']} "
          f"{t['ptx_lines']} PTX lines), no GPU:\n")
    print("| compile | ptxc | Triton | Triton / ptxc |\n|---|---:|---:|---:|")
    rows = [("to PTX (median, in process)", p_ptx, t["to_ptx"]),
            ("to cubin, ptxas included (median, in process)", p_cubin, t["total"]),
            ("one kernel to cubin in a fresh process (imports included)", p_cold, t_cold)]
    for name, a, b in rows:
        tb = f"{b * 1000:.1f} ms" if b is not None else "n/a"
        print(f"| {name} | {a * 1000:.1f} ms | {tb} | {ratio(b, a)} |")
    print(f"\n(Triton's first compile in this process, loading LLVM: {t['first'] * 1000:.0f} ms; "
          f"its cache bypassed and cleared for every timed compile.)")


if __name__ == "__main__":
    main()
