"""kv_append with index = "slot_mapping" (vLLM's reshape_and_cache_flash convention): flat
[num_tokens, Hk, d] rows written at slot_mapping[t] = page * page_size + offset of a paged cache
with no block table; padding (negative) and out-of-cache slots skipped; every byte of the cache
outside the written slots untouched (NaN-poisoned caches compared whole). The copy, the FP8
quantising append and RoPE at per-token positions, in the emulator against the references;
CUDA-graph replay (same launches for any step padded to the same num_tokens); one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import assert_pass, build_kernel
from ptxc.cli import main
from ptxc.errors import SpecError
from ptxc.kernels import FAMILIES
from ptxc.runtime.launch_test import check_artifact
from ptxc.kernels import load_text
from ptxc.spec.model import KernelSpec

HEADS = 'num_heads = 6\nnum_kv_heads = 2\nhead_dim = 40\nkv_layout = "paged"\nindex = "slot_mapping"\n'

CASES = [  # (dtype, page_size, kv_dtype, kv_scale, rope, rotary_dim)
    ("f16", 16, None, None, None, None),
    ("bf16", 1, None, None, None, None),
    ("f32", 4, None, None, None, None),
    ("f16", 4, "e4m3", "tensor", None, None),
    ("bf16", 2, "e5m2", "head", "neox", 24),
    ("f16", 8, None, None, "gptj", None),
    ("f32", 4, "e4m3", "head", "gptj", 18),
]


def body(dtype, page_size, kv_dtype, kv_scale, rope, rotary_dim) -> str:
    text = HEADS + f'dtype = "{dtype}"\npage_size = {page_size}\n'
    text += f'kv_dtype = "{kv_dtype}"\nkv_scale = "{kv_scale}"\n' if kv_dtype else ""
    text += f'rope = "{rope}"\n' if rope else ""
    text += f"rotary_dim = {rotary_dim}\n" if rotary_dim else ""
    return text


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c if x))
def test_slot_mapped_append_matches_the_reference(tmp_path, case):
    art = build_kernel(tmp_path, "kv_append", body(*case), targets=("sm_80", "sm_89"))
    dims = {"num_tokens": 13, "num_pages": 7, **({"max_position": 29} if case[4] else {})}
    rows = check_artifact(art, backend="emu", shapes=dims, seed=3)
    assert_pass(rows)
    assert all(r.max_error == 0 for r in rows if r.tensor.endswith("cache") and case[2])   # FP8: exact


def test_interface_is_vllms_reshape_and_cache_flash(tmp_path):
    art = build_kernel(tmp_path, "kv_append", body("f16", 16, "e4m3", "tensor", "neox", None))
    t = art.meta["tensors"]
    assert t["k_new"]["shape"] == ["num_tokens", 2, 40] and t["slot_mapping"]["dtype"] == "i64"
    assert t["slot_mapping"]["shape"] == ["num_tokens"] and t["positions"]["dtype"] == "i64"
    assert t["k_cache"]["shape"] == ["num_pages", 16, 2, 40] and "block_table" not in t
    assert set(art.meta["scalars"]) == {"k_scale", "v_scale"}
    assert art.meta["targets"]["sm_80"]["kernels"][0]["grid"] == ["num_tokens", "1", "1"]
    assert art.meta["graph"]["targets"]["sm_80"]["class"] == "ALWAYS"   # any mix, padded with -1
    assert art.meta["graph"]["per_step_inputs"] == ["positions", "slot_mapping"]


def test_writes_exactly_the_valid_slots_and_nothing_else(tmp_path):
    """Padding, a slot one past the cache and one far past it write nothing; every other byte
    of a NaN-filled cache stays NaN."""
    art = build_kernel(tmp_path, "kv_append", body("f16", 4, None, None, None, None))
    pages, ps, hk, d = 3, 4, 2, 40
    rng = np.random.default_rng(1)
    slots = np.array([5, -1, 11, pages * ps, 0, 1 << 33, 6], np.int64)
    k_new = rng.standard_normal((len(slots), hk, d)).astype(np.float16)
    v_new = rng.standard_normal((len(slots), hk, d)).astype(np.float16)
    cache = np.full((pages, ps, hk, d), np.nan, np.float16)
    out = art.run({"k_new": k_new, "v_new": v_new, "slot_mapping": slots,
                   "k_cache": cache, "v_cache": cache.copy()}, backend="emu")
    for name, new in (("k_cache", k_new), ("v_cache", v_new)):
        got = out[name].reshape(pages * ps, hk, d)
        written = {int(s): i for i, s in enumerate(slots) if 0 <= s < pages * ps}
        for s in range(pages * ps):
            if s in written:
                assert np.array_equal(got[s], new[written[s]].astype(got.dtype))
            else:
                assert np.isnan(got[s]).all(), f"{name} slot {s} touched"


def test_steps_padded_to_the_same_token_count_record_identical_launches(tmp_path):
    """A graph captured at num_tokens = N serves every step of <= N tokens: the engine pads
    slot_mapping with -1 and only buffer contents change."""
    art = build_kernel(tmp_path, "kv_append", body("bf16", 16, "e4m3", "tensor", None, None))
    spec = KernelSpec.from_dict(art.meta["spec"])
    fam = FAMILIES["kv_append"]
    records = []
    for i, live in enumerate((9, 3)):
        inputs = fam.make_inputs(spec, {"num_tokens": 9, "num_pages": 2}, np.random.default_rng(i))
        inputs["slot_mapping"][live:] = -1
        np.savez(tmp_path / f"in{i}.npz", **inputs)
        result = CliRunner().invoke(main, ["run", str(tmp_path / "out" / "k"), "--inputs",
                                           str(tmp_path / f"in{i}.npz"), "--output", str(tmp_path / f"o{i}.npz"),
                                           "--backend", "emu", "--set", f"k_scale={inputs['k_scale']}",
                                           "--set", f"v_scale={inputs['v_scale']}",
                                           "--record-launches", str(tmp_path / f"rec{i}.json")])
        assert result.exit_code == 0, result.output
        records.append((tmp_path / f"rec{i}.json").read_bytes())
        got = np.load(tmp_path / f"o{i}.npz")
        want = fam.reference(spec, inputs)
        for t in ("k_cache", "v_cache"):
            assert np.array_equal(got[t], want[t])
    assert records[0] == records[1]
    assert json.loads(records[0])["launches"][0]["grid"] == [9, 1, 1]


def test_slot_mapping_needs_a_paged_cache():
    text = ('[[kernel]]\nname = "k"\nfamily = "kv_append"\ndtype = "f16"\nhead_dim = 64\n'
            'num_kv_heads = 2\nindex = "slot_mapping"\n')
    with pytest.raises(SpecError) as e:
        load_text(text, "k.toml")
    assert e.value.key == "index" and "paged" in str(e.value) and "\n" not in str(e.value)


def test_slot_mapping_input_dtype_is_checked(tmp_path):
    art = build_kernel(tmp_path, "kv_append", body("f16", 16, None, None, None, None))
    spec = KernelSpec.from_dict(art.meta["spec"])
    inputs = FAMILIES["kv_append"].make_inputs(spec, {"num_tokens": 4, "num_pages": 2}, np.random.default_rng(0))
    inputs["slot_mapping"] = inputs["slot_mapping"].astype(np.float32)
    from ptxc.errors import InputError
    with pytest.raises(InputError, match="slot_mapping has dtype float32, expected i64"):
        art.run(inputs, backend="emu")
