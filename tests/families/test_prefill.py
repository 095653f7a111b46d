"""Prefill family: numerical checks in the emulator against the fp64 reference (FA2 error rule),
tile configuration and its errors, and the causal work skip.

The default subset covers dtype x causal x GQA x head_dim {64, 128} on small odd shapes with
small tiles (so the K/V pipeline runs several tiles), every dtype once at its default tiles,
BHSD strides, LSE, head_dim 256 and odd head dims; `-m slow` runs the long sweep."""

import itertools

import numpy as np
import pytest

from ptxc.pipeline.compiler import lower
from ptxc.errors import SpecError
from ptxc.kernels import load_text
from ptxc.targets import TARGETS

from families.prefill_cases import (
    PREFILL, SHAPES, SMALL_TILE, check, compiled, growing_scores, run, spec_text)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_lazy_rescale_with_growing_scores(dtype, causal):
    check(spec_text(dtype, 64, "gqa4", causal, tile=SMALL_TILE[dtype]), [(17, 113), (3, 61)],
          transform=growing_scores)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", ["mha", "gqa4", "mqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_matrix_small_tiles(dtype, causal, heads, head_dim):
    check(spec_text(dtype, head_dim, heads, causal, tile=SMALL_TILE[dtype]), SHAPES)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_default_tiles(dtype):
    text = spec_text(dtype, 64, "gqa4", causal=True)
    _, _, _, config = compiled(text, "sm_80")
    assert config["block_m"] == (32 if dtype == "f32" else 128)
    check(text, [(130, 190)], batch=1)


def test_sm90_three_stage_pipeline():
    text = spec_text("f16", 64, "mha", causal=False, targets=("sm_90",))
    assert compiled(text, "sm_90")[3]["num_stages"] == 3
    check(text, [(5, 400)], batch=1, target="sm_90")


@pytest.mark.parametrize("stages", [1, 3, 4])
def test_pipeline_depths(stages):
    check(spec_text("bf16", 64, "mqa", True, tile={"block_m": 16, "block_n": 16, "num_stages": stages}),
          [(40, 100)], batch=1)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_bhsd_strides(dtype):
    check(spec_text(dtype, 64, "gqa4", True, tile=SMALL_TILE[dtype]), [(17, 45)], layout="bhsd")


@pytest.mark.parametrize("dtype,head_dim", [("bf16", 256), ("f32", 256), ("f16", 72), ("bf16", 8),
                                            ("f32", 40)])
def test_other_head_dims(dtype, head_dim):
    check(spec_text(dtype, head_dim, "mqa", True, tile=SMALL_TILE[dtype]), [(1, 17), (23, 9)])


def test_sm75_f32_without_cp_async():
    text = spec_text("f32", 64, "gqa4", True, tile=SMALL_TILE["f32"], targets=("sm_75",))
    spec, ptx, _, config = compiled(text, "sm_75")
    assert "cp.async" not in ptx and config["cp_async"] is False
    check(text, SHAPES, target="sm_75")


def test_no_lse_output_and_empty_rows():
    text = spec_text("f16", 64, "mha", True, lse=False, tile=SMALL_TILE["f16"])
    outs = run(text, 40, 7)[0]
    assert set(outs) == {"o"}
    assert np.all(outs["o"][:, :33] == 0)                 # rows 0..32 see no key: exact zeros
    outs = run(spec_text("f16", 64, "mha", True, tile=SMALL_TILE["f16"]), 40, 7)[0]
    assert np.all(np.isneginf(outs["lse"][:, :, :33])) and np.all(np.isfinite(outs["lse"][:, :, 33:]))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_zero_keys(dtype):
    outs = run(spec_text(dtype, 64, "mha", False, tile=SMALL_TILE[dtype]), 9, 0)[0]
    assert np.all(outs["o"] == 0) and np.all(np.isneginf(outs["lse"]))


def test_causal_skips_masked_tiles():
    """Work is roughly halved, not masked away: count executed instructions."""
    tile = {"block_m": 32, "block_n": 32}
    full = run(spec_text("f16", 64, "mha", False, tile=tile), 256, 256, batch=1)[1]
    causal = run(spec_text("f16", 64, "mha", True, tile=tile), 256, 256, batch=1)[1]
    ratio = causal.thread_instructions / full.thread_instructions
    assert 0.4 < ratio < 0.7, ratio


