"""`ptxc build --fatbin`: one reproducible fatbin per artifact, checked by verify, loaded by
both generated loaders (which then launch the configuration of the target the driver runs)."""

import shutil

import pytest

from conftest import require_rustc

from stubcuda import harness
from stubcuda.cases import CASES, STUB_SMS, build_set, check_end_to_end, input_blob, prepare, shape_dims

from ptxc.emit import cheader, rust
from ptxc.pipeline.build import run_verify
from ptxc.runtime import load

NAME = "e2e_paged_fused"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    require_rustc()

    def both(out):
        return cheader.emit(out), rust.emit(out, out.parent / "rust" / "ptxc_kernels.rs")
    return build_set(tmp_path_factory, both, "fatbin", fatbin=True)


def test_fatbin_is_recorded_and_verified(built, tmp_path):
    out, _, _ = built
    meta = load(out / NAME).meta
    fatbin = (out / NAME / meta["fatbin"]["file"]).read_bytes()
    assert fatbin[:4] == bytes.fromhex("50ed55ba")
    for t in meta["targets"].values():  # every target's cubin inside, uncompressed
        assert (out / NAME / t["cubin"]).read_bytes()[64:256] in fatbin
    assert run_verify([out]).ok
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    (copy / NAME / meta["fatbin"]["file"]).write_bytes(fatbin[:-1] + b"\1")
    assert any(".fatbin: sha256" in p for p in run_verify([copy]).problems)


@pytest.mark.parametrize("language,sm,target", [("c", 90, "sm_90"), ("c", 86, "sm_80"), ("rust", 90, "sm_90")])
def test_loaders_load_the_fatbin(built, tmp_path, language, sm, target):
    out, (header, module), stub = built
    art = load(out / NAME)
    prepared = prepare(art, CASES[NAME], sm)
    (tmp_path / "inputs.bin").write_bytes(input_blob(art, prepared[4]))
    env = {"PTXC_STUB_SM": str(sm), "PTXC_STUB_SMS": str(STUB_SMS)}
    if language == "c":
        stdout = harness.compile_and_run(harness.c_main(art.meta, header, shape_dims(art, prepared[3])), tmp_path,
                                         stub, cxx=False, args=[str(out / NAME), str(tmp_path / "inputs.bin")], env=env)
    else:
        stdout = harness.compile_rust_and_run(harness.rust_main(art.meta, module, shape_dims(art, prepared[3])),
                                              tmp_path, stub, args=[str(tmp_path / "inputs.bin")], env=env)
    fatbin = (out / NAME / art.meta["fatbin"]["file"]).read_bytes()
    check_end_to_end(art, prepared, harness.parse_output(stdout), harness.read_log(tmp_path / "log"), target,
                     "fatbin", fatbin)
