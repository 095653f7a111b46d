"""varlen custom_mask = "tree" (speculative verification): draft trees of every shape (chains,
stars, binary trees, random parents) mixed in one batch with decodes and prefill chunks, checked
by the emulator against the fp64 reference that reads the same bits; the launcher's checks of
tree_indptr; each K/V row read once per KV head."""

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
from families.test_varlen import body

TREE = '\ncustom_mask = "tree"'
CASES = [
    dict(dtype="f16", head_dim=40, gqa="gqa4", layout="page16", splits=1),
    dict(dtype="bf16", head_dim=24, gqa="mha", layout="contiguous", splits="auto"),
    dict(dtype="f16", head_dim=32, gqa="gqa8", layout="page1", splits=3),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_tree_batch_matches_reference(tmp_path, case):
    """11 sequences: the serving mix plus three draft trees of 2, 5 or 16 tokens (shapes
    cycling chain / star / binary / random parents) over prefixes whose pages end anywhere."""
    art = build_kernel(tmp_path, "varlen", body(**case) + TREE)
    assert_pass(check_artifact(art, backend="emu", shapes={"batch": 11}, seed=3))


@pytest.mark.parametrize("extra", ["sliding_window = 7", "attention_chunk = 12", "attention_sinks = true\nalibi = true",
                                   "logits_soft_cap = 30.0"])
def test_tree_composes_with_variants(tmp_path, extra):
    art = build_kernel(tmp_path, "varlen", body(head_dim=24, gqa="gqa4", layout="page16") + TREE + "\n" + extra)
    assert_pass(check_artifact(art, backend="emu", shapes={"batch": 11}, seed=4))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("layout", ["page1", "page16", "contiguous"])
def test_tree_of_64_tokens(tmp_path, monkeypatch, dtype, layout):
    monkeypatch.setattr(vi, "TREE_SIZES", (64,))
    art = build_kernel(tmp_path, "varlen", body(dtype=dtype, head_dim=64, layout=layout, splits="auto") + TREE)
    shapes = {"batch": 11, "max_seq_len": 200} if layout == "contiguous" else \
        {"batch": 11, "max_pages_per_seq": 200 // (1 if layout == "page1" else 16),
         "num_pages": 11 * 200 // (1 if layout == "page1" else 16) + 3}
    assert_pass(check_artifact(art, backend="emu", shapes=shapes, seed=8))


def test_tree_bits_decide_visibility():
    """The tree generator's ancestor sets and the packed layout the kernel reads."""
    rng = np.random.default_rng(0)
    assert (vi.draft_tree(4, "chain", rng) == np.tril(np.ones((4, 4), bool))).all()
    star = vi.draft_tree(4, "star", rng)
    assert star[:, 0].all() and (star[1:, 1:] == np.eye(3, dtype=bool)).all()
    data, indptr = vi.pack_bits([vi.draft_tree(3, "binary", rng)])
    assert indptr.tolist() == [0, 2] and data[0] == 0b0101_1001 and data[1] == 1
    vis = vi.tree_visible({"tree_mask": data, "tree_indptr": indptr}, 0, 3, 5)
    assert vis[:, :2].all() and vis[:, 2:].tolist() == [[1, 0, 0], [1, 1, 0], [1, 0, 1]]


def _tree_art(tmp_path):
    art = build_kernel(tmp_path, "varlen", body(head_dim=32, layout="contiguous") + TREE)
    spec = KernelSpec.from_dict(art.meta["spec"])
    inputs = FAMILIES["varlen"].make_inputs(spec, {"batch": 11, "max_seq_len": 60}, np.random.default_rng(2))
    return art, spec, inputs


def test_tree_indptr_is_checked(tmp_path):
    art, spec, inputs = _tree_art(tmp_path)
    n = np.diff(inputs["cu_seqlens_q"])
    b = int(np.argmax(n))
    bad = inputs["tree_indptr"].copy()
    bad[b + 1:] = bad[b] + (n[b] * n[b] + 7) // 8 - 1
    for indptr, words in ((bad, "its mask needs"), (inputs["tree_indptr"] + 1, "start at 0"),
                          (inputs["tree_indptr"][::-1].copy(), "start at 0")):
        with pytest.raises(InputError, match=words):
            art.run({**inputs, "tree_indptr": indptr}, target="sm_80")
    short = inputs["tree_mask"][:int(inputs["tree_indptr"][-1]) - 1]
    with pytest.raises(InputError, match="past the"):
        art.run({**inputs, "tree_mask": short}, target="sm_80")


def test_corrupt_tree_indptr_never_reads_past_the_buffer(tmp_path, monkeypatch):
    """A launch on device memory (runtime.device, the C and Rust loaders) reads no device value
    first, so tree_indptr is not checked there: the kernel bounds each read to the buffer. With
    the host check off, a segment that starts past the end or runs over it reads zero bits
    (draft keys hidden) -- the emulator faults on any read outside a buffer -- and the output is
    the reference's over the buffer padded with zeros."""
    art, spec, inputs = _tree_art(tmp_path)
    monkeypatch.setattr(runtime.abi, "check_mask_indptr", lambda *args: None)
    n = np.diff(inputs["cu_seqlens_q"])
    trees = [b for b in range(len(n)) if n[b] > 1]
    size = inputs["tree_mask"].size
    bad = inputs["tree_indptr"].copy()
    bad[trees[0]] = size + 3                           # starts past the buffer
    bad[trees[-1]] = size - 1                          # runs over its end
    got = art.run({**inputs, "tree_indptr": bad}, target="sm_80")
    padded = np.concatenate([inputs["tree_mask"], np.zeros(size + 64, np.uint8)])
    want = FAMILIES["varlen"].reference(spec, {**inputs, "tree_indptr": bad, "tree_mask": padded})
    assert ref.max_abs_error(got["o"], want["o"]) < 5e-3
    bad[trees[0]] = 1 << 30                            # far past: nothing of it is read
    assert np.isfinite(art.run({**inputs, "tree_indptr": bad}, target="sm_80")["o"]).all()


def test_tree_needs_causal(tmp_path):
    with pytest.raises(SpecError, match="needs causal"):
        build_kernel(tmp_path, "varlen", body(causal=False) + TREE)


def test_tree_verify_reads_each_kv_row_once(tmp_path, bytes_read):
    """A batch of 5- and 16-token tree verifications (GQA 4) reads every K/V row of every
    sequence exactly once per KV head, as causal varlen does."""
    art = build_kernel(tmp_path, "varlen", body(head_dim=32, layout="page16") + TREE)
    spec = KernelSpec.from_dict(art.meta["spec"])
    rng = np.random.default_rng(12)
    q_lens = np.array([5, 16, 1, 16, 5], dtype=np.int32)
    dims = {"batch": 5, "max_pages_per_seq": 6, "num_pages": 33}
    inputs = FAMILIES["varlen"].make_inputs(spec, dims, rng)
    lens = rng.integers(16, 91, 5).astype(np.int32)
    inputs.update(seq_lens=lens, cu_seqlens_q=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
                  q=ref.round_to(rng.standard_normal((int(q_lens.sum()), 8, 32)), "f16").astype(np.float32),
                  block_table=rng.permutation(33)[:30].astype(np.int32).reshape(5, 6),
                  **vi.tree_inputs(q_lens.tolist(), rng))
    out = art.run(inputs, target="sm_80")
    once = int(lens.sum()) * spec.num_kv_heads * spec.head_dim * 2
    assert bytes_read["k_cache"] == bytes_read["v_cache"] == once
    want = FAMILIES["varlen"].reference(spec, inputs)
    assert ref.max_abs_error(out["o"], want["o"]) < 5e-3


PACKED = '\ncustom_mask = "packed"'


@pytest.mark.parametrize("case", [
    dict(dtype="f16", head_dim=40, gqa="gqa4", layout="page16", splits=1),
    dict(dtype="bf16", head_dim=24, gqa="gqa8", layout="contiguous", splits="auto"),
], ids=lambda c: "-".join(str(v) for v in c.values()))
def test_packed_batch_matches_reference(tmp_path, case):
    """The serving mix with random bits, all-zero rows (o = 0, lse = -inf), all-zero KV
    tiles, all-one and sparse masks, one kind per sequence."""
    art = build_kernel(tmp_path, "varlen", body(causal=False, **case) + PACKED)
    assert_pass(check_artifact(art, backend="emu", shapes={"batch": 10}, seed=5))


def test_packed_zero_rows_and_all_ones(tmp_path):
    """All-zero rows write 0 and lse = -inf; an all-one mask gives exactly the non-causal
    kernel's output."""
    plain = build_kernel(tmp_path / "a", "varlen", body(causal=False, head_dim=40, layout="page16"))
    art = build_kernel(tmp_path / "b", "varlen", body(causal=False, head_dim=40, layout="page16") + PACKED)
    spec = KernelSpec.from_dict(art.meta["spec"])
    inputs = FAMILIES["varlen"].make_inputs(spec, {"batch": 8, "max_pages_per_seq": 10, "num_pages": 83},
                                            np.random.default_rng(9))
    q_lens = np.diff(inputs["cu_seqlens_q"]).tolist()
    lens = inputs["seq_lens"].tolist()
    ones = vi.packed_inputs(q_lens, lens, np.random.default_rng(1), kinds=("ones",))
    base = {k: v for k, v in inputs.items() if k not in ("custom_mask", "mask_indptr")}
    want, got = plain.run(base, target="sm_80"), art.run({**base, **ones}, target="sm_80")
    assert np.array_equal(want["o"], got["o"]) and np.array_equal(want["lse"], got["lse"])
    zero = vi.packed_inputs(q_lens, lens, np.random.default_rng(1), kinds=("zero_rows",))
    zero["custom_mask"][:] = 0
    out = art.run({**base, **zero}, target="sm_80")
    assert (out["o"] == 0).all() and np.isneginf(out["lse"]).all()


def visited_rows(visible: np.ndarray, L: int, bn: int) -> int:
    """K rows a CTA reads when it visits exactly the KV tiles holding a visible key."""
    tiles = sorted({int(k) // bn for k in np.flatnonzero(visible.any(axis=0))})
    return sum(min(bn, L - t * bn) for t in tiles)


def test_packed_all_zero_tiles_are_never_read(tmp_path, bytes_read):
    """KV tiles whose bits are 0 for every row of a CTA cost no load (mask_tiles.py): the
    emulator's traffic counters see only the tiles holding a visible key, and the output is
    the reference's."""
    art = build_kernel(tmp_path, "varlen", body(causal=False, head_dim=32, layout="contiguous") + PACKED)
    spec = KernelSpec.from_dict(art.meta["spec"])
    bn = art.meta["targets"]["sm_80"]["config"]["block_n"]
    rng = np.random.default_rng(3)
    q_lens, lens = [3, 2, 4], [200, 130, 150]
    inputs = FAMILIES["varlen"].make_inputs(spec, {"batch": 3, "max_seq_len": 200}, rng)
    vis = [np.zeros((n, L), bool) for n, L in zip(q_lens, lens)]
    vis[0][0, [5, 150]] = vis[0][1, 130:141] = True     # tiles 0 and 2; token 2 sees nothing
    vis[1][0, 70:81] = vis[1][1, 129] = True            # tiles 1 and 2 (two keys)
    vis[2][:, 64:128] = True                            # tile 1 only, all ones
    data, indptr = vi.pack_bits(vis)
    inputs.update(seq_lens=np.array(lens, np.int32), custom_mask=data, mask_indptr=indptr,
                  cu_seqlens_q=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
                  q=ref.round_to(rng.standard_normal((sum(q_lens), 8, 32)), "f16").astype(np.float32))
    out = art.run(inputs, target="sm_80")
    rows = sum(visited_rows(v, L, bn) for v, L in zip(vis, lens))
    assert bytes_read["k_cache"] == bytes_read["v_cache"] == rows * spec.num_kv_heads * 32 * 2
    want = FAMILIES["varlen"].reference(spec, inputs)
    assert ref.max_abs_error(out["o"], want["o"]) < 5e-3
    assert (out["o"][2] == 0).all() and np.isneginf(out["lse"][2]).all()   # the row that sees nothing


def test_packed_needs_non_causal(tmp_path):
    with pytest.raises(SpecError, match="needs causal = false"):
        build_kernel(tmp_path, "varlen", body(causal=True) + PACKED)


@pytest.mark.parametrize("mask,head_dim", [("tree", 64), ("packed", 64),
                                           pytest.param("tree", 256, marks=pytest.mark.slow),
                                           pytest.param("packed", 256, marks=pytest.mark.slow)])
def test_zero_spills_on_every_target(tmp_path, toolchain, mask, head_dim):
    """ptxas on every tensor-core target and sm_90a (specs/speculative_masks.toml covers d128
    in the default build), split and unsplit kernels."""
    from ptxc.pipeline.build import run_build
    (tmp_path / "k.toml").write_text(
        f'[[kernel]]\nname = "k"\nfamily = "varlen"\n'
        f'{body(head_dim=head_dim, splits="auto", causal=mask == "tree")}\ncustom_mask = "{mask}"\n'
        f'targets = ["sm_80", "sm_86", "sm_89", "sm_90", "sm_90a", "sm_120"]\n')
    summary = run_build([tmp_path / "k.toml"], tmp_path / "out", progress=False)
    assert summary["verified"] and not summary["problems"]
    for t in summary["kernels"][0]["targets"].values():
        assert t["spill_bytes"] == 0


def test_tree_over_fp8_cache(tmp_path):
    from conftest import fp8_cache_body
    art = build_kernel(tmp_path, "varlen", fp8_cache_body("bf16", "e4m3", "head", "paged", extra=TREE),
                       targets=("sm_89",))
    assert_pass(check_artifact(art, backend="emu", shapes={"batch": 11}, seed=7))


def test_report_counts_dense_mask_keys(tmp_path):
    """The cost model assumes dense bits: a tree or packed mask costs the non-causal FLOPs
    plus the mask bytes."""
    from ptxc.report.costs import launch_cost
    dims = {"batch": 4, "total_q": 64, "max_pages_per_seq": 8, "num_pages": 40}
    plain = build_kernel(tmp_path / "p", "varlen", body(causal=False, head_dim=32))
    tree = build_kernel(tmp_path / "t", "varlen", body(head_dim=32) + TREE)
    packed = build_kernel(tmp_path / "k", "varlen", body(causal=False, head_dim=32) + PACKED)
    base = launch_cost(plain.meta, "sm_80", dims)
    t = launch_cost(tree.meta, "sm_80", {**dims, "tree_bytes": 4 * 32})
    k = launch_cost(packed.meta, "sm_80", {**dims, "mask_bytes": 4 * 256})
    assert t.flops == k.flops == base.flops
    assert t.bytes == base.bytes + 4 * 32 + 5 * 4 and k.bytes == base.bytes + 4 * 256 + 5 * 4


WGMMA_TREES = [   # (case, extra keys, tile)
    # d128: the producer warpgroup's tile (its default), and the one-issuer tile
    (dict(dtype="bf16", head_dim=128, gqa="gqa4", layout="page16", splits="auto"), "", ""),
    (dict(dtype="f16", head_dim=128, gqa="gqa8", layout="page16", splits=2), "", "warp_specialize = false"),
    (dict(dtype="f16", head_dim=64, gqa="gqa8", layout="contiguous", splits=3), "", 'kv_loads = "cp_async"'),
    (dict(dtype="bf16", head_dim=256, gqa="gqa4", layout="page1", splits=1),
     "sliding_window = 21\nattention_sinks = true", ""),
    (dict(dtype="bf16", head_dim=128, gqa="gqa4", layout="page16", splits=2), 'kv_dtype = "e4m3"\nkv_scale = "head"', ""),
]


@pytest.mark.parametrize("case,extra,tile", WGMMA_TREES, ids=lambda x: "-".join(map(str, x.values()))
                         if isinstance(x, dict) else x.replace("\n", "+").replace(" ", "") or "-")
def test_tree_on_sm90a_wgmma(tmp_path, case, extra, tile):
    """Tree masks run on sm_90a's wgmma body (TMA or cp.async loads, FP8 caches): the wgmma
    accumulator is the mma.sync fragment layout per warp, so MmaMath's per-row tree predicate
    applies as it is. d128 takes block_n 32 (the tree's row state on a 64 x 64 S spilled with a
    variant at 255 registers)."""
    art = build_kernel(tmp_path, "varlen", body(**case) + TREE + "\n" + extra, tile=tile, targets=("sm_90a",))
    config = art.meta["targets"]["sm_90a"]["config"]
    assert config["path"] == "wgmma.m64nNk16"
    assert config["block_n"] == (32 if case["head_dim"] >= 128 else 64)
    assert_pass(check_artifact(art, backend="emu", shapes={"batch": 11}, seed=5))
