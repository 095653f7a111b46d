"""sm_90a warp-specialised prefill with the consumers' ping-pong (tile.pingpong; Turns in
tma_ws_pipeline.py): the two consumer warpgroups take turns at issuing their wgmma on named
barriers 2 and 3 (bar.sync / bar.arrive, 256 threads). Emulator numerics against fp64 (race
checker and deadlock detection on: a turn out of order deadlocks, an unordered handoff is a
race) on odd shapes, q_len > L, 0 keys, 1-3 stages, head dims 64/128/256 and 192 / 128,
variants; the key's rules; ptxas keeps setmaxnreg with 0 spills; the SASS consumer loop waits
and arrives on the named barriers."""

import json

import numpy as np
import pytest

from ptxc.errors import SpecError
from ptxc.kernels import load_text
from families.prefill_cases import check, compiled, run, spec_text

emu = pytest.importorskip("ptxc.emu", reason="the emulator is needed for numerical checks")
SM90A = ("sm_90a",)
PP = {"pingpong": True}
SMALL = {"block_m": 128, "block_n": 32, **PP}       # two consumer warpgroups, several K/V tiles
SLOW = pytest.mark.slow


def pp_check(dtype, head_dim, heads, causal, shapes, tile=SMALL, extra="", **kw):
    text = spec_text(dtype, head_dim, heads, causal, tile=tile, targets=SM90A)
    if extra:
        text = text.replace("targets = ", extra + "targets = ")
    _, ptx, launch, config = compiled(text, "sm_90a")
    assert config["pingpong"] and config["warp_specialize"] and launch["block"] == [384, 1, 1]
    assert "bar.sync 2, 256;" in ptx and "bar.sync 3, 256;" in ptx and ptx.count("bar.arrive") == 4
    check(text, shapes, target="sm_90a", **kw)


@pytest.mark.parametrize("dtype,head_dim,heads,causal", [
    ("f16", 64, "gqa4", True), ("bf16", 128, "mqa", False),
    *(pytest.param(dt, d, h, c, marks=SLOW) for dt in ("f16", "bf16") for d in (64, 128)
      for h in ("mha", "gqa4", "mqa") for c in (False, True)),
])
def test_matrix(dtype, head_dim, heads, causal):
    pp_check(dtype, head_dim, heads, causal, [(1, 17), (17, 113), (113, 17)])


@pytest.mark.parametrize("head_dim,tile", [(128, PP), (256, PP)])
def test_default_tiles(head_dim, tile):
    pp_check("bf16", head_dim, "gqa4", True, [(150, 131)], tile=tile, batch=1)


def test_deepseek_192_128():
    text = spec_text("bf16", 192, "gqa4", True, tile=PP, targets=SM90A)
    text = text.replace("head_dim = 192\n", "head_dim = 192\nhead_dim_v = 128\n")
    assert compiled(text, "sm_90a")[3]["pingpong"]
    check(text, [(130, 70)], batch=1, target="sm_90a")


@pytest.mark.parametrize("stages", [1, 3])
def test_pipeline_depths(stages):
    pp_check("bf16", 64, "mqa", True, [(40, 100)], tile={**SMALL, "num_stages": stages}, batch=1)


def test_zero_keys_take_no_turn():
    """n_tiles = 0: no prime, no turn, nothing left on the named barriers."""
    outs = run(spec_text("bf16", 128, "gqa4", False, tile=SMALL, targets=SM90A), 9, 0,
               target="sm_90a")[0]
    assert np.all(outs["o"] == 0) and np.all(np.isneginf(outs["lse"]))


@pytest.mark.parametrize("extra", ["sliding_window = 21\nattention_sinks = true\n",
                                   "logits_soft_cap = 2.0\n", "alibi = true\n"])
def test_variants(extra):
    pp_check("bf16", 64, "gqa4", True, [(17, 113)], extra=extra)


def test_same_outputs_as_without_turns():
    """The turns reorder issues, not arithmetic: bit-identical outputs."""
    from families.test_prefill_tma_ws import WS
    base = run(spec_text("f16", 64, "gqa4", True, tile={**WS, "block_m": 128, "block_n": 32},
                         targets=SM90A), 70, 90, target="sm_90a")[0]
    turns = run(spec_text("f16", 64, "gqa4", True, tile=SMALL, targets=SM90A), 70, 90,
                target="sm_90a")[0]
    assert all(np.array_equal(base[k], turns[k]) for k in base)


