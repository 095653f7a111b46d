"""decode over FP8 KV caches (kv_dtype e4m3/e5m2, kv_scale tensor/head) in the emulator on the
software (sm_80) and hardware (sm_89) dequantisation paths, on the SIMT path (GQA groups < 4,
f32, head dims not a multiple of 16) and on tensor cores (groups >= 4: the FP8 bytes staged by
cp.async and dequantised after their wait, as in varlen): every layout, split-KV and the fused
quantising append, on ragged lengths (0, 1, odd, full). The reference dequantises the same FP8
bytes in fp64, so the attention tolerance rule is unchanged. Also: PTX forms per target, halved
DRAM bytes in the cost model, at most one SASS conversion per 2 elements in the main loop, zero
spills on every target, one-line spec errors; and bf16 over FP8 on f16 products (Q rows far
outside f16's range, P's tail kept, the loop as f16's)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import assert_pass, assert_wide_queries_match, build_kernel, cache_shapes
from conftest import fp8_cache_body as body
from ptxc.errors import SpecError
from ptxc.kernels import FAMILIES
from ptxc.runtime.launch_test import check_artifact
from ptxc.kernels import load_text
from ptxc.spec.model import KernelSpec

TARGETS = ("sm_80", "sm_89")
ALL_TARGETS = ["sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_120"]


def shapes(layout: str) -> dict:
    return cache_shapes(layout, batch=5, num_pages=29)


CASES = [  # (dtype, kv_dtype, kv_scale, layout, extra)
    ("f16", "e4m3", "tensor", "contiguous", "return_lse = true\n"),
    ("bf16", "e5m2", "head", "paged", "num_splits = 3\n"),
    ("f32", "e4m3", "head", "pointer_array", ""),
    ("bf16", "e4m3", "tensor", "paged", "append_kv = true\nreturn_lse = true\n"),
    ("f16", "e5m2", "head", "contiguous", "append_kv = true\nnum_splits = 2\n"),
    ("f32", "e5m2", "device", "paged", "num_splits = 3\nappend_kv = true\n"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c[:4]))
def test_fp8_decode_matches_reference(tmp_path, case):
    dtype, kind, scale, layout, extra = case
    art = build_kernel(tmp_path, "decode", body(dtype, kind, scale, layout, extra=extra), targets=TARGETS)
    rows = check_artifact(art, backend="emu", shapes=shapes(layout), seed=7)
    assert_pass(rows)
    assert all(r.max_error == 0 for r in rows if r.tensor.endswith("cache"))   # appended bytes exact


MMA_CASES = [  # (dtype, kv_dtype, kv_scale, layout, (heads, kv heads), head_dim, extra): groups >= 4
    ("f16", "e4m3", "head", "paged", (8, 2), 64, "num_splits = 3\nreturn_lse = true\n"),
    ("bf16", "e5m2", "tensor", "contiguous", (16, 2), 48, ""),
    ("bf16", "e4m3", "head", "pointer_array", (8, 1), 32, "num_splits = 2\n"),
    ("f16", "e5m2", "tensor", "paged", (4, 1), 64, "append_kv = true\n"),
    ("bf16", "e4m3", "device", "paged", (8, 2), 128, 'num_splits = "auto"\nappend_kv = true\n'),
]


@pytest.mark.parametrize("case", MMA_CASES, ids=lambda c: "-".join(str(x) for x in c[:4]))
def test_fp8_decode_on_tensor_cores_matches_reference(tmp_path, case):
    dtype, kind, scale, layout, heads, d, extra = case
    art = build_kernel(tmp_path, "decode", body(dtype, kind, scale, layout, heads=heads, head_dim=d,
                                                extra=extra), targets=TARGETS)
    meta = art.meta
    assert {t["config"]["path"] for t in meta["targets"].values()} == {"mma.m16n8k16"}
    assert all(t["config"]["fp8_staging_bytes"] > 0 for t in meta["targets"].values())
    rows = check_artifact(art, backend="emu", shapes=shapes(layout), seed=5)
    assert_pass(rows)
    assert all(r.max_error == 0 for r in rows if r.tensor.endswith("cache"))


@pytest.mark.parametrize("extra", ["logits_soft_cap = 30.0\nreturn_lse = true\n",
                                   "alibi = true\nlogits_soft_cap = 5.0\nnum_splits = 3\n"],
                         ids=["cap", "alibi-cap-split"])
def test_fp8_decode_on_tensor_cores_under_score_transforms(tmp_path, extra):
    """Soft-cap and ALiBi over FP8 scores on the packed tile (every target's body): until
    math/mma.MmaMath.fold_k_scale they took the constant unit and left k_scale out (0.05 and
    1.2-6.3 off the fp64 reference; bench/fuzz_numerics.py found it)."""
    art = build_kernel(tmp_path, "decode", body("bf16", "e4m3", "head", "paged", heads=(8, 2), head_dim=64,
                                                extra=extra), targets=TARGETS + ("sm_90a", "sm_100a"))
    assert {t["config"]["path"] for n, t in art.meta["targets"].items() if n in TARGETS} == {"mma.m16n8k16"}
    assert_pass(check_artifact(art, backend="emu", shapes=shapes("paged"), seed=3))


@pytest.mark.parametrize("target", ["sm_80", "sm_89"])
def test_f16_products_keep_the_range_of_bf16_queries(tmp_path, target):
    """A bf16 kernel over an FP8 cache runs its products on f16 (kv_fp8_stage.f16_math_applies):
    each Q row is rescaled by a power of two into f16 before the loop. Rows far outside f16's
    range -- elements up to 2^38 (f16 overflows at 2^16) and 2^-30 (below its subnormals),
    zero -- side by side in one tile match the fp64 reference as rows of unit scale do, the
    lse too (conftest.WIDE_Q_FACTORS; k_scale 2^-20 keeps their scores where an f32 softmax
    resolves them: any f32 softmax, the bf16 path's included, loses a score past ~2^24 in log2
    units). Without the rescale this fails."""
    art = build_kernel(tmp_path, "decode", body("bf16", "e4m3", "tensor", "paged", heads=(8, 2),
                                                head_dim=64, extra="return_lse = true\n"),
                       targets=(target,))
    assert_wide_queries_match(art, "decode", target, shapes("paged"), seed=11)


@pytest.mark.parametrize("target", ["sm_80", "sm_89"])
def test_f16_products_keep_the_probability_tail(tmp_path, target):
    """Under f16 products P is f16, which alone flushes a probability below 2^-25 of the
    running max that bf16 keeps; the exponentials are lifted by softmax.P_HEADROOM (2^7) so
    they keep 2^-31. One key 26 log2 units above 63 others whose V is 448 (its own V 0): the
    output is the tail's alone, 63 · 2^-26 · 448 / (1 + ...) ~ 4.1e-4, which a flushed tail
    makes 0. Matches fp64 within 1 %."""
    from ptxc.spec.model import KernelSpec
    art = build_kernel(tmp_path, "decode", body("bf16", "e4m3", "tensor", "contiguous", heads=(8, 2),
                                                head_dim=64), targets=(target,))
    spec = KernelSpec.from_dict(art.meta["spec"])
    fam = FAMILIES["decode"]
    inputs = fam.make_inputs(spec, {"batch": 1, "max_seq_len": 64}, np.random.default_rng(1))
    inputs["seq_lens"] = np.array([64], np.int32)
    k, v = np.zeros((1, 64, 2, 64), np.uint8), np.zeros((1, 64, 2, 64), np.uint8)
    k[0, 0, :, 0] = 0x7E                     # key 0: 448 in dimension 0, the others 0
    v[0, 1:] = 0x7E                          # the tail's values: 448, key 0's: 0
    q = np.zeros((1, 8, 64), np.float32)
    q[..., 0] = 20.625                       # s0 · scale · log2 e = 20.625 · 7 · 0.18034 = 26.04
    inputs.update(k_cache=k, v_cache=v, q=q, k_scale=np.float32(1 / 64), v_scale=np.float32(1.0))
    want = fam.reference(spec, inputs)["o"]
    got = art.run(inputs, target=target, backend="emu")["o"].astype(np.float64)
    assert 4e-4 < want.min() and want.max() < 4.3e-4
    assert np.abs(got - want).max() < 0.01 * want.max(), (got.min(), got.max(), want.max())


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("layout", ["contiguous", "pointer_array", "paged"])
def test_fp8_decode_full_product_long(tmp_path, dtype, layout):
    for kind in ("e4m3", "e5m2"):
        for scale in ("tensor", "head"):
            for extra in ("return_lse = true\n", "num_splits = 2\n") + \
                    (("append_kv = true\n",) if layout != "pointer_array" else ()):
                for heads, d in (((4, 4), 64), ((8, 2), 128), ((3, 1), 24)):
                    sub = tmp_path / f"{kind}_{scale}_{len(extra)}_{d}"
                    art = build_kernel(sub, "decode", body(dtype, kind, scale, layout, heads=heads,
                                                           head_dim=d, extra=extra), targets=TARGETS)
                    assert_pass(check_artifact(art, backend="emu", shapes=shapes(layout), seed=11))


def test_reference_reads_the_fp8_bytes():
    """The caches the kernel gets are FP8 bytes of the values over their scales; the reference
    attends over exactly those bytes times the scales (not over the unquantised values)."""
    from ptxc.reference import fp8_decode
    spec = load_text('[[kernel]]\nname = "k"\nfamily = "decode"\n' + body("f16", "e4m3", "head", "contiguous"),
                     "x.toml")[0]
    fam = FAMILIES["decode"]
    inputs = fam.make_inputs(spec, {"batch": 3, "max_seq_len": 9}, np.random.default_rng(1))
    assert inputs["k_cache"].dtype == np.uint8 and inputs["k_scale"].shape == (2,)
    shifted = {**inputs, "k_scale": inputs["k_scale"] * 2}
    assert not np.allclose(fam.reference(spec, inputs)["o"], fam.reference(spec, shifted)["o"])
    assert np.isfinite(fp8_decode(inputs["v_cache"], "e4m3")).all()


def test_ptx_uses_hardware_cvt_only_where_it_exists(tmp_path):
    art = build_kernel(tmp_path, "decode", body("f16", "e4m3", "tensor", "paged"), targets=("sm_80", "sm_89"))
    ptx = {t: (art.path / art.meta["targets"][t]["ptx"]).read_text() for t in ("sm_80", "sm_89")}
    assert "cvt.rn.f16x2.e4m3x2" in ptx["sm_89"] and ".version 8.1" in ptx["sm_89"]
    assert "e4m3x2" not in ptx["sm_80"]
    for text in ptx.values():   # the cache is loaded as 8-byte vectors of FP8 bytes
        assert "ld.global.nc.v2.b32" in text
    meta = art.meta
    assert sorted(meta["scalars"]) == ["k_scale", "v_scale"]
    assert meta["tensors"]["k_cache"]["dtype"] == "e4m3"


def _cost(text: str):
    from ptxc.report.costs import decode_cost
    spec = load_text(text, "x.toml")[0]
    iface = FAMILIES["decode"].interface(spec)
    meta = {"spec": spec.to_dict(), "tensors": {t.name: t.to_dict() for t in iface.tensors}}
    cfg = FAMILIES["decode"].resolve_tile(spec, None)
    return decode_cost(meta, cfg, {"batch": 16, "max_pages_per_seq": 256, "num_pages": 4096})


def test_cost_model_counts_one_byte_per_fp8_element():
    base = ('[[kernel]]\nname = "k"\nfamily = "decode"\ndtype = "bf16"\nhead_dim = 128\nnum_heads = 32\n'
            'num_kv_heads = 8\nkv_layout = "paged"\n')
    wide, narrow = _cost(base), _cost(base + 'kv_dtype = "e4m3"\n')
    kv = 2 * 16 * 256 * 16 * 8 * 128    # K + V elements, batch 16, 4096 rows
    assert wide.bytes - narrow.bytes == kv   # 2 bytes -> 1 byte per element
    assert wide.flops == narrow.flops


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Every FP8 decode shape worth assembling, ptxas-verified for every target: GQA paged and
    pointer-array caches with split-KV, and the fused quantising append at head_dim 64 / 256."""
    from ptxc.pipeline.build import run_build
    tmp = tmp_path_factory.mktemp("fp8_decode")
    text = ('[[kernel]]\nname = "d_{kv_dtype}_{kv_layout}"\nfamily = "decode"\ndtype = "bf16"\n'
            'num_heads = 32\nnum_kv_heads = 8\nhead_dim = 128\nkv_layout = ["paged", "pointer_array"]\n'
            'kv_dtype = ["e4m3", "e5m2"]\nkv_scale = "head"\nnum_splits = "auto"\n'
            f'targets = {json.dumps(ALL_TARGETS[1:])}\n'
            '[[kernel]]\nname = "s_{kv_dtype}_paged"\nfamily = "decode"\ndtype = "bf16"\nmath = "simt"\n'
            'num_heads = 32\nnum_kv_heads = 8\nhead_dim = 128\nkv_layout = "paged"\n'
            'kv_dtype = ["e4m3", "e5m2"]\nkv_scale = "head"\nnum_splits = "auto"\n'
            f'targets = {json.dumps(ALL_TARGETS[1:])}\n'
            '[[kernel]]\nname = "d_append_{head_dim}"\nfamily = "decode"\ndtype = "f16"\nnum_heads = 8\n'
            'num_kv_heads = 1\nhead_dim = [64, 256]\nkv_layout = "paged"\nkv_dtype = "e4m3"\nappend_kv = true\n'
            f'targets = {json.dumps(ALL_TARGETS)}\n'
            '[[kernel]]\nname = "h_e4m3_paged"\nfamily = "decode"\ndtype = "f16"\nnum_heads = 32\n'
            'num_kv_heads = 8\nhead_dim = 128\nkv_layout = "paged"\nkv_dtype = "e4m3"\nkv_scale = "head"\n'
            'num_splits = "auto"\ntargets = ["sm_89", "sm_90"]\n'
            '[[kernel]]\nname = "d_f32"\nfamily = "decode"\ndtype = "f32"\nnum_heads = 4\n'
            'num_kv_heads = 4\nhead_dim = 64\nkv_dtype = "e5m2"\n'
            f'targets = {json.dumps(ALL_TARGETS)}\n')
    (tmp / "s.toml").write_text(text)
    return tmp / "out", run_build([tmp / "s.toml"], tmp / "out", progress=False)


def test_every_target_assembles_without_spills(built):
    out, summary = built
    assert summary["verified"] and not summary["problems"]
    assert len(summary["kernels"]) == 10
    for k in summary["kernels"]:
        assert all(t["spill_bytes"] == 0 for t in k["targets"].values()), k["name"]


@pytest.mark.parametrize("kind", ["e4m3", "e5m2"])
@pytest.mark.parametrize("path", ["simt", "mma"])
def test_sass_loop_converts_at_most_once_per_two_elements(built, kind, path):
    """SIMT: every conversion of the loop is a dequantisation. Tensor cores: the loop also packs
    the probabilities P into f16/bf16 pairs for P·V (F2FP, one per two of a warp's 16 x block_n
    scores per lane), which are not dequantisation and are counted out exactly."""
    from ptxc.report.analysis import build_report
    out, _ = built
    report = build_report([out / f"{'s' if path == 'simt' else 'd'}_{kind}_paged"])
    seen = set()
    for t in report["kernels"][0]["targets"]:
        launch = t["launches"][0]
        loop = launch["loop"]
        assert launch["config"]["path"] == ("simt" if path == "simt" else "mma.m16n8k16") \
            if "path" in launch.get("config", {}) else True
        elems_per_lane = loop["global_bytes_loaded"] // 32     # FP8: one byte per element
        assert elems_per_lane > 0
        p_packs = 16 * loop["kv_rows_per_iteration"] // 32 // 2 if path == "mma" else 0
        assert (loop["classes"]["cvt"] - p_packs) * 2 <= elems_per_lane, (t["target"], loop["classes"])
        seen.add(t["target"])
    assert {"sm_80", "sm_89", "sm_90"} <= seen


def test_bf16_over_fp8_loops_as_f16_does(built):
    """bf16 over an e4m3 cache takes f16 products (kv_fp8_stage.f16_math_applies): its staged
    tiles convert in one cvt a pair, as f16's do, where a bf16 tile took four (1739 instructions
    a warp per iteration on sm_90 before, 971 now). Its loop is the f16 kernel's, give or take
    the per-row softmax factors."""
    from ptxc.report.analysis import build_report
    out, _ = built
    loops = {}
    for name in ("d_e4m3_paged", "h_e4m3_paged"):
        for t in build_report([out / name])["kernels"][0]["targets"]:
            if t["target"] in ("sm_89", "sm_90"):
                assert t["config"].get("mma_inputs", "f16") == "f16"
                loops[name, t["target"]] = t["launches"][0]["loop"]
    for target in ("sm_89", "sm_90"):
        bf16, f16 = loops["d_e4m3_paged", target], loops["h_e4m3_paged", target]
        assert bf16["mma_equivalents"] == f16["mma_equivalents"]
        assert bf16["instructions"] <= f16["instructions"] * 1.02 + 8, (target, bf16["instructions"],
                                                                        f16["instructions"])
        assert bf16["instructions"] < 1100, (target, bf16["instructions"])


ERRORS = {
    "scale_without_fp8": ('dtype = "f16"\nkv_scale = "head"\n', ["kv_scale", "FP8"]),
    "other_float_cache": ('dtype = "bf16"\nkv_dtype = "f16"\n', ["kv_dtype", "'f16'", "e4m3"]),
    "unknown_kind": ('dtype = "f16"\nkv_dtype = "e3m4"\n', ["kv_dtype", "e3m4", "e5m2"]),
    "unknown_scale": ('dtype = "f16"\nkv_dtype = "e4m3"\nkv_scale = "channel"\n', ["kv_scale", "channel", "head"]),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_spec_errors_are_one_line(case):
    text, needles = ERRORS[case]
    with pytest.raises(SpecError) as e:
        load_text('[[kernel]]\nname = "k"\nfamily = "decode"\nhead_dim = 64\nnum_heads = 4\n'
                  'num_kv_heads = 2\n' + text, "x.toml")
    msg = str(e.value)
    assert "\n" not in msg and "x.toml" in msg
    for n in needles:
        assert n in msg, msg


def test_fp8_spec_round_trips():
    spec = load_text('[[kernel]]\nname = "k"\nfamily = "decode"\n' + body("f16", "e5m2", "head", "paged"),
                     "x.toml")[0]
    assert KernelSpec.from_dict(spec.to_dict()).to_dict() == spec.to_dict()


def test_metadata_and_ptxc_run_with_scalars(tmp_path):
    """k_scale / v_scale travel as 0-d float32 arrays in the inputs .npz (or --set); the
    metadata is schema-valid; the result matches the fp64 reference."""
    from click.testing import CliRunner

    from ptxc.cli import main
    from ptxc.pipeline.metadata import schema_errors
    from ptxc.reference import max_abs_error
    art = build_kernel(tmp_path, "decode", body("f16", "e4m3", "tensor", "paged"))
    assert schema_errors(art.meta) == []
    params = {p["name"]: p for p in art.meta["targets"]["sm_80"]["kernels"][0]["params"]}
    assert params["v_scale"]["source"] == {"kind": "scalar", "name": "v_scale"}
    spec = KernelSpec.from_dict(art.meta["spec"])
    inputs = FAMILIES["decode"].make_inputs(spec, shapes("paged"), np.random.default_rng(3))
    np.savez(tmp_path / "in.npz", **{k: v for k, v in inputs.items() if k != "v_scale"})
    run = ["run", str(art.path), "--inputs", str(tmp_path / "in.npz"), "--output", str(tmp_path / "o.npz"),
           "--backend", "emu", "--target", "sm_80"]
    r = CliRunner().invoke(main, run)
    assert r.exit_code == 2 and "v_scale" in r.output and len(r.output.strip().splitlines()) == 1, r.output
    r = CliRunner().invoke(main, run + ["--set", f"v_scale={float(inputs['v_scale'])}"])
    assert r.exit_code == 0, r.output
    want = FAMILIES["decode"].reference(spec, inputs)["o"]
    assert max_abs_error(np.load(tmp_path / "o.npz")["o"], want) < 2e-3
