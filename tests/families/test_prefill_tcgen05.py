"""sm_100a prefill on tcgen05 (config/, math/, bodies/tcgen05 modules): S, P and O in tensor memory, the MMAs and
TMA copies issued by a load warp and an MMA warp (tcgen05_ws_pipeline.py, the default from d128)
or by warp 0 (thread 0 the copies, one elected lane the MMAs; the default at d64). Numerical checks in the emulator against the fp64
reference on odd shapes (seq 1, 17, 113, 333; q_len > L; GQA 1/4/8 and MQA; causal and not;
LSE; the lazy rescale driven by growing scores; variants; bhsd strides; no keys), the path
and tile rules, and ptxas with 0 spills for every head dim and option the path takes."""

import re

import numpy as np
import pytest

from ptxc.errors import EmulationError, SpecError
from ptxc.kernels import FAMILIES, load_text
from ptxc.reference import PROBS_SHIFTS, Precision, max_abs_error, tolerance
from families.prefill_cases import compiled, growing_scores, run, run_edited, spec_text

emu = pytest.importorskip("ptxc.emu", reason="the emulator is needed for numerical checks")
SM100A = ("sm_100a",)
SHAPES = [(1, 17), (17, 113), (113, 17)]
SLOW = pytest.mark.slow
PREFILL = FAMILIES["prefill"]


def check(text, shapes, **kw):
    """test_prefill.check with `ptxc launch-test`'s rule for the f32 LSE: its naive baseline
    is the f32 computation with the probabilities rounded to the dtype before the row sum, as
    the tensor-core row sums do (the largest error of PROBS_SHIFTS grids); o keeps the
    spec-dtype baseline."""
    for seq_q, seq_k in shapes:
        outs, _, spec, inputs = run(text, seq_q, seq_k, **kw)
        ref = PREFILL.reference(spec, inputs)
        naive = {"o": [PREFILL.reference(spec, inputs, dtype=spec.dtype)["o"]],
                 "lse": [PREFILL.reference(spec, inputs, dtype=Precision(
                     "f32", probs=spec.dtype, probs_scale=c)).get("lse") for c in PROBS_SHIFTS]}
        assert sorted(outs) == sorted(ref)
        for name in ref:
            err = max_abs_error(outs[name], ref[name])
            tol = max(tolerance(n, ref[name]) for n in naive[name])
            assert err <= tol, f"{name} at seq_q={seq_q}, seq_k={seq_k}: error {err:.3g} > {tol:.3g}"


def tc_check(dtype, head_dim, heads, causal, shapes=SHAPES, tile=None, extra="", **kw):
    text = spec_text(dtype, head_dim, heads, causal, tile=tile, targets=SM100A)
    if extra:
        text = text.replace('targets = ', extra + 'targets = ')
    _, ptx, launch, config = compiled(text, "sm_100a")
    assert config["path"] == "tcgen05.mma.m128" and ".target sm_100a" in ptx
    assert "tcgen05.mma.cta_group::1.kind::f16" in ptx and "wgmma" not in ptx
    assert [p["name"] for p in launch["params"][-3:]] == ["q_tmap", "k_tmap", "v_tmap"]
    check(text, shapes, target="sm_100a", **kw)


@pytest.mark.parametrize("dtype,head_dim,heads,causal", [
    ("f16", 64, "gqa4", True), ("bf16", 128, "mqa", False), ("bf16", 64, "mha", False),
    ("f16", 128, "gqa8", True),
    *(pytest.param(dt, d, h, c, marks=SLOW) for dt in ("f16", "bf16") for d in (64, 128)
      for h in ("mha", "gqa4", "gqa8", "mqa") for c in (False, True)),
])
def test_matrix(dtype, head_dim, heads, causal):
    tc_check(dtype, head_dim, heads, causal, batch=1)


ONE = {"warp_specialize": False}     # thread 0 issues the copies, warp 0 (one lane) the MMAs
WS = {"warp_specialize": True}       # the load, MMA and softmax warps


def test_default_warp_specialization():
    """The load / MMA / softmax warps (tcgen05_ws_pipeline.py, 320 threads) by default at d128;
    at d64 the one-issuer kernel (256 threads, two CTAs per SM); either on request."""
    config = compiled(spec_text("bf16", 128, "gqa4", True, targets=SM100A), "sm_100a")[3]
    assert config["warp_specialize"] and config["threads"] == 320
    config = compiled(spec_text("bf16", 64, "gqa4", True, targets=SM100A), "sm_100a")[3]
    assert "warp_specialize" not in config
    config = compiled(spec_text("bf16", 64, "gqa4", True, tile={"warp_specialize": True},
                                targets=SM100A), "sm_100a")[3]
    assert config["warp_specialize"] and config["threads"] == 320


