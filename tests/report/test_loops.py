"""The SASS loop analyser (ptxc.report.loops) and loop model (ptxc.report.loop_model) on
hand-written nvdisasm listings in tests/sass/, with answers worked out by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from ptxc.report.gpus import GPUS
from ptxc.report.loop_model import (
    bound_on, kv_reuse, kv_rows_per_iteration, loop_figures, with_tma_loads)
from ptxc.report.loops import (
    Instr, access_bytes, analyze_disassembly, classify, find_loops, mma_flops, parse_functions,
    table_refills)

SASS = Path(__file__).resolve().parents[1] / "sass"
PEER_SASS = Path(__file__).resolve().parents[1] / "data"


def _main(name: str) -> tuple[dict, dict]:
    [(fn, result)] = analyze_disassembly((SASS / name).read_text()).items()
    return result, result["loops"][result["main"]]


def test_pipelined_mma_loop_takes_prefetch_and_skips_masking():
    result, loop = _main("pipelined_mma.sass")
    assert len(result["loops"]) == 1          # the `BRA` to itself after EXIT is padding, not a loop
    assert (loop["head"], loop["back_edge"], loop["body"]) == ("0x0020", "0x0120", 17)
    # 17 in the body less the two masking FSELs the interior tile branches around
    assert loop["instructions"] == 15
    # ... which a tile taking the masking branch issues: the longest path, the bound from above
    assert loop["instructions_longest"] == 17
    c = loop["classes"]
    assert (c["tensor"], c["ldsm"], c["ldgsts"], c["mufu"], c["cvt"], c["fp32"]) == (2, 1, 2, 1, 1, 0)
    assert (c["bar"], c["int"], c["control"], c["move"]) == (3, 2, 3, 0)
    assert loop["instructions_per_mma"] == 7.5
    assert loop["mma_flops"] == 2 * 4096
    assert loop["global_bytes_loaded"] == 2 * 16 * 32
    # DEPBAR.LE SB0, 1 leaves last iteration's group (1 KiB per warp) in flight all iteration;
    # this iteration's copies add 512 B, then 1 KiB, for the last five instructions
    assert loop["inflight_bytes_peak"] == 2048
    assert loop["inflight_bytes_mean"] == round((10 * 1024 + 1536 + 4 * 2048) / 15, 1)


def test_depbar_keeps_groups_when_fewer_than_n_are_open():
    # 4 commit groups outstanding after each commit, DEPBAR.LE SB0, 3 retires one: 3-4 groups of
    # 512 B per warp stay in flight (a wait for n with fewer than n groups open retires none)
    _, loop = _main("deep_pipeline.sass")
    assert loop["instructions"] == 8 and loop["global_bytes_loaded"] == 2 * 512
    assert loop["inflight_bytes_peak"] == 2048
    assert loop["inflight_bytes_mean"] == (4 * 2048 + 4 * 1536) / 8


def test_flashinfer_paged_decode_loop():
    """A peer's SASS (tests/data: FlashInfer 0.7.2's paged decode, nvcc 13, sm_80): the main loop
    is found, its K/V row-offset table refill (taken once every 16 tiles) is off the steady path,
    and the counts are those of two 8-row tiles (the loop is unrolled twice)."""
    text = (PEER_SASS / "flashinfer_decode_sm80.sass").read_text()
    [(fn, (instrs, labels))] = parse_functions(text).items()
    assert "BatchDecodeWithPagedKVCacheKernel" in fn
    [(head, latch)] = find_loops(instrs, labels)
    refill = sorted(table_refills(instrs, labels, head, latch))
    # the 26 instructions between `@P0 BRA .L_x_3` and .L_x_3: page-id LDG.32, offset math, STS.64
    assert (instrs[refill[0]].addr, instrs[refill[-1]].addr, len(refill)) == (0x0b00, 0x0c90, 26)
    assert {instrs[n].base for n in refill} >= {"LDG", "STS", "IMAD"}
    [(fn2, result)] = analyze_disassembly(text).items()
    loop = result["loops"][result["main"]]
    assert (loop["head"], loop["back_edge"], loop["body"]) == ("0x0ac0", "0x2b10", 518)
    assert loop["instructions"] == 518 - 26
    assert loop["instructions_longest"] == 518     # the tile that refills the table
    c = loop["classes"]
    # per tile: one 16-byte K and one V cp.async per lane, 4 + 4 LDS.128 of K/V rows, the
    # row-offset table read (LDS.64) and 3 LDS; SIMT math on the FP32 pipe (the f16 -> f32
    # unpacks are 128 HADD2.F32 of the 348)
    assert (c["tensor"], c["ldg"], c["sts"], c["ldgsts"], c["lds"], c["mufu"], c["shfl"], c["bar"]) \
        == (0, 0, 0, 4, 24, 10, 32, 16)
    assert c["fp32"] == 348 and c["other"] == 0
    assert loop["global_bytes_loaded"] == 4 * 16 * 32 and loop["ldgsts_bytes"] == {"16": 4}
    # wait_group<3> after each of the 4 commits per iteration: 3-4 groups of 512 B per warp
    assert loop["inflight_bytes_peak"] == 4 * 512
    assert 3 * 512 <= loop["inflight_bytes_mean"] <= 4 * 512


def test_register_loads_are_in_flight_until_a_register_is_named():
    _, loop = _main("register_loads.sass")
    assert loop["instructions"] == 7 and loop["classes"]["ldg"] == 3 and loop["classes"]["fp32"] == 2
    assert loop["ldg_bytes"] == {"16": 2, "4": 1}
    assert loop["global_bytes_loaded"] == (16 + 16 + 4) * 32
    # R12 is never read: it stays in flight until the next iteration's load overwrites it
    samples = [128 + 512, 128 + 1024, 128 + 1024, 128 + 512, 128, 128, 128]
    assert loop["inflight_bytes_peak"] == 1152
    assert loop["inflight_bytes_mean"] == round(sum(samples) / 7, 1)


def test_uniform_branches_are_conditional_and_main_loop_has_the_mma():
    result, loop = _main("uniform_branch.sass")
    first, second = result["loops"]
    assert result["main"] == 1 and loop is second
    # BRA.U !UP0 is conditional: the path through the LDS (more work) is the steady state
    assert first["instructions"] == 6 and first["classes"]["lds"] == 1
    # the early exit (@P0 BRA out of the loop) is never followed
    assert second["instructions"] == 4 and second["classes"]["tensor"] == 1


@pytest.mark.parametrize("opcode, cls", [
    ("HMMA.16816.F32.BF16", "tensor"), ("HGMMA.64x128x16.F32", "tensor"), ("IMAD.MOV.U32", "move"),
    ("IMAD.WIDE.U32", "int"), ("UIADD3", "int"), ("ULDC.64", "move"), ("CS2R", "move"),
    ("F2FP.PACK_AB", "cvt"), ("I2F.U32.RP", "cvt"), ("FFMA", "fp32"), ("HFMA2.MMA", "fp32"),
    ("MUFU.EX2", "mufu"), ("SHFL.BFLY", "shfl"), ("LDGDEPBAR", "bar"), ("DEPBAR.LE", "bar"),
    ("BAR.SYNC.DEFER_BLOCKING", "bar"), ("LDG.E.128.CONSTANT", "ldg"), ("LD.E.64", "ldg"),
    ("STG.E.128", "stg"), ("LDS.128", "lds"), ("STS.64", "sts"), ("LDSM.16.MT88.4", "ldsm"),
    ("LDGSTS.E.BYPASS.128", "ldgsts"), ("BSSY", "control"), ("NOP", "control"), ("XYZZY", "other"),
    # seen in peers' sm_90 SASS (Triton 3.9): stmatrix, fused add-min/max, wgmma fences
    ("STSM.16.M88.2", "sts"), ("VIADDMNMX", "int"), ("WARPGROUP.ARRIVE", "bar"),
    ("WARPGROUP.DEPBAR.LE", "bar"), ("FENCE.VIEW.ASYNC.S", "bar"),
    # FlashInfer's FA3 (sm_90a): mbarrier back-off, warpgroup register reallocation; TMA is "other"
    ("NANOSLEEP.SYNCS", "control"), ("USETMAXREG.DEALLOC.CTAPOOL", "control"), ("UTMALDG.3D", "other"),
])
def test_classify(opcode, cls):
    assert classify(opcode) == cls


def test_wgmma_shape_is_part_of_the_opcode():
    text = """\t.section\t.text.k,"ax",@progbits
        /*1180*/                   HGMMA.64x64x16.F32 R88, gdesc[UR12], RZ, !UPT ;
