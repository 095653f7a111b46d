"""The cache rows no query reads (attention/unread_rows.py), which launch-test fills with NaN
before every decode and varlen kernel runs: the rule on small cases, and against the fp64
reference's own masks -- huge values in every row the rule calls unread leave the reference's
outputs bit for bit unchanged, so the rule never hides a row a query reads -- and
launch-test's check of an inout cache's unread rows."""

import numpy as np
import pytest

from ptxc.kernels import FAMILIES, load_text
from ptxc.kernels.attention.unread_rows import FP8_NAN, key_ranges, poison, restore, row_mask
from ptxc.runtime.launch_test import unread_rows_kept


def test_ranges_and_masks():
    # L 10 decode-like (first query at 9) under a window of 4: keys 6..9; no queries: nothing
    assert key_ranges([10, 5, 0], [9, None, -2], 4, None) == [(6, 10), (0, 0), (0, 0)]
    assert key_ranges([20], [17], None, 8) == [(16, 20)]         # the chunk of position 17
    assert key_ranges([3], [-2], 4, 8) == [(0, 3)]               # q_len > L: from key 0
    # contiguous: a sequence's rows below L are its own (read or masked), past L unread
    m = row_mask([(6, 10), (0, 0)], (2, 12), None)
    assert m[0].tolist() == [False] * 10 + [True] * 2 and m[1].all()
    # paged (4-row pages): the page holding key 6 is read whole, page 0 (keys 0..3) is not
    table = np.array([[5, 2, 7], [1, 0, 3]])
    m = row_mask([(6, 10), (0, 0)], (8, 4), table)
    assert not m[2].any() and m[5].all() and m[7].tolist() == [False, False, True, True]
    assert m.sum() == 32 - 6


def test_poison_and_restore():
    inputs = {"k_cache": np.ones((2, 3), np.float32), "v_cache": np.ones((2, 3), np.uint8), "q": np.zeros(1)}
    mask = np.array([[True, False, False], [False, False, True]])
    kept = {t: inputs[t] for t in inputs}
    saved = poison(inputs, {"k_cache": mask, "v_cache": mask})
    assert np.isnan(inputs["k_cache"][mask]).all() and (inputs["v_cache"][mask] == FP8_NAN).all()
    assert not np.isnan(inputs["k_cache"][~mask]).any() and inputs["q"] is kept["q"]
    restore(inputs, {"k_cache": mask, "v_cache": mask}, saved)
    assert (inputs["k_cache"] == 1).all() and (inputs["v_cache"] == 1).all()


SPECS = {
    "decode paged window": ('family = "decode"\nkv_layout = "paged"\npage_size = 8\nsliding_window = 13\n',
                            {"batch": 5, "max_pages_per_seq": 7, "num_pages": 40}),
    "decode contiguous chunk": ('family = "decode"\nattention_chunk = 16\n', {"batch": 5, "max_seq_len": 53}),
    "varlen paged window": ('family = "varlen"\npage_size = 4\nsliding_window = 7\n',
                            {"batch": 9, "max_pages_per_seq": 12, "num_pages": 120}),
    "varlen tree": ('family = "varlen"\ncustom_mask = "tree"\nattention_chunk = 8\n',
                    {"batch": 11, "max_pages_per_seq": 5, "num_pages": 64}),
    "varlen contiguous non-causal": ('family = "varlen"\nkv_layout = "contiguous"\ncausal = false\n',
                                     {"batch": 9, "max_seq_len": 29}),
}


@pytest.mark.parametrize("case", sorted(SPECS))
def test_the_rule_never_hides_a_row_a_query_reads(case):
    body, dims = SPECS[case]
    [spec] = load_text(f'[[kernel]]\nname = "k"\n{body}dtype = "f16"\nhead_dim = 16\nnum_heads = 4\n'
                       f'num_kv_heads = 2\nreturn_lse = true\n', "k.toml")
    family = FAMILIES[spec.family]
    for seed in range(3):
        inputs = family.make_inputs(spec, dims, np.random.default_rng(seed))
        masks = family.unread(spec, inputs)
        assert set(masks) == {"k_cache", "v_cache"} and masks["k_cache"].any()
        huge = {**inputs, **{t: np.where(m[(...,) + (None,) * 2], np.float32(1e4), inputs[t])
                             for t, m in masks.items()}}
        want, got = family.reference(spec, inputs), family.reference(spec, huge)
        for t in want:
            assert np.array_equal(want[t], got[t]), (case, seed, t)


def test_an_inout_cache_must_keep_its_unread_rows():
    sent = np.full((2, 4), np.nan, np.float32)
    sent[0, :2] = 1.0
    mask = np.isnan(sent)
    want = np.zeros((2, 4))
    got, err = unread_rows_kept(sent.copy(), want, sent, mask)
    assert err == 0.0 and not np.isnan(got).any() and (got[mask] == 0).all()
    assert unread_rows_kept(sent.astype(np.float16), want, sent, mask)[1] == 0.0   # f16 back
    written = sent.copy()
    written[1, 3] = 0.0                                    # a write outside the rows it owns
    assert unread_rows_kept(written, want, sent, mask)[1] == float("inf")


def test_launch_test_runs_the_kernel_on_the_poisoned_cache(tmp_path, monkeypatch):
    """The NaN reaches the kernel, not only the reference's bookkeeping: a rule that also
    marked one row a query reads makes the check fail on o; the rule as it is passes, and the
    output says how many rows it poisoned."""
    import dataclasses

    from conftest import build_kernel
    from ptxc.kernels import registry
    from ptxc.runtime.launch_test import check_artifact
    art = build_kernel(tmp_path, "decode", 'dtype = "f16"\nhead_dim = 16\nnum_heads = 2\n'
                       'return_lse = true\nkv_layout = "paged"\npage_size = 4')
    dims = {"batch": 3, "max_pages_per_seq": 3, "num_pages": 12}
    rows = check_artifact(art, backend="emu", shapes=dims, seed=0)
    assert all(r.ok for r in rows) and any(f.startswith("NaN in ") for f in rows[0].features)
    decode = FAMILIES["decode"]

    def one_more(spec, inputs):          # the first key of the first sequence with keys
        masks = decode.unread(spec, inputs)
        b = int(np.flatnonzero(np.asarray(inputs["seq_lens"]) > 0)[0])
        mask = masks["k_cache"].copy()
        mask[inputs["block_table"][b, 0], 0] = True
        return {"k_cache": mask, "v_cache": mask}
    monkeypatch.setitem(registry.FAMILIES, "decode", dataclasses.replace(decode, unread=one_more))
    bad = {r.tensor: r for r in check_artifact(art, backend="emu", shapes=dims, seed=0)}
    assert not bad["o"].ok and bad["o"].max_error == float("inf")
    assert "passes on clean caches" in bad["o"].note and bad["o"].to_dict()["note"] == bad["o"].note
