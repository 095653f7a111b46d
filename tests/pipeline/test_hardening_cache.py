"""Issue 15, defects 1-2: the cache touches only what it created, and every entry carries and
re-checks its own stage and key (a swapped, foreign or malformed entry is rebuilt with a warning)."""

import os
import shutil
import threading
from pathlib import Path

from click.testing import CliRunner

from conftest import SPECS
from ptxc.cli import main
from ptxc.pipeline.build import run_build
from ptxc.pipeline.cache import ENTRIES, MARKER, Cache

SPEC_TEXT = """
[[kernel]]
name = "{name}"
family = "decode"
dtype = "f32"
head_dim = {d}
num_heads = 2
targets = ["sm_80"]
"""


def _tree(d: Path) -> dict:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()
            and not p.name.startswith(".")}


def _entries(cache: Path, stage: str) -> list[Path]:
    return sorted(p for p in (cache / ENTRIES / stage).rglob("*") if p.is_file())


def test_clear_on_a_foreign_directory_removes_nothing(tmp_path, monkeypatch):
    home_cache = tmp_path / "dot-cache"
    (home_cache / "pip" / "wheels").mkdir(parents=True)
    (home_cache / "pip" / "wheels" / "x.whl").write_bytes(b"precious")
    (home_cache / "ab").mkdir()
    (home_cache / "ab" / ("ab" + "0" * 62)).write_bytes(b"looks like a key, is not ours")
    monkeypatch.setenv("PTXC_CACHE_DIR", str(home_cache))
    r = CliRunner().invoke(main, ["cache", "clear"])
    assert r.exit_code == 2 and "not a ptxc cache" in r.output and "Traceback" not in r.output
    assert (home_cache / "pip" / "wheels" / "x.whl").read_bytes() == b"precious"
    info = CliRunner().invoke(main, ["cache", "info", "--json"])
    assert '"entries": 0' in info.output


def test_clear_and_info_only_touch_own_entries(tmp_path, monkeypatch):
    cache = tmp_path / "c"
    monkeypatch.setenv("PTXC_CACHE_DIR", str(cache))
    run_build([SPECS / "gpt2_f32.toml"], tmp_path / "o", verify=False, progress=False, cache_dir=cache)
    assert (cache / MARKER).is_file()
    own = len(_entries(cache, "ptx"))
    assert own >= 1
    # foreign files inside and beside the cache's own tree
    (cache / "notes.txt").write_text("mine")
    (cache / ENTRIES / "ptx" / "zz").mkdir()
    (cache / ENTRIES / "ptx" / "zz" / "readme").write_text("mine")
    prefix = _entries(cache, "ptx")[0].parent
    (prefix / "not-a-key").write_text("mine")
    outside = tmp_path / "outside"
    outside.mkdir()
    # a symlinked key-prefix directory, at a prefix no entry of the build uses (keys change
    # with ptxc's source, so a fixed prefix would collide one day)
    used = {e.parent.name for e in _entries(cache, "ptx")}
    link = next(p for p in (f"{i:02x}" for i in range(256)) if p not in used)
    (outside / (link + "1" * 62)).write_text("mine")
    os.symlink(outside, cache / ENTRIES / "ptx" / link)
    info = Cache(enabled=False).info()
    assert info["entries"] == own
    r = CliRunner().invoke(main, ["cache", "clear"])
    assert r.exit_code == 0 and f"removed {own} entr" in r.output
    assert (cache / "notes.txt").exists() and (cache / ENTRIES / "ptx" / "zz" / "readme").exists()
    assert (prefix / "not-a-key").exists() and (outside / (link + "1" * 62)).exists()
    assert _entries(cache, "ptx") == sorted([prefix / "not-a-key", cache / ENTRIES / "ptx" / "zz" / "readme"])


def test_removed_entry_is_singular(tmp_path, monkeypatch):
    cache = tmp_path / "c"
    monkeypatch.setenv("PTXC_CACHE_DIR", str(cache))
    Cache().put("ptx", "ab" * 32, b"{}")
    assert "removed 1 entry\n" == CliRunner().invoke(main, ["cache", "clear"]).output


def test_swapped_ptx_entry_is_detected_and_rebuilt(tmp_path, capsys):
    cache = tmp_path / "c"
    for name, d in (("ka", 64), ("kb", 128)):
        (tmp_path / f"{name}.toml").write_text(SPEC_TEXT.format(name=name, d=d))
    run_build([tmp_path / "ka.toml", tmp_path / "kb.toml"], tmp_path / "o1", verify=False,
              progress=False, cache_dir=cache)
    a, b = _entries(cache, "ptx")
    shutil.copyfile(a, b)                       # kernel A's entry now sits under B's key
    capsys.readouterr()
    run_build([tmp_path / "ka.toml", tmp_path / "kb.toml"], tmp_path / "o2", verify=False,
              progress=False, cache_dir=cache)
    err = capsys.readouterr().err
    assert "foreign" in err and "rebuilding" in err
    assert _tree(tmp_path / "o1") == _tree(tmp_path / "o2")


