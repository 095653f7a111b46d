"""From one warp's steady-state loop iteration (ptxc.report.loops) to per-CTA and per-SM figures
and an estimated bound on each GPU model.

All resident CTAs of an SM (the launch's theoretical occupancy) run one iteration each; the
time that takes is bounded below by each of:
  issue      warp-instructions / 4 schedulers per SM, one instruction per clock each
  tensor     mma FLOPs / the SM's share of the dense tensor peak (HMMA on sm_90 is counted at
             the wgmma peak, so optimistic there), a wgmma whose shared-memory operands stream
             slower than its math (SS forms below N = 64) at the operands' time (`tensor_flops`)
  fp32       FP32-pipe lane operations / the SM's f32 lanes per clock (f32 peak / 2 / clock)
  bandwidth  DRAM bytes / the SM's share of DRAM bandwidth, where DRAM bytes = loaded bytes /
             reuse: a K/V tile read by `reuse` CTAs (prefill's query blocks and GQA heads) comes
             from DRAM once and from L2 otherwise (L2 bandwidth is not modelled)
  latency    Little's law: DRAM bytes / (mean bytes in flight per SM / DRAM latency)
The largest is the estimated bound; `bandwidth_fraction` = bandwidth time / that time, the
fraction of DRAM bandwidth the loop can use. Warps of a CTA are assumed to run the same path.
"""

from __future__ import annotations

from ..pipeline.metadata import ELEMENT_BYTES
from .loops import HMMA_16816_FLOPS

BOUNDS = ("issue", "tensor", "fp32", "bandwidth", "latency")
COPY_FAMILIES = ("kv_append", "mla_append", "merge_states")   # no attention loop: rows copied once


