"""Prefill with 32 query rows per warp (tile key warp_rows = 32): two m16 tiles per warp share
every K and V ldmatrix fragment. Numerics against the fp64 reference on odd shapes (the variant
keys that only touch the mask or the denominator included), conflict-free shared memory, the
configuration rules and the errors."""

import pytest

from ptxc.errors import SpecError
from ptxc.kernels.families.prefill import configure
from ptxc.kernels import load_text
from ptxc.targets import TARGETS
from families.prefill_cases import SHAPES, check, run, spec_text

pytest.importorskip("ptxc.emu", reason="the emulator is needed for numerical checks")
W32 = {"warp_rows": 32}
SMALL = {"block_m": 64, "block_n": 16, "num_stages": 2, **W32}      # 2 warps x 32 rows


@pytest.mark.parametrize("dtype,head_dim,heads,causal", [
    ("f16", 64, "gqa4", True), ("bf16", 64, "mha", False), ("f16", 128, "mqa", False),
    ("bf16", 128, "gqa4", True), ("f16", 72, "mqa", True),
])
def test_numerics_small_tile(dtype, head_dim, heads, causal):
    check(spec_text(dtype, head_dim, heads, causal, tile=SMALL), SHAPES)


def test_default_d128_tile_numerics_and_config():
    """sm_80 d128 with warp_rows 32: 128 x 32 with 4 warps (block_n 32 keeps two m16 tiles
    under 255 registers), two K/V stages in 68 KiB, two CTAs per SM."""
    text = spec_text("f16", 128, "gqa4", causal=True, tile=W32)
    [spec] = load_text(text)
    cfg = configure(spec, TARGETS["sm_80"])
    assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages) == (128, 32, 4, 2)
    assert cfg.min_ctas_per_sm == 2 and cfg.warp_rows == 32
    _, stats, _, _ = run(text, 150, 201, batch=1, traffic=True)
    conflicted = [(a.kind, a.text) for a in stats.traffic.shared_accesses if a.bank_conflicts]
    assert not conflicted, conflicted
    check(text, [(150, 201)], batch=1)


def test_window_sinks_and_lse():
    """The sliding window (mask) and the sinks (denominator) work on both m16 tiles."""
    text = spec_text("bf16", 64, "gqa4", True, tile=SMALL).replace(
        "causal = true\n", "causal = true\nsliding_window = 37\nattention_sinks = true\n")
    check(text, [(45, 113), (1, 17)], batch=1)


@pytest.mark.parametrize("dtype,extra,tile,message", [
    ("f32", "", W32, "needs the tensor-core path"),
    ("f16", "logits_soft_cap = 30.0\n", W32, "score transforms"),
    ("f16", "", {"block_m": 64, "num_warps": 4, **W32}, "each warp owns 32 query rows"),
    ("f16", "", {"block_n": 64, "head_dim": 128, **W32}, "use block_n = 32 or warp_rows = 16"),
    ("bf16", "", {"head_dim": 256, **W32}, "spill above head_dim 152"),
    ("f16", "", {"head_dim": 160, **W32}, "spill above head_dim 152"),
])
def test_errors(dtype, extra, tile, message):
    tile = dict(tile)
    d = tile.pop("head_dim", 64)
    text = spec_text(dtype, d, "mha", False, tile=tile).replace("causal = false\n",
                                                                "causal = false\n" + extra)
    with pytest.raises(SpecError, match=message) as e:
        load_text(text)
    assert e.value.key in ("tile.warp_rows", "tile.block_m", "tile.block_n")


@pytest.mark.parametrize("dtype,head_dim,causal,target", [
    ("f16", 128, True, "sm_80"), ("f16", 128, True, "sm_90"), ("f16", 64, True, "sm_86"),
    ("bf16", 64, False, "sm_90"),     # ptxas capped this one at 168 registers without .minnctapersm 1
])
def test_assembles_without_spills(toolchain, dtype, head_dim, causal, target):
    """ptxas: 4 warps x 32 rows (with LSE) stay within 255 registers with no spills; on sm_80
    two 128-thread CTAs per SM (.minnctapersm 2), elsewhere .minnctapersm 1."""
    from ptxc.pipeline.compiler import lower
    from ptxc.pipeline.ptxas import assemble
    from ptxc.targets import occupancy
    [spec] = load_text(spec_text(dtype, head_dim, "gqa4", causal, tile=W32, targets=(target,)))
    ptx, launches, _, _ = lower(spec, target)
    _, res, _ = assemble(ptx, target, toolchain, "w32")
    [r] = res.values()
    assert r.spill_stores == r.spill_loads == 0 and r.registers <= 255
    if target == "sm_80":
        assert ".minnctapersm 2" in ptx
        occ = occupancy(TARGETS[target], 128, r.registers, launches[0]["dynamic_smem_bytes"])
        assert occ["ctas_per_sm"] == 2
    else:
        assert ".minnctapersm 1" in ptx


def test_tune_candidates_keep_the_spec_rows_per_warp():
    """`ptxc tune` varies the tile shape only; a spec's warp_rows stays in every candidate (the
    tuned tables record and apply the shape keys alone; a shape that fits only swizzled gets the
    swizzled layout from the same rule when the table is applied)."""
    from ptxc.gpu.tune import candidate_tiles
    [spec] = load_text(spec_text("f16", 128, "gqa4", True, tile=W32))
    cands = candidate_tiles(spec, "sm_80")
    assert len(cands) > 1 and all(c["resolved"].get("warp_rows") == 32 for c in cands)
    [plain] = load_text(spec_text("f16", 128, "gqa4", True))
    assert not any("warp_rows" in c["resolved"] for c in candidate_tiles(plain, "sm_80"))
