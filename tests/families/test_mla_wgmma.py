"""MLA decode on wgmma for sm_90a (latent_tile.LatentWgmmaConfig: two warpgroups over 64 head
rows, each computing the whole S and owning half of O's 512 columns; one latent tile per stage
on wgmma_pipeline.run_latent_wgmma_pipeline; e4m3 rows staged raw and converted,
kv_fp8_latent.LatentFP8Staging). The real sm_90a PTX in the emulator against the
fp64 reference (make_inputs' mixed batches: q_len 0/1/2/4, L 0/1/63/64/65 and long, rows no
sequence owns NaN), with the race checker on: the long-sequence case reuses every stage buffer
(a refill issued before the barrier that ends the last P·V over it fails there). Plus: which
specs take the path, the latent rows read once per head tile, V never reads the RoPE columns,
ptxas 0 spills with HGMMA in the loop."""

import numpy as np
import pytest

from conftest import assert_pass, build_kernel, build_without_spills, built_sass
from families.test_mla import MLA, _decode_batch, assert_values_skip_rope, body, sparse_body
from families.test_mla_group_scaled import body as ds_body
from ptxc import reference as ref
from ptxc.runtime.launch_test import check_artifact

SM90A = ("sm_90a",)
PATH = "wgmma.m64nNk16"
# the long batches: up to 1008 keys in 16-row pages over 3 splits (> 10 tiles of 32 rows per
# split: every stage buffer and mbarrier phase reused several times), and for the variants of
# a loop one of them covers, up to 480 (> 4 tiles per split: every buffer reused)
L1000 = {"batch": 9, "max_pages_per_seq": 63, "num_pages": 600}
L480 = {"batch": 9, "max_pages_per_seq": 30, "num_pages": 290}
CASES = {   # dense caches of the dtype: TMA boxes by default, cp.async with kv_loads = "cp_async";
    # split_scores (the warpgroups split Q·Kᵀ and exchange partial scores; 3 stages): given with
    # TMA (whose default is the seesaw: test_seesaw_matches_reference), not the default with
    # cp.async (4 stages); the fourth field says which (None: the default)
    # (the traffic test runs 128 bf16 heads over paged rows by default)
    "h128-bf16-paged-auto-tma": pytest.param((dict(heads=128), {"batch": 9, "max_pages_per_seq": 2,
                                                                "num_pages": 21}, "tma", True),
                                             marks=pytest.mark.slow),
    "h128-f16-contiguous-1-tma": (dict(dtype="f16", heads=128, layout="contiguous", splits=1),
                                  {"batch": 9, "max_seq_len": 70}, "tma", True),
    "h128-f16-contiguous-1-cp_async": pytest.param(
        (dict(dtype="f16", heads=128, layout="contiguous", splits=1), {"batch": 9, "max_seq_len": 70},
         "cp_async", None), marks=pytest.mark.slow),
    # up to 1000 keys in 16-row pages over 3 splits: > 4 tiles of 32 rows per split, so every
    # stage buffer (and, by TMA, its mbarrier's phases) and the score exchange are reused while
    # the race checker watches; with 16-row pages a TMA tile is two boxes a slab
    "h64-bf16-page16-3splits-L1000-tma": (dict(heads=64, splits=3, page=16),
                                          {"batch": 9, "max_pages_per_seq": 63, "num_pages": 600}, "tma", True),
    "h64-bf16-page16-3splits-L480-tma-unsplit": (dict(heads=64, splits=3, page=16), L480, "tma", False),
    "h64-bf16-page16-3splits-L1000-cp_async": (dict(heads=64, splits=3, page=16),
                                               {"batch": 9, "max_pages_per_seq": 63, "num_pages": 600},
                                               "cp_async", None),
    "h64-bf16-page16-3splits-L1000-cp_async-split": pytest.param(
        (dict(heads=64, splits=3, page=16), {"batch": 9, "max_pages_per_seq": 63, "num_pages": 600},
         "cp_async", True), marks=pytest.mark.slow),
    # FlashMLA's 64-row pages (one box a slab), 3 splits
    "h64-bf16-page64-3splits-tma": (dict(heads=64, splits=3),
                                    {"batch": 9, "max_pages_per_seq": 5, "num_pages": 60}, "tma", True),
}
# e4m3 latent rows (one scale): staged raw -- by the threads' cp.async by default, TMA boxes of
# 192 columns with kv_loads = "tma" -- and converted (split by default): the threads' copies by
# the dequantising warpgroup into a ring of three tiles by default, else (dequant_warpgroup =
# false, and by TMA) by every warp into two alternating tiles; the fifth field: the
# dequant_warpgroup given (None: the default)
FP8_CASES = {
    "h128-e4m3-paged-auto": pytest.param((dict(heads=128, kv="e4m3"),
                                          {"batch": 9, "max_pages_per_seq": 2, "num_pages": 21},
                                          "cp_async", None, None), marks=pytest.mark.slow),
    "h64-e4m3-device-page16-3splits-L1000-tma": (dict(heads=64, kv="e4m3", scale="device", splits=3, page=16),
                                                 L1000, "tma", None, None),
    "h64-e4m3-page16-3splits-L1000": (dict(heads=64, kv="e4m3", splits=3, page=16), L1000, "cp_async", None, None),
    "h64-e4m3-page16-3splits-L480-fused": (dict(heads=64, kv="e4m3", splits=3, page=16), L480, "cp_async",
                                           None, False),
    "h64-e4m3-device-page16-3splits-L480-unsplit": (
        dict(heads=64, kv="e4m3", scale="device", splits=3, page=16), L480, "cp_async", False, None),
    "h64-e4m3-page16-3splits-L1000-tma-unsplit": pytest.param(
        (dict(heads=64, kv="e4m3", splits=3, page=16), L1000, "tma", False, None), marks=pytest.mark.slow),
    "h128-f16-e4m3-contiguous-1": (dict(dtype="f16", heads=128, kv="e4m3", layout="contiguous", splits=1),
                                   {"batch": 9, "max_seq_len": 70}, "tma", False, None),
    "h128-f16-e4m3-contiguous-1-cp_async": (dict(dtype="f16", heads=128, kv="e4m3", layout="contiguous", splits=1),
                                            {"batch": 9, "max_seq_len": 70}, "cp_async", None, None),
}
DEQUANT_BARRIERS = 48        # full[3] and empty[3], 8 bytes each
Q_BYTES, TILE, EXCHANGE = 64 * 1152, 32 * 1152, 2 * 64 * 32 * 4


