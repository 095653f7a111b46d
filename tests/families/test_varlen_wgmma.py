"""varlen on wgmma for sm_90a (ptxc/kernels/bodies/varlen_wgmma.py): numerical checks of the real
sm_90a PTX in the emulator against the fp64 reference (FA2 tolerance rule) on explicit ragged
batches (sequence lengths 0 / 1 / 17 / 113, q_len > 1 chunks, pages crossed, rows past L) and
on make_inputs' mixed batches, causal and not, GQA 4 / 8 / MQA, split-KV with empty splits, LSE
and the variants; the dispatch rule (which specs take wgmma on sm_90a, which keep mma.sync);
ptxas sm_90a with 0 spills and SASS evidence (HGMMA, no LDSM, no local memory). These pin
tile.kv_loads = "cp_async" (the per-thread loads; TMA, the default: test_varlen_tma.py). The default
subset keeps the emulated shapes small; `-m slow` runs the sweep."""

import numpy as np
import pytest

from conftest import assert_pass, build_kernel, built_sass
from ptxc.kernels import FAMILIES
from ptxc import reference as ref
from ptxc.runtime.launch_test import check_artifact
from ptxc.kernels import load_text
from ptxc.spec.model import KernelSpec
from ptxc.targets import TARGETS
from families.test_varlen import GQA, body

pytest.importorskip("ptxc.emu", reason="the emulator is needed for numerical checks")
VARLEN = FAMILIES["varlen"]
SM90A = ("sm_90a",)
SLOW = pytest.mark.slow
# (q_len, L) per sequence: L = 0 (with and without queries), a one-token sequence, a whole
# 17-token prefill, a 5-token chunk and a decode at L = 113 (pages crossed, a tail tile),
# a 4-token verification, q_len > L (rows that see nothing), a 9-token chunk at L = 17
LENGTHS = [(0, 0), (1, 1), (17, 17), (5, 113), (1, 113), (4, 40), (2, 0), (3, 2), (9, 17), (0, 50)]


CP_ASYNC = 'kv_loads = "cp_async"'    # these pin the per-thread loads (TMA: test_varlen_tma.py)


def build(tmp_path, tile="", **case):
    art = build_kernel(tmp_path, "varlen", body(**case), tile="\n".join(x for x in (tile, CP_ASYNC) if x),
                       targets=SM90A)
    target = art.meta["targets"]["sm_90a"]
    ptx = (art.path / target["ptx"]).read_text()
    assert target["config"]["path"] == "wgmma.m64nNk16"
    assert "wgmma.mma_async" in ptx and "ldmatrix" not in ptx and ".target sm_90a" in ptx
    assert "kv_loads" not in target["config"] and "cp.async.bulk" not in ptx
    return art, KernelSpec.from_dict(art.meta["spec"])


