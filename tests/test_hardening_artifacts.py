"""Issue 15, defects 3-4: metadata is never trusted blindly, and no artifact path escapes its
directory. Every consumer refuses a tampered artifact (even with the manifest hash refreshed)
with one line and exit 1; crafted names never reach generated C; symlinks are never followed."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from ptxc.cli import main
from ptxc.pipeline.build import run_build
from ptxc.pipeline.cache import sha256
from ptxc.pipeline.metadata import dumps

NAME = "hk"
SPEC = f"""
[[kernel]]
name = "{NAME}"
family = "decode"
dtype = "f32"
head_dim = 32
num_heads = 2
return_lse = true
targets = ["sm_80", "sm_86"]
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("hard")
    (root / "k.toml").write_text(SPEC)
    run_build([root / "k.toml"], root / "out", progress=False, cache_dir=root / "cache")
    rng = np.random.default_rng(0)
    inputs = {"q": rng.standard_normal((2, 2, 32)).astype(np.float32),
              "k_cache": rng.standard_normal((2, 7, 2, 32)).astype(np.float32),
              "v_cache": rng.standard_normal((2, 7, 2, 32)).astype(np.float32),
              "seq_lens": np.array([5, 7], np.int32)}
    np.savez(root / "in.npz", **inputs)
    return root


