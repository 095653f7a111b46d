"""The generated C loader, run for real (C11 and C++17) against the stub libcuda: it must pick
the device's image, raise the shared-memory limit once per function, launch every target's own
geometry and parameter bytes, and the recorded launches — replayed in ptxc.emu on the recorded
memory — must match the fp64 reference. Plus the mismatch cases: no image for the device, a
misaligned pointer, a bad stride, a parameter out of range."""

import pytest

from stubcuda import harness
from stubcuda.cases import (CASES, STUB_SMS, TARGETS, VARIANT_KEYS, another_step, build_set, check_end_to_end,
                            input_blob, prepare, python_variant, shape_dims)

from ptxc.emit.cheader import emit
from ptxc.runtime import load


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_set(tmp_path_factory, emit, "c")


def run_loader(built, name, tmp_path, *, sm, cxx=False, perturb="", env=None, graph=False, prepared=None,
               dims=None):
    out, header, stub = built
    art = load(out / name)
    prepared = prepared or prepare(art, CASES[name], sm)
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "inputs.bin").write_bytes(input_blob(art, prepared[4]))
    dims = shape_dims(art, prepared[3]) if dims is None else dims
    stdout = harness.compile_and_run(harness.c_main(art.meta, header, dims, perturb, graph=graph),
                                     tmp_path, stub, cxx=cxx, args=[str(out / name), str(tmp_path / "inputs.bin")],
                                     env={"PTXC_STUB_SM": str(sm), "PTXC_STUB_SMS": str(STUB_SMS), **(env or {})})
    return art, prepared, harness.parse_output(stdout), harness.read_log(tmp_path / "log")


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("sm,cxx", [(80, False), (90, True)], ids=["sm_80-c11", "sm_90-cxx17"])
def test_c_loader_end_to_end(built, tmp_path, name, sm, cxx):
    art, prepared, result, log = run_loader(built, name, tmp_path, sm=sm, cxx=cxx)
    target = f"sm_{sm}"
    check_end_to_end(art, prepared, result, log, target, "cubin", art.cubin(target))


def test_sm_90_and_sm_80_differ_where_it_matters(built):
    """The case the old header got wrong: each target carries its own launch configuration."""
    out, header, _ = built
    text = header.read_text()
    meta = load(out / "e2e_prefill").meta
    k80, k90 = (meta["targets"][t]["kernels"][0] for t in TARGETS)
    assert (k80["block"], k80["dynamic_smem_bytes"], k80["grid"]) != (k90["block"], k90["dynamic_smem_bytes"], k90["grid"])
    assert f"{k90['dynamic_smem_bytes']}u, p.bytes" in text and f"{k80['dynamic_smem_bytes']}u, p.bytes" in text
    assert text.index('{"sm_80", 80') < text.index('{"sm_90", 90')


def test_newer_device_falls_back_to_newest_older_ptx(built, tmp_path):
    art, prepared, result, log = run_loader(built, "e2e_paged_split", tmp_path, sm=86)
    result["load"] = (result["load"][0], result["load"][1], result["load"][2], "")
    check_end_to_end(art, prepared, result, log, "sm_80", "ptx", art.ptx("sm_80").encode())


def test_device_older_than_every_target_is_a_clear_error(built, tmp_path):
    _, _, result, log = run_loader(built, "e2e_prefill", tmp_path, sm=75)
    code, target, _, error = result["load"]
    assert code == 209 and target == -1  # CUDA_ERROR_NO_BINARY_FOR_GPU
    assert error == "e2e_prefill: no image runs on sm_75 (CUDA_ERROR_NO_BINARY_FOR_GPU); built for sm_80, sm_90"
    assert log.modules == [] and log.launches == []


