"""tile.tma_store: O leaves the sm_90a and sm_100a TMA prefill kernels through shared memory by
TMA stores (MmaMath.store_by_tma; FlashAttention-3's epilogue) instead of the threads' row
stores. The math is the same, so the outputs must be bit-identical to the kernel without it,
on odd shapes (q_len > L, the last tile's rows past seq_q clipped by the map), bhsd strides and
no keys, for every TMA kernel it applies to (one issuer, producer warpgroup, ping-pong,
tcgen05 one and two Q tiles, the correction warps); the fence and the wait it needs are
checked by planting their absence; the key's rules; ptxas with 0 spills."""

import re

import numpy as np
import pytest

from ptxc.errors import EmulationError, SpecError
from ptxc.kernels import load_text
from families.prefill_cases import compiled, run, run_edited, spec_text

pytest.importorskip("ptxc.emu", reason="the emulator is needed for numerical checks")
TS = {"tma_store": True}
KERNELS = [
    ("sm_90a", 128, {}), ("sm_90a", 64, {"warp_specialize": False}), ("sm_90a", 128, {"pingpong": True}),
    ("sm_100a", 128, {}), ("sm_100a", 64, {"warp_specialize": False}),
    pytest.param("sm_100a", 128, {"q_tiles": 2}, marks=pytest.mark.slow),
    ("sm_100a", 128, {"q_tiles": 2, "correction": True}),
]


@pytest.mark.parametrize("target,d,tile", KERNELS, ids=str)
def test_outputs_identical_to_the_threads_stores(target, d, tile):
    """The same kernel with and without the TMA stores: bit-identical o and lse, and the
    stored rows stop at seq_q (the output is exactly seq_q rows: a store past it would fault):
    a partial single tile over 113 keys, and q_len > L over two query tiles (the second's rows
    past seq_q clipped) in bhsd strides."""
    base = spec_text("bf16", d, "gqa4", True, tile={**tile} or None, targets=(target,))
    text = spec_text("bf16", d, "gqa4", True, tile={**tile, **TS}, targets=(target,))
    _, ptx, launch, config = compiled(text, target)
    assert config["tma_store"] and launch["params"][-1]["name"] == "o_tmap"
    assert ptx.count(".global.shared::cta.tile.bulk_group") == (2 if d == 128 else 1) * \
        tile.get("q_tiles", 1)
    for seq_q, seq_k, layout in ((17, 113, "bshd"), (130, 70, "bhsd")):
        want = run(base, seq_q, seq_k, target=target, layout=layout)[0]
        got = run(text, seq_q, seq_k, target=target, layout=layout)[0]
        for name in want:
            assert np.array_equal(got[name].view(np.uint8), want[name].view(np.uint8)), \
                (name, seq_q, seq_k, layout)


def test_no_keys():
    outs = run(spec_text("bf16", 128, "gqa4", False, tile=TS, targets=("sm_90a",)), 9, 0,
               target="sm_90a")[0]
    assert np.all(outs["o"] == 0) and np.all(np.isneginf(outs["lse"]))


def _last_fence_removed(ptx: str) -> str:
    """The fence.proxy.async before the first TMA store (the barrier inits' own stays)."""
    store = ptx.index(".global.shared::cta.tile.bulk_group")
    fence = ptx.rindex("fence.proxy.async.shared::cta;", 0, store)
    return ptx[:fence] + ptx[fence + len("fence.proxy.async.shared::cta;"):]


@pytest.mark.parametrize("edit,message", [
    (_last_fence_removed, "shared-memory proxy race"),
    (lambda p: p.replace("cp.async.bulk.wait_group.read 0;", ""), "still reads shared memory"),
])
def test_mistakes_are_caught(edit, message):
    with pytest.raises(EmulationError, match=message):
        run_edited(spec_text("bf16", 128, "gqa4", True, tile=TS, targets=("sm_90a",)), "sm_90a",
                   edit, 130, 70)


def test_rules():
    """With kv_loads = "cp_async" (no tensor maps) and where no target takes a TMA kernel:
    one line naming tile.tma_store."""
    for tile, targets in (({**TS, "kv_loads": "cp_async"}, ("sm_90a",)), (TS, ("sm_80",))):
        with pytest.raises(SpecError) as e:
            load_text(spec_text("bf16", 128, tile=tile, targets=targets))
        assert e.value.key == "tile.tma_store" and "\n" not in str(e.value), str(e.value)


def test_ptxas_zero_spills(toolchain):
    from ptxc.pipeline.ptxas import assemble
    every = "sliding_window = 21\nlogits_soft_cap = 2.0\nattention_sinks = true\nalibi = true\n"
    for target in ("sm_90a", "sm_100a"):
        for d in (64, 128, 256):
            for extra in ("", every):
                text = spec_text("bf16", d, "gqa4", True, tile=TS, targets=(target,))
                ptx = compiled(text.replace("targets = ", extra + "targets = "), target)[1]
                _, res, _ = assemble(ptx, target, toolchain, "p")
                [r] = res.values()
                assert r.spill_stores == r.spill_loads == r.stack == 0, (target, d, extra)
                assert re.search(r"cp\.async\.bulk\.wait_group\.read 0;", ptx)
