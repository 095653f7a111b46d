"""MLA decode on tcgen05 for sm_100a (latent_tcgen05.LatentTcgen05Config: 64 head rows on M = 64,
S, P and O in tensor memory, one latent tile per stage by TMA on tma_pipeline's latent loop; the
value columns split between two CTAs of the same rows along grid z, each computing the whole S
and owning 256 columns of O). The real sm_100a PTX in the emulator against the fp64 reference
(make_inputs' mixed batches: q_len 0/1/2/4, L 0/1/63/64/65 and long, pages shuffled, rows no
sequence owns NaN) with the race checker on -- TMA boxes (dense caches of the dtype, e4m3) and
the threads' cp.async (e4m3_ds rows, sparse top-k's slots, pages no box fits); which specs
take the tile; the latent rows read once per value CTA; V never reads the RoPE columns; a
planted mistake; ptxas 0 spills."""

import numpy as np
import pytest

from conftest import assert_pass, build_kernel, build_without_spills, built_sass
from families.test_mla import MLA, _decode_batch, assert_values_skip_rope, body
from ptxc import reference as ref
from ptxc.runtime.launch_test import check_artifact

SM100A = ("sm_100a",)
PATH = "tcgen05.mma.m64"
Q_BYTES, ROW = 64 * 1152, 1152        # DeepSeek's 576 bf16 columns
MMA_REGION = 40                       # umma.py: five 8-byte slots
CASES = {
    # up to 1000 keys in 16-row pages over 3 splits: > 4 tiles of 32 rows per split, so every
    # stage buffer and its mbarrier's phases, and the MMA barriers, are reused under the race
    # checker; with 16-row pages a tile is two boxes a slab
    "h64-bf16-page16-3splits-L1000": (dict(heads=64, splits=3, page=16),
                                      {"batch": 9, "max_pages_per_seq": 63, "num_pages": 600}),
    # two head tiles, f16, a contiguous cache (rows past max_seq_len: the TMA's zeros), unsplit
    "h128-f16-contiguous-1": (dict(dtype="f16", heads=128, layout="contiguous", splits=1),
                              {"batch": 9, "max_seq_len": 70}),
    # FlashMLA's 64-row pages, 3 splits (splits with one tile, and with none; the e4m3 case
    # below runs them by default)
    "h64-bf16-page64-3splits": pytest.param((dict(heads=64, splits=3),
                                             {"batch": 9, "max_pages_per_seq": 5, "num_pages": 60}),
                                            marks=pytest.mark.slow),
    "h128-bf16-page64-auto": pytest.param((dict(heads=128),
                                           {"batch": 9, "max_pages_per_seq": 2, "num_pages": 21}),
                                          marks=pytest.mark.slow),
}


def _config(art) -> dict:
    return art.meta["targets"]["sm_100a"]["config"]