def test_s_handed_back_before_its_loads_completed_is_caught():
    """Planted: the softmax warps arrive on s_free with their tcgen05.ld of S(j) not waited for
    (every tcgen05.wait::ld removed): the MMA warp's S(j + 1) overwrites cells whose loads may
    still be reading them -- the emulator's tensor-memory ordering names both."""
    text = spec_text("bf16", 128, "gqa4", True, targets=SM100A)
    with pytest.raises(EmulationError, match="tcgen05.mma D overwrites tensor memory .* that "
                       "warp \\d+ accessed with tcgen05.ld at PTX line \\d+, not ordered after "
                       "it: before its warp's tcgen05.wait::ld completed it"):
        run_edited(text, "sm_100a", lambda p: p.replace("tcgen05.wait::ld.sync.aligned;", ""),
                   17, 300, batch=1)


@pytest.mark.parametrize("dtype,head_dim,heads,causal", [
    ("bf16", 64, "gqa4", True), ("f16", 128, "mqa", False),
    *(pytest.param(dt, d, h, c, marks=SLOW) for dt in ("f16", "bf16") for d in (64, 128)
      for h in ("mha", "gqa8") for c in (False, True)),
])
def test_one_issuing_thread_matrix(dtype, head_dim, heads, causal):
    """tile.warp_specialize = false (d64's default): thread 0 issues the copies, warp 0 the MMAs on
    tma_pipeline.py's schedule (one CTA barrier a tile); several tiles, stage wraps, q_len > L."""
    config = compiled(spec_text(dtype, head_dim, heads, causal, tile=ONE, targets=SM100A),
                      "sm_100a")[3]
    assert "warp_specialize" not in config and config["min_ctas_per_sm"] == 1
    tc_check(dtype, head_dim, heads, causal, SHAPES + [(333, 333), (200, 150)], tile=ONE, batch=1)


def test_one_issuing_thread_rescale_variants_and_no_keys():
    tc_check("f16", 64, "gqa4", True, [(17, 300), (130, 61)], tile=ONE, transform=growing_scores,
             batch=1)
    tc_check("bf16", 128, "gqa4", True, [(130, 200)], tile={**ONE, "num_stages": 3},
             extra="sliding_window = 21\nlogits_soft_cap = 2.0\nattention_sinks = true\n"
                   "alibi = true\n", batch=1)
    text = spec_text("bf16", 128, "gqa4", False, tile=ONE, targets=SM100A)
    outs = run(text, 9, 0, target="sm_100a")[0]
    assert np.all(outs["o"] == 0) and np.all(np.isneginf(outs["lse"]))


@pytest.mark.parametrize("causal", [False, True])
def test_longer_sequences_and_q_longer_than_keys(causal):
    """Several KV tiles and stage wraps (333 keys: 3 tiles of 128), q_len > L, a tail tile."""
    tc_check("bf16", 64, "gqa4", causal, [(333, 333), (200, 150)], batch=1)


def test_block_n_64_and_three_stages():
    tc_check("f16", 128, "gqa4", True, [(130, 301)], tile={"block_n": 64, "num_stages": 3},
             batch=1)


def test_lazy_rescale_with_growing_scores():
    """The running max grows past the slack from tile to tile: O is rescaled in tensor
    memory (load, scale, store) between the P·V of one tile and the next."""
    for causal in (False, True):
        tc_check("f16", 64, "gqa4", causal, [(17, 300), (130, 61)], transform=growing_scores,
                 batch=1)


@pytest.mark.parametrize("head_dim,head_dim_v,block_n,ws", [
    (192, 128, 128, None), (256, 256, 64, None), (192, 192, 64, None), (128, 64, 128, None),
    (256, 128, 64, None), (192, 128, 128, False)],
    ids=["deepseek-192-128", "d256", "d192", "d128-v64", "d256-v128", "deepseek-one-issuer"])
