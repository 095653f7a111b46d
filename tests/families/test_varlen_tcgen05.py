"""varlen on tcgen05 for sm_100a (math/tcgen05.py's Tcgen05Math on varlen_tma.py's body): the
GQA-packed tile with S, P and O in tensor memory, K/V tiles by TMA -- one issuing warp, or
(tile.warp_specialize, the default at block_m 64) tcgen05_ws_pipeline's load, MMA and
softmax warps. Emulator numerics of the real sm_100a PTX against the fp64 reference on ragged
batches (sequence lengths 0 / 1 / 17 / 113, chunks with q_len > 1, pages crossed) whose caches
hold NaN at and past every L and in every page no sequence uses; paged and contiguous, block_m
64 (M = 64: data-path layout F) and 128, causal and not, GQA 4 / 8, split-KV with empty splits,
LSE, variants; planted mistakes in the warp-specialised V tail; which specs take which kernel;
ptxas sm_100a with 0 spills."""

import re

import numpy as np
import pytest

from ptxc.errors import EmulationError, SpecError

from conftest import build_kernel
from ptxc.kernels import FAMILIES, load_text
from ptxc.kernels.attention.varlen_tile import PATH
from ptxc.spec.model import KernelSpec
from ptxc.targets import TARGETS
from families.test_varlen_tma import check_poisoned, spec_body

pytest.importorskip("ptxc.emu", reason="the emulator is needed for numerical checks")
VARLEN = FAMILIES["varlen"]
SM100A = ("sm_100a",)
SLOW = pytest.mark.slow


def build(tmp_path, layout, tile="", extra="", **case):
    art = build_kernel(tmp_path, "varlen", spec_body(layout, **case) + extra, tile=tile,
                       targets=SM100A)
    target = art.meta["targets"]["sm_100a"]
    ptx = (art.path / target["ptx"]).read_text()
    config = target["config"]
    assert config["path"].startswith("tcgen05.mma.m")
    assert config["kv_loads"] == "tma" and config["tmem_columns"] >= 128
    # the attention launch records its columns (occupancy counts them); the reduce has none
    first, *rest = target["kernels"]
    assert first["tmem_columns"] == config["tmem_columns"] and all("tmem_columns" not in k for k in rest)
    assert "cp.async.bulk.tensor.4d" in ptx and "tcgen05.mma.cta_group::1.kind::f16" in ptx
    # the warp-specialised CTA: the load and MMA warps after the block_m / 16 softmax warps
    assert config.get("threads", 32 * config["num_warps"]) == 32 * config["num_warps"] + \
        (64 if config.get("warp_specialize") else 0) + (128 if config.get("correction") else 0)
    return art, KernelSpec.from_dict(art.meta["spec"])


WS, ONE = "warp_specialize = true", "warp_specialize = false"
CR = "correction = true"


@pytest.mark.parametrize("layout,tile,case", [
    ("page16", "", dict(dtype="f16", head_dim=64, gqa="gqa4", causal=True)),
    ("contiguous", "block_n = 32", dict(dtype="bf16", head_dim=128, gqa="gqa8", causal=False,
                                        splits=3)),
    ("page64", "block_m = 128\nnum_warps = 8", dict(dtype="bf16", head_dim=64, gqa="gqa8",
                                                    causal=True, splits=4)),
    # the other kernel where each is not the default
    ("page16", ONE, dict(dtype="bf16", head_dim=64, gqa="gqa8", causal=True, splits=3)),
    ("page16", ONE, dict(dtype="f16", head_dim=128, gqa="gqa4", causal=True, splits="auto")),
    ("contiguous", "block_m = 128\nnum_warps = 8\n" + WS,
     dict(dtype="f16", head_dim=128, gqa="gqa8", causal=True, splits=1)),
    # the correction warps (tile.correction): M = 64 and 128, an odd stage count
    ("page16", CR, dict(dtype="bf16", head_dim=128, gqa="gqa4", causal=True, splits="auto")),
    ("contiguous", "block_m = 128\nnum_warps = 8\n" + CR,
     dict(dtype="f16", head_dim=64, gqa="gqa8", causal=False, splits=3)),
    ("page64", CR + "\nnum_stages = 3", dict(dtype="f16", head_dim=128, gqa="gqa8", causal=True,
                                            splits=1)),
    *(pytest.param(lay, tile, dict(dtype=dt, head_dim=d, gqa=g, causal=c, splits=s), marks=SLOW)
      for tile in ("", ONE) for dt in ("f16", "bf16") for d in (64, 128) for g in ("gqa4", "gqa8")
      for c in (True, False) for lay, s in (("page16", 1), ("page64", "auto"), ("contiguous", 3))
      if tile == "" or d == 64),
], ids=lambda x: "-".join(map(str, x.values())) if isinstance(x, dict) else
    x.replace(" ", "").replace("\n", "-"))
