"""The in-order sub-partition model (ptxc.report.issue_sim) and the dependency program it runs
(ptxc.report.dependency.dependency_program), on hand-written loops whose clocks are worked out by
hand from the latency table."""

from __future__ import annotations

import pytest

from ptxc.report.issue_sim import BARRIER_CLOCKS, L2_HIT_CLOCKS, LATENCY, sub_partition_clocks
from ptxc.report.loops import analyze_disassembly

DRAM = 900.0          # clocks; any value well above the on-chip latencies
SLOW_TENSOR = 1 / 256  # clocks per FLOP: 16 clocks an HMMA.16816 (4096 FLOPs)


def _program(*body: str) -> list:
    """The dependency program of a one-block loop `body; @!P2 BRA head`."""
    lines = ['\t.section\t.text.k,"ax",@progbits', "        /*0000*/   MOV R1, c[0x0][0x28] ;", ".L_x_0:"]
    for n, text in enumerate((*body, "@!P2 BRA `(.L_x_0) ;", "EXIT ;")):
        lines.append(f"        /*{(n + 1) * 16:04x}*/   {text}")
    [(_, result)] = analyze_disassembly("\n".join(lines) + "\n").items()
    return result["loops"][result["main"]]["program"]


def _clocks(program, warps_per_cta=1, ctas=1, tensor=SLOW_TENSOR):
    return sub_partition_clocks(program, warps_per_cta, ctas, tensor, DRAM)


CHAIN = ["FFMA R2, R2, R3, R4 ;"] * 8
INDEPENDENT = [f"FFMA R{10 + n}, R2, R3, R4 ;" for n in range(8)]


def test_a_dependent_chain_costs_its_latencies_and_independent_work_one_clock_each():
    assert _clocks(_program(*CHAIN)) == 8 * LATENCY["fp32"]
    assert _clocks(_program(*INDEPENDENT)) == 9           # 8 FFMAs and the branch, one a clock


def test_warps_of_other_ctas_fill_a_chains_gaps_until_the_issue_slot_is_full():
    chain = _program(*CHAIN)
    assert _clocks(chain, ctas=2) == 8 * LATENCY["fp32"]       # the second warp issues in the gaps
    assert _clocks(chain, ctas=8) == 8 * 9                     # 8 warps x 9 instructions, one a clock


def test_an_hmma_holds_the_tensor_pipe_for_its_flops():
    program = _program(*(f"HMMA.16816.F32 R{8 + 4 * n}, R4, R6, R{8 + 4 * n} ;" for n in range(4)))
    assert program[0][1] == [8, 9, 10, 11] and program[0][2] == [4, 5, 6, 7, 8, 9, 10, 11]
    assert program[0][4] == 4096
    assert _clocks(program) == 4 * 16                            # the pipe: 16 clocks each
    # a fast pipe leaves each accumulator's own chain: its HMMA waits for the previous one's result
    assert _clocks(program, tensor=1 / 4096) == LATENCY["hmma"]


def test_a_tile_load_answers_from_dram_and_an_index_load_from_l2():
    tile = _program("LDG.E.128 R8, [R4.64] ;", "FFMA R3, R8, R8, R3 ;")
    index = _program("LDG.E R8, [R4.64] ;", "FFMA R3, R8, R8, R3 ;")
    assert _clocks(tile) == pytest.approx(DRAM + 2, abs=1)
    assert _clocks(index) == pytest.approx(L2_HIT_CLOCKS + 2, abs=1)


def test_depbar_waits_for_the_groups_it_retires():
    """DEPBAR.LE SB0, 0 waits for this iteration's group (a DRAM round trip per iteration);
    SB0, 1 for the previous one's (two groups overlap: half of it)."""
    def loop(keep):
        return _program("LDGSTS.E.BYPASS.128 [R20], [R22.64] ;", "LDGDEPBAR ;", f"DEPBAR.LE SB0, {keep:#x} ;",
                        "FFMA R2, R2, R3, R4 ;")
    assert [e[5] for e in loop(1)[:3]] == ["ldgsts", "commit", "wait1"]
    assert _clocks(loop(0)) == pytest.approx(DRAM, abs=5)
    assert _clocks(loop(1)) == pytest.approx(DRAM / 2, abs=5)


def test_a_cta_barrier_holds_its_warps_until_the_last_arrives():
    program = _program(*CHAIN[:4], "BAR.SYNC.DEFER_BLOCKING 0x0 ;")
    alone = _clocks(program)
    assert alone == pytest.approx(4 * LATENCY["fp32"] + BARRIER_CLOCKS, abs=2)
    # two warps of one CTA meet at the barrier every iteration: their chains run side by side,
    # so the pair takes the lone warp's time, never less
    assert _clocks(program, warps_per_cta=2) >= alone
    # an arrive-only barrier holds nobody
    assert _clocks(_program(*CHAIN[:4], "BAR.ARV 0x1, 0x40 ;")) < alone


def test_wide_results_and_loads_write_every_register_they_span():
    program = _program("IMAD.WIDE.U32 R2, R3, R4, R6 ;", "LDS.128 R8, [R2] ;", "LDG.E.64 R12, [R2.64] ;")
    assert program[0][1] == [2, 3] and program[0][2] == [3, 4, 6, 7]      # R6 is the 64-bit addend
    assert program[1][1] == [8, 9, 10, 11] and program[2][1] == [12, 13]
    assert [e[0] for e in program[:3]] == ["int", "lds", "ldg_wide"]


def test_predicates_written_by_a_compare_are_waited_for():
    program = _program("ISETP.GE.AND P0, PT, R2, R3, PT ;", "@P0 FADD R4, R4, 1 ;")
    assert 512 in program[0][1] and 512 in program[1][2]          # P0
    assert _clocks(program) >= LATENCY["int"] + 1


def test_the_launch_model_takes_the_simulation_in_place_of_the_fitted_warp_term():
    """Under H100_MMA_SYNC (warp_term "in_order") a loop with a dependency program is timed by
    the simulation -- no `warp`, `latency` or `lockstep` term -- at the busiest sub-partition:
    5 one-warp CTAs put two warps on one quarter of the SM."""
    from ptxc.report.gpus import GPUS
    from ptxc.report.calibration import H100_MMA_SYNC, H100_WGMMA
    from ptxc.report.launch_model import iteration_seconds

    chain = _program(*CHAIN)
    loop = {"instructions": 9, "classes": {"tensor": 0}, "inflight_bytes_mean": 0, "mma_flops": 0,
            "fp32_lane_ops": 8 * 32, "global_bytes_loaded": 0, "program": chain}
    h100 = GPUS["h100-sxm"]
    _, bound, terms = iteration_seconds(loop, 5, 132, h100, H100_MMA_SYNC, in_lockstep=True, warps_per_cta=1)
    assert bound == "sub_partition" and not {"warp", "latency", "lockstep"} & terms.keys()
    assert terms["sub_partition"] * h100.clock_mhz * 1e6 == pytest.approx(8 * LATENCY["fp32"])
    _, _, fitted = iteration_seconds(loop, 5, 132, h100, H100_WGMMA, warps_per_cta=1)
    assert "sub_partition" not in fitted and "warp" in fitted