def _config(art):
    return art.meta["targets"]["sm_90a"]["config"]


def _split_tile(split) -> str:
    return "" if split is None else f"split_scores = {str(split).lower()}"


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_mixed_batch_matches_reference(tmp_path, case):
    """Rows past each sequence's L and pages no sequence owns hold NaN: by TMA they land in the
    tile (masked from S; the last tile's V rows past L zeroed before its P·V), block-table
    entries past L are never read (their boxes take id -1: the TMA's zeros)."""
    keys, shapes, loads, split = case
    tile = "\n".join(x for x in ("" if loads == "tma" else f'kv_loads = "{loads}"', _split_tile(split)) if x)
    art = build_kernel(tmp_path, "mla", body(**keys), targets=SM90A, tile=tile)
    c = _config(art)
    assert (c["path"], c["block_m"], c["num_warps"], c["value_split"]) == (PATH, 64, 8, 2)
    split = bool(split)
    stages = 3 if split else 4
    barriers = 32 if loads == "tma" else 0             # 8 bytes a stage, padded to 16
    assert (c["block_n"], c["num_stages"], c.get("split_scores", False)) == (32, stages, split)
    assert c["smem_bytes"] == Q_BYTES + stages * TILE + barriers + split * EXCHANGE
    assert c.get("kv_loads", "cp_async") == loads
    assert [p["name"] for p in art.meta["targets"]["sm_90a"]["kernels"][0]["params"]
            if p["source"]["kind"] == "tensor_map"] == (["kv_tmap"] if loads == "tma" else [])
    assert_pass(check_artifact(art, backend="emu", shapes=shapes, seed=7))


