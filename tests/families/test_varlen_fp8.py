"""varlen over FP8 KV caches (kv_dtype e4m3/e5m2, kv_scale tensor/head) in the emulator on the
software (sm_80) and hardware (sm_89) dequantisation paths, over mixed serving batches (decode,
prefill, chunks, empty, q_len > L, L = 0, full cache) with odd lengths, paged and contiguous,
split-KV, GQA packing. The reference dequantises the same FP8 bytes in fp64. Also: zero spills
on every target, at most one SASS conversion per 2 cache elements in the main loop, halved K/V
bytes in the cost model; bf16 over FP8 on f16 products with Q rows far outside f16's range on
every body that takes them (varlen and MLA, mma.sync and wgmma)."""

from __future__ import annotations

import json

import pytest

from conftest import assert_pass, assert_wide_queries_match, build_kernel, cache_shapes
from conftest import fp8_cache_body as body
from ptxc.kernels import FAMILIES
from ptxc.runtime.launch_test import check_artifact
from ptxc.kernels import load_text

TARGETS = ("sm_80", "sm_89")
ALL_TARGETS = ["sm_80", "sm_86", "sm_89", "sm_90", "sm_120"]


def shapes(layout: str) -> dict:
    return cache_shapes(layout, batch=9, num_pages=47)


CASES = [  # (dtype, kv_dtype, kv_scale, layout, head_dim, extra)
    # head_dim 40: rows of 2.5 16-byte FP8 chunks, the synchronous dequantising copy
    ("f16", "e4m3", "tensor", "paged", 40, "return_lse = true\n"),
    ("bf16", "e5m2", "head", "contiguous", 40, "num_splits = 3\ncausal = false\n"),
    # multiples of 16: FP8 bytes by cp.async, dequantised after the wait (kv_fp8_stage.py);
    # 48 = 3 chunks per row, so 2 of 128 threads copy nothing and the last pass is partial
    ("bf16", "e4m3", "head", "paged", 48, "num_splits = 2\nreturn_lse = true\n"),
    ("f16", "e5m2", "tensor", "contiguous", 48, ""),
    ("f16", "e4m3", "head", "contiguous", 64, "num_splits = 2\ncausal = false\n"),
    ("bf16", "e5m2", "tensor", "paged", 32, "return_lse = true\n"),
    ("f16", "e4m3", "tensor", "paged", 80, "head_dim_v = 32\n"),   # V rows narrower than K's
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c[:5]))
def test_fp8_varlen_matches_reference(tmp_path, case):
    dtype, kind, scale, layout, d, extra = case
    art = build_kernel(tmp_path, "varlen", body(dtype, kind, scale, layout, head_dim=d, extra=extra),
                       targets=TARGETS)
    assert_pass(check_artifact(art, backend="emu", shapes=shapes(layout), seed=13))


# The score transforms over FP8 scores: k_scale reaches the scores only in the softmax factor,
# so soft-cap and ALiBi take their unit at run time (math/mma.MmaMath.fold_k_scale) --
# on every body FP8 varlen runs: mma.sync staged (sm_80 software, sm_89 hardware conversions;
# sm_100a's FP8 varlen is this tile too) and wgmma (sm_90a)
TRANSFORM_CASES = {
    "cap-window": ("bf16", "e4m3", "tensor", "paged", 64,
                   "logits_soft_cap = 30.0\nsliding_window = 33\nreturn_lse = true\n"),
    "alibi-cap-split": ("f16", "e5m2", "head", "contiguous", 128,
                        "alibi = true\nlogits_soft_cap = 5.0\nattention_sinks = true\nnum_splits = 3\n"),
}


@pytest.mark.parametrize("case", TRANSFORM_CASES.values(), ids=TRANSFORM_CASES.keys())
def test_fp8_varlen_under_score_transforms(tmp_path, case):
    dtype, kind, scale, layout, d, extra = case
    text = body(dtype, kind, scale, layout, heads=(8, 2), head_dim=d, extra=extra).replace(
        "page_size = 8", "page_size = 16")
    art = build_kernel(tmp_path, "varlen", text, targets=TARGETS + ("sm_90a", "sm_100a"))
    assert_pass(check_artifact(art, backend="emu", shapes=cache_shapes(layout, batch=7, num_pages=40),
                               seed=11))


