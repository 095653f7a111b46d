"""What num_splits = "auto" picks for the example split-KV specs, and how evenly the split CTAs'
work falls on a mixed-length batch: the old rule (min(16, cdiv(2 x SMs, CTAs)), every sequence
cut into num_splits even shares) against the new one (SPLIT_HEADROOM x resident CTA slots from
the split kernel's own ptxas occupancy, one length-balanced chunk for the batch:
ptxc/kernels/attention/split_plan.py). Pure arithmetic over the built metadata; the kernels follow the
same model exactly (tests/pieces/test_split_balance.py). No GPU needed.

    .venv/bin/python bench/split_balance.py [--sms 108]

Per spec and target: CTAs/SM of the split kernel, the auto num_splits at batch 32, and on the
batch "1 x 32768 keys + 24 x 1024 + 4 x 128 + 3 x 0" (decode rows): busy CTAs, max / mean keys
per busy CTA, and the modelled makespan (CTAs dispatched in grid order onto the resident slots,
each costing its keys) over the ideal (all keys / slots).
"""

from __future__ import annotations

import argparse
import heapq
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ptxc.kernels.attention.split_plan import AUTO_SPLIT, AutoSplit, plan  # noqa: E402
from ptxc.pipeline.exprs import evaluate  # noqa: E402
from ptxc.runtime import apply_dim_rule, load, rule_ctas_per_sm  # noqa: E402

SPECS = [("specs/vllm_paged.toml", "llama3_8b_paged_decode"),
         ("specs/model_variants.toml", "gemma2_local_decode"),
         ("specs/llama3_8b_fp8.toml", "llama3_8b_fp8_decode"),
         ("specs/serve_varlen.toml", "llama3_8b_serve"),
         ("specs/serve_varlen.toml", "qwen25_7b_serve")]
LENS = [32768] + [1024] * 24 + [128] * 4 + [0] * 3


def makespan(works: list[list[int]], slots: int) -> int:
    """CTAs in grid order (one list per split index z, sequences inside) onto `slots` slots."""
    free = [0] * slots
    for w in works:
        t = heapq.heappop(free)
        heapq.heappush(free, t + w)
    return max(free)


def figures(lens, unit, S, columns, slots, balanced, auto):
    units = [-(-n // unit) for n in lens]
    if balanced:
        _, ranges = plan(units, S, auto)
        keys = [[max(0, min(e * unit, n) - a * unit) for a, e in r] for r, n in zip(ranges, lens)]
    else:   # the old even shares: rows [z * per, (z + 1) * per), per rounded up to the unit
        keys = []
        for n in lens:
            per = -(-(-(-n // S)) // unit) * unit
            keys.append([max(0, min((z + 1) * per, n) - min(z * per, n)) for z in range(S)])
    order = [k[z] for z in range(S) for k in keys for _ in range(columns)]   # x (heads) fastest
    busy = [k for k in order if k]
    ideal = -(-sum(order) // slots)
    return len(busy), max(busy), sum(busy) / len(busy), makespan(order, slots) / ideal


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sms", type=int, default=108)
    args = ap.parse_args()
    from ptxc.pipeline.artifacts import update_manifest, write_kernel
    from ptxc.pipeline.cache import Cache
    from ptxc.pipeline.compiler import build_all
    from ptxc.pipeline.ptxas import toolchain
    from ptxc.kernels import load_paths
    print(f"{args.sms} SMs; batch: 1 x 32768 + 24 x 1024 + 4 x 128 + 3 x 0 keys, one query each")
    print("| kernel | target | CTAs/SM | auto @ batch 32 old -> new | busy CTAs old -> new "
          "| max / mean keys per CTA old | new | makespan / ideal old -> new |")
    print("|---|---|---|---|---|---|---|---|")
    wanted = {name for _, name in SPECS}
    specs = [s for s in load_paths(sorted({ROOT / p for p, _ in SPECS})) if s.name in wanted]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        out.mkdir()
        metas = [write_kernel(out, b, verified=True)[0] for b in build_all(specs, Cache(None), toolchain())]
        update_manifest(out, metas)
        for _, name in SPECS:
            art = load(out / name)
            meta, rule = art.meta, art.meta["dim_rules"]["num_splits"]
            fam = meta["family"]
            for target, t in sorted(meta["targets"].items()):
                occ = rule_ctas_per_sm(meta, rule, target)
                cfg = t["config"]
                if fam == "decode":   # tensor-core path: block_n-key tiles; SIMT: rows per iteration
                    unit = (cfg["block_n"] if "block_n" in cfg else
                            cfg["num_warps"] * (32 // cfg["lanes_per_row"]) * cfg["kv_unroll"])
                    dims = {"batch": len(LENS)}
                    columns = evaluate(rule["auto"]["ctas"], {"batch": 1})
                else:   # varlen, one query per sequence: one query tile each
                    unit = cfg["block_n"]
                    dims = {"batch": len(LENS), "total_q": len(LENS)}
                    columns = meta["spec"]["num_kv_heads"]
                old = min(16, max(1, -(-2 * args.sms // max(1, evaluate(rule["auto"]["ctas"], dims)))))
                new = apply_dim_rule(rule, dims, args.sms, occ)
                slots = args.sms * occ
                b_old = figures(LENS, unit, old, columns, slots, False, None)
                b_new = figures(LENS, unit, new, columns, slots, True, AUTO_SPLIT.get(fam, AutoSplit()))
                print(f"| {name} | {target} | {occ} | {old} -> {new} | {b_old[0]} -> {b_new[0]} "
                      f"| {b_old[1]} / {b_old[2]:.0f} | {b_new[1]} / {b_new[2]:.0f} "
                      f"| {b_old[3]:.2f} -> {b_new[3]:.2f} |")



if __name__ == "__main__":
    main()
