"""The whole-launch model (ptxc.report.launch_model) against the medians recorded in
bench/calibration/ (the cubins of the commits that were timed, and measurements.json).
The points of the three H100 runs of 2026-11-22 are in-sample: the constants were fitted to
them, so those tests pin the fit and the sign of the recorded changes, not a forecast. The H200
points (53a4762) and the H100 points of 89432c6 are out-of-sample: those tests pin the error the
report quotes."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from ptxc.report.calibration import CALIBRATION_ERROR, COPY_CALIBRATION_ERROR, WGMMA_CALIBRATION_ERROR
from ptxc.report.sass import SassUnavailable, find_nvdisasm

CALIB = Path(__file__).resolve().parents[2] / "bench" / "calibration"
sys.path.insert(0, str(CALIB))
from predict import predictions as model_at_points  # noqa: E402

ORDER = ("b26fd24", "c889eb4", "3357c2c", "53a4762", "89432c6", "2d6d5cd")


def recorded_changes(points: list[dict], order: tuple[str, ...], key=lambda p: p["kernel"]):
    """(a, b, measured change, modelled change) for every kernel (`key`) timed at two commits of
    `order` in a row with different cubins."""
    runs: dict = {}
    for p in points:
        if p["commit"] in order:
            runs.setdefault(key(p), []).append(p)
    for ps in runs.values():
        ps.sort(key=lambda p: order.index(p["commit"]))
        for a, b in zip(ps, ps[1:]):
            if a["cubin"] != b["cubin"]:
                yield (a, b, b["median_ms"] / a["median_ms"] - 1, b["predicted_ms"] / a["predicted_ms"] - 1)


@pytest.fixture(scope="module")
def every_point():
    try:
        find_nvdisasm()
    except SassUnavailable as e:
        pytest.skip(f"nvdisasm unavailable: {e}")
    return model_at_points(CALIB)


@pytest.fixture(scope="module")
def predictions(every_point):
    """The points the constants were fitted to (the H100 runs of 2026-11-22)."""
    return [p for p in every_point if p["in_sample"] and p["path"] == "mma.sync"]


def test_every_point_within_45_percent_and_most_within_35(predictions):
    ratios = {(p["commit"], p["kernel"]): p["predicted_ms"] / p["median_ms"] for p in predictions}
    assert len(ratios) == 45
    worst = max(ratios.items(), key=lambda kv: abs(math.log(kv[1])))
    assert all(1 / 1.45 <= r <= 1.45 for r in ratios.values()), worst
    within = [k for k, r in ratios.items() if 1 / 1.35 <= r <= 1.35]
    assert len(within) >= 44, sorted(set(ratios) - set(within))
    # no systematic lean: the median ratio is within 10 % of 1
    assert 0.9 <= sorted(ratios.values())[len(ratios) // 2] <= 1.1


def test_recorded_changes_keep_their_sign(predictions):
    """Every kernel timed at two commits with a different cubin: a change the H100 measured
    beyond its noise (>= 5 %) is modelled with its sign and within 5 points; one within the
    noise is modelled under 5 %."""
    checked = 0
    for a, b, measured, modelled in recorded_changes(predictions, ORDER):   # one GPU: the H100
        if abs(measured) >= 0.05:
            assert math.copysign(1, measured) == math.copysign(1, modelled), (a["kernel"], measured, modelled)
            # the one large change: mha_d64's 2 CTAs / SM (-28 %; -25 % modelled, -21.5 % by
            # the fitted issue-rate term the sub-partition simulation replaced)
            assert abs(modelled - measured) < 0.05, (a["kernel"], measured, modelled)
        else:
            # within the noise, modelled within it: the issue-rate term had the prefills at
            # -10 % / -14 % and the paged decode at -24 % for changes measured at -1 to -2 %
            assert abs(modelled) < 0.05, (a["kernel"], a["commit"], measured, modelled)
        checked += 1
    assert checked >= 7


def test_h200_points_are_out_of_sample_and_quoted_as_measured(every_point):
    """The H100-fitted constants on the H200's row (4.8 TB/s), against 23 medians of the kernels
    at 53a4762 that were never fitted to: the report quotes exactly this error, so a model change
    that moves it has to say so. The unsplit tensor-core decodes are modelled 1.35-1.71x slow.
    (16 within, 0.73-2.00, before the split partials' bytes were counted; 17, 0.75-2.00, with
    the fitted issue-rate warp term before the sub-partition simulation.)"""
    h200 = [p for p in every_point if p["commit"] == "53a4762" and p["path"] == "mma.sync"]
    assert all(p["gpu"] == "h200" for p in h200)
    ratios = {p["kernel"]: p["predicted_ms"] / p["median_ms"] for p in h200}
    assert len(h200) == 23 and len(ratios) == 23
    within = sorted(k for k, r in ratios.items() if 1 / 1.35 <= r <= 1.35)
    assert len(within) == 19, within
    assert 0.74 <= min(ratios.values()) and max(ratios.values()) <= 1.71
    assert "23 H200 medians" in CALIBRATION_ERROR and "19 within ±35 %" in CALIBRATION_ERROR
    assert "0.74–1.71" in CALIBRATION_ERROR
    # the one wgmma point is modelled by the wgmma constants (test_wgmma_* below)
    assert [p["kernel"] for p in every_point if p["commit"] == "53a4762" and p["path"] == "wgmma"] \
        == ["llama3_8b_fp8_varlen"]


def test_h100_points_of_later_kernels_are_out_of_sample_and_quoted_as_measured(every_point):
    """The same constants on the same GPU, against 41 medians of the kernels at 89432c6 (split
    decode by default, tensor-core and MLA decode, none of them fitted to). Before DRAM was one
    shared resource per launch these were 31 within ±35 %, 0.67-2.08 (decode of 2-3 waves
    modelled up to 2.1x slow); that change was made after seeing them, so they test it only
    in part. What it still misses: the MQA split decode 1.37x slow and gpt-oss's serve step at
    batch 16 0.74x; DeepSeek-V3 at 16 heads (13 splits) was 1.57x slow until the latent tile's
    copied bytes were capped at the tile's (its predicated copy slots: 0.96x since; chosen after
    seeing it). (37 within, 0.75-1.57, with
    the fitted issue-rate warp term before the sub-partition simulation; 33 within, 0.67-1.61,
    before the lockstep term moved the MLA decodes of the 64-row mma.sync tile, whose warps share rows:
    chosen after seeing them; 35, 0.70-1.61, before the model followed the kernels' split chunk,
    34, 0.70-1.56, before it counted the split partials' bytes -- both also after seeing them.)"""
    later = [p for p in every_point if p["commit"] == "89432c6" and p["path"] == "mma.sync"]
    assert all(p["gpu"] == "h100-sxm" and not p["in_sample"] for p in later)
    ratios = {p["kernel"]: p["predicted_ms"] / p["median_ms"] for p in later}
    assert len(later) == 41 and len(ratios) == 41
    within = sorted(k for k, r in ratios.items() if 1 / 1.35 <= r <= 1.35)
    assert len(within) == 39, within
    assert 0.73 <= min(ratios.values()) and max(ratios.values()) <= 1.375
    assert 0.9 <= ratios["deepseek_v3_mla_decode_tp8"] <= 1.0
    assert "41 H100 medians of 89432c6" in CALIBRATION_ERROR and "39 within ±35 %, 0.74–1.37" in CALIBRATION_ERROR
    # the sm_90a rows whose code is wgmma are the wgmma constants' (17 of them)
    assert sum(p["commit"] == "89432c6" and p["path"] == "wgmma" for p in every_point) == 17


def test_h200_points_of_2d6d5cd_are_out_of_sample_and_quoted_as_measured(every_point):
    """The same constants against 48 H200 medians of the mma.sync / SIMT kernels at 2d6d5cd,
    timed after the last change to the model (DRAM shared per launch): the first points that test
    it wholly out of sample. Misses: the MQA split decode 1.46x and the FP8 decode at batch 64
    (whose rows the rule of then left whole) 1.43x slow, the d256 decode at 64 splits fast
    (0.71x); 42 (0.72-2.11) with the fitted issue-rate warp term before the sub-partition
    simulation, whose tensor-core split decodes were up to 1.9x slow (the FP8 one 2.1x); 39
    within before the lockstep term moved the MLA
    decodes (chosen after seeing them), 41 (0.66-1.91) before the model followed the kernels'
    split chunk, 40 (0.69-2.11) before it counted the split partials' bytes and 41 before
    varlen's queries were the last of the L keys, causal among themselves. The wgmma rows (61)
    are the wgmma constants' (below)."""
    later = [p for p in every_point if p["commit"] == "2d6d5cd" and p["path"] == "mma.sync"]
    assert all(p["gpu"] == "h200" and not p["in_sample"] for p in later)
    ratios = {(p["kernel"], json.dumps(p["shape"], sort_keys=True)): p["predicted_ms"] / p["median_ms"]
              for p in later}
    assert len(later) == 48 and len(ratios) == 48
    within = sorted(k for k, r in ratios.items() if 1 / 1.35 <= r <= 1.35)
    assert len(within) == 45, within
    assert 0.71 <= min(ratios.values()) and max(ratios.values()) <= 1.46
    assert "48 H200 medians of 2d6d5cd: 45 within ±35 %, 0.71–1.46" in CALIBRATION_ERROR
    assert sum(p["commit"] == "2d6d5cd" and p["path"] == "wgmma" for p in every_point) == 61


def test_the_same_cubins_timed_a_day_apart_on_the_h200_agree_within_2_percent(every_point):
    """The noise floor the change-sign rule leans on: every cubin timed on the H200 at both
    53a4762 and 2d6d5cd at the same shape (20 kernels, different machines of the same kind)."""
    first = {(p["kernel"], p["target"], json.dumps(p["shape"], sort_keys=True)): p
             for p in every_point if p["commit"] == "53a4762"}
    pairs = [(first[k], p) for p in every_point if p["commit"] == "2d6d5cd"
             for k in [(p["kernel"], p["target"], json.dumps(p["shape"], sort_keys=True))]
             if k in first and first[k]["cubin"] == p["cubin"]]
    assert len(pairs) >= 20
    assert all(abs(b["median_ms"] / a["median_ms"] - 1) < 0.02 for a, b in pairs), \
        [(a["kernel"], b["median_ms"] / a["median_ms"]) for a, b in pairs]


def test_wgmma_constants_in_sample(every_point):
    """The wgmma + TMA constants (H100_WGMMA: tensor cores at 0.60 of the dense peak, 3 us a CTA
    outside the loop; the rest the mma.sync fit's) against the 28 H100 wgmma medians they were
    chosen on: every one within ±35 %."""
    fitted = [p for p in every_point if p["path"] == "wgmma" and p["in_sample"]]
    assert len(fitted) == 28 and {p["commit"] for p in fitted} == {"89432c6", "f7ee845"}
    ratios = [p["predicted_ms"] / p["median_ms"] for p in fitted]
    assert all(1 / 1.35 <= r <= 1.35 for r in ratios) and 0.74 <= min(ratios) and max(ratios) <= 1.27
    assert "28 H100 wgmma medians" in WGMMA_CALIBRATION_ERROR and "0.75–1.26" in WGMMA_CALIBRATION_ERROR


def test_wgmma_constants_out_of_sample_on_the_h200(every_point):
    """The same constants on the H200's row against its 62 wgmma medians (2d6d5cd and the one of
    53a4762): 61 within ±35 %, the one outside gpt-oss's serve step at batch 64 (a 128-key
    window: 4 tiles a CTA), modelled 0.65x. (Before the lockstep term -- a tile whose warps
    share rows and meet at a CTA barrier every iteration: tensor + chain, not the larger --
    every MLA decode on wgmma was outside, 0.53-0.73x; after it the 3 sparse MLA decodes at 5
    splits, 0.71-0.73x, until the split partials' bytes were counted. Both chosen after seeing
    these points, no constant refitted. The window's keys counted as they are visited moved
    gpt-oss from 0.78x: 5 tiles of 32 keys before, 4 now.)"""
    h200 = [p for p in every_point if p["path"] == "wgmma" and p["gpu"] == "h200"
            and p["commit"] in ("2d6d5cd", "53a4762")]
    assert len(h200) == 62 and not any(p["in_sample"] for p in h200)
    ratio = {(p["commit"], p["kernel"], json.dumps(p["shape"], sort_keys=True)): p["predicted_ms"] / p["median_ms"]
             for p in h200}
    outside = {k for k, r in ratio.items() if not 1 / 1.35 <= r <= 1.35}
    assert len(ratio) == 62 and {k[1] for k in outside} == {"gpt_oss_serve"} and len(outside) == 1
    assert 0.65 <= min(ratio.values()) and max(ratio.values()) <= 1.23
    assert "62 H200 wgmma medians" in WGMMA_CALIBRATION_ERROR and "61 within ±35 %, 0.65–1.22" in WGMMA_CALIBRATION_ERROR


RUN_621D27F = ("6c5a819", "dd55dec", "4d6b7c7", "621d27f")   # the H200 run at 621d27f: its four calls of 2026-11-28


def test_h200_points_of_run_621d27f_are_out_of_sample_and_quoted_as_measured(every_point):
    """The four H200 calls after the last model change (decode split counts and split rules,
    the MLA tile's choices, gpt-oss on 64-row tiles, the MLA prefill on wgmma): 155 medians.
    mma.sync (the decodes, on sm_90a images of mma.sync code): 51 of 55 within ±35 %, the
    misses the FP8 decode at batch 64 (1.38-1.39x slow) and MQA d256 decode at 64 splits
    (0.71-0.72x); 49 (FP8 decode 1.65-2.04x) with the fitted issue-rate warp term before the
    sub-partition simulation. wgmma: 96 of
    100, every point that is not MLA within (20, 0.88-1.15); outside, all modelled slow: the
    MLA decode's unsplit-scores and cp.async tiles at 1 and 2 splits (1.36-1.42x). Before the
    wgmma operand stall (sass_instr.operand_stall_flops: an SS wgmma below N = 64 paced by its
    shared-memory operands, from the SM's rates, not fitted) 95, all outside modelled fast:
    Kimi-K2 at batch 16 and 17 splits (0.73-0.74x), the sparse MLA decode at 5 splits (0.73x)
    and the varlen MLA prefill at 4 x 4096 queries (0.66x, now 0.83x); it moved every MLA
    decode's lockstep term up by ~15 %, chosen before it. Four model changes were made after seeing
    these points: the lockstep term (0.33-0.74x for all 78 MLA decodes before it), the kernels'
    split chunk (6 forced split counts the rule left partly idle, 0.44-0.58x before it), the
    split partials' bytes (6 decodes at 5-17 splits, 0.66-0.74x before them) and varlen's
    causal queries at the end of the L keys, their tiles sharing K/V through L2 (the MLA prefill
    5.8x slow before: every query tile read every key from DRAM, and L + q of them)."""
    new = [p for p in every_point if p["commit"] in RUN_621D27F]
    assert len(new) == 155 and all(p["gpu"] == "h200" and not p["in_sample"] for p in new)
    ratio = lambda p: p["predicted_ms"] / p["median_ms"]
    inside = lambda p: 1 / 1.35 <= ratio(p) <= 1.35
    mma = [p for p in new if p["path"] == "mma.sync"]
    assert len(mma) == 55 and sum(map(inside, mma)) == 51
    assert {p["kernel"] for p in mma if not inside(p)} == {"llama3_8b_fp8_decode", "mqa_d256_decode"}
    assert 0.71 <= min(map(ratio, mma)) and max(map(ratio, mma)) <= 1.39
    wg = [p for p in new if p["path"] == "wgmma"]
    other = [p for p in wg if "mla" not in p["kernel"]]
    assert len(wg) == 100 and len(other) == 20 and all(map(inside, other))
    assert all(p["kernel"] == "deepseek_v3_mla_prefill" or "mla" in p["kernel"] and "decode" in p["kernel"]
               for p in wg if not inside(p))
    assert sum(map(inside, wg)) == 96 and all(ratio(p) > 1 for p in wg if not inside(p))
    assert {p["kernel"] for p in wg if not inside(p)} == {"deepseek_v3_mla_decode_unsplit",
                                                          "deepseek_v3_mla_decode_cp"}
    assert 0.79 <= min(map(ratio, wg)) and max(map(ratio, wg)) <= 1.42
    assert "155 H200 medians of 6c5a819–621d27f" in CALIBRATION_ERROR + WGMMA_CALIBRATION_ERROR


def test_out_of_sample_changes_on_the_h200_as_documented(every_point):
    """Every mma.sync / SIMT kernel and shape timed on the H200 at two commits of the run series
    (2d6d5cd, 6c5a819-621d27f) with different cubins: of the 10 changes beyond the noise the
    model has the sign of 6 (the fitted issue-rate term had 9); the 10 within the noise it
    models under 5 %. The three it misses are the batch-64 decodes at 4 splits from 2d6d5cd /
    6c5a819 to 4d6b7c7 (the split rule changed: measured -18 to -23 %, modelled +0.6 %): both
    commits are DRAM-bound in the model, while the one-warp CTAs (3 per SM) ran 20 % slower than
    that at the earlier commit. Not the load latency as simulated (the two-stage pipeline hides
    up to 1500 ns there): the one-warp CTA's own rate, which sets the launch's tail, is faster
    in the simulation (3899 clocks an iteration) than the fitted term had it (4623). And
    mistral's +5.4 % (4d6b7c7 -> 621d27f), modelled -0.5 %. Kept visible here:
    docs/performance.md quotes it."""
    h200 = [p for p in every_point if p["gpu"] == "h200" and p["path"] == "mma.sync"]
    beyond, right, noise, flat, missed = 0, 0, 0, 0, set()
    point = lambda p: (p["kernel"], p["target"], json.dumps(p["shape"], sort_keys=True))   # noqa: E731
    for a, b, measured, modelled in recorded_changes(h200, ("2d6d5cd", *RUN_621D27F), key=point):
        if abs(measured) >= 0.05:
            beyond += 1
            right += (measured > 0) == (modelled > 0)
            if (measured > 0) != (modelled > 0):
                missed.add((a["kernel"], a["commit"], b["commit"]))
        else:
            noise += 1
            flat += abs(modelled) < 0.05
    assert (beyond, right, noise, flat) == (10, 6, 10, 10)
    assert missed == {("llama3_8b_decode", "6c5a819", "4d6b7c7"), ("mistral_7b_decode", "2d6d5cd", "4d6b7c7"),
                      ("llama3_8b_paged_decode", "2d6d5cd", "4d6b7c7"), ("mistral_7b_decode", "4d6b7c7", "621d27f")}


def test_the_same_cubins_timed_again_in_run_621d27f_agree_within_7_percent(every_point):
    """Cubins timed at 2d6d5cd and again at 6c5a819–621d27f at the same shape (another day's machine of
    the same kind): decode, varlen and MLA within 1 %, prefill at 4 x 4096^2 within 7 % (the
    noise docs/performance.md quotes for prefill A/B between separate items)."""
    first = {(p["cubin"], json.dumps(p["shape"], sort_keys=True)): p
             for p in every_point if p["commit"] == "2d6d5cd"}
    pairs = [(first[k], p) for p in every_point if p["commit"] in RUN_621D27F
             for k in [(p["cubin"], json.dumps(p["shape"], sort_keys=True))] if k in first]
    assert len(pairs) >= 9
    for a, b in pairs:
        limit = 0.07 if a["kernel"].endswith(("prefill", "prefill_pp")) else 0.01
        assert abs(b["median_ms"] / a["median_ms"] - 1) < limit, (a["kernel"], b["median_ms"] / a["median_ms"])


def test_wgmma_constants_cannot_rank_the_schedule_choices(every_point):
    """What the wgmma constants do not see: the tile's schedule. Every A/B pair timed (producer
    warpgroup or one issuer, ping-pong, stages, three consumer warpgroups: measured -10 % to
    +10 %) is modelled within 3.5 % -- the widest, varlen d128's producer warpgroup against one
    issuer at batch 64 x 4096 (lease at 4078740), 3.0 % with the sign wrong -- so the report's
    estimate must not be used to pick among them (docs/performance.md says so)."""
    wg = {(p["commit"], p["kernel"], json.dumps(p["shape"], sort_keys=True)): p
          for p in every_point if p["path"] == "wgmma"}
    pairs = 0
    for (commit, kernel, shape), p in wg.items():
        for suffix in ("_one", "_pp", "_m192", "_s4", "_ws", "_s3"):
            base = wg.get((commit, kernel.removesuffix(suffix), shape)) if kernel.endswith(suffix) else None
            if base:
                pairs += 1
                assert abs(p["predicted_ms"] / base["predicted_ms"] - 1) < 0.035, (kernel, shape)
    assert pairs >= 20


def test_h200_points_of_4078740_are_out_of_sample_and_quoted_as_measured(every_point):
    """The lease at 4078740 (every example on sm_90a and sm_90, the MLA and prefill A/B sets;
    no term was chosen after seeing them but the copies' bytes, which moved one point, the merge
    of two prefill chunks' states, 0.05x -> 1.10x): mma.sync / SIMT 56 of 60 within ±35 %
    (qwen2's FP8 per-head decode 1.69x and MQA split decode 1.44x slow, MQA d256 at 64 splits
    0.69x and the FP8 append with RoPE 0.73x fast); wgmma 109 of 114: modelled fast gpt-oss's
    serve step (0.61x), the FP8 varlen serve step and FP8 decode at batch 64 (0.66, 0.73x),
    slow Kimi-K2 at batch 64 x 16k (1.39x) and the sparse MLA decode (1.44x), both in the MLA
    lockstep term the wgmma operand stall moved up. DeepSeek's 192 / 128 varlen prefill, 0.68-0.71x
    before that stall (its S: m64n32k16 from shared memory), is within (0.86-0.98x)."""
    run = [p for p in every_point if p["commit"] == "4078740"]
    assert all(p["gpu"] == "h200" and not p["in_sample"] for p in run)
    ratio = lambda p: p["predicted_ms"] / p["median_ms"]
    inside = lambda p: 1 / 1.35 <= ratio(p) <= 1.35
    mma = [p for p in run if p["path"] == "mma.sync"]
    assert len(mma) == 60 and sum(map(inside, mma)) == 56
    assert {p["kernel"] for p in mma if not inside(p)} == {
        "qwen2_7b_fp8_head_decode", "mqa_split_bf16_decode", "mqa_d256_decode", "llama3_8b_fp8_rope_append"}
    assert 0.69 <= min(map(ratio, mma)) and max(map(ratio, mma)) <= 1.70
    wg = [p for p in run if p["path"] == "wgmma"]
    assert len(wg) == 114 and sum(map(inside, wg)) == 109
    assert {p["kernel"] for p in wg if ratio(p) < 1 / 1.35} == {
        "gpt_oss_serve", "llama3_8b_fp8_varlen", "llama3_8b_fp8_decode"}
    assert {p["kernel"] for p in wg if ratio(p) > 1.35} == {"kimi_k2_mla_decode",
                                                             "deepseek_v32_mla_sparse_decode"}
    chunks = [p for p in wg if "mla_prefill" in p["kernel"] and p["shape"]["total_q"] == 16384]
    assert len(chunks) == 4 and all(0.85 <= ratio(p) <= 0.99 and p["bound"] == "tensor" for p in chunks)
    assert 0.61 <= min(map(ratio, wg)) and max(map(ratio, wg)) <= 1.45
    assert "60 H200 medians of 4078740: 56 within ±35 %, 0.69–1.69" in CALIBRATION_ERROR
    assert "114 H200 wgmma medians of 4078740: 109 within ±35 %, 0.61–1.44" in WGMMA_CALIBRATION_ERROR


def test_copies_are_their_launch_and_their_bytes_and_quoted_as_measured(every_point):
    """The copy families (no attention loop: the appends, merge_states) modelled as their launch
    term plus their bytes (report.costs) over the DRAM share: 22 of the 23 timed copies within
    ±35 %, as the report quotes; outside, the FP8 append with RoPE on the H200 (0.73x: its
    rotation and quantisation are arithmetic the launch term does not hold). The merge of two prefill chunks' states (0.10 ms on the H200 at
    4078740, 402 MB) was 0.05x under the launch term alone."""
    from ptxc.report.loop_model import COPY_FAMILIES
    copies = [p for p in every_point if json.loads((CALIB / p["commit"] / f"{p['kernel']}.json").read_text())[
        "family"] in COPY_FAMILIES]
    ratio = {(p["commit"], p["kernel"]): p["predicted_ms"] / p["median_ms"] for p in copies}
    assert len(copies) == len(ratio) == 23 and sum(p["in_sample"] for p in copies) == 5
    outside = {k for k, r in ratio.items() if not 1 / 1.35 <= r <= 1.35}
    assert outside == {("4078740", "llama3_8b_fp8_rope_append")}, outside
    assert 0.73 <= min(ratio.values()) and max(ratio.values()) <= 1.16
    assert 1.0 <= ratio[("4078740", "deepseek_v3_prefill_merge")] <= 1.15
    assert [p["bound"] for p in copies if p["bound"] == "bandwidth"] == ["bandwidth"]   # the merge
    assert "23 H100 and H200 medians of copies" in COPY_CALIBRATION_ERROR
    assert "5 of them" in COPY_CALIBRATION_ERROR and "22 within ±35 %, 0.73–1.16" in COPY_CALIBRATION_ERROR


def test_every_cta_of_a_sparse_mla_launch_visits_its_share_of_the_n_slots():
    """Sparse top-k MLA has no batch or sequence length: each of the grid's CTAs (token x head
    tile x split) visits its split's share of the N slots in kv_rows tiles, as split_plan
    chunks them: cdiv(128 tiles, 3) = 43, 43 and the remaining 42 (the report gave no estimate
    before: KeyError 'batch')."""
    from ptxc.report.launch_model import cta_iterations
    spec = {"family": "mla", "sparse_topk": 2048, "num_heads": 128, "num_kv_heads": 1}
    work = cta_iterations("mla", spec, {"block_m": 32}, {"total_q": 64, "num_pages": 4096, "num_splits": 3},
                          [64 * 4, 3, 1], 16)
    assert work == [43] * (64 * 4 * 2) + [42] * (64 * 4)     # split-major, as the grid's y
    dense = cta_iterations("mla", {**spec, "sparse_topk": 0}, {"block_m": 64},
                           {"batch": 2, "total_q": 2, "max_pages_per_seq": 2, "page_size": 64}, [2, 1, 1], 16)
    assert dense and all(w > 0 for w in dense)


def test_split_kv_ctas_take_the_kernels_chunk():
    """cta_iterations follows split_plan's chunk, not an even share per split index: DeepSeek-V3
    decode at batch 16 x 4096 (its token the last of the 4096 keys: 128 tiles of 32) on 2 split
    indices. "auto" (MLA rounds down): the `total` term's chunk, 171 tiles, leaves every row
    whole, so split 1's CTAs get nothing; a fixed num_splits = 2: 64 and 64 tiles."""
    from ptxc.report.launch_model import cta_iterations
    spec = {"family": "mla", "num_heads": 128, "num_kv_heads": 1, "page_size": 64, "num_splits": "auto"}
    dims = {"batch": 16, "total_q": 16, "max_pages_per_seq": 64, "num_splits": 2}
    grid = [16 * 128 // 64 + 16, 2, 1]          # query tiles + batch, KV head x split
    config = {"block_m": 64, "block_n": 32}
    assert cta_iterations("mla", spec, config, dims, grid, 32) == [128] * 32 + [0] * 32
    assert cta_iterations("mla", {**spec, "num_splits": 2}, config, dims, grid, 32) == [64] * 64
    # the seesaw's iteration is two tiles: the same split, half the iterations
    assert cta_iterations("mla", {**spec, "num_splits": 2}, config, dims, grid, 64) == [32] * 64


def test_varlen_query_tiles_see_the_causal_keys_and_share_them_through_l2():
    """A varlen sequence's q queries are the last of its L keys, causal among themselves: at
    L = q = 256 (a prefill) with 64-row tiles of one head, tile m visits keys up to 64 (m + 1),
    2, 4, 6, 8 tiles of 32; its 4 tiles re-read the same K/V, all but the first from L2."""
    from ptxc.report.launch_model import cta_iterations
    from ptxc.report.loop_model import kv_reuse
    spec = {"family": "varlen", "num_heads": 2, "num_kv_heads": 2}
    dims = {"batch": 1, "total_q": 256, "max_seq_len": 256}
    config = {"block_m": 64, "block_n": 32}
    assert cta_iterations("varlen", spec, config, dims, [256 // 64 + 1, 2, 1], 32) == [2, 4, 6, 8] * 2
    assert cta_iterations("varlen", {**spec, "causal": False}, config, dims, [5, 2, 1], 32) == [8] * 8
    assert kv_reuse("varlen", config, spec, dims) == 4


def test_split_partials_are_dram_bytes_of_the_launch_and_its_reduce():
    """A split CTA with keys writes its f32 partial rows (head_dim_v wide) and the reduce reads
    them: DRAM bytes of both launches. A row split 0 covers whole writes o itself on the packed
    wgmma / tcgen05 tiles (no partial); the mma.sync tiles write the partial even then."""
    from ptxc.report.launch_model import partial_bytes
    spec = {"family": "mla", "num_heads": 128, "kv_lora_rank": 512, "head_dim": 576}
    dims = {"batch": 16, "total_q": 16, "num_splits": 2}
    one_split = 16 * 128 * 512 * 4                  # every (token, head) row, f32
    wgmma, mma = {"path": "wgmma.m64nNk16"}, {"path": "mma.m16n8k16"}
    assert partial_bytes("mla", spec, wgmma, dims, [65] * 32 + [64] * 32, 2) == 2 * one_split
    assert partial_bytes("mla", spec, wgmma, dims, [129] * 32 + [0] * 32, 2) == 0
    assert partial_bytes("mla", spec, mma, dims, [129] * 32 + [0] * 32, 2) == one_split
