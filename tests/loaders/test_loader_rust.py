"""The generated Rust module (no crates; images embedded), compiled with rustc against the stub
libcuda and run end to end exactly like the C loader (tests/loaders/test_loader_c.py)."""

import shutil

import pytest

from conftest import require_rustc

from stubcuda import harness
from stubcuda.cases import (CASES, STUB_SMS, VARIANT_KEYS, another_step, build_set, check_end_to_end, input_blob,
                            prepare, python_variant, shape_dims)

from ptxc.emit.rust import emit
from ptxc.runtime import load


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    require_rustc()
    return build_set(tmp_path_factory, lambda out: emit(out, out.parent / "rust" / "ptxc_kernels.rs"), "rust")


def run_loader(built, name, tmp_path, *, sm, perturb="", graph=False, prepared=None):
    out, module, stub = built
    art = load(out / name)
    tmp_path.mkdir(parents=True, exist_ok=True)
    prepared = prepared or prepare(art, CASES[name], sm)
    (tmp_path / "inputs.bin").write_bytes(input_blob(art, prepared[4]))
    src = harness.rust_main(art.meta, module, shape_dims(art, prepared[3]), perturb, graph=graph)
    stdout = harness.compile_rust_and_run(src, tmp_path, stub, args=[str(tmp_path / "inputs.bin")],
                                          env={"PTXC_STUB_SM": str(sm), "PTXC_STUB_SMS": str(STUB_SMS)})
    return art, prepared, harness.parse_output(stdout), harness.read_log(tmp_path / "log")


@pytest.mark.parametrize("name,sm", [(n, 90) for n in sorted(CASES)] + [("e2e_prefill", 80)])
def test_rust_loader_end_to_end(built, tmp_path, name, sm):
    art, prepared, result, log = run_loader(built, name, tmp_path, sm=sm)
    target = f"sm_{sm}"
    check_end_to_end(art, prepared, result, log, target, "cubin", art.cubin(target))


def test_rust_falls_back_to_ptx_and_refuses_old_devices(built, tmp_path):
    art, prepared, result, log = run_loader(built, "e2e_paged_fused", tmp_path / "a", sm=89)
    check_end_to_end(art, prepared, result, log, "sm_80", "ptx", art.ptx("sm_80").encode())
    _, _, result, log = run_loader(built, "e2e_paged_fused", tmp_path / "b", sm=75)
    assert result["load"] == (209, -1, "-", "e2e_paged_fused: no image runs on sm_75 "
                              "(CUDA_ERROR_NO_BINARY_FOR_GPU); built for sm_80, sm_90")


def test_rust_graph_run_enqueues_the_same_launches_for_every_step(built, tmp_path):
    """Kernel::graph_run at the capture maxima (as the C loader's ptxc_<a>_graph_run): two
    compositions of a ragged batch enqueue identical launches, each right in the emulator."""
    out, _, _ = built
    art = load(out / "e2e_varlen")
    first = prepare(art, CASES["e2e_varlen"], 90)
    records = []
    for i, step in enumerate((first, another_step(art, first, 90))):
        _, _, result, log = run_loader(built, "e2e_varlen", tmp_path / str(i), sm=90, graph=True, prepared=step)
        check_end_to_end(art, step, result, log, "sm_90", "cubin", art.cubin("sm_90"))
        records.append(harness.launch_records(log, art.meta, "sm_90", result["tensors"]))
    assert records[0] == records[1] and records[0]
    out, module, stub = built
    prefill = load(out / "e2e_prefill")
    src = harness.rust_main(prefill.meta, module, {"batch": 1, "seq_q": 17, "seq_k": 33}, graph=True)
    stdout = harness.compile_rust_and_run(src, tmp_path / "never", stub, args=["/dev/null"],
                                          env={"PTXC_STUB_SM": "90", "PTXC_STUB_SMS": str(STUB_SMS)})
    assert stdout.splitlines()[1] == ("dims 801 e2e_prefill [sm_90]: cannot be captured in a CUDA graph "
                                      "(class NEVER: a prefill grid is the step's own sequence lengths)")