def _check_tile(art, stages: int = 4, block_n: int = 32, row: int = ROW, staged: int = 0,
                loads: str = "tma", dequant: bool = False, sparse: bool = False) -> None:
    """The tile's metadata: 64 rows on 4 warps, two value CTAs (grid z), the latent stages --
    FP8: the converted 16-bit tiles (two; a dequantising warpgroup's ring of three) and the
    stages of `staged`-byte raw rows --, with TMA a full mbarrier a stage (the ring's full and
    empty ones under a dequantising warpgroup), the MMA region and sparse top-k's slot ring."""
    c = _config(art)
    assert (c["path"], c["block_m"], c["num_warps"], c["value_split"], c["value_ctas"]) == \
        (PATH, 64, 4, 2, 2)
    assert (c["block_n"], c["num_stages"], c.get("kv_loads", "cp_async"), c["tmem_columns"]) == \
        (block_n, stages, loads, 512)
    converted = 3 if dequant else 2
    tiles = converted * block_n * row + stages * block_n * staged if staged else stages * block_n * row
    bars = 6 if dequant else stages if loads == "tma" else 0
    ring = 2 * block_n * 8 + 16 * 4 if sparse else 0   # sparse: row offsets, valid-rows words
    assert c["smem_bytes"] == 64 * row + tiles + bars * 8 + MMA_REGION + ring
    assert c.get("fp8_staging_bytes") == (block_n * staged if staged else None)
    assert (c.get("dequant_warpgroup", False), c.get("threads", 128)) == (dequant, 256 if dequant else 128)
    assert "setmaxnreg" not in c      # 256 threads at one CTA per SM: 255 registers each
    launch = art.meta["targets"]["sm_100a"]["kernels"][0]
    assert launch["grid"][2] == "2" and launch["block"] == [256 if dequant else 128, 1, 1]


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_mixed_batch_matches_reference(tmp_path, case):
    """Both value CTAs of every tile: rows past each sequence's L and pages no sequence owns
    hold NaN (masked from S; the last tile's V rows past L zeroed before its P·V; block-table
    entries past L never read: their boxes take id -1, the TMA's zeros); one CTA of the pair
    writes the LSE."""
    keys, shapes = case
    art = build_kernel(tmp_path, "mla", body(**keys), targets=SM100A)
    _check_tile(art)
    assert_pass(check_artifact(art, backend="emu", shapes=shapes, seed=7))


# e4m3 rows (one scale): TMA lands the raw bytes in staging buffers (three 192-byte boxes a row),
# every thread converts its share into one of two alternating 16-bit tiles; bf16 kernels take
# f16 products (Q rescaled per row), qk_products = "e4m3" rounds Q's rows to e4m3 values
L480 = {"batch": 9, "max_pages_per_seq": 30, "num_pages": 290}
L192 = {"batch": 9, "max_pages_per_seq": 12, "num_pages": 120}
DEQUANT = dict(loads="cp_async", dequant=True, stages=2)      # a warpgroup converting: the default
FUSED = dict(loads="tma")                                     # every warp converting TMA-staged rows
FP8_CASES = {   # (keys, shapes, tile, the tile's form)
    # up to 480 keys: > 4 tiles of 32 rows per split, every staging buffer, converted tile and
    # ring phase reused
    "h64-bf16-e4m3-page16-3splits-L480": (dict(heads=64, kv="e4m3", splits=3, page=16), L480, "",
                                          dict(DEQUANT, staged=576)),
    # one split over up to 192 keys: 6 tiles, every stage (and ring slot) reused
    "h64-bf16-e4m3_ds-page16-1-L192": (dict(heads=64, kv="e4m3_ds", splits=1, page=16), L192, "",
                                       dict(DEQUANT, staged=656)),
    "h64-bf16-e4m3-page16-1-L192-fused": (dict(heads=64, kv="e4m3", splits=1, page=16), L192,
                                          "dequant_warpgroup = false", dict(FUSED, staged=576)),
    "h128-f16-e4m3-device-contiguous-1": (dict(dtype="f16", heads=128, kv="e4m3", scale="device",
                                               layout="contiguous", splits=1),
                                          {"batch": 9, "max_seq_len": 70}, "", dict(DEQUANT, staged=576)),
    "h128-f16-e4m3-device-contiguous-1-tma": pytest.param(
        (dict(dtype="f16", heads=128, kv="e4m3", scale="device", layout="contiguous", splits=1),
         {"batch": 9, "max_seq_len": 70}, 'kv_loads = "tma"', dict(FUSED, staged=576)), marks=pytest.mark.slow),
    # 784-byte rows (128 RoPE columns): one staging buffer beside the ring
    "h64-bf16-e4m3_ds-rope128-page64-1": (dict(heads=64, kv="e4m3_ds", rope=128, splits=1),
                                          {"batch": 5, "max_pages_per_seq": 2, "num_pages": 12}, "",
                                          dict(DEQUANT, staged=784, stages=1, row=1280)),
    "h64-bf16-e4m3-qk8-page64-3splits": (dict(heads=64, kv="e4m3", splits=3),
                                         {"batch": 5, "max_pages_per_seq": 3, "num_pages": 20}, "",
                                         dict(DEQUANT, staged=576), 'qk_products = "e4m3"\n'),
}