def test_wider_heads_and_narrower_v(head_dim, head_dim_v, block_n, ws):
    """DeepSeek's MLA prefill (192 / 128), d256 and V narrower than K: K's and V's stages and
    boxes of their own widths, S over head_dim, P·V N = head_dim_v (192: O loaded and stored as
    16 + 8 blocks of 16x256b); 128 keys a tile where the stages fit, else 64."""
    tile = None if ws is None else {"warp_specialize": ws}
    extra = f"head_dim_v = {head_dim_v}\n"
    text = spec_text("bf16", head_dim, "gqa4", True, tile=tile, targets=SM100A).replace(
        "targets = ", extra + "targets = ")
    assert compiled(text, "sm_100a")[3]["block_n"] == block_n
    tc_check("bf16", head_dim, "gqa4", True, [(17, 113), (130, 200)], tile=tile, extra=extra,
             batch=1)


def test_bhsd_strides():
    tc_check("bf16", 128, "mqa", True, [(17, 45)], layout="bhsd")


def test_zero_keys_and_empty_rows():
    outs = run(spec_text("bf16", 128, "gqa4", False, targets=SM100A), 9, 0, target="sm_100a")[0]
    assert np.all(outs["o"] == 0) and np.all(np.isneginf(outs["lse"]))
    outs = run(spec_text("f16", 64, "mha", True, lse=False, targets=SM100A), 40, 7,
               target="sm_100a")[0]
    assert set(outs) == {"o"} and np.all(outs["o"][:, :33] == 0)   # rows 0..32 see no key


@pytest.mark.parametrize("extra", ["sliding_window = 21\n", "logits_soft_cap = 2.0\n",
                                   "attention_sinks = true\n", "alibi = true\n"])
def test_variants(extra):
    tc_check("f16", 64, "gqa4", True, [(17, 113), (130, 200)], extra=extra, batch=1)


# ---- two Q tiles per CTA (tile.q_tiles = 2: FlashAttention-4's structure) -----------------------
Q2 = {"q_tiles": 2}
EVERY = "sliding_window = 21\nlogits_soft_cap = 2.0\nattention_sinks = true\nalibi = true\n"


@pytest.mark.parametrize("dtype,head_dim,heads,causal,extra", [
    ("f16", 64, "gqa4", True, ""), ("bf16", 128, "gqa4", True, EVERY),
    pytest.param("bf16", 128, "gqa4", True, "head_dim_v = 64\n", marks=SLOW),
    *(pytest.param(dt, d, h, c, "", marks=SLOW) for dt in ("f16", "bf16") for d in (64, 128)
      for h in ("mha", "gqa4", "gqa8", "mqa") for c in (False, True)),
], ids=lambda x: x.replace("\n", ";")[:24] if isinstance(x, str) else str(x))
def test_two_q_tiles(dtype, head_dim, heads, causal, extra):
    """Two 128-row Q tiles per CTA share each K/V tile: 16 softmax warps (8 a tile, their own
    copy of the loop, S / P / O columns and barriers), the MMA warp issuing both tiles' S then
    both P·V, one CTA per 256 rows (the second tile of the last CTA past seq_q, causal tiles
    beyond the first tile's diagonal); seq 1 / 17 / 113 / 333, q_len > L, variants, 128 / 64."""
    text = spec_text(dtype, head_dim, heads, causal, tile=Q2, targets=SM100A)
    _, ptx, launch, config = compiled(text.replace("targets = ", extra + "targets = "), "sm_100a")
    assert config["q_tiles"] == 2 and config["threads"] == 640 and config["tmem_columns"] == 512
    assert launch["grid"][0] == "cdiv(seq_q, 256)"
    assert re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32 (\d+)", ptx) == [("dec", "48"),
                                                                              ("inc", "104")]
    tc_check(dtype, head_dim, heads, causal, SHAPES + [(333, 333), (200, 150)], tile=Q2,
             extra=extra, batch=1)


def test_two_q_tiles_rescale_stages_and_no_keys():
    tc_check("bf16", 128, "gqa4", True, [(17, 300), (260, 61)], tile=Q2, transform=growing_scores,
             batch=1)
    tc_check("f16", 128, "gqa4", False, [(300, 333)], tile={**Q2, "num_stages": 3}, batch=1)
    outs = run(spec_text("bf16", 128, "gqa4", False, tile=Q2, targets=SM100A), 9, 0,
               target="sm_100a")[0]
    assert np.all(outs["o"] == 0) and np.all(np.isneginf(outs["lse"]))


