"""MLA with e4m3 score products (qk_products = "e4m3", sm_90a): each query row quantised in the
kernel to e4m3 after a power-of-two scale (math/q_rescale.quantize_q_rows), S = Q·Kᵀ on
m64nNk32 e4m3 wgmma over the latent rows' raw bytes, which the dequantising warpgroup copies
into each converted tile beside the 16-bit V (kv_fp8_stage.LatentFP8Staging's narrow store);
P·V unchanged. The real sm_90a PTX in the emulator (race checker and deadlock detection on)
against the fp64 reference with the same row quantisation (reference.quantize_rows_e4m3);
the quantisation rule itself; the rows read once per head tile; V never reads the RoPE
columns; the spec's refusals; ptxas 0 spills with QGMMA in the loop; the cost model's FP8
share."""

import numpy as np
import pytest

from conftest import assert_pass, build_kernel, built_sass
from families.test_mla import MLA, _decode_batch, body
from ptxc import reference as ref
from ptxc.errors import SpecError
from ptxc.kernels import load_text
from ptxc.runtime.launch_test import check_artifact

SM90A = ("sm_90a",)
NARROW = 'qk_products = "e4m3"\n'
L1000 = {"batch": 9, "max_pages_per_seq": 63, "num_pages": 600}
CASES = {   # (body keys, shapes, split scores)
    # up to 1000 keys in 16-row pages over 3 splits: every converted tile, staging buffer and
    # full / empty phase reused many times under the race checker; the score exchange too
    "h64-bf16-page16-3splits-L1000": (dict(heads=64, kv="e4m3", splits=3, page=16), L1000, True),
    # two head tiles, f16, a contiguous cache, the scale a device tensor
    "h128-f16-contiguous-device-1": (dict(dtype="f16", heads=128, kv="e4m3", scale="device",
                                          layout="contiguous", splits=1),
                                     {"batch": 9, "max_seq_len": 70}, True),
    # 128 RoPE columns (640-byte rows): the exchange no longer fits, each warpgroup takes all of S
    "h64-bf16-rope128-contiguous-auto": (dict(heads=64, kv="e4m3", rope=128, layout="contiguous"),
                                         {"batch": 9, "max_seq_len": 70}, False),
    "h128-bf16-paged-auto": pytest.param((dict(heads=128, kv="e4m3"),
                                          {"batch": 9, "max_pages_per_seq": 2, "num_pages": 21}, True),
                                         marks=pytest.mark.slow),
}


def _config(art) -> dict:
    return art.meta["targets"]["sm_90a"]["config"]


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_reference(tmp_path, case):
    """Rows past each sequence's L and pages no sequence owns hold NaN; q_len 0/1/2/4 mixed.
    Shared memory: the e4m3 Q tile (64 x head_dim bytes), three converted tiles of the rows'
    e4m3 bytes and V's 512 16-bit columns, one staging buffer, full / empty barriers, the
    exchange when split."""
    keys, shapes, split = case
    art = build_kernel(tmp_path, "mla", body(**keys) + NARROW, targets=SM90A)
    c, d = _config(art), 512 + keys.get("rope", 64)
    assert (c["qk_products"], c["dequant_warpgroup"], c["num_stages"]) == ("e4m3", True, 1)
    assert c.get("split_scores", False) == split
    tile = 32 * d + 32 * 512 * 2
    assert c["smem_bytes"] == 64 * d + 3 * tile + 32 * d + 48 + split * 2 * 64 * 32 * 4
    assert "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3" in art.ptx("sm_90a")
    assert_pass(check_artifact(art, backend="emu", shapes=shapes, seed=7))


def _e4m3_batch(art, lens, q_lens, heads, rng):
    """test_mla's batches over all-owned, shuffled pages of finite e4m3 codes."""
    return _decode_batch(art, lens, q_lens, heads, rng, fp8="e4m3")