def test_ragged_batch_with_nan_garbage(tmp_path, layout, tile, case):
    art, spec = build(tmp_path, layout, tile, **case)
    check_poisoned(art, spec, layout, target="sm_100a")


@pytest.mark.parametrize("extra", ["sliding_window = 21", "logits_soft_cap = 2.0",
                                   "attention_sinks = true", "alibi = true"])
def test_variants(tmp_path, extra):
    layout = "page16" if "21" in extra else "page64"
    art, spec = build(tmp_path, layout, "", "\n" + extra, dtype="f16", head_dim=64,
                      gqa="gqa4", causal=True, splits=2)
    check_poisoned(art, spec, layout, seed=2, target="sm_100a")


def test_correction_warps_rescale_growing_scores(tmp_path):
    """The correction warps (tile.correction) rescale O as the running max grows past the slack
    from tile to tile (q scaled up, k growing along the keys), with every variant."""
    from ptxc.reference import round_to
    extra = "\nsliding_window = 300\nlogits_soft_cap = 30.0\nattention_sinks = true\nalibi = true"
    art, spec = build(tmp_path, "contiguous", CR, extra, dtype="bf16", head_dim=128, gqa="gqa4",
                      causal=True, splits=1)
    assert art.meta["targets"]["sm_100a"]["config"]["correction"]
    import families.test_varlen_tma as tv
    made = tv.ragged_inputs

    def growing(spec, layout, lengths, seed):
        inputs = made(spec, layout, lengths, seed)
        k = inputs["k_cache"]                  # [batch, max_seq_len, Hk, d]: axis 1 is the key
        rows = np.arange(k.shape[1]).reshape(1, -1, 1, 1)
        inputs["k_cache"] = round_to(k * (1 + rows / 8), spec.dtype).astype(np.float32)
        inputs["q"] = round_to(inputs["q"] * 3, spec.dtype).astype(np.float32)
        return inputs
    tv.ragged_inputs = growing
    try:
        check_poisoned(art, spec, "contiguous", seed=5, target="sm_100a")
    finally:
        tv.ragged_inputs = made


def test_every_variant_on_the_warp_specialised_tile(tmp_path):
    """The load / MMA / softmax warps (d128's default) with window, soft-cap, sinks and ALiBi
    at once: pages wholly before the window never read, split-KV."""
    extra = "\nsliding_window = 21\nlogits_soft_cap = 2.0\nattention_sinks = true\nalibi = true"
    art, spec = build(tmp_path, "page16", "", extra, dtype="bf16", head_dim=128, gqa="gqa4",
                      causal=True, splits=2)
    assert art.meta["targets"]["sm_100a"]["config"]["warp_specialize"]
    check_poisoned(art, spec, "page16", seed=3, target="sm_100a")


# the MMA warp's V tail (varlen_tma.py): its stores, fenced for the async proxy, then the warp's
# named barrier before the elected lane's last P·V
TAIL = re.compile(r"\n\tfence\.proxy\.async[^\n]*\n(\tbar\.sync 2, 32;)")