def test_two_q_tiles_rules():
    """block_n 128 where both tiles' S, P and O fit 512 columns (2 x 256 at d64 and at 128 / 64),
    else 64 (2 x 224 at d128); refused, one line naming tile.q_tiles: with warp_specialize = false,
    where the columns do not fit (block_n 128 at d128), above head_dim 128 (192 / 128 spilled),
    and where no target takes the tcgen05 kernel."""
    for d, extra, bn in ((64, "", 128), (128, "", 64), (128, "head_dim_v = 64\n", 128)):
        text = spec_text("bf16", d, "gqa4", True, tile=Q2, targets=SM100A)
        assert compiled(text.replace("targets = ", extra + "targets = "), "sm_100a")[3]["block_n"] == bn
    for tile, d, targets in (({**Q2, "warp_specialize": False}, 128, SM100A), (Q2, 256, SM100A),
                             ({**Q2, "block_n": 128}, 128, SM100A), (Q2, 128, ("sm_90a",)),
                             (Q2, 192, SM100A)):
        with pytest.raises(SpecError) as e:
            load_text(spec_text("bf16", d, tile=tile, targets=targets))
        assert e.value.key == "tile.q_tiles" and "\n" not in str(e.value), str(e.value)


def _run_edited(edit):
    run_edited(spec_text("bf16", 128, "gqa4", True, tile=Q2, targets=SM100A), "sm_100a", edit,
               333, 333, batch=1)


@pytest.mark.parametrize("edit,message", [
    # warp 0 frees the tensor memory without waiting for the other tile's warps
    (lambda p: p.replace("bar.sync 4, 512;", ""), "tcgen05.dealloc of columns"),
    # the second tile's p_full expects an arrival more than its 8 softmax warps give
    (lambda p: re.sub(r"(mbarrier\.init\.shared::cta\.b64 \[%r\d+\+64\], )8;", r"\g<1>9;", p),
     "mbarrier deadlock"),
    # the softmax warps ask for 112 registers, as they once did: 640 x 96 at entry, less the
    # issuing warpgroup's 128 x 48, leaves the four softmax warpgroups 104 -- the last .inc
    # would wait for ever on hardware
    (lambda p: p.replace("setmaxnreg.inc.sync.aligned.u32 104;", "setmaxnreg.inc.sync.aligned.u32 112;"),
     "setmaxnreg.inc waits for ever"),
])
def test_two_q_tiles_protocol_mistakes_are_caught(edit, message):
    with pytest.raises(EmulationError, match=message):
        _run_edited(edit)


# ---- the correction warpgroup (tile.correction: FlashAttention-4's) ----------------------------
CR = {"correction": True}


@pytest.mark.parametrize("dtype,head_dim,heads,causal,extra,tile", [
    ("f16", 64, "gqa4", True, "", CR), ("bf16", 128, "gqa8", True, EVERY, CR),
    pytest.param("bf16", 192, "gqa4", True, "head_dim_v = 128\n", CR, marks=SLOW),
    # odd stage counts: P's buffer of the loop's P·V is chosen at run time
    ("bf16", 128, "gqa4", True, "", {**CR, "num_stages": 3, "block_n": 64}),
    pytest.param("f16", 64, "gqa8", False, "", {**CR, "num_stages": 1}, marks=SLOW),
    *(pytest.param(dt, d, h, c, "", CR, marks=SLOW) for dt in ("f16", "bf16") for d in (64, 128)
      for h in ("mha", "gqa4", "gqa8", "mqa") for c in (False, True)),
], ids=lambda x: x.replace("\n", ";")[:24] if isinstance(x, str) else str(x))
def test_correction_warpgroup(dtype, head_dim, heads, causal, extra, tile):
    """Four correction warps rescale O in tensor memory where a softmax warp voted (its rows'
    max grew past the lazy slack), between P·V(j - 1) and P·V(j); the softmax warps hand alpha
    over through shared memory and write P(j) to buffer j mod 2 once P·V(j - 2) is done."""
    text = spec_text(dtype, head_dim, heads, causal, tile=tile, targets=SM100A)
    config = compiled(text.replace("targets = ", extra + "targets = "), "sm_100a")[3]
    assert config["correction"] and config["threads"] == 448
    tc_check(dtype, head_dim, heads, causal, SHAPES + [(333, 333), (200, 150)], tile=tile,
             extra=extra, batch=1)


