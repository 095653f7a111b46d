"""ptxc.runtime.device against the stub libcuda (tests/stubcuda): device tensors given through
__cuda_array_interface__, launched on the caller's stream with no copy; each recorded launch is
replayed in the emulator on the recorded memory and checked against fp64. Each scenario runs in
its own process (the stub numbers launches per process)."""

import json
import sys
import textwrap

import numpy as np
import pytest

from conftest import build_kernel
from ptxc.kernels import FAMILIES
from ptxc import reference as ref
from ptxc.spec.model import KernelSpec
from stubcuda import harness

pytestmark = pytest.mark.skipif(harness.toolchain_missing() is not None,
                                reason=str(harness.toolchain_missing()))

SCRIPT = textwrap.dedent('''
    import ctypes, json, sys
    import numpy as np
    from ptxc.runtime import load
    from ptxc.runtime.device import DeviceRuntime
    from ptxc.errors import PtxcError
    art_dir, inputs_path, mode = sys.argv[1:4]
    art = load(art_dir)
    rt = DeviceRuntime(libcuda=sys.argv[4])
    drv = rt.driver

    class Dev:       # device memory seen through the CUDA array interface
        def __init__(self, addr, shape, typestr, strides=None, dl=None):
            self.__cuda_array_interface__ = {"data": (addr, False), "shape": shape, "typestr": typestr,
                                             "strides": strides, "version": 3}
            if dl is not None:
                self.__dlpack_device__ = lambda: dl

    DL = {"f32": (2, 32), "f16": (2, 16), "bf16": (4, 16), "i32": (0, 32), "u64": (1, 64), "u8": (1, 8)}

    class DLTensor(ctypes.Structure):
        _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32),
                    ("ndim", ctypes.c_int32), ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8),
                    ("lanes", ctypes.c_uint16), ("shape", ctypes.POINTER(ctypes.c_int64)),
                    ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64),
                    ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]

    class DLOnly:    # a DLPack-only producer (no CAI), e.g. torch's bf16 through DLPack
        def __init__(self, addr, shape, dtype):
            self.shape = (ctypes.c_int64 * len(shape))(*shape)
            self.t = DLTensor(addr, 2, 0, len(shape), *DL[dtype], 1, self.shape, None, 0, None, None)
        def __dlpack__(self, stream=None):
            self.stream = stream
            new = ctypes.pythonapi.PyCapsule_New
            new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
            return new(ctypes.addressof(self.t), b"dltensor", None)
        def __dlpack_device__(self):
            return (2, 0)

    class Stream:
        cuda_stream = 0x5150

    TYPESTR = {"f32": "<f4", "f16": "<f2", "bf16": "<V2", "i32": "<i4", "i64": "<i8", "u64": "<u8",
               "e4m3": "|u1", "e5m2": "|u1", "u8": "|u1"}
    host = dict(np.load(inputs_path))
    tensors, where = {}, {}
    for name, info in art.meta["tensors"].items():
        arr = np.ascontiguousarray(host[name])
        p = ctypes.c_uint64()
        drv("cuMemAlloc_v2", ctypes.byref(p), ctypes.c_size_t(max(arr.nbytes, 1)))
        drv("cuMemcpyHtoD_v2", p, arr.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(arr.nbytes))
        tensors[name] = (DLOnly(p.value, arr.shape, info["dtype"]) if mode == "dlpack"
                         else Dev(p.value, arr.shape, TYPESTR[info["dtype"]]))
        where[name] = (p.value, arr.nbytes)
    result = {"tensors": where}
    try:
        if mode == "misaligned":
            t = tensors["q"].__cuda_array_interface__
            tensors["q"] = Dev(t["data"][0] + 2, t["shape"], t["typestr"])
        elif mode == "wrong_device":
            t = tensors["q"].__cuda_array_interface__
            tensors["q"] = Dev(t["data"][0], t["shape"], t["typestr"], dl=(2, 1))
        elif mode == "wrong_dtype":
            t = tensors["q"].__cuda_array_interface__
            tensors["q"] = Dev(t["data"][0], t["shape"], "<f4")
        elif mode == "null":
            t = tensors["o"].__cuda_array_interface__
            tensors["o"] = Dev(0, t["shape"], t["typestr"])
        if mode == "repeat" or mode.startswith("graph"):
            rt.prepare(art) if mode != "graph_unprepared" else None
        if mode.startswith("graph"):
            result["dims"] = rt.graph_launch(art, tensors, json.loads(sys.argv[5]), stream=Stream())
        for _ in range(100 if mode == "repeat" else 0 if mode.startswith("graph") else 1):
            result["dims"] = rt.launch(art, tensors, stream=Stream(),
                                       sets={"num_splits": 0} if mode == "splits0" else None)
        result["module_loads"] = rt.module_loads
    except PtxcError as e:
        result["error"] = str(e)
    print(json.dumps(result))
''')