@pytest.mark.parametrize("name,perturb,message", [
    ("e2e_prefill", "t.v.ptr += 8;", "e2e_prefill: tensor v: address {v:#x} is not 16-byte aligned"),
    ("e2e_prefill", "t.o.ptr = 0;", "e2e_prefill: tensor o: null device address"),
    ("e2e_varlen", "d.num_splits = 0;", "e2e_varlen: dim num_splits = 0 outside 1..{max} (0 = auto: resolve_dims first)"),
    # the split kernel's launch is fine, the reduce's grid (total_q rows in y) is not: nothing runs
    ("e2e_varlen", "d.total_q = 70000;", "ptxc_e2e_varlen_reduce: grid ["),
], ids=["misaligned", "null", "unresolved-splits", "second-launch-refused"])
def test_rust_checks_preconditions_before_any_launch(built, tmp_path, name, perturb, message):
    art, _, result, log = run_loader(built, name, tmp_path, sm=90, perturb=perturb)
    rule = art.meta.get("dim_rules", {}).get("num_splits", {}).get("auto", {})
    code, error = result["run"]
    v = result["tensors"].get("v", (0,))[0]
    assert code == 1 and error.startswith(message.format(v=v, max=rule.get("max"))), error
    assert log.launches == []


def test_rust_refuses_an_image_it_was_not_generated_for(built, tmp_path):
    """Kernel::load_target with another build's image (here the embedded cubin with a byte
    appended) is refused before the driver sees it."""
    out, module, stub = built
    src = (f'#[path = "{module}"]\nmod kernels;\nuse kernels::*;\n'
           'fn main() {\n'
           '    let mut image = e2e_prefill::TARGETS[1].cubin.unwrap().to_vec();\n    image.push(0);\n'
           '    match e2e_prefill::Kernel::load_target(1, "cubin", &image) {\n'
           '        Ok(_) => println!("loaded"),\n        Err(e) => println!("{} {}", e.code, e.message),\n    }\n}\n')
    stdout = harness.compile_rust_and_run(src, tmp_path, stub, args=[], env={"PTXC_STUB_SM": "90"})
    size = len(load(out / "e2e_prefill").cubin("sm_90"))
    assert stdout.strip() == (f"200 e2e_prefill: the sm_90 cubin image ({size + 1} bytes) is not the one this "
                              f"module was generated for ({size} bytes): regenerate the module from this build")


def test_rust_variant_dispatcher(built, tmp_path):
    out, module, stub = built
    src = (f'#[path = "{module}"]\nmod kernels;\n'
           'fn main() {\n'
           '    println!("{}", kernels::find_variant("family=prefill, causal=true").unwrap());\n'
           '    let e = kernels::find_variant("family=decode,dtype=f32").unwrap_err();\n'
           '    println!("{}|{}", e.code, e.message);\n}\n')
    lines = harness.compile_rust_and_run(src, tmp_path, stub, args=[], env={}).splitlines()
    assert lines[0] == "e2e_prefill"
    assert lines[1].startswith("500|not built: family=decode,dtype=f32; built variants are e2e_merge: ")
    assert "; e2e_paged_fused: " in lines[1]


def test_rust_resolve_dims_refuses_huge_dims_before_any_arithmetic(built, tmp_path):
    """A dim of 2^62 (a debug build's multiply would panic in the split rule) is an Err."""
    out, module, stub = built
    src = (f'#[path = "{module}"]\nmod kernels;\nuse kernels::*;\n'
           'fn main() {\n    let mut d = e2e_varlen::Dims::default();\n'
           '    d.batch = 1i64 << 62; d.total_q = 5; d.max_pages_per_seq = 3; d.num_pages = 9;\n'
           '    match e2e_varlen::resolve_dims(&mut d, 6, 1) {\n'
           '        Ok(()) => println!("ok"),\n        Err(e) => println!("{} {}", e.code, e.message),\n    }\n}\n')
    stdout = harness.compile_rust_and_run(src, tmp_path, stub, args=[], env={})
    assert stdout.strip() == f"1 e2e_varlen: dim batch = {1 << 62} outside 0..2147483647"


def test_rust_variant_errors_are_pythons(built, tmp_path):
    """find_variant says what ptxc.runtime.find_variant says for an unknown field, a part that
    is not field=value, spaces, not built and ambiguous keys; a malformed key is
    CUDA_ERROR_INVALID_VALUE, a key no single artifact serves CUDA_ERROR_NOT_FOUND."""
    import json
    out, module, stub = built
    calls = "".join(f'    match kernels::find_variant({json.dumps(k)}) {{\n'
                    '        Ok(name) => println!("{}", name),\n'
                    '        Err(e) => println!("{}|{}", e.code, e.message),\n    }\n' for k in VARIANT_KEYS)
    src = f'#[path = "{module}"]\nmod kernels;\nfn main() {{\n{calls}}}\n'
    lines = harness.compile_rust_and_run(src, tmp_path, stub, args=[], env={}).splitlines()
    codes = [line.split("|", 1)[0] if "|" in line else None for line in lines]
    assert [line.split("|", 1)[-1] for line in lines] == [python_variant(out, k) for k in VARIANT_KEYS]
    assert codes == ["1", "1", "1", None, "500", "500", None, "500"]
