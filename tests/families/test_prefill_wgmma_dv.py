"""sm_90a wgmma prefill with V's head narrower than K's (head_dim_v < head_dim: DeepSeek-V3/R1's
MLA prefill runs 192 / 128): K and V stages of their own sizes (kv_pipeline.StageRing), V's TMA
boxes and P·V's wgmma n over head_dim_v. Emulator numerics against fp64 on odd shapes (q_len > L,
tail tiles, several K/V tiles, GQA/MQA/MHA, causal and not, LSE, variants, the producer
warpgroup, per-thread cp.async loads), which (head_dim, head_dim_v) take the kernel and its
default tile, the one-line refusals, and ptxas with 0 spills for every pair."""

import pytest

from ptxc.errors import SpecError
from ptxc.kernels import load_text
from families.prefill_cases import check, compiled, spec_text

emu = pytest.importorskip("ptxc.emu", reason="the emulator is needed for numerical checks")
SM90A = ("sm_90a",)
SMALL = {"block_m": 64, "block_n": 32}             # one warpgroup, several K/V tiles
SLOW = pytest.mark.slow
PAIRS = [(128, 64), (192, 64), (192, 128), (192, 192), (256, 64), (256, 128), (256, 192)]


def dv_text(dtype, d, dv, heads, causal, tile=None, extra="", lse=True):
    text = spec_text(dtype, d, heads, causal, lse=lse, tile=tile, targets=SM90A)
    return text.replace(f"head_dim = {d}\n", f"head_dim = {d}\nhead_dim_v = {dv}\n{extra}")


def dv_check(dtype, d, dv, heads, causal, shapes, tile=SMALL, extra="", **kw):
    text = dv_text(dtype, d, dv, heads, causal, tile, extra)
    _, ptx, _, config = compiled(text, "sm_90a")
    assert config["path"] == "wgmma.m64nNk16" and f"wgmma.mma_async.sync.aligned.m64n{dv}k16" in ptx
    check(text, shapes, target="sm_90a", **kw)


def test_deepseek_default_tile():
    """192 / 128 at the default tile: 128 x 128, two stages of K (48 KiB) and V (32 KiB) after Q,
    TMA from a producer warpgroup (five mbarriers); q_len > L with a tail tile."""
    text = dv_text("bf16", 192, 128, "mha", True, {})
    c = compiled(text, "sm_90a")[3]
    assert (c["block_m"], c["block_n"], c["num_stages"], c["kv_loads"]) == (128, 128, 2, "tma")
    assert c["smem_bytes"] == 128 * 384 + 2 * (128 * 384 + 128 * 256) + 5 * 8 and c["warp_specialize"]
    check(text, [(150, 131)], batch=1, target="sm_90a")


@pytest.mark.parametrize("dtype,d,dv,heads,causal", [
    ("bf16", 192, 128, "gqa4", True), ("f16", 192, 128, "mqa", False), ("bf16", 256, 128, "mha", True),
    ("f16", 128, 64, "gqa4", False), ("bf16", 192, 192, "mqa", True),
    *(pytest.param("f16", d, dv, h, c, marks=SLOW) for d, dv in PAIRS for h in ("mha", "gqa4")
      for c in (False, True)),
])
def test_matrix(dtype, d, dv, heads, causal):
    dv_check(dtype, d, dv, heads, causal, [(1, 17), (17, 113), (113, 17)])


def test_producer_warpgroup_and_lse():
    """tile.warp_specialize: the producer's expect_tx counts a V tile's own bytes."""
    dv_check("bf16", 192, 128, "gqa4", True, [(130, 70)], tile={"warp_specialize": True}, batch=1)


@pytest.mark.parametrize("extra", ["sliding_window = 21\nattention_sinks = true\n",
                                   "logits_soft_cap = 2.0\n", "alibi = true\n"])
def test_variants(extra):
    dv_check("bf16", 192, 128, "gqa4", True, [(17, 113)], extra=extra)


@pytest.mark.parametrize("d,dv", [(128, 64), (256, 128)])
def test_per_thread_loads(d, dv):
    """kv_loads = "cp_async": V's rows copied by their own thread slots."""
    dv_check("bf16", d, dv, "gqa4", True, [(17, 113)], tile={**SMALL, "block_m": 128, "kv_loads": "cp_async"},
             batch=1)


def test_which_pairs_take_the_kernel_and_their_tiles():
    from ptxc.kernels.config.wgmma import configure, uses_wgmma
    from ptxc.targets import TARGETS
    tiles = {}
    for d, dv in PAIRS:
        [spec] = load_text(dv_text("bf16", d, dv, "gqa4", True))
        assert uses_wgmma(spec, TARGETS["sm_90a"]) and not uses_wgmma(spec, TARGETS["sm_90"])
        c = configure(spec, TARGETS["sm_90a"])
        assert c.smem_bytes <= TARGETS["sm_90a"].max_smem_per_cta
        tiles[(d, dv)] = c.block_n
    # 128 keys where O is at most 128 columns wide and the stages fit; else 64
    assert tiles == {(128, 64): 128, (192, 64): 128, (192, 128): 128, (192, 192): 64,
                     (256, 64): 128, (256, 128): 64, (256, 192): 64}
    [other] = load_text(dv_text("bf16", 192, 96, "gqa4", True))      # not whole 128-byte slabs
    assert not uses_wgmma(other, TARGETS["sm_90a"])
    assert compiled(dv_text("bf16", 192, 96, "gqa4", True), "sm_90a")[3]["path"] == "mma.m16n8k16"


def test_per_thread_loads_refused_where_rows_do_not_split_into_passes():
    with pytest.raises(SpecError) as e:
        load_text(dv_text("bf16", 192, 128, "gqa4", True, {"kv_loads": "cp_async"}))
    assert e.value.key == "tile.kv_loads" and 'use kv_loads = "tma"' in str(e.value)
    with pytest.raises(SpecError) as e:
        load_text(dv_text("bf16", 256, 128, "gqa4", True, {"block_m": 64, "kv_loads": "cp_async"}))
    assert e.value.key == "tile.block_m" and "needs block_m = 128" in str(e.value)


@pytest.mark.parametrize("ws", [False, True])
def test_ptxas_zero_spills_for_every_pair(toolchain, ws):
    from ptxc.pipeline.ptxas import assemble
    for d, dv in PAIRS:
        for causal in (False, True):
            text = dv_text("bf16", d, dv, "gqa4", causal, {"warp_specialize": True} if ws else {})
            _, res, _ = assemble(compiled(text, "sm_90a")[1], "sm_90a", toolchain, "p")
            [r] = res.values()
            assert r.spill_stores == r.spill_loads == r.stack == 0, (d, dv, causal, ws)
