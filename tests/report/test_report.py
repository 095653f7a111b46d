"""`ptxc report`: occupancy against hand-computed cases, the cost models by hand, the report on
every example spec (JSON and HTML), and a headless-browser screenshot of the HTML."""

import json
import os
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import SPECS

from ptxc.cli import main
from ptxc.report.costs import Cost, decode_cost, launch_cost, prefill_cost, resolve_dims, roofline
from ptxc.errors import InputError, UserError
from ptxc.report.gpus import GPUS, get_gpu, match_device, models_for_target
from ptxc.report.calibration import CALIBRATION_ERROR, COPY_CALIBRATION_ERROR, H100_MMA_SYNC, WGMMA_CALIBRATION_ERROR
from ptxc.report.loop_model import COPY_FAMILIES
from ptxc.targets import TARGETS, occupancy

KIB = 1024


# ---- theoretical occupancy, computed by hand from the per-SM limits in ptxc/targets.py ----

def test_occupancy_sm80_shared_memory_bound():
    # sm_80: 64 warps, 32 CTAs, 164 KiB shared memory per SM, 1 KiB reserved per CTA.
    # 128 threads = 4 warps; 64 regs x 32 lanes = 2048 regs per warp -> 65536 / 2048 = 32 warps
    # -> 8 CTAs by registers. Shared memory: 48 KiB + 1 KiB = 49 KiB per CTA; 164 / 49 = 3 CTAs.
    # 3 CTAs x 4 warps = 12 of 64 warps = 18.75 %.
    assert occupancy(TARGETS["sm_80"], 128, 64, 48 * KIB) == {
        "ctas_per_sm": 3, "warps_per_sm": 12, "occupancy": 0.1875, "limited_by": "shared_memory"}


def test_occupancy_sm80_register_granularity():
    # 256 threads = 8 warps, 130 registers: 130 x 32 = 4160 per warp, allocated in units of 256
    # -> 4352 (17 units). 65536 / 4352 = 15 whole warps -> 15 // 8 = 1 CTA. Without the
    # rounding it would be 65536 / 4160 = 15 warps too, but at 128 registers (4096 per warp,
    # exactly 16 units) it is 16 warps = 2 CTAs: the granularity decides at this boundary.
    occ = occupancy(TARGETS["sm_80"], 256, 130, 0)
    assert occ == {"ctas_per_sm": 1, "warps_per_sm": 8, "occupancy": 0.125, "limited_by": "registers"}
    assert occupancy(TARGETS["sm_80"], 256, 128, 0)["ctas_per_sm"] == 2


def test_occupancy_sm89_smem_bound_fraction_of_48_warps():
    # sm_89: 48 warps, 24 CTAs, 100 KiB shared memory per SM. 128 threads (4 warps), 40 regs:
    # 40 x 32 = 1280 = 5 units -> 65536 / 1280 = 51 warps -> 12 CTAs; warps: 48 / 4 = 12 CTAs.
    # Shared memory: 20 KiB + 1 KiB = 21 KiB per CTA -> 100 / 21 = 4 CTAs (4.76).
    # 4 x 4 = 16 of 48 warps = 33.33 %.
    assert occupancy(TARGETS["sm_89"], 128, 40, 20 * KIB) == {
        "ctas_per_sm": 4, "warps_per_sm": 16, "occupancy": 0.3333, "limited_by": "shared_memory"}


# ---- cost models, by hand ----

def _decode_meta(heads_per_cta: int, return_lse: bool = True, splits: int = 1) -> dict:
    dims = ["batch", "max_seq_len"] + (["num_splits"] if splits > 1 else [])
    return {"name": "tiny", "family": "decode", "dims": dims,
            "spec": {"dtype": "f16", "head_dim": 8, "num_heads": 4, "num_kv_heads": 2,
                     "return_lse": return_lse},
            "tensors": {"k_cache": {"shape": ["batch", "max_seq_len", 2, 8]}},
            "targets": {"sm_80": {"config": {"heads_per_cta": heads_per_cta}}}}


def test_decode_cost_by_hand():
    # batch 2, L 10, H 4, Hk 2 (GQA group 2), d 8, f16 (2 bytes), with lse.
    dims = {"batch": 2, "max_seq_len": 10}
    c = launch_cost(_decode_meta(heads_per_cta=2), "sm_80", dims)
    assert c.flops == 4 * 2 * 4 * 10 * 8 == 2560
    # K+V: 2 x batch 2 x L 10 x Hk 2 x d 8 x 2 B = 1280, read once (one chunk per group);
    # q + o: 2 x 2 x 4 x 8 x 2 B = 256; lse: 2 x 4 x 4 B = 32; seq_lens: 2 x 4 B = 8.
    assert c.bytes == 1280 + 256 + 32 + 8 == 1576
    assert c.unit == "simt" and c.intensity == pytest.approx(2560 / 1576)
    # One query head per CTA: each KV row is read by both CTAs of its group.
    assert decode_cost(_decode_meta(heads_per_cta=1, return_lse=False), {"heads_per_cta": 1}, dims).bytes \
        == 2 * 1280 + 256 + 8
    # Four splits: the f32 partials are overhead, not the attention's traffic (a row split 0
    # covers whole writes none): the useful bytes and FLOPs are the unsplit kernel's.
    split = launch_cost(_decode_meta(2, splits=4), "sm_80", {**dims, "num_splits": 4})
    assert split.bytes == 1576 and split.flops == 2560