@pytest.mark.parametrize("case", FP8_CASES.values(), ids=FP8_CASES.keys())
def test_fp8_latent_matches_reference(tmp_path, case):
    """FP8 rows converted by a warpgroup of their own (the default: the threads' cp.async into
    a staging ring, three converted tiles under full / empty mbarriers) or by every softmax
    warp (TMA-staged, two converted tiles). The long cases refill every staging buffer,
    converted tile and mbarrier phase under the race checker and its deadlock detection (a
    conversion without the barrier before it, or a refill of a stage before its conversion
    read it, fails there); k_scale in the softmax scale and 1/l."""
    keys, shapes, tile, form, *extra = case
    art = build_kernel(tmp_path, "mla", body(**keys) + "".join(extra), targets=SM100A, tile=tile)
    _check_tile(art, **form)
    f16 = keys.get("dtype", "bf16") == "bf16" and keys["kv"] == "e4m3"
    assert _config(art).get("mma_inputs") == ("f16" if f16 else None)
    assert_pass(check_artifact(art, backend="emu", shapes=shapes, seed=7))


def test_the_issuing_warp_waits_for_every_warps_p(tmp_path, monkeypatch):
    """Planted: without p_visible (a named barrier of the softmax warps before each P·V) the
    issuing warp's tcgen05.mma reads P that the other warps stored in tensor memory unordered:
    the race checker stops the dequantising tile there."""
    from ptxc.errors import EmulationError
    from ptxc.kernels.math import tcgen05
    monkeypatch.setattr(tcgen05.Tcgen05Math, "p_visible", lambda self: None)
    art = build_kernel(tmp_path, "mla", body(heads=64, kv="e4m3", splits=1, page=16), targets=SM100A)
    assert _config(art)["dequant_warpgroup"]
    with pytest.raises(EmulationError, match="tcgen05.mma"):
        check_artifact(art, backend="emu", seed=5, shapes={"batch": 3, "max_pages_per_seq": 4, "num_pages": 13})


# The threads' cp.async with every softmax warp converting (wgmma_pipeline.run_latent_wgmma_pipeline):
# e4m3_ds rows (656 bytes: no box divides them) staged whole and converted with their group
# scales, dequant_warpgroup = false; pages TMA cannot box (12 rows), or kv_loads = "cp_async" given
CP_ASYNC = {
    "h128-e4m3_ds-paged-3splits-fused": pytest.param(
        (dict(heads=128, kv="e4m3_ds", splits=3), {"batch": 9, "max_pages_per_seq": 3, "num_pages": 30},
         "dequant_warpgroup = false", 4, 656), marks=pytest.mark.slow),
    "h64-e4m3_ds-page16-1-L192-fused": (dict(heads=64, kv="e4m3_ds", splits=1, page=16), L192,
                                        "dequant_warpgroup = false", 4, 656),
    "h64-f16-page12-auto": (dict(dtype="f16", heads=64, page=12),
                            {"batch": 9, "max_pages_per_seq": 9, "num_pages": 90}, "", 4, 0),
    "h64-bf16-contiguous-cp_async-1": (dict(heads=64, layout="contiguous", splits=1),
                                       {"batch": 9, "max_seq_len": 70}, 'kv_loads = "cp_async"', 4, 0),
}


@pytest.mark.parametrize("case", CP_ASYNC.values(), ids=CP_ASYNC.keys())
def test_threads_copies_match_reference(tmp_path, case):
    """The copies' commit groups and the top-of-iteration barrier reuse every stage (and
    converted tile) under the race checker; the last P·V after the loop waits for every warp's
    P in tensor memory (a barrier: without it the race checker names the tcgen05.mma)."""
    keys, shapes, tile, stages, staged = case
    art = build_kernel(tmp_path, "mla", body(**keys), targets=SM100A, tile=tile)
    _check_tile(art, stages=stages, staged=staged, loads="cp_async")
    assert_pass(check_artifact(art, backend="emu", shapes=shapes, seed=7))


