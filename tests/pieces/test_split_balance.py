"""Length-balanced split-KV (ptxc/kernels/attention/split_plan.py): the kernels follow the Python model of
the assignment exactly (every split's partial lse is recomputed in fp64 over the rows the model
gives it), outputs stay exact on very mixed lengths, and the model's balance beats even splits."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import build_kernel
from ptxc.kernels import FAMILIES
from ptxc.kernels.attention.split_plan import AUTO_SPLIT, SPLIT_HEADROOM, AutoSplit, auto_split, plan
from ptxc.reference import from_device
from ptxc.runtime import _emu_launcher, infer_dims, prepare_buffers
from ptxc.spec.model import KernelSpec

LOG2E = np.log2(np.e)


def run_keeping_workspace(art, inputs: dict, target="sm_80", dims: dict | None = None,
                          poison=()) -> tuple[dict, dict]:
    """Run the launch list on the emulator; return (dims, every buffer incl. o_part/lse_part).
    `poison`: buffers filled with NaN first (what a kernel must not read or need not write)."""
    dims = infer_dims(art.meta, inputs, dims or {}, target=target)
    buffers = prepare_buffers(art.meta, inputs, dims)
    for name in poison:
        buffers[name].fill(np.nan)
    launch = _emu_launcher(art.ptx(target), art.meta)
    for k in art.meta["targets"][target]["kernels"]:
        launch(k, buffers, dims)
    return dims, buffers


def uniform_mla_inputs(B: int, heads: int, d: int, cache_rows: int, L: int) -> dict:
    """B single-token MLA queries over contiguous latent caches of L keys each, bf16 values."""
    rng = np.random.default_rng(3)
    bf = lambda shape: (rng.standard_normal(shape).astype(np.float32).view(np.uint32)
                        & np.uint32(0xFFFF0000)).view(np.float32)
    return {"q": bf((B, heads, d)), "kv_cache": bf((B, cache_rows, d)),
            "cu_seqlens_q": np.arange(B + 1, dtype=np.int32), "seq_lens": np.full(B, L, np.int32)}


def partial_lse(q, k, scale, rows) -> float:
    """log2 sum_j 2^(q.k_j * scale * log2 e) over `rows` (-inf when empty), in fp64."""
    if len(rows) == 0:
        return -np.inf
    s = (k[rows].astype(np.float64) @ q.astype(np.float64)) * scale * LOG2E
    return float(s.max() + np.log2(np.exp2(s - s.max()).sum()))


def test_plan_covers_every_row_once_and_bounds_splits():
    units = [613, 0, 1, 3, 17, 5, 0, 40, 2]
    policies = [AutoSplit(), *AUTO_SPLIT.values()]
    for S, auto in [(1, None), (4, None)] + [(S, a) for S in (12, 64) for a in policies]:
        chunk, ranges = plan(units, S, auto)
        for u, rs in zip(units, ranges):
            covered = [x for a, b in rs for x in range(a, b)]
            assert covered == list(range(u))                     # contiguous, once, in order
            assert all(b - a <= chunk for a, b in rs)
        assert chunk >= -(-max(units) // S)
    chunk, _ = plan([10] * 8, 4, AutoSplit())                     # equal lengths: busy CTAs ~ slots
    assert chunk == -(-80 // -(-4 * 8 // SPLIT_HEADROOM))


def busy_ctas(units: list[int], S: int, auto, rows: int, ctas_per_row: int, work=None) -> tuple[int, int]:
    chunk, ranges = plan(units, S, auto, work, rows)
    return chunk, sum(b > a for r in ranges for a, b in r) * ctas_per_row


def test_family_rules_give_the_split_counts_timed_fastest_on_an_h200():
    """The shapes of docs/performance.md "Split-KV 'auto' rule" (H200: 132 SMs), through the
    launch's own S (AUTO_RULE): decode at batch 64 x 4096 (3 CTAs per SM, 8 KV heads, 64-key
    tiles) left every sequence whole, 512 busy CTAs (1.29 waves, 0.344 ms), and now spreads
    them over the 4 splits, 2048 (5.2 waves, 0.279 ms);
    MLA (1 CTA per SM, 32-row latent tiles, rows = the packed tiles + batch) now leaves
    DeepSeek-V3 at batch 64 unsplit (0.207 ms timed at num_splits 1 against 0.227 at the old
    rule's 114 + 14 rows) and gives Kimi-K2 two even halves (0.127 against 0.147)."""
    cd = lambda a, d: -(-a // d)
    S = cd(SPLIT_HEADROOM * 132 * 3, 8 * 64)
    assert busy_ctas([64] * 64, S, AutoSplit(), 64, 8) == (64, 512)
    assert busy_ctas([64] * 64, S, AUTO_SPLIT["decode"], 64, 8) == (16, 2048)
    # batch 16 (13 splits): the rule's uneven 20 + 20 + 20 + 4 tiles stay (0.084 ms; spread
    # over 13 splits of 5: 0.087, evened to 4 x 16: 0.096); likewise batch 32 x 8192
    for batch, units in ((16, 64), (32, 128)):
        S = cd(SPLIT_HEADROOM * 132 * 3, 8 * batch)
        assert plan([units] * batch, S, AUTO_SPLIT["decode"]) == plan([units] * batch, S, AutoSplit())
    for heads, old, new in ((128, (114, 256), (128, 128)), (64, (52, 192), (64, 128))):
        tiles = heads // 64
        rows = 64 * tiles + 64
        S = cd(SPLIT_HEADROOM * 132, rows)
        args = ([128] * 64, S, None, rows, tiles, [128 * tiles] * 64)
        assert busy_ctas(*args[:2], AutoSplit(), *args[3:]) == old
        assert busy_ctas(*args[:2], AUTO_SPLIT["mla"], *args[3:]) == new


def test_rounding_down_never_exceeds_the_aim_and_stays_exact():
    """round_down: the longest row's splits are floor(longest / the total term's chunk), even."""
    for units in ([100] * 7, [613, 0, 1, 40], [5, 5, 6], [1]):
        for S in (1, 2, 3, 8, 64):
            chunk, ranges = plan(units, S, AutoSplit(round_down=True))
            aim = max(1, -(-sum(units) // max(1, -(-S * len(units) // SPLIT_HEADROOM))))
            assert chunk >= -(-max(units) // S)                                   # S chunks cover
            assert sum(b > a for a, b in ranges[units.index(max(units))]) <= max(1, max(units) // aim)


@pytest.mark.parametrize("splits", [5, "auto"])
def test_decode_splits_follow_the_model_on_mixed_lengths(tmp_path, splits):
    """1 long sequence, many short ones and empty ones: exact outputs, and every split's partial
    covers exactly the rows the model assigns (lse_part recomputed in fp64)."""
    value = f'"{splits}"' if splits == "auto" else splits
    art = build_kernel(tmp_path, "decode", f'dtype = "f32"\nhead_dim = 32\nnum_heads = 4\nnum_kv_heads = 2\n'
                                           f'num_splits = {value}\nreturn_lse = true')
    spec = KernelSpec.from_dict(art.meta["spec"])
    lens = np.array([613, 0, 1, 3, 17, 5, 0, 40, 2], np.int32)
    B, S_max, Hk, d = len(lens), 640, 2, 32
    rng = np.random.default_rng(5)
    inputs = {"q": rng.standard_normal((B, 4, d)).astype(np.float32),
              "k_cache": rng.standard_normal((B, S_max, Hk, d)).astype(np.float32),
              "v_cache": rng.standard_normal((B, S_max, Hk, d)).astype(np.float32), "seq_lens": lens}
    dims, buf = run_keeping_workspace(art, inputs)
    ref = FAMILIES["decode"].reference(spec, inputs)
    np.testing.assert_allclose(buf["o"], ref["o"], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(buf["lse"], ref["lse"], rtol=2e-5, atol=2e-5)

    cfg = art.meta["targets"]["sm_80"]["config"]
    per_iter = cfg["num_warps"] * (32 // cfg["lanes_per_row"]) * cfg["kv_unroll"]
    S = dims["num_splits"]
    assert S == (5 if splits == 5 else min(64, -(-SPLIT_HEADROOM * 108 // (Hk * B))))  # 1 CTA/SM: unverified
    units = [-(-int(n) // per_iter) for n in lens]
    chunk, ranges = plan(units, S, auto_split(spec))
    busy = 0
    for bi, n in enumerate(lens):
        for h in range(4):
            for z, (a, e) in enumerate(ranges[bi]):
                rows = np.arange(a * per_iter, min(e * per_iter, n))
                want = partial_lse(inputs["q"][bi, h], inputs["k_cache"][bi, :, h // 2], spec.softmax_scale, rows)
                got = float(buf["lse_part"][bi, h, z])
                assert (got == -np.inf) if want == -np.inf else abs(got - want) < 1e-4, (bi, h, z, got, want)
                busy += len(rows) > 0
    even = sum(min(S, u) for u in units) * 4        # busy (head, split) CTAs under even shares
    assert busy <= even


def test_varlen_splits_follow_the_model_on_mixed_lengths(tmp_path):
    """Decode-like varlen rows (one query each) over 1 long, many short and empty sequences."""
    art = build_kernel(tmp_path, "varlen", 'dtype = "f16"\nhead_dim = 32\nnum_heads = 4\nnum_kv_heads = 2\n'
                                           'kv_layout = "contiguous"\ncausal = false\nnum_splits = 4\n'
                                           'return_lse = true')
    spec = KernelSpec.from_dict(art.meta["spec"])
    lens = np.array([301, 0, 1, 7, 64, 0, 33, 2], np.int32)
    B, S_max, Hk, d = len(lens), 320, 2, 32
    rng = np.random.default_rng(9)
    f16 = lambda shape: rng.standard_normal(shape).astype(np.float16).astype(np.float32)
    inputs = {"q": f16((B, 4, d)), "cu_seqlens_q": np.arange(B + 1, dtype=np.int32), "seq_lens": lens,
              "k_cache": f16((B, S_max, Hk, d)), "v_cache": f16((B, S_max, Hk, d))}
    dims, buf = run_keeping_workspace(art, inputs)
    ref = FAMILIES["varlen"].reference(spec, inputs)
    np.testing.assert_allclose(buf["o"].astype(np.float64), ref["o"], rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(buf["lse"], ref["lse"], rtol=1e-2, atol=1e-2)
    bn = art.meta["targets"]["sm_80"]["config"]["block_n"]
    units = [-(-int(n) // bn) for n in lens]
    chunk, ranges = plan(units, 4, None)
    for bi, n in enumerate(lens):
        for h in range(4):
            for z, (a, e) in enumerate(ranges[bi]):
                rows = np.arange(a * bn, min(e * bn, n))
                want = partial_lse(inputs["q"][bi, h], inputs["k_cache"][bi, :, h // 2], spec.softmax_scale, rows)
                got = float(buf["lse_part"][bi, h, z])
                assert (got == -np.inf) if want == -np.inf else abs(got - want) < 2e-2, (bi, h, z, got, want)


def test_mla_splits_follow_the_model_with_the_mla_rule(tmp_path):
    """MLA's "auto" kernel at num_splits 4 over eight 300-key sequences: the total term's chunk
    (8 of 10 tiles) would split every row 8 + 2; MLA's round_down keeps each row whole, and
    every split's partial lse covers exactly the rows the model gives it (fp64). The idle split
    indices leave their o_part unwritten (NaN planted there stays, and the reduce, which never
    reads a split of lse -inf, still gives the exact output)."""
    art = build_kernel(tmp_path, "mla", 'dtype = "bf16"\nnum_heads = 16\nkv_lora_rank = 128\n'
                                        'qk_rope_head_dim = 16\nsoftmax_scale = 0.1\n'
                                        'kv_layout = "contiguous"\nnum_splits = "auto"\nreturn_lse = true')
    spec = KernelSpec.from_dict(art.meta["spec"])
    B, L = 8, 300
    inputs = uniform_mla_inputs(B, 16, 144, 320, L)
    dims = infer_dims(art.meta, inputs, {"num_splits": 4}, target="sm_80")
    buf = prepare_buffers(art.meta, inputs, dims)
    buf["o_part"].fill(np.nan)
    launch = _emu_launcher(art.ptx("sm_80"), art.meta)
    for k in art.meta["targets"]["sm_80"]["kernels"]:
        launch(k, buf, dims)
    ref = FAMILIES["mla"].reference(spec, inputs)
    np.testing.assert_allclose(buf["lse"], ref["lse"], rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(from_device(buf["o"], "bf16").astype(np.float64), ref["o"], rtol=2e-2, atol=2e-2)
    assert np.isfinite(buf["o_part"][:, :, 0]).all() and np.isnan(buf["o_part"][:, :, 1:]).all()
    cfg = art.meta["targets"]["sm_80"]["config"]
    bn, bm = cfg["block_n"], cfg["block_m"]
    units = [-(-L // bn)] * B
    rows, work = B * 16 // bm + B, [u * -(-16 // bm) for u in units]   # grid.x: the launched query tiles
    chunk, ranges = plan(units, 4, auto_split(spec), work, rows)
    assert chunk == units[0] and plan(units, 4, AutoSplit(), work, rows)[0] == 8
    for bi in range(B):
        for h in range(16):
            for z, (a, e) in enumerate(ranges[bi]):
                keys = np.arange(a * bn, min(e * bn, L))
                want = partial_lse(inputs["q"][bi, h], inputs["kv_cache"][bi], spec.softmax_scale, keys)
                got = float(buf["lse_part"][bi, h, z])
                assert (got == -np.inf) if want == -np.inf else abs(got - want) < 2e-2, (bi, h, z, got, want)


def check_whole_rows(buf: dict, ranges: list, want_lse) -> int:
    """The sm_90a packed tile's split contract, row by row (rows of [rows, H, S] from
    plan's `ranges` per row): where split 0 covers the row, lse_part[.., 0] is its log2 lse
    (fp64 `want_lse(row, head)`), split 1 holds the +inf mark, splits past it and o_part stay
    as planted (NaN); elsewhere every split has its partial. Returns the whole rows."""
    whole = 0
    for r, splits in enumerate(ranges):
        lse = buf["lse_part"][r]
        if all(e <= a for a, e in splits[1:]):
            whole += 1
            assert (lse[:, 1] == np.inf).all() and np.isnan(lse[:, 2:]).all(), r
            assert np.isnan(buf["o_part"][r]).all(), r
            for h in range(lse.shape[0]):
                want = want_lse(r, h)
                assert (lse[h, 0] == -np.inf) if want == -np.inf else abs(lse[h, 0] - want) < 2e-2, (r, h)
        else:
            assert not np.isnan(lse).any() and not (lse == np.inf).any(), r
    return whole


def test_sm90a_varlen_finishes_whole_sequences_in_split_0(tmp_path):
    """varlen's wgmma tile (sm_90a) at 4 splits over decode-like rows of 1 long, many short
    and empty sequences, the workspace and lse planted with NaN: split 0 of a sequence it
    covers whole stores the final o itself and marks split 1 (the reduce then writes only its
    lse); idle split indices leave at once; the long sequence is merged as before. Exact."""
    art = build_kernel(tmp_path, "varlen", 'dtype = "f16"\nhead_dim = 64\nnum_heads = 8\nnum_kv_heads = 2\n'
                                           'kv_layout = "contiguous"\ncausal = false\nnum_splits = 4\n'
                                           'return_lse = true', targets=("sm_90a",))
    cfg = art.meta["targets"]["sm_90a"]["config"]
    assert cfg["path"].startswith("wgmma")
    spec = KernelSpec.from_dict(art.meta["spec"])
    lens = np.array([613, 0, 1, 3, 17, 5, 0, 40, 2], np.int32)
    B, S_max, Hk, d = len(lens), 640, 2, 64
    rng = np.random.default_rng(11)
    f16 = lambda shape: rng.standard_normal(shape).astype(np.float16).astype(np.float32)
    inputs = {"q": f16((B, 8, d)), "cu_seqlens_q": np.arange(B + 1, dtype=np.int32), "seq_lens": lens,
              "k_cache": f16((B, S_max, Hk, d)), "v_cache": f16((B, S_max, Hk, d))}
    _, buf = run_keeping_workspace(art, inputs, "sm_90a", poison=("o_part", "lse_part", "lse"))
    ref = FAMILIES["varlen"].reference(spec, inputs)
    np.testing.assert_allclose(from_device(buf["o"], "f16").astype(np.float64), ref["o"], rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(buf["lse"], ref["lse"], rtol=1e-2, atol=1e-2)
    _, ranges = plan([-(-int(n) // cfg["block_n"]) for n in lens], 4, None)
    whole = check_whole_rows(buf, ranges, lambda r, h: partial_lse(
        inputs["q"][r, h], inputs["k_cache"][r, :, h // 4], spec.softmax_scale, np.arange(lens[r])))
    assert 0 < whole < B


def test_sm90a_mla_whole_rows_write_no_partials(tmp_path):
    """MLA on the sm_90a latent tile (DeepSeek's 512 + 64, 64 heads), "auto" at num_splits 2
    over three 100-key sequences: round_down keeps every row whole, so no o_part is written at
    all, split 0's lse_part holds each row's log2 lse and split 1 the mark. Exact outputs."""
    art = build_kernel(tmp_path, "mla", 'dtype = "bf16"\nnum_heads = 64\nkv_lora_rank = 512\n'
                                        'qk_rope_head_dim = 64\nsoftmax_scale = 0.05\n'
                                        'kv_layout = "contiguous"\nnum_splits = "auto"\nreturn_lse = true',
                       targets=("sm_90a",))
    assert art.meta["targets"]["sm_90a"]["config"]["path"].startswith("wgmma")
    spec = KernelSpec.from_dict(art.meta["spec"])
    B, L = 3, 100
    inputs = uniform_mla_inputs(B, 64, 576, 128, L)
    _, buf = run_keeping_workspace(art, inputs, "sm_90a", {"num_splits": 2}, poison=("o_part", "lse_part", "lse"))
    ref = FAMILIES["mla"].reference(spec, inputs)
    np.testing.assert_allclose(buf["lse"], ref["lse"], rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(from_device(buf["o"], "bf16").astype(np.float64), ref["o"], rtol=2e-2, atol=2e-2)
    whole = check_whole_rows(buf, [[(0, 1), (1, 1)]] * B, lambda r, h: partial_lse(
        inputs["q"][r, h], inputs["kv_cache"][r], spec.softmax_scale, np.arange(L)))
    assert whole == B
