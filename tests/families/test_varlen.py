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
from ptxc import reference as ref
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


def test_dims_are_inferred_and_cu_seqlens_checked(tmp_path):
    art = build_kernel(tmp_path, "varlen", body())
    spec = _spec(art)
    inputs = FAMILIES["varlen"].make_inputs(spec, {"batch": 8, "max_pages_per_seq": 10,
                                                   "num_pages": 83}, np.random.default_rng(2))
    dims = art.infer_dims(inputs)
    cu = inputs["cu_seqlens_q"]
    assert dims == {"batch": 8, "total_q": cu[-1], "max_pages_per_seq": 10, "num_pages": 83}
    for bad in (cu[::-1].copy(), np.where(np.arange(9) == 8, cu[-1] - 1, cu).astype(np.int32)):
        with pytest.raises(InputError, match="prefix sums"):
            art.infer_dims(dict(inputs, cu_seqlens_q=bad))
    with pytest.raises(InputError, match="batch \\+ 1"):
        art.infer_dims(dict(inputs, cu_seqlens_q=cu[:-1].copy()))


def test_launch_geometry_packs_gqa_and_bounds_the_grid(tmp_path):
    """One CTA row per KV head (not per query head): a K/V tile is read once for the whole GQA
    group. grid.x counts packed tiles over the whole batch: at most useful tiles + batch."""
    art = build_kernel(tmp_path, "varlen", 'dtype = "bf16"\nhead_dim = 128\nnum_heads = 28\n'
                       'num_kv_heads = 4\nnum_splits = "auto"')
    kernels = art.target("sm_80")[1]["kernels"]
    assert kernels[0]["grid"] == ["total_q * 7 // 64 + batch", "4 * num_splits", "1"]
    assert kernels[1]["grid"] == ["28", "total_q", "1"]   # split_reduce over (head, token)
    assert art.meta["dim_rules"]["num_splits"]["auto"]["ctas"] == "4 * (total_q * 7 // 64 + batch)"
    # 64 decodes + one 3000-token chunk: 7 * 3064 // 64 + 65 = 400 tiles per KV head, against
    # 64 + cdiv(3000 * 7, 64) = 393 useful ones (FA2's grid would launch 65 * 329).
    assert 3064 * 7 // 64 + 65 <= 64 + -(-3000 * 7 // 64) + 65


def test_one_long_sequence_among_many_short_ones(tmp_path):
    """Tiles of the long sequence land after many empty / one-token sequences: the search must
    map every tile to the right sequence (and the tiles past each sequence exit)."""
    art = build_kernel(tmp_path, "varlen", body(layout="contiguous", head_dim=16, gqa="mqa"))
    spec = _spec(art)
    rng = np.random.default_rng(9)
    B, S = 13, 40
    inputs = FAMILIES["varlen"].make_inputs(spec, {"batch": B, "max_seq_len": S}, rng)
    q_lens = np.array([1, 0, 1, 1, 0, 0, 1, 37, 1, 0, 2, 1, 1], dtype=np.int32)
    inputs["cu_seqlens_q"] = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    inputs["seq_lens"] = np.maximum(q_lens, rng.integers(0, S + 1, B)).astype(np.int32)
    inputs["q"] = ref.round_to(rng.standard_normal((int(q_lens.sum()), 6, 16)), "f16").astype(np.float32)
    out = art.run(inputs, target="sm_80")
    want = FAMILIES["varlen"].reference(spec, inputs)
    naive = FAMILIES["varlen"].reference(spec, inputs, dtype="f16")
    for t in ("o", "lse"):
        assert ref.max_abs_error(out[t], want[t]) <= ref.tolerance(naive[t], want[t])


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