def test_check_artifact_on_built_spec(tmp_path):
    from ptxc.pipeline.build import run_build
    from ptxc.runtime.launch_test import check_artifact
    from ptxc.runtime import load
    path = tmp_path / "p.toml"
    path.write_text(spec_text("bf16", 64, "gqa4", True, tile=SMALL_TILE["bf16"], targets=("sm_80", "sm_89")))
    run_build([path], tmp_path / "out", verify=False, progress=False, cache_dir=tmp_path / "c")
    art = load(tmp_path / "out" / "p")
    k = art.meta["targets"]["sm_80"]["kernels"][0]
    assert k["grid"] == ["cdiv(seq_q, 32)", "8", "batch"] and k["block"] == [64, 1, 1]
    assert [p["source"]["kind"] for p in k["params"]].count("stride") == 12
    rows = check_artifact(art, backend="emu", shapes={}, seed=3)
    assert len(rows) == 4 and all(r.ok for r in rows), [(r.tensor, r.max_error, r.tol) for r in rows]


# ---- configuration ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,head_dim,target,expect", [
    ("f16", 64, "sm_80", (128, 64, 8, 2)), ("f16", 128, "sm_86", (128, 64, 8, 1)),
    ("f16", 128, "sm_80", (128, 64, 8, 1)), ("bf16", 96, "sm_80", (128, 64, 8, 2)),
    ("f16", 128, "sm_90", (128, 64, 8, 3)), ("bf16", 256, "sm_89", (64, 64, 4, 1)),
    ("bf16", 256, "sm_90", (128, 64, 8, 2)), ("bf16", 256, "sm_80", (64, 64, 4, 1)),
    ("f32", 64, "sm_75", (32, 32, 4, 1)), ("f32", 256, "sm_75", (16, 16, 2, 1)),
])
def test_tile_heuristic(dtype, head_dim, target, expect):
    [spec] = load_text(spec_text(dtype, head_dim, targets=(target,)))
    c = PREFILL.resolve_tile(spec, TARGETS[target])
    assert (c["block_m"], c["block_n"], c["num_warps"], c["num_stages"]) == expect


@pytest.mark.parametrize("dtype,head_dim,tile,targets,key,message", [
    ("f16", 128, {"block_m": 64, "block_n": 256, "num_stages": 4}, ("sm_86",), "tile.block_n",
     "block_n=256, num_stages=4 needs 574464 bytes of shared memory (Q 17408 + 4 x K/V 139264); "
     "sm_86 allows 101376 per CTA"),
    ("f16", 128, {"block_m": 64, "num_warps": 8}, ("sm_80",), "tile.block_m", "block_m must be 16 * num_warps"),
    ("f16", 128, None, ("sm_80", "sm_75"), "targets", "uses mma.m16n8k16 and cp.async (sm_80+), but "
     "targets include sm_75"),
    ("f32", 128, {"block_m": 16, "num_warps": 8}, ("sm_80",), "tile.block_m", "1..8 rows per lane"),
    ("bf16", 192, {"block_m": 16, "block_n": 256}, ("sm_90",), "tile.block_n",
     "needs about 264 registers per thread"),
])
def test_tile_errors(dtype, head_dim, tile, targets, key, message):
    with pytest.raises(SpecError) as e:
        load_text(spec_text(dtype, head_dim, tile=tile, targets=targets))
    assert e.value.key == key and message in str(e.value), str(e.value)


# ---- long sweep ----------------------------------------------------------------------------
SLOW_SHAPES = [(1, 1), (1, 300), (64, 64), (113, 17), (129, 257), (203, 203)]


@pytest.mark.slow
@pytest.mark.parametrize("dtype,causal,heads,head_dim,tiles", list(itertools.product(
    ["f32", "f16", "bf16"], [False, True], ["mha", "gqa4", "mqa"], [64, 96, 128, 256],
    ["default", "small"])))
def test_sweep(dtype, causal, heads, head_dim, tiles):
    tile = SMALL_TILE[dtype] if tiles == "small" else None
    check(spec_text(dtype, head_dim, heads, causal, tile=tile), SLOW_SHAPES, batch=1)


@pytest.mark.parametrize("target", ["sm_80", "sm_90a"])
def test_causal_query_blocks_run_longest_first(target):
    """Causal: CTA x computes query block nctaid.x - 1 - x (the hardware dispatches x first, so
    each head starts with its longest block and the short ones fill the launch's tail); the
    numerics of every causal test above run through this mapping. Non-causal blocks are equal
    work and keep x."""
    for causal in (True, False):
        [spec] = load_text(f'[[kernel]]\nname = "k"\nfamily = "prefill"\ndtype = "f16"\nhead_dim = 64\n'
                           f'num_heads = 2\ncausal = {str(causal).lower()}\ntargets = ["{target}"]\n')
        ptx = lower(spec, target)[0]
        assert ("%nctaid.x" in ptx) == causal
