"""Whole-launch time of an attention launch list on a GPU model, from the SASS loop analysis,
with constants fitted to the H100 timings in bench/calibration/ -- an estimate with a stated
error, never a forecast past what it was checked on.

Per launch with an attention main loop:
  1. the work: every CTA's number of main-loop iterations at the shape (prefill: its query
     block's visible key tiles, causal and window included; varlen: the real (sequence, KV
     head, split) tiles -- the grid's spare CTAs exit at once --, each query tile's keys up to
     its last token (the q queries are the last of the L keys, causal among themselves), its
     K/V shared through L2 with the sequence's other query tiles; split-KV: the kernels' uniform
     chunk of the keys, split_plan's arithmetic at a shape of equal lengths (`chunk_rule`), so
     a row may leave split indices idle),
  2. one iteration's time with r CTAs resident per SM (r = min(occupancy, CTAs per SM the
     launch can fill)), the largest of
       issue       warp-instructions / 4 schedulers per clock
       sub_partition  (mma.sync and SIMT kernels: `warp_term` "in_order") one SM
                   sub-partition's resident warps issuing the loop's dependency program in
                   order (ptxc.report.issue_sim): each instruction waits for its operands'
                   latencies, its pipe (the HMMA pipe at `tensor_fraction` of the peak) and the
                   one issue slot a clock; loads answer after `dram_latency_ns`, cp.async
                   groups are waited for as DEPBAR says, a CTA's warps meet at its barriers.
                   It replaces the next two terms and `lockstep`, which it covers
       warp        (wgmma kernels: "ipc") one warp's own chain: non-tensor instructions /
                   `ipc` + tensor instructions x `hmma_cycles` (the latency no other warp hides
                   when few are resident: what made 1-CTA/SM prefill slow on the H100)
       tensor      mma FLOPs / (`tensor_fraction` x the SM's share of the dense tensor peak):
                   mma.sync on an H100 does not reach the wgmma peak the GPU model states; a
                   wgmma reading A and B from shared memory (SS) with N < 64 is paced by its
                   operands at 128 B a clock, not its math (loop_model.tensor_flops)
       fp32, smem  FP32 lane operations, and bytes through the shared-memory pipe (128 B/clock)
       latency     ("ipc") Little's law: loaded bytes / bytes in flight x `dram_latency_ns`
       lockstep    a tile whose warps share rows (`value_split` > 1: MLA's latent tiles, each
                   warp a slice of O's columns) and meet at a CTA barrier every iteration:
                   every row's softmax waits for its S and the whole CTA for every row, so the
                   tensor cores idle while it runs -- the tensor term plus one warp's
                   non-tensor chain (/ `ipc`), not the larger of the two ("ipc" only). Not under MLA's
                   seesaw (no CTA barrier in its loop: one warpgroup's softmax runs under the
                   other's products). No constant of its own; chosen after the H200 MLA points
                   it fixes were seen (0.33-0.74x before, docs/performance.md)
  3. CTAs list-scheduled in launch order onto SMs x r slots, each taking iterations x that time
     (tile.persistent: one CTA a slot, each taking its rounds' work tiles as the kernel deals
     them, `persistent_tiles`; every tile still pays `cta_fixed_s`: the model cannot see the
     prologue and epilogue the producer overlaps with the next tile);
  4. DRAM, one resource every resident CTA shares: the launch takes at least all its loaded
     bytes (/ reuse: prefill tiles re-read from L2) over `bandwidth_fraction` of the DRAM
     bandwidth -- whatever the waves (a launch's tail wave has the bandwidth to fewer CTAs,
     which per-wave accounting missed: split decode of 2-3 waves was modelled up to 2x slow),
     plus under split-KV the f32 partials it writes (`partial_bytes`; MLA: 2 KiB per head row
     and split, 128 KiB for a 64-row tile -- the bytes of 114 latent rows).
Launches without an attention loop cost `launch_s` each, which also stands for the per-launch
overhead of the others; a split reduce adds the time to read the partials, a copy family's
launch (merge_states, the appends) its bytes over the DRAM share -- most appends are a few
rows, the launch term alone; merging two prefill chunks' states moves hundreds of MB.

The mma.sync / SIMT constants (`H100_MMA_SYNC`) are chosen (a grid search,
bench/calibration/README.md) on the 45 medians of three H100 runs of ptxc's mma.sync / SIMT
kernels (sm_90 cubins): in-sample, 44 land within ±35 % and all within ±45 %, and the one large
recorded change (mha_d64's 2 CTAs per SM, -28 %) is modelled at -25 %
(tests/report/test_calibration.py pins this). Out of sample, on an H200 (its own GPU row, the
same constants) at 53a4762, 19 of 23 medians land within ±35 % (0.74-1.71: the unsplit
tensor-core decodes modelled slow), on the H100 at 89432c6 39 of 41 (0.74-1.37), on an H200 at
2d6d5cd 45 of 48 (0.71-1.46) and in the run of 621d27f 51 of 55 (0.71-1.39). With the fitted
issue-rate warp term in place of the sub-partition simulation they were 41, 17 (0.75-2.00), 37,
42 (0.72-2.11) and 49 (0.72-2.04): the FP8 and split tensor-core decodes were up to 2.1x slow,
their high-ILP loops priced as one dependent chain. The simulation was built after those
misses were seen; its latencies are textbook figures, not fitted, and the calibration moves by
a point or two when all are scaled by 0.75 or 1.25. The lockstep term, the split chunk, the
partials' bytes and varlen's causal queries were likewise chosen after seeing these points.

The sm_90a wgmma + TMA kernels have constants of their own (`H100_WGMMA`), chosen on the 28
H100 wgmma medians of 89432c6 / f7ee845: the tensor term at 0.60 of the dense peak (wgmma gets
twice mma.sync's share) and `cta_fixed_s`, 3 us a CTA outside its loop (a warp-specialised CTA
holds a whole SM, so its prologue and epilogue overlap nothing: what made gpt-oss's 128-key
window, two tiles a CTA, 2.6-2.9x slower than its loop alone). In-sample all 28 land within ±35 %;
out of sample on an H200 (2d6d5cd) 61 of 62 (51 before the lockstep term: every MLA decode
on wgmma modelled 0.53-0.73x; the one outside gpt-oss's 128-key window at batch 64, 0.65x).
They price the tensor term and the per-CTA overhead only: every A/B pair of schedules timed
(producer warpgroup or not, ping-pong, stages) is modelled within 3 % while measured -10 % to
+10 %, so they cannot rank schedules.
tcgen05 kernels (sm_100a) get no estimate: none has run on hardware.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable

from ..kernels.attention.split_plan import AUTO_SPLIT, AutoSplit, plan
from ..pipeline.exprs import evaluate
from .calibration import Calibration
from .costs import first_key, visible_rows
from .gpus import GpuModel
from .issue_sim import sub_partition_clocks
from .loop_model import kv_reuse, kv_rows_per_iteration, loop_warps, tensor_flops


def _opt(spec: dict, key: str, default=None):
    return spec.get(key, (spec.get("options") or {}).get(key, default))


def kv_length(spec: dict, dims: dict) -> int:
    """Keys per sequence at the shape: max_seq_len, or max_pages_per_seq x page_size."""
    if "max_seq_len" in dims:
        return dims["max_seq_len"]
    return dims.get("max_pages_per_seq", 0) * int(_opt(spec, "page_size", 16) or 16)


@dataclass(frozen=True)
class SplitRows:
    """What a split kernel's uniform chunk is computed from (kernels/attention/split_plan.py),
    at a shape where every sequence has the same length."""
    units: int      # KV units of each row (its KV tiles; the SIMT decode: its loop iterations)
    splits: int     # S, the launch's num_splits
    work: int       # units of work per sequence (its query tiles x KV units)
    rows: int       # split rows of the grid (the `rows` of the `total` term)
    seqs: int       # sequences the batch pass sums over


ChunkRule = Callable[[SplitRows], int]


def kernel_chunk_rule(family: str, spec: dict) -> ChunkRule:
    """The chunk this ptxc's kernels compute: split_plan.plan with the family's AutoSplit
    under num_splits = "auto", cdiv(units, S) otherwise. An artifact of another ptxc version
    may follow another rule (bench/calibration/predict.py names those of the timed commits)."""
    auto = AUTO_SPLIT.get(family, AutoSplit()) if _opt(spec, "num_splits") == "auto" else None
    return lambda s: plan([s.units] * s.seqs, s.splits, auto, [s.work] * s.seqs, s.rows)[0]


def query_tile_keys(spec: dict, config: dict, dims: dict, L: int, window: int | None,
                    chunk: int | None = None) -> list[tuple[int, int]]:
    """The keys [start, end) each packed query tile of a varlen / MLA sequence visits: its q
    queries are the last of its L keys (seq_lens counts them), causal among themselves, and a
    tile's packed rows [m block_m, (m + 1) block_m) are (token, head) pairs, token = row // group.
    A tile starts at its first token's first key (sliding window / attention chunk).
    In launch order: the last block first where the config records query_order "longest_first"
    (varlen_attend.emit_varlen; the cubins timed before it launched block 0 first)."""
    g, bm = spec["num_heads"] // spec["num_kv_heads"], config["block_m"]
    q = max(1, dims["total_q"] // max(1, dims["batch"]))
    causal = _opt(spec, "causal", True)
    keys = []
    for m in range(math.ceil(q * g / bm)):
        first, last = m * bm // g, min(q, -(-(m + 1) * bm // g)) - 1
        end = L - q + last + 1 if causal else L
        keys.append((first_key(max(0, L - q + first), window, chunk), end))
    return keys[::-1] if config.get("query_order") == "longest_first" else keys


def cta_iterations(family: str, spec: dict, config: dict, dims: dict, grid: list[int],
                   kv_rows: int, chunk_rule: ChunkRule | None = None) -> list[int]:
    """Main-loop iterations of every CTA that does work, in launch order. Split-KV CTAs take
    the kernel's chunk (`chunk_rule`, default `kernel_chunk_rule`): split z of a row covers
    units [z * chunk, (z + 1) * chunk) of its span, so a row may use fewer than S splits
    (its spare CTAs: 0 iterations, `cta_fixed_s`)."""
    window = _opt(spec, "sliding_window") or _opt(spec, "window") or None
    attn_chunk = _opt(spec, "attention_chunk") or None
    n = grid[0] * grid[1] * grid[2]
    if family == "prefill":
        bm, sq, sk = config["block_m"], dims["seq_q"], dims["seq_k"]
        causal = _opt(spec, "causal", True)
        out = []
        for mb in range(grid[0]):
            end = min(sk, (mb + 1) * bm + sk - sq) if causal else sk
            start = first_key(max(0, mb * bm + sk - sq), window, attn_chunk)
            out += [max(0, math.ceil(end / kv_rows) - start // kv_rows)] * (grid[1] * grid[2])
        return out
    if family not in ("decode", "varlen", "mla"):
        return []
    S = max(1, dims.get("num_splits", 1))
    unit = int(config.get("block_n", kv_rows))   # split_plan's unit: a KV tile, or a SIMT iteration
    # one split index's CTAs in launch order, each as the keys [start, end) it visits unsplit
    if family == "mla" and _opt(spec, "sparse_topk"):   # every CTA: one token's N slots
        full = _opt(spec, "sparse_topk")
        seqs, tiles = dims["total_q"], spec["num_heads"] // config["block_m"]
        rows, spans = grid[0], [(0, full)] * (n // S)
    else:
        full, seqs = kv_length(spec, dims), dims["batch"]
        if family == "decode":       # the query sits at L - 1
            tiles = grid[0] // spec.get("num_kv_heads", 1) if "block_n" in config else 1
            rows, spans = seqs * tiles, [(full - visible_rows(full, window, attn_chunk), full)] * (n // S)
        else:
            per_seq = query_tile_keys(spec, config, dims, full, window, attn_chunk)
            tiles, rows = len(per_seq), grid[0]
            spans = (per_seq * seqs * grid[1])[:min(n, seqs * tiles * grid[1]) // S]
    units = math.ceil(full / unit)   # the longest row's KV units: the batch pass's term
    chunk = (chunk_rule or kernel_chunk_rule(family, spec))(SplitRows(units, S, units * tiles, rows, seqs))
    out = []
    for z in range(S):      # the split index is the grid's slowest dimension
        for start, end in spans:
            begin, stop = start // unit, math.ceil(end / unit)
            lo = min(begin + z * chunk, stop)
            out.append(math.ceil((min(lo + chunk, stop) - lo) * unit / kv_rows))
    return out


def persistent_tiles(blocks: list[int], per_block: int, causal: bool) -> list[int]:
    """tile.persistent's work tiles in the order its CTAs take them (prefill_tile.
    PersistentTiles): query block fastest, longest first when causal, then head and batch
    (`per_block` of them); `blocks`: each query block's iterations, block 0 first."""
    order = blocks[::-1] if causal else blocks
    return order * per_block