def _fp8_tile(c: dict, row_bytes: int, loads: str, split: bool, dequant: bool, sparse: bool = False) -> None:
    """The FP8 wgmma tile's metadata: under the dequantising warpgroup 384 threads, setmaxnreg
    104 / 200, three converted 36 KiB tiles and the staging buffers that fit beside them (one
    with the score exchange, two without); else 256 threads, two converted tiles and three
    staging buffers with the exchange, four without; sparse top-k's slot ring before the
    exchange (two tiles of 8-byte row offsets, then 16 words of valid rows; the dequantising
    warpgroup takes 120 registers there and leaves 192)."""
    stages = (1 if split else 2) if dequant else (3 if split else 4)
    tiles, barriers = (3, DEQUANT_BARRIERS) if dequant else (2, 32 if loads == "tma" else 0)
    assert (c["path"], c["num_stages"], c["fp8_staging_bytes"]) == (PATH, stages, 32 * row_bytes)
    assert (c.get("split_scores", False), c.get("kv_loads", "cp_async")) == (split, loads)
    assert c["smem_bytes"] == Q_BYTES + tiles * TILE + stages * 32 * row_bytes + barriers + split * EXCHANGE \
        + sparse * (2 * 32 * 8 + 64)
    regs = [120, 192] if sparse else [104, 200]
    assert (c.get("dequant_warpgroup", False), c.get("threads"), c.get("setmaxnreg")) == \
        ((True, 384, regs) if dequant else (False, None, None))


@pytest.mark.parametrize("case", FP8_CASES.values(), ids=FP8_CASES.keys())
def test_fp8_latent_matches_reference(tmp_path, case):
    """FP8 bytes in 18 KiB staging buffers (by TMA three 192-column boxes a page, or the
    threads' cp.async) converted into 36 KiB tiles (_fp8_tile); k_scale in the softmax scale
    and 1/l. The long cases refill every staging buffer, converted tile and (dequantising
    warpgroup) full / empty phase under the race checker and its deadlock detection (a
    conversion without the barrier before it, or a release before the P·V retired, fails
    there)."""
    keys, shapes, loads, split, dequant = case
    tile = "\n".join(x for x in ('kv_loads = "tma"' if loads == "tma" else "", _split_tile(split),
                                 "" if dequant is None else f"dequant_warpgroup = {str(dequant).lower()}") if x)
    art = build_kernel(tmp_path, "mla", body(**keys), targets=SM90A, tile=tile)
    _fp8_tile(_config(art), 576, loads, True if split is None else split,
              loads == "cp_async" if dequant is None else dequant)
    assert_pass(check_artifact(art, backend="emu", shapes=shapes, seed=7))


SPARSE = [   # (heads, rank, rope, dtype, kv, scale, topk, topk_length, splits, total_q, pages)
    (128, 512, 64, "bf16", None, None, 300, True, 1, 5, 9),          # > 4 tiles a token
    (64, 512, 64, "f16", "e4m3", "device", 100, False, 3, 7, 5),
    (128, 512, 64, "bf16", None, None, 40, True, "auto", 7, 5),
]


@pytest.mark.parametrize("case", SPARSE, ids=lambda c: "-".join(map(str, c[:9])))
def test_sparse_topk_on_wgmma(tmp_path, case):
    """Sparse top-k (DeepSeek-V3.2) on the wgmma tile when sm_90a is the spec's only target:
    64 head rows (the mma.sync tile stops at 32 there), past the first tile each copy reading
    its rows' offsets from the slot ring (kv_pages.SparseSlots);
    -1, duplicates, slots past the cache and negative ones, topk_length out of range, every
    row no counted slot names NaN (test_mla.py's sparse batches)."""
    *keys, total_q, pages = case
    art = build_kernel(tmp_path, "mla", sparse_body(*keys), targets=SM90A)
    c = _config(art)
    assert (c["path"], c["block_m"], c["num_warps"]) == (PATH, 64, 8)
    assert_pass(check_artifact(art, backend="emu", shapes={"total_q": total_q, "num_pages": pages}, seed=13))


@pytest.mark.parametrize("target", ["sm_90a", "sm_90"])
def test_a_valid_rows_word_one_tile_off_fails(tmp_path, monkeypatch, target):
    """Planted: the warps that mask a sparse tile's scores read the word of valid rows its
    copies published (under sm_90a's dequantising warpgroup, and on sm_90's mma.sync tile where
    the same warps copy); reading the next tile's word instead, they mask another tile's keys
    and the results go wrong -- or, where the next tile's word was never written (sm_90's last
    tile), the emulator stops at the read."""
    from ptxc.kernels.attention import packed_tile
    from ptxc.kernels.kv.kv_pages import valid_word_slot
    monkeypatch.setattr(packed_tile, "valid_word_slot",
                        lambda b, words, key0, bn: valid_word_slot(b, words, b.add(key0, bn), bn))
    art = build_kernel(tmp_path, "mla", sparse_body(64, 512, 64, "bf16", "e4m3", None, 100, True, 1),
                       targets=(target,))
    assert art.meta["targets"][target]["config"].get("dequant_warpgroup", False) == (target == "sm_90a")
    from ptxc.errors import EmulationError
    try:
        results = check_artifact(art, backend="emu", shapes={"total_q": 7, "num_pages": 5}, seed=13)
    except EmulationError as e:
        assert "never-written shared memory" in str(e)
        return
    assert {r.tensor: r.ok for r in results} == {"o": False, "lse": False}


