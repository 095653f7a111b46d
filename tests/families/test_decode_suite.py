"""Decode suite: KV layouts x dtype x GQA x head_dim x num_splits against the fp64 reference in
the emulator (FA2 rule), paged caches with shuffled block tables, and kv_append leaving every
byte outside the written rows unchanged."""

import itertools

import numpy as np
import pytest

from ptxc import reference as ref
from conftest import assert_pass, build_kernel
from ptxc.kernels import FAMILIES
from ptxc.runtime.launch_test import check_artifact
from ptxc.spec.model import KernelSpec

GQA_DIMS = [(4, 4, 64), (8, 2, 128), (8, 1, 256)]  # (heads, kv_heads, head_dim): GQA 1, 4, 8


CASES = [(layout, dtype, splits, GQA_DIMS[i % 3])
         for i, (layout, dtype, splits) in enumerate(itertools.product(
             ("contiguous", "pointer_array", "paged"), ("f32", "f16", "bf16"), (1, 3, '"auto"')))]


@pytest.mark.parametrize("layout,dtype,splits,gqa", CASES)
def test_layout_dtype_splits(tmp_path, layout, dtype, splits, gqa):
    heads, kv_heads, d = gqa
    body = (f'dtype = "{dtype}"\nhead_dim = {d}\nnum_heads = {heads}\nnum_kv_heads = {kv_heads}\n'
            f'kv_layout = "{layout}"\nnum_splits = {splits}\nreturn_lse = true')
    shapes = {"batch": 5, "max_seq_len": 37} if layout != "paged" else \
        {"batch": 5, "max_pages_per_seq": 3, "num_pages": 19}
    art = build_kernel(tmp_path, "decode", body + ('\npage_size = 16' if layout == "paged" else ""))
    assert_pass(check_artifact(art, backend="emu", shapes=shapes, seed=11))


