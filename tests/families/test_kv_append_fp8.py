"""kv_append with FP8 caches (quantising append) and fused RoPE, in the emulator on the software
(sm_80) and hardware (sm_89) FP8 paths: FP8 bytes bit-exact against the OCP reference (every
byte outside the written rows untouched), RoPE against fp64 for both styles, partial rotary_dim,
positions crossing a page, a llama3-scaled cos_sin_cache; runtime scalars through `ptxc run`;
one-line spec errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import assert_pass, build_kernel
from ptxc.cli import main
from ptxc.errors import SpecError
from ptxc.kernels import FAMILIES
from ptxc.kernels.kv.kv_transform_ref import rope_cos_sin_cache, rotate
from ptxc.runtime.launch_test import check_artifact
from ptxc.reference import fp8_decode, fp8_quantize, max_abs_error
from ptxc.kernels import load_text
from ptxc.spec.model import KernelSpec

TARGETS = ("sm_80", "sm_89")
HEADS = 'num_heads = 6\nnum_kv_heads = 2\nhead_dim = 40\n'
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position": 32}


def shapes(layout: str) -> dict:
    return {"batch": 5, "num_new": 3, **({"max_seq_len": 17} if layout == "contiguous" else
                                         {"max_pages_per_seq": 3, "num_pages": 17})}


CASES = [  # (dtype, kv_dtype, kv_scale, layout, rope, rotary_dim)
    ("f16", "e4m3", "tensor", "contiguous", None, None),
    ("bf16", "e5m2", "head", "paged", None, None),
    ("f32", "e5m2", "tensor", "paged", None, None),
    ("f16", "e4m3", "head", "contiguous", "neox", 24),
    ("bf16", "e4m3", "tensor", "paged", "gptj", None),
    ("f16", None, None, "paged", "neox", None),
    ("f32", None, None, "contiguous", "gptj", 18),
    ("f16", "e5m2", "tensor", "contiguous", "neox", 32),     # neox by whole chunks (rd % 16 == 0)
    ("f32", None, None, "paged", "neox", 16),
]


def body(dtype, kv_dtype, kv_scale, layout, rope, rotary_dim, page_size=4) -> str:
    text = HEADS + f'dtype = "{dtype}"\nkv_layout = "{layout}"\n'
    text += f'page_size = {page_size}\n' if layout == "paged" else ""
    text += f'kv_dtype = "{kv_dtype}"\n' if kv_dtype else ""
    text += f'kv_scale = "{kv_scale}"\n' if kv_scale else ""
    text += f'rope = "{rope}"\n' if rope else ""
    text += f'rotary_dim = {rotary_dim}\n' if rotary_dim else ""
    return text


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c if x))
def test_launch_test_passes(tmp_path, case):
    art = build_kernel(tmp_path, "kv_append", body(*case), targets=TARGETS)
    dims = {**shapes(case[3]), **({"max_position": 13} if case[4] else {})}
    rows = check_artifact(art, backend="emu", shapes=dims, seed=5)
    assert_pass(rows)
    fp8_rows = [r for r in rows if r.tensor.endswith("cache") and case[1]]
    assert all(r.max_error == 0 for r in fp8_rows)          # FP8 bytes are bit-exact


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_full_product_long(tmp_path, dtype, layout):
    for kv_dtype, kv_scale, rope, rd in [(k, s, r, d) for k in ("e4m3", "e5m2") for s in ("tensor", "head")
                                         for r, d in ((None, None), ("neox", 32), ("gptj", 22))] + \
            [(None, None, "neox", 26), (None, None, "gptj", None)]:
        sub = tmp_path / f"{kv_dtype}_{kv_scale}_{rope}"
        art = build_kernel(sub, "kv_append", body(dtype, kv_dtype, kv_scale, layout, rope, rd), targets=TARGETS)
        dims = {**shapes(layout), **({"max_position": 15} if rope else {})}
        assert_pass(check_artifact(art, backend="emu", shapes=dims, seed=9))


def test_scalar_input_must_be_0d_float32(tmp_path):
    art = build_kernel(tmp_path, "kv_append", body("f16", "e5m2", "tensor", "contiguous", None, None))
    spec = KernelSpec.from_dict(art.meta["spec"])
    inputs = FAMILIES["kv_append"].make_inputs(spec, shapes("contiguous"), np.random.default_rng(4))
    from ptxc.errors import InputError
    for bad in (np.float64(0.5), np.array([0.5], np.float32)):
        with pytest.raises(InputError, match="k_scale must be a 0-d float32 array"):
            art.run({**inputs, "k_scale": bad})


def _run(spec_body, tmp_path, layout, rng_seed=1, dims=None, cos_sin=None):
    art = build_kernel(tmp_path, "kv_append", spec_body, targets=TARGETS)
    spec = KernelSpec.from_dict(art.meta["spec"])
    fam = FAMILIES["kv_append"]
    dims = dims or {**shapes(layout), "max_position": 40}
    inputs = fam.make_inputs(spec, dims, np.random.default_rng(rng_seed))
    if cos_sin is not None:
        inputs["cos_sin_cache"] = cos_sin
    return art, spec, inputs, {t: art.run(inputs, target=t) for t in TARGETS}


@pytest.mark.parametrize("style,rd", [("neox", 24), ("gptj", 24), ("neox", 32), ("gptj", 18)])
def test_rope_fp64_with_llama3_scaling_across_a_page(tmp_path, style, rd):
    """Positions 2..4 of page size 4 cross a page; rotary_dim rd of 40 (per element and by
    whole chunks); llama3 frequencies."""
    cs = rope_cos_sin_cache(40, rd, llama3=LLAMA3)
    art, spec, inputs, outs = _run(body("f32", None, None, "paged", style, rd), tmp_path, "paged", cos_sin=cs)
    inputs["positions"][:] = [2, 5, 0, 9, 37][:len(inputs["positions"])]
    outs = {t: art.run(inputs, target=t) for t in TARGETS}
    table, h = inputs["block_table"], rd // 2
    for t in TARGETS:
        for b in range(5):
            for n in range(3):
                r = int(inputs["positions"][b]) + n
                if r >= 12:      # past this cache's 3 pages * 4 rows: skipped, q copied
                    assert np.array_equal(outs[t]["q_rot"][b, n], inputs["q"][b, n])
                    continue
                cos, sin = cs[r, :h].astype(np.float64), cs[r, h:].astype(np.float64)
                want_q = rotate(inputs["q"][b, n].astype(np.float64), cos, sin, style, rd)
                want_k = rotate(inputs["k_new"][b, n].astype(np.float64), cos, sin, style, rd)
                assert max_abs_error(outs[t]["q_rot"][b, n], want_q) < 2e-6
                page = table[b, r // 4]
                if 0 <= page < inputs["k_cache"].shape[0]:
                    assert max_abs_error(outs[t]["k_cache"][page, r % 4], want_k) < 2e-6
                    assert np.array_equal(outs[t]["v_cache"][page, r % 4], inputs["v_new"][b, n])
                    assert np.array_equal(outs[t]["k_cache"][page, r % 4][:, rd:], inputs["k_new"][b, n][:, rd:])


@pytest.mark.parametrize("kind", ["e4m3", "e5m2"])
def test_fp8_rope_bytes_agree_with_fp64(tmp_path, kind):
    """The kernel's f32 rotation quantises to the code of the fp64 rotation, or to a neighbour
    when the two straddle a rounding boundary (rare)."""
    cs = rope_cos_sin_cache(40, 40)
    art, spec, inputs, outs = _run(body("f16", kind, "tensor", "contiguous", "neox", None), tmp_path,
                                   "contiguous", cos_sin=cs)
    h, scale = 20, np.float64(inputs["k_scale"])
    same = total = 0
    for t in TARGETS:
        for b in range(5):
            for n in range(3):
                r = int(inputs["positions"][b]) + n
                if not 0 <= r < 17:
                    continue
                x = rotate(inputs["k_new"][b, n].astype(np.float64), cs[r, :h].astype(np.float64),
                           cs[r, h:].astype(np.float64), "neox", 40)
                want = fp8_quantize(x / scale, kind)
                got = outs[t]["k_cache"][b, r]
                g, w = got.astype(int), want.astype(int)    # codes are monotonic in magnitude
                neighbours = np.abs((g & 0x7F) - (w & 0x7F)) <= 1
                same_sign = ((g ^ w) & 0x80 == 0) | ((g & 0x7F) + (w & 0x7F) <= 1)
                assert np.all(neighbours & same_sign)
                same += int((got == want).sum())
                total += got.size
    assert same >= 0.98 * total


def test_fp8_dequantised_cache_approximates_input(tmp_path):
    """Sanity on the scale convention: fp8 x k_scale reproduces k_new within e4m3 precision."""
    art, spec, inputs, outs = _run(body("f16", "e4m3", "head", "contiguous", None, None), tmp_path, "contiguous")
    for b in range(5):
        r = int(inputs["positions"][b])
        if 0 <= r < 17:
            got = fp8_decode(outs["sm_80"]["k_cache"][b, r], "e4m3") * inputs["k_scale"][:, None]
            x = inputs["k_new"][b, 0].astype(np.float64)
            assert np.all(np.abs(got - x) <= np.abs(x) / 16 + inputs["k_scale"][:, None] * 2 ** -9)


def test_metadata_and_ptxc_run_with_scalars(tmp_path):
    art = build_kernel(tmp_path, "kv_append", body("f16", "e4m3", "tensor", "contiguous", None, None))
    meta = art.meta
    assert sorted(meta["scalars"]) == ["k_scale", "v_scale"]
    assert meta["tensors"]["k_cache"]["dtype"] == "e4m3"
    params = {p["name"]: p for p in meta["targets"]["sm_80"]["kernels"][0]["params"]}
    assert params["k_scale"]["type"] == "f32" and params["k_scale"]["source"] == {"kind": "scalar", "name": "k_scale"}
    from ptxc.pipeline.metadata import schema_errors
    assert schema_errors(meta) == []
    spec = KernelSpec.from_dict(meta["spec"])
    inputs = FAMILIES["kv_append"].make_inputs(spec, shapes("contiguous"), np.random.default_rng(2))
    want = FAMILIES["kv_append"].reference(spec, inputs)
    np.savez(tmp_path / "in.npz", **inputs)
    run = ["run", str(art.path), "--inputs", str(tmp_path / "in.npz"), "--output", str(tmp_path / "o.npz"),
           "--backend", "emu", "--target", "sm_80"]
    r = CliRunner().invoke(main, run)
    assert r.exit_code == 0, r.output
    got = np.load(tmp_path / "o.npz")
    assert got["k_cache"].dtype == np.uint8 and np.array_equal(got["k_cache"], want["k_cache"])
    # --set overrides a scalar; a missing scalar is one line, exit 2
    without = {k: v for k, v in inputs.items() if k != "v_scale"}
    np.savez(tmp_path / "in2.npz", **without)
    run2 = run[:3] + [str(tmp_path / "in2.npz")] + run[4:]
    r = CliRunner().invoke(main, run2 + ["--set", f"v_scale={float(inputs['v_scale'])}"])
    assert r.exit_code == 0, r.output
    assert np.array_equal(np.load(tmp_path / "o.npz")["v_cache"], want["v_cache"])
    r = CliRunner().invoke(main, run2)
    assert r.exit_code == 2 and "missing scalar v_scale" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, run2 + ["--set", "v_scale=inf"])
    assert r.exit_code == 2 and "Traceback" not in r.output


def test_plain_append_unchanged_and_fused_decode_still_copies(tmp_path):
    art = build_kernel(tmp_path, "kv_append", HEADS + 'dtype = "f16"\n')
    names = [p["name"] for p in art.meta["targets"]["sm_80"]["kernels"][0]["params"]]
    assert "k_scale" not in names and art.meta["scalars"] == {}
    assert "div.rn" not in art.ptx("sm_80") and art.meta["targets"]["sm_80"]["ptx_version"] == "7.1"


def test_sm89_fp8_module_declares_ptx_8_1(tmp_path):
    art = build_kernel(tmp_path, "kv_append", body("f16", "e4m3", None, "contiguous", None, None), targets=TARGETS)
    assert art.meta["targets"]["sm_89"]["ptx_version"] == "8.1"
    assert ".version 8.1" in art.ptx("sm_89") and "cvt.rn.satfinite.e4m3x2.f32" in art.ptx("sm_89")
    assert "e4m3x2" not in art.ptx("sm_80")


BASE = '[[kernel]]\nname = "k"\nfamily = "kv_append"\ndtype = "f16"\nnum_heads = 8\nhead_dim = 64\n'
ERRORS = {
    "kv_scale without fp8": (BASE + 'kv_scale = "head"\n', ["key 'kv_scale'", "applies only to FP8"]),
    "kv_dtype mismatch": (BASE + 'kv_dtype = "bf16"\n', ["key 'kv_dtype'", "got 'bf16'", "FP8"]),
    "bad kv_dtype": (BASE + 'kv_dtype = "fp8"\n', ["key 'kv_dtype'", "'e4m3' | 'e5m2'"]),
    "rotary_dim without rope": (BASE + "rotary_dim = 32\n", ["key 'rotary_dim'", "needs rope"]),
    "rotary_dim too big": (BASE + 'rope = "neox"\nrotary_dim = 80\n', ["key 'rotary_dim'", "<= head_dim = 64"]),
    "odd rotary_dim": (BASE + 'rope = "gptj"\nrotary_dim = 31\n', ["key 'rotary_dim'", "multiple of 2"]),
    "bad rope": (BASE + 'rope = "yarn"\n', ["key 'rope'", "'neox' | 'gptj'"]),
    "bf16 on sm_75": (BASE.replace('"f16"', '"bf16"') + 'kv_dtype = "e4m3"\ntargets = ["sm_75"]\n',
                      ["key 'targets'", "bf16 needs sm_80"]),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_spec_errors_are_one_line(case):
    text, needles = ERRORS[case]
    with pytest.raises(SpecError) as e:
        load_text(text, "x.toml")
    msg = str(e.value)
    assert "\n" not in msg and "x.toml" in msg
    for n in needles:
        assert n in msg, msg


def test_every_target_assembles_without_spills(tmp_path):
    from ptxc.pipeline.build import run_build
    text = ('[[kernel]]\nname = "a_{kv_dtype}_{rope}"\nfamily = "kv_append"\ndtype = "f16"\n'
            'num_heads = 32\nnum_kv_heads = 8\nhead_dim = 128\nkv_layout = "paged"\n'
            'kv_dtype = ["e4m3", "e5m2"]\nrope = ["neox", "gptj"]\nrotary_dim = 64\n'
            'targets = ["sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_120"]\n')
    (tmp_path / "s.toml").write_text(text)
    summary = run_build([tmp_path / "s.toml"], tmp_path / "out", progress=False)
    assert summary["verified"] and not summary["problems"]
    for k in summary["kernels"]:
        assert all(t["spill_bytes"] == 0 for t in k["targets"].values()), k["name"]
