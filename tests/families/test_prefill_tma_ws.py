"""sm_90a TMA prefill with warp specialisation (tile.warp_specialize, the default where TMA loads
the tiles; tma_ws_pipeline.py):
numerical checks in the emulator (race checker and deadlock detection on) against the fp64
reference on test_prefill_tma.py's shapes, one and two consumer warpgroups, 1-3 stages; the
protocol's failure modes are caught by the emulator (a missing release, a wrong arrival count, a
consumer barrier counting the producer); the tile key's rules; the launch (384 or 256 threads,
.minnctapersm 1, setmaxnreg); ptxas keeps setmaxnreg with 0 spills at d64/128/256; the SASS
consumer loop has no CTA barrier and no TMA issue."""

import json
import re

import numpy as np
import pytest

from ptxc.errors import EmulationError, SpecError
from ptxc.kernels import load_text
from families.prefill_cases import check, compiled, run, run_edited, spec_text

emu = pytest.importorskip("ptxc.emu", reason="the emulator is needed for numerical checks")
SM90A = ("sm_90a",)
WS = {"kv_loads": "tma", "warp_specialize": True}
SMALL = {"block_m": 64, "block_n": 32, **WS}          # one consumer warpgroup
TWO = {"block_m": 128, "block_n": 32, **WS}           # two consumer warpgroups
SHAPES = [(1, 17), (17, 113), (113, 17)]
SLOW = pytest.mark.slow


def ws_check(dtype, head_dim, heads, causal, shapes=SHAPES, tile=SMALL, **kw):
    text = spec_text(dtype, head_dim, heads, causal, tile=tile, targets=SM90A)
    _, ptx, launch, config = compiled(text, "sm_90a")
    consumers = config["block_m"] // 64
    assert config["warp_specialize"] and launch["block"] == [128 * (consumers + 1), 1, 1]
    assert ptx.count("bar.sync 0;") == 1 and f"bar.sync 1, {128 * consumers};" in ptx
    check(text, shapes, target="sm_90a", **kw)


@pytest.mark.parametrize("dtype,head_dim,heads,causal,tile", [
    ("f16", 64, "gqa4", True, SMALL), ("bf16", 128, "mqa", False, SMALL),
    ("f16", 64, "mha", True, TWO),
    *(pytest.param(dt, d, h, c, t, marks=SLOW) for dt in ("f16", "bf16") for d in (64, 128)
      for h in ("mha", "gqa4", "mqa") for c in (False, True) for t in (SMALL, TWO)),
])
def test_matrix(dtype, head_dim, heads, causal, tile):
    ws_check(dtype, head_dim, heads, causal, tile=tile)


@pytest.mark.parametrize("head_dim,block_n,stages", [
    (64, 128, 4), pytest.param(128, 128, 2, marks=SLOW), pytest.param(256, 64, 2, marks=SLOW)])
def test_default_tiles(head_dim, block_n, stages):
    """The default tiles (two consumer warpgroups + the producer; d64 four stages, timed 5 %
    faster than two on an H100 and an H200), q_len > L, a tail tile, and at d64 a sequence of
    five key tiles, so the four slots wrap."""
    text = spec_text("bf16", head_dim, "gqa4" if head_dim < 256 else "mqa", True, tile=WS,
                     targets=SM90A)
    c = compiled(text, "sm_90a")[3]
    assert (c["block_m"], c["block_n"], c["num_warps"], c["num_stages"]) == (128, block_n, 8, stages)
    assert (c["threads"], c["setmaxnreg"], c["min_ctas_per_sm"]) == (384, [24, 240], 1)
    check(text, [(150, 131), (20, 620)] if head_dim < 256 else [(130, 70)], batch=1, target="sm_90a")