@pytest.mark.parametrize("tile,message", [
    ({"block_m": 64, **PP}, "takes two consumer warpgroups"),
    ({"warp_specialize": False, **PP}, "takes two consumer warpgroups"),
    ({"kv_loads": "cp_async", **PP}, "takes two consumer warpgroups"),
])
def test_key_rules(tile, message):
    with pytest.raises(SpecError) as e:
        load_text(spec_text("f16", 64, "gqa4", True, tile=tile, targets=SM90A))
    assert e.value.key == "tile.pingpong" and message in str(e.value)
    with pytest.raises(SpecError) as e:
        load_text(spec_text("f16", 64, "gqa4", True, tile=PP, targets=("sm_90",)))
    assert e.value.key == "tile.pingpong" and "add sm_90a or drop the key" in str(e.value)


def test_ptxas_keeps_setmaxnreg_with_zero_spills(toolchain):
    from ptxc.pipeline.ptxas import assemble
    for d, dv in ((64, 64), (128, 128), (256, 256), (192, 128)):
        for causal in (False, True):
            text = spec_text("bf16", d, "gqa4", causal, tile=PP, targets=SM90A)
            if dv != d:
                text = text.replace(f"head_dim = {d}\n", f"head_dim = {d}\nhead_dim_v = {dv}\n")
            _, res, log = assemble(compiled(text, "sm_90a")[1], "sm_90a", toolchain, "p")
            [r] = res.values()
            assert r.spill_stores == r.spill_loads == r.stack == 0 and r.registers == 168, (d, causal)
            assert "C7508" not in log, (d, causal)


def test_sass_consumer_loop_takes_turns(tmp_path, toolchain):
    """The consumer loop waits for its turn and hands it on: ptxas predicates the warpgroup
    branch, so the loop holds BAR.SYNC on barriers 2 and 3 and BAR.ARV on 3 and 2, one of each
    pair per warpgroup (ptxas 13.5: 371 instructions, 1.41 per HMMA-equivalent; without the
    turns 353, 1.34), and the loop's tensor work is unchanged."""
    from conftest import SPECS
    from ptxc.pipeline.build import run_build
    from ptxc.report.sass import SassUnavailable, disassembly_text, find_nvdisasm, sass_profile
    text = (SPECS / "llama3_8b_prefill.toml").read_text()
    text = "\n".join('targets = ["sm_90a"]' if line.startswith("targets") else line
                     for line in text.splitlines()) + "\n[kernel.tile]\npingpong = true\n"
    (tmp_path / "l.toml").write_text(text)
    run_build([tmp_path / "l.toml"], tmp_path / "out", progress=False, cache_dir=tmp_path / "cache")
    art = tmp_path / "out" / "llama3_8b_prefill"
    meta = json.loads((art / "llama3_8b_prefill.json").read_text())
    cubin = (art / meta["targets"]["sm_90a"]["cubin"]).read_bytes()
    try:
        [prof] = sass_profile(cubin).values()
        sass = disassembly_text(find_nvdisasm(), cubin)
    except SassUnavailable as e:
        pytest.skip(f"SASS unavailable: {e}")
    from families.test_prefill_tma_ws import _loop_text
    loop = prof["loops"]["loops"][prof["loops"]["main"]]
    assert (loop["classes"]["tensor"], loop["mma_equivalents"]) == (24, 264)
    bars = sorted((line.split(" ", 1)[1] if line.startswith("@") else line).strip()
                  for line in _loop_text(sass, loop).splitlines() if "BAR." in line and "DEPBAR" not in line)
    assert bars == ["BAR.ARV 0x2, 0x100", "BAR.ARV 0x3, 0x100", "BAR.SYNC.DEFER_BLOCKING 0x2, 0x100",
                    "BAR.SYNC.DEFER_BLOCKING 0x3, 0x100"], bars
    assert loop["instructions_per_mma_equivalent"] <= 1.5