def test_fp8_transforms_fail_at_the_constant_unit(tmp_path, monkeypatch):
    """The planted mistake: the transforms at 1 / softmax_scale (k_scale left out) fail."""
    from ptxc.kernels.math import mma
    def fold_only_the_factor(self, k_scale):
        self.scale_log2 = self.b.mul(k_scale, self.scale_log2)
    monkeypatch.setattr(mma.MmaMath, "fold_k_scale", fold_only_the_factor)
    dtype, kind, scale, layout, d, extra = TRANSFORM_CASES["cap-window"]
    art = build_kernel(tmp_path, "varlen", body(dtype, kind, scale, layout, heads=(8, 2), head_dim=d,
                                                extra=extra), targets=("sm_80",))
    rows = check_artifact(art, backend="emu", shapes=cache_shapes(layout, batch=7, num_pages=40), seed=11)
    assert not all(r.ok for r in rows)


WIDE = {   # (family, spec keys, tile keys, target, dims): every body with f16 products
    "varlen-mma": ("varlen", body("bf16", "e4m3", "tensor", "paged", heads=(8, 2), head_dim=64,
                                  extra="return_lse = true\n"), "", "sm_89",
                   cache_shapes("paged", batch=9, num_pages=47)),
    "varlen-wgmma": ("varlen", body("bf16", "e5m2", "head", "paged", heads=(8, 2), head_dim=128,
                                    extra="num_splits = 2\n").replace("page_size = 8", "page_size = 16"),
                     "", "sm_90a", cache_shapes("paged", batch=5, num_pages=30)),
    # MLA on mma.sync: four warps share 16 rows (value split, split scores)
    "mla-mma": ("mla", 'dtype = "bf16"\nnum_heads = 16\nsoftmax_scale = 0.1353\nkv_layout = "paged"\n'
                       'kv_dtype = "e4m3"\nreturn_lse = true\n', "", "sm_89",
                {"batch": 5, "max_pages_per_seq": 2, "num_pages": 12}),
    # MLA on wgmma: two warpgroups share 64 rows of 128-byte slabs, staged by cp.async / TMA
    "mla-wgmma": ("mla", 'dtype = "bf16"\nnum_heads = 64\nsoftmax_scale = 0.1353\nkv_layout = "paged"\n'
                         'kv_dtype = "e4m3"\nkv_scale = "device"\n', "", "sm_90a",
                  {"batch": 5, "max_pages_per_seq": 2, "num_pages": 12}),
    "mla-wgmma-tma": ("mla", 'dtype = "bf16"\nnum_heads = 64\nsoftmax_scale = 0.1353\nkv_layout = "paged"\n'
                             'kv_dtype = "e4m3"\n', 'kv_loads = "tma"', "sm_90a",
                      {"batch": 5, "max_pages_per_seq": 2, "num_pages": 12}),
    # sparse top-k slots (a tile holds one token's heads) on both bodies
    **{f"mla-sparse-{target}": ("mla", 'dtype = "bf16"\nnum_heads = 64\nsoftmax_scale = 0.1353\n'
                                       'kv_layout = "paged"\nkv_dtype = "e4m3"\nnum_splits = 3\n'
                                       'sparse_topk = 100\ntopk_length = true\n', "", target,
                                {"total_q": 7, "num_pages": 5}) for target in ("sm_90", "sm_90a")},
}


@pytest.mark.parametrize("case", WIDE.values(), ids=WIDE.keys())
def test_f16_products_keep_the_range_of_bf16_queries(tmp_path, case):
    """bf16 over FP8 on f16 products, on every body that takes them (mma.sync's padded tiles,
    wgmma's slabs; rows owned by one warp, or shared by warps that convert a share each):
    Q rows from 2^-30 to 2^38 and zero, side by side in a tile, match the fp64 reference
    (conftest.assert_wide_queries_match; test_decode_fp8 has decode's)."""
    family, text, tile, target, dims = case
    art = build_kernel(tmp_path, family, text, tile=tile, targets=(target,))
    assert_wide_queries_match(art, family, target, dims, seed=17)