def test_shared_memory_the_device_lacks_fails_at_load(built, tmp_path):
    """An older target's configuration on a device with less shared memory (sm_80's tiles on a
    99 KB sm_86): the opt-in attribute call fails at load, with the reason, before any launch."""
    out, _, _ = built
    k = load(out / "e2e_prefill").meta["targets"]["sm_80"]["kernels"][0]
    assert k["needs_smem_opt_in"]
    _, _, result, log = run_loader(built, "e2e_prefill", tmp_path, sm=86,
                                   env={"PTXC_STUB_SMEM_OPTIN": str(k["dynamic_smem_bytes"] - 1)})
    assert result["load"] == (1, -1, "-", f"e2e_prefill [sm_80]: ptxc_e2e_prefill: cuFuncSetAttribute failed "
                                           f"(CUresult 1; {k['dynamic_smem_bytes']} bytes of dynamic shared memory)")
    assert log.launches == []


PERTURBATIONS = [
    ("t.q.ptr += 4;", "e2e_prefill: tensor q: address 0x{q:x} is not 16-byte aligned"),
    ("t.k.strides[1] += 1;", "e2e_prefill: tensor k: stride 129 along axis 1 is not a multiple of 8 elements"),
    ("t.o.strides[3] = 2;", "e2e_prefill: tensor o: stride 2 along axis 3 must be 1 (packed)"),
    ("d.seq_q = 1LL << 40;", "e2e_prefill: dim seq_q = 1099511627776 outside 0..2147483647"),
    ("t.o.ptr = 0;", "e2e_prefill: tensor o: null device address"),
]


@pytest.mark.parametrize("perturb,message", PERTURBATIONS,
                         ids=["misaligned", "stride", "innermost", "range", "null"])
def test_violated_precondition_is_an_error_not_a_launch(built, tmp_path, perturb, message):
    _, _, result, log = run_loader(built, "e2e_prefill", tmp_path, sm=90, perturb=perturb)
    code, error = result["run"]
    assert code == 1  # CUDA_ERROR_INVALID_VALUE
    assert error == message.format(q=result["tensors"]["q"][0])
    assert log.launches == []


@pytest.mark.parametrize("name", ["e2e_varlen", "e2e_paged_fused", "e2e_mla", "e2e_merge"])
def test_graph_run_enqueues_the_same_launches_for_every_step(built, tmp_path, name):
    """ptxc_<a>_graph_run at the capture maxima: two steps with different compositions (the
    ragged batch rotated; half the decodes absent) enqueue byte-identical launches -- one
    captured graph replays both -- and each step replays right in the emulator."""
    out, _, _ = built
    art = load(out / name)
    first = prepare(art, CASES[name], 90)
    records = []
    for i, step in enumerate((first, another_step(art, first, 90))):
        _, _, result, log = run_loader(built, name, tmp_path / str(i), sm=90, graph=True, prepared=step)
        check_end_to_end(art, step, result, log, "sm_90", "cubin", art.cubin("sm_90"))
        records.append(harness.launch_records(log, art.meta, "sm_90", result["tensors"]))
    assert records[0] == records[1] and records[0]


def test_graph_run_refuses_what_a_graph_cannot_replay(built, tmp_path):
    """A NEVER-class list (prefill: its grid is the step's own lengths) and a maximum of 0 (a
    graph with no launch) are one-line errors before any launch."""
    out, header, stub = built
    for name, dims, want in [
        ("e2e_prefill", {"batch": 1, "seq_q": 17, "seq_k": 33},
         "dims 801 e2e_prefill [sm_90]: cannot be captured in a CUDA graph (class NEVER: a prefill grid "
         "is the step's own sequence lengths)"),
        ("e2e_varlen", {"batch": 0, "max_pages_per_seq": 3, "num_pages": 9, "total_q": 5},
         "dims 1 e2e_varlen: maximum batch is not positive; capture at the step maxima")]:
        art = load(out / name)
        stdout = harness.compile_and_run(harness.c_main(art.meta, header, dims, graph=True), tmp_path / name, stub,
                                         cxx=False, args=[str(out / name), "/dev/null"],
                                         env={"PTXC_STUB_SM": "90", "PTXC_STUB_SMS": str(STUB_SMS)})
        assert stdout.splitlines()[1] == want
        assert not harness.read_log(tmp_path / name / "log").launches