"""
    [(_, (instrs, _))] = parse_functions(text).items()
    assert (instrs[0].opcode, instrs[0].operands) == ("HGMMA.64x64x16.F32", "R88, gdesc[UR12], RZ, !UPT")
    assert mma_flops(instrs[0]) == 2 * 64 * 64 * 16 // 4


def test_widths_and_mma_flops():
    assert [access_bytes(o) for o in ("LDG.E.128.CONSTANT", "LDG.E.64", "LDG.E", "LDG.E.U16", "LDG.E.S8")] \
        == [16, 8, 4, 2, 1]
    assert mma_flops(Instr(0, "", "HMMA.16816.F32", "")) == 4096
    assert mma_flops(Instr(0, "", "HMMA.1688.F32.TF32", "")) == 2048
    assert mma_flops(Instr(0, "", "HGMMA.64x128x16.F32", "")) == 2 * 64 * 128 * 16 // 4
    # FP8 at twice the 16-bit rate: one QMMA.16832 (sm_89 / sm_120) is one HMMA.16816's time
    assert mma_flops(Instr(0, "", "QMMA.16832.F32.E4M3.E4M3", "")) == 4096
    assert classify("QMMA.16832.F32.E4M3.E4M3") == "tensor"


def test_wgmma_operands_from_shared_memory_pace_it_below_n_64():
    """An SS wgmma (`Rd, gdesc[UR], Rc`: A and B through one descriptor pair) reads
    (64 + N) x K elements of shared memory, an RS one (`Rd, Ra, gdesc[UR], Rc`) N x K; at the
    SM's 128 bytes against 4096 FLOPs a clock, the operands of an SS m64nNk16 take
    (64 + N) / 4 clocks to its math's N / 2, so below N = 64 they pace it. Per warp: a
    quarter of the warpgroup's bytes and FLOPs."""
    from ptxc.report.loop_model import tensor_flops
    from ptxc.report.sass_instr import operand_stall_flops, wgmma_operand_bytes
    ss32 = Instr(0, "", "HGMMA.64x32x16.F32.BF16", "R88, gdesc[UR24], R88, gsb0")
    assert wgmma_operand_bytes(ss32) == (64 + 32) * 16 * 2 // 4
    assert mma_flops(ss32) == 2 * 64 * 32 * 16 // 4
    assert operand_stall_flops(ss32) == (64 + 32) * 16 * 2 // 4 * 32 - 2 * 64 * 32 * 16 // 4   # 1.5x its math
    rs128 = Instr(0, "", "HGMMA.64x128x16.F32.BF16", "R24, R104, gdesc[UR16].tnspB, R24")
    assert wgmma_operand_bytes(rs128) == 128 * 16 * 2 // 4 and operand_stall_flops(rs128) == 0
    for n in (64, 128, 256):            # SS at N >= 64: the math paces it
        assert operand_stall_flops(Instr(0, "", f"HGMMA.64x{n}x16.F32.BF16", "R24, gdesc[UR8], R24")) == 0
    ss16 = Instr(0, "", "HGMMA.64x16x16.F32.F16", "R8, gdesc[UR8], RZ, !UPT")
    assert operand_stall_flops(ss16) == 1.5 * mma_flops(ss16)           # 2.5x its math
    # FP8 (k32, one byte an element, twice the rate): the same clocks as 16-bit k16
    qss32 = Instr(0, "", "QGMMA.64x32x32.F32.E4M3.E4M3", "R88, gdesc[UR24], R88")
    assert operand_stall_flops(qss32) == operand_stall_flops(ss32)
    assert operand_stall_flops(Instr(0, "", "HGMMA.64x8x16.F16", "RZ, gdesc[URZ], RZ, !UPT, gsb0")) == 0
    assert operand_stall_flops(Instr(0, "", "HMMA.16816.F32", "R4, R8, R12, R4")) == 0
    assert tensor_flops({"mma_flops": 100, "operand_stall_flops": 50}) == 150
    assert tensor_flops({"mma_flops": 100}) == 100