@pytest.mark.parametrize("causal", [pytest.param(False, marks=SLOW), True])
def test_correction_rescales_growing_scores(causal):
    """Scores growing from tile to tile: the max grows past the slack again and again, so the
    correction warps rescale O many times (a correction that skipped it fails here)."""
    tc_check("bf16", 128, "gqa4", causal, [(17, 300), (130, 61), (200, 500)], tile=CR,
             transform=growing_scores, batch=1)
    outs = run(spec_text("bf16", 128, "gqa4", False, tile=CR, targets=SM100A), 9, 0,
               target="sm_100a")[0]
    assert np.all(outs["o"] == 0) and np.all(np.isneginf(outs["lse"]))


def test_correction_rules():
    for tile, targets, d in (({**CR, "warp_specialize": False}, SM100A, 128),
                             (CR, ("sm_90a",), 128), (CR, SM100A, 256)):
        with pytest.raises(SpecError) as e:
            load_text(spec_text("bf16", d, tile=tile, targets=targets))
        assert e.value.key == "tile.correction" and "\n" not in str(e.value), str(e.value)
    config = compiled(spec_text("bf16", 64, tile=CR, targets=SM100A), "sm_100a")[3]
    assert config["warp_specialize"] and config["tmem_columns"] == 512   # S, 2 P, O: 384


def _run_corrected(monkeypatch, edit=None, transform=None):
    """Lower the kernel afresh (under the caller's patches: `compiled` remembers its PTX),
    optionally edit its PTX, run it against fp64, and forget it again."""
    import families.prefill_cases as tp
    cached = tp.compiled
    cached.cache_clear()
    try:
        text = spec_text("bf16", 128, "gqa4", True, tile=CR, targets=SM100A)
        spec, ptx, launch, config = cached(text, "sm_100a")
        if edit is not None:
            edited = edit(ptx)
            assert edited != ptx
            monkeypatch.setattr(tp, "compiled", lambda *_: (spec, edited, launch, config))
        tc_check("bf16", 128, "gqa4", True, [(130, 300)], tile=CR, batch=1, transform=transform)
    finally:
        cached.cache_clear()


def test_correction_mistakes_are_caught(monkeypatch):
    """Planted: the correction warps never rescale (wrong numbers when the max grows); the
    softmax warps write tile j's exchange buffer without waiting for the correction warps to
    have read tile j - 2's (the race checker); the MMA warp issues P·V(j) on p_full instead of
    O_READY (it writes O while the correction warps rescale it)."""
    import ptxc.kernels.math.tcgen05 as tc
    with monkeypatch.context() as m:
        m.setattr(tc.Correction, "tile", lambda self, j: (self.b.tcgen05_fence(before=True),
                                                          self.b.warp_sync()))
        with pytest.raises(AssertionError, match="error"):
            _run_corrected(m, transform=growing_scores)
    with monkeypatch.context() as m:
        pair = tc.wait_pair
        m.setattr(tc, "wait_pair", lambda b, bars, even, odd, i, fence=True:
                  None if even == tc.X_FREE0 else pair(b, bars, even, odd, i, fence))
        with pytest.raises(EmulationError, match="race"):
            _run_corrected(m)
    # the MMA warp's waits on O_READY (+48 into the MMA region) turned into waits on P_FULL
    with monkeypatch.context() as m, pytest.raises(EmulationError, match="tcgen05"):
        _run_corrected(m, edit=lambda p: re.sub(
            r"(mbarrier\.try_wait\.parity\.shared::cta\.b64 %p\d+, \[%r\d+)\+48\]", r"\1+24]", p))


# ---- both: two Q tiles and the correction warpgroup (FlashAttention-4's whole CTA) ------------
Q2CR = {**Q2, **CR}


@pytest.mark.parametrize("dtype,head_dim,heads,causal,extra,tile", [
    ("bf16", 128, "gqa4", True, "", Q2CR), ("f16", 64, "gqa8", True, EVERY, Q2CR),
    pytest.param("bf16", 128, "gqa4", False, "", {**Q2CR, "num_stages": 3}, marks=SLOW),
    pytest.param("bf16", 128, "gqa4", True, "head_dim_v = 64\n", Q2CR, marks=SLOW),
    *(pytest.param(dt, d, h, c, "", Q2CR, marks=SLOW) for dt in ("f16", "bf16") for d in (64, 128)
      for h in ("mha", "gqa4", "gqa8", "mqa") for c in (False, True)),
], ids=lambda x: x.replace("\n", ";")[:24] if isinstance(x, str) else str(x))
def test_two_q_tiles_with_correction(dtype, head_dim, heads, causal, extra, tile):
    """FlashAttention-4's CTA: two 128-row Q tiles (16 softmax warps), one correction
    warpgroup rescaling both tiles' O (each tile its barriers, P buffers and exchange), the
    issuing warpgroup: 768 threads, registers moved by setmaxnreg (issuing 48, correction 48,
    softmax 96); seq 1 / 17 / 113 / 333, q_len > L, variants, head_dim_v 64."""
    text = spec_text(dtype, head_dim, heads, causal, tile=tile, targets=SM100A)
    _, ptx, launch, config = compiled(text.replace("targets = ", extra + "targets = "), "sm_100a")
    assert config["q_tiles"] == 2 and config["correction"] and config["threads"] == 768
    assert config["tmem_columns"] == 512 and launch["grid"][0] == "cdiv(seq_q, 256)"
    assert re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32 (\d+)", ptx) == [
        ("dec", "48"), ("dec", "48"), ("inc", "96")]
    tc_check(dtype, head_dim, heads, causal, SHAPES + [(333, 333), (200, 150)], tile=tile,
             extra=extra, batch=1)