DS = {   # FlashMLA's fp8_ds_mla rows (656 bytes: e4m3 latent, 4 group scales, bf16 RoPE); the
    # third field: dequant_warpgroup given (None: the default)
    "h128-paged-auto": (ds_body(heads=128), {"batch": 9, "max_pages_per_seq": 2, "num_pages": 21}, None),
    "h128-paged-auto-fused": (ds_body(heads=128), {"batch": 9, "max_pages_per_seq": 2, "num_pages": 21}, False),
    "h128-sparse-top300-1split": (ds_body(heads=128, splits=1, extra="sparse_topk = 300\ntopk_length = true\n"),
                                  {"total_q": 5, "num_pages": 9}, None),
    "h128-page16-3splits-L480": (ds_body(heads=128, splits=3, page=16), L480, None),
    "h128-page16-3splits-L1000-fused": pytest.param(
        (ds_body(heads=128, splits=3, page=16), L1000, False), marks=pytest.mark.slow),
}


@pytest.mark.parametrize("case", DS.values(), ids=DS.keys())
def test_group_scaled_rows_on_wgmma(tmp_path, case):
    """e4m3_ds rows with sm_90a the only target: 64 head rows on the wgmma tile; whole 656-byte
    rows staged (20.5 KiB buffers), each latent chunk multiplied by its row's group scale (read
    from the staged row another thread copied) and rounded once, RoPE copied -- by the
    dequantising warpgroup (one staging buffer) or by every warp (three); unowned rows hold
    NaN bytes, scales and RoPE."""
    text, shapes, dequant = case
    tile = "" if dequant is None else f"dequant_warpgroup = {str(dequant).lower()}"
    art = build_kernel(tmp_path, "mla", text, targets=SM90A, tile=tile)
    c = _config(art)
    assert c["block_m"] == 64
    _fp8_tile(c, 656, "cp_async", True, dequant is None, sparse="sparse_topk" in text)
    assert_pass(check_artifact(art, backend="emu", shapes=shapes, seed=7))


@pytest.mark.parametrize("kv", [None, "e4m3", "e4m3_ds"])
def test_every_rope_width_fits_one_ctas_shared_memory(kv):
    """sm_90a alone, 128 heads, every qk_rope_head_dim the spec allows: the tile fits one CTA's
    shared memory (the wgmma tile needs three stages when every warp converts: e4m3_ds rows with
    128 RoPE columns, 784 bytes, would need 239104 bytes, so they keep the mma.sync tile at 32
    rows; the dequantising warpgroup, which would fit them, spills there and takes only 64)."""
    from ptxc.kernels import load_text
    from ptxc.kernels.families import mla, varlen
    from ptxc.targets import TARGETS
    target = TARGETS["sm_90a"]
    for rope in range(16, 129, 16):
        extra = "" if kv is None else f'kv_dtype = "{kv}"\n'
        [spec] = load_text(f'[[kernel]]\nname = "m"\nfamily = "mla"\ndtype = "bf16"\nnum_heads = 128\n'
                           f'softmax_scale = 0.1\nqk_rope_head_dim = {rope}\n{extra}'
                           f'targets = ["sm_90a"]\n', "m.toml")
        cfg = varlen.configure(mla.attention_view(spec), target)
        assert cfg.smem_bytes <= target.max_smem_per_cta, (kv, rope)
        wgmma = rope % 64 == 0 and not (kv == "e4m3_ds" and rope == 128)
        assert (cfg.block_m == 64 and cfg.num_warps == 8) == wgmma, (kv, rope, cfg)


@pytest.mark.parametrize("extra,target,tile", [
    ('kv_dtype = "e4m3_ds"\nqk_rope_head_dim = 128\n', "sm_90a", ""),
    ('sparse_topk = 100\nqk_products = "e4m3"\n', "sm_90a", ""),
    ('kv_dtype = "bf16"\n', "sm_90a", ""),
    # sm_100a's tcgen05 tile: TMA-staged e4m3 keeps every warp converting
    ("", "sm_100a", 'kv_loads = "tma"\n'),
    ('kv_dtype = "bf16"\n', "sm_100a", "")])
