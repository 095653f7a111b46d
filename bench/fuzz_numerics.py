"""Random specs against the fp64 reference on the emulator: the option space the tests sample.

    python bench/fuzz_numerics.py [--seed N] [--minutes M] [--cases N] [--log FILE.jsonl]
    python bench/fuzz_numerics.py --replay FILE.jsonl        # re-run the failures of a log
    python bench/fuzz_numerics.py --targets sm_90a,sm_100a --families prefill,varlen,mla  # focused

Each case draws a family (decode, prefill, varlen, mla; now and then kv_append, mla_append or
merge_states), a dtype, head sizes, heads, the family's options (masks, variants, layouts, page
sizes, FP8 caches, splits, sparse top-k, RoPE, slot mapping) and
one target (sm_80 … sm_100a), writes the spec, lets the spec loader refuse what the spec does
not allow (counted, not failures), builds it without ptxas (the emulator runs the PTX), and runs
`launch-test`'s check on the emulator at the family's default dimensions or a smaller draw of
them (the families' inputs already mix the serving cases: decode rows, prefill chunks, q_len > L,
L = 0, shuffled pages, NaN in every cache row no query reads). A failure is a row over its tolerance or any
exception other than a refusal, except an "edge": an f32 output (lse) over launch-test's
tolerance whose 4 sampled probability rounding grids fall short, within the tolerance of 64
(fine_grid_ratios). Each case is one JSON line (spec, dims, seed, outcome), so `--replay`
re-runs exactly the failures, errors and edges. Nothing here needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ptxc.errors import SpecError, UserError  # noqa: E402

TARGETS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a", "sm_90a", "sm_100a", "sm_100a", "sm_120")
HEAD_DIMS = (16, 24, 40, 64, 72, 96, 128, 128, 192, 256)


def _maybe(r: random.Random, p: float, value):
    return value if r.random() < p else None


def _variants(r: random.Random, causal: bool) -> dict:
    """Window / chunk (causal only), soft-cap, sinks, ALiBi: each now and then."""
    out = {}
    if causal and r.random() < 0.25:
        out["sliding_window"] = r.choice((1, 7, 33, 100))
    elif causal and r.random() < 0.15:
        out["attention_chunk"] = r.choice((8, 17, 64))
    if r.random() < 0.2:
        out["logits_soft_cap"] = r.choice((5.0, 30.0))
    if r.random() < 0.15:
        out["attention_sinks"] = True
    if r.random() < 0.12:
        out["alibi"] = True
    return out


def _heads(r: random.Random, fields: dict) -> None:
    kv = r.choice((1, 1, 2, 3))
    fields["num_kv_heads"] = kv
    fields["num_heads"] = kv * r.choice((1, 2, 4, 5, 8))


def _fp8_cache(r: random.Random, fields: dict, p: float = 0.25) -> None:
    if r.random() < p:
        fields["kv_dtype"] = r.choice(("e4m3", "e5m2"))
        fields["kv_scale"] = r.choice(("tensor", "device", "head"))


def draw_spec(r: random.Random, targets=TARGETS, families=None) -> tuple[dict, dict, str]:
    """(fields, tile, target) of one random kernel (`targets`, `families`: a focused campaign)."""
    family = r.choice(families or ("decode", "prefill", "varlen", "varlen", "mla", "mla", "copies"))
    target = r.choice(targets)
    if family == "copies":
        return _draw_copies(r, target)
    f: dict = {"family": family, "dtype": r.choice(("f16", "bf16", "bf16"))}
    tile: dict = {}
    if family == "mla":
        f["num_heads"] = r.choice((16, 16, 32, 64))
        f["kv_lora_rank"] = r.choice((128, 192, 256, 512, 512))
        f["qk_rope_head_dim"] = r.choice((16, 32, 64, 64))
        f["softmax_scale"] = 0.0723
        f["kv_layout"] = r.choice(("paged", "paged", "contiguous"))
        if f["kv_layout"] == "paged":
            f["page_size"] = r.choice((1, 3, 16, 17, 64))
        f["kv_dtype"] = r.choice((f["dtype"], f["dtype"], "e4m3", "e4m3_ds"))
        if f["kv_dtype"] == "e4m3_ds":   # fp8_ds_mla's row: 512 + 64, bf16, paged
            f.update(dtype="bf16", kv_lora_rank=512, qk_rope_head_dim=64, kv_layout="paged",
                     page_size=f.get("page_size", 64))
        if f["kv_layout"] == "paged" and r.random() < 0.35:
            f["sparse_topk"] = r.choice((8, 16, 40, 64))
        f["num_splits"] = r.choice((1, 2, 3, "auto"))
        f["return_lse"] = r.random() < 0.5
        if target in ("sm_90a", "sm_100a") and r.random() < 0.4:
            tile.update(r.choice(({"block_m": 64}, {"kv_loads": "cp_async"}, {"split_scores": False},
                                  {"seesaw": True}, {"dequant_warpgroup": False}, {"block_n": 16})))
        if f["kv_dtype"] == "e4m3" and r.random() < 0.3:
            f["qk_products"] = "e4m3"
            if target == "sm_90a" and f["dtype"] == "bf16" and r.random() < 0.5:
                # S on FP8 wgmma: mostly where it applies (64 / 128 heads of 512 + 64 / 128
                # columns, dense, the tile's own keys), else refused in one line
                tile["fp8_scores"] = True
                if r.random() < 0.8:
                    f.update(num_heads=r.choice((64, 128)), kv_lora_rank=512,
                             qk_rope_head_dim=r.choice((64, 64, 128)))
                    f.pop("sparse_topk", None)
                    for key in ("block_m", "split_scores", "dequant_warpgroup", "kv_loads", "seesaw"):
                        tile.pop(key, None)
        return f, tile, target
    f["head_dim"] = r.choice(HEAD_DIMS)
    _heads(r, f)
    f["return_lse"] = r.random() < 0.4
    if family == "decode":
        f["kv_layout"] = r.choice(("contiguous", "paged", "paged", "pointer_array"))
        if f["kv_layout"] == "paged":
            f["page_size"] = r.choice((1, 3, 8, 16, 17))
        f["num_splits"] = r.choice((1, 1, 2, 3, "auto"))
        f["math"] = r.choice(("auto", "auto", "mma", "simt"))
        f["append_kv"] = r.random() < 0.15 and f["kv_layout"] != "pointer_array"
        _fp8_cache(r, f)
        f.update(_variants(r, causal=True))
        if r.random() < 0.25:
            tile.update(r.choice(({"block_n": 16}, {"block_n": 32}, {"num_stages": 3}, {"num_stages": 1},
                                  {"kv_loads": "cp_async"}, {"warp_specialize": True})))
        return f, tile, target
    causal = r.random() < 0.7
    f["causal"] = causal
    if r.random() < 0.2 and f["head_dim"] >= 16:
        f["head_dim_v"] = r.choice([d for d in range(8, f["head_dim"] + 1, 8)])
    if family == "prefill":
        if not causal and r.random() < 0.2:
            f["custom_mask"] = "packed"
        f.update(_variants(r, causal))
        if r.random() < 0.2:
            tile.update(r.choice(({"warp_rows": 32}, {"smem_layout": "swizzled"}, {"block_n": 32},
                                  {"num_stages": 3}, {"block_m": 64, "num_warps": 4})))
        if target == "sm_90a" and r.random() < 0.3:
            tile.update(r.choice(({"pingpong": True, "block_m": 128}, {"kv_loads": "cp_async"},
                                  {"warp_specialize": False}, {"tma_store": True}, {"persistent": True})))
        if target == "sm_100a" and r.random() < 0.3:
            tile.update(r.choice(({"q_tiles": 2}, {"correction": True}, {"exp2_poly": 3})))
        return f, tile, target
    # varlen
    f["kv_layout"] = r.choice(("paged", "paged", "contiguous"))
    if f["kv_layout"] == "paged":
        f["page_size"] = r.choice((1, 3, 8, 16, 17, 64))
    f["num_splits"] = r.choice((1, 1, 2, 3, "auto"))
    if causal and r.random() < 0.15:
        f["custom_mask"] = "tree"
    elif not causal and r.random() < 0.2:
        f["custom_mask"] = "packed"
    _fp8_cache(r, f)
    f.update(_variants(r, causal))
    if r.random() < 0.2:
        tile["num_stages"] = r.choice((1, 2, 3))
    if target in ("sm_90a", "sm_100a") and r.random() < 0.25:
        tile.update(r.choice(({"kv_loads": "cp_async"}, {"pingpong": True, "block_m": 128},
                              {"correction": True}, {"block_n": 32}, {"block_m": 64})))
    return f, tile, target


def _draw_copies(r: random.Random, target: str) -> tuple[dict, dict, str]:
    """The families around attention: kv_append (RoPE, FP8 quantisation, slot mapping),
    mla_append (latent rows, e4m3 / e4m3_ds) and merge_states."""
    family = r.choice(("kv_append", "mla_append", "merge_states"))
    f: dict = {"family": family, "dtype": r.choice(("f16", "bf16", "f32" if family != "mla_append" else "bf16"))}
    if family == "merge_states":
        f.update(head_dim=r.choice((16, 40, 128, 512)), num_heads=r.choice((1, 3, 8)), return_lse=r.random() < 0.5)
        return f, {}, target
    if family == "mla_append":
        f.update(num_heads=1, kv_lora_rank=r.choice((128, 256, 512)), qk_rope_head_dim=r.choice((16, 64)),
                 page_size=r.choice((1, 3, 16, 64)), kv_dtype=r.choice((f["dtype"], "e4m3", "e4m3_ds")))
        if f["kv_dtype"] == "e4m3_ds":
            f.update(kv_lora_rank=512, qk_rope_head_dim=64, dtype="bf16")
        if f["kv_dtype"] == "e4m3" and r.random() < 0.5:
            f["kv_scale"] = "device"
        if r.random() < 0.5:
            f["rope"] = r.choice(("neox", "gptj"))
        return f, {}, target
    kv = r.choice((1, 2, 3))
    f.update(head_dim=r.choice((16, 40, 64, 128, 256)), num_heads=kv, num_kv_heads=kv,
             kv_layout=r.choice(("contiguous", "paged")))
    if f["kv_layout"] == "paged":
        f["page_size"] = r.choice((1, 3, 16, 17))
        if r.random() < 0.5:
            f["index"] = "slot_mapping"
    _fp8_cache(r, f, 0.35)
    if r.random() < 0.4:
        f["rope"] = r.choice(("neox", "gptj"))
        if r.random() < 0.4:
            f["rotary_dim"] = r.choice([d for d in (8, 16, 32, 64) if d <= f["head_dim"]])
    return f, {}, target


def spec_text(name: str, fields: dict, tile: dict, target: str) -> str:
    def toml(v):
        return json.dumps(v) if not isinstance(v, bool) else str(v).lower()
    lines = ["[[kernel]]", f'name = "{name}"', *(f"{k} = {toml(v)}" for k, v in fields.items()),
             f'targets = ["{target}"]']
    if tile:
        lines += ["[kernel.tile]", *(f"{k} = {toml(v)}" for k, v in tile.items())]
    return "\n".join(lines) + "\n"


def draw_dims(r: random.Random, defaults: dict, page_size: int = 16) -> dict:
    """The family's defaults, or (half the time) a smaller or odder draw of them, or (one time in
    ten) a long one: a few sequences of up to ~1000 keys (many tiles, every stage buffer and
    split reused)."""
    if r.random() < 0.1:
        long = {"batch": 2, "max_seq_len": 1000, "seq_q": 65, "seq_k": 1000,
                "max_pages_per_seq": -(-1000 // page_size)}
        out = {k: v for k, v in long.items() if k in defaults}
        if "num_pages" in defaults and "max_pages_per_seq" in out:
            out["num_pages"] = 2 * out["max_pages_per_seq"] + 5
        return out
    if r.random() < 0.45:
        return {}
    out = {}
    for k, v in defaults.items():
        if k == "batch":
            out[k] = r.choice((1, 2, 3, v))
        elif k in ("seq_q", "seq_k", "max_seq_len"):
            out[k] = r.choice((1, 2, 17, 63, 65, 113))
        elif k == "max_pages_per_seq":
            out[k] = r.choice((1, 2, v, v + 2))
    if "num_pages" in defaults and "max_pages_per_seq" in out:
        out["num_pages"] = out.get("batch", defaults.get("batch", 1)) * out["max_pages_per_seq"] + 3
    return out


def _refusal(e: Exception, case: dict) -> str:
    """"refused", or "error" where the refusal names a tile key the case never gave: it blames
    the user for a value ptxc derived (16-head sparse MLA once refused "num_warps = 1" so)."""
    key = getattr(e, "key", None) or ""
    return "error" if key.startswith("tile.") and key[len("tile."):] not in case["tile"] else "refused"


def run_case(case: dict, workdir: Path) -> dict:
    """Build and check one case; returns it with "outcome" (pass, refused, fail, error -- a
    defect, a refusal of a tile key the case did not give included -- or edge: over
    launch-test's tolerance only where its 4 sampled rounding grids fall short)."""
    from ptxc.kernels import FAMILIES, load_text
    from ptxc.pipeline.build import run_build
    from ptxc.runtime.artifact import load
    from ptxc.runtime.launch_test import check_artifact
    text = spec_text(case["name"], case["fields"], case["tile"], case["target"])
    try:
        [spec] = load_text(text, f"{case['name']}.toml")
    except SpecError as e:
        return {**case, "outcome": _refusal(e, case), "why": str(e).splitlines()[0][:300]}
    src = workdir / f"{case['name']}.toml"
    src.write_text(text)
    out = workdir / case["name"]
    t0 = time.perf_counter()
    try:
        summary = run_build([src], out, verify=False, progress=False)
        if summary["problems"]:
            return {**case, "outcome": "error", "why": "; ".join(summary["problems"])[:600]}
        art = load(out / case["name"])
        if case.get("dims") is None:
            defaults = FAMILIES[spec.family].interface(spec).defaults
            page = dict(spec.options).get("page_size") or (64 if spec.family == "mla" else 16)
            case = {**case, "dims": draw_dims(random.Random(case["seed"]), defaults, page)}
        rows = check_artifact(art, backend="emu", shapes=case["dims"], seed=case["seed"])
    except UserError as e:     # a refusal (SpecError, InputError): not the kernel's defect
        return {**case, "outcome": _refusal(e, case), "why": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    except Exception as e:  # noqa: BLE001 -- anything else (IRError, the emulator's faults) is a defect
        return {**case, "outcome": "error", "why": f"{type(e).__name__}: {e}"[:600],
                "trace": traceback.format_exc()[-2000:], "secs": round(time.perf_counter() - t0, 1)}
    bad = [r.to_dict() for r in rows if not r.ok]
    edge = fine_grid_ratios(art, spec, case, bad) if bad else None
    return {**case, "outcome": "edge" if edge else "fail" if bad else "pass",
            "secs": round(time.perf_counter() - t0, 1),
            "rows": [{"output": r.tensor, "max_error": r.max_error, "tol": r.tol} for r in rows],
            **({"bad": bad} if bad else {}), **({"fine_grid_ratios": edge} if edge else {})}


FINE_GRIDS = 64


def fine_grid_ratios(art, spec, case: dict, bad: list[dict]) -> dict | None:
    """A tolerance edge, not a defect: where every failing output is an f32 one whose baseline
    samples the probabilities' rounding grids (launch-test: the largest of PROBS_SHIFTS' 4) and
    passes against the largest of FINE_GRIDS grids 2^(k/64) -- the kernel's own grid is one of
    a continuum (its lazy running max), and with one dominant key a row's error on an unlucky
    grid is about twice the 4 sampled ones' (seen with e4m3_ds rows, whose group scales span
    six decades). Returns {output: error / fine tolerance}, or None (a failure to report)."""
    import numpy as np

    from ptxc.kernels import FAMILIES
    from ptxc.reference import Precision, max_abs_error, tolerance
    family = FAMILIES[spec.family]
    sums = family.row_sum_dtype(spec) if family.row_sum_dtype else None
    names = {row["tensor"] for row in bad}
    if sums is None or any(art.meta["tensors"].get(n, {}).get("dtype") != "f32" for n in names):
        return None
    dims = {**family.interface(spec).defaults, **case["dims"]}
    inputs = family.make_inputs(spec, dims, np.random.default_rng(case["seed"]))
    ref = family.reference(spec, inputs)
    out = art.run(inputs, target=case["target"], backend="emu")
    naive = [family.reference(spec, inputs, dtype=Precision("f32", probs=sums, probs_scale=2 ** (k / FINE_GRIDS)))
             for k in range(FINE_GRIDS)]
    ratios = {n: max_abs_error(out[n], ref[n]) / max(tolerance(x[n], ref[n]) for x in naive) for n in names}
    return {n: round(r, 3) for n, r in ratios.items()} if all(r <= 1 for r in ratios.values()) else None


def drawn_cases(seed: int, n: int, targets=TARGETS, families=None):
    """The campaign's cases, drawn as they are run (the deadline usually ends it)."""
    r = random.Random(seed)
    for k in range(n):
        fields, tile, target = draw_spec(r, targets, families)
        yield {"name": f"fz{seed}_{k}", "fields": fields, "tile": tile, "target": target,
               "seed": r.randrange(1 << 30), "dims": None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", type=int, default=1_000_000)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--log", type=Path, help="append one JSON line per case")
    ap.add_argument("--replay", type=Path, help="re-run the failures, errors and edges of a log")
    ap.add_argument("--targets", help="comma-separated: draw only these targets (a focused campaign)")
    ap.add_argument("--families", help="comma-separated: decode, prefill, varlen, mla, copies")
    args = ap.parse_args(argv)
    if args.replay:
        cases = [{k: c[k] for k in ("name", "fields", "tile", "target", "seed", "dims")}
                 for c in map(json.loads, args.replay.read_text().splitlines())
                 if c["outcome"] in ("fail", "error", "edge")]
    else:
        cases = drawn_cases(args.seed, args.cases,
                            tuple(args.targets.split(",")) if args.targets else TARGETS,
                            tuple(args.families.split(",")) if args.families else None)
    deadline = time.monotonic() + args.minutes * 60
    counts: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="ptxc-fuzz-") as tmp:
        for case in cases:
            if time.monotonic() > deadline:
                break
            res = run_case(case, Path(tmp))
            counts[res["outcome"]] = counts.get(res["outcome"], 0) + 1
            if res["outcome"] in ("fail", "error", "edge"):
                print(f"{res['outcome'].upper()}: {res['name']} {res['target']} {json.dumps(res['fields'])} "
                      f"tile={json.dumps(res['tile'])} dims={json.dumps(res.get('dims'))}: "
                      f"{res.get('why') or res.get('fine_grid_ratios') or res.get('bad')}", flush=True)
            if args.log:
                with args.log.open("a") as fh:
                    fh.write(json.dumps(res) + "\n")
    print(json.dumps(counts))
    return 1 if counts.get("fail") or counts.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