def test_cli_run_and_launch_test(tmp_path):
    """`ptxc run` takes nothing but the arrays (every dim comes from shapes); bad prefix sums
    are one line, exit 2, and no output file; `ptxc launch-test` draws a mixed batch."""
    from click.testing import CliRunner

    from ptxc.cli import main
    art = build_kernel(tmp_path, "varlen", body(splits=3, head_dim=32))
    spec = _spec(art)
    inputs = FAMILIES["varlen"].make_inputs(spec, {"batch": 5, "max_pages_per_seq": 4,
                                                   "num_pages": 23}, np.random.default_rng(4))
    np.savez(tmp_path / "in.npz", **inputs)
    r = CliRunner().invoke(main, ["run", str(art.path), "--inputs", str(tmp_path / "in.npz"),
                                  "--output", str(tmp_path / "o.npz"), "--backend", "emu"])
    assert r.exit_code == 0, r.output
    with np.load(tmp_path / "o.npz") as out:
        want = FAMILIES["varlen"].reference(spec, inputs)
        assert ref.max_abs_error(out["o"], want["o"]) < 5e-3
    inputs["cu_seqlens_q"] = inputs["cu_seqlens_q"][::-1].copy()
    np.savez(tmp_path / "bad.npz", **inputs)
    r = CliRunner().invoke(main, ["run", str(art.path), "--inputs", str(tmp_path / "bad.npz"),
                                  "--output", str(tmp_path / "o2.npz"), "--backend", "emu"])
    assert r.exit_code == 2 and "prefix sums" in r.output and len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "o2.npz").exists()
    r = CliRunner().invoke(main, ["launch-test", str(art.path), "--backend", "emu", "--seed", "3"])
    assert r.exit_code == 0 and "0 failed" in r.output, r.output