def test_loop_model_bounds_by_hand():
    _, loop = _main("register_loads.sass")
    a100 = GPUS["a100-sxm"]
    b = bound_on(loop, 8, a100)
    bandwidth = 1152 * 8 / (a100.bandwidth / a100.sm_count)
    latency = 1152 * 8 * 700e-9 / (loop["inflight_bytes_mean"] * 8)
    assert b["times"]["bandwidth"] == pytest.approx(bandwidth)
    assert b["times"]["latency"] == pytest.approx(latency)
    assert b["times"]["issue"] == pytest.approx(7 * 8 / 4 / 1.41e9)
    assert b["bound"] == "latency" and b["bandwidth_fraction"] == round(bandwidth / latency, 3)
    fig = loop_figures(loop, 4, 2, 32, [a100])
    assert fig["instructions_per_kv_row"] == round(7 * 4 / 32, 2)
    assert fig["inflight_bytes_per_cta"] == round(loop["inflight_bytes_mean"] * 4)
    assert fig["inflight_bytes_per_sm"] == round(loop["inflight_bytes_mean"] * 4 * 2)
    assert fig["inflight_peak_bytes_per_sm"] == 1152 * 8


def test_mma_loop_is_tensor_bound_when_loads_come_from_l2():
    _, loop = _main("pipelined_mma.sass")
    a100 = GPUS["a100-sxm"]
    assert bound_on(loop, 8, a100, reuse=1)["bound"] in ("bandwidth", "latency")
    b = bound_on(loop, 8, a100, reuse=64)
    assert b["times"]["tensor"] == pytest.approx(2 * 4096 * 8 / (312e12 / 108))
    # A100: one HMMA.16816 per 2 clocks per SM, 4 issue slots per clock: 7.5 instructions per
    # HMMA (1.875 clocks) still fit under the tensor time
    assert b["times"]["issue"] == pytest.approx(15 * 8 / 4 / 1.41e9)
    assert b["bound"] == "tensor"