@pytest.fixture(scope="module")
def stub(tmp_path_factory):
    return harness.build_stub(tmp_path_factory.mktemp("stub")) / "libcuda.so"


def run_script(tmp_path, stub, art, inputs, mode="ok", maxima=None, sm=80):
    tmp_path.mkdir(parents=True, exist_ok=True)
    np.savez(tmp_path / "in.npz", **inputs)
    (tmp_path / "s.py").write_text(SCRIPT)
    out = harness.run_program([sys.executable, str(tmp_path / "s.py"), str(art.path),
                               str(tmp_path / "in.npz"), mode, str(stub), json.dumps(maxima or {})], tmp_path,
                              {"PTXC_STUB_SM": str(sm), "PTXC_STUB_SMS": "7"})
    return json.loads(out.strip().splitlines()[-1]), harness.read_log(tmp_path / "log")


def device_inputs(art, inputs, target="sm_80"):
    """Every tensor in device format (bf16 as bits); outputs and workspaces NaN-poisoned."""
    from ptxc.runtime import infer_dims, prepare_buffers
    dims = infer_dims(art.meta, inputs, {}, num_sms=7, target=target)
    return prepare_buffers(art.meta, inputs, dims)


CASES = {
    "decode": ("decode", 'dtype = "bf16"\nhead_dim = 32\nnum_heads = 4\nnum_kv_heads = 2\n'
               'num_splits = "auto"\nreturn_lse = true\nkv_layout = "paged"\npage_size = 16',
               {"batch": 3, "max_pages_per_seq": 2, "num_pages": 7}),
    "varlen": ("varlen", 'dtype = "f16"\nhead_dim = 24\nnum_heads = 4\nnum_kv_heads = 2\ncausal = true\n'
               'num_splits = 2\nreturn_lse = true\nkv_layout = "contiguous"', {"batch": 4, "max_seq_len": 17}),
    "prefill": ("prefill", 'dtype = "f16"\nhead_dim = 40\nnum_heads = 2\nnum_kv_heads = 2\ncausal = true',
                {"batch": 1, "seq_q": 17, "seq_k": 17}),
    "prefill_mask": ("prefill", 'dtype = "bf16"\nhead_dim = 40\nnum_heads = 2\nnum_kv_heads = 1\ncausal = false\n'
                     'custom_mask = "packed"\nreturn_lse = true', {"batch": 2, "seq_q": 17, "seq_k": 19}),
    "kv_append": ("kv_append", 'dtype = "f16"\nhead_dim = 32\nnum_heads = 4\nnum_kv_heads = 2\n'
                  'kv_layout = "paged"\npage_size = 16', {"batch": 3, "num_new": 2, "max_pages_per_seq": 2,
                                                          "num_pages": 7}),
    "kv_append_slots": ("kv_append", 'dtype = "f16"\nhead_dim = 32\nnum_heads = 4\nnum_kv_heads = 2\n'
                        'kv_layout = "paged"\npage_size = 4\nindex = "slot_mapping"\nkv_dtype = "e4m3"\n'
                        'kv_scale = "head"\nrope = "neox"', {"num_tokens": 9, "num_pages": 3, "max_position": 20}),
    "mla": ("mla", 'dtype = "f16"\nnum_heads = 16\nkv_lora_rank = 128\nqk_rope_head_dim = 16\n'
            'softmax_scale = 0.125\npage_size = 16', {"batch": 9, "max_pages_per_seq": 5, "num_pages": 50}),
    "mla_sparse": ("mla", 'dtype = "f16"\nnum_heads = 16\nkv_lora_rank = 128\nqk_rope_head_dim = 16\n'
                   'softmax_scale = 0.125\npage_size = 16\nsparse_topk = 20\ntopk_length = true',
                   {"total_q": 5, "num_pages": 4}),
    "mla_append": ("mla_append", 'dtype = "f16"\nkv_lora_rank = 128\nqk_rope_head_dim = 16\n'
                   'page_size = 16\nkv_dtype = "e4m3"\nkv_scale = "device"\nrope = "neox"', {"num_tokens": 9, "num_pages": 2,
                                                                          "max_position": 20}),
}


