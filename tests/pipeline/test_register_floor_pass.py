"""The register-floor pass (pipeline/register_floor_pass.py): ptxas spilled an entry that sets no
.minnctapersm of its own -> the build assembles it again with .minnctapersm 1 and keeps the
result when it spills less; the metadata records the entries, and a reader re-derives the PTX
with exactly those directives (a removed or invented record is refused)."""

import json

import pytest

from ptxc.errors import PtxcError
from ptxc.files import sha256
from ptxc.pipeline.build import run_build
from ptxc.pipeline.register_floor_pass import apply_floor, floorable
from ptxc.runtime import load

# f32 prefill d128 causal on sm_103: the default tile, where ptxas's own register cap spilled
# 4 bytes (found by a random-spec audit; sm_103 is outside the sweep's measured targets)
SPEC = ('[[kernel]]\nname = "k"\nfamily = "prefill"\ndtype = "f32"\nnum_heads = 2\nnum_kv_heads = 1\n'
        'head_dim = 128\ncausal = true\ntargets = ["sm_103"]\n')
PTX = """.visible .entry a(
	.param .u64 p
)
.maxntid 128, 1, 1
{
	ret;
}
.visible .entry b(
	.param .u64 p
)
.maxntid 256, 1, 1
.minnctapersm 2
{
	ret;
}
"""


def test_the_directive_goes_where_the_printer_puts_it():
    floored = apply_floor(PTX, ["a"])
    assert ".maxntid 128, 1, 1\n.minnctapersm 1\n{" in floored and floored.count(".minnctapersm") == 2
    with pytest.raises(ValueError, match="sets its own"):
        apply_floor(PTX, ["b"])
    with pytest.raises(ValueError, match="no entry c"):
        apply_floor(PTX, ["c"])
    spills = {"a": {"spill_stores": 4, "spill_loads": 4}, "b": {"spill_stores": 8, "spill_loads": 0}}
    assert floorable(PTX, spills) == ["a"]       # b's own .minnctapersm is the kernel's choice


@pytest.fixture(scope="module")
def built(tmp_path_factory, toolchain):
    root = tmp_path_factory.mktemp("floor")
    (root / "k.toml").write_text(SPEC)
    summary = run_build([root / "k.toml"], root / "out", progress=False, cache_dir=root / "cache")
    return root, summary


def test_a_spilling_default_tile_is_floored_and_recorded(built):
    root, summary = built
    assert not summary["problems"], summary["problems"]
    t = json.loads((root / "out" / "k" / "k.json").read_text())["targets"]["sm_103"]
    assert t["register_floor"] == ["ptxc_k"]
    assert all(k["resources"]["spill_stores"] == k["resources"]["spill_loads"] == 0 for k in t["kernels"])
    assert ".minnctapersm 1\n{" in (root / "out" / "k" / "k.sm_103.ptx").read_text()
    load(root / "out" / "k")


@pytest.mark.parametrize("edit,why", [
    (lambda t: t.pop("register_floor"), "PTX is not what the recorded spec compiles to"),
    (lambda t: t.__setitem__("register_floor", ["ptxc_other"]), "register_floor does not fit"),
])
def test_a_removed_or_invented_floor_is_refused(built, tmp_path, edit, why):
    import shutil
    root, _ = built
    out = tmp_path / "out"
    shutil.copytree(root / "out", out)
    path = out / "k" / "k.json"
    meta = json.loads(path.read_text())
    edit(meta["targets"]["sm_103"])
    raw = json.dumps(meta).encode()
    path.write_bytes(raw)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["artifacts"]["k"]["metadata_sha256"] = sha256(raw)
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PtxcError, match=why):
        load(out / "k")
