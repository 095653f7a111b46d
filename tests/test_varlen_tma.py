"""varlen on wgmma for sm_90a with K/V tiles fed by TMA (tile.kv_loads = "tma";
ptxc/kernels/varlen_tma.py): emulator numerics of the real sm_90a PTX against the fp64
reference on ragged batches (sequence lengths 0 / 1 / 17 / 113, q_len > 1 chunks, pages
crossed) whose caches hold NaN in every row at or past L and in every page no sequence uses
(so a box reading them, or a V tail row not zeroed, fails the check); paged (16- and 64-row
pages) and contiguous, causal and not, GQA 4 / 8, split-KV with empty splits, LSE; the loader
rule (pages < 8 rows keep cp.async), one-line errors, the tensor-map metadata, and ptxas sm_90a
with 0 spills. The default subset keeps the emulated shapes small; `-m slow` runs the sweep."""

import numpy as np
import pytest

from conftest import build_kernel
from ptxc.errors import SpecError
from ptxc.kernels import FAMILIES
from ptxc.runtime import reference as ref
from ptxc.spec import load_text
from ptxc.spec.model import KernelSpec
from ptxc.targets import TARGETS
from tests.test_varlen import body
from tests.test_varlen_wgmma import LENGTHS, ragged_inputs

pytest.importorskip("ptxc.emu", reason="the emulator is needed for numerical checks")
VARLEN = FAMILIES["varlen"]
SM90A = ("sm_90a",)
SLOW = pytest.mark.slow
TMA = 'kv_loads = "tma"'


def spec_body(layout: str, **case) -> str:
    text = body(layout="contiguous" if layout == "contiguous" else "page16", **case)
    return text if layout in ("contiguous", "page16") else \
        text.replace("page_size = 16", f"page_size = {int(layout[4:])}")


def build(tmp_path, layout, tile="", extra="", **case):
    art = build_kernel(tmp_path, "varlen", spec_body(layout, **case) + extra,
                       tile="\n".join(x for x in (TMA, tile) if x), targets=SM90A)
    target = art.meta["targets"]["sm_90a"]
    ptx = (art.path / target["ptx"]).read_text()
    assert target["config"]["path"] == "wgmma.m64nNk16" and target["config"]["kv_loads"] == "tma"
    assert "cp.async.bulk.tensor.4d" in ptx and "wgmma.mma_async" in ptx
    return art, KernelSpec.from_dict(art.meta["spec"])


def poison(inputs: dict, layout: str, lengths) -> dict:
    """NaN in every cache row at or past each sequence's L, and in every page that no
    sequence's first cdiv(L, page_size) block-table entries name."""
    for t in ("k_cache", "v_cache"):
        cache = inputs[t]
        if layout == "contiguous":
            for b, (_, L) in enumerate(lengths):
                cache[b, L:] = np.nan
            continue
        ps = cache.shape[1]
        live = np.zeros(cache.shape[:2], bool)
        for b, (_, L) in enumerate(lengths):
            for r in range(L):
                live[inputs["block_table"][b, r // ps], r % ps] = True
        cache[~live] = np.nan
    return inputs


def check_poisoned(art, spec, layout, lengths=LENGTHS, seed=0):
    inputs = poison(ragged_inputs(spec, layout, lengths, seed), layout, lengths)
    assert np.isnan(inputs["v_cache"]).any()
    out = art.run(inputs, target="sm_90a")
    want = VARLEN.reference(spec, inputs)
    naive = VARLEN.reference(spec, inputs, dtype=spec.dtype)
    for t in want:
        assert np.all(np.isfinite(want[t]) | np.isneginf(want[t])), t
        assert np.array_equal(np.isneginf(out[t]), np.isneginf(want[t])), t
        assert np.all(np.isfinite(out[t]) | np.isneginf(out[t])), f"{t}: NaN or +inf in the output"
        err, tol = ref.max_abs_error(out[t], want[t]), ref.tolerance(naive[t], want[t])
        assert err <= tol, f"{t}: max error {err:.3e} > tolerance {tol:.3e}"
    return out, inputs


@pytest.mark.parametrize("layout,tile,case", [
    ("page16", "block_n = 32", dict(dtype="f16", head_dim=64, gqa="gqa4", causal=True)),
    ("contiguous", "block_n = 32", dict(dtype="bf16", head_dim=64, gqa="gqa8", causal=False,
                                        splits=3)),
    ("page64", "", dict(dtype="f16", head_dim=64, gqa="gqa8", causal=True, splits=4)),
    *(pytest.param(lay, "", dict(dtype=dt, head_dim=d, gqa=g, causal=c, splits=s), marks=SLOW)
      for dt in ("f16", "bf16") for d in (64, 128, 256) for g in ("gqa4", "gqa8")
      for c in (True, False) for lay, s in (("page16", 1), ("page64", "auto"), ("contiguous", 3))),
], ids=lambda x: "-".join(map(str, x.values())) if isinstance(x, dict) else x.replace(" ", ""))
def test_ragged_batch_with_nan_garbage(tmp_path, layout, tile, case):
    """Lengths 0 / 1 / 17 / 113, chunks and verifications, q_len > L, pages crossed (16-row
    pages: four boxes per 64-row tile; 64-row pages: one), splits with empty shares; NaN past L
    and in unused pages never reaches O or the LSE."""
    art, spec = build(tmp_path, layout, tile, **case)
    out, inputs = check_poisoned(art, spec, layout)
    cu = inputs["cu_seqlens_q"]
    assert np.all(out["o"][cu[6]:cu[7]] == 0)                 # L = 0
    assert np.all(np.isneginf(out["lse"][cu[6]:cu[7]]))
