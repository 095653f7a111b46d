"""Prefill example specs through ptxas: 0 spill bytes on every acceptance target at the default
tiles, shared memory recorded as dynamic (with the > 48 KiB opt-in flagged), and SASS evidence
that the tensor-core kernel uses HMMA, LDSM and LDGSTS and touches no local memory."""

import json

import pytest

from conftest import SPECS
from ptxc.pipeline.build import run_build

PREFILL_SPECS = sorted(SPECS.glob("*prefill*.toml"))
TARGETS = ["sm_80", "sm_86", "sm_89", "sm_90", "sm_120"]


@pytest.fixture(scope="module")
def built(tmp_path_factory, toolchain):
    out = tmp_path_factory.mktemp("prefill")
    summary = run_build(PREFILL_SPECS, out, targets=TARGETS, progress=False,
                        cache_dir=tmp_path_factory.mktemp("cache"))
    metas = {k["name"]: json.loads((out / k["name"] / f"{k['name']}.json").read_text())
             for k in summary["kernels"]}
    return out, summary, metas


def test_examples_cover_the_issue():
    names = {p.stem for p in PREFILL_SPECS}
    assert {"llama3_8b_prefill", "mha_d64_prefill", "mqa_d256_prefill"} <= names


def test_every_prefill_spec_assembles_without_spills(built):
    _, summary, metas = built
    assert summary["verified"] and not summary["problems"]
    for name, meta in metas.items():
        assert sorted(meta["targets"]) == sorted(TARGETS)
        for target, t in meta["targets"].items():
            [k] = t["kernels"]
            r = k["resources"]
            assert r["spill_stores"] == r["spill_loads"] == r["stack"] == 0, (name, target)
            assert 0 < r["registers"] <= 255 and k["static_smem_bytes"] == 0
            assert k["dynamic_smem_bytes"] == t["config"]["smem_bytes"] > 0
            assert k["needs_smem_opt_in"] == (k["dynamic_smem_bytes"] > 48 * 1024)
            assert k["occupancy"]["ctas_per_sm"] >= 1
            assert k["grid"] == [f"cdiv(seq_q, {t['config']['block_m']})", str(meta["spec"]["num_heads"]), "batch"]


def test_d128_runs_two_ctas_per_sm_on_sm80(built):
    """Issue 13: f16 d128 prefill fits two 8-warp CTAs per SM on sm_80 (one K/V stage, ptxas
    capped at 128 registers by .minnctapersm 2), without spills; sm_90 keeps its tile."""
    out, _, metas = built
    t = metas["llama3_8b_prefill"]["targets"]["sm_80"]
    [k] = t["kernels"]
    assert (t["config"]["block_m"], t["config"]["block_n"], t["config"]["num_stages"]) == (128, 64, 1)
    assert t["config"]["min_ctas_per_sm"] == 2 and k["occupancy"]["ctas_per_sm"] == 2
    assert k["resources"]["registers"] <= 128 and k["resources"]["spill_stores"] == 0
    assert ".minnctapersm 2" in (out / "llama3_8b_prefill" / t["ptx"]).read_text()
    assert "min_ctas_per_sm" not in metas["llama3_8b_prefill"]["targets"]["sm_90"]["config"]


def test_f32_example_builds_for_sm75(tmp_path, toolchain):
    summary = run_build([SPECS / "gpt2_prefill_f32.toml"], tmp_path, progress=False, cache_dir=tmp_path / "c")
    assert not summary["problems"]
    [k] = summary["kernels"]
    assert "sm_75" in k["targets"] and all(t["spill_bytes"] == 0 for t in k["targets"].values())


@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
def test_sass_tensor_core_evidence(built, target):
    from ptxc.report.sass import SassUnavailable, instruction_mix
    out, _, metas = built
    meta = metas["llama3_8b_prefill"]
    cubin = (out / "llama3_8b_prefill" / meta["targets"][target]["cubin"]).read_bytes()
    try:
        [mix] = instruction_mix(cubin).values()
    except SassUnavailable as e:
        pytest.skip(f"SASS mix unavailable: {e}")
    assert mix["HMMA"] > 0 and mix["LDSM"] > 0 and mix["LDGSTS"] > 0 and mix["MUFU.EX2"] > 0
    assert mix["LDL"] == 0 and mix["STL"] == 0


def test_sass_f32_path_has_no_tensor_cores(built):
    from ptxc.report.sass import SassUnavailable, instruction_mix
    out, _, metas = built
    meta = metas["gpt2_prefill_f32"]
    cubin = (out / "gpt2_prefill_f32" / meta["targets"]["sm_80"]["cubin"]).read_bytes()
    try:
        [mix] = instruction_mix(cubin).values()
    except SassUnavailable as e:
        pytest.skip(f"SASS mix unavailable: {e}")
    assert mix["HMMA"] == 0 and mix["LDL"] == 0 and mix["STL"] == 0


def test_tuned_table_steers_prefill_tiles(tmp_path, monkeypatch):
    """A `ptxc tune` table replaces the heuristic's default tile for its key and target only."""
    from ptxc import tuned
    from ptxc.kernels.families.prefill import resolve_tile
    from ptxc.kernels import load_text
    from ptxc.targets import TARGETS
    tuned.write_table(tmp_path, target="sm_80", sm=80, device_name="NVIDIA A100-SXM4-80GB",
                      entries=[{"family": "prefill", "head_dim": 128, "causal": True, "dtype": "f16",
                                "tile": {"block_m": 64, "block_n": 32, "num_stages": 3, "num_warps": 4},
                                "median_ms": 1.0}])
    monkeypatch.setattr(tuned.lookup, "__defaults__", (None, tmp_path))
    base = ('[[kernel]]\nname = "k"\nfamily = "prefill"\ndtype = "f16"\nhead_dim = 128\n'
            'num_heads = 8\ncausal = {}\n')
    [causal] = load_text(base.format("true"))
    [full] = load_text(base.format("false"))
    got = resolve_tile(causal, TARGETS["sm_80"])
    assert (got["block_m"], got["block_n"], got["num_stages"], got["num_warps"]) == (64, 32, 3, 4)
    assert resolve_tile(full, TARGETS["sm_80"])["block_n"] != 32 or resolve_tile(full, TARGETS["sm_80"])["block_m"] != 64
    assert resolve_tile(causal, TARGETS["sm_89"]) == resolve_tile(full, TARGETS["sm_89"])
