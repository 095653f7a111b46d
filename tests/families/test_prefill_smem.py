"""Prefill's shared-memory layouts (tiles.py), padded and swizzled (tile key smem_layout),
checked in the emulator's traffic counters -- every ldmatrix, cp.async and shared load/store of
the tensor-core kernel is free of bank conflicts in both -- and numerically. (Rows of
a multiple of 128 bytes with neither would conflict 8-way: tests/emu/test_traffic.py, pitch 128.)"""

import pytest

from ptxc.kernels.families.prefill import configure
from ptxc.kernels import load_text
from ptxc.targets import TARGETS
from families.prefill_cases import SHAPES, check, run, spec_text

pytest.importorskip("ptxc.emu", reason="the emulator counts bank conflicts")

SWIZZLED = {"smem_layout": "swizzled"}
# (dtype, head_dim, tile, swizzled): the d128 and d64 default tiles of sm_80 in both layouts,
# a swizzled 4-warp d128 tile, and the 2-warp d128 test tile (padded).
CASES = [
    ("f16", 128, None, False),
    ("f16", 128, SWIZZLED, True),
    ("bf16", 64, SWIZZLED, True),
    ("f16", 128, {"block_m": 64, "block_n": 32, "num_stages": 2, **SWIZZLED}, True),
    ("f16", 128, {"block_m": 32, "block_n": 16, "num_stages": 2}, False),
]


@pytest.mark.parametrize("dtype,head_dim,tile,swizzled", CASES)
def test_tensor_core_prefill_smem_is_conflict_free(dtype, head_dim, tile, swizzled):
    text = spec_text(dtype, head_dim, "gqa4", causal=True, tile=tile)
    [spec] = load_text(text)
    cfg = configure(spec, TARGETS["sm_80"])
    assert cfg.q_geom.swizzled == cfg.kv_geom.swizzled == cfg.o_geom.swizzled == swizzled
    assert cfg.q_geom.stride == head_dim * 2 + (0 if swizzled else 16)
    _, stats, _, _ = run(text, 19, 70, batch=1, traffic=True)
    shared = stats.traffic.shared_accesses
    assert {a.kind for a in shared} >= {"ldmatrix", "cp.async", "st.shared", "ld.shared"}
    conflicted = [(a.kind, a.text, a.wavefronts, a.ideal_wavefronts) for a in shared if a.bank_conflicts]
    assert not conflicted, conflicted
    check(text, [(19, 70)], batch=1)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_swizzled_d128_numerics(dtype):
    """A 4-warp d128 tile (swizzled, 8-row copy passes) against the fp64 reference."""
    tile = {"block_m": 64, "block_n": 32, "num_stages": 2, **SWIZZLED}
    check(spec_text(dtype, 128, "mqa", True, tile=tile), SHAPES, batch=1)


def test_swizzle_saves_the_padding():
    """sm_80 d128 default: 128 x 64, one K/V stage, two CTAs per SM either way; padded rows
    (272 bytes) take 68 KiB, swizzled ones 32 + 2 x 16 = 64 KiB. (Without return_lse: with it
    the two-CTA tile spilled on sm_80 and is not taken, kernels/register_floor.py.)"""
    for tile, swizzled, kib in ((None, False, 68), (SWIZZLED, True, 64)):
        text = spec_text("f16", 128, "gqa4", causal=True, tile=tile).replace("return_lse = true\n", "")
        [spec] = load_text(text)
        cfg = configure(spec, TARGETS["sm_80"])
        assert (cfg.block_m, cfg.block_n, cfg.num_stages, cfg.min_ctas_per_sm) == (128, 64, 1, 2)
        assert cfg.q_geom.swizzled == swizzled and cfg.smem_bytes == kib * 1024


def test_swizzle_chosen_when_only_it_fits():
    """sm_86 allows 99 KiB per CTA; a 128 x 128 single-stage d128 tile takes 102 KiB padded and
    96 KiB swizzled, so the swizzled layout is chosen rather than a smaller tile; asking for
    padded rows with every tile key given is an error that names the budget."""
    from ptxc.errors import SpecError
    tile = {"block_m": 128, "block_n": 128, "num_stages": 1}
    [spec] = load_text(spec_text("f16", 128, "mqa", True, tile=tile, targets=("sm_86",)))
    cfg = configure(spec, TARGETS["sm_86"])
    assert cfg.q_geom.swizzled and (cfg.block_m, cfg.block_n) == (128, 128)
    assert cfg.smem_bytes == 96 * 1024
    with pytest.raises(SpecError, match="104448 bytes of shared memory"):
        load_text(spec_text("f16", 128, "mqa", True, tile={**tile, "smem_layout": "padded"},
                            targets=("sm_86",)))


@pytest.mark.parametrize("dtype,head_dim,tile,message", [
    ("f32", 64, {"block_m": 16, "block_n": 16}, "needs the tensor-core path"),
    ("f16", 96, None, "head_dim a multiple of 64"),
    ("f16", 128, {"block_m": 32, "block_n": 16}, "copy passes of a multiple of 8 rows"),
])
def test_swizzle_errors_name_the_key(dtype, head_dim, tile, message):
    from ptxc.errors import SpecError
    with pytest.raises(SpecError, match=message) as e:
        load_text(spec_text(dtype, head_dim, tile={**(tile or {}), **SWIZZLED}))
    assert e.value.key == "tile.smem_layout"
