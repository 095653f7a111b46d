"""sm_90a wgmma prefill fed by TMA from one elected thread (tile.kv_loads = "tma" with
warp_specialize = false; tma_pipeline.py -- the default, a producer warpgroup, is
tests/families/test_prefill_tma_ws.py):
numerical checks in the emulator against the fp64 reference on the wgmma test shapes (odd
lengths, causal bottom-right, q_len > L, GQA/MQA, LSE, variants, bhsd strides, empty inputs),
the tile key's rules, the tensor-map launch parameters (metadata, checked loading refuses a
tampered box or swizzle, the loaders encode them), the encoding every launcher
derives (pure function), ptxas with 0 spills at d64/128/256 and the SASS loop figure."""

import json

import numpy as np
import pytest

from ptxc.errors import InputError, SpecError, VerifyError
from ptxc.kernels import load_text
from families.prefill_cases import TENSOR_CORE_MATRIX, check, compiled, run, spec_text

emu = pytest.importorskip("ptxc.emu", reason="the emulator is needed for numerical checks")
SM90A = ("sm_90a",)
SMALL = {"block_m": 64, "block_n": 32, "kv_loads": "tma", "warp_specialize": False}
ONE_ISSUER = {"kv_loads": "tma", "warp_specialize": False}
SHAPES = [(1, 17), (17, 113), (113, 17)]


def tma_check(dtype, head_dim, heads, causal, shapes=SHAPES, tile=SMALL, **kw):
    text = spec_text(dtype, head_dim, heads, causal, tile=tile, targets=SM90A)
    _, ptx, launch, config = compiled(text, "sm_90a")
    assert config["kv_loads"] == "tma" and not config["cp_async"]
    assert "cp.async.bulk.tensor.4d" in ptx and "cp.async.ca" not in ptx and "cp.async.cg" not in ptx
    assert [p["name"] for p in launch["params"][-3:]] == ["q_tmap", "k_tmap", "v_tmap"]
    check(text, shapes, target="sm_90a", **kw)


@pytest.mark.parametrize("dtype,head_dim,heads,causal", TENSOR_CORE_MATRIX)
def test_matrix(dtype, head_dim, heads, causal):
    tma_check(dtype, head_dim, heads, causal)


@pytest.mark.parametrize("head_dim,block_n", [(64, 128), (128, 128), (256, 64)])
def test_default_tiles_two_warpgroups(head_dim, block_n):
    """The default tiles (two warpgroups, two stages), q_len > L and a tail tile."""
    text = spec_text("bf16", head_dim, "gqa4" if head_dim < 256 else "mqa", True,
                     tile=ONE_ISSUER, targets=SM90A)
    c = compiled(text, "sm_90a")[3]
    assert (c["block_m"], c["block_n"], c["num_warps"], c["num_stages"]) == (128, block_n, 8, 2)
    check(text, [(150, 131)] if head_dim < 256 else [(130, 70)], batch=1, target="sm_90a")


@pytest.mark.parametrize("stages", [1, 3])
def test_pipeline_depths(stages):
    """The barrier slot / parity arithmetic at other depths (1: one slot, parity flips every
    tile; 3: the slot wraps mid-sequence)."""
    tma_check("bf16", 64, "mqa", True, [(40, 100)], tile={**SMALL, "num_stages": stages}, batch=1)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_block_m_64_at_large_head_dims(head_dim):
    """The per-thread copy needs whole 8-row passes (block_m 128 at d128/d256); TMA has no such
    rule (ptxas 13.5: d256 64 x 64 takes 211 registers, no spills)."""
    tma_check("f16", head_dim, "gqa4", False, [(70, 45)], tile={**SMALL, "block_n": 64}, batch=1)


def test_bhsd_strides_and_growing_scores():
    from families.prefill_cases import growing_scores
    tma_check("f16", 64, "gqa4", True, [(17, 45)], layout="bhsd")
    tma_check("bf16", 64, "mqa", False, [(3, 97)], transform=growing_scores)


