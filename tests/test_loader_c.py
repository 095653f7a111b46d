"""The generated C loader, run for real (C11 and C++17) against the stub libcuda: it must pick
the device's image, raise the shared-memory limit once per function, launch every target's own
geometry and parameter bytes, and the recorded launches — replayed in ptxc.emu on the recorded
memory — must match the fp64 reference. Plus the mismatch cases: no image for the device, a
misaligned pointer, a bad stride, a parameter out of range."""

import numpy as np
import pytest

from stubcuda import harness

from ptxc.emit.cheader import emit
from ptxc.kernels import FAMILIES
from ptxc.pipeline.build import run_build
from ptxc.runtime import launch_geometry, load, prepare_buffers
from ptxc.runtime.reference import from_device, max_abs_error, tolerance
from ptxc.spec.model import KernelSpec

TARGETS = ("sm_80", "sm_90")
STUB_SMS = 6  # few SMs, so num_splits = "auto" picks several splits for a small batch

SPECS = '''
[defaults]
targets = ["sm_80", "sm_90"]
head_dim = 64
num_heads = 4
num_kv_heads = 2

[[kernel]]
name = "e2e_prefill"
family = "prefill"
dtype = "f16"
causal = true

[[kernel]]
name = "e2e_paged_split"
family = "decode"
dtype = "bf16"
kv_layout = "paged"
page_size = 16
num_splits = "auto"
return_lse = true

[[kernel]]
name = "e2e_paged_fused"
family = "decode"
dtype = "f16"
kv_layout = "paged"
page_size = 16
num_splits = "auto"
append_kv = true
'''