def test_every_tensor_dtype_has_a_device_form():
    """A tensor dtype the metadata may name (custom masks' u8, slot mappings' i64, ...) has a
    CUDA-array-interface typestr and a DLPack code, so the device path answers in one line."""
    from ptxc.runtime import HOST_DTYPES
    from ptxc.runtime.device import DL_DTYPES, TYPESTRS
    assert set(TYPESTRS) == set(DL_DTYPES) == set(HOST_DTYPES)


@pytest.mark.parametrize("case,mode", [(c, "cai") for c in CASES] + [("decode", "dlpack")])
def test_every_family_launches_on_device_tensors(tmp_path, stub, case, mode):
    """Through __cuda_array_interface__, and the bf16 decode through DLPack alone (kDLBfloat)."""
    family, body, dims = CASES[case]
    art = build_kernel(tmp_path, family, body)
    spec = KernelSpec.from_dict(art.meta["spec"])
    inputs = FAMILIES[family].make_inputs(spec, dims, np.random.default_rng(5))
    check_launched(tmp_path, stub, art, spec, inputs, mode=mode)


def check_launched(tmp_path, stub, art, spec, inputs, mode="cai", maxima=None, target="sm_80") -> list:
    """Run the script, replay its launches in the emulator, compare with fp64; the launches as
    a graph would hold them."""
    family = spec.family
    buffers = device_inputs(art, inputs, target)
    result, log = run_script(tmp_path, stub, art, buffers, mode=mode, maxima=maxima,
                             sm=int("".join(c for c in target[3:] if c.isdigit())))
    assert "error" not in result, result
    assert log.launches and all(line.endswith("0x5150") for line in
                                (tmp_path / "log" / "events.txt").read_text().splitlines()
                                if line.startswith("launch"))          # the caller's stream
    memory = harness.replay(log, art.meta, target, art.ptx(target), result["tensors"])
    want = FAMILIES[family].reference(spec, inputs)
    from ptxc.reference import from_device
    for name, expected in want.items():
        info = art.meta["tensors"][name]
        addr, size = result["tensors"][name]
        raw = harness.read_tensor(memory, addr, size).view(buffers[name].dtype).reshape(buffers[name].shape)
        got = from_device(raw, info["dtype"])
        if np.issubdtype(np.asarray(expected).dtype, np.floating) and name != "lse":
            assert ref.max_abs_error(got, expected) < 5e-3, name
        elif name != "lse":
            assert np.array_equal(got, expected), name
    return harness.launch_records(log, art.meta, target, result["tensors"])


TMA_CASES = {   # kernels whose K/V (and Q) tiles come by TMA: tensor-map parameters
    "prefill": ("prefill", 'dtype = "bf16"\nhead_dim = 64\nnum_heads = 4\nnum_kv_heads = 2\ncausal = true\n'
                'return_lse = true', 'block_m = 64\nblock_n = 32\nkv_loads = "tma"',
                {"batch": 2, "seq_q": 19, "seq_k": 45}, "sm_90a"),
    "varlen": ("varlen", 'dtype = "f16"\nhead_dim = 64\nnum_heads = 8\nnum_kv_heads = 2\ncausal = true\n'
               'return_lse = true\nkv_layout = "paged"\npage_size = 16', 'kv_loads = "tma"',
               {"batch": 3, "max_pages_per_seq": 4, "num_pages": 13}, "sm_90a"),
    # sm_100a: the warp-specialised tcgen05 prefill (d128, 320 threads) and varlen's tile
    "prefill_tcgen05": ("prefill", 'dtype = "bf16"\nhead_dim = 128\nnum_heads = 4\nnum_kv_heads = 2\n'
                        'causal = true\nreturn_lse = true', '', {"batch": 2, "seq_q": 19, "seq_k": 45},
                        "sm_100a"),
    "varlen_tcgen05": ("varlen", 'dtype = "f16"\nhead_dim = 64\nnum_heads = 8\nnum_kv_heads = 2\n'
                       'causal = true\nreturn_lse = true\nkv_layout = "paged"\npage_size = 16', '',
                       {"batch": 3, "max_pages_per_seq": 4, "num_pages": 13}, "sm_100a"),
    # MLA's latent tile on sm_90a wgmma: one 3D map over the latent cache (kv_tmap)
    "mla": ("mla", 'dtype = "f16"\nnum_heads = 64\nsoftmax_scale = 0.1\npage_size = 16', '',
            {"batch": 3, "max_pages_per_seq": 4, "num_pages": 13}, "sm_90a"),
}