def kv_rows_per_iteration(family: str, config: dict, entry: str) -> int | None:
    """K/V rows one CTA consumes per iteration of its main loop (None: not an attention loop)."""
    if entry.endswith(("_reduce", "_append")) or family in COPY_FAMILIES:
        return None
    if "block_n" in config:   # MLA's seesaw: each warpgroup's iteration is its tile and the other's
        return int(config["block_n"]) * (2 if config.get("seesaw") else 1)
    if {"num_warps", "lanes_per_row", "kv_unroll"} <= config.keys():
        return config["num_warps"] * (32 // config["lanes_per_row"]) * config["kv_unroll"]
    return None


def kv_reuse(family: str, config: dict, spec: dict, dims: dict) -> int:
    """How many CTAs read each K/V tile: prefill's query blocks of every query head of a KV head,
    varlen's (and MLA's) packed query tiles of a sequence and KV head (all but the first are
    assumed to hit L2), 1 for decode (one CTA per KV head's group)."""
    if family in ("mla", "varlen") and "block_m" in config and "total_q" in dims:
        # every packed tile of a sequence's (token, head) rows reads its K/V (MLA: latent) rows
        q = max(1, dims["total_q"] // max(1, dims.get("batch", 1)))
        group = max(1, spec.get("num_heads", 1) // max(1, spec.get("num_kv_heads") or 1))
        return max(1, -(-q * group // config["block_m"]))
    if "block_m" in config and "seq_q" in dims:
        group = max(1, spec.get("num_heads", 1) // max(1, spec.get("num_kv_heads") or spec.get("num_heads", 1)))
        return max(1, -(-dims["seq_q"] // config["block_m"])) * group
    return 1


def with_tma_loads(loop: dict, launch: dict, tensors: dict, config: dict, kv_rows: int | None,
                   warps_per_cta: int) -> dict:
    """A loop whose K/V tiles arrive by TMA shows no load bytes in its SASS (a box's size lives
    in the tensor map), so they are modelled from the launch instead: per iteration the CTA
    loads kv_rows rows of every tensor a `tensor_map` parameter maps inside the loop (K and V;
    Q is loaded once, before it), and each refill is outstanding from its issue after tile j's
    barrier to the wait of tile j + num_stages, i.e. num_stages iterations' worth in flight --
    one fewer for a latent cache (MLA's kv_cache, tma_pipeline.run_latent_tma_pipeline: tiles
    j - 1 and j are read while the other stages land, so the refill after tile j's barrier is
    waited for num_stages - 1 tiles later), and under MLA's seesaw (two tiles an iteration) the
    two tiles beyond those read. Spread over the warps that run the loop (the per-warp figures
    are what the model scales)."""
    maps = [p["source"]["tensor"] for p in launch.get("params", [])
            if p.get("source", {}).get("kind") == "tensor_map"]
    per_iter = 0
    for t in maps:
        info = tensors.get(t) or {}
        width = (info.get("shape") or [None])[-1]
        if t == "q" or not isinstance(width, int) or info.get("dtype") not in ELEMENT_BYTES:
            continue
        per_iter += (kv_rows or 0) * width * ELEMENT_BYTES[info["dtype"]]
    if not per_iter or not warps_per_cta:
        return loop
    stages = int(config.get("num_stages", 1))
    if "kv_cache" in maps:          # latent tiles: one stage holds a tile still being read
        stages -= 1
    if config.get("seesaw"):        # two tiles an iteration; two of four stages in flight (T(j+1),
        stages = (stages - 1) / 2   # T(j+2) while tiles j-1 and j are read)
    share = per_iter / warps_per_cta
    return {**loop, "global_bytes_loaded": loop["global_bytes_loaded"] + round(share),
            "inflight_bytes_mean": round(loop["inflight_bytes_mean"] + stages * share, 1),
            "inflight_bytes_peak": loop["inflight_bytes_peak"] + round(stages * share),
            "tma_bytes_per_iteration": per_iter}


def with_umma_flops(loop: dict, config: dict, spec: dict, warps_per_cta: int) -> dict:
    """A tcgen05 kernel's main loop: one thread issues the CTA's MMAs with their shapes in an
    instruction-descriptor register -- inside this loop (class "umma") or in an MMA warp's own
    loop (warp-specialised) -- so the SASS shows no FLOPs for them. Per iteration the CTA
    computes S = Q·Kᵀ and O += P·V over block_m x block_n: 2 block_m block_n (head_dim +
    head_dim_v) FLOPs for each of its q_tiles Q tiles -- head_dim_v an MLA spec's kv_lora_rank,
    and a CTA's share of it where value_ctas CTAs split the value columns -- spread here over
    the warps that run the loop (the per-warp figures are what the model scales), on top of
    the SASS's own (the mma.sync row sums)."""
    if not str(config.get("path", "")).startswith("tcgen05"):
        return loop
    d = int(spec["head_dim"])
    dv = int(spec.get("head_dim_v") or spec.get("kv_lora_rank") or d) // int(config.get("value_ctas", 1))
    cta = 2 * config["block_m"] * config.get("q_tiles", 1) * config["block_n"] * (d + dv)
    flops = loop["mma_flops"] + cta // warps_per_cta
    total = loop["instructions"]
    return {**loop, "mma_flops": flops, "umma_flops_per_cta": cta,
            "mma_equivalents": round(flops / HMMA_16816_FLOPS, 2),
            "instructions_per_mma_equivalent": round(total * HMMA_16816_FLOPS / flops, 2)}


def with_dequant_loads(loop: dict, loops: dict, config: dict, warps_per_cta: int) -> dict:
    """MLA's dequantising warpgroup (config.dequant_warpgroup): the computing warps' loop reads
    converted tiles from shared memory, and the rows arrive in that warpgroup's own loop (the
    one with the most global loads and no tensor work; one tile an iteration, as the main
    loop). Its loads, bytes in flight and instructions are spread over the computing warps:
    `issue_instructions` (the SM's issue slots per computing warp) is what the issue bound
    counts, `dequant_instructions` its warps' own figure."""
    if not config.get("dequant_warpgroup"):
        return loop
    others = [p for n, p in enumerate(loops["loops"])
              if n != loops["main"] and not p["classes"]["tensor"] and p["global_bytes_loaded"]]
    if not others:
        return loop
    dq = max(others, key=lambda p: p["global_bytes_loaded"])
    share = (config["threads"] // 32 - warps_per_cta) / warps_per_cta
    return {**loop, "global_bytes_loaded": loop["global_bytes_loaded"] + round(dq["global_bytes_loaded"] * share),
            "inflight_bytes_mean": round(loop["inflight_bytes_mean"] + dq["inflight_bytes_mean"] * share, 1),
            "inflight_bytes_peak": loop["inflight_bytes_peak"] + round(dq["inflight_bytes_peak"] * share),
            "dequant_instructions": dq["instructions"],
            "issue_instructions": round(loop["instructions"] + dq["instructions"] * share, 2)}


def with_tile_bytes(loop: dict, family: str, tensors: dict, kv_rows: int | None,
                    warps_per_cta: int) -> dict:
    """MLA's latent rows copied by the threads: a loop's `LDGSTS` slots include predicated-off
    ones (a row's 16-byte chunks dealt over the CTA's threads in passes that do not divide
    them: 16 slots a thread for a 16-row tile of 576-column rows where 9 carry bytes), and the
    SASS cannot say which, so the copied bytes are capped at the tile's: kv_rows rows of
    kv_cache a CTA iteration (the emulator's traffic counters pin exactly that, once per head
    tile: tests/families/test_mla.py), over the warps; other loads (the page table's) stay.
    Before this, the 16-head mma.sync tile's loads were counted 1.76x and its launches modelled
    1.5x slow."""
    info = tensors.get("kv_cache") or {}
    width = (info.get("shape") or [None])[-1]
    if family != "mla" or not kv_rows or not isinstance(width, int) or info.get("dtype") not in ELEMENT_BYTES:
        return loop
    copied = sum(int(w) * n * 32 for w, n in (loop.get("ldgsts_bytes") or {}).items())
    tile = kv_rows * width * ELEMENT_BYTES[info["dtype"]] / warps_per_cta
    if copied <= tile:
        return loop
    scale = (loop["global_bytes_loaded"] - copied + tile) / loop["global_bytes_loaded"]
    return {**loop, "global_bytes_loaded": round(loop["global_bytes_loaded"] * scale),
            "inflight_bytes_mean": round(loop["inflight_bytes_mean"] * scale, 1),
            "inflight_bytes_peak": round(loop["inflight_bytes_peak"] * scale),
            "ldgsts_slot_bytes": copied}


def loop_warps(config: dict, launch: dict) -> int:
    """Warps of one CTA that run the main loop: every warp, except in a warp-specialised kernel,
    whose producer / issuing / dequantising warps never do (the per-warp figures are scaled by
    this)."""
    if config.get("warp_specialize") or config.get("dequant_warpgroup"):
        return config["num_warps"] * config.get("q_tiles", 1)
    return -(-launch["block"][0] * launch["block"][1] * launch["block"][2] // 32)


def main_loop(profile: dict | None, launch: dict, meta: dict, config: dict) -> dict | None:
    """One launch's main-loop profile as the models read it: the SASS loop (`profile`, one
    entry of report.sass.sass_profile) plus what the SASS cannot show -- TMA's load bytes and
    tcgen05's FLOPs -- spread over `loop_warps`; None without a main loop."""
    loops = (profile or {}).get("loops") or {}
    if loops.get("main") is None:
        return None
    warps = loop_warps(config, launch)
    rows = kv_rows_per_iteration(meta["family"], config, launch["entry"])
    loop = with_tma_loads(loops["loops"][loops["main"]], launch, meta["tensors"], config, rows, warps)
    loop = with_tile_bytes(loop, meta["family"], meta["tensors"], rows, warps)
    loop = with_dequant_loads(loop, loops, config, warps)
    return with_umma_flops(loop, config, meta["spec"], warps)


def tensor_flops(loop: dict) -> int:
    """The tensor pipe's work in an iteration: its FLOPs, plus the FLOPs' worth of time wgmmas
    wait for their shared-memory operands (sass_instr.operand_stall_flops: SS forms below N 64)."""
    return loop["mma_flops"] + loop.get("operand_stall_flops", 0)


def bound_on(loop: dict, warps_per_sm: int, gpu, reuse: int = 1) -> dict:
    """Seconds per iteration of every resident CTA under each bound, on one GPU model; only
    1/`reuse` of the loaded bytes come from DRAM (the rest from L2, at no modelled cost)."""
    clock = gpu.clock_mhz * 1e6
    per_sm_bw = gpu.bandwidth / gpu.sm_count
    loaded = loop["global_bytes_loaded"] * warps_per_sm / reuse
    inflight = loop["inflight_bytes_mean"] * warps_per_sm
    times = {
        "issue": loop.get("issue_instructions", loop["instructions"]) * warps_per_sm / 4 / clock,
        "tensor": tensor_flops(loop) * warps_per_sm / (gpu.tensor_tflops * 1e12 / gpu.sm_count),
        "fp32": loop["fp32_lane_ops"] * warps_per_sm / (gpu.f32_tflops * 1e12 / 2 / gpu.sm_count),
        "bandwidth": loaded / per_sm_bw,
        "latency": loaded * gpu.dram_latency_ns * 1e-9 / inflight if inflight else 0.0,
    }
    worst = max(BOUNDS, key=lambda k: times[k])
    return {"gpu": gpu.key, "bound": worst, "seconds": times[worst],
            "times": {k: times[k] for k in BOUNDS},
            "bandwidth_fraction": round(times["bandwidth"] / times[worst], 3) if times[worst] else None}


def loop_figures(loop: dict, warps_per_cta: int, ctas_per_sm: int, kv_rows: int | None,
                 gpus, reuse: int = 1) -> dict:
    """The report's loop row: the per-warp profile plus per-CTA/per-SM figures and bounds."""
    warps_per_sm = warps_per_cta * ctas_per_sm
    per_cta = loop["inflight_bytes_mean"] * warps_per_cta
    return {
        **{k: v for k, v in loop.items() if k != "program"},   # issue_sim's input, not a figure
        "kv_rows_per_iteration": kv_rows,
        "instructions_per_kv_row": round(loop["instructions"] * warps_per_cta / kv_rows, 2)
        if kv_rows else None,
        "inflight_bytes_per_cta": round(per_cta),
        "inflight_bytes_per_sm": round(per_cta * ctas_per_sm),
        "inflight_peak_bytes_per_sm": loop["inflight_bytes_peak"] * warps_per_sm,
        "dram_share": round(1 / reuse, 6),
        "bounds": [bound_on(loop, warps_per_sm, g, reuse) for g in gpus] if warps_per_sm else [],
    }


__all__ = ["BOUNDS", "bound_on", "tensor_flops",
           "kv_reuse", "kv_rows_per_iteration", "loop_figures", "loop_warps", "main_loop",
           "with_dequant_loads", "with_tma_loads", "with_umma_flops"]