# Sparse top-k on tcgen05 (64 head rows where every target runs a tensor-core latent tile):
# test_mla.py's slot batches -- -1, duplicates, slots past the cache, topk_length 0 / 1 / N /
# past N / negative; every row no counted slot names holds NaN
SPARSE = [   # (heads, kv, topk, topk_length, splits, total_q, pages)
    (64, None, 100, True, 3, 7, 5),
    (128, "e4m3_ds", 160, False, 1, 5, 9),
    (64, "e4m3", 64, True, "auto", 7, 5),
]


@pytest.mark.parametrize("case", SPARSE, ids=lambda c: "-".join(map(str, c[:5])))
def test_sparse_topk_on_tcgen05(tmp_path, case):
    heads, kv, topk, topk_length, splits, total_q, pages = case
    art = build_kernel(tmp_path, "mla", body(heads=heads, kv=kv, splits=splits) +
                       f"sparse_topk = {topk}\ntopk_length = {str(topk_length).lower()}\n", targets=SM100A)
    _check_tile(art, staged={None: 0, "e4m3": 576, "e4m3_ds": 656}[kv], sparse=True,
                **(DEQUANT if kv else dict(loads="cp_async")))
    assert_pass(check_artifact(art, backend="emu", shapes={"total_q": total_q, "num_pages": pages},
                               seed=11))


@pytest.mark.parametrize("target,kv", [("sm_100a", "e4m3"), ("sm_90a", "e4m3_ds")])
def test_sparse_fp8_block_n_16_wraps_the_valid_rows_words(tmp_path, target, kv):
    """block_n 16 under the dequantising warpgroup: the most staging buffers (a prologue of up
    to 4 tiles), 16 rows a ballot (lanes 16-31 vote 0) and 300 slots on one split -- 19
    tiles, so the ring of 16 valid-rows words wraps, under the race checker."""
    art = build_kernel(tmp_path, "mla", body(heads=64, kv=kv, splits=1) +
                       "sparse_topk = 300\ntopk_length = true\n", targets=(target,), tile="block_n = 16")
    c = art.meta["targets"][target]["config"]
    assert (c["block_n"], c["dequant_warpgroup"]) == (16, True)
    assert_pass(check_artifact(art, backend="emu", shapes={"total_q": 3, "num_pages": 9}, seed=17))


@pytest.mark.parametrize("target", ["sm_100a", "sm_90a"])
def test_sixteen_heads_in_a_64_row_tile_given(tmp_path, target):
    """DeepSeek-V3 at TP 8 (16 heads) given tile.block_m = 64: a token's 16 heads and up to
    three more speculative tokens of its sequence in one 64-row tensor-core tile (FlashMLA's
    packing; padding rows where the step has fewer), on tcgen05 and on wgmma."""
    art = build_kernel(tmp_path, "mla", body(heads=16, splits=3, page=16), targets=(target,),
                       tile="block_m = 64")
    c = art.meta["targets"][target]["config"]
    assert (c["block_m"], c["path"]) == (64, {"sm_100a": PATH, "sm_90a": "wgmma.m64nNk16"}[target])
    assert_pass(check_artifact(art, backend="emu", seed=5,
                               shapes={"batch": 5, "max_pages_per_seq": 8, "num_pages": 50}))


def test_block_n_16_and_three_stages_given(tmp_path):
    art = build_kernel(tmp_path, "mla", body(heads=64, splits=3, page=16), targets=SM100A,
                       tile="block_n = 16\nnum_stages = 3")
    _check_tile(art, stages=3, block_n=16)
    assert_pass(check_artifact(art, backend="emu", seed=3,
                               shapes={"batch": 5, "max_pages_per_seq": 8, "num_pages": 50}))