def test_page_ids_out_of_range_are_never_read(tmp_path):
    """A corrupt block-table entry inside a sequence's length: the emulator faults on any read
    outside a buffer, so finishing proves the id was never dereferenced; those rows read as
    zero K/V rows (docs/kernels.md), the other sequences are untouched."""
    art = build_kernel(tmp_path, "varlen", body(head_dim=16, gqa="mha"))
    spec = _spec(art)
    dims = {"batch": 8, "max_pages_per_seq": 3, "num_pages": 27}
    inputs = FAMILIES["varlen"].make_inputs(spec, dims, np.random.default_rng(8))
    corrupt = dict(inputs, block_table=inputs["block_table"].copy())
    L0 = int(inputs["seq_lens"][0])
    corrupt["block_table"][0, (L0 - 1) // 16] = -5 if L0 % 2 else 1 << 30
    out = art.run(corrupt, target="sm_80")
    want = FAMILIES["varlen"].reference(spec, inputs)
    assert np.all(np.isfinite(out["o"]))
    rest = slice(int(inputs["cu_seqlens_q"][1]), None)
    assert ref.max_abs_error(out["o"][rest], want["o"][rest]) < 5e-3


@pytest.mark.parametrize("layout", ["contiguous", "page16"])
def test_gqa_packing_reads_each_kv_row_once(tmp_path, bytes_read, layout):
    """Global K/V bytes the emulator actually reads for a batch of decodes and 4-token
    verifications of a GQA-4 model: every row of every sequence exactly once per KV head — not
    once per query head (4x), as an unpacked kernel would."""
    art = build_kernel(tmp_path, "varlen", body(layout=layout, head_dim=32))
    spec = _spec(art)
    rng = np.random.default_rng(12)
    q_lens = np.array([1, 4, 1, 0, 4, 1, 1], dtype=np.int32)
    dims = {"batch": 7, "max_seq_len": 90} if layout == "contiguous" else \
        {"batch": 7, "max_pages_per_seq": 6, "num_pages": 45}
    inputs = FAMILIES["varlen"].make_inputs(spec, dims, rng)
    lens = rng.integers(4, 91, 7).astype(np.int32)
    inputs.update(seq_lens=lens, cu_seqlens_q=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
                  q=ref.round_to(rng.standard_normal((int(q_lens.sum()), 8, 32)), "f16").astype(np.float32))
    if layout != "contiguous":   # every sequence owns its 6 pages (90 rows), shuffled
        inputs["block_table"] = rng.permutation(45)[:42].astype(np.int32).reshape(7, 6)
    out = art.run(inputs, target="sm_80")
    once = int(lens[q_lens > 0].sum()) * spec.num_kv_heads * spec.head_dim * 2   # q_len 0: none
    assert bytes_read["k_cache"] == bytes_read["v_cache"] == once
    want = FAMILIES["varlen"].reference(spec, inputs)
    assert ref.max_abs_error(out["o"], want["o"]) < 5e-3


def test_report_cost_and_bench_inputs(tmp_path):
    from ptxc.gpu.bench import bench_inputs
    from ptxc.report.costs import launch_cost, resolve_dims
    art = build_kernel(tmp_path, "varlen", 'dtype = "f16"\nhead_dim = 128\nnum_heads = 32\n'
                       'num_kv_heads = 8\nnum_splits = "auto"')
    dims = resolve_dims(art.meta, {})
    assert dims["batch"] == 16 and dims["total_q"] == 64 and dims["max_pages_per_seq"] == 256
    cost = launch_cost(art.meta, "sm_80", dims)
    q, L = 4, 4096                                  # causal: query i sees L - q + i + 1 keys
    assert cost.flops == 4 * 16 * 32 * 128 * (q * L - q * (q - 1) // 2) and cost.unit == "tensor"
    assert cost.bytes > 2 * 16 * L * 8 * 128 * 2    # at least K and V once
    small = resolve_dims(art.meta, {"batch": 3, "total_q": 12, "max_pages_per_seq": 2})
    inputs = bench_inputs(art.meta, small)
    assert list(inputs["cu_seqlens_q"]) == [0, 4, 8, 12] and list(inputs["seq_lens"]) == [32] * 3
    assert art.infer_dims(inputs)["total_q"] == 12


@pytest.mark.parametrize("causal", [True, False])
def test_causal_query_blocks_launch_longest_first(tmp_path, causal):
    """A causal sequence's query blocks launch last to first (FA3 / FlashInfer: the last block
    sees the most keys, so the grid's last wave holds short ones): the grid's first CTA alone
    (an emulated launch of grid.x = 1) writes the last rows of sequence 0, and the metadata
    records config.query_order = "longest_first", which the launch model's tile order follows;
    non-causal keeps block 0 first."""
    from ptxc import emu
    from ptxc.report.launch_model import query_tile_keys
    from ptxc.runtime import infer_dims, launch_geometry, pack_args, prepare_buffers
    art = build_kernel(tmp_path, "varlen", body(head_dim=32, gqa="gqa4", causal=causal,
                                                layout="contiguous"))
    spec = _spec(art)
    rng = np.random.default_rng(4)
    inputs = FAMILIES["varlen"].make_inputs(spec, {"batch": 2, "max_seq_len": 80}, rng)
    q_lens = np.array([50, 3], np.int32)              # 50 tokens x 4 heads: 4 tiles of 64 rows
    inputs["cu_seqlens_q"] = np.array([0, 50, 53], np.int32)
    inputs["seq_lens"] = np.array([70, 9], np.int32)
    inputs["q"] = ref.round_to(rng.standard_normal((53, 8, 32)), "f16").astype(np.float32)
    dims = infer_dims(art.meta, inputs, {})
    buffers = prepare_buffers(art.meta, inputs, dims)
    buffers["o"][...] = np.nan
    [kernel] = art.target("sm_80")[1]["kernels"]
    grid, block = launch_geometry(kernel, dims)
    emu.launch(art.ptx("sm_80"), kernel["entry"], (1, grid[1], grid[2]), block,
               pack_args(kernel, buffers, dims, pointer=lambda n, a: a),
               dynamic_smem_bytes=kernel["dynamic_smem_bytes"])
    written = ~np.isnan(buffers["o"]).any(axis=(1, 2))
    # one CTA per KV head: 64 packed rows = 16 tokens of the 4 heads of each KV head
    tokens = np.arange(48, 50) if causal else np.arange(0, 16)     # block 3: tokens 48, 49
    assert written[tokens].all() and written.sum() == len(tokens), np.flatnonzero(written)
    config = art.meta["targets"]["sm_80"]["config"]
    assert config.get("query_order") == ("longest_first" if causal else None)
    ends = [end for _, end in query_tile_keys(art.meta["spec"], config,
                                              {"total_q": 200, "batch": 1}, 300, None)]
    assert ends == sorted(ends, reverse=causal) and len(set(ends)) == (4 * 200 // 64 + 1 if causal else 1)