def copy_out(built, tmp_path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(built / "out", out, symlinks=True)
    return out


def tamper(out: Path, edit, refresh: bool = True) -> None:
    """Edit the metadata and (like an attacker would) refresh the manifest's hash of it."""
    path = out / NAME / f"{NAME}.json"
    meta = json.loads(path.read_text())
    edit(meta)
    raw = dumps(meta)
    path.write_bytes(raw)
    if refresh:
        manifest = json.loads((out / "manifest.json").read_text())
        manifest["artifacts"][NAME]["metadata_sha256"] = sha256(raw)
        (out / "manifest.json").write_bytes(dumps(manifest))


def consumers(out: Path, built: Path, tmp_path: Path) -> dict[str, list[str]]:
    art = str(out / NAME)
    return {
        "run": ["run", art, "--inputs", str(built / "in.npz"), "--output", str(tmp_path / "r.npz"),
                "--backend", "emu"],
        "launch-test": ["launch-test", art, "--backend", "emu", "--shape", "batch=2,max_seq_len=7"],
        "inspect": ["inspect", art],
        "report": ["report", art, "--no-sass", "--json"],
        "emit-c-header": ["emit-c-header", str(out), "-o", str(tmp_path / "k.h")],
        "pack": ["pack", str(out), "-o", str(tmp_path / "k.tar.gz")],
        "merge": ["merge", str(out), "--out", str(tmp_path / "merged")],
        "verify": ["verify", str(out)],
    }


def assert_one_line_failure(r, code=1):
    assert r.exit_code == code, (r.exit_code, r.output)
    lines = [l for l in r.output.splitlines() if l.startswith("error:")]
    assert "Traceback" not in r.output and "internal error" not in r.output, r.output
    return lines


def _swap_pointers(meta):
    params = meta["targets"]["sm_80"]["kernels"][0]["params"]
    ptrs = [p for p in params if p["source"]["kind"] == "pointer"]
    ptrs[1]["source"]["tensor"], ptrs[2]["source"]["tensor"] = ptrs[2]["source"]["tensor"], ptrs[1]["source"]["tensor"]


MUTATIONS = {
    "grid": lambda m: m["targets"]["sm_80"]["kernels"][0]["grid"].__setitem__(0, "batch * 2"),
    "block": lambda m: m["targets"]["sm_80"]["kernels"][0]["block"].__setitem__(0, 64),
    "smem": lambda m: m["targets"]["sm_80"]["kernels"][0].__setitem__("dynamic_smem_bytes", 4096),
    "pointer swap": _swap_pointers,
    "shape": lambda m: m["tensors"]["q"]["shape"].__setitem__(1, 4),
    "dtype": lambda m: m["tensors"]["q"].__setitem__("dtype", "f16"),
    "division by zero": lambda m: m["targets"]["sm_80"]["kernels"][0]["grid"].__setitem__(0, "cdiv(batch, 0)"),
    "deep nesting": lambda m: m["targets"]["sm_80"]["kernels"][0]["grid"].__setitem__(0, "(" * 3000 + "batch" + ")" * 3000),
    "C injection": lambda m: m["targets"]["sm_80"]["kernels"][0]["params"][0].__setitem__(
        "name", "q; } int evil(void) { return 1; } struct { int x"),
    "path escape": lambda m: m["targets"]["sm_80"].__setitem__("ptx", "/etc/passwd"),
    "parent path": lambda m: m["targets"]["sm_80"].__setitem__("ptx", "../../x.ptx"),
    "spec": lambda m: m["spec"].__setitem__("head_dim", 64),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_every_consumer_refuses_tampered_metadata(built, tmp_path, mutation):
    out = copy_out(built, tmp_path)
    tamper(out, MUTATIONS[mutation])
    for consumer, args in consumers(out, built, tmp_path).items():
        r = CliRunner().invoke(main, args)
        lines = assert_one_line_failure(r, 1)
        if consumer != "verify":
            assert len(lines) == 1, (consumer, r.output)
    assert not (tmp_path / "r.npz").exists() and not (tmp_path / "k.h").exists()
    assert not (tmp_path / "k.tar.gz").exists() and not (tmp_path / "merged" / NAME).exists()


def test_unrefreshed_edit_is_refused_by_the_manifest_hash(built, tmp_path):
    out = copy_out(built, tmp_path)
    tamper(out, lambda m: m.__setitem__("verified", False), refresh=False)
    r = CliRunner().invoke(main, ["inspect", str(out / NAME)])
    assert r.exit_code == 1 and "differs from" in r.output and "manifest.json" in r.output


def test_verify_rejects_a_swapped_cubin_with_refreshed_hashes(built, tmp_path):
    out = copy_out(built, tmp_path)
    d = out / NAME
    other = (d / f"{NAME}.sm_86.cubin").read_bytes()
    (d / f"{NAME}.sm_80.cubin").write_bytes(other)
    tamper(out, lambda m: m["targets"]["sm_80"].__setitem__("cubin_sha256", sha256(other)))
    r = CliRunner().invoke(main, ["verify", str(out)])
    assert r.exit_code == 1 and "is not what ptxas makes of the recorded PTX" in r.output


def test_verify_rejects_symlinked_artifact_and_files(built, tmp_path):
    out = copy_out(built, tmp_path)
    real = tmp_path / "elsewhere"
    shutil.move(out / NAME, real)
    os.symlink(real, out / NAME)
    r = CliRunner().invoke(main, ["verify", str(out)])
    assert r.exit_code == 1 and "symlink" in r.output
    out2 = copy_out(built, tmp_path / "b")
    ptx = out2 / NAME / f"{NAME}.sm_80.ptx"
    shutil.move(ptx, tmp_path / "real.ptx")
    os.symlink(tmp_path / "real.ptx", ptx)
    r = CliRunner().invoke(main, ["verify", str(out2)])
    assert r.exit_code == 1 and "symlink" in r.output
    r = CliRunner().invoke(main, ["run", str(out2 / NAME), "--inputs", str(built / "in.npz"),
                                  "--output", str(tmp_path / "r.npz"), "--backend", "emu"])
    assert r.exit_code == 1 and "symlink" in r.output


def test_pack_never_follows_a_symlinked_readme(built, tmp_path):
    out = copy_out(built, tmp_path)
    os.symlink("/etc/passwd", out / NAME / "README")
    r = CliRunner().invoke(main, ["pack", str(out), "-o", str(tmp_path / "p.tar.gz")])
    assert r.exit_code == 1 and "symlink" in r.output and not (tmp_path / "p.tar.gz").exists()


def test_manifest_lock_symlink_cannot_redirect_build(built, tmp_path):
    out = copy_out(built, tmp_path)
    target = tmp_path / "victim"
    (out / ".manifest.lock").unlink(missing_ok=True)
    os.symlink(target, out / ".manifest.lock")
    r = CliRunner().invoke(main, ["build", str(built / "k.toml"), "--out", str(out), "--no-verify"])
    assert r.exit_code == 2 and "lock" in r.output and "Traceback" not in r.output
    assert not target.exists()


def test_manifest_name_with_parent_path_is_refused(built, tmp_path):
    out = copy_out(built, tmp_path)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["artifacts"]["../evil/x"] = dict(manifest["artifacts"][NAME], metadata="../evil/x/x.json")
    (out / "manifest.json").write_bytes(dumps(manifest))
    for cmd in (["emit-c-header", str(out), "-o", str(tmp_path / "h.h")],
                ["pack", str(out), "-o", str(tmp_path / "p.tgz")],
                ["merge", str(out), "--out", str(tmp_path / "m")]):
        r = CliRunner().invoke(main, cmd)
        assert r.exit_code == 1 and "not a kernel name" in r.output, (cmd, r.output)


def test_symlinked_artifact_dir_in_out_is_not_written_through(built, tmp_path):
    out = copy_out(built, tmp_path)
    real = tmp_path / "elsewhere"
    shutil.move(out / NAME, real)
    os.symlink(real, out / NAME)
    r = CliRunner().invoke(main, ["build", str(built / "k.toml"), "--out", str(out), "--no-verify"])
    assert r.exit_code == 2 and "symlink" in r.output


def test_untampered_artifact_runs_and_matches_reference(built, tmp_path):
    from ptxc.runtime import load
    from ptxc.reference import decode
    art = load(built / "out" / NAME)
    with np.load(built / "in.npz") as z:
        inputs = {k: z[k] for k in z.files}
    out = art.run(inputs, backend="emu")
    o, lse = decode(inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["seq_lens"],
                    art.meta["spec"]["softmax_scale"])
    assert np.abs(out["o"] - o).max() < 1e-4 and np.abs(out["lse"] - lse).max() < 1e-4


def test_concurrent_builds_of_one_name_from_two_specs_never_mix(tmp_path):
    import subprocess
    import sys
    from ptxc.pipeline.checked import load_checked
    for d in (64, 128):
        (tmp_path / f"s{d}.toml").write_text(SPEC.replace(f'name = "{NAME}"', 'name = "dup"')
                                             .replace("head_dim = 32", f"head_dim = {d}"))
    out = tmp_path / "out"
    for _ in range(3):
        procs = [subprocess.Popen([sys.executable, "-m", "ptxc.cli", "build", str(tmp_path / f"s{d}.toml"),
                                   "--out", str(out), "--no-verify", "--no-cache"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for d in (64, 128)]
        assert all(p.wait(timeout=300) == 0 for p in procs)
        meta = load_checked(out / "dup")   # consistent: files, hashes, manifest and spec agree
        assert meta["spec"]["head_dim"] in (64, 128)