@pytest.mark.parametrize("case", sorted(TMA_CASES))
def test_tensor_map_kernels_launch_on_device_tensors(tmp_path, stub, case):
    """The TMA kernels (sm_90a wgmma, sm_100a tcgen05) through the engine path: DeviceRuntime
    encodes each tensor map with the driver's cuTensorMapEncodeTiled for the caller's tensor
    (the stub checks the driver's rules and writes the emulator's map layout), and the launch
    replays right."""
    family, body, tile, dims, target = TMA_CASES[case]
    art = build_kernel(tmp_path, family, body, tile=tile, targets=(target,))
    [kern] = [k for k in art.meta["targets"][target]["kernels"] if any(p["type"] == "tmap" for p in k["params"])]
    spec = KernelSpec.from_dict(art.meta["spec"])
    inputs = FAMILIES[family].make_inputs(spec, dims, np.random.default_rng(7))
    records = check_launched(tmp_path, stub, art, spec, inputs, target=target)
    assert any(e == kern["entry"] for e, *_ in records)
    events = (tmp_path / "log" / "events.txt").read_text()
    assert events.count("tensor_map ") == sum(p["type"] == "tmap" for p in kern["params"])


@pytest.mark.parametrize("case", ["varlen", "mla"])
def test_tensor_map_kernels_are_captured_at_the_maxima(tmp_path, stub, case):
    """A launch list with tensor maps is captured like any other (its class is the family's,
    ALWAYS): graph_launch encodes each map for the cache at the maxima, two steps of different
    compositions (the ragged batch rotated) enqueue identical launches, maps included, and each
    replays right in the emulator."""
    from stubcuda.cases import next_step
    family, body, tile, dims, target = TMA_CASES[case]
    art = build_kernel(tmp_path, family, body, tile=tile, targets=(target,))
    assert art.meta["graph"]["targets"][target]["class"] == "ALWAYS"
    spec = KernelSpec.from_dict(art.meta["spec"])
    first = FAMILIES[family].make_inputs(spec, dims, np.random.default_rng(5))
    maxima = {d: v for d, v in art.infer_dims(first, num_sms=7, target=target).items()
              if d in art.meta["graph"]["capture_dims"]}
    records = [check_launched(tmp_path / str(i), stub, art, spec, step, mode="graph", maxima=maxima,
                              target=target)
               for i, step in enumerate((first, next_step(first)))]
    assert records[0] == records[1]
    assert any(name.endswith("_tmap") for *_, params in records[0] for name, *_ in params)


def test_tensor_map_enum_values_are_the_drivers():
    """The ctypes path hard-codes cuTensorMapEncodeTiled's enum values: cuda-python's agree."""
    drv = pytest.importorskip("cuda.bindings.driver", reason="cuda-python is not installed")
    from ptxc.runtime.device import TENSOR_MAP_ENUMS
    groups = {"data_type": (drv.CUtensorMapDataType, "DATA_TYPE"),
              "interleave": (drv.CUtensorMapInterleave, "INTERLEAVE"),
              "swizzle": (drv.CUtensorMapSwizzle, "SWIZZLE"),
              "l2_promotion": (drv.CUtensorMapL2promotion, "L2_PROMOTION"),
              "oob_fill": (drv.CUtensorMapFloatOOBfill, "FLOAT_OOB_FILL")}
    for key, (cls, prefix) in groups.items():
        for name, value in TENSOR_MAP_ENUMS[key].items():
            assert int(getattr(cls, f"CU_TENSOR_MAP_{prefix}_{name}")) == value, (key, name)


@pytest.mark.parametrize("case", ["decode", "varlen"])
def test_graph_launch_enqueues_the_same_launches_for_every_step(tmp_path, stub, case):
    """DeviceRuntime.graph_launch at the capture maxima: two steps of different compositions
    (half the decodes absent; the ragged batch rotated) enqueue identical launches -- "auto"
    splits resolved from the maxima -- and each replays right in the emulator."""
    from stubcuda.cases import next_step
    family, body, dims = CASES[case]
    art = build_kernel(tmp_path, family, body)
    spec = KernelSpec.from_dict(art.meta["spec"])
    first = FAMILIES[family].make_inputs(spec, dims, np.random.default_rng(5))
    maxima = {d: v for d, v in art.infer_dims(first, num_sms=7, target="sm_80").items()
              if d in art.meta["graph"]["capture_dims"]}
    records = [check_launched(tmp_path / str(i), stub, art, spec, step, mode="graph", maxima=maxima)
               for i, step in enumerate((first, next_step(first)))]
    assert records[0] == records[1]


