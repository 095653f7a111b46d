"""`ptxc verify --rebuild` catches hand edits that a re-hashed manifest hides from plain verify."""

import json
import os
import re
import shutil

import pytest

from ptxc.pipeline.artifacts import MANIFEST
from ptxc.pipeline.build import run_build, run_verify
from ptxc.files import sha256
from ptxc.pipeline.metadata import dumps

SPEC = '''[[kernel]]
name = "rb"
family = "decode"
dtype = "f16"
head_dim = 64
num_heads = 4
num_kv_heads = 2
num_splits = 2
targets = ["sm_80"]
'''


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    root = tmp_path_factory.mktemp("rebuild")
    (root / "rb.toml").write_text(SPEC)
    with pytest.MonkeyPatch.context() as mp:  # the ptxas the tests themselves see (conftest drops PTXAS)
        mp.delenv("PTXAS", raising=False)
        run_build([root / "rb.toml"], root / "out", progress=False)
    return root / "out"


def tamper(clean, tmp_path, edit_meta=None, edit_ptx=None):
    """A copy of the output dir with the metadata (and maybe PTX) edited and every sha256 redone."""
    out = tmp_path / "out"
    shutil.copytree(clean, out)
    meta_path = out / "rb" / "rb.json"
    meta = json.loads(meta_path.read_text())
    t = meta["targets"]["sm_80"]
    if edit_ptx:
        ptx = out / "rb" / t["ptx"]
        ptx.write_text(edit_ptx(ptx.read_text()))
        t["ptx_sha256"] = sha256(ptx.read_bytes())
    if edit_meta:
        edit_meta(meta)
    meta_path.write_bytes(dumps(meta))
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["artifacts"]["rb"]["metadata_sha256"] = sha256(meta_path.read_bytes())
    (out / MANIFEST).write_bytes(dumps(manifest))
    return out


def test_clean_build_passes(clean):
    report = run_verify([clean], rebuild=True)
    assert report.ok, report.problems


def _set_grid(meta):
    meta["targets"]["sm_80"]["kernels"][0]["grid"][0] = "3"


def _set_smem(meta):
    meta["targets"]["sm_80"]["kernels"][0]["dynamic_smem_bytes"] += 1024


def _set_shape(meta):
    meta["tensors"]["q"]["shape"][-1] = 32


def _ptx_constant(ptx):
    # the softmax scale is a float constant in the PTX: change its last hex digit
    m = re.search(r"0f[0-9A-F]{8}", ptx)
    assert m
    bad = m.group(0)[:-1] + ("0" if m.group(0)[-1] != "0" else "1")
    return ptx[:m.start()] + bad + ptx[m.end():]


@pytest.mark.parametrize("edit_meta,edit_ptx,where", [
    (_set_grid, None, "/targets/sm_80/kernels/0/grid/0"),
    (_set_smem, None, "/targets/sm_80/kernels/0/dynamic_smem_bytes"),
    (_set_shape, None, "/tensors/q/shape/2"),
    (None, _ptx_constant, "rb.sm_80.ptx: differs"),
], ids=["grid", "smem", "shape", "ptx-constant"])
def test_rebuild_catches_edit_with_every_hash_redone(clean, tmp_path, edit_meta, edit_ptx, where):
    out = tamper(clean, tmp_path, edit_meta, edit_ptx)
    plain = run_verify([out])
    if edit_ptx is None:   # plain verify re-derives the launch metadata from the spec (checked.py)
        assert not plain.ok and any("differ" in p for p in plain.problems), plain.problems
    report = run_verify([out], rebuild=True)
    assert not report.ok
    assert any(where in p for p in report.problems), report.problems


def test_rebuild_needs_the_same_ptxas(clean, tmp_path):
    def other_ptxas(meta):
        meta["targets"]["sm_80"]["ptxas_version"] = "0.0.1"
    out = tamper(clean, tmp_path, other_ptxas)
    report = run_verify([out], rebuild=True)
    assert any("built with ptxas 0.0.1, installed is" in p for p in report.problems), report.problems


def test_cli_exit_codes(clean, tmp_path):
    from click.testing import CliRunner
    from ptxc.cli import main
    runner = CliRunner()
    assert runner.invoke(main, ["verify", "--rebuild", str(clean)]).exit_code == 0
    bad = runner.invoke(main, ["verify", "--rebuild", str(tamper(clean, tmp_path, _set_smem))])
    assert bad.exit_code == 1 and "dynamic_smem_bytes" in bad.output
    no_cubins = runner.invoke(main, ["build", "--fatbin", "--no-verify", "--out", str(tmp_path / "o"),
                                     str(clean.parent / "rb.toml")])
    assert no_cubins.exit_code == 2 and "--fatbin packs the cubins" in no_cubins.output
    (tmp_path / "rs").mkdir()   # a file output's parent must exist (docs/reliability.md)
    rust = runner.invoke(main, ["emit-rust", str(clean), "-o", str(tmp_path / "rs" / "k.rs")])
    text = (tmp_path / "rs" / "k.rs").read_text()
    rel = os.path.relpath(clean / "rb" / "rb.sm_80.cubin", tmp_path / "rs")
    assert rust.exit_code == 0 and f"include_bytes!(\"{rel}\")" in text
    not_a_build = runner.invoke(main, ["emit-rust", str(tmp_path / "rs")])
    assert not_a_build.exit_code == 2 and "no manifest.json" in not_a_build.output


def test_rebuild_never_reads_through_a_symlink(clean, tmp_path, monkeypatch):
    """A cubin replaced by a symlink to a huge (sparse) file outside: reported, never read."""
    out = tmp_path / "out"
    shutil.copytree(clean, out)
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        f.truncate(3 << 30)          # 3 GiB sparse: reading it would take 3 GiB of memory
    cubin = out / "rb" / "rb.sm_80.cubin"
    cubin.unlink()
    os.symlink(big, cubin)
    from pathlib import Path
    real_read_bytes = Path.read_bytes
    opened = []

    def guarded(self):
        if self.resolve() == big.resolve():
            opened.append(self)
            raise AssertionError(f"read through the symlink {self}")
        return real_read_bytes(self)
    monkeypatch.setattr(Path, "read_bytes", guarded)
    report = run_verify([out], rebuild=True)
    assert not opened
    assert any("rb.sm_80.cubin" in p and "symlink" in p for p in report.problems), report.problems
