"""Tier 2: every example spec builds, ptxas accepts every PTX with 0 spill bytes on every
target, outputs are deterministic, warm rebuilds touch nothing, and `verify` catches tampering."""

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import SPECS
from ptxc.pipeline.build import run_build
from ptxc.cli import main

ACCEPTANCE_TARGETS = ["sm_80", "sm_89", "sm_90", "sm_120"]


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.startswith(".")}


@pytest.fixture(scope="module")
def built(example_build):
    return example_build     # conftest's: built once per run, shared with the report tests


def test_every_spec_target_assembles_without_spills(built):
    out, summary = built
    assert summary["verified"] and not summary["problems"]
    seen = set()
    for k in summary["kernels"]:
        meta = json.loads((out / k["name"] / f"{k['name']}.json").read_text())
        for target, t in meta["targets"].items():
            seen.add(target)
            assert (out / k["name"] / t["cubin"]).stat().st_size > 0
            for launch in t["kernels"]:
                r = launch["resources"]
                assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack"] == 0, (k, target)
                assert 0 < r["registers"] <= 255
                assert r["shared_bytes"] == launch["static_smem_bytes"]
    assert set(ACCEPTANCE_TARGETS) <= seen


@pytest.mark.slow
def test_retarget_every_spec_to_acceptance_targets(tmp_path, toolchain):
    """Slow (27 s): every example retargeted to every acceptance target. By default
    test_spill_sweep covers each family × option × target with ptxas, and
    test_every_spec_target_assembles_without_spills the examples on their own targets."""
    summary = run_build([SPECS], tmp_path, targets=ACCEPTANCE_TARGETS, progress=False, cache_dir=tmp_path / "c")
    assert not summary["problems"]
    for k in summary["kernels"]:
        assert sorted(k["targets"]) == sorted(ACCEPTANCE_TARGETS)
        assert all(t["spill_bytes"] == 0 for t in k["targets"].values())


def test_metadata_matches_schema_and_manifest(built):
    from ptxc.pipeline.metadata import schema_errors
    out, _ = built
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(manifest["artifacts"]) == sorted(p.name for p in out.iterdir() if p.is_dir())
    for name in manifest["artifacts"]:
        meta = json.loads((out / name / f"{name}.json").read_text())
        assert schema_errors(meta) == []
        assert str(out) not in json.dumps(meta)  # no absolute paths


# Spec files whose kernels cover every family (mla, mla_append, varlen and its masks, decode,
# kv_append, prefill): the default determinism check rebuilds these; -m slow every example
EVERY_FAMILY = ("deepseek_mla", "hybrid_pages", "llama3_8b_prefill", "speculative_masks")


@pytest.mark.parametrize("which", ["families", pytest.param("all", marks=pytest.mark.slow)])
def test_deterministic_across_cache_dirs_and_cwd(built, tmp_path, monkeypatch, toolchain, which):
    """Rebuilt from another cache directory and working directory, with an unrelated variable
    set, every artifact is byte-identical to the session build's."""
    out1, _ = built
    out2 = tmp_path / "o2"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PTXC_SOME_UNRELATED", "x")
    paths = [SPECS] if which == "all" else [SPECS / f"{name}.toml" for name in EVERY_FAMILY]
    run_build(paths, out2, progress=False, cache_dir=tmp_path / "other-cache")
    if which == "all":
        assert tree(out1) == tree(out2)
        return
    rebuilt = [p.name for p in out2.iterdir() if p.is_dir()]
    assert len(rebuilt) >= 20
    for name in rebuilt:
        assert tree(out1 / name) == tree(out2 / name), name


def test_warm_rebuild_touches_nothing(tmp_path, toolchain):
    cache = tmp_path / "c"
    out = tmp_path / "o"
    run_build([SPECS / "llama3_8b.toml"], out, progress=False, cache_dir=cache)
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    summary = run_build([SPECS / "llama3_8b.toml"], out, progress=False, cache_dir=cache)
    assert summary["files_changed"] == 0 and summary["cache"]["misses"] == 0
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == stamps


def test_corrupt_cache_entry_is_rebuilt_with_warning(tmp_path, toolchain, capsys):
    cache = tmp_path / "c"
    run_build([SPECS / "llama3_8b.toml"], tmp_path / "o1", progress=False, cache_dir=cache,
              targets=["sm_80"])
    entries = [p for p in (cache / "v2").rglob("*") if p.is_file() and not p.name.startswith(".")]
    for p in entries:
        data = bytearray(p.read_bytes())
        data[-1] ^= 1
        p.write_bytes(bytes(data))
    run_build([SPECS / "llama3_8b.toml"], tmp_path / "o2", progress=False, cache_dir=cache,
              targets=["sm_80"])
    assert "corrupt" in capsys.readouterr().err
    assert tree(tmp_path / "o1") == tree(tmp_path / "o2")


