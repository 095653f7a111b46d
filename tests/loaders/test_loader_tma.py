"""The generated C and Rust loaders with tensor-map parameters (the sm_90a wgmma prefill with
tile.kv_loads = "tma", and the sm_100a tcgen05 prefill, warp-specialised, 320 threads):
compiled and run against the stub libcuda, whose cuTensorMapEncodeTiled
checks the driver's rules and writes the emulator's map layout, then the recorded launch -- its
parameter bytes, maps included -- replayed in ptxc.emu and compared with the fp64 reference.
Also: the loaders refuse a misaligned tensor before encoding (the preconditions), and the
stub's encoder refuses what TMA cannot describe, and the capture-safe entries (graph_run) take
a launch list with tensor maps (varlen on sm_90a: class ALWAYS)."""

import numpy as np
import pytest

from conftest import rustc_problem

from stubcuda import harness
from stubcuda.cases import STUB_SMS, another_step, input_blob, prepare, shape_dims

from ptxc.runtime import load
from ptxc.reference import from_device, max_abs_error, tolerance

SPEC = '''
[[kernel]]
name = "e2e_prefill_tma"
family = "prefill"
dtype = "bf16"
head_dim = 128
num_heads = 4
num_kv_heads = 2
causal = true
return_lse = true
targets = ["sm_90a"]

[kernel.tile]
block_m = 64
block_n = 32
kv_loads = "tma"
'''
NAME = "e2e_prefill_tma"
SHAPES = {"batch": 2, "seq_q": 19, "seq_k": 45}
# the same kernel on sm_100a (tcgen05: its tile rules take block_m 128, so the tile lines go)
SPECS = {"sm_90a": SPEC, "sm_100a": SPEC.split("[kernel.tile]")[0].replace("sm_90a", "sm_100a")}


def build_loaders(root, spec_text: str) -> tuple:
    """The spec built (cubins verified) into root/out, its C header, its Rust module (None
    without a working rustc) and the stub libcuda; skips where the toolchain is missing."""
    from ptxc.emit import cheader, rust
    from ptxc.pipeline.build import run_build
    missing = harness.toolchain_missing()
    if missing:
        pytest.skip(missing)
    (root / "e2e.toml").write_text(spec_text)
    out = root / "out"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("PTXAS", raising=False)
        run_build([root / "e2e.toml"], out, verify=True, progress=False)
    header = cheader.emit(out)
    module = rust.emit(out, root / "rust" / "ptxc_kernels.rs") if rustc_problem() is None else None
    return out, header, module, harness.build_stub(root / "stub")


@pytest.fixture(scope="module", params=sorted(SPECS))
def built(tmp_path_factory, request):
    return (*build_loaders(tmp_path_factory.mktemp("loader_tma"), SPECS[request.param]), request.param)


def run_loader(built, tmp_path, lang, perturb=""):
    out, header, module, stub, target = built
    sm = target[3:-1]
    art = load(out / NAME)
    prepared = prepare(art, SHAPES, int(sm))
    (tmp_path / "inputs.bin").write_bytes(input_blob(art, prepared[4]))
    env = {"PTXC_STUB_SM": sm, "PTXC_STUB_SMS": str(STUB_SMS)}
    if lang == "c":
        src = harness.c_main(art.meta, header, shape_dims(art, prepared[3]), perturb)
        stdout = harness.compile_and_run(src, tmp_path, stub, cxx=False, env=env,
                                         args=[str(out / NAME), str(tmp_path / "inputs.bin")])
    else:
        if module is None:
            pytest.skip(rustc_problem())
        src = harness.rust_main(art.meta, module, shape_dims(art, prepared[3]), perturb)
        stdout = harness.compile_rust_and_run(src, tmp_path, stub, env=env,
                                              args=[str(tmp_path / "inputs.bin")])
    return art, prepared, harness.parse_output(stdout), harness.read_log(tmp_path / "log")


@pytest.mark.parametrize("lang", ["c", "rust"])
def test_loader_encodes_tensor_maps_end_to_end(built, tmp_path, lang):
    art, (spec, family, inputs, dims, buffers), result, log = run_loader(built, tmp_path, lang)
    target = built[4]
    assert result["load"][:3] == (0, 0, "cubin") and result["run"] == (0, "")
    [launch] = log.launches
    [kernel] = art.meta["targets"][target]["kernels"]
    # the three maps sit at their metadata offsets, in the stub's (emulator) layout, over the
    # tensors the loader allocated
    for p in kernel["params"][-3:]:
        raw = launch.params[p["offset"]:p["offset"] + 128]
        assert raw[:8] == b"PTXCTMAP"
        assert int(np.frombuffer(raw[16:24], np.uint64)[0]) == result["tensors"][p["source"]["tensor"]][0]
        assert list(np.frombuffer(raw[52:68], np.uint32)) == p["source"]["box"]
    check_replay(art, target, (spec, family, inputs, dims, buffers), result, log)


