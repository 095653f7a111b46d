"""MLA over FlashMLA's / vLLM's fp8_ds_mla latent rows (kv_dtype = "e4m3_ds"): 656 bytes per
token - 512 e4m3 in four 128-column groups, four f32 group scales, 64 bf16 RoPE values.

The mla family reads them (heads 16 and 128, mixed q_len 0/1/2/4 batches over L 0, 1, 63, 64,
65 and the capacity, splits 1/3/auto, sparse top-k with -1, duplicates and slots outside the
cache; every unowned row NaN bytes, NaN scales and NaN RoPE) against fp64 over the rows the
kernel dequantises (e4m3 x scale in f32, rounded to bf16 once); group scales over six decades;
values never read the RoPE bytes; each 656-byte row crosses from global memory once per head
tile. mla_append writes them bit-exactly as vLLM's concat_and_cache_ds_mla (amax 0, +-inf, NaN,
the FLT_MIN floor), and the rows it writes are the rows mla attends over.
"""

import numpy as np
import pytest

from conftest import assert_pass, build_kernel
from ptxc import reference as ref
from ptxc.errors import SpecError
from ptxc.kernels import FAMILIES
from ptxc.kernels.kv import kv_fp8
from ptxc.kernels.families.mla_inputs import ds_decode, ds_encode, ds_fields, ds_pack
from ptxc.runtime.launch_test import check_artifact
from ptxc.kernels import load_text
from ptxc.spec.model import KernelSpec

MLA, APPEND = FAMILIES["mla"], FAMILIES["mla_append"]
ROWS = kv_fp8.GroupScaledRows(512, 64)


def body(heads=16, splits="auto", page=None, extra="") -> str:
    splits = '"auto"' if splits == "auto" else splits
    text = (f'dtype = "bf16"\nnum_heads = {heads}\nsoftmax_scale = 0.1353\nkv_dtype = "e4m3_ds"\n'
            f"num_splits = {splits}\n")
    return text + (f"page_size = {page}\n" if page else "") + extra


def test_row_layout_byte_by_byte():
    """FlashMLA's layout: codes at [0, 512), f32 scales little-endian at [512, 528), bf16 RoPE
    at [528, 656); decoding multiplies each code by its group's scale."""
    assert (ROWS.row_bytes, ROWS.scales_at, ROWS.rope_at, ROWS.groups) == (656, 512, 528, 4)
    codes = np.full(512, 0x38, np.uint8)                     # e4m3 1.0
    row = ds_pack(ROWS, codes, np.array([2.0, 0.5, 1e3, 1e-3], np.float32), np.full(64, 1.5))
    assert row.shape == (656,) and row[512:516].tobytes() == np.float32(2.0).tobytes()
    assert row[528:530].tolist() == [0xC0, 0x3F]                 # bf16 1.5
    k = ds_decode(ROWS, row)
    assert k.shape == (576,) and k[0] == 2.0 and k[128] == 0.5 and k[511] == ref.round_to(1e-3, "bf16")
    assert np.all(k[512:] == 1.5)


def test_interface_is_the_byte_rows():
    [spec] = load_text('[[kernel]]\nname = "m"\nfamily = "mla"\n' + body(heads=128), "m.toml")
    tensors = {t.name: t for t in MLA.interface(spec).tensors}
    assert tensors["kv_cache"].dtype == "u8" and tensors["kv_cache"].shape == ("num_pages", 64, 656)
    assert "k_scale" not in tensors and not MLA.interface(spec).scalars
    assert tensors["o"].shape == ("total_q", 128, 512)


