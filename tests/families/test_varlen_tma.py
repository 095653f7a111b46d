"""varlen on wgmma for sm_90a with K/V tiles fed by TMA (tile.kv_loads = "tma";
ptxc/kernels/bodies/varlen_tma.py): emulator numerics of the real sm_90a PTX against the fp64
reference on ragged batches (sequence lengths 0 / 1 / 17 / 113, q_len > 1 chunks, pages
crossed) whose caches hold NaN in every row at or past L and in every page no sequence uses
(so a box reading them, or a V tail row not zeroed, fails the check); paged (16- and 64-row
pages) and contiguous, causal and not, GQA 4 / 8, split-KV with empty splits, LSE; the loader
rule (pages < 8 rows keep cp.async), one-line errors, the tensor-map metadata, and ptxas sm_90a
with 0 spills. The default subset keeps the emulated shapes small; `-m slow` runs the sweep."""

import numpy as np
import pytest

from conftest import build_kernel, built_sass
from ptxc.errors import SpecError
from ptxc.kernels import FAMILIES
from ptxc import reference as ref
from ptxc.kernels import load_text
from ptxc.spec.model import KernelSpec
from ptxc.targets import TARGETS
from families.test_varlen import body
from families.test_varlen_wgmma import LENGTHS, ragged_inputs

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