def test_kv_rows_and_reuse():
    decode = {"num_warps": 4, "lanes_per_row": 16, "kv_unroll": 4, "heads_per_cta": 4}
    assert kv_rows_per_iteration("decode", decode, "ptxc_x_split") == 4 * 2 * 4
    assert kv_rows_per_iteration("decode", decode, "ptxc_x_reduce") is None
    assert kv_rows_per_iteration("prefill", {"block_m": 128, "block_n": 64}, "ptxc_p") == 64
    assert kv_rows_per_iteration("kv_append", {"threads": 128}, "ptxc_a") is None
    spec = {"num_heads": 32, "num_kv_heads": 8}
    assert kv_reuse("prefill", {"block_m": 128}, spec, {"seq_q": 4096}) == 32 * 4
    assert kv_reuse("decode", decode, spec, {"batch": 16}) == 1


def test_gpu_clocks_match_their_tensor_peaks():
    """tensor peak / (SMs x clock) is each architecture's dense f16 rate per SM per clock."""
    for g in GPUS.values():
        per_clock = g.tensor_tflops * 1e12 / (g.sm_count * g.clock_mhz * 1e6)
        assert min(abs(per_clock / p - 1) for p in (512, 1024, 2048, 4096, 8192)) < 0.015, g.key


def test_tma_loads_are_modelled_from_the_tensor_maps():
    """UTMALDG carries no size in the SASS: a loop fed by TMA gets its K/V bytes from the
    launch's tensor_map parameters (Q's map is loaded before the loop and not counted), spread
    over the loop's warps, with num_stages refills in flight."""
    loop = {"global_bytes_loaded": 0, "inflight_bytes_mean": 0.0, "inflight_bytes_peak": 0,
            "instructions": 351, "mma_flops": 264 * 4096, "fp32_lane_ops": 0}
    launch = {"params": [{"name": "q", "source": {"kind": "pointer", "tensor": "q"}}] + [
        {"name": f"{t}_tmap", "source": {"kind": "tensor_map", "tensor": t, "box": [64, 1, 128, 1],
                                         "swizzle": 128}} for t in ("q", "k", "v")]}
    tensors = {t: {"dtype": "f16", "shape": ["batch", "seq", 8, 128]} for t in ("q", "k", "v")}
    got = with_tma_loads(loop, launch, tensors, {"num_stages": 2}, 128, 8)
    per_iter = 2 * 128 * 128 * 2                       # K and V: 128 rows x 128 x f16
    assert got["tma_bytes_per_iteration"] == per_iter
    assert got["global_bytes_loaded"] == per_iter // 8
    assert got["inflight_bytes_mean"] == 2 * per_iter / 8
    fig = loop_figures(got, 8, 1, 128, [GPUS["h100-sxm"]])
    assert fig["inflight_bytes_per_cta"] == 2 * per_iter == 128 * 1024
    # without tensor maps (cp.async / LDG loops) nothing changes
    assert with_tma_loads(loop, {"params": launch["params"][:1]}, tensors, {"num_stages": 2}, 128, 8) is loop
    # MLA's latent tiles (one kv_cache map): tiles j - 1 and j are read while the rest land,
    # so num_stages - 1 tiles are in flight (32 rows x 576 x bf16, 4 stages: 3 x 36 KiB)
    latent = {"params": [{"name": "kv_tmap", "source": {"kind": "tensor_map", "tensor": "kv_cache",
                                                        "box": [64, 32, 1], "swizzle": 128}}]}
    got = with_tma_loads(loop, latent, {"kv_cache": {"dtype": "bf16", "shape": ["num_pages", 64, 576]}},
                         {"num_stages": 4}, 32, 8)
    assert got["inflight_bytes_mean"] * 8 == 3 * 32 * 576 * 2