def test_two_q_tiles_with_correction_rescale_and_no_keys():
    """Growing scores: both tiles' correction passes rescale O again and again; no keys."""
    tc_check("bf16", 128, "gqa4", True, [(17, 300), (260, 61)], tile=Q2CR,
             transform=growing_scores, batch=1)
    outs = run(spec_text("bf16", 128, "gqa4", False, tile=Q2CR, targets=SM100A), 9, 0,
               target="sm_100a")[0]
    assert np.all(outs["o"] == 0) and np.all(np.isneginf(outs["lse"]))


@pytest.mark.parametrize("edit,message", [
    # the softmax warps ask for 104: 768 x 80 at entry less 128 x 48 twice leaves them 96
    (lambda p: p.replace("setmaxnreg.inc.sync.aligned.u32 96;", "setmaxnreg.inc.sync.aligned.u32 104;"),
     "setmaxnreg.inc waits for ever"),
    # the MMA warp's waits on each tile's O_READY (+48 into its barriers) turned into waits on
    # its P_FULL: P·V no longer waits for the correction warps (with one Q tile the emulator
    # sees P·V write O under the rescale; with two the phases no longer line up and every
    # warp ends up waiting -- refused either way)
    (lambda p: re.sub(r"(mbarrier\.try_wait\.parity\.shared::cta\.b64 %p\d+, \[%r\d+)\+48\]", r"\1+24]", p),
     "tcgen05|mbarrier deadlock"),
])
def test_two_q_tiles_with_correction_mistakes_are_caught(edit, message):
    with pytest.raises(EmulationError, match=message):
        run_edited(spec_text("bf16", 128, "gqa4", True, tile=Q2CR, targets=SM100A), "sm_100a", edit,
                   333, 333, batch=1)


# ---- the path and its tile key ---------------------------------------------------------------
def test_other_shapes_keep_the_portable_kernels():
    """sm_100 without the suffix, f32 and head dims other than 64/128/192/256 build the
    mma.sync / SIMT kernels, as on sm_90."""
    for dtype, d, target in (("f16", 64, "sm_100"), ("f32", 64, "sm_100a"),
                             ("f16", 96, "sm_100a"), ("bf16", 80, "sm_100a")):
        config = compiled(spec_text(dtype, d, targets=(target,)), target)[3]
        assert config["path"] in ("mma.m16n8k16", "simt"), (dtype, d, target)


def test_tile_keys_it_takes():
    """kv_loads = "tma" (its loads), warp_specialize / pingpong = false, block_n 64 and the
    stage count are accepted and recorded."""
    tile = {"kv_loads": "tma", "block_n": 64, "num_stages": 3}
    config = compiled(spec_text("f16", 128, tile=tile, targets=SM100A), "sm_100a")[3]
    assert (config["block_n"], config["num_stages"], config["kv_loads"]) == (64, 3, "tma")
    assert config["min_ctas_per_sm"] == 1 and config["tmem_columns"] == 256


def test_tile_keys_it_does_not_take():
    for key, value in (("block_m", 64), ("num_warps", 4), ("kv_loads", "cp_async"),
                       ("block_n", 32)):
        with pytest.raises(SpecError) as e:
            load_text(spec_text("f16", 64, tile={key: value}, targets=SM100A))
        assert e.value.key == f"tile.{key}" and "\n" not in str(e.value)
        assert "tcgen05" in str(e.value)
    # pingpong is the sm_90a kernel's own key: ignored on sm_100a, refused when no target takes
    # sm_90a's kernel
    load_text(spec_text("f16", 64, tile={"pingpong": True}, targets=("sm_90a", "sm_100a")))
    with pytest.raises(SpecError, match="sm_90a") as e:
        load_text(spec_text("f16", 64, tile={"pingpong": True}, targets=SM100A))
    assert e.value.key == "tile.pingpong"