@pytest.mark.parametrize("what,caught", [
    ("stores", "NaN"),
    ("fence", "shared-memory proxy race"),
])
def test_warp_specialised_v_tail_mistakes_are_caught(tmp_path, monkeypatch, what, caught):
    """The MMA warp zeroes the last V tile's rows past L before the last P·V: without the
    stores NaN reaches O; without the fence (generic-proxy stores read through the MMA's
    async proxy) the emulator's race checker names the line. (The warp's named barrier after
    the fence is not tested: the emulator orders a warp at its elect.sync, which waits for
    every lane; the PTX ISA promises memory ordering for bar.sync / bar.warp.sync.)"""
    import ptxc.kernels.bodies.varlen_tma as vt
    if what == "stores":      # the MMA warp's call (32 threads) leaves the rows as they are
        monkeypatch.setenv("PTXC_CACHE_DIR", str(tmp_path / "cache"))   # not a cached good build
        zero = vt.zero_tail_rows
        monkeypatch.setattr(vt, "zero_tail_rows", lambda b, cfg, tid, v_tile, nvalid, threads=None:
                            None if threads == 32 else zero(b, cfg, tid, v_tile, nvalid, threads))
    art, spec = build(tmp_path, "page16", "", dtype="bf16", head_dim=128, gqa="gqa4",
                      causal=True, splits=1)
    if what != "stores":
        ptx = art.ptx("sm_100a")
        assert len(TAIL.findall(ptx)) == 1
        edited = TAIL.sub(r"\n\1", ptx)
        monkeypatch.setattr(art, "ptx", lambda *_: edited)
    with pytest.raises((AssertionError, EmulationError), match=caught):
        check_poisoned(art, spec, "page16", target="sm_100a")


@pytest.mark.parametrize("layout,d,dv,case", [
    ("page64", 192, 128, dict(dtype="bf16", gqa="gqa4", causal=True, splits="auto")),
    ("contiguous", 256, 256, dict(dtype="f16", gqa="gqa8", causal=False, splits=3)),
    ("page16", 256, 128, dict(dtype="bf16", gqa="gqa4", causal=True, splits=1)),
    ("page16", 192, 192, dict(dtype="f16", gqa="gqa4", causal=True, splits=2)),
], ids=["deepseek-page64", "d256-contiguous", "d256v128-page16", "d192-page16"])
def test_wider_heads_and_narrower_v(tmp_path, layout, d, dv, case):
    """DeepSeek's MLA prefill (192 / 128) and d256 on the packed tile: V's boxes over its own
    slabs, P·V N = head_dim_v, V's tail rows zeroed over its width; NaN past L and in unused
    pages."""
    art, spec = build(tmp_path, layout, "", f"\nhead_dim_v = {dv}", head_dim=d, **case)
    check_poisoned(art, spec, layout, seed=4, target="sm_100a")


def _tile(text: str, target: str = "sm_100a") -> dict:
    [spec] = load_text(f'[[kernel]]\nname = "k"\nfamily = "varlen"\ntargets = ["{target}"]\n'
                       + text)
    VARLEN.validate(spec)
    return VARLEN.resolve_tile(spec, TARGETS[target])


def _path(text: str, target: str = "sm_100a") -> str:
    return _tile(text, target)["path"]