def test_a_dequantising_warpgroup_where_it_does_not_apply_is_one_line(extra, target, tile):
    """e4m3_ds rows of 128 RoPE columns on sm_90a (784 bytes: the dequantising warps spill),
    sparse top-k with e4m3 score products on sm_90a (its gathering warps spill), TMA-staged
    rows, a cache of the dtype: refused with the key, one line."""
    from ptxc.errors import SpecError
    from ptxc.kernels import load_text
    kv = "" if "kv_dtype" in extra else 'kv_dtype = "e4m3"\n'
    text = ('[[kernel]]\nname = "m"\nfamily = "mla"\ndtype = "bf16"\nnum_heads = 128\n'
            f'softmax_scale = 0.1\n{kv}{extra}targets = ["{target}"]\n[kernel.tile]\n{tile}'
            'dequant_warpgroup = true\n')
    with pytest.raises(SpecError) as e:
        load_text(text, "m.toml")
    assert "dequant_warpgroup" in str(e.value) and "\n" not in str(e.value)


def test_sparse_with_another_target_keeps_32_rows(tmp_path):
    """Listed with sm_90 (the mma.sync tile spills at 64 sparse rows), a sparse spec keeps 32
    head rows on every target, so sm_90a runs the mma.sync tile too (one grid for all)."""
    art = build_kernel(tmp_path, "mla", sparse_body(128, 512, 64, "bf16", None, None, 64, False, 1),
                       targets=("sm_90", "sm_90a"))
    assert (_config(art)["path"], _config(art)["block_m"]) == ("mma.m16n8k16", 32)


@pytest.mark.parametrize("keys,why", [
    (dict(heads=16), "16 head rows: wgmma's M is 64"),
    (dict(heads=128, rank=256, rope=64), "rank 256: one warpgroup's n256 would do, not built"),
])
def test_other_latent_tiles_keep_mma_sync(tmp_path, keys, why):
    art = build_kernel(tmp_path, "mla", body(**keys), targets=SM90A)
    assert _config(art)["path"] == "mma.m16n8k16", why


@pytest.mark.parametrize("keys,tile,loads", [
    (dict(heads=64), "", "tma"),                                # FlashMLA's 64-row pages
    (dict(heads=64, page=8), "", "tma"),                        # one swizzle period: 4 boxes a slab
    (dict(heads=64, page=1), "", "cp_async"),                   # a box would start mid-period
    (dict(heads=64, page=48), "", "cp_async"),                  # a 32-row tile would cross a page
    (dict(heads=64, kv="e4m3"), "", "cp_async"),                # e4m3 rows: the threads' copies ...
    (dict(heads=64, kv="e4m3"), 'kv_loads = "tma"', "tma"),     # ... or 192-column boxes, staged
    (dict(heads=64, kv="e4m3_ds"), "", "cp_async"),             # 656-byte rows: no box width fits
    (dict(heads=64, layout="contiguous"), 'kv_loads = "cp_async"', "cp_async"),
])
def test_which_latent_tiles_come_by_tma(tmp_path, keys, tile, loads):
    art = build_kernel(tmp_path, "mla", body(**keys), tile=tile, targets=SM90A)
    assert (_config(art)["path"], _config(art).get("kv_loads", "cp_async")) == (PATH, loads)


@pytest.mark.parametrize("keys,targets", [
    (dict(heads=64), ("sm_80",)),                               # no wgmma tile
    (dict(heads=64, kv="e4m3_ds"), SM90A),
    (dict(heads=64, page=48), SM90A),
    (dict(heads=16), SM90A),                                    # 16 head rows: the mma.sync tile
])
def test_tma_where_it_cannot_apply_is_one_line(keys, targets):
    from ptxc.errors import SpecError
    from ptxc.kernels import load_text
    text = (f'[[kernel]]\nname = "m"\nfamily = "mla"\ntargets = {list(targets)!r}\n{body(**keys)}'
            f'[kernel.tile]\nkv_loads = "tma"\n').replace("'", '"')
    with pytest.raises(SpecError) as e:
        load_text(text, "m.toml")
    assert "kv_loads" in str(e.value) and "\n" not in str(e.value)