@pytest.mark.parametrize("keys,tile,targets,why", [
    (dict(heads=32), "", SM100A, "32 heads: the family's tile is 32 rows"),
    (dict(heads=128, rope=32), "", SM100A, "544 columns: RoPE not whole 64-column slabs"),
    (dict(heads=128, rank=256, rope=64), "", SM100A, "rank 256"),
    (dict(heads=128), "num_stages = 2", SM100A, "two stages: the loop reads two tiles"),
    (dict(heads=128, kv="e4m3_ds", rope=128), "dequant_warpgroup = false", SM100A,
     "784-byte rows, every warp converting: three stages do not fit"),
    (dict(heads=128, kv="e4m3_ds", rope=128), "", SM100A, None),
    (dict(heads=128, kv="e4m3"), "", SM100A, None),
    (dict(heads=128, kv="e4m3_ds"), "", SM100A, None),
    (dict(heads=128, page=12), "", SM100A, None),
])
def test_other_latent_tiles_keep_mma_sync(tmp_path, keys, tile, targets, why):
    """Which latent specs keep the mma.sync tile on sm_100a (why: None -- this one takes tcgen05)."""
    art = build_kernel(tmp_path, "mla", body(**keys), targets=targets, tile=tile)
    assert (_config(art)["path"] == "mma.m16n8k16") == (why is not None), why
    assert art.meta["targets"]["sm_100a"]["kernels"][0]["grid"][2] == ("1" if why else "2")


def test_sparse_beside_a_target_of_32_rows_keeps_them(tmp_path):
    """Sparse top-k listed with sm_90 (whose mma.sync tile stops at 32 sparse rows; a kernel's
    tiles are the same on all its targets) keeps 32 rows, so sm_100a runs the mma.sync tile too;
    alone it takes 64 rows on tcgen05."""
    text = body(heads=128) + "sparse_topk = 64\n"
    both = build_kernel(tmp_path / "a", "mla", text, targets=("sm_90", "sm_100a"))
    assert (_config(both)["block_m"], _config(both)["path"]) == (32, "mma.m16n8k16")
    alone = build_kernel(tmp_path / "b", "mla", text, targets=SM100A)
    assert (_config(alone)["block_m"], _config(alone)["path"]) == (64, PATH)


def test_every_rope_width_takes_the_tile_or_keeps_mma_sync():
    """128 heads, a bf16 cache, every qk_rope_head_dim the spec allows: whole 64-column slabs
    take tcgen05 with the stages that fit (4 at 64: 576 columns; 3 at 128: 640), the rest
    mma.sync."""
    from ptxc.kernels import load_text
    from ptxc.kernels.families import varlen
    from ptxc.kernels.families.mla import attention_view
    from ptxc.targets import TARGETS
    target = TARGETS["sm_100a"]
    for rope in range(16, 129, 16):
        [spec] = load_text(f'[[kernel]]\nname = "k"\nfamily = "mla"\ntargets = ["sm_100a"]\n'
                           f'{body(heads=128, rope=rope)}')
        cfg = varlen.configure(attention_view(spec), target)
        assert cfg.smem_bytes <= target.max_smem_per_cta, rope
        tc = getattr(cfg, "value_ctas", 1) == 2
        assert tc == (rope % 64 == 0), (rope, cfg)
        if tc:
            assert cfg.num_stages == {64: 4, 128: 3}[rope]