def test_which_tiles_are_warp_specialised():
    """The load / MMA / softmax warps by default at block_m 64 (every head dim: tensor memory
    holds the one-issuer tile to the same CTAs per SM) and at block_m 128 at d64; the
    one-issuer tile at block_m 128 from d128 (where 64 more threads cost a CTA per SM); the
    key overrides either way, and is refused where no target runs the tcgen05 tile."""
    tile = "\n[kernel.tile]\n"
    m128 = tile + "block_m = 128\nnum_warps = 8"
    for d, extra, ws in ((128, "", True), (256, "", True), (192, "\nhead_dim_v = 128", True),
                         (64, "", True), (128, m128, False), (64, m128, True),
                         (64, tile + ONE, False), (128, tile + ONE, False),
                         (128, tile + "block_m = 128\nnum_warps = 8\n" + WS, True), (64, tile + CR, True)):
        got = _tile(spec_body("page16", head_dim=d) + extra)
        assert got.get("warp_specialize", False) == ws, (d, extra)
        assert got.get("threads", 32 * got["num_warps"]) == \
            32 * got["num_warps"] + 64 * ws + 128 * bool(got.get("correction"))
    for text, target in ((spec_body("page16", head_dim=128) + tile + WS, "sm_90"),
                         (spec_body("page4", head_dim=128) + tile + WS, "sm_100a"),
                         (spec_body("page16", head_dim=96) + tile + WS, "sm_100a")):
        with pytest.raises(SpecError) as e:
            _tile(text, target)
        assert e.value.key == "tile.warp_specialize" and "sm_100a tcgen05" in str(e.value)
    # the correction warps: recorded with their 128 threads; refused without the load / MMA
    # warps, above head_dim_v 128, and where no target runs the tcgen05 tile
    got = _tile(spec_body("page16", head_dim=128) + tile + CR)
    assert got["correction"] and got["threads"] == 4 * 32 + 128 + 64
    for text, target in ((spec_body("page16", head_dim=128) + tile + CR + "\n" + ONE, "sm_100a"),
                         (spec_body("page16", head_dim=256) + tile + CR, "sm_100a"),
                         (spec_body("page16", head_dim=128) + tile + CR, "sm_90a")):
        with pytest.raises(SpecError) as e:
            _tile(text, target)
        assert e.value.key == "tile.correction" and "\n" not in str(e.value), str(e.value)


def test_which_specs_take_tcgen05():
    """sm_100a f16/bf16 caches loaded by TMA at head_dim 64/128/192/256 take tcgen05 (M =
    block_m); FP8 caches, pages TMA cannot box, other head dims and sm_100 without the suffix
    keep the mma.sync tile."""
    assert _path(spec_body("page16", head_dim=128)) == "tcgen05.mma.m64"
    assert _path(spec_body("contiguous", head_dim=64) +
                 "\n[kernel.tile]\nblock_m = 128\nnum_warps = 8") == "tcgen05.mma.m128"
    for text, target in ((spec_body("page16", head_dim=128), "sm_100"),
                         (spec_body("page4", head_dim=128), "sm_100a"),
                         (spec_body("page16", head_dim=96), "sm_100a"),
                         (spec_body("page16", head_dim=128) + '\nkv_dtype = "e4m3"\n'
                          'kv_scale = "tensor"', "sm_100a"),
                         (spec_body("page16", head_dim=128) +
                          '\n[kernel.tile]\nkv_loads = "cp_async"', "sm_100a")):
        assert _path(text, target) in ("mma.m16n8k16", PATH), (text, target)
        assert not _path(text, target).startswith("tcgen05"), (text, target)


def test_ptxas_zero_spills(toolchain):
    from ptxc.pipeline.compiler import lower
    from ptxc.pipeline.ptxas import assemble
    every = "\nsliding_window = 21\nlogits_soft_cap = 2.0\nattention_sinks = true\nalibi = true"
    for d in (64, 128):
        for tile in ("", "\n[kernel.tile]\nblock_m = 128\nnum_warps = 8",
                     "\n[kernel.tile]\n" + (ONE if d == 128 else WS),
                     "\n[kernel.tile]\nblock_m = 128\nnum_warps = 8\n" + WS,
                     "\n[kernel.tile]\n" + CR):
            for extra in ("", every):
                for layout in ("page16", "contiguous"):
                    [spec] = load_text('[[kernel]]\nname = "k"\nfamily = "varlen"\n'
                                       'targets = ["sm_100a"]\n'
                                       + spec_body(layout, head_dim=d, causal=True) + extra
                                       + tile)
                    ptx = lower(spec, "sm_100a")[0]
                    _, res, _ = assemble(ptx, "sm_100a", toolchain, "k")
                    [r] = res.values()
                    assert r.spill_stores == r.spill_loads == 0 and r.stack == 0, \
                        (d, tile, extra, layout)