def test_c_variant_dispatcher(built, tmp_path):
    out, header, stub = built
    src = (f'#include <stdio.h>\n#include "{header}"\n'
           'int main(void) {\n    char e[4096];\n'
           '    int i = ptxc_find_variant("family=decode,append_kv=true,dtype=f16", e, sizeof e);\n'
           '    printf("%s\\n", i >= 0 ? ptxc_variant_names[i] : e);\n'
           '    i = ptxc_find_variant("family=decode,head_dim=128", e, sizeof e);\n'
           '    printf("%d|%s\\n", i, e);\n    return 0;\n}\n')
    lines = harness.compile_and_run(src, tmp_path, stub, cxx=True, args=[], env={}).splitlines()
    assert lines[0] == "e2e_paged_fused"
    assert lines[1].startswith("-1|not built: family=decode,head_dim=128; built variants are e2e_merge: "
                               "family=merge_states,dtype=bf16,head_dim=64,")   # in name order
    assert "; e2e_mla: family=mla,dtype=bf16,head_dim=144," in lines[1]
    assert "; e2e_paged_fused: family=decode,dtype=f16,head_dim=64," in lines[1]
    assert "; e2e_prefill: family=prefill,dtype=f16,head_dim=64,num_heads=4,num_kv_heads=2," in lines[1]
    prefill_key = lines[1].split("; e2e_prefill: ")[1].split(";")[0].split(",")
    assert {"causal=true", "sliding_window=none", "logits_soft_cap=none"} <= set(prefill_key)


def test_another_artifacts_handle_is_refused(built, tmp_path):
    """Every artifact's functions take the same ptxc_loader_t: a handle loaded for one (the
    append kernel's, say) given to another's run, resolve_dims or graph_dims is refused, and
    nothing runs."""
    out, header, stub = built
    src = (f'#include <stdio.h>\n#include <string.h>\n#include "{header}"\n'
           'int main(int argc, char **argv) {\n'
           '    CUdevice dev; CUcontext ctx; ptxc_loader_t L; (void)argc;\n'
           '    cuInit(0); cuDeviceGet(&dev, 0); cuDevicePrimaryCtxRetain(&ctx, dev); cuCtxSetCurrent(ctx);\n'
           '    if (ptxc_e2e_prefill_load(&L, dev, argv[1]) != CUDA_SUCCESS) return 2;\n'
           '    ptxc_e2e_varlen_dims_t d; ptxc_e2e_varlen_tensors_t t; memset(&d, 0, sizeof d); memset(&t, 0, sizeof t);\n'
           '    printf("%d|%s\\n", (int)ptxc_e2e_varlen_resolve_dims(&L, &d, 6), L.error);\n'
           '    printf("%d|%s\\n", (int)ptxc_e2e_varlen_run(&L, &d, &t, NULL), L.error);\n'
           '    printf("%d|%s\\n", (int)ptxc_e2e_varlen_graph_run(&L, &d, 6, &t, NULL), L.error);\n'
           '    ptxc_unload(&L);\n'
           '    printf("%d|%s\\n", (int)ptxc_e2e_varlen_run(&L, &d, &t, NULL), L.error);\n    return 0;\n}\n')
    lines = harness.compile_and_run(src, tmp_path, stub, cxx=False, args=[str(out / "e2e_prefill")],
                                    env={"PTXC_STUB_SM": "90", "PTXC_STUB_SMS": str(STUB_SMS)}).splitlines()
    assert lines[:3] == ["400|e2e_varlen: the loader holds e2e_prefill's module, not e2e_varlen's"] * 3
    assert lines[3] == "3|e2e_varlen: not loaded (call ptxc_e2e_varlen_load first)"
    assert not harness.read_log(tmp_path / "log").launches