def test_rows_read_once_per_head_tile_and_values_skip_the_rope_columns(tmp_path, bytes_read):
    """128 heads: two 64-row tiles, so each latent row with queries crosses from global memory
    twice per split as e4m3 bytes (S's and V's from one copy), none past L. With q's RoPE part
    zero, caches that differ only in the RoPE columns (448 there) give identical bytes: V's
    slabs never reach them, and S's products with them are exact zeros."""
    art = build_kernel(tmp_path, "mla", body(heads=128, kv="e4m3", splits=3, page=16) + NARROW,
                       targets=SM90A)
    lens = [1, 37, 64, 7, 50, 0, 63]
    spec, inputs, q_lens = _e4m3_batch(art, lens, [1, 1, 1, 0, 1, 2, 1], 128, np.random.default_rng(4))
    out = art.run(inputs, target="sm_90a")
    assert bytes_read["kv_cache"] == sum(L for L, n in zip(lens, q_lens) if n) * spec.head_dim * 2
    assert ref.max_abs_error(out["o"], MLA.reference(spec, inputs)["o"]) < 2e-2
    inputs["q"][..., 512:] = 0
    other = {**inputs, "kv_cache": inputs["kv_cache"].copy()}
    other["kv_cache"][..., 512:] = 0x7E                     # 448
    a, b = art.run(inputs, target="sm_90a"), art.run(other, target="sm_90a")
    assert np.array_equal(a["o"], b["o"]) and np.array_equal(a["lse"], b["lse"])


def test_row_quantisation_rule():
    """2^k puts the row's largest |q| in [128, 256): e4m3 keeps 3 mantissa bits at every scale,
    saturation (448) is never reached, and elements down to 2^-17 of the largest survive."""
    rows = np.array([[1.0, 0.3, -0.7, 0.0],          # k = 7: 128, 38.4 -> 40, -89.6 -> -88
                     [300.0, 1e-3, 2.0 ** -9, -5.0],  # k = -1 (largest 300 -> 150 -> 144)
                     [0.0, 0.0, 0.0, 0.0],            # a row of zeros stays zeros
                     [1.99, 1.0, 2.0 ** -12, 3e-6]], np.float32)
    got = ref.quantize_rows_e4m3(rows)
    assert got[0].tolist() == [1.0, 40 / 128, -88 / 128, 0.0]
    assert got[1, 0] == 288.0 and got[1, 3] == -5.0 and got[1, 1] == 0.0
    assert not got[2].any()
    assert got[3, 0] == 2.0 and got[3, 2] == 2.0 ** -12 and got[3, 3] == 0.0   # 3e-6 * 128: below 2^-10
    # the power of two is exact: scaling a row by 2^j scales its quantised values by 2^j
    assert np.array_equal(ref.quantize_rows_e4m3(rows * 8), got * 8)


def _spec(extra: str, tile: str = "", heads: int = 128):
    text = (f'[[kernel]]\nname = "m"\nfamily = "mla"\ndtype = "bf16"\nnum_heads = {heads}\n'
            'softmax_scale = 0.1353\n' + extra + (f"[kernel.tile]\n{tile}" if tile else ""))
    return load_text(text, "m.toml")