@pytest.mark.parametrize("kind", ["e4m3", "e5m2"])
def test_fp8_varlen_staged_pages_loaded_ahead(tmp_path, kind):
    """head_dim 128 over 16-row pages: the staged FP8 copy takes kv_pages' page ids loaded one
    tile ahead (16 rows per copy pass, one page each), causal, GQA 4, 4 K/V stages on sm_80."""
    text = body("f16", kind, "head", "paged", heads=(8, 2), head_dim=128).replace(
        "page_size = 8", "page_size = 16")
    art = build_kernel(tmp_path, "varlen", text, targets=TARGETS)
    assert art.meta["targets"]["sm_80"]["config"]["num_stages"] == 4
    assert_pass(check_artifact(art, backend="emu", shapes=cache_shapes("paged", batch=7, num_pages=40),
                               seed=5))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_fp8_varlen_full_product_long(tmp_path, dtype, layout):
    for kind in ("e4m3", "e5m2"):
        for scale in ("tensor", "head"):
            for extra in ("return_lse = true\n", "num_splits = 2\ncausal = false\n"):
                for heads, d in (((4, 4), 64), ((8, 2), 128), ((3, 1), 24)):
                    sub = tmp_path / f"{kind}_{scale}_{len(extra)}_{d}"
                    art = build_kernel(sub, "varlen", body(dtype, kind, scale, layout, heads=heads,
                                                           head_dim=d, extra=extra), targets=TARGETS)
                    assert_pass(check_artifact(art, backend="emu", shapes=shapes(layout), seed=17))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from ptxc.pipeline.build import run_build
    tmp = tmp_path_factory.mktemp("fp8_varlen")
    text = "".join(
        f'[[kernel]]\nname = "v_{kind}_{dtype}_{d}"\nfamily = "varlen"\ndtype = "{dtype}"\nnum_heads = 32\n'
        f'num_kv_heads = 8\nhead_dim = {d}\nkv_dtype = "{kind}"\nkv_scale = "head"\nnum_splits = "auto"\n'
        f'return_lse = true\ntargets = {json.dumps(ALL_TARGETS)}\n'
        for kind, dtype, d in (("e4m3", "f16", 128), ("e5m2", "bf16", 128), ("e4m3", "bf16", 256)))
    (tmp / "s.toml").write_text(text)
    return tmp / "out", run_build([tmp / "s.toml"], tmp / "out", progress=False)


def test_every_target_assembles_without_spills(built):
    _, summary = built
    assert summary["verified"] and not summary["problems"]
    assert len(summary["kernels"]) == 3
    for k in summary["kernels"]:
        assert all(t["spill_bytes"] == 0 for t in k["targets"].values()), k["name"]


@pytest.mark.parametrize("name", ["v_e4m3_f16_128", "v_e5m2_bf16_128", "v_e4m3_bf16_256"])
def test_sass_loop_converts_at_most_once_per_two_elements(built, name):
    """The FP8 bytes reach the main loop by cp.async (kv_fp8_stage.py: 16-byte LDGSTS, no
    register loads of cache bytes); its conversions beyond the non-FP8 loop's own (the f32 ->
    f16x2/bf16x2 packing of the probabilities) are at most half the cache elements it copies."""
    from ptxc.report.analysis import build_report
    out, _ = built
    for t in build_report([out / name])["kernels"][0]["targets"]:
        loop = t["launches"][0]["loop"]
        cfg = t["config"]
        prob_packs = cfg["block_n"] // 8 * 2             # MmaMath.softmax: 2 rows per n8 tile
        elems = loop["ldgsts_bytes"].get("16", 0) * 16   # 16-byte copies of FP8 bytes per lane
        assert elems > 0 and not set(loop["ldg_bytes"]) - {"4"}, (t["target"], loop)   # 4: page ids
        assert (loop["classes"]["cvt"] - prob_packs) * 2 <= elems, (t["target"], loop["classes"])