def persistent_cta(t: int, ctas: int) -> int:
    """The CTA that takes work tile t of a persistent grid of `ctas` (PersistentTiles' snake:
    round k = t // ctas in order when even, mirrored when odd)."""
    k, r = divmod(t, ctas)
    return r if k % 2 == 0 else ctas - 1 - r


def lockstep(config: dict) -> bool:
    """Whether a tile's warps share rows and meet at a CTA barrier every iteration (the module
    docstring's `lockstep` term): MLA's latent tiles, except under the seesaw schedule."""
    return config.get("value_split", 1) > 1 and not config.get("seesaw") \
        and not config.get("warp_specialize")


def tensor_clocks_per_flop(gpu: GpuModel, cal: Calibration) -> float:
    """Clocks one SM sub-partition's HMMA pipe spends per FLOP at the calibrated share of the
    dense tensor peak (an m16n8k16 is 4096 FLOPs)."""
    return 1 / (cal.tensor_fraction * gpu.tensor_tflops * 1e12 / gpu.sm_count / 4 / (gpu.clock_mhz * 1e6))


def iteration_seconds(loop: dict, warps_per_sm: int, active_sms: int, gpu: GpuModel,
                      cal: Calibration, reuse: int = 1, in_lockstep: bool = False,
                      warps_per_cta: int | None = None) -> tuple[float, str, dict]:
    """Time of one main-loop iteration of every resident CTA of an SM, its binding term, all terms.
    Under an in-order calibration (`cal.warp_term`), a loop with a dependency program gets the
    `sub_partition` term (ptxc.report.issue_sim) in place of `warp` and `latency`; that needs
    `warps_per_cta` (default: all of the SM's warps are one CTA)."""
    clock = gpu.clock_mhz * 1e6
    tensor = loop["classes"].get("tensor", 0)
    inflight = loop["inflight_bytes_mean"]
    terms = {
        # the SM's issue slots: a dequantising warpgroup's instructions too (with_dequant_loads)
        "issue": loop.get("issue_instructions", loop["instructions"]) * warps_per_sm / 4 / clock,
        "warp": ((loop["instructions"] - tensor) / cal.ipc + tensor * cal.hmma_cycles) / clock,
        "tensor": tensor_flops(loop) * warps_per_sm
        / (cal.tensor_fraction * gpu.tensor_tflops * 1e12 / gpu.sm_count),
        "fp32": loop["fp32_lane_ops"] * warps_per_sm / (gpu.f32_tflops * 1e12 / 2 / gpu.sm_count),
        "smem": loop.get("shared_bytes", 0) * warps_per_sm / (128 * clock),
        "bandwidth": loop["global_bytes_loaded"] * warps_per_sm / reuse
        / (cal.bandwidth_fraction * gpu.bandwidth / active_sms),
        "latency": loop["global_bytes_loaded"] / inflight * cal.dram_latency_ns * 1e-9 if inflight else 0.0,
    }
    if in_lockstep:
        terms["lockstep"] = terms["tensor"] + (loop["instructions"] - tensor) / cal.ipc / clock
    if cal.warp_term == "in_order" and loop.get("program"):
        # the busiest sub-partition: a CTA's warps are dealt round the four, so it holds
        # ceil(warps / 4) of the SM's warps, ceil(warps of a CTA / 4) of each CTA's
        per_cta = math.ceil((warps_per_cta or warps_per_sm) / 4)
        ctas = max(1, math.ceil(warps_per_sm / 4) // per_cta)
        clocks = sub_partition_clocks(loop["program"], per_cta, ctas, tensor_clocks_per_flop(gpu, cal),
                                      cal.dram_latency_ns * 1e-9 * clock)
        for k in ("warp", "latency", "lockstep"):
            terms.pop(k, None)
        terms["sub_partition"] = clocks / clock
    worst = max(terms, key=lambda k: terms[k])
    return terms[worst], worst, terms


def partial_bytes(family: str, spec: dict, config: dict, dims: dict, work: list[int], splits: int) -> int:
    """DRAM bytes of the split-KV partials an attention launch writes and its reduce reads:
    an f32 row of head_dim_v per (query row, head) for each split CTA with keys -- except a
    row that one split covers whole on the packed wgmma / tcgen05 tiles, which write o
    directly (split_plan.py, packed_tile.emit_idle_split_exit). `work`: cta_iterations'
    list, split-major, of `splits` split indices."""
    if not work:
        return 0
    per = len(work) // splits
    direct = (family != "decode" and splits > 1
              and str(config.get("path", "")).startswith(("wgmma", "tcgen05")))
    written = 0
    for r in range(per):
        busy = sum(work[z * per + r] > 0 for z in range(splits))
        written += busy if busy > 1 or not direct else 0
    dv = spec.get("kv_lora_rank") or _opt(spec, "head_dim_v") or spec["head_dim"]
    rows = (dims["batch"] if family == "decode" else dims["total_q"]) * spec["num_heads"]
    return rows * dv * 4 * written // max(1, per)


def launch_list_seconds(family: str, spec: dict, config: dict, launches: list[dict],
                        loops: dict[str, dict | None], dims: dict, gpu: GpuModel,
                        cal: Calibration, chunk_rule: ChunkRule | None = None,
                        copy_bytes: int = 0) -> dict:
    """The whole launch list's modelled time. `launches`: metadata launch dicts (entry, grid
    expressions, block, occupancy); `loops`: entry -> main-loop profile (or None);
    `chunk_rule`: the split-KV chunk the kernels compute (cta_iterations); `copy_bytes`: what a
    copy family's loop-less launch reads and writes (report.costs' bytes: merge_states,
    kv_append, mla_append), over the DRAM share after its launch term."""
    total, parts = 0.0, []
    split = any(k["entry"].endswith("_reduce") for k in launches)
    dram_rate = cal.bandwidth_fraction * gpu.bandwidth
    partials = 0      # bytes of split partials written by the attention launch, read by the reduce
    for launch in launches:
        entry, loop = launch["entry"], loops.get(launch["entry"])
        kv_rows = kv_rows_per_iteration(family, config, entry) if loop else None
        if not loop or not kv_rows:
            reduce = entry.endswith("_reduce")
            moved = partials if reduce else copy_bytes
            seconds = cal.launch_s + moved / dram_rate
            total += seconds
            # (a copy's bytes name the bound once they outweigh the launch term: most appends
            # move a few KiB)
            bandwidth = (reduce and partials > 0) or moved / dram_rate > cal.launch_s
            parts.append({"entry": entry, "bound": "bandwidth" if bandwidth else "fixed", "seconds": seconds})
            continue
        persistent = family == "prefill" and config.get("persistent")
        grid = ([math.ceil(dims["seq_q"] / config["block_m"]), 1, 1] if persistent
                else [evaluate(g, dims) for g in launch["grid"]])
        work = cta_iterations(family, spec, config, dims, grid, kv_rows, chunk_rule)
        if persistent and work:     # the query blocks' iterations -> each work tile's, in order
            work = persistent_tiles(work, spec["num_heads"] * dims["batch"], _opt(spec, "causal", True))
        if not work:
            total += cal.launch_s
            parts.append({"entry": entry, "bound": "fixed", "seconds": cal.launch_s})
            continue
        warps = loop_warps(config, launch)
        resident = max(1, min(launch["occupancy"]["ctas_per_sm"], math.ceil(len(work) / gpu.sm_count)))
        active = min(gpu.sm_count, len(work))
        _, _, terms = iteration_seconds(loop, warps * resident, active, gpu, cal,
                                        kv_reuse(family, config, spec, dims), lockstep(config), warps)
        own = {k: v for k, v in terms.items() if k != "bandwidth"}
        bound = max(own, key=lambda k: own[k])
        slots = [0.0] * (gpu.sm_count * resident)
        if persistent:          # a CTA a slot, each taking a tile a round (PersistentTiles)
            P = min(len(work), len(slots))
            slots = [0.0] * P
            for t, iters in enumerate(work):
                slots[persistent_cta(t, P)] += iters * own[bound] + cal.cta_fixed_s
        for iters in [] if persistent else work:
            # list scheduling in launch order: the next CTA takes the first free slot
            heapq.heappush(slots, heapq.heappop(slots) + iters * own[bound] + cal.cta_fixed_s)
        # DRAM is one resource every resident CTA shares: the launch's bytes over the
        # bandwidth, not whole waves of CTAs at a full wave's share (a launch's tail wave has
        # the bandwidth to fewer CTAs)
        if split:
            partials = partial_bytes(family, spec, config, dims, work, max(1, dims.get("num_splits", 1)))
        dram = terms["bandwidth"] * sum(work) / (resident * active) + partials / dram_rate
        if dram > max(slots):
            bound = "bandwidth"
        seconds = max(max(slots), dram) + cal.launch_s
        total += seconds
        parts.append({"entry": entry, "bound": bound, "seconds": seconds, "ctas": len(work),
                      "resident": resident})
    return {"seconds": total, "launches": parts, "calibration": cal.source}


__all__ = ["ChunkRule", "SplitRows", "cta_iterations", "iteration_seconds", "kernel_chunk_rule",
           "kv_length", "launch_list_seconds", "lockstep", "partial_bytes", "persistent_cta",
           "persistent_tiles", "tensor_clocks_per_flop"]
