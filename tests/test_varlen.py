"""The varlen family: ragged query batches over paged / contiguous KV caches.

Numeric tests run the real PTX in the emulator on mixed batches (make_inputs cycles through
decode, whole prefill, prefill chunk, q_len 0, 4-token verification, q_len > L, L = 0 and L at
the cache capacity; paged block tables are shuffled and hold garbage ids past each sequence's
pages) and hold it to the FA2 tolerance rule against the fp64 reference. A few representative
cases run by default; the full dtype x causal x GQA x layout x splits matrix is marked slow.
"""

import numpy as np
import pytest

from conftest import assert_pass, build_kernel
from ptxc.errors import InputError, SpecError
from ptxc.kernels import FAMILIES
from ptxc.runtime import reference as ref
from ptxc.runtime.launch_test import check_artifact
from ptxc.spec.model import KernelSpec

LAYOUTS = {"contiguous": 'kv_layout = "contiguous"', "page1": "page_size = 1",
           "page16": "page_size = 16", "page32": "page_size = 32"}
GQA = {"mha": (4, 4), "gqa4": (8, 2), "gqa8": (16, 2), "mqa": (6, 1)}


def body(dtype="f16", head_dim=64, gqa="gqa4", causal=True, layout="page16", splits=1, lse=True):
    heads, kv = GQA[gqa]
    split = f'"{splits}"' if splits == "auto" else splits
    return (f'dtype = "{dtype}"\nhead_dim = {head_dim}\nnum_heads = {heads}\nnum_kv_heads = {kv}\n'
            f"causal = {str(causal).lower()}\nnum_splits = {split}\nreturn_lse = {str(lse).lower()}\n"
            f"{LAYOUTS[layout]}")


DEFAULT_CASES = [
    dict(dtype="f16", head_dim=64, gqa="gqa4", causal=True, layout="page16", splits=1),
    dict(dtype="bf16", head_dim=72, gqa="mha", causal=False, layout="contiguous", splits=1),
    dict(dtype="f16", head_dim=40, gqa="mqa", causal=True, layout="page1", splits=3),
    dict(dtype="bf16", head_dim=128, gqa="gqa8", causal=True, layout="page32", splits="auto"),
    dict(dtype="f16", head_dim=24, gqa="gqa4", causal=False, layout="page16", splits=3, lse=False),
]


