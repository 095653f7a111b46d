"""The mla family: latent attention decode over a shared latent cache (DeepSeek-V3, Kimi-K2).

The real PTX runs in the emulator on mixed batches (q_len 0, 1, 2, 4 in one batch; L = 0, 1,
63, 64, 65, the capacity, random, and q_len > L; paged caches with shuffled pages and garbage
ids past each sequence; every cache row no sequence owns holds NaN) against the fp64 reference
under the FA2 tolerance rule: heads 16 / 32 / 128, paged and contiguous, bf16 and f16, splits
1 / 3 / auto, e4m3 caches with tensor and device scales. Plus: the latent rows are read once
per head tile (traffic counters), V never reads the RoPE columns, FP8 scales from 1e-3 to 1e3,
and the spec's one-line refusals. Sparse top-k (DeepSeek-V3.2): tokens over their own slots
with -1, duplicates, slots outside the cache and topk_length counts out of range.
"""

import numpy as np
import pytest

from conftest import assert_pass, build_kernel
from ptxc import reference as ref
from ptxc.errors import SpecError
from ptxc.kernels import FAMILIES
from ptxc.runtime.launch_test import check_artifact
from ptxc.kernels import load_text
from ptxc.spec.model import KernelSpec

MLA = FAMILIES["mla"]


def body(dtype="bf16", heads=16, layout="paged", splits="auto", kv=None, scale=None, rank=None,
         rope=None, page=None) -> str:
    splits = '"auto"' if splits == "auto" else splits
    text = (f'dtype = "{dtype}"\nnum_heads = {heads}\nsoftmax_scale = 0.1353\n'
            f'kv_layout = "{layout}"\nnum_splits = {splits}\n')
    for key, value in (("kv_dtype", kv), ("kv_scale", scale)):
        if value:
            text += f'{key} = "{value}"\n'
    for key, value in (("kv_lora_rank", rank), ("qk_rope_head_dim", rope), ("page_size", page)):
        if value:
            text += f"{key} = {value}\n"
    return text