def test_tma_issue_blocks_count_for_the_warp_that_runs_them():
    """varlen's TMA boxes are issued by lane 0 of every warp, each warp its own block chosen by
    `ISETP.NE Rwarp, c; @P BRA`, with the page ids loaded by scalar LDGs inside. Such a block is
    not a table refill (it issues TMA every iteration): every warp's path is followed and the
    figures are the worst warp's."""
    result, loop = _main("tma_issue_per_warp.sass")
    # the loop body is 0x20..0x140: 19 instructions; warp 0 skips warp 1's 4-instruction block
    # and its branch target is BSYNC, warp 1 skips warp 0's 4 (LDG, R2UR, 2 UTMALDG)
    assert loop["warp_instructions"] == {"R9=0": 15, "R9=1": 15, "R9=other": 11}
    assert loop["instructions"] == 15 and loop["worst_warp"] in ("R9=0", "R9=1")
    # a warp never runs another warp's block: its longest path is its own (no mask branch here)
    assert loop["instructions_longest"] == 15
    assert loop["classes"]["tensor"] == 2
    instrs, labels = parse_functions((SASS / "tma_issue_per_warp.sass").read_text())["tma_issue_per_warp"]
    [(head, latch)] = find_loops(instrs, labels)
    assert not table_refills(instrs, labels, head, latch)


def test_single_tma_issuer_is_the_worst_warp():
    """Prefill's boxes are issued by one thread under a predicate set before the loop: the
    issuing warp's path holds the issue block, the others' does not; the figure is the issuer's."""
    _, loop = _main("tma_single_issuer.sass")
    assert loop["warp_instructions"] == {"issuer": 9, "others": 5}
    assert loop["instructions"] == 9 and loop["worst_warp"] == "issuer"