def test_short_windows_keep_one_issuer_and_given_stages_stay():
    """The producer warpgroup is the default except under a sliding window of fewer than four
    key tiles (gpt-oss's 128 keys ran 9-10 % faster with one TMA issuer on an H200); the d64
    stage default (4) yields to a given num_stages, block_m 192 and ping-pong (timed at 2)."""
    def config(window=None, **tile):
        text = spec_text("bf16", 64, "gqa4", True, tile=tile or None, targets=SM90A)
        if window:
            text = text.replace("causal = true\n", f"causal = true\nsliding_window = {window}\n")
        return compiled(text, "sm_90a")[3]
    short, long_ = config(128), config(512)
    assert not short.get("warp_specialize") and short["num_stages"] == 2
    assert long_["warp_specialize"] and long_["num_stages"] == 4
    assert config(128, warp_specialize=True)["warp_specialize"]
    assert config(num_stages=2)["num_stages"] == 2
    assert config(block_m=192)["num_stages"] == 2 and config(pingpong=True)["num_stages"] == 2
    # ping-pong and three consumer warpgroups are producer-warpgroup tiles under any window
    for tile in ({"pingpong": True}, {"block_m": 192}):
        c = config(128, **tile)
        assert c["warp_specialize"] and c["threads"] == 128 * (c["block_m"] // 64 + 1)


@pytest.mark.parametrize("stages,tile", [(1, SMALL), (3, SMALL), pytest.param(3, TWO, marks=SLOW)])
def test_pipeline_depths(stages, tile):
    """The full/empty slot and parity arithmetic at other depths (1: the producer waits for
    every tile's release; 3: the slots wrap mid-sequence)."""
    ws_check("bf16", 64, "mqa", True, [(40, 100)], tile={**tile, "num_stages": stages}, batch=1)


@pytest.mark.parametrize("head_dim", [128, pytest.param(256, marks=SLOW)])
def test_block_m_64_at_large_head_dims(head_dim):
    ws_check("f16", head_dim, "gqa4", False, [(70, 45)], tile={**SMALL, "block_n": 64}, batch=1)


def test_bhsd_strides_and_growing_scores():
    from families.prefill_cases import growing_scores
    ws_check("f16", 64, "gqa4", True, [(17, 45)], layout="bhsd")
    ws_check("bf16", 64, "mqa", False, [(3, 97)], tile=TWO, transform=growing_scores)


def test_zero_keys_and_empty_rows():
    """No tile at all (the producer's loop is empty, the consumers skip the last P·V) and
    causal rows that see no key."""
    outs = run(spec_text("bf16", 128, "gqa4", False, tile=SMALL, targets=SM90A), 9, 0,
               target="sm_90a")[0]
    assert np.all(outs["o"] == 0) and np.all(np.isneginf(outs["lse"]))
    outs = run(spec_text("f16", 64, "mha", True, lse=False, tile=TWO, targets=SM90A), 40, 7,
               target="sm_90a")[0]
    assert set(outs) == {"o"} and np.all(outs["o"][:, :33] == 0)


@pytest.mark.parametrize("extra", ["sliding_window = 21\n",
                                   pytest.param("logits_soft_cap = 2.0\n", marks=SLOW),
                                   pytest.param("attention_sinks = true\n", marks=SLOW),
                                   "alibi = true\n"])
def test_variants(extra):
    text = spec_text("f16", 64, "gqa4", True, tile=SMALL, targets=SM90A).replace(
        "[kernel.tile]", extra + "[kernel.tile]")
    check(text, [(17, 113)], batch=1, target="sm_90a")


@pytest.mark.parametrize("tile", [SMALL, TWO])
def test_bit_identical_to_the_single_thread_tma_kernel(tile):
    """Only who issues the copies and how stages are released changed: the math is the same
    instructions in the same order, so the outputs are equal bit for bit."""
    outs = []
    for ws in (False, True):
        text = spec_text("bf16", 64, "gqa4", True, tile={**tile, "warp_specialize": ws},
                         targets=SM90A)
        outs.append(run(text, 70, 113, batch=1, target="sm_90a", seed=3)[0])
    for name in outs[0]:
        assert np.array_equal(outs[0][name], outs[1][name], equal_nan=True), name


# ---- the protocol: the emulator catches what would hang or race on a GPU -----------------------
def _run_edited(tile, edit):
    run_edited(spec_text("f16", 64, "mha", False, tile=tile, targets=SM90A), "sm_90a", edit,
               5, 100, batch=1)


@pytest.mark.parametrize("tile,edit,message", [
    # empty[0] expects one arrival more than the 4 consumer warps give: the producer never refills
    (SMALL, lambda p: re.sub(r"(mbarrier\.init\.shared::cta\.b64 \[%r\d+\+24\], )4;",
                             r"\g<1>5;", p, count=1), "mbarrier deadlock"),
    # the consumers never release a stage
    (SMALL, lambda p: re.sub(r"\n\tmbarrier\.arrive\.shared::cta\.b64 %rd\d+, \[%r\d+\];", "", p),
     "mbarrier deadlock"),
    # the consumers' barrier counting the producer's threads, which never reach it
    (SMALL, lambda p: p.replace("bar.sync 1, 128;", "bar.sync 1, 256;"), "barrier deadlock"),
    # empty[] counting one consumer warpgroup of two (at 2 stages: empty[] at +24 and +32)
    ({**TWO, "num_stages": 2}, lambda p: re.sub(r"(mbarrier\.init\.shared::cta\.b64 \[%r\d+\+(24|32)\], )8;",
                           r"\g<1>4;", p), "arrivals on an mbarrier phase expecting"),
])
def test_protocol_mistakes_are_caught(tile, edit, message):
    with pytest.raises(EmulationError, match=message):
        _run_edited(tile, edit)


def test_a_stage_released_before_the_wgmma_that_reads_it_completed_is_caught(monkeypatch):
    """Planted: the consumers arrive on empty[] right after issuing S(j) and P(j-1)·V(j-1),
    before the wait_group that completes them -- the producer's next box into that stage then
    races with the tensor cores' reads on hardware. The race checker sees a wgmma's operands read
    again when its wait_group retires it, so the refill must be ordered after that."""
    import families.prefill_cases as cases
    import ptxc.kernels.mainloop.tma_ws_pipeline as ws
    import ptxc.kernels.mainloop.wgmma_pipeline as wp
    real = wp.attend_tile

    def early_release(b, math, *args, reads_done=None, **kw):
        if reads_done is not None:
            pv_done = math.pv_done
            math.pv_done = lambda: (reads_done(), pv_done())     # arrive, then wait
        return real(b, math, *args, **kw)

    monkeypatch.setattr(ws, "attend_tile", early_release)
    cases.compiled.cache_clear()
    try:
        with pytest.raises(EmulationError, match="race \\(write after read\\)"):
            run(spec_text("f16", 64, "mha", False, tile=SMALL, targets=SM90A), 5, 100, batch=1,
                target="sm_90a")
    finally:
        cases.compiled.cache_clear()


# ---- the tile key ------------------------------------------------------------------------------
def test_key_rules():
    only = {"warp_specialize": True}
    bad = [(("f16", 64), ("sm_80", "sm_90"), only), (("f32", 64), SM90A, only),
           (("f16", 96), SM90A, only), (("f16", 64), SM90A, {**only, "kv_loads": "cp_async"})]
    for (dtype, d), targets, tile in bad:
        with pytest.raises(SpecError) as e:
            load_text(spec_text(dtype, d, tile=tile, targets=targets))
        assert e.value.key == "tile.warp_specialize" and "\n" not in str(e.value), str(e.value)
    with pytest.raises(SpecError, match="warp_specialize"):
        load_text(spec_text("f16", 64, tile={"warp_specialize": "yes"}, targets=SM90A))


def test_default_on_sm90a_off_is_the_one_issuer_kernel_and_other_targets_ignore_the_key():
    """The producer warpgroup is the sm_90a default where TMA loads the tiles (4-7 % faster on an
    H100); warp_specialize = false is the one-issuer TMA kernel, kv_loads = "cp_async" neither."""
    targets = ("sm_80", "sm_90", "sm_90a")
    ws = spec_text("f16", 64, "gqa4", True, tile=WS, targets=targets)
    off = spec_text("f16", 64, "gqa4", True, tile={**WS, "warp_specialize": False}, targets=targets)
    plain = spec_text("f16", 64, "gqa4", True, targets=targets)
    cp = spec_text("f16", 64, "gqa4", True, tile={"kv_loads": "cp_async"}, targets=targets)
    for target in ("sm_80", "sm_90"):
        assert compiled(ws, target)[1:] == compiled(plain, target)[1:]
    assert compiled(ws, "sm_90a")[1:] == compiled(plain, "sm_90a")[1:]
    assert ".maxntid 256, 1, 1" in compiled(off, "sm_90a")[1] and "setmaxnreg" not in compiled(off, "sm_90a")[1]
    assert "warp_specialize" not in compiled(cp, "sm_90a")[3]
    ptx, launch, config = compiled(ws, "sm_90a")[1:]
    assert ".maxntid 384, 1, 1" in ptx and ".minnctapersm 1" in ptx
    assert "setmaxnreg.dec.sync.aligned.u32 24;" in ptx
    assert "setmaxnreg.inc.sync.aligned.u32 240;" in ptx
    assert launch["block"] == [384, 1, 1] and config["warp_specialize"]


# ---- ptxas and SASS ----------------------------------------------------------------------------
def test_ptxas_keeps_setmaxnreg_with_zero_spills(toolchain):
    from ptxc.pipeline.ptxas import assemble
    for d in (64, 128, 256):
        for dtype in ("f16", "bf16"):
            for causal in (False, True):
                for tile in (WS, {**WS, "block_m": 64, "block_n": 64}):
                    text = spec_text(dtype, d, "gqa4", causal, tile=tile, targets=SM90A)
                    _, res, log = assemble(compiled(text, "sm_90a")[1], "sm_90a", toolchain, "p")
                    [r] = res.values()
                    where = (d, dtype, causal, tile)
                    assert r.spill_stores == r.spill_loads == r.stack == 0, where
                    assert "C7508" not in log and "setmaxnreg" not in log, where
                    # the entry count .minnctapersm 1 pins: 65536 / threads (at most 255)
                    assert r.registers == (168 if "block_m" not in tile else 255), where


@pytest.fixture(scope="module")
def built(tmp_path_factory, toolchain):
    from conftest import SPECS
    from ptxc.pipeline.build import run_build
    tmp = tmp_path_factory.mktemp("tma_ws")
    text = (SPECS / "llama3_8b_prefill.toml").read_text()
    text = "\n".join('targets = ["sm_90a"]' if line.startswith("targets") else line
                     for line in text.splitlines()) + "\n[kernel.tile]\nwarp_specialize = true\n"
    (tmp / "l.toml").write_text(text)
    summary = run_build([tmp / "l.toml"], tmp / "out", progress=False, cache_dir=tmp / "cache")
    return tmp / "out", summary


def test_artifact_and_sass_consumer_loop(built):
    """The consumer loop at d128: the TMA loop's tensor work (24 tensor instructions, 264
    HMMA-equivalents per warp), no BAR.SYNC and no UTMALDG (both left the loop with the
    producer), one mbarrier arrive; the register split is in the SASS (ptxas 13.5: 353
    instructions, 1.34 per HMMA-equivalent; the plain TMA loop: 350, 1.33)."""
    from ptxc.report.sass import SassUnavailable, disassembly_text, find_nvdisasm, sass_profile
    from ptxc.runtime import load
    out, summary = built
    assert summary["verified"] and not summary["problems"]
    meta = load(out / "llama3_8b_prefill").meta
    [kern] = meta["targets"]["sm_90a"]["kernels"]
    assert kern["block"] == [384, 1, 1]
    assert meta["targets"]["sm_90a"]["config"]["setmaxnreg"] == [24, 240]
    _runs_in_the_emulator(out, load)
    cubin = (out / "llama3_8b_prefill" /
             json.loads((out / "llama3_8b_prefill" / "llama3_8b_prefill.json").read_text())
             ["targets"]["sm_90a"]["cubin"]).read_bytes()
    try:
        [prof] = sass_profile(cubin).values()
        text = disassembly_text(find_nvdisasm(), cubin)
    except SassUnavailable as e:
        pytest.skip(f"SASS unavailable: {e}")
    assert "USETMAXREG.DEALLOC.CTAPOOL 0x18" in text and "USETMAXREG.TRY_ALLOC.CTAPOOL" in text
    loop = prof["loops"]["loops"][prof["loops"]["main"]]
    assert (loop["classes"]["tensor"], loop["mma_equivalents"]) == (24, 264)
    body = _loop_text(text, loop)
    assert "BAR.SYNC" not in body and "UTMALDG" not in body
    assert body.count("SYNCS.ARRIVE") == 1
    assert loop["instructions_per_mma_equivalent"] <= 1.5


def _loop_text(sass: str, loop: dict) -> str:
    head, back = int(loop["head"], 16), int(loop["back_edge"], 16)
    lines = []
    for line in sass.splitlines():
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m and head <= int(m.group(1), 16) <= back:
            lines.append(m.group(2))
    return "\n".join(lines)


def _runs_in_the_emulator(out, load):
    """ptxc.runtime (emulator backend) launches the artifact from its metadata (384 threads)."""
    from ptxc.kernels import FAMILIES
    from ptxc.reference import max_abs_error, tolerance
    art = load(out / "llama3_8b_prefill")
    prefill = FAMILIES["prefill"]
    [spec] = load_text((out.parent / "l.toml").read_text())
    inputs = prefill.make_inputs(spec, {"batch": 1, "seq_q": 9, "seq_k": 140},
                                 np.random.default_rng(2))
    got = art.run(inputs, target="sm_90a")["o"]
    ref, naive = prefill.reference(spec, inputs), prefill.reference(spec, inputs, dtype="f16")
    assert max_abs_error(got, ref["o"]) <= tolerance(naive["o"], ref["o"])


# ---- three consumer warpgroups (block_m 192, head dims up to 64: FA3's d64 tile) ----------------
M192 = {"block_m": 192}


@pytest.mark.parametrize("causal,shapes,tile", [
    (True, [(1, 17), (17, 113), (250, 131)], M192),
    (False, [(200, 75)], {**M192, "block_n": 32}),
])
def test_three_consumer_warpgroups(causal, shapes, tile):
    """512 threads (three consumer warpgroups of 64 rows and the producer), setmaxnreg 24 / 160,
    empty[] counting 12 consumer warps; q_len > L, tail tiles, several K/V tiles."""
    text = spec_text("bf16", 64, "gqa4", causal, tile=tile, targets=SM90A)
    _, ptx, launch, config = compiled(text, "sm_90a")
    assert launch["block"] == [512, 1, 1] and config["setmaxnreg"] == [24, 160]
    assert "setmaxnreg.inc.sync.aligned.u32 160;" in ptx
    check(text, shapes, batch=1, target="sm_90a")


def test_three_consumer_warpgroups_variants_and_zero_keys():
    text = spec_text("f16", 64, "gqa4", True, tile={**M192, "block_n": 32}, targets=SM90A)
    check(text.replace("targets = ", "sliding_window = 21\nattention_sinks = true\ntargets = "),
          [(70, 113)], batch=1, target="sm_90a")
    outs = run(spec_text("bf16", 64, "gqa4", False, tile=M192, targets=SM90A), 9, 0,
               target="sm_90a")[0]
    assert np.all(outs["o"] == 0) and np.all(np.isneginf(outs["lse"]))


@pytest.mark.parametrize("d,tile,targets,message", [
    (128, M192, SM90A, "head dims up to 64"),
    (64, {**M192, "warp_specialize": False}, SM90A, "with warp_specialize"),
    (64, {**M192, "kv_loads": "cp_async"}, SM90A, "with warp_specialize"),
    (64, M192, ("sm_80", "sm_90a"), "sm_80 takes 16, 32, 64, 128 or 256"),
    (64, {"block_m": 256}, SM90A, "must be 64 or 128"),
])
def test_three_consumer_warpgroups_rules(d, tile, targets, message):
    with pytest.raises(SpecError) as e:
        load_text(spec_text("bf16", d, "gqa4", True, tile=tile, targets=targets))
    assert e.value.key == "tile.block_m" and message in str(e.value), str(e.value)


def test_three_consumer_warpgroups_zero_spills(toolchain):
    from ptxc.pipeline.ptxas import assemble
    for dtype in ("f16", "bf16"):
        for causal in (False, True):
            text = spec_text(dtype, 64, "gqa4", causal, tile=M192, targets=SM90A)
            _, res, log = assemble(compiled(text, "sm_90a")[1], "sm_90a", toolchain, "p")
            [r] = res.values()
            assert r.spill_stores == r.spill_loads == r.stack == 0 and r.registers == 128, (dtype, causal)
            assert "C7508" not in log