def test_zero_keys_and_empty_rows():
    outs = run(spec_text("bf16", 128, "gqa4", False, tile=SMALL, targets=SM90A), 9, 0,
               target="sm_90a")[0]
    assert np.all(outs["o"] == 0) and np.all(np.isneginf(outs["lse"]))
    outs = run(spec_text("f16", 64, "mha", True, lse=False, tile=SMALL, targets=SM90A), 40, 7,
               target="sm_90a")[0]
    assert set(outs) == {"o"} and np.all(outs["o"][:, :33] == 0)   # rows 0..32 see no key


@pytest.mark.parametrize("extra", ["sliding_window = 21\n", "logits_soft_cap = 2.0\n",
                                   "attention_sinks = true\n", "alibi = true\n"])
def test_variants(extra):
    text = spec_text("f16", 64, "gqa4", True, tile=SMALL, targets=SM90A).replace(
        "[kernel.tile]", extra + "[kernel.tile]")
    check(text, [(17, 113)], batch=1, target="sm_90a")


# ---- the tile key ------------------------------------------------------------------------------
def test_kv_loads_needs_a_wgmma_target():
    for dtype, d, targets in (("f16", 64, ("sm_80", "sm_90")), ("f32", 64, SM90A), ("f16", 96, SM90A)):
        with pytest.raises(SpecError) as e:
            load_text(spec_text(dtype, d, tile={"kv_loads": "tma"}, targets=targets))
        assert e.value.key == "tile.kv_loads" and "\n" not in str(e.value)
    with pytest.raises(SpecError, match="kv_loads"):
        load_text(spec_text("f16", 64, tile={"kv_loads": "bulk"}, targets=SM90A))


def test_default_on_sm90a_and_other_targets_ignore_the_key():
    """TMA is the sm_90a default; `kv_loads` changes nothing on the other targets of a
    multi-target spec, and "cp_async" gives the per-thread kernel."""
    targets = ("sm_80", "sm_90", "sm_90a")
    tma = spec_text("f16", 64, "gqa4", True, tile={"kv_loads": "tma"}, targets=targets)
    plain = spec_text("f16", 64, "gqa4", True, targets=targets)
    cp = spec_text("f16", 64, "gqa4", True, tile={"kv_loads": "cp_async"}, targets=targets)
    for target in ("sm_80", "sm_90"):
        assert compiled(tma, target)[1:] == compiled(plain, target)[1:] == compiled(cp, target)[1:]
    assert compiled(tma, "sm_90a")[1:] == compiled(plain, "sm_90a")[1:]
    assert compiled(plain, "sm_90a")[3]["kv_loads"] == "tma"
    ptx, _, config = compiled(cp, "sm_90a")[1:]
    assert "kv_loads" not in config and config["cp_async"] and "cp.async.bulk" not in ptx


# ---- the tensor-map encoding (pure) ------------------------------------------------------------
def test_encoding_of_a_bshd_tensor():
    from ptxc.runtime.tensor_maps import encode_tensor_map
    shape, esize = (3, 113, 8, 128), 2
    strides = (113 * 8 * 128 * 2, 8 * 128 * 2, 128 * 2, 2)
    enc = encode_tensor_map("t", "bf16", shape, strides, 0x10000, (64, 1, 128, 1), 128)
    assert (enc.data_type, enc.rank, enc.dims, enc.strides) == \
        ("BFLOAT16", 4, (128, 8, 113, 3), (256, 2048, 113 * 2048))
    assert (enc.box, enc.element_strides, enc.swizzle, enc.l2_promotion, enc.oob_fill,
            enc.interleave) == ((64, 1, 128, 1), (1, 1, 1, 1), "128B", "L2_128B", "NONE", "NONE")
    # a head-major view (bhsd memory): the strides follow the tensor
    enc = encode_tensor_map("t", "f16", (2, 17, 4, 64), (4 * 32 * 128, 128, 32 * 128, 2), 0,
                            (64, 1, 64, 1), 128)
    assert enc.dims == (64, 4, 17, 2) and enc.strides == (32 * 128, 128, 4 * 32 * 128)
    # an empty tensor (seq_k = 0) is described as packed with the empty axis 1
    enc = encode_tensor_map("t", "f16", (2, 0, 4, 64), (0, 0, 0, 0), 0, (64, 1, 64, 1), 128)
    assert enc.dims == (64, 4, 1, 2) and enc.strides == (128, 512, 512)
    assert esize == 2