def test_sliding_window_costs_count_only_the_window():
    # decode: L 10, W 4 -> the 4 last rows; everything else as in test_decode_cost_by_hand
    meta = _decode_meta(heads_per_cta=2)
    meta["spec"]["sliding_window"] = 4
    c = decode_cost(meta, {"heads_per_cta": 2}, {"batch": 2, "max_seq_len": 10})
    assert c.flops == 4 * 2 * 4 * 4 * 8 and c.bytes == 2 * 2 * 4 * 2 * 8 * 2 + 256 + 32 + 8
    # prefill 6 x 6 causal, W 2: query i sees min(i + 1, 2) keys -> 1 + 2 * 5 = 11 (not 36 / 2)
    pmeta = {"spec": {"dtype": "f16", "head_dim": 8, "num_heads": 2, "num_kv_heads": 1, "causal": True,
                      "sliding_window": 2}}
    assert prefill_cost(pmeta, {"path": "mma.m16n8k16"}, {"batch": 1, "seq_q": 6, "seq_k": 6}).flops \
        == 4 * 2 * 8 * 11
    from ptxc.report.costs import keys_seen
    assert keys_seen(3, 10, True, None) == 8 + 9 + 10 and keys_seen(3, 10, True, 4) == 12
    assert keys_seen(12, 10, True, None) == 55 and keys_seen(4, 10, False, None) == 40


def test_prefill_cost_by_hand():
    meta = {"spec": {"dtype": "f16", "head_dim": 8, "num_heads": 2, "num_kv_heads": 1, "causal": True}}
    c = prefill_cost(meta, {"path": "mma.m16n8k16"}, {"batch": 1, "seq_q": 4, "seq_k": 4})
    # 4 x 1 x 4 x 4 x 8 x 2 = 1024, halved for causal; q + o = 2 x 4 x 2 x 8 x 2 B = 256,
    # k + v = 2 x 4 x 1 x 8 x 2 B = 128.
    assert (c.flops, c.bytes, c.unit) == (512, 384, "tensor")


def test_roofline_picks_the_binding_limit():
    a100 = get_gpu("a100")
    mem = roofline(Cost(flops=2560, bytes=1576, unit="simt", dims={}), a100)
    assert mem["bound"] == "memory" and mem["seconds"] == pytest.approx(1576 / 2039e9)
    comp = roofline(Cost(flops=10**12, bytes=10**6, unit="tensor", dims={}), a100)
    assert comp["bound"] == "compute" and comp["seconds"] == pytest.approx(1e12 / 312e12)
    assert comp["attainable_tflops"] == pytest.approx(312.0)


def test_unknown_family_and_bad_shape_are_clear_errors():
    with pytest.raises(UserError, match="no cost model for family 'mystery'"):
        launch_cost({"family": "mystery", "spec": {}, "targets": {"sm_80": {}}}, "sm_80", {})
    with pytest.raises(InputError, match="--shape bogus: not a runtime dimension"):
        resolve_dims(_decode_meta(2), {"bogus": 3})


def test_gpu_table():
    assert {g.sm for g in GPUS.values()} == {80, 89, 90, 100, 120}
    assert all(g.source and g.tensor_tflops > g.f32_tflops > 0 and g.bandwidth_gbs > 0 for g in GPUS.values())
    assert [g.key for g in models_for_target("sm_90a")] == ["h100-sxm", "h200"]
    assert get_gpu("RTX 4090").key == "rtx-4090" and get_gpu("H200 SXM").key == "h200"
    assert match_device("NVIDIA H100 80GB HBM3").key == "h100-sxm"
    assert match_device("NVIDIA A100-SXM4-80GB").key == "a100-sxm"
    assert match_device("NVIDIA H100 PCIe") is None and match_device("NVIDIA A100-SXM4-40GB") is None
    # B200 bounds the sm_100a kernels; a GB200 (1200 W, other peaks) is not taken for one
    assert [g.key for g in models_for_target("sm_100a")] == ["b200"] and not models_for_target("sm_103a")
    assert match_device("NVIDIA B200").key == "b200" and match_device("NVIDIA GB200") is None
    with pytest.raises(UserError, match="unknown GPU model"):
        get_gpu("voodoo2")