@pytest.mark.parametrize("dtype,poly,tile", [
    ("bf16", 2, WS), ("f16", 8, WS), ("bf16", 8, ONE), ("f16", 2, ONE)])
def test_exp2_poly(dtype, poly, tile):
    """tile.exp2_poly: `poly` of every 8 exponentials by the FMA polynomial (FlashAttention-4's
    emulation) -- numerics vs fp64 with the lazy rescale driven, and the ex2.approx left in the
    PTX (8: only the rescale factors' and the sink's)."""
    text = spec_text(dtype, 128 if tile is WS else 64, "gqa4", True,
                     tile={**tile, "exp2_poly": poly}, targets=SM100A)
    _, ptx, _, config = compiled(text, "sm_100a")
    plain = compiled(spec_text(dtype, 128 if tile is WS else 64, "gqa4", True, tile=tile,
                               targets=SM100A), "sm_100a")[1]
    assert config["exp2_poly"] == poly
    assert "add.rm.f32" in ptx and ptx.count("ex2.approx") < plain.count("ex2.approx")
    d = 128 if tile is WS else 64
    tc_check(dtype, d, "gqa4", True, [(17, 113), (113, 150)], tile={**tile, "exp2_poly": poly}, batch=1)
    tc_check(dtype, d, "gqa4", True, [(17, 113)], tile={**tile, "exp2_poly": poly}, batch=1,
             transform=growing_scores)


def test_exp2_poly_rules():
    """0..8; refused (one line, naming the key and the kernel that takes it) where no target
    takes the tcgen05 kernel; 0 records nothing."""
    with pytest.raises(SpecError) as e:
        load_text(spec_text("bf16", 128, tile={"exp2_poly": 2}, targets=("sm_90a",)))
    assert e.value.key == "tile.exp2_poly" and "tcgen05" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(SpecError) as e:
        load_text(spec_text("bf16", 128, tile={"exp2_poly": 9}, targets=SM100A))
    assert e.value.key == "tile.exp2_poly"
    load_text(spec_text("bf16", 128, tile={"exp2_poly": 2}, targets=("sm_90a", "sm_100a")))
    config = compiled(spec_text("bf16", 128, tile={"exp2_poly": 0}, targets=SM100A), "sm_100a")[3]
    assert "exp2_poly" not in config


def test_ptxas_zero_spills(toolchain):
    """ptxas (sm_100a) with 0 spills at each head dim and dtype, causal and not, plain and
    with every variant at once; the tensor-memory columns the tile records. Where warpgroups
    move registers (two Q tiles), ptxas starts every thread at entry_regs(threads) -- the
    count the setmaxnreg budgets (and the emulator's pool) assume."""
    from ptxc.kernels.mainloop.tma_ws_pipeline import entry_regs
    from ptxc.pipeline.ptxas import assemble
    every = "sliding_window = 21\nlogits_soft_cap = 2.0\nattention_sinks = true\nalibi = true\n"
    for d in (64, 128):
        for dtype in ("f16", "bf16"):
            for causal, extra, tile in ((False, "", None), (True, "", None), (True, every, None),
                                        (False, "", ONE), (True, every, ONE), (False, "", WS),
                                        (True, every, WS), (False, "", Q2), (True, every, Q2),
                                        (False, "", CR), (True, every, CR), (False, "", Q2CR),
                                        (True, every, Q2CR)):
                text = spec_text(dtype, d, "gqa4", causal, tile=tile, targets=SM100A)
                text = text.replace("targets = ", extra + "targets = ")
                _, ptx, _, config = compiled(text, "sm_100a")
                _, res, _ = assemble(ptx, "sm_100a", toolchain, "p")
                [r] = res.values()
                assert r.spill_stores == r.spill_loads == 0 and r.stack == 0, (d, dtype, extra, tile)
                assert config["tmem_columns"] == (256 if d == 64 and tile not in (Q2, CR, Q2CR)
                                                  else 512)
                if "setmaxnreg" in ptx:
                    assert r.registers == entry_regs(config["threads"]), (d, dtype, tile)