def test_other_stage_and_malformed_entries_are_rebuilt(tmp_path, toolchain, capsys):
    cache = tmp_path / "c"
    spec = SPECS / "gpt2_f32.toml"
    run_build([spec], tmp_path / "o1", targets=["sm_80"], progress=False, cache_dir=cache)
    ptx, cubin = _entries(cache, "ptx"), _entries(cache, "cubin")
    shutil.copyfile(ptx[0], cubin[0])           # a ptx-stage entry under a cubin key
    c = Cache(cache)
    key = ptx[0].name
    c.put("ptx", key, b'{"not": "a ptx entry"}')  # well-formed entry, payload of the wrong shape
    capsys.readouterr()
    summary = run_build([spec], tmp_path / "o2", targets=["sm_80"], progress=False, cache_dir=cache)
    err = capsys.readouterr().err
    assert "foreign" in err and "malformed" in err and "Traceback" not in err
    assert not summary["problems"]
    assert _tree(tmp_path / "o1") == _tree(tmp_path / "o2")
    # and the rebuilt entries are good again: a third build is all hits, silent
    summary = run_build([spec], tmp_path / "o3", targets=["sm_80"], progress=False, cache_dir=cache)
    assert summary["cache"]["misses"] == 0 and "warning" not in capsys.readouterr().err


def test_fifo_and_huge_entries_do_not_hang(tmp_path, capsys):
    cache = Cache(tmp_path / "c")
    key = "cd" * 32
    path = tmp_path / "c" / ENTRIES / "ptx" / key[:2] / key
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    result = []
    t = threading.Thread(target=lambda: result.append(cache.get("ptx", key)), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive() and result == [None]
    assert "unreadable" in capsys.readouterr().err and not path.exists()
    os.symlink("/dev/zero", path)
    assert cache.get("ptx", key) is None and not path.is_symlink()


def test_marker_written_by_someone_else_disables_the_cache(tmp_path, capsys):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / MARKER).write_text("Signature: 8a477f597d28d172789f06886806bc55\n# other tool\n")
    c = Cache(tmp_path / "c")
    assert not c.enabled and "not written by ptxc" in capsys.readouterr().err


def test_symlinked_stage_or_prefix_directory_is_never_written_through(tmp_path, capsys):
    """A stage directory (`v2/ptx -> /elsewhere`) or key-prefix directory that is a symlink is
    replaced by a real directory with a warning: entries never land outside the cache."""
    cache = Cache(tmp_path / "c")
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, tmp_path / "c" / ENTRIES / "ptx")
    key = "ab" * 32
    assert cache.get("ptx", key) is None           # nothing is read through the link either
    cache.put("ptx", key, b"payload")
    assert list(outside.iterdir()) == []
    assert "symlink" in capsys.readouterr().err
    stage = tmp_path / "c" / ENTRIES / "ptx"
    assert stage.is_dir() and not stage.is_symlink() and cache.get("ptx", key) == b"payload"
    key2 = "ef" * 32
    os.symlink(outside, stage / key2[:2])
    cache.put("ptx", key2, b"other")
    assert list(outside.iterdir()) == [] and cache.get("ptx", key2) == b"other"


MLA_SPEC = """[[kernel]]
name = "m"
family = "mla"
dtype = "bf16"
num_heads = 128
kv_lora_rank = 512
qk_rope_head_dim = 64
softmax_scale = 0.1352
targets = {targets}
"""


def test_cache_key_covers_the_other_targets(tmp_path):
    """A target's PTX may depend on the spec's other targets (MLA's latent tile is sized to fit
    every one of them: 64 head rows on sm_80 alone, fewer with a 99 KiB sm_120 beside it), so
    a cached target of one target list never stands for another: the build of ["sm_80"] after
    ["sm_80", "sm_120"] in the same cache equals its build in an empty one."""
    cache, fresh = tmp_path / "c", tmp_path / "fresh"
    (tmp_path / "both.toml").write_text(MLA_SPEC.format(targets='["sm_80", "sm_120"]'))
    (tmp_path / "one.toml").write_text(MLA_SPEC.format(targets='["sm_80"]'))
    run_build([tmp_path / "both.toml"], tmp_path / "o1", verify=False, progress=False, cache_dir=cache)
    run_build([tmp_path / "one.toml"], tmp_path / "o2", verify=False, progress=False, cache_dir=cache)
    run_build([tmp_path / "one.toml"], tmp_path / "o3", verify=False, progress=False, cache_dir=fresh)
    ptx = lambda out: (out / "m" / "m.sm_80.ptx").read_text()   # noqa: E731
    assert ptx(tmp_path / "o2") == ptx(tmp_path / "o3")
    assert ptx(tmp_path / "o1") != ptx(tmp_path / "o3")   # the case is real: the tiles differ


def test_families_that_say_their_ptx_is_per_target_are_right():
    """The PTX key holds only the target unless the family says its PTX reads the other
    targets (Family.ptx_reads_all_targets): for every example spec and target of a family that
    says it does not, lowering with that target alone gives the same PTX as with all."""
    import dataclasses
    from ptxc.kernels import FAMILIES, load_paths
    from ptxc.pipeline.compiler import lower
    checked = 0
    for spec in load_paths([SPECS]):
        if FAMILIES[spec.family].ptx_reads_all_targets(spec) or len(spec.targets) < 2:
            continue
        for t in spec.targets:
            alone = dataclasses.replace(spec, targets=(t,))
            assert lower(alone, t)[0] == lower(spec, t)[0], (spec.name, t)
            checked += 1
    assert checked > 50
