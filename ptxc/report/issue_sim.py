"""One SM sub-partition running its resident warps through a loop's steady iteration, in order:
the launch model's time for an iteration of an mma.sync or SIMT kernel (launch_model's
`sub_partition` term).

An SM has four sub-partitions, each with one warp scheduler; the model takes the warps of one
(every sub-partition runs the same) and issues their dependency program
(ptxc.report.dependency.dependency_program) under these rules:
  - one instruction per clock for the sub-partition, each warp in its own program order;
  - an instruction issues once every register it reads is ready (its writer's issue +
    `LATENCY` of the writer's unit) and its unit's pipe is free (`INTERVAL` clocks after the
    unit's last issue; an HMMA holds the tensor pipe for its FLOPs at the calibrated mma.sync
    rate; shared-memory traffic holds the SM's 128-byte/clock pipe for a quarter's share);
  - global loads: a tile row (>= 8 bytes a lane) answers after the DRAM latency, a scalar
    index (a page id, a sequence length) after an L2 hit; cp.async (LDGSTS) groups land after
    the DRAM latency and DEPBAR waits for them as the hardware's scoreboard does;
  - a CTA barrier holds each warp until every warp of its CTA on the sub-partition arrived (the
    other sub-partitions run the same warps' mirror images), released 20 clocks after the last;
  - of several warps the one that can issue earliest goes first, on a tie the one that issued
    least recently (no warp starves when the issue slot is full).
It runs until every warp has done `PASSES` iterations (one that is done keeps going, so the
others' last passes compete with every warp) and reports the clocks per iteration of the
slowest warp over its last two: every resident CTA finishes one iteration in that time. What it leaves out: warps of
other sub-partitions (symmetry), register-bank conflicts, instruction-cache misses, the DRAM
bandwidth (a separate launch_model term), and wgmma's asynchronous completion (HGMMA waits are
not in the program: the wgmma kernels keep the fitted issue-rate term).

The latencies are the commonly measured Ampere / Hopper figures (microbenchmark papers: ALU 4,
MUFU ~16, SHFL ~24, LDS ~30, LDSM ~32, mma.sync m16n8k16 ~32 clocks), not fitted: the whole
calibration moves by under one point if all of them are scaled by 0.75 or 1.25
(bench/calibration/README.md).
"""

from __future__ import annotations

from functools import lru_cache

# clocks from an instruction's issue until a dependent instruction may issue
LATENCY = {"alu": 4, "int": 4, "fp32": 4, "half": 6, "pack": 6, "cvt": 14, "mufu": 16, "shfl": 24,
           "lds": 30, "ldsm": 32, "sts": 4, "hmma": 32, "async": 4}
# clocks a unit's pipe is busy per warp instruction in one sub-partition (32 FP32 lanes, 16
# INT32, 4 SFU lanes: MUFU and most conversions 8 clocks a warp)
INTERVAL = {"alu": 1, "int": 2, "fp32": 1, "half": 1, "pack": 2, "cvt": 8, "mufu": 8, "shfl": 2,
            "lds": 1, "ldsm": 1, "sts": 1, "hmma": 1, "async": 1}
L2_HIT_CLOCKS = 260     # a scalar index load (page table, lengths): hot in L2
BARRIER_CLOCKS = 20     # from the last warp's arrival at a CTA barrier to the release
PASSES = 6


def sub_partition_clocks(program: list, warps_per_cta: int, ctas: int, tensor_clocks_per_flop: float,
                         dram_clocks: float) -> float:
    """Clocks per steady iteration with `ctas` CTAs of `warps_per_cta` warps each on one
    sub-partition, all running `program`."""
    return _clocks(_freeze(program), warps_per_cta, ctas, tensor_clocks_per_flop, dram_clocks)


def _freeze(program: list) -> tuple:
    return tuple((u, tuple(w), tuple(r), s, f, e) for u, w, r, s, f, e in program)


@lru_cache(maxsize=4096)
def _clocks(program: tuple, warps_per_cta: int, ctas: int, tensor_clocks_per_flop: float,
            dram_clocks: float) -> float:
    n = warps_per_cta * ctas
    if not program or n < 1:
        return 0.0
    latency = {**LATENCY, "ldg_wide": dram_clocks, "ldg_index": L2_HIT_CLOCKS}
    ready: list[dict[int, float]] = [{} for _ in range(n)]
    groups: list[list[float]] = [[] for _ in range(n)]     # landing clock of each committed group
    open_group = [0.0] * n
    pc, done = [0] * n, [0] * n
    last = [-1.0] * n                # a warp's previous issue (or its barrier release - 1)
    at_barrier: list[float | None] = [None] * n
    ends: list[list[float]] = [[] for _ in range(n)]
    pipe_free: dict[str, float] = {}
    clock = 0.0
    while min(done) < PASSES:
        best = None
        for w in range(n):
            if at_barrier[w] is not None:    # (a warp past PASSES keeps running: the others'
                continue                     # last passes are measured with every warp there)
            unit, _, reads, smem, _, event = program[pc[w]]
            start = max(clock, last[w] + 1, pipe_free.get(unit, 0.0),
                        pipe_free.get("smem", 0.0) if smem else 0.0,
                        *(ready[w].get(r, 0.0) for r in reads))
            if event.startswith("wait"):
                keep = int(event[4:])
                retired = groups[w][:max(0, len(groups[w]) - keep)]
                start = max(start, *retired) if retired else start
            if best is None or (start, last[w]) < best[:2]:
                best = (start, last[w], w)
        if best is None:           # cannot happen: a barrier releases when its last warp arrives
            raise RuntimeError("issue_sim: every warp waits at a barrier")
        clock, _, w = best
        unit, writes, _, smem, flops, event = program[pc[w]]
        pipe_free[unit] = clock + (flops * tensor_clocks_per_flop if flops else INTERVAL.get(unit, 1))
        if smem:
            pipe_free["smem"] = clock + smem / 32     # a quarter of the SM's 128 B / clock
        for r in writes:
            ready[w][r] = clock + latency.get(unit, 4)
        last[w] = clock
        if event.startswith("wait"):
            keep = int(event[4:])
            groups[w] = groups[w][max(0, len(groups[w]) - keep):] if keep else []
        elif event == "ldgsts":
            open_group[w] = max(open_group[w], clock + dram_clocks)
        elif event == "commit":
            groups[w].append(open_group[w])
            open_group[w] = 0.0
        elif event == "bar":
            at_barrier[w] = clock
            cta = range(w - w % warps_per_cta, w - w % warps_per_cta + warps_per_cta)
            if all(at_barrier[m] is not None for m in cta):
                release = max(at_barrier[m] for m in cta) + BARRIER_CLOCKS
                for m in cta:
                    at_barrier[m], last[m] = None, release - 1
        pc[w] += 1
        if pc[w] == len(program):
            pc[w], done[w] = 0, done[w] + 1
            ends[w].append(last[w])
        clock += 1
    return max((e[PASSES - 1] - e[PASSES - 3]) / 2 for e in ends)


__all__ = ["BARRIER_CLOCKS", "INTERVAL", "L2_HIT_CLOCKS", "LATENCY", "PASSES", "sub_partition_clocks"]