# ---- the report on every example spec ----

@pytest.fixture(scope="module")
def built(example_build):
    """conftest's example build (verified; shared with tests/pipeline/test_build.py)."""
    out, summary = example_build
    assert not summary["problems"], summary["problems"]
    return out, summary


@pytest.fixture(scope="module")
def sass_cache(tmp_path_factory):
    """One cache for the report tests: nvdisasm runs once per cubin, not once per test."""
    return tmp_path_factory.mktemp("sass-cache")


@pytest.fixture
def shared_cache(sass_cache, monkeypatch):
    monkeypatch.setenv("PTXC_CACHE_DIR", str(sass_cache))


def _report(args, as_json: bool = True) -> tuple[dict | None, str]:
    r = CliRunner().invoke(main, ["report", *args])
    assert r.exit_code == 0, r.output
    return (json.loads(r.stdout) if as_json else None), r.output


def test_report_every_example_spec_json_and_html(built, tmp_path, shared_cache):
    out, summary = built
    html_path = tmp_path / "report.html"
    data, _ = _report([str(out), "--json", "--html", str(html_path)])
    assert {k["name"] for k in data["kernels"]} == {k["name"] for k in summary["kernels"]}
    spec_files = sorted(SPECS.glob("*.toml"))
    assert spec_files and len(data["kernels"]) >= len(spec_files)
    from ptxc.report.sass import SassUnavailable, find_nvdisasm
    try:
        find_nvdisasm()
        has_nvdisasm = True
    except SassUnavailable:
        has_nvdisasm = False
    assert data["sass"]["available"] == has_nvdisasm
    wgmma_estimates = 0
    for k in data["kernels"]:
        meta = json.loads((out / k["name"] / f"{k['name']}.json").read_text())
        for t in k["targets"]:
            tmeta = meta["targets"][t["target"]]
            for row, launch in zip(t["launches"], tmeta["kernels"]):
                res = launch["resources"]
                threads = launch["block"][0] * launch["block"][1] * launch["block"][2]
                smem = launch["static_smem_bytes"] + launch["dynamic_smem_bytes"]
                assert row["registers"] == res["registers"] and row["barriers"] == res["barriers"]
                assert row["occupancy"] == occupancy(TARGETS[t["target"]], threads, res["registers"], smem,
                                                     launch.get("tmem_columns", 0))
                if has_nvdisasm:
                    assert row["sass"]["total"] > 0 and row["sass"]["LDL"] == row["sass"]["STL"] == 0
                    # the attention launch of a tensor-core kernel (not its split-merge
                    # reduce, nor the kv_append copy fused in front of a decode)
                    if t["config"].get("path") == "mma.m16n8k16" and \
                            not launch["entry"].endswith(("_reduce", "_append")):
                        assert row["sass"]["HMMA"] > 0 and row["sass"]["LDSM"] > 0
                    _check_loop_row(k, t, row)
            assert t["cost"] is not None, t["cost_note"]
            want = launch_cost(meta, t["target"], k["dims"]).to_dict()
            assert t["cost"] == want
            assert [r["gpu"] for r in t["roofline"]] == [g.key for g in models_for_target(t["target"])]
            # the calibrated estimate: each path quotes its own fit's error, the families without
            # an attention loop (copies, merges) the error measured on the timed copies, their
            # launch term and bytes (more than the launch term alone); tcgen05 gets none
            path = str(t["config"].get("path", ""))
            wgmma_estimates += path.startswith("wgmma") and bool(t.get("estimate"))
            copy = meta["family"] in COPY_FAMILIES
            for e in t.get("estimate") or []:
                assert e["error"] == (COPY_CALIBRATION_ERROR if copy else WGMMA_CALIBRATION_ERROR
                                      if path.startswith("wgmma") else CALIBRATION_ERROR)
                assert not copy or e["seconds"] > H100_MMA_SYNC.launch_s * len(tmeta["kernels"])
            if path.startswith("tcgen05"):
                assert not t.get("estimate")
            elif has_nvdisasm and any(r["gpu"] == "h100-sxm" for r in t["roofline"]):
                assert t.get("estimate"), (k["name"], t["target"])
    assert (wgmma_estimates > 0) == has_nvdisasm   # the examples' sm_90a kernels are estimated
    html = html_path.read_text()
    assert ("Main loop: one steady-state iteration" in html) == has_nvdisasm
    assert html.count('<svg class="roofline"') == len(data["gpus"]) >= 4
    for needle in ("http:", "https:", "<script", "<link", "src=", "@import", "url("):
        assert needle not in html, needle