@pytest.mark.parametrize("shape,strides,address,box,swizzle,message", [
    ((2, 5, 64), (640, 128, 2), 8, (64, 5, 1), 128, "not 16-byte aligned"),
    ((2, 5, 64), (648, 130, 2), 0, (64, 5, 1), 128, "byte stride 130 along axis 1"),
    ((2, 5, 64), (1280, 256, 4), 0, (64, 5, 1), 128, "innermost axis must be packed"),
    ((2, 5, 64), (640, 128, 2), 0, (64, 300, 1), 128, "boxes are 1..256"),
    ((2, 5, 128), (1280, 256, 2), 0, (128, 5, 1), 128, "at most the swizzle width"),
    ((2, 5, 64), (640, 128, 2), 0, (64, 5), 128, "one box size per dim"),
])
def test_encoding_refuses_what_tma_cannot_describe(shape, strides, address, box, swizzle, message):
    from ptxc.runtime.tensor_maps import encode_tensor_map
    with pytest.raises(InputError, match=message) as e:
        encode_tensor_map("k: tensor map of k", "f16", shape, strides, address, box, swizzle)
    assert "\n" not in str(e.value)


def test_cuda_call_arguments():
    """What the cuda backend hands cuTensorMapEncodeTiled (needs cuda-python's enums only)."""
    pytest.importorskip("cuda.bindings.driver", reason="cuda-python is not installed")
    from cuda.bindings import driver as drv

    from ptxc.runtime.cuda import tensor_map_call
    from ptxc.runtime.tensor_maps import encode_tensor_map
    enc = encode_tensor_map("t", "f16", (1, 17, 2, 64), (17 * 256, 256, 128, 2), 256,
                            (64, 1, 64, 1), 128)
    args = tensor_map_call(enc)
    assert args[0] == drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16
    assert (int(args[1]), args[2], *([int(v) for v in a] for a in args[3:7])) == (
        4, 256, [64, 2, 17, 1], [128, 256, 4352], [64, 1, 64, 1], [1, 1, 1, 1])
    assert isinstance(args[1], drv.cuuint32_t) and all(isinstance(v, drv.cuuint32_t) for v in args[5] + args[6])
    assert all(isinstance(v, drv.cuuint64_t) for v in args[3] + args[4])
    assert args[7:] == (drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
                        drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
                        drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                        drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)


def _encoding_driver(monkeypatch):
    """cuda-python's real driver module, except that cuTensorMapEncodeTiled, after cuda-python
    has converted every argument (a TypeError there is what the H200 run hit), returns a blank
    map when no libcuda is installed: the argument conversion is checked without a GPU."""
    from types import SimpleNamespace

    from cuda.bindings import driver as real

    import ptxc.runtime.cuda as rcuda
    calls = []

    def encode(*args):
        calls.append(args)
        try:
            return real.cuTensorMapEncodeTiled(*args)
        except TypeError:
            raise
        except Exception:          # no libcuda here: the call got past the conversion
            return real.CUresult.CUDA_SUCCESS, real.CUtensorMap()
    fake = SimpleNamespace(**{n: getattr(real, n) for n in dir(real) if not n.startswith("__")})
    fake.cuTensorMapEncodeTiled = encode
    monkeypatch.setattr(rcuda, "_driver", lambda: fake)
    return calls


def test_cuda_python_takes_the_encoding_call(monkeypatch):
    """The arguments pass cuda-python's own conversion (plain ints raised TypeError on device)."""
    pytest.importorskip("cuda.bindings.driver", reason="cuda-python is not installed")
    from ptxc.runtime.cuda import tensor_map_call
    from ptxc.runtime.tensor_maps import encode_tensor_map
    calls = _encoding_driver(monkeypatch)
    import ptxc.runtime.cuda as rcuda
    enc = encode_tensor_map("t", "bf16", (2, 33, 8, 128), (33 * 2048, 2048, 256, 2), 1 << 40,
                            (64, 1, 64, 1), 128)
    err, _ = rcuda._driver().cuTensorMapEncodeTiled(*tensor_map_call(enc))
    assert len(calls) == 1 and err == rcuda._driver().CUresult.CUDA_SUCCESS