@pytest.mark.parametrize("case", DEFAULT_CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_mixed_batch_matches_reference(tmp_path, case):
    art = build_kernel(tmp_path, "varlen", body(**case))
    assert_pass(check_artifact(art, backend="emu", shapes={}, seed=11))


SWEEP = [dict(dtype=dt, head_dim=hd, gqa=g, causal=c, layout=lay, splits=s)
         for dt in ("f16", "bf16") for c in (True, False) for g in GQA for lay in LAYOUTS
         for s, hd in ((1, 64), (3, 40), ("auto", 96))]


@pytest.mark.slow
@pytest.mark.parametrize("case", SWEEP, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_full_matrix(tmp_path, case):
    art = build_kernel(tmp_path, "varlen", body(**case))
    assert_pass(check_artifact(art, backend="emu", shapes={"batch": 11}, seed=5))


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [8, 128, 256])
def test_head_dims(tmp_path, head_dim):
    art = build_kernel(tmp_path, "varlen", body(dtype="bf16", head_dim=head_dim, splits=2))
    assert_pass(check_artifact(art, backend="emu", shapes={"batch": 8}, seed=6))


def _spec(art) -> KernelSpec:
    return KernelSpec.from_dict(art.meta["spec"])


def test_lengths_beyond_capacity_are_clamped_and_rows_without_keys_are_zero(tmp_path):
    art = build_kernel(tmp_path, "varlen", body(layout="contiguous", head_dim=32))
    spec = _spec(art)
    rng = np.random.default_rng(3)
    S = 19
    inputs = FAMILIES["varlen"].make_inputs(spec, {"batch": 3, "max_seq_len": S}, rng)
    inputs["cu_seqlens_q"] = np.array([0, 5, 7, 10], dtype=np.int32)
    inputs["q"] = ref.round_to(rng.standard_normal((10, 8, 32)), "f16").astype(np.float32)
    inputs["seq_lens"] = np.array([1000, -4, 2], dtype=np.int32)   # clamp to 19, 0; q_len 3 > 2
    out = art.run(inputs, target="sm_80")
    want = FAMILIES["varlen"].reference(spec, inputs)
    assert ref.max_abs_error(out["o"], want["o"]) < 2e-3
    assert np.all(out["o"][5:7] == 0) and np.all(np.isneginf(out["lse"][5:7]))
    assert np.all(out["o"][7] == 0) and np.all(np.isneginf(out["lse"][7]))   # position -1
    assert np.all(np.isfinite(out["lse"][8:10]))


def test_batch_without_queries(tmp_path):
    art = build_kernel(tmp_path, "varlen", body(splits=3))
    spec = _spec(art)
    dims = {"batch": 2, "max_pages_per_seq": 2, "num_pages": 5}
    inputs = FAMILIES["varlen"].make_inputs(spec, dims, np.random.default_rng(1))
    inputs["cu_seqlens_q"] = np.zeros(3, dtype=np.int32)
    inputs["q"] = inputs["q"][:0]
    out = art.run(inputs, target="sm_80")
    assert out["o"].shape == (0, 8, 64) and out["lse"].shape == (0, 8)


def test_dims_are_inferred_from_cu_seqlens(tmp_path):
    art = build_kernel(tmp_path, "varlen", body())
    spec = _spec(art)
    inputs = FAMILIES["varlen"].make_inputs(spec, {"batch": 8, "max_pages_per_seq": 10,
                                                   "num_pages": 83}, np.random.default_rng(2))
    dims = art.infer_dims(inputs)
    cu = inputs["cu_seqlens_q"]
    assert dims["batch"] == 8 and dims["total_q"] == cu[-1]
    assert dims["max_seqlen_q"] == int(np.diff(cu).max())
    bad = dict(inputs, cu_seqlens_q=cu[::-1].copy())
    with pytest.raises(InputError, match="prefix sums"):
        art.infer_dims(bad)
    with pytest.raises(InputError, match="batch \\+ 1"):
        art.infer_dims(dict(inputs, cu_seqlens_q=cu[:-1].copy()))


def test_launch_geometry_packs_gqa_and_bounds_the_grid(tmp_path):
    """One CTA row per KV head (not per query head): a K/V tile is read once for the whole GQA
    group. The grid is (cdiv(max_seqlen_q * group, block_m), kv_heads * splits, batch)."""
    art = build_kernel(tmp_path, "varlen", 'dtype = "bf16"\nhead_dim = 128\nnum_heads = 28\n'
                       'num_kv_heads = 4\nnum_splits = "auto"')
    kernels = art.target("sm_80")[1]["kernels"]
    assert kernels[0]["grid"] == ["cdiv(max_seqlen_q * 7, 64)", "4 * num_splits", "batch"]
    assert kernels[1]["grid"] == ["28", "total_q", "1"]   # split_reduce over (head, token)
    assert art.meta["dim_rules"]["num_splits"]["auto"]["ctas"] == "4 * batch * cdiv(max_seqlen_q * 7, 64)"


@pytest.mark.parametrize("text,key", [
    ('dtype = "f32"\nhead_dim = 64\nnum_heads = 4', "dtype"),
    ('dtype = "f16"\nhead_dim = 64\nnum_heads = 4\nkv_layout = "contiguous"\npage_size = 16', "page_size"),
    ('dtype = "f16"\nhead_dim = 60\nnum_heads = 4', "head_dim"),
    ('dtype = "f16"\nhead_dim = 64\nnum_heads = 4\nkv_layout = "pointer_array"', "kv_layout"),
])
def test_spec_errors(tmp_path, text, key):
    with pytest.raises(SpecError) as e:
        build_kernel(tmp_path, "varlen", text)
    assert e.value.key == key


def test_turing_is_refused(tmp_path):
    with pytest.raises(SpecError, match="sm_80"):
        build_kernel(tmp_path, "varlen", 'dtype = "f16"\nhead_dim = 64\nnum_heads = 4',
                     targets=("sm_75",))


@pytest.mark.parametrize("head_dim", [64, pytest.param(128, marks=pytest.mark.slow),
                                      pytest.param(256, marks=pytest.mark.slow)])
def test_zero_spills_on_every_target(tmp_path, toolchain, head_dim):
    """ptxas on every tensor-core target (the example specs cover 128 and 256 by default)."""
    from ptxc.pipeline.build import run_build
    (tmp_path / "k.toml").write_text(
        f'[[kernel]]\nname = "k"\nfamily = "varlen"\n{body(head_dim=head_dim, splits="auto")}\n'
        f'targets = ["sm_80", "sm_86", "sm_89", "sm_90", "sm_120"]\n')
    summary = run_build([tmp_path / "k.toml"], tmp_path / "out", progress=False)
    assert summary["verified"] and not summary["problems"]
    for t in summary["kernels"][0]["targets"].values():
        assert t["spill_bytes"] == 0