def ragged_inputs(spec, layout: str, lengths, seed: int) -> dict:
    """make_inputs' tensors with the given (q_len, L) per sequence; a paged cache gets every
    sequence's pages shuffled over the pool (garbage ids past each sequence's pages)."""
    rng = np.random.default_rng(seed)
    B, S = len(lengths), 120
    paged = layout != "contiguous"
    ps = int(layout[4:]) if paged else 0
    P = -(-S // ps) if paged else 0
    dims = {"batch": B, "max_pages_per_seq": P, "num_pages": B * P + 3} if paged else \
        {"batch": B, "max_seq_len": S}
    inputs = VARLEN.make_inputs(spec, dims, rng)
    q_lens = np.array([q for q, _ in lengths], dtype=np.int32)
    inputs["cu_seqlens_q"] = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    inputs["seq_lens"] = np.array([L for _, L in lengths], dtype=np.int32)
    inputs["q"] = ref.round_to(rng.standard_normal((int(q_lens.sum()), spec.num_heads, spec.head_dim)),
                               spec.dtype).astype(np.float32)
    if paged:
        table = rng.permutation(B * P + 3)[:B * P].reshape(B, P).astype(np.int32)
        for b, (_, L) in enumerate(lengths):
            table[b, -(-L // ps):] = -1 if b % 2 else B * P + 10
        inputs["block_table"] = table
    return inputs


def check_ragged(art, spec, layout, lengths=LENGTHS, seed=0):
    inputs = ragged_inputs(spec, layout, lengths, seed)
    out = art.run(inputs, target="sm_90a")
    want = VARLEN.reference(spec, inputs)
    naive = VARLEN.reference(spec, inputs, dtype=spec.dtype)
    for t in want:
        err, tol = ref.max_abs_error(out[t], want[t]), ref.tolerance(naive[t], want[t])
        assert err <= tol, f"{t}: max error {err:.3e} > tolerance {tol:.3e}"
    return out, inputs


@pytest.mark.parametrize("case,tile", [
    (dict(dtype="f16", head_dim=64, gqa="gqa4", causal=True, layout="page16"), "block_n = 32"),
    (dict(dtype="bf16", head_dim=128, gqa="gqa8", causal=False, layout="page32", splits=4), ""),
    (dict(dtype="f16", head_dim=64, gqa="gqa8", causal=True, layout="contiguous", splits=3),
     "block_n = 32"),
    *(pytest.param(dict(dtype=dt, head_dim=d, gqa=g, causal=c, layout=lay, splits=s), "",
                   marks=SLOW)
      for dt in ("f16", "bf16") for d in (64, 128, 256) for g in ("gqa4", "gqa8")
      for c in (True, False) for lay, s in (("page16", 1), ("contiguous", "auto"))),
], ids=lambda x: "-".join(map(str, x.values())) if isinstance(x, dict) else x.replace(" ", ""))
def test_ragged_batch(tmp_path, case, tile):
    """Lengths 0 / 1 / 17 / 113, chunks and verifications, q_len > L, pages crossed; with
    splits, the one-tile sequences leave splits empty (their partials merge as nothing)."""
    art, spec = build(tmp_path, tile, **case)
    out, inputs = check_ragged(art, spec, case["layout"])
    cu = inputs["cu_seqlens_q"]
    if spec.opt("causal"):   # sequence 7: q_len 3 > L 2, its first token (position -1) sees nothing
        assert np.all(out["o"][cu[7]] == 0)
    assert np.all(out["o"][cu[6]:cu[7]] == 0)                 # L = 0
    if "lse" in out:
        assert np.all(np.isneginf(out["lse"][cu[6]:cu[7]]))


@pytest.mark.parametrize("case,shapes", [
    (dict(dtype="f16", head_dim=64, gqa="gqa4", causal=True, layout="page16", splits=1), {}),
    (dict(dtype="bf16", head_dim=256, gqa="mqa", causal=False, layout="page1", splits="auto"),
     {"max_pages_per_seq": 70, "num_pages": 8 * 70 + 3}),
    pytest.param(dict(dtype="bf16", head_dim=128, gqa="mha", causal=True, layout="contiguous",
                      splits=2), {}, marks=SLOW),
], ids=lambda c: "-".join(str(v) for v in c.values()) if "dtype" in c else "")
def test_mixed_batch(tmp_path, case, shapes):
    """make_inputs' serving mix (decode, prefill, chunk, empty, verify, q_len > L, L = 0, L at
    the capacity) through the launch-test harness; head_dim 256 copies in two column groups."""
    art, _ = build(tmp_path, **case)
    assert_pass(check_artifact(art, backend="emu", shapes={"batch": 8, **shapes}, seed=3))


@pytest.mark.parametrize("extra", [
    "sliding_window = 21", "logits_soft_cap = 2.0",
    pytest.param("attention_sinks = true", marks=SLOW), pytest.param("alibi = true", marks=SLOW)])
def test_variants(tmp_path, extra):
    """The variant seam (MmaMath's transform / mask / finish_rows) on the wgmma fragments."""
    case = dict(dtype="f16", head_dim=64, gqa="gqa4", causal=True, layout="page16", splits=3)
    art = build_kernel(tmp_path, "varlen", body(**case) + "\n" + extra,
                       tile="block_n = 32\n" + CP_ASYNC, targets=SM90A)
    assert art.meta["targets"]["sm_90a"]["config"]["path"] == "wgmma.m64nNk16"
    check_ragged(art, KernelSpec.from_dict(art.meta["spec"]), "page16")


def test_two_warpgroups(tmp_path):
    """A given block_m of 128: two warpgroups over the packed rows (256 threads)."""
    art, spec = build(tmp_path, "block_m = 128\nnum_warps = 8", dtype="bf16", head_dim=128,
                      gqa="gqa4", causal=True, layout="page16")
    assert art.meta["targets"]["sm_90a"]["kernels"][0]["block"] == [256, 1, 1]
    check_ragged(art, spec, "page16", seed=1)


FP8 = [   # (case, kv_dtype, kv_scale)
    (dict(dtype="f16", head_dim=64, gqa="gqa4", causal=True, layout="page16", splits=1), "e4m3", "tensor"),
    (dict(dtype="bf16", head_dim=128, gqa="gqa8", causal=False, layout="contiguous", splits=3), "e5m2", "device"),
    (dict(dtype="bf16", head_dim=256, gqa="mqa", causal=True, layout="page16", splits="auto"), "e4m3", "head"),
    *(pytest.param(dict(dtype=dt, head_dim=d, gqa="gqa4", causal=c, layout=lay, splits=s), kd, sc, marks=SLOW)
      for dt in ("f16", "bf16") for d in (64, 128, 256) for c in (True, False)
      for lay, s in (("page1", 1), ("contiguous", "auto")) for kd, sc in (("e4m3", "head"), ("e5m2", "tensor"))),
]


@pytest.mark.parametrize("case,kv,scale", FP8, ids=lambda x: "-".join(map(str, x.values())) if isinstance(x, dict) else x)
def test_fp8_caches_on_wgmma(tmp_path, case, kv, scale):
    """FP8 caches on the wgmma body: the bytes land by cp.async in staging buffers and every
    thread dequantises its chunks into the swizzled K and V tiles at the top of each iteration
    (kv_fp8_stage.SwizzledFP8Staging); k_scale joins the softmax scale, v_scale the 1/l. The
    ragged batch of test_ragged_batch against fp64 over the dequantised caches."""
    art = build_kernel(tmp_path, "varlen", body(**case) + f'\nkv_dtype = "{kv}"\nkv_scale = "{scale}"',
                       targets=SM90A)
    config = art.meta["targets"]["sm_90a"]["config"]
    assert config["path"] == "wgmma.m64nNk16" and "kv_loads" not in config
    assert config["fp8_staging_bytes"] == config["block_n"] * case["head_dim"]
    ptx = (art.path / art.meta["targets"]["sm_90a"]["ptx"]).read_text()
    assert "wgmma.mma_async" in ptx and "cp.async.bulk" not in ptx and "ldmatrix" not in ptx
    out, inputs = check_ragged(art, KernelSpec.from_dict(art.meta["spec"]), case["layout"])
    assert np.all(out["o"][inputs["cu_seqlens_q"][6]:inputs["cu_seqlens_q"][7]] == 0)   # L = 0


# ---- dispatch and configuration ------------------------------------------------------------
def _config(text: str, target: str) -> dict:
    [spec] = load_text(f'[[kernel]]\nname = "k"\nfamily = "varlen"\ntargets = ["{target}"]\n{text}')
    return VARLEN.resolve_tile(spec, TARGETS[target])


@pytest.mark.parametrize("extra,target,path", [
    (body(head_dim=64), "sm_90a", "wgmma.m64nNk16"),
    (body(dtype="bf16", head_dim=256, layout="contiguous"), "sm_90a", "wgmma.m64nNk16"),
    (body(head_dim=128), "sm_90", "mma.m16n8k16"),
    (body(head_dim=96), "sm_90a", "mma.m16n8k16"),                         # other head dims
    (body(head_dim=128) + '\nkv_dtype = "e4m3"\nkv_scale = "tensor"', "sm_90a", "wgmma.m64nNk16"),
    (body(head_dim=128) + '\nkv_dtype = "e5m2"\nkv_scale = "head"', "sm_90", "mma.m16n8k16"),
    (body(head_dim=128) + '\ncustom_mask = "tree"', "sm_90a", "wgmma.m64nNk16"),
    (body(head_dim=128, causal=False) + '\ncustom_mask = "packed"', "sm_90a", "mma.m16n8k16"),
    (body(head_dim=128) + "\nhead_dim_v = 64", "sm_90a", "wgmma.m64nNk16"),         # TMA loads
    (body(head_dim=128) + '\nhead_dim_v = 64\nkv_dtype = "e4m3"', "sm_90a", "mma.m16n8k16"),   # cp.async
    (body(head_dim=192, layout="contiguous"), "sm_90a", "wgmma.m64nNk16"),
    (body(head_dim=64) + "\n[kernel.tile]\nblock_m = 32", "sm_90a", "mma.m16n8k16"),
])
def test_dispatch(extra, target, path):
    assert _config(extra, target)["path"] == path


def test_config_records_the_swizzle_and_keeps_the_grid():
    """Same tile as mma.sync (so grid.x and the split rule are target-independent), swizzled
    tiles without padding: smem_swizzle instead of smem_row_stride."""
    text = body(head_dim=128, gqa="gqa4", splits="auto")
    wg, mma = _config(text + "\n[kernel.tile]\n" + CP_ASYNC, "sm_90a"), _config(text, "sm_90")
    assert {k: wg[k] for k in ("block_m", "block_n", "num_warps", "num_stages", "gqa_packing")} == \
        {k: mma[k] for k in ("block_m", "block_n", "num_warps", "num_stages", "gqa_packing")}
    assert wg["smem_swizzle"] == 128 and "smem_row_stride" not in wg
    assert wg["smem_bytes"] == 64 * 256 + 4 * 64 * 256 < mma["smem_bytes"]


# ---- ptxas and SASS ----------------------------------------------------------------------------
def test_ptxas_sm90a_zero_spills_and_hgmma(tmp_path, toolchain):
    """Every head dim x dtype x causal x layout on sm_90a (f16/bf16 give the same code shape,
    so the default run takes f16 and one bf16): 0 spills, HGMMA in the loop, no LDSM."""
    from ptxc.pipeline.build import run_build
    kernels = []
    for d in (64, 128, 256):
        for causal in (True, False):
            for lay, splits in (("page16", "auto"), ("contiguous", 1)):
                heads, kv = GQA["gqa4"]
                kernels.append(
                    f'[[kernel]]\nname = "v_d{d}_{int(causal)}_{lay}"\nfamily = "varlen"\n'
                    f'targets = ["sm_90a"]\n{body(dtype="f16" if d != 128 else "bf16", head_dim=d, causal=causal, layout=lay, splits=splits)}\n'
                    f'[kernel.tile]\n{CP_ASYNC}\n')
    (tmp_path / "k.toml").write_text("\n".join(kernels))
    summary = run_build([tmp_path / "k.toml"], tmp_path / "out", progress=False)
    assert summary["verified"] and not summary["problems"]
    assert len(summary["kernels"]) == 12
    for k in summary["kernels"]:
        assert k["targets"]["sm_90a"]["spill_bytes"] == 0, k["name"]
    meta, prof = built_sass(tmp_path / "out", "v_d128_1_page16", "sm_90a", "ptxc_v_d128_1_page16_split")
    assert meta["targets"]["sm_90a"]["config"]["path"] == "wgmma.m64nNk16"
    mix, loops = prof["mix"], prof["loops"]
    loop = loops["loops"][loops["main"]]
    assert mix["LDSM"] == mix["LDL"] == mix["STL"] == 0 and mix["HGMMA"] > 0
    # per warp and iteration (64 x 64 tile, d128): S = 8 HGMMA.64x64x16 (8 x 8), P·V = 4
    # HGMMA.64x128x16 (4 x 16), 4 row-sum HMMA.16816
    assert (loop["classes"]["tensor"], loop["mma_equivalents"]) == (8 + 4 + 4, 64 + 64 + 4)
    assert loop["instructions_per_mma_equivalent"] <= 3.5


def test_tile_inside_one_page(tmp_path):
    """page_size 64 >= block_n: a K/V tile sits inside one page (the lagged page id plus the
    tile's row offset in it), sliding window zero-filling keys before the first token's."""
    text = body(dtype="bf16", head_dim=64, gqa="gqa4", causal=True, layout="page16", splits=2)
    art = build_kernel(tmp_path, "varlen", text.replace("page_size = 16", "page_size = 64") +
                       "\nsliding_window = 40", tile=CP_ASYNC, targets=SM90A)
    assert art.meta["targets"]["sm_90a"]["config"]["path"] == "wgmma.m64nNk16"
    check_ragged(art, KernelSpec.from_dict(art.meta["spec"]), "page64", seed=2)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp8_conversion_into_swizzled_tiles_is_bank_conflict_free(tmp_path, head_dim):
    """Traffic counters of the FP8 wgmma kernel: the staging copies, their read-back and the
    converted stores into the swizzled slabs (staging_slot's row pairs: r % 8 even and odd
    swizzles fill the 8 bank groups) take no more shared-memory wavefronts than their bytes."""
    from conftest import shared_traffic
    art = build_kernel(tmp_path, "varlen", body(head_dim=head_dim, layout="contiguous") +
                       '\nkv_dtype = "e4m3"\nkv_scale = "tensor"', targets=SM90A)
    spec = KernelSpec.from_dict(art.meta["spec"])
    inputs = VARLEN.make_inputs(spec, {"batch": 3, "max_seq_len": 150}, np.random.default_rng(3))
    t = shared_traffic(art, "sm_90a", inputs)
    assert sum(a.requests for a in t.shared_accesses if a.kind == "cp.async") > 0
    assert t.bank_conflicts == 0, [a for a in t.shared_accesses if a.bank_conflicts][:4]