def test_launch_arguments_of_a_tma_kernel(built, monkeypatch):
    """What the cuda backend and `ptxc bench` hand cuLaunchKernel for the sm_90a TMA prefill:
    one void* per parameter, each tensor map a 64-byte aligned 128-byte block (bench refused
    tensor maps outright before: "this launcher encodes none")."""
    pytest.importorskip("cuda.bindings.driver", reason="cuda-python is not installed")
    import ctypes

    from ptxc.kernels import FAMILIES
    from ptxc.runtime import load, prepare_buffers
    from ptxc.runtime.cuda import launch_args
    calls = _encoding_driver(monkeypatch)
    out, _ = built
    art = load(out / "llama3_8b_prefill")
    [spec] = load_text((out.parent / "l.toml").read_text())
    dims = {"batch": 1, "seq_q": 9, "seq_k": 70}
    inputs = FAMILIES["prefill"].make_inputs(spec, dims, np.random.default_rng(1))
    buffers = prepare_buffers(art.meta, inputs, dims)
    [kern] = art.meta["targets"]["sm_90a"]["kernels"]
    cvals, argv = launch_args(art.meta, kern, buffers, dims, lambda n: 0x10000 * (1 + sorted(buffers).index(n)))
    assert len(cvals) == len(argv) == len(kern["params"]) and len(calls) == 3
    for p, v, a in zip(kern["params"], cvals, argv):
        assert a == ctypes.addressof(v)
        if p["type"] == "tmap":
            assert ctypes.sizeof(v) == 128 and a % 64 == 0
    addresses = [c[2] for c in calls]
    assert addresses == [0x10000 * (1 + sorted(buffers).index(t)) for t in "qkv"]


# ---- artifacts: metadata, checked loading, loaders, ptxas, SASS --------------------------------
@pytest.fixture(scope="module")
def built(tmp_path_factory, toolchain):
    from conftest import SPECS
    from ptxc.pipeline.build import run_build
    tmp = tmp_path_factory.mktemp("tma")
    text = (SPECS / "llama3_8b_prefill.toml").read_text()
    text = "\n".join('targets = ["sm_90a"]' if line.startswith("targets") else line
                     for line in text.splitlines()) + '\n[kernel.tile]\nkv_loads = "tma"\nwarp_specialize = false\n'
    (tmp / "l.toml").write_text(text)
    summary = run_build([tmp / "l.toml"], tmp / "out", progress=False, cache_dir=tmp / "cache")
    return tmp / "out", summary


def test_metadata_records_the_tensor_maps(built):
    from ptxc.runtime import load
    out, summary = built
    assert summary["verified"] and not summary["problems"]
    meta = load(out / "llama3_8b_prefill").meta
    [kern] = meta["targets"]["sm_90a"]["kernels"]
    maps = [p for p in kern["params"] if p["type"] == "tmap"]
    assert [(p["name"], p["size"], p["offset"] % 64, p["source"]) for p in maps] == [
        (f"{t}_tmap", 128, 0, {"kind": "tensor_map", "tensor": t, "box": [64, 1, 128, 1],
                               "swizzle": 128}) for t in "qkv"]
    assert kern["param_bytes"] == maps[-1]["offset"] + 128
    assert meta["targets"]["sm_90a"]["config"]["kv_loads"] == "tma"


