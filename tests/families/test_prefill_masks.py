"""prefill custom_mask = "packed": a seq_q x seq_k bit matrix per batch entry (random bits,
all-zero rows, all-zero KV tiles, all-one and sparse masks), emulator vs the fp64 reference
reading the same bits; all-one masks equal the non-causal kernel exactly; launcher checks."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_pass, build_kernel
from ptxc.errors import InputError, SpecError
from ptxc.kernels import FAMILIES
from ptxc.kernels.families import varlen_inputs as vi
from ptxc import reference as ref
from ptxc import runtime
from ptxc.runtime.launch_test import check_artifact
from ptxc.spec.model import KernelSpec


def body(dtype="f16", head_dim=40, heads=(4, 2), extra=""):
    return (f'dtype = "{dtype}"\nhead_dim = {head_dim}\nnum_heads = {heads[0]}\n'
            f'num_kv_heads = {heads[1]}\ncausal = false\nreturn_lse = true\n'
            f'custom_mask = "packed"\n{extra}')


@pytest.mark.parametrize("dtype,head_dim,heads,extra", [
    ("f16", 40, (4, 2), ""), ("bf16", 64, (8, 1), "attention_sinks = true"),
    ("f16", 24, (4, 4), "logits_soft_cap = 20.0\nalibi = true")])
def test_packed_prefill_matches_reference(tmp_path, dtype, head_dim, heads, extra):
    art = build_kernel(tmp_path, "prefill", body(dtype, head_dim, heads, extra))
    assert_pass(check_artifact(art, backend="emu", shapes={"batch": 5, "seq_q": 19, "seq_k": 131}, seed=2))


def _inputs(art, kinds):
    spec = KernelSpec.from_dict(art.meta["spec"])
    inputs = FAMILIES["prefill"].make_inputs(spec, {"batch": 2, "seq_q": 17, "seq_k": 113},
                                             np.random.default_rng(4))
    inputs.update(vi.packed_inputs([17, 17], [113, 113], np.random.default_rng(5), kinds=kinds))
    return inputs


def test_all_ones_equals_non_causal_and_zero_rows(tmp_path):
    art = build_kernel(tmp_path / "m", "prefill", body())
    plain = build_kernel(tmp_path / "p", "prefill", body().replace('custom_mask = "packed"\n', ""))
    inputs = _inputs(art, ("ones",))
    base = {k: v for k, v in inputs.items() if k not in ("custom_mask", "mask_indptr")}
    want, got = plain.run(base, target="sm_80"), art.run(inputs, target="sm_80")
    assert np.array_equal(want["o"], got["o"]) and np.array_equal(want["lse"], got["lse"])
    inputs["custom_mask"][:] = 0
    out = art.run(inputs, target="sm_80")
    assert (out["o"] == 0).all() and np.isneginf(out["lse"]).all()


def test_all_zero_tiles_are_never_read(tmp_path, bytes_read):
    """A prefix-LM-like mask over 3 x 64-key tiles: each query block reads only the tiles some
    row of it sees (mask_tiles.py), and matches the reference."""
    from families.test_varlen_masks import visited_rows
    art = build_kernel(tmp_path, "prefill", body(head_dim=32, heads=(2, 1)))
    spec = KernelSpec.from_dict(art.meta["spec"])
    cfg = art.meta["targets"]["sm_80"]["config"]
    bm, bn = cfg["block_m"], cfg["block_n"]
    Sq, Sk = bm + 5, 3 * bn
    inputs = FAMILIES["prefill"].make_inputs(spec, {"batch": 1, "seq_q": Sq, "seq_k": Sk}, np.random.default_rng(4))
    vis = np.zeros((Sq, Sk), bool)
    vis[:bm, :10] = True                # block 0: tile 0 only
    vis[bm:, 2 * bn:] = True            # block 1: tile 2 only (all ones)
    inputs["custom_mask"], inputs["mask_indptr"] = vi.pack_bits([vis])
    out = art.run(inputs, target="sm_80")
    rows = visited_rows(vis[:bm], Sk, bn) + visited_rows(vis[bm:], Sk, bn)
    assert bytes_read["k"] == bytes_read["v"] == rows * spec.num_heads * 32 * 2   # a CTA per query head
    want = FAMILIES["prefill"].reference(spec, inputs)
    assert ref.max_abs_error(out["o"], want["o"]) < 5e-3


def test_mask_indptr_is_checked(tmp_path):
    art = build_kernel(tmp_path, "prefill", body())
    inputs = _inputs(art, ("random",))
    with pytest.raises(InputError, match="its mask needs"):
        art.run({**inputs, "mask_indptr": np.array([0, 100, 300], np.int32)}, target="sm_80")
    with pytest.raises(InputError, match="past the"):
        art.run({**inputs, "custom_mask": inputs["custom_mask"][:200]}, target="sm_80")


def test_corrupt_mask_indptr_never_reads_past_the_buffer(tmp_path, monkeypatch):
    """As test_varlen_masks' tree case: with the host check off (a launch on device memory),
    batch entry 1's segment running over the buffer's end reads zero bits past it."""
    art = build_kernel(tmp_path, "prefill", body())
    inputs = _inputs(art, ("random",))
    monkeypatch.setattr(runtime.abi, "check_mask_indptr", lambda *args: None)
    size = inputs["custom_mask"].size
    bad = np.array([0, size - 40, size + 5], np.int32)
    got = art.run({**inputs, "mask_indptr": bad}, target="sm_80")
    padded = np.concatenate([inputs["custom_mask"], np.zeros(size, np.uint8)])
    spec = KernelSpec.from_dict(art.meta["spec"])
    want = FAMILIES["prefill"].reference(spec, {**inputs, "mask_indptr": bad, "custom_mask": padded})
    assert ref.max_abs_error(got["o"], want["o"]) < 5e-3


@pytest.mark.parametrize("extra,words", [("causal = true\n", "needs causal = false")])
def test_spec_errors(tmp_path, extra, words):
    with pytest.raises(SpecError, match=words):
        build_kernel(tmp_path, "prefill", body().replace("causal = false\n", extra))


def test_f32_is_refused(tmp_path):
    with pytest.raises(SpecError, match="tensor-core path only"):
        build_kernel(tmp_path, "prefill", body(dtype="f32"))


@pytest.mark.parametrize("head_dim", [64, pytest.param(256, marks=pytest.mark.slow)])
def test_zero_spills_on_every_target(tmp_path, toolchain, head_dim):
    """ptxas on every tensor-core target and sm_90a (specs/speculative_masks.toml: d128)."""
    from ptxc.pipeline.build import run_build
    (tmp_path / "k.toml").write_text(
        f'[[kernel]]\nname = "k"\nfamily = "prefill"\n{body(head_dim=head_dim)}\n'
        f'targets = ["sm_80", "sm_86", "sm_89", "sm_90", "sm_90a", "sm_120"]\n')
    summary = run_build([tmp_path / "k.toml"], tmp_path / "out", progress=False)
    assert summary["verified"] and not summary["problems"]
    for t in summary["kernels"][0]["targets"].values():
        assert t["spill_bytes"] == 0
