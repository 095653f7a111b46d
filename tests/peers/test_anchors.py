"""bench/anchors.py end to end (slow: four nvcc compiles of FlashInfer's templates, ~1-2 min on
2 cores): FlashInfer 0.7.2 and Triton kernels compiled without a GPU and read by ptxc's own loop
analysis, next to ptxc's. Skips, saying why, without nvcc, the FlashInfer wheel (the
flashinfer-python wheel is not a test dependency: installing it pulls in torch; point
FLASHINFER_WHEEL at a downloaded wheel), Triton or nvdisasm; FlashInfer's FA3 prefill (sm_90a,
another ~2 min) also needs curand's headers (CURAND_INCLUDE) and is checked when they are found."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_anchor_table(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    monkeypatch.syspath_prepend(str(ROOT / "bench" / "peers"))
    import fi_build
    try:
        fi_build.find_nvcc()
        fi_build.find_source(None)
    except fi_build.Unavailable as e:
        pytest.skip(str(e))
    pytest.importorskip("triton", reason="triton not installed (the `test` extra)")
    from ptxc.report.sass import SassUnavailable, find_nvdisasm
    try:
        find_nvdisasm()
    except SassUnavailable as e:
        pytest.skip(str(e))
    import anchors
    args = anchors.argparse.Namespace(targets=["sm_80", "sm_90"], flashinfer=None, work=tmp_path,
                                      ptxc_out=None, json=True)
    try:
        fi_build.find_curand()
        has_curand = True
    except fi_build.Unavailable:
        has_curand = False
    rows, notes = anchors.collect(args)
    # only FlashInfer's FA3 prefill needs curand's headers; without them it alone is skipped
    assert notes == ([] if has_curand else [n for n in notes if "curand_kernel.h" in n]) and \
        len(notes) == (0 if has_curand else 1)
    fa3 = [r for r in rows if "FA3" in r["kernel"]]
    got = {(r["impl"], r["job"], r["target"]): r for r in rows if r not in fa3}
    for impl in ("ptxc", "flashinfer", "triton"):
        for job in ("decode", "prefill"):
            for t in ("sm_80", "sm_90"):
                r = got[(impl, job, t)]
                assert r["per_kv_row"] > 0 and r["inflight_kib_sm"] > 0 and r["ctas_per_sm"] >= 1
    fi_decode, fi_prefill = got[("flashinfer", "decode", "sm_80")], got[("flashinfer", "prefill", "sm_80")]
    # the dispatcher's configuration: 128 threads, 2 cp.async stages (9 KiB), SIMT; 64 KiB, 2 CTAs/SM
    assert (fi_decode["smem_kib"], fi_decode["tensor"], fi_decode["kv_rows"]) == (9.0, 0, 16)
    assert fi_decode["registers"] <= 64 and fi_decode["ctas_per_sm"] >= 8
    assert 100 <= fi_decode["per_kv_row"] <= 150
    assert (fi_prefill["smem_kib"], fi_prefill["ctas_per_sm"], fi_prefill["tensor"]) == (64.0, 2, 264)
    assert 3.0 <= fi_prefill["per_hmma"] <= 4.0
    # Triton's decode and prefill put their math on tensor cores (wgmma for prefill on sm_90)
    assert all(got[("triton", j, t)]["tensor"] > 0 for j in ("decode", "prefill") for t in ("sm_80", "sm_90"))
    assert got[("triton", "prefill", "sm_90")]["per_hmma"] is not None
    if has_curand:   # FA3 on sm_90a: warp-specialised, HGMMA in the consumers' loop, TMA loads
        [r] = fa3
        assert (r["target"], r["smem_kib"], r["ctas_per_sm"], r["kv_rows"]) == ("sm_90", 160.1, 1, 128)
        assert r["tensor"] == 16 and 1.0 <= r["per_hmma"] <= 3.0


def test_cubin_registers_match_ptxas(tmp_path, toolchain, monkeypatch):
    """bench/peers/cubin_info.py reads a kernel's register count from the cubin's .nv.info (how
    the anchors get the peers'): the same number ptxas reported into ptxc's metadata, on sm_80
    and sm_90 (where the section header no longer carries it)."""
    import json
    monkeypatch.syspath_prepend(str(ROOT / "bench" / "peers"))
    from cubin_info import registers
    from ptxc.pipeline.build import run_build
    spec = tmp_path / "k.toml"
    spec.write_text('[[kernel]]\nname = "k"\nfamily = "decode"\ndtype = "f16"\nhead_dim = 64\n'
                    'num_heads = 4\nnum_kv_heads = 2\ntargets = ["sm_80", "sm_90"]\n')
    run_build([spec], tmp_path / "out", progress=False)
    meta = json.loads((tmp_path / "out" / "k" / "k.json").read_text())
    for target, t in meta["targets"].items():
        cubin = (tmp_path / "out" / "k" / f"k.{target}.cubin").read_bytes()
        got = registers(cubin)
        assert got and {L["entry"]: L["resources"]["registers"] for L in t["kernels"]} == got