def check_replay(art, target: str, prepared, result, log) -> None:
    """The recorded launches replayed in the emulator match the fp64 reference."""
    spec, family, inputs, _, buffers = prepared
    memory = harness.replay(log, art.meta, target, art.ptx(target), result["tensors"])
    ref, naive = family.reference(spec, inputs), family.reference(spec, inputs, dtype=spec.dtype)
    for tensor in sorted(ref):
        raw = harness.read_tensor(memory, *result["tensors"][tensor])
        got = from_device(raw.view(buffers[tensor].dtype).reshape(buffers[tensor].shape),
                          art.meta["tensors"][tensor]["dtype"])
        assert max_abs_error(got, ref[tensor]) <= tolerance(naive[tensor], ref[tensor]), tensor


@pytest.mark.parametrize("lang,perturb", [("c", "t.k.ptr += 8;"), ("rust", "t.k.ptr += 8;")])
def test_loader_refuses_a_misaligned_tensor_before_encoding(built, tmp_path, lang, perturb):
    _, _, result, log = run_loader(built, tmp_path, lang, perturb)
    assert result["run"][0] == 1 and "tensor k: address" in result["run"][1]
    assert log.launches == []


@pytest.mark.parametrize("lang", ["c", "rust"])
def test_encoder_failure_is_one_line(built, tmp_path, lang):
    """A K row stride that is a multiple of 8 elements but whose byte stride is past 2^40:
    the preconditions pass, the driver (here the stub) refuses the map, the loader says which
    parameter."""
    perturb = ("t.k.strides[0] = (int64_t)1 << 40;" if lang == "c" else "t.k.strides[0] = 1i64 << 40;")
    _, _, result, log = run_loader(built, tmp_path, lang, perturb)
    code, message = result["run"]
    assert code == 1 and "parameter k_tmap: cuTensorMapEncodeTiled failed" in message
    assert "\n" not in message and log.launches == []


VARLEN_SPEC = '''
[[kernel]]
name = "e2e_varlen_tma"
family = "varlen"
dtype = "f16"
head_dim = 64
num_heads = 8
num_kv_heads = 2
causal = true
return_lse = true
kv_layout = "paged"
page_size = 16
targets = ["sm_90a"]
'''
# MLA's latent tile on sm_90a: one 3D map over the latent cache (kv_tmap), split scores
MLA_SPEC = '''
[[kernel]]
name = "e2e_mla_tma"
family = "mla"
dtype = "f16"
num_heads = 64
softmax_scale = 0.1
page_size = 16
targets = ["sm_90a"]
'''
GRAPH_CASES = {"e2e_varlen_tma": VARLEN_SPEC, "e2e_mla_tma": MLA_SPEC}
VARLEN_SHAPES = {"batch": 3, "max_pages_per_seq": 4, "num_pages": 13}


@pytest.fixture(scope="module")
def built_graph(tmp_path_factory):
    return build_loaders(tmp_path_factory.mktemp("loader_tma_graph"), "\n".join(GRAPH_CASES.values()))


@pytest.mark.parametrize("name", sorted(GRAPH_CASES))
@pytest.mark.parametrize("lang", ["c", "rust"])
def test_graph_run_captures_tensor_map_kernels(built_graph, tmp_path, lang, name):
    """ptxc_<a>_graph_run / Kernel::graph_run on the sm_90a TMA kernels of varlen and MLA
    (class ALWAYS: the maps over the caches are encoded at the maxima like every other
    parameter): two steps of different compositions enqueue the same launches, maps included,
    and each replays right."""
    out, header, module, stub = built_graph
    if lang == "rust" and module is None:
        pytest.skip(rustc_problem())
    art = load(out / name)
    assert art.meta["graph"]["targets"]["sm_90a"]["class"] == "ALWAYS"
    first = prepare(art, VARLEN_SHAPES, 90)
    env = {"PTXC_STUB_SM": "90", "PTXC_STUB_SMS": str(STUB_SMS)}
    records = []
    for i, (spec, family, inputs, dims, buffers) in enumerate((first, another_step(art, first, 90))):
        work = tmp_path / str(i)
        work.mkdir()
        (work / "inputs.bin").write_bytes(input_blob(art, buffers))
        if lang == "c":
            src = harness.c_main(art.meta, header, shape_dims(art, dims), graph=True)
            stdout = harness.compile_and_run(src, work, stub, cxx=False, env=env,
                                             args=[str(out / name), str(work / "inputs.bin")])
        else:
            src = harness.rust_main(art.meta, module, shape_dims(art, dims), graph=True)
            stdout = harness.compile_rust_and_run(src, work, stub, env=env, args=[str(work / "inputs.bin")])
        result, log = harness.parse_output(stdout), harness.read_log(work / "log")
        assert result["run"] == (0, ""), result
        check_replay(art, "sm_90a", (spec, family, inputs, dims, buffers), result, log)
        records.append(harness.launch_records(log, art.meta, "sm_90a", result["tensors"]))
    assert records[0] == records[1] and records[0]
    assert any(name.endswith("_tmap") for *_, params in records[0] for name, *_ in params)