PAGED = {"batch": 9, "max_pages_per_seq": 2, "num_pages": 21}        # L up to 128: 63 / 64 / 65
CASES = {
    "h16-auto": (body(), PAGED, ("sm_80", "sm_89")),
    "h128-page16-3splits": (body(heads=128, splits=3, page=16), {"batch": 9, "max_pages_per_seq": 5,
                                                                 "num_pages": 50}, ("sm_90",)),
    "h16-sparse-top100": (body(extra="sparse_topk = 100\ntopk_length = true\n"),
                          {"total_q": 7, "num_pages": 5}, ("sm_90",)),
    "h128-sparse-1split": (body(heads=128, splits=1, extra="sparse_topk = 40\n"),
                           {"total_q": 3, "num_pages": 3}, ("sm_89",)),
    # RoPE widths whose chunks do not divide the threads (6 and 14 a row: per-item rows, a
    # guarded last pass of the copy kv_fp8_group.py makes of them)
    "h16-rope48": (body(extra="qk_rope_head_dim = 48\n"), PAGED, ("sm_89",)),
    "h128-rope112-page16": (body(heads=128, splits=3, page=16, extra="qk_rope_head_dim = 112\n"),
                            {"batch": 5, "max_pages_per_seq": 5, "num_pages": 30}, ("sm_90",)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_batches_match_reference(tmp_path, case):
    text, shapes, targets = CASES[case]
    art = build_kernel(tmp_path, "mla", text, targets=targets)
    assert_pass(check_artifact(art, backend="emu", shapes=shapes, seed=7))


def _owned_batch(art, lens, q_lens, rng, heads=16):
    """Sequences over a 16-row paged cache whose rows all hold group-scaled bf16 values."""
    spec = KernelSpec.from_dict(art.meta["spec"])
    B = len(lens)
    dims = {"batch": B, "max_pages_per_seq": 4, "num_pages": 4 * B + 1}
    inputs = MLA.make_inputs(spec, dims, rng)
    q_lens = np.array(q_lens, np.int32)
    inputs["seq_lens"] = np.array(lens, np.int32)
    inputs["cu_seqlens_q"] = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    inputs["q"] = ref.round_to(rng.standard_normal((int(q_lens.sum()), heads, 576)), "bf16").astype(np.float32)
    inputs["block_table"] = rng.permutation(4 * B + 1)[:4 * B].astype(np.int32).reshape(B, 4)
    vals = ref.round_to(rng.standard_normal((4 * B + 1, 16, 576)), "bf16")
    inputs["kv_cache"] = ds_encode(ROWS, vals[..., :512], vals[..., 512:])
    return spec, inputs, q_lens


@pytest.mark.parametrize("heads,rows", [(16, 16), (128, 64)])
def test_rows_are_read_once_per_head_tile(tmp_path, bytes_read, heads, rows):
    """Whole 656-byte rows (scales and RoPE with them) cross from global memory once per head
    tile, none for a sequence without queries, none past L; 128 heads take 64-row tiles (16
    warps) on sm_80, so a row crosses twice."""
    art = build_kernel(tmp_path, "mla", body(heads=heads, splits=3, page=16))
    assert art.meta["targets"]["sm_80"]["config"]["block_m"] == rows
    lens = [1, 37, 64, 7, 50, 0, 63]
    spec, inputs, q_lens = _owned_batch(art, lens, [1, 1, 1, 0, 1, 1, 1], np.random.default_rng(4), heads)
    out = art.run(inputs, target="sm_80")
    assert bytes_read["kv_cache"] == sum(L for L, n in zip(lens, q_lens) if n) * 656 * (heads // rows)
    assert ref.max_abs_error(out["o"], MLA.reference(spec, inputs)["o"]) < 2e-2


def test_values_never_read_the_rope_bytes(tmp_path):
    """With q's RoPE part zero, two caches that differ only in their RoPE bytes (ordinary
    values vs. bf16 3e4) give identical o and lse bytes."""
    art = build_kernel(tmp_path, "mla", body(page=16))
    spec, inputs, _ = _owned_batch(art, [5, 64, 33], [1, 2, 4], np.random.default_rng(9))
    inputs["q"][..., 512:] = 0
    other = {**inputs, "kv_cache": inputs["kv_cache"].copy()}
    other["kv_cache"][..., 528:] = np.tile(np.array([0xEA, 0x46], np.uint8), 64)    # bf16 30000
    a, b = art.run(inputs, target="sm_80"), art.run(other, target="sm_80")
    assert np.array_equal(a["o"], b["o"]) and np.array_equal(a["lse"], b["lse"])


def test_group_scales_across_six_decades(tmp_path):
    """The same codes over group scales multiplied by 1e-3 .. 1e3 (each row and group its own
    decade): every group dequantises with its own scale, so o and lse follow the reference."""
    art = build_kernel(tmp_path, "mla", body(splits=1, page=16), targets=("sm_89",))
    spec, inputs, _ = _owned_batch(art, [3, 17, 64, 40], [1, 2, 1, 4], np.random.default_rng(2))
    codes, scales, rope = ds_fields(ROWS, inputs["kv_cache"])
    decade = (np.arange(scales.size).reshape(scales.shape) * 5) % 7 - 3
    scales = (scales * 10.0 ** decade).astype(np.float32)
    assert scales.max() / scales.min() > 1e5
    inputs["kv_cache"] = ds_pack(ROWS, codes, scales, ref.bf16_bits_to_f32(rope))
    out, want = art.run(inputs, target="sm_89"), MLA.reference(spec, inputs)
    assert np.all(np.isfinite(out["o"]))
    assert ref.max_abs_error(out["o"], want["o"]) <= 2e-2 * float(np.abs(want["o"]).max())
    assert np.allclose(out["lse"], want["lse"], rtol=1e-3, atol=1e-2)


# ---- mla_append (its bit-exact cases over every format are in test_mla_append.py) ------------
def test_append_edge_groups_by_hand(tmp_path):
    """The special groups, spelled out: amax 0 -> scale FLT_MIN and zero codes; +inf -> scale
    inf, the inf's code NaN and finite codes 0; tiny values -> the FLT_MIN floor."""
    art = build_kernel(tmp_path, "mla_append", 'dtype = "bf16"\nkv_dtype = "e4m3_ds"\npage_size = 4\n')
    kv_c = np.zeros((2, 512), np.float32)
    kv_c[1, :128] = 1.0
    kv_c[1, 5] = np.inf
    kv_c[1, 128:256] = ref.round_to(np.linspace(-3, 3, 128), "bf16")
    kv_c[1, 256:264] = ref.round_to(1e-39, "bf16")
    inputs = {"kv_c": kv_c, "k_pe": np.ones((2, 64), np.float32), "slot_mapping": np.array([1, 6], np.int64),
              "kv_cache": np.zeros((2, 4, 656), np.uint8)}
    cache = art.run(inputs, target="sm_80")["kv_cache"]
    codes, scales, _ = ds_fields(ROWS, cache)
    flt_min = np.finfo(np.float32).tiny
    assert scales[0, 1].tolist() == [flt_min] * 4 and not codes[0, 1].any()
    assert np.isinf(scales[1, 2, 0]) and codes[1, 2, 5] == 0x7F and not codes[1, 2, :5].any()
    assert scales[1, 2, 1] == np.float32(3.0) / np.float32(448.0) and codes[1, 2, 255] == 0x7E   # +448
    assert scales[1, 2, 2] == flt_min and scales[1, 2, 3] == flt_min
    assert np.array_equal(cache, APPEND.reference(KernelSpec.from_dict(art.meta["spec"]), inputs)["kv_cache"])


def test_appended_rows_are_what_mla_attends(tmp_path):
    """An engine step on fp8_ds_mla: mla_append writes three tokens' rows (one per sequence)
    into a cache the earlier steps wrote the same way, mla decodes over it; o matches fp64
    attention over the rows as the append quantised them, and those rows are the kv_c / k_pe
    values within e4m3's precision."""
    app = build_kernel(tmp_path / "a", "mla_append", 'dtype = "bf16"\nkv_dtype = "e4m3_ds"\npage_size = 16\n')
    att = build_kernel(tmp_path / "m", "mla", body(page=16, splits=1))
    rng = np.random.default_rng(3)
    lens, pages = [5, 17, 33], 12
    table = rng.permutation(pages)[:9].astype(np.int32).reshape(3, 3)
    rows = {b: ref.round_to(rng.standard_normal((L, 576)), "bf16").astype(np.float32) for b, L in enumerate(lens)}
    cache = np.zeros((pages, 16, 656), np.uint8)
    for b, L in enumerate(lens):
        for r in range(L - 1):
            cache[table[b, r // 16], r % 16] = ds_encode(ROWS, rows[b][r, :512], rows[b][r, 512:])
    slots = np.array([table[b, (L - 1) // 16] * 16 + (L - 1) % 16 for b, L in enumerate(lens)], np.int64)
    last = np.stack([rows[b][L - 1] for b, L in enumerate(lens)])
    cache = app.run({"kv_c": last[:, :512], "k_pe": last[:, 512:], "slot_mapping": slots,
                     "kv_cache": cache}, target="sm_80")["kv_cache"]
    q = ref.round_to(rng.standard_normal((3, 16, 576)), "bf16").astype(np.float32)
    inputs = {"q": q, "cu_seqlens_q": np.array([0, 1, 2, 3], np.int32),
              "seq_lens": np.array(lens, np.int32), "kv_cache": cache, "block_table": table}
    out = att.run(inputs, target="sm_80")
    spec = KernelSpec.from_dict(att.meta["spec"])
    assert ref.max_abs_error(out["o"], MLA.reference(spec, inputs)["o"]) < 2e-2
    for b, L in enumerate(lens):
        k = ds_decode(ROWS, np.stack([cache[table[b, r // 16], r % 16] for r in range(L)]))
        assert np.allclose(k, rows[b], rtol=2 ** -3, atol=1e-5 * np.abs(rows[b]).max())


@pytest.mark.parametrize("family,extra,key,words", [
    ("mla", "kv_lora_rank = 256\n", "kv_lora_rank", "allowed: 512"),
    ("mla", 'dtype = "f16"\n', "dtype", "bf16"),
    ("mla", 'kv_layout = "contiguous"\n', "kv_layout", "paged"),
    ("mla", 'kv_scale = "device"\n', "kv_scale", "e4m3"),
    ("mla_append", "kv_lora_rank = 384\n", "kv_lora_rank", "allowed: 512"),
    ("mla_append", 'dtype = "f16"\n', "dtype", "bf16"),
])
def test_spec_refusals_name_the_key(family, extra, key, words):
    text = f'[[kernel]]\nname = "m"\nfamily = "{family}"\nkv_dtype = "e4m3_ds"\nsoftmax_scale = 0.1\n'
    if "dtype = " not in extra.replace("kv_dtype", ""):
        text += 'dtype = "bf16"\n'
    if family == "mla":
        text += "num_heads = 16\n"
    with pytest.raises(SpecError) as e:
        load_text(text + extra, "m.toml")
    assert e.value.key == key and words in str(e.value), str(e.value)