@pytest.mark.parametrize("page_size", [1, 4, 16, 256])
def test_paged_lengths_at_page_boundaries(tmp_path, page_size):
    art = build_kernel(tmp_path, "decode", f'dtype = "f16"\nhead_dim = 64\nnum_heads = 4\nnum_kv_heads = 2\n'
                                    f'kv_layout = "paged"\npage_size = {page_size}\nnum_splits = 3')
    spec = KernelSpec.from_dict(art.meta["spec"])
    fam = FAMILIES["decode"]
    pages = -(-70 // page_size)
    inputs = fam.make_inputs(spec, {"batch": 7, "max_pages_per_seq": pages, "num_pages": 7 * pages + 5},
                             np.random.default_rng(page_size))
    inputs["seq_lens"] = np.array([page_size, 2 * page_size, 0, 1, page_size + 1, 70, 69], np.int32).clip(0, pages * page_size)
    out = art.run(inputs, target="sm_80")
    want, naive = fam.reference(spec, inputs), fam.reference(spec, inputs, dtype="f16")
    assert ref.max_abs_error(out["o"], want["o"]) <= ref.tolerance(naive["o"], want["o"])


def test_splits_with_no_keys_merge_correctly(tmp_path):
    """More splits than rows: most splits are empty (lse = -inf, weight 0)."""
    art = build_kernel(tmp_path, "decode", 'dtype = "f32"\nhead_dim = 32\nnum_heads = 2\nnum_splits = 16\nreturn_lse = true')
    spec = KernelSpec.from_dict(art.meta["spec"])
    inputs = FAMILIES["decode"].make_inputs(spec, {"batch": 3, "max_seq_len": 5}, np.random.default_rng(3))
    inputs["seq_lens"] = np.array([5, 0, 2], np.int32)
    out = art.run(inputs, target="sm_80")
    want = FAMILIES["decode"].reference(spec, inputs)
    assert ref.max_abs_error(out["o"], want["o"]) < 1e-5 and ref.max_abs_error(out["lse"], want["lse"]) < 1e-5
    assert np.all(out["o"][1] == 0) and np.all(np.isneginf(out["lse"][1]))


def test_auto_splits_follow_the_rule(tmp_path):
    """auto = 4 split indices per resident CTA slot (SMs x the split kernel's own CTAs/SM on
    the launched target) over the CTAs per split index, in [1, 64]."""
    from ptxc.runtime import apply_dim_rule, rule_ctas_per_sm
    art = build_kernel(tmp_path, "decode", 'dtype = "f16"\nhead_dim = 128\nnum_heads = 32\nnum_kv_heads = 8\nnum_splits = "auto"')
    rule = art.meta["dim_rules"]["num_splits"]
    assert rule["auto"] == {"ctas": "8 * batch", "max": 64, "occupancy_of": "ptxc_k_split",
                            "rule": "min(max, max(1, cdiv(4 * num_sms * ctas_per_sm, ctas)))"}
    assert apply_dim_rule(rule, {"batch": 1}, 132, 4) == 64     # 8 CTAs, 528 slots: capped
    assert apply_dim_rule(rule, {"batch": 64}, 132, 4) == 5     # cdiv(2112, 512)
    assert apply_dim_rule(rule, {"batch": 4}, 108, 4) == 54     # cdiv(1728, 32)
    assert apply_dim_rule(rule, {"batch": 4096}, 108, 4) == 1   # the batch alone fills every slot
    [split] = [k for k in art.meta["targets"]["sm_80"]["kernels"] if k["entry"] == "ptxc_k_split"]
    assert "occupancy" not in split and rule_ctas_per_sm(art.meta, rule, "sm_80") == 1  # unverified build
    [reduce] = [k for k in art.meta["targets"]["sm_80"]["kernels"] if k["entry"].endswith("_reduce")]
    assert art.meta["targets"]["sm_80"]["kernels"][0]["grid"] == ["8", "batch", "num_splits"]
    assert reduce["grid"] == ["32", "batch", "1"]


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_kv_append_writes_rows_and_nothing_else(tmp_path, layout, dtype):
    art = build_kernel(tmp_path, "kv_append", f'dtype = "{dtype}"\nhead_dim = 64\nnum_heads = 8\nnum_kv_heads = 2\n'
                                       f'kv_layout = "{layout}"')
    spec = KernelSpec.from_dict(art.meta["spec"])
    fam = FAMILIES["kv_append"]
    shapes = {"batch": 6, "num_new": 3, **({"max_seq_len": 11} if layout == "contiguous" else
                                           {"max_pages_per_seq": 2, "num_pages": 14})}
    inputs = fam.make_inputs(spec, shapes, np.random.default_rng(8))
    out = art.run(inputs, target="sm_80")
    want = fam.reference(spec, inputs)
    for name in ("k_cache", "v_cache"):  # bit-exact: rows copied, everything else untouched
        got_bits = ref.to_device(out[name], dtype).view(np.uint8)
        want_bits = ref.to_device(want[name], dtype).view(np.uint8)
        assert np.array_equal(got_bits, want_bits), name
    written = ~np.isclose(want["k_cache"], inputs["k_cache"]).all(axis=(-1, -2))
    assert written.sum() > 0 and (~written).sum() > 0  # some rows written, some left alone


@pytest.mark.slow
@pytest.mark.parametrize("layout,dtype,splits", list(itertools.product(
    ("contiguous", "pointer_array", "paged"), ("f32", "f16", "bf16"), (1, 3, '"auto"'))))
def test_decode_suite_long(tmp_path, layout, dtype, splits):
    for heads, kv_heads, d in GQA_DIMS + [(8, 8, 128), (16, 4, 64)]:
        body = (f'dtype = "{dtype}"\nhead_dim = {d}\nnum_heads = {heads}\nnum_kv_heads = {kv_heads}\n'
                f'kv_layout = "{layout}"\nnum_splits = {splits}\nreturn_lse = true')
        shapes = {"batch": 5, "max_seq_len": 600} if layout != "paged" else \
            {"batch": 5, "max_pages_per_seq": 40, "num_pages": 230}
        art = build_kernel(tmp_path / f"{heads}_{kv_heads}_{d}", "decode", body)
        assert_pass(check_artifact(art, backend="emu", shapes=shapes, seed=12))


def test_pointer_array_metadata_says_runtime_builds_pointers(tmp_path):
    art = build_kernel(tmp_path, "decode", 'dtype = "f16"\nhead_dim = 64\nnum_heads = 4\nkv_layout = "pointer_array"')
    t = art.meta["tensors"]
    assert t["k_ptrs"] == {"dtype": "u64", "shape": ["batch"], "role": "input", "derived_from": "k_cache",
                           "doc": t["k_ptrs"]["doc"],
                           "preconditions": {"align_bytes": 8, "stride_multiple": 1, "strided_axes": []}}
    assert t["k_cache"]["passed_as"] == "k_ptrs"
    # rows are reached through the per-sequence pointers, so axis 0 may be strided too
    assert t["k_cache"]["preconditions"]["strided_axes"] == [0, 1, 2]
    params = [p["name"] for p in art.meta["targets"]["sm_80"]["kernels"][0]["params"]]
    assert "k_ptrs" in params and "k_cache" not in params and "k_cache_stride0" not in params


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_kv_append_fused_into_decode_launch_list(tmp_path, layout):
    art = build_kernel(tmp_path, "decode", f'dtype = "bf16"\nhead_dim = 64\nnum_heads = 8\nnum_kv_heads = 2\n'
                                           f'kv_layout = "{layout}"\nnum_splits = 3\nappend_kv = true\nreturn_lse = true')
    entries = [k["entry"] for k in art.meta["targets"]["sm_80"]["kernels"]]
    assert entries == ["ptxc_k_append", "ptxc_k_split", "ptxc_k_reduce"]
    assert art.meta["tensors"]["k_cache"]["role"] == "inout"
    shapes = {"batch": 5, "max_seq_len": 29} if layout == "contiguous" else \
        {"batch": 5, "max_pages_per_seq": 2, "num_pages": 12}
    rows = check_artifact(art, backend="emu", shapes=shapes, seed=21)
    assert {r.tensor for r in rows} == {"o", "lse", "k_cache", "v_cache"}
    assert_pass(rows)


def test_append_kv_rejects_pointer_arrays():
    from ptxc.errors import SpecError
    from ptxc.kernels import load_text
    with pytest.raises(SpecError, match="append_kv supports"):
        load_text('[[kernel]]\nname = "k"\nfamily = "decode"\ndtype = "f16"\nhead_dim = 64\nnum_heads = 4\n'
                  'kv_layout = "pointer_array"\nappend_kv = true\n')


def test_tuned_table_steers_decode_tiles(tmp_path, monkeypatch):
    """A table written by `ptxc tune` changes the default tile; a tile the user gives wins."""
    from ptxc import tuned
    from ptxc.kernels.families.decode import resolve_tile
    from ptxc.kernels import load_text
    from ptxc.targets import TARGETS
    tuned.write_table(tmp_path, target="sm_90", sm=90, device_name="NVIDIA H100 80GB HBM3",
                      entries=[{"family": "decode", "head_dim": 128, "causal": False, "dtype": "f16",
                                "tile": {"num_warps": 8, "kv_unroll": 2}, "median_ms": 0.1}])
    monkeypatch.setattr(tuned, "TUNED_DIR", tmp_path)
    monkeypatch.setattr(tuned.lookup, "__defaults__", (None, tmp_path))
    base = '[[kernel]]\nname = "k"\nfamily = "decode"\ndtype = "f16"\nhead_dim = 128\nnum_heads = 8\n'
    [spec] = load_text(base)
    assert resolve_tile(spec, TARGETS["sm_90"])["num_warps"] == 8
    assert resolve_tile(spec, TARGETS["sm_80"])["num_warps"] == 4          # no table for sm_80
    [mine] = load_text(base + "[kernel.tile]\nnum_warps = 2\n")
    chosen = resolve_tile(mine, TARGETS["sm_90"])
    assert chosen["num_warps"] == 2 and chosen["kv_unroll"] == 2                 # user's key, tuned rest