@pytest.mark.parametrize("extra,tile,words", [
    (NARROW + 'targets = ["sm_90a"]\n', "", 'kv_dtype = "bf16"'),
    (NARROW + 'kv_dtype = "e4m3_ds"\ntargets = ["sm_90a"]\n', "", 'allowed: kv_dtype = "e4m3"'),
    (NARROW + 'kv_dtype = "e4m3"\ntargets = ["sm_90", "sm_90a"]\n', "", "including sm_90"),
    (NARROW + 'kv_dtype = "e4m3"\n', "", "including sm_80"),
    (NARROW + 'kv_dtype = "e4m3"\ntargets = ["sm_90a"]\n', 16, "64 head rows"),
    (NARROW + 'kv_dtype = "e4m3"\nsparse_topk = 64\ntargets = ["sm_90a"]\n', "", "not sparse_topk"),
    (NARROW + 'kv_dtype = "e4m3"\ntargets = ["sm_90a"]\n', "dequant_warpgroup = false\n", "dequantising"),
    (NARROW + 'kv_dtype = "e4m3"\ntargets = ["sm_90a"]\n', 'kv_loads = "tma"\n', "cp_async"),
])
def test_where_it_cannot_run_is_one_line(extra, tile, words):
    """`tile`: tile keys, or (an int) the query heads."""
    with pytest.raises(SpecError) as e:
        _spec(extra, tile, 128) if isinstance(tile, str) else _spec(extra, "", tile)
    assert e.value.key == "qk_products" and words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_ptxas_zero_spills_qgmma_loop_and_fp8_cost(tmp_path, toolchain):
    """0 spills (rope 64 and 128, bf16 and f16); with split scores each warp's iteration issues
    half of S as 9 QGMMA.64x32x32 (at twice HGMMA's rate: 4 HMMA-equivalents each, as an
    HGMMA.64x32x16), P·V as 2 HGMMA.64x256x16 and 2 row-sum HMMA -- 102 HMMA-equivalents
    where the 16-bit products' loop has 138. The cost model counts S's FLOPs as FP8 (half the
    time at the 16-bit peak)."""
    from ptxc.pipeline.build import run_build
    from ptxc.report.costs import launch_cost, roofline
    from ptxc.report.gpus import get_gpu
    kernels = [f'[[kernel]]\nname = "{n}"\nfamily = "mla"\ntargets = ["sm_90a"]\n{b}'
               for n, b in (("q8", body(heads=128, kv="e4m3") + NARROW),
                            ("q8_f16_r128", body(dtype="f16", heads=64, kv="e4m3", rope=128,
                                                 layout="contiguous") + NARROW),
                            ("wide", body(heads=128, kv="e4m3")))]
    (tmp_path / "k.toml").write_text("\n".join(kernels))
    summary = run_build([tmp_path / "k.toml"], tmp_path / "out", progress=False)
    assert summary["verified"] and not summary["problems"]
    for k in summary["kernels"]:
        assert k["targets"]["sm_90a"]["spill_bytes"] == 0, k["name"]
    _, prof = built_sass(tmp_path / "out", "q8", "sm_90a", "ptxc_q8_split")
    loop = prof["loops"]["loops"][prof["loops"]["main"]]
    assert prof["mix"]["LDL"] == prof["mix"]["STL"] == 0
    assert (loop["classes"]["tensor"], loop["mma_equivalents"]) == (9 + 2 + 2, 9 * 4 + 2 * 32 + 2)
    import json
    dims = {"batch": 64, "total_q": 64, "max_pages_per_seq": 64, "num_pages": 4096}
    costs = {n: launch_cost(json.loads((tmp_path / "out" / n / f"{n}.json").read_text()), "sm_90a", dims)
             for n in ("q8", "wide")}
    assert costs["q8"].flops == costs["wide"].flops and costs["q8"].bytes == costs["wide"].bytes
    assert costs["q8"].fp8_flops == costs["q8"].flops * 576 // (576 + 512) and not costs["wide"].fp8_flops
    gpu = get_gpu("h100-sxm")
    narrow, wide = roofline(costs["q8"], gpu), roofline(costs["wide"], gpu)
    assert narrow["compute_seconds"] == pytest.approx(wide["compute_seconds"] * (288 + 512) / (576 + 512))


def test_one_key_lse_is_the_quantised_score_exactly(tmp_path):
    """A sequence of one key: lse = softmax_scale · k_scale · (q8 · k) -- the quantised Q's own
    dot product, f32-exact up to the accumulation order. Pins the kernel's rounding of Q to
    the reference's (a scale 2x too large would saturate a row's largest element at 448, one
    too small lose its smallest to subnormals); rows whose largest |q| sits just under a power
    of two (1.99 · 2^e) are where a wrong k saturates."""
    art = build_kernel(tmp_path, "mla", body(heads=64, kv="e4m3", splits=1, page=16) + NARROW,
                       targets=SM90A)
    rng = np.random.default_rng(11)
    spec, inputs, _ = _e4m3_batch(art, [1, 1, 1], [1, 2, 1], 64, rng)
    q = inputs["q"]
    q[..., 7] = ref.round_to(1.99 * np.exp2(rng.integers(-3, 4, q.shape[:2])), spec.dtype)
    q[..., 9] = ref.round_to(3e-4 * rng.standard_normal(q.shape[:2]), spec.dtype)   # near 2^-17 of it
    out = art.run(inputs, target="sm_90a")
    want = MLA.reference(spec, inputs)
    np.testing.assert_allclose(out["lse"], want["lse"], rtol=2e-6, atol=2e-6)