def test_given_stages_are_kept_over_the_score_split():
    """tile.num_stages = 4 with TMA: the split's exchange does not fit beside four stages, so
    the tile keeps four and all of S per warpgroup (the split never lowers given stages);
    given 3, it splits."""
    from ptxc.kernels import load_text
    from ptxc.kernels.families import mla, varlen
    from ptxc.targets import TARGETS
    for stages, split in ((4, False), (3, True)):
        [spec] = load_text(f'[[kernel]]\nname = "m"\nfamily = "mla"\ndtype = "bf16"\nnum_heads = 64\n'
                           f'softmax_scale = 0.1\ntargets = ["sm_90a"]\n[kernel.tile]\n'
                           f'num_stages = {stages}\n', "m.toml")
        cfg = varlen.configure(mla.attention_view(spec), TARGETS["sm_90a"])
        assert (cfg.num_stages, cfg.split_scores, cfg.tma) == (stages, split, True)


def test_two_stages_keep_mma_sync_and_block_n_16_is_honoured(tmp_path):
    """The latent wgmma loop holds tiles j-1 and j and one landing: num_stages = 2 keeps the
    mma.sync kernel; block_n = 16 runs on wgmma (n16 scores) and still matches."""
    art = build_kernel(tmp_path / "a", "mla", body(heads=64), tile="num_stages = 2", targets=SM90A)
    assert _config(art)["path"] == "mma.m16n8k16"
    art = build_kernel(tmp_path / "b", "mla", body(heads=64, splits=1), tile="block_n = 16",
                       targets=SM90A)
    assert (_config(art)["path"], _config(art)["block_n"], _config(art)["num_stages"]) == (PATH, 16, 4)
    assert_pass(check_artifact(art, backend="emu", shapes={"batch": 5, "max_pages_per_seq": 3,
                                                           "num_pages": 16}, seed=2))