def _main_loop(tmp_path, tile):
    from ptxc.report.analysis import build_report
    from ptxc.report.sass import SassUnavailable, find_nvdisasm
    try:
        find_nvdisasm()
    except SassUnavailable as e:
        pytest.skip(f"SASS unavailable: {e}")
    from ptxc.pipeline.build import run_build
    text = spec_text("bf16", 128, "gqa4", True, tile=tile, targets=SM100A)
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "s.toml").write_text(text)
    run_build([tmp_path / "s.toml"], tmp_path / "out", progress=False)
    [k] = build_report([tmp_path / "out" / "p"])["kernels"]
    [t] = k["targets"]
    [launch] = t["launches"]
    return launch["loop"]


def test_sass_loop_one_issuing_thread(tmp_path):
    """nvdisasm sm_100a at d128, one issuing thread: the issuing warp's steady path holds the
    CTA's 16 UTCHMMA (8 for S, 8 for P·V) and the other warps' none; every warp loads S and
    stores P once (LDTM, STTM); the report spreads the tile's tensor work over the 8 warps (264
    HMMA-equivalents each: 256 from the tile, 8 row-sum HMMA)."""
    loop = _main_loop(tmp_path, ONE)
    assert set(loop["warp_instructions"]) == {"issuer", "others"}
    assert loop["classes"]["umma"] == 16 and loop["classes"]["tmem"] == 2
    assert loop["umma_flops_per_cta"] == 2 * 128 * 128 * 256
    assert loop["mma_equivalents"] == 264
    assert loop["warp_instructions"]["others"] < loop["warp_instructions"]["issuer"]


def test_sass_loop_warp_specialized(tmp_path):
    """The default at d128: the main loop is the softmax warps' -- no MMA or TMA issue in it,
    one path for all of them, fewer instructions than the one-issuer kernel's other warps."""
    loop = _main_loop(tmp_path, None)
    assert "warp_instructions" not in loop
    assert loop["classes"]["umma"] == 0 and loop["classes"]["tmem"] == 2
    assert loop["mma_equivalents"] == 264
    assert loop["instructions"] < _main_loop(tmp_path / "one", ONE)["warp_instructions"]["others"]


def test_sass_issuing_warps_keep_descriptors_uniform(tmp_path):
    """The MMA and load warps run warp-wide and issue under elect.sync, the MMA loop unrolled by
    the stages (each stage's descriptors computed once): at d128 the MMA warp's loop spends
    about 7 instructions per UTCHMMA -- it was 18.4 when one thread ran it (ptxas wrapped every
    MMA in a loop over the lanes with R2UR moves) -- and the load warp 18 per TMA box (21)."""
    from ptxc.report.loops import issue_loops
    from ptxc.report.sass import disassembly_text
    _main_loop(tmp_path, None)   # builds (and skips without nvdisasm)
    ptx = (tmp_path / "out" / "p" / "p.sm_100a.ptx").read_text()
    assert ptx.count("elect.sync") >= 3
    from ptxc.report.sass import find_nvdisasm
    text = disassembly_text(find_nvdisasm(), (tmp_path / "out" / "p" / "p.sm_100a.cubin").read_bytes())
    [roles] = issue_loops(text).values()
    assert roles["mma"]["issues"] == 2 * 16 and roles["mma"]["per_issue"] < 8, roles
    assert roles["load"]["issues"] == 4 and roles["load"]["per_issue"] < 20, roles


def test_sass_exp2_poly_moves_exponentials_off_mufu(tmp_path):
    """At d128 a softmax warp's tile holds 64 MUFU.EX2; exp2_poly = 2 leaves 48, the other 16
    on the FP32 pipe: about 4 instructions each (f32x2 pairs; 7 in the scalar form)."""
    plain = _main_loop(tmp_path / "plain", None)
    poly = _main_loop(tmp_path / "poly", {"exp2_poly": 2})
    assert plain["classes"]["mufu"] == 64 and poly["classes"]["mufu"] == 48
    assert 16 * 3 <= poly["classes"]["fp32"] - plain["classes"]["fp32"] <= 16 * 5


def test_sm103a_takes_the_same_kernel():
    """B300's target: the same tcgen05 kernel (PTX ISA 8.8), in the emulator and by ptxas."""
    text = spec_text("bf16", 128, "gqa4", True, targets=("sm_103a",))
    _, ptx, _, config = compiled(text, "sm_103a")
    assert ".target sm_103a" in ptx and config["path"] == "tcgen05.mma.m128"
    check(text, [(113, 150)], target="sm_103a", batch=1)