def test_an_image_the_header_was_not_generated_for_is_refused(built, tmp_path):
    """The header records each image's size and CRC-32: another build's cubin (here a byte
    appended) in the artifact directory is refused at load, before the driver sees it."""
    import shutil
    out, _, _ = built
    copy = tmp_path / "art"
    shutil.copytree(out / "e2e_prefill", copy)
    cubin = copy / load(out / "e2e_prefill").meta["targets"]["sm_90"]["cubin"]
    cubin.write_bytes(cubin.read_bytes() + b"\0")
    size = cubin.stat().st_size
    built_copy = (out, built[1], built[2])
    art = load(out / "e2e_prefill")
    prepared = prepare(art, CASES["e2e_prefill"], 90)
    (tmp_path / "inputs.bin").write_bytes(input_blob(art, prepared[4]))
    stdout = harness.compile_and_run(harness.c_main(art.meta, built_copy[1], shape_dims(art, prepared[3])),
                                     tmp_path / "run", built_copy[2], cxx=False,
                                     args=[str(copy), str(tmp_path / "inputs.bin")],
                                     env={"PTXC_STUB_SM": "90", "PTXC_STUB_SMS": str(STUB_SMS)})
    assert stdout.splitlines()[0] == (
        f"load 200 -1 -|e2e_prefill: {copy}/{cubin.name} is not the image this loader was generated for "
        f"({size} bytes; expected {size - 1}): regenerate the loader from this build")
    assert not harness.read_log(tmp_path / "run" / "log").modules


@pytest.mark.parametrize("perturb,message", [
    ("d.num_splits = 0;", "e2e_varlen: dim num_splits = 0 outside 1..{max} (0 = auto: resolve_dims first)"),
    ("d.num_splits = 70000;", "e2e_varlen: dim num_splits = 70000 outside 1..{max} (0 = auto: resolve_dims first)"),
    # the split kernel's launch is fine, the reduce's grid (total_q rows in y) is not: nothing runs
    ("d.total_q = 70000;", "ptxc_e2e_varlen_reduce: grid ("),
], ids=["unresolved-splits", "splits-past-the-rule", "second-launch-refused"])
def test_a_refused_run_enqueues_nothing(built, tmp_path, perturb, message):
    art, _, result, log = run_loader(built, "e2e_varlen", tmp_path, sm=90, perturb=perturb)
    code, error = result["run"]
    rule = art.meta["dim_rules"]["num_splits"]["auto"]
    assert code == 1 and error.startswith(message.format(max=rule["max"])), error
    assert log.launches == []



def test_c_variant_errors_are_pythons(built, tmp_path):
    """An unknown field (a typo: "famly"), a part that is not field=value, spaces, not built and
    ambiguous: ptxc_find_variant says what ptxc.runtime.find_variant says, word for word."""
    import json
    out, header, stub = built
    calls = "".join(f'    i = ptxc_find_variant({json.dumps(k)}, e, sizeof e);\n'
                    '    printf("%s\\n", i >= 0 ? ptxc_variant_names[i] : e);\n' for k in VARIANT_KEYS)
    src = (f'#include <stdio.h>\n#include "{header}"\n'
           f'int main(void) {{\n    static char e[16384];\n    int i;\n{calls}    return 0;\n}}\n')
    lines = harness.compile_and_run(src, tmp_path, stub, cxx=False, args=[], env={}).splitlines()
    assert lines == [python_variant(out, k) for k in VARIANT_KEYS]
    assert lines[0].startswith("variant key: unknown field 'famly'; fields are family, dtype, head_dim, ")
    assert lines[2] == "variant key 'family=decode,dtype': 'dtype' is not field=value"


def test_c_variant_error_fits_a_small_buffer(built, tmp_path):
    """A message longer than the caller's buffer is cut there, NUL-terminated."""
    out, header, stub = built
    src = (f'#include <stdio.h>\n#include <string.h>\n#include "{header}"\n'
           'int main(void) {\n    char e[12]; memset(e, 1, sizeof e);\n'
           '    int i = ptxc_find_variant("famly=decode", e, sizeof e);\n'
           '    printf("%d|%s|%d\\n", i, e, (int)strlen(e));\n'
           '    printf("%d\\n", ptxc_find_variant("famly=decode", NULL, 0));\n    return 0;\n}\n')
    lines = harness.compile_and_run(src, tmp_path, stub, cxx=True, args=[], env={}).splitlines()
    assert lines == ["-1|variant key|11", "-1"]