def poison(inputs: dict, layout: str, lengths, window: int | None = None,
           chunk: int | None = None) -> dict:
    """NaN in every cache row at or past each sequence's L, and in every page that no
    sequence's first cdiv(L, page_size) block-table entries name; with a sliding window (an
    attention chunk) also in the pages wholly before the window (the chunk) of a sequence's
    first query (an engine may free them)."""
    for t in ("k_cache", "v_cache"):
        cache = inputs[t]
        if layout == "contiguous":
            for b, (_, L) in enumerate(lengths):
                cache[b, L:] = np.nan
            continue
        ps = cache.shape[1]
        live = np.zeros(cache.shape[:2], bool)
        for b, (q_len, L) in enumerate(lengths):
            first = L - q_len                      # the first query's position
            lo = max(0, first - window + 1 if window else 0, first // chunk * chunk if chunk else 0)
            lo = lo // ps * ps
            for r in range(lo, L):
                live[inputs["block_table"][b, r // ps], r % ps] = True
        cache[~live] = np.nan
    return inputs


def check_poisoned(art, spec, layout, lengths=LENGTHS, seed=0, target="sm_90a"):
    inputs = poison(ragged_inputs(spec, layout, lengths, seed), layout, lengths,
                    spec.opt("sliding_window"), spec.opt("attention_chunk"))
    assert np.isnan(inputs["v_cache"]).any()
    out = art.run(inputs, target=target)
    # the reference multiplies masked probabilities (0) by the rows before a window: it gets
    # the NaN as zeros, which no unmasked key ever reads
    clean = {**inputs, **{t: np.nan_to_num(inputs[t], nan=0.0) for t in ("k_cache", "v_cache")}}
    want = VARLEN.reference(spec, clean)
    naive = VARLEN.reference(spec, clean, dtype=spec.dtype)
    for t in want:
        assert np.all(np.isfinite(want[t]) | np.isneginf(want[t])), t
        assert np.array_equal(np.isneginf(out[t]), np.isneginf(want[t])), t
        assert np.all(np.isfinite(out[t]) | np.isneginf(out[t])), f"{t}: NaN or +inf in the output"
        err, tol = ref.max_abs_error(out[t], want[t]), ref.tolerance(naive[t], want[t])
        assert err <= tol, f"{t}: max error {err:.3e} > tolerance {tol:.3e}"
    return out, inputs


# the slow sweep: f16/bf16 x d64/128/256 x GQA 4/8 x causal x (16-row pages, 64-row pages with
# split auto, contiguous with 3 splits); test_varlen_tma_ws.py runs it too
SLOW_MATRIX = [pytest.param(lay, "", dict(dtype=dt, head_dim=d, gqa=g, causal=c, splits=s), marks=SLOW)
               for dt in ("f16", "bf16") for d in (64, 128, 256) for g in ("gqa4", "gqa8")
               for c in (True, False) for lay, s in (("page16", 1), ("page64", "auto"), ("contiguous", 3))]


def case_id(x) -> str:
    return "-".join(map(str, x.values())) if isinstance(x, dict) else x.replace(" ", "")


@pytest.mark.parametrize("layout,tile,case", [
    ("page16", "block_n = 32", dict(dtype="f16", head_dim=64, gqa="gqa4", causal=True)),
    ("contiguous", "block_n = 32", dict(dtype="bf16", head_dim=64, gqa="gqa8", causal=False,
                                        splits=3)),
    ("page64", "", dict(dtype="f16", head_dim=64, gqa="gqa8", causal=True, splits=4)),
    *SLOW_MATRIX,
], ids=case_id)
def test_ragged_batch_with_nan_garbage(tmp_path, layout, tile, case):
    """Lengths 0 / 1 / 17 / 113, chunks and verifications, q_len > L, pages crossed (16-row
    pages: four boxes per 64-row tile; 64-row pages: one), splits with empty shares; NaN past L
    and in unused pages never reaches O or the LSE."""
    art, spec = build(tmp_path, layout, tile, **case)
    out, inputs = check_poisoned(art, spec, layout)
    cu = inputs["cu_seqlens_q"]
    assert np.all(out["o"][cu[6]:cu[7]] == 0)                 # L = 0
    assert np.all(np.isneginf(out["lse"][cu[6]:cu[7]]))


@pytest.mark.parametrize("layout,d,dv,case", [
    ("page64", 192, 128, dict(dtype="bf16", gqa="gqa4", causal=True, splits="auto")),
    ("page16", 128, 64, dict(dtype="f16", gqa="gqa8", causal=False, splits=3)),
    ("contiguous", 256, 128, dict(dtype="bf16", gqa="gqa4", causal=True, splits=1)),
    ("page16", 192, 192, dict(dtype="f16", gqa="gqa4", causal=True, splits=2)),
], ids=["deepseek-page64", "d128v64-page16", "d256v128-contiguous", "d192-page16"])
def test_v_narrower_than_k(tmp_path, layout, d, dv, case):
    """head_dim_v < head_dim (DeepSeek's MLA prefill: 192 / 128): V's stages and boxes are
    head_dim_v wide (its first slabs' boxes, on the warps that issue K's), P·V is m64n{dv};
    NaN past L and in unused pages, V's tail rows zeroed over its own width. 192-wide rows:
    Q copied in three 128-byte column groups (a pass of 128 threads is then 16 rows)."""
    art, spec = build(tmp_path, layout, "warp_specialize = false", f"\nhead_dim_v = {dv}",
                      head_dim=d, **case)                                  # one issuer
    ptx = (art.path / art.meta["targets"]["sm_90a"]["ptx"]).read_text()
    assert f"m64n{dv}k16" in ptx
    check_poisoned(art, spec, layout, seed=4)


def test_v_narrower_than_k_needs_tma(tmp_path):
    """The per-thread copy groups K's rows: head_dim_v < head_dim with cp.async or an FP8
    cache keeps the mma.sync body on sm_90a."""
    for extra in ('[kernel.tile]\nkv_loads = "cp_async"\n', 'kv_dtype = "e4m3"\n'):
        body_text = spec_body("page64", dtype="bf16", head_dim=192, gqa="gqa4", causal=True) + "\nhead_dim_v = 128\n"
        tile = ""
        if extra.startswith("[kernel.tile]"):
            tile = extra
        else:
            body_text += extra
        [spec] = load_text(f'[[kernel]]\nname = "k"\nfamily = "varlen"\ntargets = ["sm_90a"]\n{body_text}{tile}')
        assert VARLEN.resolve_tile(spec, TARGETS["sm_90a"])["path"] == "mma.m16n8k16"


def test_two_warpgroups_small_tile_page8(tmp_path):
    """block_m 128 (256 threads) with block_n 16 at head_dim 64: the tail zeroing's one pass
    is partial (128 chunks for 256 threads); 8-row pages, the smallest TMA takes (two boxes of
    one swizzle period per slab and tile)."""
    art, spec = build(tmp_path, "page8", "block_m = 128\nnum_warps = 8\nblock_n = 16",
                      dtype="bf16", head_dim=64, gqa="gqa4", causal=True, splits=2)
    assert art.meta["targets"]["sm_90a"]["kernels"][0]["block"] == [256, 1, 1]
    check_poisoned(art, spec, "page8", seed=1)


@pytest.mark.parametrize("extra", ["sliding_window = 40", "sliding_window = 21", "logits_soft_cap = 2.0",
                                   pytest.param("attention_sinks = true", marks=SLOW),
                                   pytest.param("alibi = true", marks=SLOW)])
def test_variants(tmp_path, extra):
    """The variant seam on the TMA body; a sliding window masks the keys of the first
    token's window's page before it and never reads pages wholly before it (NaN there)."""
    layout = "page16" if "21" in extra else "page64"
    art, spec = build(tmp_path, layout, "block_n = 32", "\n" + extra, dtype="f16",
                      head_dim=64, gqa="gqa4", causal=True, splits=2)
    check_poisoned(art, spec, layout, seed=2)


def test_mixed_batch(tmp_path):
    """make_inputs' serving mix through the launch-test harness (its tensor maps encoded by
    runtime.tensor_maps), garbage block-table ids (-1, num_pages + 7) past each sequence."""
    from conftest import assert_pass
    from ptxc.runtime.launch_test import check_artifact
    art, _ = build(tmp_path, "page16", dtype="f16", head_dim=64, gqa="gqa4", causal=True,
                   splits="auto")
    assert_pass(check_artifact(art, backend="emu", shapes={"batch": 8}, seed=3))


# ---- configuration, metadata, errors -----------------------------------------------------------
def _config(text: str, targets=SM90A, tile: str = "") -> dict:
    [spec] = load_text(f'[[kernel]]\nname = "k"\nfamily = "varlen"\ntargets = {list(targets)!r}\n'
                       .replace("'", '"') + text + (f"\n[kernel.tile]\n{tile}\n" if tile else ""))
    return {t: VARLEN.resolve_tile(spec, TARGETS[t]) for t in targets}


def test_default_and_loader_rule():
    """TMA is the sm_90a default where it applies: contiguous caches and pages of >= 8 rows;
    smaller pages, and kv_loads = "cp_async", keep the per-thread loads (no kv_loads in the
    config). The barriers are the only extra shared memory."""
    for layout in ("contiguous", "page8", "page16", "page256"):
        assert _config(spec_body(layout, head_dim=128))["sm_90a"]["kv_loads"] == "tma", layout
        assert "kv_loads" not in _config(spec_body(layout, head_dim=128),
                                         tile='kv_loads = "cp_async"')["sm_90a"]
    for layout in ("page1", "page4"):
        for tile in ("", TMA):
            assert "kv_loads" not in _config(spec_body(layout, head_dim=128), tile=tile)["sm_90a"]
    cp = _config(spec_body("page16", head_dim=128), tile='kv_loads = "cp_async"')["sm_90a"]
    # the one-issuer tile (d128's default is warp-specialised: test_varlen_tma_ws.py)
    tma = _config(spec_body("page16", head_dim=128), tile="warp_specialize = false")["sm_90a"]
    assert tma["smem_bytes"] == cp["smem_bytes"] + 3 * 8   # full[2 stages] and the Q barrier


def test_kv_loads_needs_a_wgmma_target():
    for text, targets in ((spec_body("page16"), ("sm_80", "sm_90")),
                          (spec_body("page16", head_dim=96), SM90A),
                          (spec_body("page16", head_dim=128) + '\nkv_dtype = "e4m3"\nkv_scale = "tensor"', SM90A)):
        with pytest.raises(SpecError) as e:
            _config(text, targets, TMA)
        assert e.value.key == "tile.kv_loads" and "\n" not in str(e.value)
    with pytest.raises(SpecError, match="kv_loads"):
        _config(spec_body("page16"), SM90A, 'kv_loads = "bulk"')


def test_metadata_and_other_targets(tmp_path):
    """k_tmap / v_tmap after the other parameters: tensor maps over k_cache / v_cache with one
    box per 128-byte slab of a page (or a tile); the other targets of the spec keep their PTX
    byte for byte (the key changes only the sm_90a kernel)."""
    targets = ("sm_80", "sm_90", "sm_90a")
    text = spec_body("page16", dtype="bf16", head_dim=128, splits=3)
    arts = {tile: build_kernel(tmp_path / tile.split('"')[1], "varlen", text, tile=tile, targets=targets)
            for tile in (TMA, 'kv_loads = "cp_async"')}
    tma, cp = arts[TMA], arts['kv_loads = "cp_async"']
    for t in ("sm_80", "sm_90"):
        assert tma.ptx(t) == cp.ptx(t)
    kern = tma.meta["targets"]["sm_90a"]["kernels"][0]
    names = [p["name"] for p in kern["params"]]
    assert names[-2:] == ["k_tmap", "v_tmap"]
    assert names[:-2] == [p["name"] for p in cp.meta["targets"]["sm_90a"]["kernels"][0]["params"]]
    for p in kern["params"][-2:]:
        assert p["type"] == "tmap" and p["source"] == {
            "kind": "tensor_map", "tensor": f"{p['name'][0]}_cache", "box": [64, 1, 16, 1],
            "swizzle": 128}
    from ptxc.emit import cheader, rust     # the loaders encode both maps
    header = cheader.emit(tmp_path / "tma" / "out", tmp_path / "k.h").read_text()
    assert header.count("ptxc_put_tensor_map(L, p.bytes, ") == 2
    assert "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, box, CU_TENSOR_MAP_SWIZZLE_128B" in header
    assert rust.emit(tmp_path / "tma" / "out", tmp_path / "k.rs").read_text().count(
        "put_tensor_map(&mut p, ") == 2
    [spec] = load_text(f'[[kernel]]\nname = "k"\nfamily = "varlen"\ntargets = ["sm_90a"]\n'
                       f'{spec_body("contiguous", head_dim=64)}\n[kernel.tile]\nblock_n = 32\n{TMA}\n')
    params = FAMILIES["varlen"].build(spec, TARGETS["sm_90a"]).launches[0].params
    assert [dict(p.source.box and {"box": p.source.box}) for p in params if p.name.endswith("_tmap")] == \
        [{"box": (64, 1, 32, 1)}] * 2


# ---- ptxas and SASS ----------------------------------------------------------------------------
def assemble_without_spills(tmp_path, kernels: list[str]) -> None:
    """Build the TOML `kernels` for sm_90a into tmp_path / "out": verified by ptxas, no problem
    (a spill or a performance note), 0 spill bytes each."""
    from ptxc.pipeline.build import run_build
    (tmp_path / "k.toml").write_text("\n".join(kernels))
    summary = run_build([tmp_path / "k.toml"], tmp_path / "out", progress=False)
    assert summary["verified"] and not summary["problems"] and len(summary["kernels"]) == len(kernels)
    for k in summary["kernels"]:
        assert k["targets"]["sm_90a"]["spill_bytes"] == 0, k["name"]


@pytest.mark.parametrize("dtypes", [("f16", "bf16"), pytest.param(("bf16", "f16"), marks=SLOW)])
def test_ptxas_sm90a_zero_spills(tmp_path, toolchain, dtypes):
    """head_dim 64 / 128 / 256 x paged (16-row pages) / contiguous, causal split-KV and not
    (the default run alternates f16 / bf16; -m slow the other way round), the one-issuer tile
    (d128's default is warp-specialised: test_varlen_tma_ws.py): 0 spills; the d128 paged loop
    issues UTMALDG and no LDGSTS, with the tensor work of the cp.async kernel."""
    kernels = []
    for i, d in enumerate((64, 128, 256)):
        for j, (lay, splits, causal) in enumerate((("page16", "auto", True), ("contiguous", 1, False))):
            kernels.append(f'[[kernel]]\nname = "v_d{d}_{lay}"\nfamily = "varlen"\n'
                           f'targets = ["sm_90a"]\n'
                           f'{spec_body(lay, dtype=dtypes[(i + j) % 2], head_dim=d, causal=causal, splits=splits)}\n'
                           f'[kernel.tile]\n{TMA}\nwarp_specialize = false\n')   # one issuer
    assemble_without_spills(tmp_path, kernels)
    meta, prof = built_sass(tmp_path / "out", "v_d128_page16", "sm_90a", "ptxc_v_d128_page16_split")
    assert meta["targets"]["sm_90a"]["config"]["kv_loads"] == "tma"
    loop = prof["loops"]["loops"][prof["loops"]["main"]]
    assert prof["mix"]["LDGSTS"] > 0          # the Q gather, before the loop
    assert loop["classes"]["ldgsts"] == 0
    assert prof["mix"]["LDL"] == prof["mix"]["STL"] == 0
    assert (loop["classes"]["tensor"], loop["mma_equivalents"]) == (8 + 4 + 4, 64 + 64 + 4)
    # every warp issues two of the tile's boxes from lane 0 (warp_boxes: slabs and offsets from
    # the warp id, no branch per warp): ptxas 13.5, 313 instructions a warp, 2.37 per
    # MMA-equivalent (347-351, 2.64-2.66 with a branch per warp), against cp.async's 3.13
    assert loop["instructions_per_mma_equivalent"] < 2.45