def test_fp8_bytes_stay_in_flight(built):
    """Issue 13: the staged FP8 pipeline (kv_fp8_stage.py) keeps at least 32 KiB of K/V in
    flight per SM on sm_80 (2.4 KiB with the synchronous dequantising copy it replaced), and
    its stages follow the shared memory (4 on sm_80, 3 on sm_90 at head_dim 128)."""
    from ptxc.report.analysis import build_report
    out, _ = built
    targets = {t["target"]: t for t in build_report([out / "v_e4m3_f16_128"])["kernels"][0]["targets"]}
    stages = {"sm_80": 4, "sm_90": 3}
    for target, floor in (("sm_80", 32 * 1024), ("sm_90", 64 * 1024)):
        t = targets[target]
        assert t["config"]["num_stages"] == stages[target] and t["config"]["fp8_staging_bytes"] == 64 * 128
        loop = t["launches"][0]["loop"]
        assert loop["classes"]["ldgsts"] > 0, loop
        assert loop["inflight_bytes_per_sm"] >= floor, (target, loop["inflight_bytes_per_sm"])


def test_cost_model_counts_one_byte_per_fp8_element():
    from ptxc.report.costs import varlen_cost
    base = ('[[kernel]]\nname = "k"\nfamily = "varlen"\ndtype = "bf16"\nhead_dim = 128\nnum_heads = 32\n'
            'num_kv_heads = 8\n')

    def cost(text):
        spec = load_text(text, "x.toml")[0]
        meta = {"spec": spec.to_dict(), "tensors": {t.name: t.to_dict() for t in FAMILIES["varlen"].interface(spec).tensors}}
        return varlen_cost(meta, {}, {"batch": 16, "total_q": 64, "max_pages_per_seq": 256, "num_pages": 4096})
    wide, narrow = cost(base), cost(base + 'kv_dtype = "e4m3"\n')
    assert wide.bytes - narrow.bytes == 2 * 16 * 4096 * 8 * 128
    assert wide.flops == narrow.flops


def test_interface_lists_fp8_cache_and_scales():
    spec = load_text('[[kernel]]\nname = "k"\nfamily = "varlen"\n' + body("f16", "e4m3", "head", "paged"), "x.toml")[0]
    iface = FAMILIES["varlen"].interface(spec)
    t = {x.name: x for x in iface.tensors}
    assert t["k_cache"].dtype == "e4m3" and t["k_scale"].shape == (2,) and not iface.scalars
    spec = load_text('[[kernel]]\nname = "k"\nfamily = "varlen"\n' + body("f16", "e5m2", "tensor", "paged"), "x.toml")[0]
    assert sorted(FAMILIES["varlen"].interface(spec).scalars) == ["k_scale", "v_scale"]


def test_staged_fp8_copy_and_conversion_are_bank_conflict_free(tmp_path):
    """Traffic counters of the staged d128 kernel: cp.async into the staging buffers (thread
    order), their read-back and the converted f16 stores (kv_fp8_stage.staging_slot: two rows
    per quarter-warp) take no more shared-memory wavefronts than their bytes need."""
    import numpy as np

    from conftest import shared_traffic
    from ptxc.spec.model import KernelSpec
    art = build_kernel(tmp_path, "varlen", body("f16", "e4m3", "tensor", "contiguous", heads=(8, 2),
                                                head_dim=128), targets=("sm_80",))
    spec = KernelSpec.from_dict(art.meta["spec"])
    inputs = FAMILIES["varlen"].make_inputs(spec, {"batch": 3, "max_seq_len": 150}, np.random.default_rng(3))
    t = shared_traffic(art, "sm_80", inputs)
    assert sum(a.requests for a in t.shared_accesses if a.kind == "cp.async") > 0
    assert t.bank_conflicts == 0, [a for a in t.shared_accesses if a.bank_conflicts]


@pytest.mark.parametrize("tile", ["num_stages = 1\nblock_n = 32", "num_stages = 3\nblock_n = 16"])
def test_fp8_varlen_staged_given_tiles(tmp_path, tile):
    """Given stage counts and tiles on the staged path (one stage: no refill overlaps a read)."""
    art = build_kernel(tmp_path, "varlen", body("bf16", "e4m3", "tensor", "paged", head_dim=64,
                                                extra="num_splits = 2\n"), tile=tile, targets=TARGETS)
    cfg = art.meta["targets"]["sm_80"]["config"]
    assert cfg["fp8_staging_bytes"] == cfg["block_n"] * 64 and f"num_stages = {cfg['num_stages']}" in tile
    assert_pass(check_artifact(art, backend="emu", shapes=shapes("paged"), seed=21))
