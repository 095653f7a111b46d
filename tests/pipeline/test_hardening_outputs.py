"""What the CLI writes and refuses around an artifact set: a repeated --target, a foreign or
damaged manifest, a file where an artifact's directory goes, outputs that would land inside an
artifact set, `pack` taking exactly the listed artifacts, malformed --measured files, a recorded
spec `verify --rebuild` must not build, metadata that is not UTF-8, and click's own usage errors
-- each one line, exit 2 for the user's input, 1 for a failed check, nothing half-written."""

import json
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from ptxc.cli import main
from ptxc.files import sha256

SPEC = '[[kernel]]\nname = "tiny"\nfamily = "decode"\ndtype = "f32"\nhead_dim = 16\nnum_heads = 1\ntargets = ["sm_80"]\n'


def ptxc(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_line(r, code: int, *needles: str) -> None:
    lines = r.output.strip().splitlines()
    assert r.exit_code == code and len(lines) == 1 and lines[0].startswith("error: "), r.output
    for n in needles:
        assert n in lines[0], r.output


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("outs")
    (root / "tiny.toml").write_text(SPEC)
    r = ptxc("build", root / "tiny.toml", "-o", root / "out", "--no-verify")
    assert r.exit_code == 0, r.output
    return root


def test_a_repeated_target_is_refused(built, tmp_path):
    r = ptxc("build", built / "tiny.toml", "-o", tmp_path / "o", "--target", "sm_80", "--target", "sm_80")
    one_line(r, 2, "--target sm_80 sm_80", "repeated")
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


@pytest.mark.parametrize("manifest,why", [
    ("[1]", "no 'artifacts' table"),
    ('{"artifacts": [1, 2]}', "no 'artifacts' table"),
    ('{"artifacts": {"x": {"metadata": "../../../etc/passwd"}}}', "entry 'x' is malformed"),
])
def test_a_foreign_or_damaged_manifest_is_neither_overwritten_nor_carried(built, tmp_path, manifest, why):
    out = tmp_path / "o"
    out.mkdir()
    (out / "manifest.json").write_text(manifest)
    one_line(ptxc("build", built / "tiny.toml", "-o", out, "--no-verify"), 2, why, "remove it")
    assert (out / "manifest.json").read_text() == manifest and not (out / "tiny").exists()


def test_a_file_where_an_artifact_directory_goes_is_found_first(built, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "tiny").write_text("mine")
    one_line(ptxc("build", built / "tiny.toml", "-o", out, "--no-verify"), 2, "exists and is not a directory")
    assert (out / "tiny").read_text() == "mine" and not (out / "manifest.json").exists()


@pytest.mark.parametrize("args", [
    ["report", "{out}", "--no-sass", "--html", "{out}/tiny/tiny.json"],
    ["pack", "{out}", "-o", "{out}/tiny/tiny.json"],
    ["pack", "{out}", "-o", "{out}/manifest.json"],
    ["emit-c-header", "{out}", "-o", "{out}/tiny/k.h"],
    ["merge", "{out}", "-o", "{out}/tiny"],
])
def test_no_output_lands_inside_an_artifact_set(built, args):
    out = built / "out"
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    r = ptxc(*[a.format(out=out) for a in args])
    one_line(r, 2, "inside the artifact")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_pack_takes_exactly_the_listed_artifacts(built, tmp_path):
    import shutil
    out = tmp_path / "o"
    shutil.copytree(built / "out", out)
    (out / "tiny" / "extra.txt").write_text("leftover")
    (out / "old.tgz").write_bytes(b"x")
    (out / "half").mkdir()
    (out / "half" / "half.sm_80.ptx").write_text("// half-written")
    r = ptxc("pack", out, "-o", tmp_path / "a.tgz")
    assert r.exit_code == 0, r.output
    with tarfile.open(tmp_path / "a.tgz") as tar:
        assert sorted(tar.getnames()) == ["manifest.json", "tiny/tiny.json", "tiny/tiny.sm_80.ptx"]
    shutil.copytree(out / "tiny", out / "zz")          # an artifact directory the manifest lacks
    (out / "zz" / "tiny.json").rename(out / "zz" / "zz.json")
    one_line(ptxc("pack", out, "-o", tmp_path / "b.tgz"), 1, "does not list artifact directory 'zz'")
    assert not (tmp_path / "b.tgz").exists()


@pytest.mark.parametrize("text,why", [
    ("[1, 2]", "'results' list of objects"), ('{"results": [5]}', "'results' list of objects"),
    ('{"results": [{"impl": "ptxc"}]}', "field 'kernel' is missing"),
    ('{"results": [{"impl": "ptxc", "kernel": "tiny", "target": "sm_80", "gpu": null, "intensity": 1,'
     ' "tflops": "fast", "median_ms": 1}]}', "field 'tflops' is missing or not a number"),
])
def test_a_malformed_measured_file_is_one_line(built, tmp_path, text, why):
    (tmp_path / "m.json").write_text(text)
    one_line(ptxc("report", built / "out", "--no-sass", "--measured", tmp_path / "m.json"), 2, why)


@pytest.mark.parametrize("args,why", [
    (["launch-test", "{out}/tiny", "--backend", "emu", "--seed", "-5"], "'--seed'"),
    (["verify", "{out}/nonexistent"], "does not exist"),
    (["build", "{out}/../tiny.toml", "-j", "0"], "'--jobs'"),
    (["nonsense"], "No such command"),
    (["report", "{out}", "--no-sass", "--shape", "batch=99999999999999999999"], "below 2^31"),
])
def test_click_usage_errors_are_one_line(built, args, why):
    one_line(ptxc(*[a.format(out=built / "out") for a in args]), 2, why)


def test_ptxc_alone_prints_the_help():
    r = ptxc()
    assert r.output.startswith("Usage: ") and "COMMAND [ARGS]" in r.output and "build" in r.output
    assert "error" not in r.output


@pytest.mark.parametrize("encode", ["utf-16", "bom"])
def test_metadata_that_is_not_plain_utf8_is_refused(built, tmp_path, encode):
    import shutil
    out = tmp_path / "o"
    shutil.copytree(built / "out", out)
    path = out / "tiny" / "tiny.json"
    text = path.read_text()
    raw = text.encode("utf-16") if encode == "utf-16" else b"\xef\xbb\xbf" + text.encode()
    path.write_bytes(raw)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["artifacts"]["tiny"]["metadata_sha256"] = sha256(raw)
    (out / "manifest.json").write_text(json.dumps(manifest))
    r = ptxc("inspect", out / "tiny")
    assert r.exit_code == 1 and ("not UTF-8" in r.output or "byte-order mark" in r.output), r.output


def test_rebuild_refuses_a_recorded_spec_no_spec_file_could_give(built, tmp_path):
    import shutil
    out = tmp_path / "o"
    shutil.copytree(built / "out", out)
    path = out / "tiny" / "tiny.json"
    meta = json.loads(path.read_text())
    meta["spec"]["head_dim"] = 12          # not a head size the decode family takes
    raw = json.dumps(meta).encode()
    path.write_bytes(raw)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["artifacts"]["tiny"]["metadata_sha256"] = sha256(raw)
    (out / "manifest.json").write_text(json.dumps(manifest))
    r = ptxc("verify", "--rebuild", out / "tiny")
    assert r.exit_code == 1 and "--rebuild: the recorded spec is invalid" in r.output, r.output
    assert "Traceback" not in r.output


@pytest.mark.parametrize("args", [("build", "{spec}", "-o", ""), ("verify", ""), ("emit-c-header", "{out}", "-o", " "),
                                  ("report", "{out}", "--html", "")])
def test_an_empty_path_is_refused_not_taken_for_the_current_directory(built, tmp_path, monkeypatch, args):
    monkeypatch.chdir(tmp_path)
    r = ptxc(*[a.format(spec=built / "tiny.toml", out=built / "out") for a in args])
    one_line(r, 2, "empty path")
    assert not list(tmp_path.iterdir())


def test_a_spec_directory_of_a_whole_file_system_is_refused(tmp_path, monkeypatch):
    import ptxc.spec.loader as loader
    monkeypatch.setattr(loader, "MAX_SPEC_DIR_ENTRIES", 50)
    for i in range(60):
        (tmp_path / "tree" / f"d{i // 10}").mkdir(parents=True, exist_ok=True)
        (tmp_path / "tree" / f"d{i // 10}" / f"f{i}.txt").write_text("")
    r = ptxc("build", tmp_path / "tree", "-o", tmp_path / "out")
    one_line(r, 2, "more than 50 entries", "name the spec files")
    assert not (tmp_path / "out").exists()