@pytest.mark.parametrize("loads", ["tma", "cp_async"])
def test_latent_rows_are_read_once_per_head_tile(tmp_path, bytes_read, loads):
    """128 heads: two 64-row tiles (each of two warpgroups), so each latent row a sequence
    with queries owns crosses from global memory twice per split, never for V again. cp.async
    reads exactly the L rows; a TMA box is a whole 16-row page (the emulator counts the
    elements a box takes from the tensor), so the rows up to L's page end, and no page past it
    (its box has id -1: outside the map, nothing read)."""
    art = build_kernel(tmp_path, "mla", body(heads=128, splits=3, page=16), targets=SM90A,
                       tile="" if loads == "tma" else f'kv_loads = "{loads}"')
    lens = [1, 37, 64, 7, 50, 0, 63]
    spec, inputs, q_lens = _decode_batch(art, lens, [1, 1, 1, 0, 1, 1, 1], 128, np.random.default_rng(4))
    out = art.run(inputs, target="sm_90a")
    assert _config(art)["path"] == PATH
    rows = [L if loads == "cp_async" else -(-L // 16) * 16 for L, n in zip(lens, q_lens) if n]
    # the map is over the kv_cache argument's own array: the boxes' reads are counted apart
    threads, boxes = bytes_read["kv_cache"], bytes_read["kv_cache (TMA)"]
    assert (threads if loads == "cp_async" else boxes) == sum(rows) * spec.head_dim * 2 * 2
    assert (boxes if loads == "cp_async" else threads) == 0
    assert ref.max_abs_error(out["o"], MLA.reference(spec, inputs)["o"]) < 2e-2


def test_values_never_read_the_rope_columns(tmp_path):
    """Caches that differ only in the RoPE columns give identical bytes: the warpgroups' value
    slabs (0-3, 4-7) never reach slab 8 (test_mla.assert_values_skip_rope)."""
    assert_values_skip_rope(build_kernel(tmp_path, "mla", body(heads=64, page=16), targets=SM90A),
                            64, "sm_90a")


def test_ptxas_zero_spills_and_hgmma_loop(tmp_path, toolchain):
    """bf16 and f16, paged and contiguous, split, unsplit and seesaw (the default): 0 spills
    and no wgmma ptxas serialised; with split scores the loop issues half of S, 18
    HGMMA.64x32x16, and P·V as 2 HGMMA.64x256x16 per warpgroup (36 for S unsplit), no LDSM."""
    kernels = [f'[[kernel]]\nname = "m_{dt}_{lay}"\nfamily = "mla"\ntargets = ["sm_90a"]\n'
               f'{body(dtype=dt, heads=128, layout=lay, splits=s)}\n[kernel.tile]\nsplit_scores = true\n'
               for dt, lay, s in (("bf16", "paged", "auto"), ("f16", "contiguous", 1))]
    kernels.append(f'[[kernel]]\nname = "m_e4m3"\nfamily = "mla"\ntargets = ["sm_90a"]\n'
                   f'{body(heads=128, kv="e4m3")}\n')
    kernels.append(f'[[kernel]]\nname = "m_unsplit"\nfamily = "mla"\ntargets = ["sm_90a"]\n'
                   f'{body(heads=128)}\n[kernel.tile]\nsplit_scores = false\n')
    kernels += [f'[[kernel]]\nname = "m_seesaw_{dt}"\nfamily = "mla"\ntargets = ["sm_90a"]\n'
                f'{body(dtype=dt, heads=128, layout=lay)}\n'
                for dt, lay in (("bf16", "paged"), ("f16", "contiguous"))]
    build_without_spills(tmp_path, kernels, "sm_90a")
    _, prof = built_sass(tmp_path / "out", "m_bf16_paged", "sm_90a", "ptxc_m_bf16_paged_split")
    mix, loops = prof["mix"], prof["loops"]
    loop = loops["loops"][loops["main"]]
    assert mix["LDSM"] == mix["LDL"] == mix["STL"] == 0
    # per warp and iteration: 18 HGMMA.64x32x16 (4 each), 2 HGMMA.64x256x16 (32 each), and
    # 2 row-sum HMMA.16816; unsplit 36 for S
    assert (loop["classes"]["tensor"], loop["mma_equivalents"]) == (18 + 2 + 2, 18 * 4 + 2 * 32 + 2)
    _, prof = built_sass(tmp_path / "out", "m_unsplit", "sm_90a", "ptxc_m_unsplit_split")
    loop = prof["loops"]["loops"][prof["loops"]["main"]]
    assert (loop["classes"]["tensor"], loop["mma_equivalents"]) == (36 + 2 + 2, 36 * 4 + 2 * 32 + 2)
    # seesaw, per warp and iteration (its own tile and the other's): its tile's whole S, two
    # P·V (its P's and the received one's) and their row sums; the build's problems would
    # name a wgmma ptxas serialised
    _, prof = built_sass(tmp_path / "out", "m_seesaw_bf16", "sm_90a", "ptxc_m_seesaw_bf16_split")
    loop = prof["loops"]["loops"][prof["loops"]["main"]]
    assert prof["mix"]["LDL"] == prof["mix"]["STL"] == 0
    assert (loop["classes"]["tensor"], loop["mma_equivalents"]) == (36 + 4 + 4, 36 * 4 + 4 * 32 + 4)


# FlashMLA's seesaw schedule (tile.seesaw; mainloop/seesaw_pipeline.py): the warpgroups take
# alternate tiles' S and softmax and hand each other P and m; four stages, 10 KiB of hand-over
SEESAW = {
    # up to 1000 keys in 16-row pages over 3 splits: every stage buffer, mbarrier phase and
    # hand-over slot reused many times under the race checker; odd and even tile counts
    "h64-bf16-page16-3splits-L1000": (dict(heads=64, splits=3, page=16),
                                      {"batch": 9, "max_pages_per_seq": 63, "num_pages": 600}),
    # two head tiles, f16, a contiguous cache (rows past max_seq_len: the TMA's zeros); no tile
    # key: the seesaw is the default (latent_tile.seesaw_by_default)
    "h128-f16-contiguous-1-default": (dict(dtype="f16", heads=128, layout="contiguous", splits=1),
                                      {"batch": 9, "max_seq_len": 70}, 32, "default"),
    # FlashMLA's 64-row pages, 3 splits (splits with one tile: the other warpgroup owns none)
    "h64-bf16-page64-3splits": (dict(heads=64, splits=3),
                                {"batch": 9, "max_pages_per_seq": 5, "num_pages": 60}),
    # 16-row tiles: one A fragment a hand-over, S as m64n16
    "h64-bf16-page16-3splits-L480-bn16": (dict(heads=64, splits=3, page=16), L480, 16),
    "h128-bf16-page8-auto": pytest.param((dict(heads=128, page=8),
                                          {"batch": 9, "max_pages_per_seq": 16, "num_pages": 150}),
                                         marks=pytest.mark.slow),
}
SEESAW_TILE = "seesaw = true"


def _seesaw_exchange(bn: int) -> int:
    """Two slots: bn / 16 A-fragment blocks of 128 x 16 bytes (P), 128 x 8 bytes (m)."""
    return 2 * (bn // 16 * 128 * 16 + 128 * 8)


@pytest.mark.parametrize("case", SEESAW.values(), ids=SEESAW.keys())
def test_seesaw_matches_reference(tmp_path, case):
    """The mixed batches of test_mixed_batch_matches_reference (q_len 0/1/2/4, L 0/1/63/64/65
    and long, NaN in rows no sequence owns) under the seesaw: 0, 1, 2, 3 and many tiles per
    split, so either warpgroup may own the last tile (and zero its V tail) or none."""
    keys, shapes, *given = case
    bn = given[0] if given else 32
    tile = "" if given[1:] == ["default"] else "seesaw = true" + (f"\nblock_n = {bn}" if given else "")
    art = build_kernel(tmp_path, "mla", body(**keys), targets=SM90A, tile=tile)
    c = _config(art)
    assert (c["path"], c["block_m"], c["num_warps"], c["value_split"]) == (PATH, 64, 8, 2)
    assert (c["block_n"], c["num_stages"], c["seesaw"], c.get("split_scores", False)) == (bn, 4, True, False)
    assert c["smem_bytes"] == Q_BYTES + 4 * TILE * bn // 32 + 32 + _seesaw_exchange(bn)
    assert c["exchange_bytes"] == _seesaw_exchange(bn) and (bn != 32 or c["smem_bytes"] == 231456)
    assert_pass(check_artifact(art, backend="emu", shapes=shapes, seed=7))


def test_seesaw_never_reads_the_rope_columns_for_values_and_reads_rows_once(tmp_path, bytes_read):
    """Two caches that differ only in the RoPE columns give identical bytes (V is the first 512
    columns, whichever warpgroup's P weighs them); each latent row a tile sees crosses once
    (each warpgroup's boxes load its own tiles: every page once, none twice, none past L)."""
    art = build_kernel(tmp_path, "mla", body(heads=64, page=16), targets=SM90A, tile=SEESAW_TILE)
    lens = [5, 64, 33, 1, 0, 49]
    spec, inputs, q_lens = _decode_batch(art, lens, [1, 2, 4, 1, 1, 0], 64, np.random.default_rng(9))
    inputs["q"][..., 512:] = 0
    other = {**inputs, "kv_cache": inputs["kv_cache"].copy()}
    other["kv_cache"][..., 512:] = 30000.0
    a = art.run(inputs, target="sm_90a")
    # 64 heads: a tile a query token, whose causal keys end at L - q_len + 1 + i (whole pages)
    rows = [-(-(L - n + 1 + i) // 16) * 16 for L, n in zip(lens, q_lens) for i in range(n) if L]
    assert bytes_read["kv_cache (TMA)"] == sum(rows) * spec.head_dim * 2 and bytes_read["kv_cache"] == 0
    b = art.run(other, target="sm_90a")
    assert np.array_equal(a["o"], b["o"]) and np.array_equal(a["lse"], b["lse"])
    assert ref.max_abs_error(a["o"], MLA.reference(spec, inputs)["o"]) < 2e-2


@pytest.mark.parametrize("tile,targets,key", [
    ("seesaw = true\nsplit_scores = true", SM90A, "tile.split_scores"),
    ("seesaw = true\nnum_stages = 3", SM90A, "tile.num_stages"),
    ('seesaw = true\nkv_loads = "cp_async"', SM90A, "tile.seesaw"),
    ("seesaw = true", ("sm_80", "sm_90"), "tile.seesaw"),
])
def test_seesaw_where_it_cannot_run_is_one_line(tile, targets, key):
    from ptxc.errors import SpecError
    from ptxc.kernels import load_text
    text = (f'[[kernel]]\nname = "m"\nfamily = "mla"\ntargets = {list(targets)!r}\n{body(heads=64)}'
            f'[kernel.tile]\n{tile}\n').replace("'", '"')
    with pytest.raises(SpecError) as e:
        load_text(text, "m.toml")
    assert key in str(e.value) and "\n" not in str(e.value)
    for kv in ("e4m3", "e4m3_ds"):       # FP8 rows are staged and converted: not the seesaw's loop
        with pytest.raises(SpecError, match="tile.seesaw"):
            load_text(f'[[kernel]]\nname = "m"\nfamily = "mla"\ntargets = ["sm_90a"]\n'
                      f'{body(heads=64, kv=kv)}[kernel.tile]\nseesaw = true\n', "m.toml")