def test_latent_rows_are_read_once_per_value_cta(tmp_path, bytes_read):
    """128 heads: two 64-row tiles, each of two value CTAs, so each latent row a sequence with
    queries owns crosses from global memory four times per split (a TMA box is a whole 16-row
    page: the rows up to L's page end, no page past it), never again for V; the threads read
    none of the cache."""
    art = build_kernel(tmp_path, "mla", body(heads=128, splits=3, page=16), targets=SM100A)
    lens = [1, 37, 64, 7, 50, 0, 63]
    spec, inputs, q_lens = _decode_batch(art, lens, [1, 1, 1, 0, 1, 1, 1], 128, np.random.default_rng(4))
    out = art.run(inputs, target="sm_100a")
    rows = [-(-L // 16) * 16 for L, n in zip(lens, q_lens) if n]
    assert bytes_read["kv_cache (TMA)"] == sum(rows) * spec.head_dim * 2 * 2 * 2
    assert bytes_read["kv_cache"] == 0
    assert ref.max_abs_error(out["o"], MLA.reference(spec, inputs)["o"]) < 2e-2


def test_values_never_read_the_rope_columns(tmp_path):
    """Caches that differ only in the RoPE columns give identical bytes: neither value CTA's
    slabs (0-3, 4-7) reach slab 8 (test_mla.assert_values_skip_rope)."""
    assert_values_skip_rope(build_kernel(tmp_path, "mla", body(heads=64, page=16), targets=SM100A),
                            64, "sm_100a")


def test_a_value_cta_reading_the_other_half_fails(tmp_path, monkeypatch):
    """Planted: the second value CTA's P·V reads V from slab 0 (its own half of O gets the
    first half's values)."""
    from ptxc.kernels.math import umma
    monkeypatch.setattr(umma.UmmaIssue, "v_desc", lambda self, v_tile: self.b.umma_descriptor(
        v_tile, self.bn * umma.SWIZZLE, umma.SWIZZLE_PERIOD, umma.SWIZZLE))
    art = build_kernel(tmp_path, "mla", body(heads=64, splits=1, page=16), targets=SM100A)
    results = check_artifact(art, backend="emu", seed=5,
                             shapes={"batch": 3, "max_pages_per_seq": 4, "num_pages": 13})
    assert {r.tensor: r.ok for r in results} == {"o": False, "lse": True}


def test_ptxas_zero_spills_and_utcmma_loop(tmp_path, toolchain):
    """bf16 and f16, paged and contiguous, split and not, RoPE 64 and 128, e4m3, e4m3_ds, sparse
    top-k: 0 spills; the issuing
    warp's loop issues S as 36 UTCHMMA (576 / 16) and P·V as 2 (block_n 32 / 16), no HMMA but
    the two row-sum ones, no ldmatrix."""
    kernels = [f'[[kernel]]\nname = "m_{dt}_{lay}_{rope}"\nfamily = "mla"\ntargets = ["sm_100a"]\n'
               f'{body(dtype=dt, heads=128, layout=lay, splits=s, rope=rope)}\n'
               for dt, lay, s, rope in (("bf16", "paged", "auto", 64), ("f16", "contiguous", 1, 64),
                                        ("bf16", "paged", 1, 128))]
    kernels += [f'[[kernel]]\nname = "m_{tag}"\nfamily = "mla"\ntargets = ["sm_100a"]\n{text}\n'
                for tag, text in (("e4m3", body(heads=128, kv="e4m3")), ("ds", body(heads=128, kv="e4m3_ds")),
                                  ("sparse_ds", body(heads=128, kv="e4m3_ds") + "sparse_topk = 2048\n"),
                                  ("sparse", body(heads=64) + "sparse_topk = 2048\ntopk_length = true\n"))]
    build_without_spills(tmp_path, kernels, "sm_100a")
    _, prof = built_sass(tmp_path / "out", "m_bf16_paged_64", "sm_100a", "ptxc_m_bf16_paged_64_split")
    assert prof["mix"]["LDL"] == prof["mix"]["STL"] == prof["mix"]["LDSM"] == 0
    loop = prof["loops"]["loops"][prof["loops"]["main"]]
    # the issuing warp's path: 36 + 2 UTCHMMA, and every warp's S load and P store (LDTM, STTM)
    assert (loop["classes"]["umma"], loop["classes"]["tmem"], loop["classes"]["tensor"]) == (38, 2, 2)
    assert loop["warp_instructions"]["others"] < loop["warp_instructions"]["issuer"]
