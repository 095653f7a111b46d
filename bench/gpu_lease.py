"""Check and time prebuilt artifact sets on a GPU inside a short lease, most important first.

    python bench/gpu_lease.py --out DIR --deadline 360 [--shape a=1,b=2 ...] SET_DIR [SET_DIR ...]

`bench/gpu_suite.sh` runs everything and needs the time to; a lease of a few minutes does not
have it. This driver takes output directories built elsewhere (`ptxc build specs/ --out A`,
`ptxc build specs/ --target sm_90a --out B`: the cubins our SASS figures describe) and works
through a plan in priority order:

1. launch-test (cuda backend, fp64 reference) of every arch-specific image the device runs
   (sm_90a on a Hopper): code that no GPU has run before goes first;
2. `ptxc bench` of the priority kernels (`PRIORITY`) on that image, with torch SDPA side by side,
   then the same kernel on the portable image (sm_90 cubin) for the mma.sync comparison;
3. launch-test of the portable images, then the remaining kernels' timings.

Each item's result is one JSON line in DIR/results.jsonl, written as soon as it is known, so a
lease that ends mid-plan keeps everything finished. Items run in a child process; a CUDA error
(sticky for its context), a crash or an item silent for --item-timeout seconds ends the child,
the item is recorded as failed and a new child resumes with the next one.
`bench/gpu_lease_summary.py DIR` turns the lines into markdown for docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

# The kernels whose timings answer open questions (wgmma vs mma.sync prefill/varlen, decode
# bandwidth, MLA), in the order they are timed.
PRIORITY = (
    "llama3_8b_prefill", "mha_d64_bf16_prefill", "llama3_8b_serve", "llama3_8b_decode",
    "deepseek_v3_mla_decode", "mqa_d256_prefill", "qwen25_7b_serve", "llama3_8b_paged_decode",
    "kimi_k2_mla_decode", "deepseek_v3_mla_decode_fp8_ds", "deepseek_v3_mla_decode_fp8",
    "deepseek_v32_mla_sparse_decode", "llama3_8b_fp8_varlen", "llama3_8b_fp8_decode",
    "llama3_8b_eagle_verify", "mistral_7b_decode", "mqa_split_bf16_decode", "mqa_d256_serve",
    "mqa_d256_decode", "deepseek_v3_prefill", "deepseek_v3_mla_prefill", "gpt_oss_prefill",
    "gpt_oss_serve", "gpt_oss_decode", "llama3_8b_packed_mask", "deepseek_v32_mla_sparse_decode_fp8",
)


def artifact_dirs(set_dir: Path) -> dict[str, Path]:
    return {p.name: p for p in sorted(set_dir.iterdir()) if (p / f"{p.name}.json").is_file()}


def targets_of(path: Path) -> list[str]:
    return sorted(_meta(path)["targets"])


def _meta(path: Path) -> dict:
    return json.loads((path / f"{path.name}.json").read_text())


def plan(sets: list[Path], sm: int, shapes: list[dict] | None = None, every: bool = False,
         only: list[str] | None = None) -> list[dict]:
    """The ordered items: {"kind": "check"|"bench", "kernel", "path", "target", "compare", "shape"}.
    Each of `shapes` (--shape) adds a timing of every priority kernel that has all the dims it names, right
    after the priority kernels' default-shape timings, on the arch-specific image where built.
    `only`: just these kernels, each a priority kernel, in this order (an A/B question that must
    be answered first); a name the sets lack is an error."""
    own, arch = f"sm_{sm}", f"sm_{sm}a"
    images: dict[str, dict[str, Path]] = {}     # kernel -> target -> artifact dir (first set wins)
    for s in sets:
        for name, path in artifact_dirs(s).items():
            for t in targets_of(path):
                if t in (own, arch):
                    images.setdefault(name, {}).setdefault(t, path)
    if only:
        missing = [n for n in only if n not in images]
        if missing:
            raise SystemExit(f"gpu_lease: --only names kernels the sets do not hold for sm_{sm}: "
                             f"{', '.join(missing)}")
        images = {n: images[n] for n in only}
    rank = {n: i for i, n in enumerate(only or PRIORITY)}
    names = sorted(images, key=lambda n: (rank.get(n, len(rank)), n))
    if every:   # an A/B set: every kernel is a priority kernel, in PRIORITY's order, then by name
        rank = {n: i for i, n in enumerate(names)}
    items = []

    def add(kind, name, target, compare=False, shape=None):
        if target in images[name]:
            path = images[name][target]
            items.append({"kind": kind, "kernel": name, "path": str(path), "target": target,
                          "compare": compare, "shape": shape or {},
                          "buffer_bytes": (buffer_bytes(_meta(path), shape or {}) or 0) if kind == "bench" else 0})
    for n in names:
        add("check", n, arch)
    for n in names:
        if n in rank:
            add("bench", n, arch, compare=True)
            add("bench", n, own, compare=arch not in images[n])
    for shape in shapes or []:
        for n in names:
            path = images[n].get(arch) or images[n].get(own)
            if n in rank and set(shape) <= set(_meta(path)["dims"]) and buffer_bytes(_meta(path), shape):
                add("bench", n, arch if arch in images[n] else own, compare=True, shape=shape)
    for n in names:
        add("check", n, own)
    for n in names:
        if n not in rank:
            add("bench", n, arch, compare=True)
            add("bench", n, own, compare=arch not in images[n])
    return items


# Making and uploading a bench's buffers runs at roughly this rate (device bytes a second; the
# host builds bf16 tensors as f32 first): an item gets --item-timeout plus its buffers' share
# (a 128-head latent cache's 5.4 GB took longer than 30 s on the H200's host).
BUFFER_BYTES_PER_S = 100e6


def buffer_bytes(meta: dict, shape: dict) -> int | None:
    """Bytes of every buffer a bench at `shape` needs, by the runtime's own count
    (runtime.abi.check_buffer_budget), or None where the runtime refuses them: a --shape that
    suits one kernel can be enormous for another with the same dims (a batch of 64 paged
    sequences of 4096 tokens is 1 GiB of llama3's cache, 40 GiB of a 128-head latent one)."""
    from ptxc.errors import InputError
    from ptxc.report.costs import resolve_dims
    from ptxc.runtime.abi import check_buffer_budget
    dims = resolve_dims(meta, shape, num_sms=132, target=sorted(meta["targets"])[0])
    try:
        return check_buffer_budget(meta, None, dims)
    except InputError:
        return None


def run_item(item: dict, device, dry: bool) -> dict:
    from ptxc.runtime import load
    if item["kind"] == "check":
        from ptxc.runtime.launch_test import check_artifact
        art = load(item["path"])
        if dry:
            return {"rows": []}
        rows = check_artifact(art, backend="cuda", shapes={}, seed=0, targets=[item["target"]], device=device)
        return {"rows": [r.to_dict() for r in rows], "pass": all(r.ok for r in rows)}
    if dry:
        from ptxc.gpu.bench import bench_inputs
        from ptxc.report.costs import resolve_dims
        meta = load(item["path"]).meta
        dims = resolve_dims(meta, item["shape"], num_sms=132, target=item["target"])
        bench_inputs(meta, dims)
        return {"rows": []}
    from ptxc.gpu.bench import run_bench
    result = run_bench([item["path"]], shapes=item["shape"], target=item["target"], compare=item["compare"])
    return {"rows": result.pop("results"), "device": result}


def apply_patches(patches: list[str]) -> None:
    """--patch MODULE:NAME=INT ...: set compiler constants in this process before any artifact
    loads (the checked loader re-derives each PTX from its spec, so an A/B of a constant -- round
    17's split-rule variants, built by bench/split_rule_ab.py at dd55dec -- must load each
    variant set with the values it was built with). A malformed argument, an unknown module or
    name, or a value that is not an integer is refused in one line."""
    import importlib
    import re
    for p in patches:
        m = re.fullmatch(r"([\w.]+):(\w+)=(-?\d+)", p)
        if m is None:
            raise SystemExit(f"--patch {p}: expected MODULE:NAME=INT")
        module, name, value = m.groups()
        try:
            mod = importlib.import_module(module)
        except ImportError:
            raise SystemExit(f"--patch {p}: no module {module}") from None
        if not hasattr(mod, name):
            raise SystemExit(f"--patch {p}: {module} has no {name}")
        setattr(mod, name, int(value))


def child(items_path: Path, results: Path, start: int, dry: bool, patches: list[str]) -> int:
    apply_patches(patches)
    items = json.loads(items_path.read_text())
    device = None
    if not dry:
        from ptxc.runtime.cuda import CudaDevice
        device = CudaDevice.open()
    for index in range(start, len(items)):
        item = items[index]
        t0 = time.perf_counter()
        try:
            line = {"status": "ok", **run_item(item, device, dry)}
        except Exception as e:   # recorded, then a fresh process (a CUDA error poisons the context)
            line = {"status": "error", "error": f"{e.__class__.__name__}: {e}"[:2000]}
        line.update(index=index, seconds=round(time.perf_counter() - t0, 3), **item)
        with results.open("a") as f:
            f.write(json.dumps(line, sort_keys=True) + "\n")
        if line["status"] != "ok":
            return 3
    return 0


def lines(results: Path) -> int:
    return len(results.read_text().splitlines()) if results.exists() else 0


def parent(args) -> int:
    sm = args.sm
    if sm is None:
        from ptxc.runtime.cuda import CudaDevice
        sm = CudaDevice.open().sm
    args.out.mkdir(parents=True, exist_ok=True)
    from ptxc.runtime.launch_test import parse_assignments
    items_path, results = args.out / "plan.json", args.out / "results.jsonl"
    if args.resume and items_path.exists():
        # the plan already there, from the first item without a result; an item the last
        # call's deadline cut (always the last line) runs again
        items = json.loads(items_path.read_text())
        kept = [t for t in (results.read_text().splitlines() if results.exists() else [])
                if json.loads(t).get("error") != "deadline"]
        results.write_text("".join(t + "\n" for t in kept))
    else:
        items = plan(args.sets, sm, [parse_assignments([text], "--shape") for text in args.shape], args.every,
                     args.only.split(",") if args.only else None)
        items_path.write_text(json.dumps(items, indent=1))
        results.unlink(missing_ok=True)
    end = time.monotonic() + args.deadline
    print(f"gpu_lease: {len(items)} items for sm_{sm}, deadline {args.deadline} s", file=sys.stderr, flush=True)
    while lines(results) < len(items) and time.monotonic() < end:
        start = lines(results)
        cmd = [sys.executable, __file__, "--child", str(items_path), str(results), str(start)]
        cmd += [f"--patch={p}" for p in args.patch]
        proc = subprocess.Popen(cmd + (["--dry"] if args.dry else []))
        seen, last = start, time.monotonic()
        while proc.poll() is None:
            time.sleep(0.25)
            now = time.monotonic()
            if lines(results) != seen:
                seen, last = lines(results), now
            allowed = args.item_timeout + items[min(seen, len(items) - 1)].get("buffer_bytes", 0) / BUFFER_BYTES_PER_S
            if now > end or now - last > allowed:
                proc.kill()
                proc.wait()
                break
        if lines(results) == seen and seen < len(items) and proc.returncode not in (0, 3):
            why = "deadline" if time.monotonic() > end else \
                f"no result in time ({args.item_timeout} s + the buffers' share), or the process died " \
                f"(exit {proc.returncode})"
            with results.open("a") as f:
                f.write(json.dumps({"status": "timeout", "error": why, "index": seen, **items[seen]},
                                   sort_keys=True) + "\n")
        print(f"gpu_lease: {lines(results)}/{len(items)} done", file=sys.stderr, flush=True)
    return 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), "--dry" in sys.argv,
                     [a.split("=", 1)[1] for a in sys.argv[5:] if a.startswith("--patch=")])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sets", nargs="+", type=Path, help="ptxc build output directories")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--deadline", type=float, default=360.0, help="seconds for the whole plan")
    ap.add_argument("--item-timeout", type=float, default=60.0,
                    help="seconds one item may take, plus its buffers' bytes at BUFFER_BYTES_PER_S")
    ap.add_argument("--sm", type=int, default=None, help="plan for this SM (default: the device's)")
    ap.add_argument("--shape", action="append", default=[],
                    help="also time the priority kernels whose dims it names at this shape, e.g. "
                         "batch=1,seq_q=16384,seq_k=16384 (repeatable)")
    ap.add_argument("--every", action="store_true",
                    help="treat every kernel of the sets as a priority kernel (an A/B set: each timed "
                         "at every --shape that fits it)")
    ap.add_argument("--only", default=None, metavar="NAME[,NAME...]",
                    help="just these kernels of the sets, in this order, each timed at every --shape "
                         "that fits it (the A/B pairs a short call must answer first)")
    ap.add_argument("--resume", action="store_true",
                    help="continue the plan already in --out (a second device call after a deadline: "
                         "the sets and --shape given are not re-planned)")
    ap.add_argument("--dry", action="store_true", help="no GPU: load, plan and make inputs only")
    ap.add_argument("--patch", action="append", default=[], metavar="MODULE:NAME=INT",
                    help="set a compiler constant in every process that loads artifacts (an A/B "
                         "set built with the same value; repeatable)")
    args = ap.parse_args()
    apply_patches(args.patch)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
