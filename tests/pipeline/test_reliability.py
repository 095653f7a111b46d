"""Faults: broken toolchains, concurrent builders on one cache and output, killed builds,
unusable cache directories; sharded generation, merge and reproducible packs."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import SPECS
from ptxc.cli import main

PTXC = [sys.executable, "-m", "ptxc.cli"]


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.startswith(".")}


def fake_ptxas(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "ptxas"
    p.write_text("#!/bin/sh\nif [ \"$1\" = \"--version\" ]; then echo 'Cuda compilation tools, "
                 "release 12.0, V12.0.76'; exit 0; fi\n" + body)
    p.chmod(0o755)
    return p


@pytest.mark.parametrize("body,expected", [
    ("echo \"ptxas $2, line 1; fatal   : Unsupported .version 8.7; current version is '7.8'\" >&2\nexit 255\n",
     "too old"),
    ("kill -SEGV $$\n", "crashed"),
    ("echo \"ptxas fatal   : Value 'sm_120' is not defined for option 'gpu-name'\" >&2\nexit 255\n",
     "does not support sm_120"),
])
def test_toolchain_faults_are_one_line_exit_2(tmp_path, monkeypatch, body, expected):
    monkeypatch.setenv("PTXAS", str(fake_ptxas(tmp_path, body)))
    r = CliRunner().invoke(main, ["build", str(SPECS / "llama3_8b.toml"), "--out", str(tmp_path / "o"),
                                  "--target", "sm_120", "-j", "1"])
    assert r.exit_code == 2, r.output
    assert expected in r.output and len(r.output.strip().splitlines()) == 1


def test_shards_cover_everything_once_and_merge(tmp_path):
    names = []
    for i in (1, 2, 3):
        r = CliRunner().invoke(main, ["build", str(SPECS), "--out", str(tmp_path / f"s{i}"),
                                      "--shard", f"{i}/3", "--no-verify", "--json"])
        assert r.exit_code == 0, r.output
        names += [k["name"] for k in json.loads(r.output)["kernels"]]
    full = tmp_path / "full"
    CliRunner().invoke(main, ["build", str(SPECS), "--out", str(full), "--no-verify"])
    assert sorted(names) == sorted(json.loads((full / "manifest.json").read_text())["artifacts"])
    r = CliRunner().invoke(main, ["merge", *(str(tmp_path / f"s{i}") for i in (1, 2, 3)),
                                  "--out", str(tmp_path / "merged")])
    assert r.exit_code == 0, r.output
    assert tree(tmp_path / "merged") == tree(full)


def test_merge_conflict_and_bad_shard(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        CliRunner().invoke(main, ["build", str(SPECS / "gpt2_f32.toml"), "--out", str(out), "--no-verify"])
    meta = b / "gpt2_decode_f32" / "gpt2_decode_f32.json"
    data = json.loads(meta.read_text())
    data["verified"] = True  # same name, different content
    meta.write_text(json.dumps(data))
    r = CliRunner().invoke(main, ["merge", str(a), str(b), "--out", str(tmp_path / "m")])
    assert r.exit_code != 0 and "gpt2_decode_f32" in r.output
    r = CliRunner().invoke(main, ["build", str(SPECS), "--shard", "4/3", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "1 <= i <= N" in r.output


def test_pack_is_reproducible(tmp_path):
    out = tmp_path / "o"
    CliRunner().invoke(main, ["build", str(SPECS / "gpt2_f32.toml"), "--out", str(out), "--no-verify"])
    (out / ".stale.tmp").write_text("junk")
    for name in ("a.tgz", "b.tgz"):
        r = CliRunner().invoke(main, ["pack", str(out), "-o", str(tmp_path / name)])
        assert r.exit_code == 0, r.output
        os.utime(out / "gpt2_decode_f32" / "gpt2_decode_f32.json", (1, time.time()))
    assert (tmp_path / "a.tgz").read_bytes() == (tmp_path / "b.tgz").read_bytes()
    import tarfile
    with tarfile.open(tmp_path / "a.tgz") as t:
        members = t.getmembers()
    assert [m.name for m in members] == sorted(m.name for m in members)
    assert all(m.mtime == 0 and m.uid == 0 and m.uname == "" for m in members)
    assert not any(".stale" in m.name for m in members)


def _concurrent_builds(tmp_path: Path, n: int, extra: list[str], every_spec: bool = False) -> None:
    """n builders, alternately of a larger and an overlapping smaller spec set, on one cache and
    one output directory: the output equals a lone build of the larger set and verifies. By
    default the larger set is five files of every family (decode, prefill, varlen, masks, FP8);
    `every_spec`: the whole example directory (test_build builds it on its own)."""
    cache, out = tmp_path / "cache", tmp_path / "shared-out"
    env = {**os.environ, "PTXC_CACHE_DIR": str(cache)}
    small = [str(SPECS / "llama3_8b.toml"), str(SPECS / "mqa_d256.toml")]
    large = [str(SPECS)] if every_spec else small + [
        str(SPECS / f) for f in ("llama3_8b_prefill.toml", "serve_varlen.toml", "speculative_masks.toml",
                                 "qwen2_7b_fp8_head_scales.toml")]
    spec_sets = [large, small]
    procs = [subprocess.Popen(PTXC + ["build", *spec_sets[i % 2], "--out", str(out), "-j", "1", *extra],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(n)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err.decode()
    reference = tmp_path / "reference"
    subprocess.run(PTXC + ["build", *large, "--out", str(reference), *extra], check=True,
                   env={**os.environ, "PTXC_CACHE_DIR": str(tmp_path / "ref-cache")}, capture_output=True)
    assert tree(out) == tree(reference)
    r = subprocess.run(PTXC + ["verify", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_eight_concurrent_builders_share_cache_and_output(tmp_path):
    _concurrent_builds(tmp_path, 8, ["--target", "sm_80"])


@pytest.mark.slow
def test_eight_concurrent_builders_all_targets(tmp_path):
    _concurrent_builds(tmp_path, 8, [], every_spec=True)


def test_sigkill_mid_build_leaves_nothing_corrupt(tmp_path):
    """Three spec files (five kernels, ~2.5 s to build on 2 cores), so every kill lands mid-build
    and the rebuild + verify after them stays short; the whole example set's build is
    test_build's."""
    cache, out, specs = tmp_path / "cache", tmp_path / "o", tmp_path / "specs"
    specs.mkdir()
    for name in ("llama3_8b", "serve_varlen", "gpt2_f32"):
        (specs / f"{name}.toml").write_bytes((SPECS / f"{name}.toml").read_bytes())
    env = {**os.environ, "PTXC_CACHE_DIR": str(cache)}
    for delay in (0.3, 0.6, 0.9):
        p = subprocess.Popen(PTXC + ["build", str(specs), "--out", str(out), "-j", "2"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait()
    r = subprocess.run(PTXC + ["build", str(specs), "--out", str(out)], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "corrupt" not in r.stderr
    r = subprocess.run(PTXC + ["verify", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def test_unusable_cache_dir_falls_back_with_warning(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("PTXC_CACHE_DIR", str(blocker / "cache"))
    r = subprocess.run(PTXC + ["build", str(SPECS / "gpt2_f32.toml"), "--out", str(tmp_path / "o"),
                               "--no-verify"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "warning: cache directory" in r.stderr and "without the cache" in r.stderr
    assert (tmp_path / "o" / "gpt2_decode_f32" / "gpt2_decode_f32.json").exists()


def test_truncated_and_foreign_cache_entries_are_rebuilt(tmp_path, monkeypatch, capsys):
    from ptxc.pipeline.build import run_build
    cache = tmp_path / "c"
    run_build([SPECS / "gpt2_f32.toml"], tmp_path / "o1", verify=False, progress=False, cache_dir=cache)
    entries = sorted(p for p in (cache / "v2").rglob("*") if p.is_file() and not p.name.startswith("."))
    entries[0].write_bytes(entries[0].read_bytes()[:40])        # truncated
    entries[1].write_bytes(b"somebody else's file\n")          # foreign
    run_build([SPECS / "gpt2_f32.toml"], tmp_path / "o2", verify=False, progress=False, cache_dir=cache)
    assert capsys.readouterr().err.count("corrupt") == 2
    assert tree(tmp_path / "o1") == tree(tmp_path / "o2")


def test_rustc_probe_skips_a_rustc_that_does_not_run(tmp_path, monkeypatch):
    """A rustup proxy without a default toolchain is on PATH but cannot run: the Rust loader
    tests must skip with that reason, not fail."""
    import conftest
    fake = tmp_path / "rustc"
    fake.write_text("#!/bin/sh\necho 'error: rustup could not choose a version of rustc to run' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    why = conftest._probe_rustc()
    assert why is not None and "exits 1" in why and "rustup could not choose" in why


def test_make_build_installs_only_the_toolchain():
    """`make build` must not pull the test extras (Triton, ~1 GB) into the venv; `make test`
    installs them. Both still start from nothing (the venv is created by the build stamp)."""
    env = {**os.environ, "MAKEFLAGS": ""}
    root = Path(__file__).resolve().parents[2]

    def plan(target):
        r = subprocess.run(["make", "-n", "-B", target], cwd=root, capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr
        return [l for l in r.stdout.splitlines() if "pip install" in l and " -e " in l]
    build, test = plan("build"), plan("test")
    assert build and all("test" not in l.split(" -e ", 1)[1] for l in build), build
    assert any("[toolchain,test]" in l for l in test), test
    assert any("-m venv" in l for l in subprocess.run(["make", "-n", "-B", "test"], cwd=root, capture_output=True,
                                                       text=True, env=env).stdout.splitlines())


def test_wgmma_ptxas_serialised_is_a_failed_check(tmp_path, monkeypatch, toolchain):
    """ptxas's C75xx notes (here: it serialised an entry's wgmma, each waiting for the one
    before, a several-fold slowdown the kernel was not written for) fail the build like a
    spill: exit 1, the entry named. A wrapper around the real ptxas adds the note for every
    entry it compiles."""
    wrapper = tmp_path / "ptxas"
    wrapper.write_text(
        f'#!/bin/sh\n[ "$1" = "--version" ] && exec "{toolchain.path}" --version\n'
        f'out=$("{toolchain.path}" "$@" 2>&1); rc=$?\nprintf "%s\\n" "$out" >&2\n'
        'printf "%s\\n" "$out" | sed -n "s/.*Compiling entry function \'\\([^\']*\\)\'.*/ptxas info    '
        ': (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to '
        'a test in the function \'\\1\'/p" >&2\nexit $rc\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PTXAS", str(wrapper))
    r = CliRunner().invoke(main, ["build", str(SPECS / "llama3_8b.toml"), "--out", str(tmp_path / "o"),
                                  "--target", "sm_90a", "-j", "1", "--no-cache"])
    assert r.exit_code == 1, r.output
    assert "potential performance loss" in r.output and "ptxc_llama3_8b_decode_split" in r.output


def test_performance_notes_go_to_the_entry_they_name_or_the_one_being_compiled():
    """A C75xx note names its function (wgmma serialised) or not (setmaxnreg ignored: the entry
    ptxas is compiling); either way the entry's resources count it, and 0 stays out of the
    metadata."""
    from ptxc.pipeline.ptxas import Resources, parse_resources, performance_notes
    log = ("ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are "
           "serialized due to a test in the function 'k_b' in line 0\n"
           "ptxas info    : Compiling entry function 'k_a' for 'sm_90a'\n"
           "ptxas info    : (C7508) Potential Performance Loss: 'setmaxnreg' ignored; unable to "
           "determine register count at entry.\n"
           "ptxas info    : Used 168 registers, used 1 barriers\n"
           "ptxas info    : Compiling entry function 'k_b' for 'sm_90a'\n"
           "ptxas info    : Used 96 registers\n")
    assert performance_notes(log) == {
        "k_b": ["C7514: wgmma.mma_async instructions are serialized due to a test"],
        "k_a": ["C7508: 'setmaxnreg' ignored; unable to determine register count at entry"]}
    res = parse_resources(log)
    assert (res["k_a"].performance_notes, res["k_a"].registers) == (1, 168)
    assert (res["k_b"].performance_notes, res["k_b"].registers) == (1, 96)
    assert "performance_notes" not in Resources(registers=1).to_dict()