@pytest.mark.parametrize("edit", [
    lambda p: p["source"].__setitem__("box", [64, 1, 64, 1]),
    lambda p: p["source"].__setitem__("swizzle", 64),
    lambda p: p["source"].__setitem__("tensor", "q"),
    lambda p: p.__setitem__("offset", p["offset"] + 8),
    lambda p: p["source"].__setitem__("box", [64, 1, 999, 1]),
])
def test_checked_loading_refuses_a_tampered_tensor_map(built, tmp_path, edit):
    import shutil

    from ptxc.files import sha256
    from ptxc.pipeline.checked import load_checked
    out, _ = built
    dest = tmp_path / "out"
    shutil.copytree(out, dest)
    path = dest / "llama3_8b_prefill" / "llama3_8b_prefill.json"
    meta = json.loads(path.read_text())
    edit(next(p for p in meta["targets"]["sm_90a"]["kernels"][0]["params"] if p["name"] == "k_tmap"))
    raw = (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode()
    path.write_bytes(raw)
    manifest = json.loads((dest / "manifest.json").read_text())
    for entry in manifest["artifacts"].values():   # re-sign, so only the content check can refuse
        if isinstance(entry, dict) and "metadata_sha256" in entry:
            entry["metadata_sha256"] = sha256(raw)
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    with pytest.raises(VerifyError):
        load_checked(dest / "llama3_8b_prefill")


def test_runtime_runs_the_artifact_and_loaders_encode_it(built, tmp_path):
    """ptxc.runtime (emulator backend) runs the built artifact; the C and Rust loaders encode its
    maps with cuTensorMapEncodeTiled (run end to end in tests/loaders/test_loader_tma.py)."""
    from ptxc.emit import cheader, rust
    from ptxc.kernels import FAMILIES
    from ptxc.runtime import load
    from ptxc.reference import max_abs_error, tolerance
    out, _ = built
    art = load(out / "llama3_8b_prefill")
    prefill = FAMILIES["prefill"]
    [spec] = load_text((out.parent / "l.toml").read_text())
    inputs = prefill.make_inputs(spec, {"batch": 1, "seq_q": 9, "seq_k": 70},
                                 np.random.default_rng(1))
    got = art.run(inputs, target="sm_90a")["o"]
    ref, naive = prefill.reference(spec, inputs), prefill.reference(spec, inputs, dtype="f16")
    assert max_abs_error(got, ref["o"]) <= tolerance(naive["o"], ref["o"])
    header = cheader.emit(out, tmp_path / "k.h").read_text()
    assert header.count("ptxc_put_tensor_map(L, p.bytes, ") == 3
    assert "CU_TENSOR_MAP_DATA_TYPE_FLOAT16, box, CU_TENSOR_MAP_SWIZZLE_128B" in header
    module = rust.emit(out, tmp_path / "k.rs").read_text()
    assert module.count("put_tensor_map(&mut p, ") == 3


def test_ptxas_zero_spills(toolchain):
    from ptxc.pipeline.ptxas import assemble
    for d in (64, 128, 256):
        for dtype in ("f16", "bf16"):
            for causal in (False, True):
                text = spec_text(dtype, d, "gqa4", causal, tile=ONE_ISSUER, targets=SM90A)
                _, res, _ = assemble(compiled(text, "sm_90a")[1], "sm_90a", toolchain, "p")
                [r] = res.values()
                assert r.spill_stores == r.spill_loads == 0 and r.stack == 0, (d, dtype, causal)


def test_sass_loop(built):
    """The TMA loop at d128: the same tensor work as the cp.async one (24 tensor instructions,
    264 HMMA-equivalents per warp) in fewer instructions -- no per-thread copies or address
    arithmetic (ptxas 13.5: 351 against 454, 1.33 per HMMA-equivalent against 1.72, for the
    warps that issue no box; the issuing warp's ELECT issue loops make it 408, 1.55, and the
    loop analysis reports that worst warp)."""
    from ptxc.report.sass import SassUnavailable, sass_profile
    out, _ = built
    meta = json.loads((out / "llama3_8b_prefill" / "llama3_8b_prefill.json").read_text())
    cubin = (out / "llama3_8b_prefill" / meta["targets"]["sm_90a"]["cubin"]).read_bytes()
    try:
        [prof] = sass_profile(cubin).values()
    except SassUnavailable as e:
        pytest.skip(f"SASS unavailable: {e}")
    loop = prof["loops"]["loops"][prof["loops"]["main"]]
    assert (loop["classes"]["tensor"], loop["mma_equivalents"]) == (24, 264)
    assert loop["classes"]["ldgsts"] == 0 and prof["mix"]["LDGSTS"] == 0
    per_eq = loop["mma_flops"] / 4096
    assert loop["warp_instructions"]["others"] / per_eq <= 1.5
    assert loop["worst_warp"] == "issuer" and loop["instructions_per_mma_equivalent"] < 1.72
