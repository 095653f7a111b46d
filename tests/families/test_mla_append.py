"""The mla_append family (vLLM's concat_and_cache_mla): a step's latent rows written at their
slots, bit-exact against the numpy model of the formats (mla_inputs.append_reference: bf16/f16
rows, RoPE's exact f32 sequence, e4m3 with amax-0 rows, +-inf, NaN and saturating values, and
e4m3_ds's group-scaled rows);
padding slots, slots past the cache and skipped RoPE positions leave every byte untouched. And
the cache it writes is the one the mla family reads."""

import numpy as np
import pytest

from conftest import build_kernel
from ptxc import reference as ref
from ptxc.errors import SpecError
from ptxc.kernels import FAMILIES
from ptxc.runtime.launch_test import check_artifact
from ptxc.kernels import load_text
from ptxc.spec.model import KernelSpec

APPEND = FAMILIES["mla_append"]

CASES = {
    "bf16": ('dtype = "bf16"\n', ("sm_80",)),
    "bf16-neox-r256": ('dtype = "bf16"\nrope = "neox"\nkv_lora_rank = 256\nqk_rope_head_dim = 32\n', ("sm_80",)),
    "f16-gptj-page16": ('dtype = "f16"\nrope = "gptj"\npage_size = 16\n', ("sm_80",)),
    "e4m3": ('dtype = "bf16"\nkv_dtype = "e4m3"\n', ("sm_80", "sm_89")),
    "e4m3-device-neox": ('dtype = "bf16"\nkv_dtype = "e4m3"\nkv_scale = "device"\nrope = "neox"\n'
                         'page_size = 1\n', ("sm_80", "sm_90")),
    # fp8_ds_mla rows (vLLM's concat_and_cache_ds_mla): an amax-0 row (scale FLT_MIN), +inf in a
    # group (scale inf: inf/inf -> the NaN code, the rest 0), NaN among finite values (ignored
    # by the amax), values so small that amax / 448 falls under FLT_MIN, -inf and NaN RoPE
    "e4m3_ds": ('dtype = "bf16"\nkv_dtype = "e4m3_ds"\n', ("sm_80", "sm_89")),
    "e4m3_ds-neox-page16": ('dtype = "bf16"\nkv_dtype = "e4m3_ds"\nrope = "neox"\npage_size = 16\n', ("sm_90",)),
    "e4m3_ds-gptj-page1": ('dtype = "bf16"\nkv_dtype = "e4m3_ds"\nrope = "gptj"\npage_size = 1\n', ("sm_80",)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_cache_bytes_match_the_model_exactly(tmp_path, case):
    text, targets = CASES[case]
    art = build_kernel(tmp_path, "mla_append", text, targets=targets)
    shapes = {"num_tokens": 13, "num_pages": 3 if "page_size = 1" not in text else 20}
    rows = check_artifact(art, backend="emu", shapes=shapes, seed=5)
    assert rows and all(r.ok and r.max_error == 0 for r in rows), [(r.target, r.max_error) for r in rows]


def test_skipped_tokens_touch_nothing(tmp_path):
    """Every slot padding or outside the cache, or (RoPE) every position outside [0,
    max_position): the cache comes back byte for byte."""
    art = build_kernel(tmp_path, "mla_append", 'dtype = "bf16"\nkv_dtype = "e4m3"\nrope = "neox"\n')
    spec = KernelSpec.from_dict(art.meta["spec"])
    inputs = APPEND.make_inputs(spec, {"num_tokens": 6, "num_pages": 2, "max_position": 9},
                                np.random.default_rng(1))
    before = inputs["kv_cache"].copy()
    skipped = {**inputs, "slot_mapping": np.array([-1, 128, 1 << 40, -(1 << 40), 200, -7], np.int64)}
    assert np.array_equal(art.run(skipped, target="sm_80")["kv_cache"], before)
    off = {**inputs, "positions": np.array([9, -1, 10, 1 << 40, -(1 << 40), 9], np.int64)}
    assert np.array_equal(art.run(off, target="sm_80")["kv_cache"], before)


def test_appended_rows_are_what_mla_attends(tmp_path):
    """An engine step: append three tokens' latent rows (one per sequence) into a paged cache
    with mla_append, then decode with mla over that cache: o matches the reference computed
    from kv_c and k_pe directly."""
    common = 'dtype = "bf16"\nkv_lora_rank = 128\nqk_rope_head_dim = 16\npage_size = 16\n'
    app = build_kernel(tmp_path / "a", "mla_append", common)
    att = build_kernel(tmp_path / "m", "mla", common + "num_heads = 16\nsoftmax_scale = 0.11\n")
    rng = np.random.default_rng(3)
    rnd = lambda *s: ref.round_to(rng.standard_normal(s), "bf16").astype(np.float32)
    lens, pages = [5, 17, 33], 12
    table = rng.permutation(pages)[:9].astype(np.int32).reshape(3, 3)
    cache = rnd(pages, 16, 144)
    rows = {b: rnd(L, 144) for b, L in enumerate(lens)}          # every row of each sequence
    for b, L in enumerate(lens):                                  # the first L - 1 already cached
        for r in range(L - 1):
            cache[table[b, r // 16], r % 16] = rows[b][r]
    slots = np.array([table[b, (L - 1) // 16] * 16 + (L - 1) % 16 for b, L in enumerate(lens)], np.int64)
    last = np.stack([rows[b][L - 1] for b, L in enumerate(lens)])
    cache = app.run({"kv_c": last[:, :128], "k_pe": last[:, 128:], "slot_mapping": slots,
                     "kv_cache": cache}, target="sm_80")["kv_cache"]
    q = rnd(3, 16, 144)
    inputs = {"q": q, "cu_seqlens_q": np.array([0, 1, 2, 3], np.int32),
              "seq_lens": np.array(lens, np.int32), "kv_cache": cache, "block_table": table}
    out = att.run(inputs, target="sm_80")
    for b, L in enumerate(lens):
        k = rows[b].astype(np.float64)
        s = 0.11 * q[b].astype(np.float64) @ k.T
        p = np.exp(s - s.max(axis=1, keepdims=True))
        want = (p / p.sum(axis=1, keepdims=True)) @ k[:, :128]
        assert ref.max_abs_error(out["o"][b], want) < 2e-2


@pytest.mark.parametrize("extra,key,words", [
    ('kv_dtype = "e4m3_ds"\nqk_rope_head_dim = 32\nkv_lora_rank = 256\n', "kv_lora_rank", "e4m3_ds"),
    ('kv_scale = "device"\n', "kv_scale", "e4m3"),
    ("head_dim = 512\n", "head_dim", "576"),
    ('rope = "yarn"\n', "rope", "neox"),
    ('dtype = "f32"\n', "dtype", "bf16"),
])
def test_spec_refusals_name_the_key(extra, key, words):
    text = '[[kernel]]\nname = "a"\nfamily = "mla_append"\n' + extra
    if not extra.startswith("dtype"):
        text += 'dtype = "bf16"\n'
    with pytest.raises(SpecError) as e:
        load_text(text, "a.toml")
    assert e.value.key == key and words in str(e.value), str(e.value)


def test_spec_without_heads_normalises_and_round_trips():
    from ptxc.kernels import spec_from_record
    [spec] = load_text('[[kernel]]\nname = "a"\nfamily = "mla_append"\ndtype = "bf16"\n', "a.toml")
    assert (spec.head_dim, spec.num_heads, spec.num_kv_heads, spec.opt("page_size")) == (576, 1, 1, 64)
    assert spec_from_record(spec.to_dict()).to_dict() == spec.to_dict()