PAGED = {"batch": 9, "max_pages_per_seq": 2, "num_pages": 21}        # L up to 128: 63 / 64 / 65
CASES = {
    "h16-bf16-paged-auto": (dict(), PAGED, ("sm_80",)),
    "h128-f16-contiguous-1": (dict(dtype="f16", heads=128, layout="contiguous", splits=1),
                              {"batch": 9, "max_seq_len": 70}, ("sm_80",)),
    "h16-bf16-page16-3splits-L1000": (dict(splits=3, page=16),
                                      {"batch": 9, "max_pages_per_seq": 63, "num_pages": 600}, ("sm_80",)),
    "h16-e4m3-paged": (dict(kv="e4m3"), PAGED, ("sm_80", "sm_89")),
    "h32-e4m3-device-contiguous-r256": (dict(heads=32, kv="e4m3", scale="device", layout="contiguous",
                                             splits=1, rank=256, rope=32),
                                        {"batch": 9, "max_seq_len": 67}, ("sm_89",)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_mixed_batch_matches_reference(tmp_path, case):
    keys, shapes, targets = CASES[case]
    art = build_kernel(tmp_path, "mla", body(**keys), targets=targets)
    assert_pass(check_artifact(art, backend="emu", shapes=shapes, seed=7))


@pytest.mark.slow
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("layout,shapes", [("paged", {"batch": 9, "max_pages_per_seq": 16, "num_pages": 150}),
                                           ("contiguous", {"batch": 9, "max_seq_len": 1000})])
@pytest.mark.parametrize("kv", [None, "e4m3"])
def test_deepseek_shapes_long_sequences(tmp_path, heads, layout, shapes, kv):
    art = build_kernel(tmp_path, "mla", body(heads=heads, layout=layout, kv=kv), targets=("sm_80",))
    assert_pass(check_artifact(art, backend="emu", shapes=shapes, seed=3))


def _decode_batch(art, lens, q_lens, heads, rng, fp8: str | None = None):
    """Sequences of the given lengths and query counts over a 16-row paged cache whose pages
    are all owned, shuffled, and hold finite values (`fp8`: that format's codes)."""
    spec = KernelSpec.from_dict(art.meta["spec"])
    B = len(lens)
    dims = {"batch": B, "max_pages_per_seq": 4, "num_pages": 4 * B + 1}
    inputs = MLA.make_inputs(spec, dims, rng)
    q_lens = np.array(q_lens, dtype=np.int32)
    inputs["seq_lens"] = np.array(lens, dtype=np.int32)
    inputs["cu_seqlens_q"] = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    inputs["q"] = ref.round_to(rng.standard_normal((int(q_lens.sum()), heads, spec.head_dim)),
                               spec.dtype).astype(np.float32)
    inputs["block_table"] = rng.permutation(4 * B + 1)[:4 * B].astype(np.int32).reshape(B, 4)
    values = rng.standard_normal(inputs["kv_cache"].shape)
    inputs["kv_cache"] = ref.fp8_quantize(values, fp8) if fp8 else \
        ref.round_to(values, spec.dtype).astype(np.float32)
    return spec, inputs, q_lens


@pytest.mark.parametrize("heads,rank,rope", [(16, 512, 64), (16, 512, 16), (32, 128, 16), (128, 512, 64)])
def test_latent_rows_are_read_once_per_head_tile(tmp_path, bytes_read, heads, rank, rope):
    """The emulator's global reads of kv_cache: every row of every sequence with a query, once
    per head tile (K and V from the same tile: a row is never fetched for V again), none for
    a sequence without queries, none past L (the tile's tail is zero-filled, not read). 128
    heads at rank 512: two 64-row tiles (16 warps each), so each row crosses twice, not 8x."""
    art = build_kernel(tmp_path, "mla", body(heads=heads, splits=3, page=16, rank=rank, rope=rope))
    lens = [1, 37, 64, 7, 50, 0, 63]
    spec, inputs, q_lens = _decode_batch(art, lens, [1, 1, 1, 0, 1, 1, 1], heads, np.random.default_rng(4))
    out = art.run(inputs, target="sm_80")
    config = art.meta["targets"]["sm_80"]["config"]
    row_bytes, bm = spec.head_dim * 2, config["block_m"]
    # rank 128: one warp per 16 rows, 64-row tiles; above 256 columns four warps share 16 rows,
    # and the CTA holds as many head rows as the heads fill, up to 64 (latent_block_m)
    assert bm == {16: 16, 32: 64, 128: 64}[heads]
    # 512 columns: the four warps sharing 16 rows each take a quarter of Q.K^T's depth (when
    # its k-steps divide by four: 576 = 36 x 16 does, 528 = 33 x 16 computes it in each warp)
    assert config.get("score_split", False) == (rank == 512 and rope == 64)
    assert bytes_read["kv_cache"] == sum(L for L, n in zip(lens, q_lens) if n) * row_bytes * -(-heads // bm)
    want = MLA.reference(spec, inputs)
    assert ref.max_abs_error(out["o"], want["o"]) < 2e-2


def assert_values_skip_rope(art, heads: int, target: str) -> None:
    """With q's RoPE part zero the scores do not depend on the cache's RoPE columns, so neither
    may the output: two caches that differ only there (ordinary values vs. 3e4) give identical
    bytes on `target`. (NaN cannot stand in for the garbage here: 0 x NaN is NaN in Q.K^T.)"""
    spec, inputs, _ = _decode_batch(art, [5, 64, 33], [1, 2, 4], heads, np.random.default_rng(9))
    rank = spec.opt("kv_lora_rank")
    inputs["q"][..., rank:] = 0
    other = {**inputs, "kv_cache": inputs["kv_cache"].copy()}
    other["kv_cache"][..., rank:] = 30000.0
    a, b = art.run(inputs, target=target), art.run(other, target=target)
    assert np.array_equal(a["o"], b["o"]) and np.array_equal(a["lse"], b["lse"])
    assert ref.max_abs_error(a["o"], MLA.reference(spec, inputs)["o"]) < 2e-2


def test_values_never_read_the_rope_columns(tmp_path):
    assert_values_skip_rope(build_kernel(tmp_path, "mla", body(rank=128, rope=32, page=16)), 16, "sm_80")


@pytest.mark.parametrize("k_scale", [1e-3, 1.0, 1e3])
def test_fp8_scales_across_six_decades(tmp_path, k_scale):
    """The same e4m3 bytes over k_scale 1e-3, 1 and 1e3: K and V both dequantise with it (V is
    K's columns), so o scales with it and the scores by it."""
    art = build_kernel(tmp_path, "mla", body(kv="e4m3", splits=1, page=16, rank=128, rope=16),
                       targets=("sm_89",))
    spec = KernelSpec.from_dict(art.meta["spec"])
    inputs = MLA.make_inputs(spec, {"batch": 9, "max_pages_per_seq": 5, "num_pages": 50},
                             np.random.default_rng(2))
    inputs["k_scale"] = np.float32(k_scale)
    out, want = art.run(inputs, target="sm_89"), MLA.reference(spec, inputs)
    assert np.all(np.isfinite(out["o"]))
    assert ref.max_abs_error(out["o"], want["o"]) <= 2e-2 * float(np.abs(want["o"]).max())
    seen = np.isfinite(want["lse"])
    assert np.array_equal(seen, np.isfinite(out["lse"]))
    assert np.allclose(out["lse"][seen], want["lse"][seen], rtol=1e-3, atol=1e-2)


def _spec(extra: str):
    return load_text('[[kernel]]\nname = "m"\nfamily = "mla"\ndtype = "bf16"\nnum_heads = 128\n' + extra,
                     "m.toml")


def test_deepseek_v3_spec_normalises():
    [spec] = _spec("softmax_scale = 0.1353\n")
    assert (spec.head_dim, spec.num_kv_heads, spec.opt("kv_lora_rank"), spec.opt("page_size")) == (576, 1, 512, 64)
    assert spec.opt("num_splits") == "auto" and spec.opt("return_lse") is True
    names = [t.name for t in MLA.interface(spec).tensors]
    assert names[:6] == ["q", "cu_seqlens_q", "seq_lens", "kv_cache", "block_table", "o"]
    shapes = {t.name: t.shape for t in MLA.interface(spec).tensors}
    assert shapes["kv_cache"] == ("num_pages", 64, 576) and shapes["o"] == ("total_q", 128, 512)


@pytest.mark.parametrize("extra,key,words", [
    ("", "softmax_scale", "never 1/sqrt(576)"),
    ("softmax_scale = 0.1\nhead_dim = 512\n", "head_dim", "kv_lora_rank + qk_rope_head_dim = 576"),
    ("softmax_scale = 0.1\nnum_kv_heads = 8\n", "num_kv_heads", "one latent KV head"),
    ('softmax_scale = 0.1\nkv_dtype = "e4m3_ds"\nkv_lora_rank = 256\n', "kv_lora_rank", "e4m3_ds"),
    ('softmax_scale = 0.1\nsparse_topk = 2048\nkv_layout = "contiguous"\n', "sparse_topk", "paged"),
    ("softmax_scale = 0.1\ntopk_length = true\n", "topk_length", "sparse_topk > 0"),
    ('softmax_scale = 0.1\nkv_layout = "contiguous"\npage_size = 64\n', "page_size", "paged"),
    ('softmax_scale = 0.1\nkv_scale = "device"\n', "kv_scale", "e4m3"),
    ("softmax_scale = 0.1\nkv_lora_rank = 520\n", "kv_lora_rank", "multiple of 64"),
    ('softmax_scale = 0.1\nkv_dtype = "f16"\n', "kv_dtype", "bf16"),
    ('softmax_scale = 0.1\ntargets = ["sm_75"]\n', "targets", "sm_75"),
])
def test_spec_refusals_name_the_key(extra, key, words):
    with pytest.raises(SpecError) as e:
        _spec(extra)
    assert e.value.key == key and words in str(e.value), str(e.value)


def test_head_dim_576_elsewhere_points_at_mla():
    with pytest.raises(SpecError) as e:
        load_text('[[kernel]]\nname = "d"\nfamily = "varlen"\ndtype = "bf16"\nhead_dim = 576\n'
                  'num_heads = 128\nnum_kv_heads = 1\n', "d.toml")
    assert e.value.key == "head_dim" and 'family = "mla"' in str(e.value)


def test_steps_under_the_same_maxima_record_identical_launches(tmp_path):
    """CUDA-graph class ALWAYS (varlen's kernel): two different decode/verify steps padded to
    the same max_batch and max_total_q (a padding sequence with seq_len 0 holds the spare query
    rows, absent sequences have q_len 0) record byte-identical launches, and the padding rows
    come out 0."""
    import json
    art = build_kernel(tmp_path, "mla", body(rank=128, rope=16, layout="contiguous"))
    assert art.meta["graph"]["targets"]["sm_80"]["class"] == "ALWAYS"
    spec = KernelSpec.from_dict(art.meta["spec"])
    max_batch, max_total_q, S = 5, 9, 40
    records = []
    for i, (q_lens, kv_lens) in enumerate((([1, 4, 1], [7, 33, 40]), ([2, 1], [0, 13]))):
        rng = np.random.default_rng(i)
        real = len(q_lens)
        q_lens = q_lens + [max_total_q - sum(q_lens)] + [0] * (max_batch - real - 1)
        kv_lens = kv_lens + [0] * (max_batch - real)
        cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        rnd = lambda *s: ref.round_to(rng.standard_normal(s), "bf16").astype(np.float32)
        inputs = {"q": rnd(max_total_q, 16, 144), "kv_cache": rnd(max_batch, S, 144),
                  "cu_seqlens_q": cu, "seq_lens": np.array(kv_lens, np.int32)}
        rec = []
        out = art.run(inputs, target="sm_80", record=rec)
        records.append(json.dumps(rec, sort_keys=True))
        assert ref.max_abs_error(out["o"], MLA.reference(spec, inputs)["o"]) < 2e-2
        assert np.all(out["o"][cu[real]:] == 0)
    assert records[0] == records[1]


SPARSE = [   # (heads, rank, rope, dtype, kv, scale, topk, topk_length, splits)
    (16, 512, 64, "bf16", None, None, 100, True, "auto"),
    (128, 512, 64, "f16", None, None, 40, False, 3),
    (64, 192, 32, "bf16", "e4m3", "device", 33, True, 1),
    (32, 128, 16, "f16", "e4m3", None, 70, False, "auto"),
]


def sparse_body(heads, rank, rope, dtype, kv, scale, topk, topk_length, splits):
    return body(dtype=dtype, heads=heads, splits=splits, kv=kv, scale=scale, rank=rank, rope=rope) + \
        f"sparse_topk = {topk}\ntopk_length = {str(topk_length).lower()}\n"


@pytest.mark.parametrize("case", SPARSE, ids=lambda c: "-".join(map(str, c)))
def test_sparse_topk_matches_reference(tmp_path, case):
    """Each token over its own slots: -1, duplicates (counted twice), slots past the cache and
    negative ones (skipped, never read: every row no counted slot names holds NaN, and the
    emulator faults on a read outside a buffer), topk_length 0 / 1 / N / past N / negative."""
    art = build_kernel(tmp_path, "mla", sparse_body(*case))
    assert_pass(check_artifact(art, backend="emu", shapes={"total_q": 7, "num_pages": 5}, seed=11))


@pytest.mark.parametrize("target", ["sm_90a", "sm_100a"])
def test_sparse_ranks_the_latent_tiles_leave_run_on_mma_sync(tmp_path, target):
    """Sparse top-k at a rank the sm_90a / sm_100a latent tiles do not take (192, 64 heads,
    16-row pages) runs the mma.sync tile: sparse slots are never TMA boxes
    (varlen_tile.tma_applies), which the generic sm_90a wgmma tile took them for -- an
    internal error at build (bench/fuzz_numerics.py found it)."""
    art = build_kernel(tmp_path, "mla", sparse_body(64, 192, 64, "bf16", None, None, 64, True, 2)
                       + "page_size = 16\n", targets=(target,))
    assert art.meta["targets"][target]["config"]["path"] == "mma.m16n8k16"
    assert_pass(check_artifact(art, backend="emu", shapes={"total_q": 7, "num_pages": 5}, seed=11))


@pytest.mark.parametrize("kv", [None, "e4m3"])
def test_sparse_sixteen_heads_of_wide_rows_share_the_warps(tmp_path, kv):
    """TP 8's 16 heads over 256 + 32 columns (576-byte Q rows: 36 chunks): a tile holds one
    token's heads, 16 rows, whose one warp cannot copy such a row a chunk a thread, so two
    warps share the rows, each with half of O's columns and of Q·Kᵀ's depth (varlen.configure)
    -- refused before with an error naming a num_warps nobody gave (bench/fuzz_numerics.py
    found it). Every target family of tile, poisoned slots as above."""
    targets = ("sm_80", "sm_89", "sm_90a", "sm_100a")
    art = build_kernel(tmp_path, "mla", sparse_body(16, 256, 32, "bf16", kv, None, 40, True, "auto"),
                       targets=targets)
    for t in targets:
        c = art.meta["targets"][t]["config"]
        assert (c["block_m"], c["num_warps"], c["value_split"], c["score_split"]) == (16, 2, 2, True), (t, c)
    assert_pass(check_artifact(art, backend="emu", shapes={"total_q": 7, "num_pages": 5}, seed=11))


def test_sparse_interface_and_tokens_without_slots(tmp_path):
    """No sequences: q, kv_cache, indices [total_q, N] (+ topk_length); a token whose slots are
    all -1 or outside the cache writes 0 and lse = -inf."""
    art = build_kernel(tmp_path, "mla", sparse_body(16, 128, 16, "bf16", None, None, 24, False, 1))
    assert sorted(art.meta["tensors"]) == ["indices", "kv_cache", "lse", "o", "q"]
    assert art.meta["tensors"]["indices"]["shape"] == ["total_q", 24]
    spec = KernelSpec.from_dict(art.meta["spec"])
    inputs = MLA.make_inputs(spec, {"total_q": 3, "num_pages": 4}, np.random.default_rng(2))
    inputs["indices"][1] = -1
    cap = inputs["kv_cache"].shape[0] * inputs["kv_cache"].shape[1]
    inputs["indices"][2] = np.arange(24) + cap           # just past the cache
    out = art.run(inputs, target="sm_80")
    assert (out["o"][1:] == 0).all() and np.isneginf(out["lse"][1:]).all()
    want = MLA.reference(spec, inputs)
    assert ref.max_abs_error(out["o"][0], want["o"][0]) < 2e-2


def test_sparse_num_heads_fill_whole_tiles():
    """A tile holds one token's heads: 24 heads do not fill 16-row tiles."""
    with pytest.raises(SpecError) as e:
        load_text('[[kernel]]\nname = "m"\nfamily = "mla"\ndtype = "bf16"\nnum_heads = 24\n'
                  'softmax_scale = 0.1\nsparse_topk = 64\n', "m.toml")
    assert e.value.key == "num_heads" and "multiple of 16" in str(e.value), str(e.value)


@pytest.mark.parametrize("heads,kv", [(16, None), (128, "e4m3_ds")])
def test_sparse_long_token_runs_the_slot_ring(tmp_path, heads, kv):
    """One split over 300 slots per token: 19 tiles, so past the pipeline's prologue every
    tile's copy reads its rows' slots from the shared-memory ring (kv_pages.SparseSlots) that
    the previous tile's copy parked (their byte offsets: st.shared.s64); -1, duplicates and
    out-of-cache slots throughout."""
    text = body(heads=heads, splits=1, kv=kv) + "sparse_topk = 300\ntopk_length = true\n"
    art = build_kernel(tmp_path, "mla", text, targets=("sm_90",))
    assert "st.shared.s64" in art.ptx("sm_90")
    assert_pass(check_artifact(art, backend="emu", shapes={"total_q": 5, "num_pages": 9}, seed=13))


def test_sparse_sixteen_warp_tile_loads_slots_directly(tmp_path):
    """tile.block_m = 64 (16 warps, 128 registers a thread) has no room for the slot ring: each
    copy loads its rows' slots itself, and the numerics are the same."""
    text = body(heads=128, splits=1) + "sparse_topk = 300\n"
    art = build_kernel(tmp_path, "mla", text, tile="block_m = 64", targets=("sm_90",))
    assert art.meta["targets"]["sm_90"]["config"]["num_warps"] == 16
    assert "st.shared.s32" not in art.ptx("sm_90")
    assert_pass(check_artifact(art, backend="emu", shapes={"total_q": 3, "num_pages": 9}, seed=13))


def test_sparse_block_m_divides_the_heads():
    """A sparse tile holds one token's heads: a named block_m that does not divide them is
    refused (it would leave tokens without a tile)."""
    with pytest.raises(SpecError) as e:
        load_text('[[kernel]]\nname = "m"\nfamily = "mla"\ndtype = "bf16"\nnum_heads = 16\n'
                  'softmax_scale = 0.1\nsparse_topk = 64\n[kernel.tile]\nblock_m = 64\n', "m.toml")
    assert e.value.key == "tile.block_m" and "divisor of num_heads" in str(e.value), str(e.value)
