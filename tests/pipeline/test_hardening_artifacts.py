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
from ptxc.errors import PtxcError
from ptxc.files import sha256
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
    # a scalar the spec does not have would let `--set num_pages=...` override a dim
    "extra scalar": lambda m: m["scalars"].__setitem__("num_pages", {"dtype": "f32"}),
    "softmax_scale": lambda m: m["spec"].__setitem__("softmax_scale", m["spec"]["softmax_scale"] * 2),
    "spec not in normal form": lambda m: m["spec"].pop("alibi"),
    "targets": lambda m: m["targets"].pop("sm_86"),
    "occupancy": lambda m: m["targets"]["sm_80"]["kernels"][0]["occupancy"].__setitem__("ctas_per_sm", 99),
    "ptx_version": lambda m: m["targets"]["sm_80"].__setitem__("ptx_version", "9.9"),
    "verified": lambda m: m.__setitem__("verified", False),
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


def altered_cubin(d: Path) -> bytes:
    """sm_80's cubin with one byte of its middle flipped: still an sm_80 ELF naming the recorded
    kernel (the checks without ptxas pass it), not what ptxas makes of the PTX."""
    from ptxc.pipeline.cubin_elf import cubin_sm, has_kernel
    data = bytearray((d / f"{NAME}.sm_80.cubin").read_bytes())
    data[len(data) // 2] ^= 0xFF
    assert cubin_sm(bytes(data)) == 80 and has_kernel(bytes(data), f"ptxc_{NAME}")
    return bytes(data)


def test_verify_rejects_a_swapped_cubin_with_refreshed_hashes(built, tmp_path):
    out = copy_out(built, tmp_path)
    d = out / NAME
    other = altered_cubin(d)
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


# --- every metadata field a consumer reads is re-derived, checked or declared not trusted ---

def _schema_paths(node, schema, prefix=""):
    """Every field path of the metadata schema (`*` for any key or list index)."""
    if "$ref" in node:
        node = schema["$defs"][node["$ref"].split("/")[-1]]
    paths = []
    for key, sub in node.get("properties", {}).items():
        path = f"{prefix}{key}"
        paths.append(path)
        if path == "spec":
            continue    # the spec is re-derived as a whole (normal form, validated by the spec rules)
        paths += _schema_paths(sub, schema, path + ".")
    for key in ("additionalProperties", "items"):
        sub = node.get(key)
        if isinstance(sub, dict) and prefix and ("properties" in sub or "$ref" in sub or "items" in sub):
            paths += _schema_paths(sub, schema, prefix + "*.")
    return paths


def test_every_schema_field_is_rederived_or_declared_not_trusted():
    from ptxc.pipeline.checked import TRUST
    from ptxc.pipeline.metadata import schema
    paths = set(_schema_paths(schema(), schema()))
    undecided = sorted(p for p in paths if p not in TRUST)
    assert not undecided, f"metadata fields with no trust decision in checked.TRUST: {undecided}"
    assert set(TRUST.values()) <= {"re-derived", "checked", "not trusted"}
    assert not sorted(set(TRUST) - paths), "TRUST names fields the schema no longer has"
    doc = (Path(__file__).resolve().parents[2] / "docs" / "reliability.md").read_text()
    missing = sorted(p for p in TRUST if f"`{p}`" not in doc)
    assert not missing, f"docs/reliability.md's metadata table lacks {missing}"


def test_empty_scalars_are_named_as_scalars(tmp_path):
    """An FP8 kernel whose metadata says `scalars = {}`: refused naming `scalars`, not v_scale."""
    spec = tmp_path / "f.toml"
    spec.write_text(SPEC.replace('dtype = "f32"', 'dtype = "f16"\nkv_dtype = "e4m3"').replace(
        ', "sm_86"', ""))
    run_build([spec], tmp_path / "out", progress=False, verify=False, cache_dir=tmp_path / "cache")
    out = tmp_path / "out"
    assert json.loads((out / NAME / f"{NAME}.json").read_text())["scalars"]
    tamper(out, lambda m: m.__setitem__("scalars", {}))
    r = CliRunner().invoke(main, ["inspect", str(out / NAME)])
    lines = assert_one_line_failure(r, 1)
    assert len(lines) == 1 and "scalars differ" in lines[0] and "v_scale" in lines[0], r.output
    assert "unexpected input" not in r.output


def test_recorded_ptxas_version_never_turns_the_cubin_compare_off(built, tmp_path):
    out = copy_out(built, tmp_path)
    d = out / NAME
    other = altered_cubin(d)
    (d / f"{NAME}.sm_80.cubin").write_bytes(other)

    def edit(m):
        m["targets"]["sm_80"]["cubin_sha256"] = sha256(other)
        m["targets"]["sm_80"]["ptxas_version"] = "0.0.1"
    tamper(out, edit)
    r = CliRunner().invoke(main, ["verify", str(out)])
    assert r.exit_code == 1 and "cannot be byte-compared" in r.output, r.output
    # an untouched artifact whose version string alone is edited: still no silent pass
    out2 = tmp_path / "o2"
    shutil.copytree(built / "out", out2)
    tamper(out2, lambda m: m["targets"]["sm_80"].__setitem__("ptxas_version", "0.0.1"))
    r = CliRunner().invoke(main, ["verify", str(out2)])
    assert r.exit_code == 1 and "cannot be byte-compared" in r.output, r.output
    r = CliRunner().invoke(main, ["verify", "--allow-other-ptxas", str(out2)])
    assert r.exit_code == 0 and "not checked" in r.output and "--allow-other-ptxas" in r.output, r.output


def test_swapped_fatbin_is_refused(tmp_path):
    """Another build's fatbin copied in, its hash refreshed and the manifest re-signed."""
    spec = tmp_path / "k.toml"
    spec.write_text(SPEC)
    other = tmp_path / "other.toml"
    other.write_text(SPEC.replace("return_lse = true", "return_lse = false"))
    run_build([spec], tmp_path / "out", progress=False, fatbin=True, cache_dir=tmp_path / "cache")
    run_build([other], tmp_path / "o2", progress=False, fatbin=True, cache_dir=tmp_path / "cache")
    out = tmp_path / "out"
    assert CliRunner().invoke(main, ["verify", str(out)]).exit_code == 0
    data = (tmp_path / "o2" / NAME / f"{NAME}.fatbin").read_bytes()
    (out / NAME / f"{NAME}.fatbin").write_bytes(data)
    tamper(out, lambda m: m["fatbin"].__setitem__("sha256", sha256(data)))
    for args in (["verify", str(out)], ["emit-c-header", str(out), "-o", str(tmp_path / "k.h")],
                 ["emit-rust", str(out), "-o", str(tmp_path / "k.rs")]):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 1 and "image for sm_" in r.output, (args, r.output)
    assert not (tmp_path / "k.h").exists() and not (tmp_path / "k.rs").exists()


def test_a_scalar_shadowing_a_dim_is_refused_before_run(built, tmp_path):
    """The issue's attack: a scalar named like a dim would let `--set` override the dim after
    its range checks (a kernel then writes past its buffers)."""
    out = copy_out(built, tmp_path)
    tamper(out, lambda m: m["scalars"].__setitem__("batch", {"dtype": "f32"}))
    args = consumers(out, built, tmp_path)["run"] + ["--set", "batch=100000"]
    r = CliRunner().invoke(main, args)
    lines = assert_one_line_failure(r, 1)
    assert len(lines) == 1 and "scalar 'batch' is also a dim" in lines[0], r.output
    assert not (tmp_path / "r.npz").exists()
    r = CliRunner().invoke(main, consumers(out, built, tmp_path)["emit-c-header"])
    assert r.exit_code == 1 and not (tmp_path / "k.h").exists()


@pytest.mark.parametrize("swap", ["other-target", "other-kernel"])
def test_a_cubin_of_another_target_or_kernel_is_refused_at_load(built, tmp_path, swap):
    """Without ptxas (an engine's load, inspect, the emitters): the cubin's ELF header names its
    SM and its section names its kernels (pipeline/cubin_elf.py), so sm_86's cubin recorded as
    sm_80's, or a cubin without the recorded entry, is refused even with every hash refreshed."""
    from ptxc.runtime import load
    out = copy_out(built, tmp_path)
    d = out / NAME
    if swap == "other-target":
        data = (d / f"{NAME}.sm_86.cubin").read_bytes()
        want = "assembled for sm_86, not sm_80"
    else:
        data = (d / f"{NAME}.sm_80.cubin").read_bytes().replace(b".text.ptxc_", b".text.ptxX_")
        want = "holds no kernel ptxc_"
    (d / f"{NAME}.sm_80.cubin").write_bytes(data)
    tamper(out, lambda m: m["targets"]["sm_80"].__setitem__("cubin_sha256", sha256(data)))
    with pytest.raises(PtxcError, match=want):
        load(d)