@pytest.mark.parametrize("victim", ["ptx", "cubin", "json"])
def test_verify_detects_an_edited_byte(built, tmp_path, victim):
    """Verifying the artifact's own directory: the per-artifact check a set's verify runs for
    each of its artifacts (test_verify_detects_manifest_disagreement and
    test_verify_ok_on_build_artifact_and_spec verify the whole set), without re-deriving the
    other 40-odd kernels."""
    out = tmp_path / "copy"
    shutil.copytree(built[0], out)
    art = out / "llama3_8b_decode"
    path = art / ("llama3_8b_decode.json" if victim == "json" else f"llama3_8b_decode.sm_80.{victim}")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    r = CliRunner().invoke(main, ["verify", str(art)])
    assert r.exit_code == 1, r.output
    assert "llama3_8b_decode" in r.output and "FAILED" in r.output


def test_verify_detects_manifest_disagreement(tmp_path):
    """A manifest listing an artifact that is gone (one spec file's build: verifying the whole
    example build took ~30 s for the same check)."""
    out = tmp_path / "out"
    run_build([SPECS / "gpt2_f32.toml"], out, progress=False)
    shutil.rmtree(out / "gpt2_decode_f32")
    r = CliRunner().invoke(main, ["verify", str(out)])
    assert r.exit_code == 1 and "lists 'gpt2_decode_f32'" in r.output


def test_verify_ok_on_build_artifact_and_spec(built):
    out, _ = built
    for path in (out, out / "mqa_d256_decode", SPECS / "mqa_d256.toml"):
        r = CliRunner().invoke(main, ["verify", str(path)])
        assert r.exit_code == 0, r.output
        assert "verify: OK" in r.output


def test_no_verify_writes_ptx_only(tmp_path):
    r = CliRunner().invoke(main, ["build", str(SPECS / "llama3_8b.toml"), "--out", str(tmp_path), "--no-verify", "--json"])
    assert r.exit_code == 0, r.output
    meta = json.loads((tmp_path / "llama3_8b_decode" / "llama3_8b_decode.json").read_text())
    assert meta["verified"] is False and all("cubin" not in t for t in meta["targets"].values())
    assert not list(tmp_path.rglob("*.cubin"))


def test_missing_and_broken_ptxas_are_one_line_exit_2(tmp_path, monkeypatch):
    spec = str(SPECS / "llama3_8b.toml")
    monkeypatch.setenv("PTXAS", str(tmp_path / "nope"))
    r = CliRunner().invoke(main, ["build", spec, "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "PTXAS=" in r.output and len(r.output.strip().splitlines()) == 1
    fake = tmp_path / "ptxas"
    fake.write_text("#!/bin/sh\necho boom >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PTXAS", str(fake))
    r = CliRunner().invoke(main, ["build", spec, "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "broken" in r.output and len(r.output.strip().splitlines()) == 1


def test_inspect_and_list(built):
    r = CliRunner().invoke(main, ["inspect", str(built[0] / "mistral_7b_decode")])
    assert r.exit_code == 0 and "[batch, 32, 128]" in r.output and "k_cache.stride(1)" in r.output
    r = CliRunner().invoke(main, ["list"])
    assert r.exit_code == 0 and "decode" in r.output and "tile.num_warps" in r.output


def test_cache_commands(tmp_path, monkeypatch):
    monkeypatch.setenv("PTXC_CACHE_DIR", str(tmp_path / "cc"))
    r = CliRunner().invoke(main, ["cache", "path"])
    assert r.output.strip() == str(tmp_path / "cc")
    CliRunner().invoke(main, ["build", str(SPECS / "gpt2_f32.toml"), "--out", str(tmp_path / "o"), "--no-verify"])
    info = json.loads(CliRunner().invoke(main, ["cache", "info", "--json"]).output)
    assert info["entries"] == 5
    assert "removed 5" in CliRunner().invoke(main, ["cache", "clear"]).output


def test_a_launch_over_the_targets_shared_memory_is_a_problem():
    """ptxas never sees dynamic shared memory: a launch asking more than one CTA of the target
    may have is reported (exit 1 from build), naming the kernel, target, entry and both sizes."""
    from ptxc.pipeline.compiler import TargetBuild, check_resources
    from ptxc.spec.model import KernelSpec
    from ptxc.targets import TARGETS
    spec = KernelSpec.from_dict({"name": "k", "family": "prefill", "dtype": "f16", "head_dim": 64,
                                 "num_heads": 1, "num_kv_heads": 1, "softmax_scale": 0.125,
                                 "targets": ["sm_90a"]})
    limit = TARGETS["sm_90a"].max_smem_per_cta
    launch = {"entry": "ptxc_k", "static_smem_bytes": 0, "dynamic_smem_bytes": limit}
    assert check_resources(spec, TargetBuild("sm_90a", "", [launch], {})) == []
    over = TargetBuild("sm_90a", "", [{**launch, "static_smem_bytes": 16}], {})
    assert check_resources(spec, over) == [
        f"k [sm_90a] ptxc_k: needs {limit + 16} bytes of shared memory per CTA; sm_90a allows {limit}"]