@pytest.mark.parametrize("case,mode,maxima,message", [
    ("prefill", "graph", {"batch": 1, "seq_q": 17, "seq_k": 17},
     "cannot be captured in a CUDA graph (class NEVER: a prefill grid is the step's own sequence lengths); use launch()"),
    ("decode", "graph_unprepared", {"batch": 3, "max_pages_per_seq": 2, "num_pages": 7},
     "call prepare() before capture"),
    ("decode", "graph", {"batch": 4, "max_pages_per_seq": 2, "num_pages": 7},
     "tensor block_table has shape [3, 2], expected [4, 2] ([\'batch\', \'max_pages_per_seq\'] at the capture maxima)"),
    ("decode", "graph", {"batch": 3, "num_pages": 7}, "maxima lack max_pages_per_seq"),
    ("decode", "graph", {"batch": 0, "max_pages_per_seq": 2, "num_pages": 7}, "maximum batch = 0"),
], ids=["never", "unprepared", "not_at_maxima", "missing", "zero"])
def test_graph_launch_refusals(tmp_path, stub, case, mode, maxima, message):
    family, body, dims = CASES[case]
    art = build_kernel(tmp_path, family, body)
    spec = KernelSpec.from_dict(art.meta["spec"])
    buffers = device_inputs(art, FAMILIES[family].make_inputs(spec, dims, np.random.default_rng(1)))
    result, log = run_script(tmp_path, stub, art, buffers, mode=mode, maxima=maxima)
    assert message in result.get("error", ""), result
    assert "\n" not in result["error"] and not log.launches


def test_module_loaded_once_across_100_launches(tmp_path, stub):
    family, body, dims = CASES["decode"]
    art = build_kernel(tmp_path, family, body)
    spec = KernelSpec.from_dict(art.meta["spec"])
    buffers = device_inputs(art, FAMILIES[family].make_inputs(spec, dims, np.random.default_rng(1)))
    result, log = run_script(tmp_path, stub, art, buffers, mode="repeat")
    assert result["module_loads"] == 1 and len(log.modules) == 1
    assert len(log.launches) == 100 * len(art.meta["targets"]["sm_80"]["kernels"])


@pytest.mark.parametrize("mode,message", [
    ("misaligned", "is not 16-byte aligned"),
    ("wrong_device", "expected CUDA device 0"),
    ("wrong_dtype", "typestr '<f4', expected bf16"),
    ("null", "tensor o: null device address"),
    ("splits0", "dim num_splits=0 is out of range (allowed: 1.."),   # the C / Rust loaders' "auto" unresolved
])
def test_bad_tensors_are_refused_before_any_launch(tmp_path, stub, mode, message):
    family, body, dims = CASES["decode"]
    art = build_kernel(tmp_path, family, body)
    spec = KernelSpec.from_dict(art.meta["spec"])
    buffers = device_inputs(art, FAMILIES[family].make_inputs(spec, dims, np.random.default_rng(1)))
    result, log = run_script(tmp_path, stub, art, buffers, mode=mode)
    assert message in result.get("error", ""), result
    assert "\n" not in result["error"] and not log.launches


def test_a_tensor_tma_cannot_take_is_refused_before_any_encoding_or_launch(tmp_path, stub):
    """A misaligned q on the sm_90a TMA prefill: one line, no tensor map encoded, no launch."""
    family, body, tile, dims, _ = TMA_CASES["prefill"]
    art = build_kernel(tmp_path, family, body, tile=tile, targets=("sm_90a",))
    spec = KernelSpec.from_dict(art.meta["spec"])
    buffers = device_inputs(art, FAMILIES[family].make_inputs(spec, dims, np.random.default_rng(2)), "sm_90a")
    result, log = run_script(tmp_path, stub, art, buffers, mode="misaligned", sm=90)
    assert "is not 16-byte aligned" in result.get("error", ""), result
    assert "\n" not in result["error"] and not log.launches
    assert "tensor_map" not in (tmp_path / "log" / "events.txt").read_text()