# One entry per family case: artifact name and small odd shapes. A new family (varlen) is one
# more kernel in SPECS and one more entry here.
CASES = {
    "e2e_prefill": {"batch": 1, "seq_q": 17, "seq_k": 33},
    "e2e_paged_split": {"batch": 2, "max_pages_per_seq": 3, "num_pages": 7},
    "e2e_paged_fused": {"batch": 2, "max_pages_per_seq": 3, "num_pages": 7},
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    missing = harness.toolchain_missing()
    if missing:
        pytest.skip(missing)
    root = tmp_path_factory.mktemp("loader_c")
    (root / "e2e.toml").write_text(SPECS)
    out = root / "out"
    run_build([root / "e2e.toml"], out, verify=True, progress=False)
    return out, emit(out), harness.build_stub(root / "stub")


def prepare(art, shapes, seed=0):
    spec = KernelSpec.from_dict(art.meta["spec"])
    family = FAMILIES[spec.family]
    dims = {**family.interface(spec).defaults, **shapes}
    inputs = family.make_inputs(spec, dims, np.random.default_rng(seed))
    full = art.infer_dims(inputs, num_sms=STUB_SMS)
    buffers = prepare_buffers(art.meta, inputs, full)
    return (spec, family, inputs, full, buffers)


def run_loader(built, name, tmp_path, *, sm, cxx=False, perturb="", seed=0, shapes=None):
    out, header, stub = built
    art = load(out / name)
    spec, family, inputs, dims, buffers = prepare(art, shapes or CASES[name], seed)
    blob = b"".join(buffers[n].tobytes() for n, t in art.meta["tensors"].items() if t["role"] != "workspace")
    (tmp_path / "inputs.bin").write_bytes(blob)
    shape_dims = {d: dims[d] for d in art.meta["dims"] if d not in art.meta["dim_rules"]}
    stdout = harness.compile_and_run(harness.c_main(art.meta, header, shape_dims, perturb), tmp_path, stub,
                                     cxx=cxx, args=[str(out / name), str(tmp_path / "inputs.bin")],
                                     env={"PTXC_STUB_SM": str(sm), "PTXC_STUB_SMS": str(STUB_SMS)})
    return art, (spec, family, inputs, dims, buffers), harness.parse_output(stdout), harness.read_log(tmp_path / "log")


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("sm,cxx", [(80, False), (90, True)], ids=["sm_80-c11", "sm_90-cxx17"])
def test_c_loader_end_to_end(built, tmp_path, name, sm, cxx):
    art, (spec, family, inputs, dims, buffers), result, log = run_loader(built, name, tmp_path, sm=sm, cxx=cxx)
    target = f"sm_{sm}"
    t = art.meta["targets"][target]
    assert result["load"] == (0, TARGETS.index(target), "cubin", "")
    assert result["run"] == (0, "")
    assert result["dims"] == dims
    # the device's own cubin, loaded once; the smem opt-in set once per function that needs it
    assert log.modules == [("cubin", art.cubin(target))]
    entries = {fid: entry for fid, (_, entry) in log.functions.items()}
    assert sorted(entries.values()) == sorted(k["entry"] for k in t["kernels"])
    want_attrs = sorted((k["entry"], k["dynamic_smem_bytes"]) for k in t["kernels"] if k["needs_smem_opt_in"])
    assert sorted((entries[f], v) for f, a, v in log.attributes) == want_attrs
    # this target's launch list with this target's geometry and shared memory
    assert [launch.entry for launch in log.launches] == [k["entry"] for k in t["kernels"]]
    for launch, k in zip(log.launches, t["kernels"]):
        grid, block = launch_geometry(k, dims)
        assert (launch.grid, launch.block, launch.smem) == (grid, block, k["dynamic_smem_bytes"])
    memory = harness.replay(log, art.meta, target, art.ptx(target), result["tensors"])
    ref = family.reference(spec, inputs)
    naive = family.reference(spec, inputs, dtype=spec.dtype)
    for tensor in sorted(ref):
        raw = harness.read_tensor(memory, *result["tensors"][tensor])
        got = from_device(raw.view(buffers[tensor].dtype).reshape(buffers[tensor].shape),
                          art.meta["tensors"][tensor]["dtype"])
        err, tol = max_abs_error(got, ref[tensor]), tolerance(naive[tensor], ref[tensor])
        assert err <= tol, f"{name} [{target}] {tensor}: max error {err:.3e} > {tol:.3e}"


def test_sm_90_and_sm_80_differ_where_it_matters(built):
    """The case the old header got wrong: each target carries its own launch configuration."""
    out, header, _ = built
    text = header.read_text()
    meta = load(out / "e2e_prefill").meta
    k80, k90 = (meta["targets"][t]["kernels"][0] for t in TARGETS)
    assert (k80["block"], k80["dynamic_smem_bytes"]) != (k90["block"], k90["dynamic_smem_bytes"]) or \
        k80["grid"] != k90["grid"]
    assert f"{k90['dynamic_smem_bytes']}u, p.bytes" in text and f"{k80['dynamic_smem_bytes']}u, p.bytes" in text
    assert text.index('{"sm_80", 80') < text.index('{"sm_90", 90')


def test_newer_device_falls_back_to_newest_older_ptx(built, tmp_path):
    art, _, result, log = run_loader(built, "e2e_paged_split", tmp_path, sm=86)
    assert result["load"] == (0, 0, "ptx", "")
    assert log.modules == [("ptx", art.ptx("sm_80").encode())]
    assert result["run"] == (0, "")
    assert [launch.entry for launch in log.launches] == [k["entry"] for k in art.meta["targets"]["sm_80"]["kernels"]]


def test_device_older_than_every_target_is_a_clear_error(built, tmp_path):
    _, _, result, log = run_loader(built, "e2e_prefill", tmp_path, sm=75)
    code, target, _, error = result["load"]
    assert code == 209 and target == -1  # CUDA_ERROR_NO_BINARY_FOR_GPU
    assert error == "e2e_prefill: no image runs on sm_75 (CUDA_ERROR_NO_BINARY_FOR_GPU); built for sm_80, sm_90"
    assert log.modules == [] and log.launches == []


@pytest.mark.parametrize("perturb,message", [
    ("t.q.ptr += 4;", "e2e_prefill: tensor q: address 0x{q:x} is not 16-byte aligned"),
    ("t.k.strides[1] += 1;", "e2e_prefill: tensor k: stride 129 along axis 1 is not a multiple of 8 elements"),
    ("t.o.strides[3] = 2;", "e2e_prefill: tensor o: stride 2 along axis 3 must be 1 (packed)"),
    ("d.seq_q = 1LL << 40;", "ptxc_e2e_prefill: parameter seq_q = 1099511627776 does not fit its 32-bit type"),
])
def test_violated_precondition_is_an_error_not_a_launch(built, tmp_path, perturb, message):
    _, _, result, log = run_loader(built, "e2e_prefill", tmp_path, sm=90, perturb=perturb)
    code, error = result["run"]
    assert code == 1  # CUDA_ERROR_INVALID_VALUE
    q = result["tensors"]["q"][0]
    assert error == message.format(q=q)
    assert log.launches == []