def test_report_each_artifact_with_shape_and_gpu(built):
    out, summary = built
    for k in summary["kernels"]:
        data, _ = _report([k["dir"], "--json", "--no-sass", "--gpu", "h100", "--shape", "batch=2"])
        spec = json.loads((out / k["name"] / f"{k['name']}.json").read_text())["spec"]
        assert data["sass"] == {"available": False, "reason": "skipped (--no-sass)"}
        (kern,) = data["kernels"]
        # (kv_append by slot mapping has no batch: its rows are num_tokens; sparse MLA's tokens
        # are their own sequences: total_q, with a cache of `batch` sequences' pages)
        assert kern["dims"].get("batch", 2) == 2
        rows = ("total_q",) if spec.get("sparse_topk") else ("batch", "num_tokens")
        assert any(r in kern["dims"] for r in rows)
        # The H100 runs one image per kernel: the sm_90 cubin (else the newest older PTX); a
        # kernel built for Blackwell alone has none it can run, and no row
        if all(TARGETS[t["target"]].sm > 90 for t in kern["targets"]):
            assert list(data["gpus"]) == [] and not any(t["roofline"] for t in kern["targets"])
            continue
        assert list(data["gpus"]) == ["h100-sxm"]
        on_h100 = [t for t in kern["targets"] if t["roofline"]]
        assert len(on_h100) == 1 and on_h100[0]["roofline"][0]["gpu"] == "h100-sxm"
        assert on_h100[0]["target"] == ("sm_90" if "sm_90" in [t["target"] for t in kern["targets"]]
                                        else on_h100[0]["target"])


def test_report_table_and_errors(built, tmp_path, shared_cache):
    out, _ = built
    _, text = _report([str(out), "--shape", "batch=4,max_seq_len=1024,seq_q=512,seq_k=512"], as_json=False)
    assert "theoretical occupancy" in text and "roofline" in text and "A100 SXM 80GB" in text
    r = CliRunner().invoke(main, ["report", str(out), "--gpu", "voodoo2"])
    assert r.exit_code == 2 and "unknown GPU model" in r.output
    r = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert r.exit_code == 2 and "not an artifact directory" in r.output


def _png_size_and_ink(png: bytes) -> tuple[int, int, float]:
    """(width, height, fraction of non-white bytes in the decoded scanlines)."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    pos, idat = 8, b""
    while pos < len(png):
        length, kind = struct.unpack(">I4s", png[pos:pos + 8])
        if kind == b"IDAT":
            idat += png[pos + 8:pos + 8 + length]
        pos += 12 + length
    raw = zlib.decompress(idat)
    return width, height, sum(1 for b in raw[::7] if b != 0xFF) / len(raw[::7])


def test_html_report_headless_screenshot(built, tmp_path, shared_cache):
    chromium = "/usr/bin/chromium"
    if not Path(chromium).exists():
        pytest.skip("chromium not installed: `make test-deps-system` installs it (Debian, as root)")
    out, _ = built
    html_path = tmp_path / "report.html"
    _report([str(out), "--json", "--html", str(html_path)])
    shot = tmp_path / "report.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync", "--no-first-run",
                    f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1280,2000",
                    html_path.as_uri()], capture_output=True, timeout=120, check=False)
    assert shot.is_file(), "chromium wrote no screenshot"
    png = shot.read_bytes()
    width, height, ink = _png_size_and_ink(png)
    assert (width, height) == (1280, 2000) and len(png) > 30_000 and ink > 0.01
    keep = os.environ.get("PTXC_TEST_ARTIFACTS")
    if keep:   # CI uploads this folder: the screenshot is the human check of the page
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(keep) / "report.png")
        shutil.copy(html_path, Path(keep) / "report.html")


def _check_loop_row(k: dict, t: dict, row: dict) -> None:
    """Every attention launch has a main loop with per-KV-row figures and a bound per model."""
    if k["family"] in COPY_FAMILIES or row["entry"].endswith(("_reduce", "_append")):
        return
    loop = row["loop"]
    assert loop is not None and loop["instructions"] > 0, row["entry"]
    assert loop["instructions_longest"] >= loop["instructions"]     # the bound from above
    assert loop["kv_rows_per_iteration"] > 0 and loop["instructions_per_kv_row"] > 0
    assert loop["global_bytes_loaded"] > 0 and loop["inflight_bytes_per_sm"] > 0
    if t["config"].get("path") == "mma.m16n8k16":
        assert loop["classes"]["tensor"] > 0 and loop["instructions_per_mma"] > 1
    assert [b["gpu"] for b in loop["bounds"]] == [g.key for g in models_for_target(t["target"])]
    for b in loop["bounds"]:
        assert b["seconds"] == max(b["times"].values()) > 0 and b["times"][b["bound"]] == b["seconds"]
