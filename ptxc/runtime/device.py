"""Launch an artifact on tensors already in device memory, on the caller's stream, without a
copy and without synchronising: the per-step path of a serving engine (docs/loaders.md).

    rt = ptxc.runtime.device.DeviceRuntime()            # libcuda: $PTXC_LIBCUDA or libcuda.so.1
    rt.launch(art, {"q": q, "k_cache": k, ..., "o": o, "lse": lse, "o_part": ws, ...}, stream=s)

Tensors are any objects exposing `__cuda_array_interface__` (v2/v3: data pointer, shape, typestr,
strides in bytes or None for packed) or else DLPack (`__dlpack__`, read from the capsule with no
copy; bf16 is kDLBfloat 16, FP8 raw uint8). CAI has no bf16 or FP8 type strings, so the
artifact's metadata names the dtype and the typestr must have its width: bf16 as "<V2" or "<u2"
(the bits), e4m3/e5m2 as "|u1" / "|V1". A CAI object that also has `__dlpack_device__` must be
on this device (kDLCUDA, this ordinal). Outputs and workspaces are the
caller's too (a captured graph owns its memory; workspace shapes are in the metadata and are
sized from the same dims as the rest), never allocated here.

The driver is reached through ctypes (a dozen calls), not cuda-python, so tests can point it at
the stub libcuda (tests/stubcuda) exactly as the C and Rust loaders are tested. Every check the C
loader makes -- dtype, rank and shape against the metadata, strides and 16-byte alignment
(`preconditions`), device, parameter ranges, grid limits -- runs before any launch and fails
with the one-line InputError the CLI prints. Values inside device tensors (prefix sums of
cu_seqlens_q) are not read: that would synchronise. Modules are loaded once per (artifact
image, context); functions and their shared-memory opt-in are looked up once per module.
Tensor-map parameters (sm_90a TMA) are encoded here with cuTensorMapEncodeTiled for the tensor's
own address, shape and strides (tensor_maps.encode_tensor_map, as every loader derives them), at
every launch and capture alike: the encoding is host work, no stream operation, and a map bakes
in its tensor's address and shape as the other parameters bake in theirs (the shape's dims are
capture dims, fixed at the maxima).
Not yet taken: pointer-array KV caches (`derived_from` tensors).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from ..errors import InputError, PtxcError, ToolchainError
from ..pipeline import exprs
from ..pipeline.graph import never_reason
from ..pipeline.metadata import ELEMENT_BYTES
from .abi import NP_PARAM, check_dim, launch_geometry, pack_args, pick_target
from ..pipeline.dim_rules import apply_dim_rule, rule_ctas_per_sm
from .preconditions import check_tensor, packed_strides

TYPESTRS = {"f32": ("<f4",), "f16": ("<f2",), "bf16": ("<V2", "<u2"), "i32": ("<i4",), "i64": ("<i8",),
            "u64": ("<u8",), "e4m3": ("|u1", "|V1"), "e5m2": ("|u1", "|V1"), "u8": ("|u1",)}
KDL_CUDA = 2
# DLPack (code, bits) per dtype: kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4; FP8 as raw bytes
DL_DTYPES = {"f32": (2, 32), "f16": (2, 16), "bf16": (4, 16), "i32": (0, 32), "i64": (0, 64), "u64": (1, 64),
             "e4m3": (1, 8), "e5m2": (1, 8), "u8": (1, 8)}


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):   # the head of DLManagedTensor(Versioned's dl_tensor: v0 only)
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


def _dlpack_view(where: str, want: str, obj, ordinal: int, stream: int):
    """(address, shape, strides in elements) of a DLPack tensor, read from its capsule without a
    copy; the capsule keeps ownership (its destructor calls the producer's deleter)."""
    try:
        capsule = obj.__dlpack__(stream=stream if stream else None)
    except TypeError:
        capsule = obj.__dlpack__()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    t = _DLTensor.from_address(get(capsule, b"dltensor"))
    if (t.device.device_type, t.device.device_id) != (KDL_CUDA, ordinal):
        raise InputError(f"{where}: on DLPack device {(t.device.device_type, t.device.device_id)}, "
                         f"expected CUDA device {ordinal} ({(KDL_CUDA, ordinal)})")
    if (t.dtype.code, t.dtype.bits, t.dtype.lanes) != (*DL_DTYPES[want], 1):
        raise InputError(f"{where}: DLPack dtype (code {t.dtype.code}, bits {t.dtype.bits}, lanes "
                         f"{t.dtype.lanes}), expected {want} {DL_DTYPES[want] + (1,)}")
    shape = tuple(int(t.shape[i]) for i in range(t.ndim))
    strides = (tuple(int(t.strides[i]) for i in range(t.ndim)) if t.strides
               else tuple(packed_strides(list(shape))))
    return int(t.data or 0) + int(t.byte_offset), shape, strides
CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_LAUNCH_PARAM_BUFFER_POINTER, CU_LAUNCH_PARAM_BUFFER_SIZE = 1, 2


@dataclass(frozen=True)
class DeviceTensor:
    """What a launch needs of a caller's tensor: address, shape, strides in elements."""
    address: int
    shape: tuple
    strides: tuple
    itemsize: int

    @property
    def byte_strides(self) -> tuple:
        return tuple(s * self.itemsize for s in self.strides)


def stream_handle(stream) -> int:
    """A CUstream as an integer: an int, an object with `cuda_stream` (torch, cupy), or one with
    `__cuda_stream__()` returning (version, handle)."""
    if stream is None:
        return 0
    if isinstance(stream, (int, np.integer)):
        return int(stream)
    if hasattr(stream, "__cuda_stream__"):
        return int(stream.__cuda_stream__()[1])
    if hasattr(stream, "cuda_stream"):
        return int(stream.cuda_stream)
    raise InputError(f"stream: {type(stream).__name__} is no stream (an int handle, or an object "
                     f"with cuda_stream or __cuda_stream__)")


def device_tensor(meta: dict, name: str, obj, ordinal: int, stream: int = 0) -> DeviceTensor:
    where = f"{meta['name']}: tensor {name}"
    want = meta["tensors"][name]["dtype"]
    if not hasattr(obj, "__cuda_array_interface__") and hasattr(obj, "__dlpack__"):
        address, shape, strides = _dlpack_view(where, want, obj, ordinal, stream)
        return DeviceTensor(address, shape, strides, ELEMENT_BYTES[want])
    if hasattr(obj, "__dlpack_device__"):
        dev = tuple(int(x) for x in obj.__dlpack_device__())
        if dev != (KDL_CUDA, ordinal):
            raise InputError(f"{where}: on DLPack device {dev}, expected CUDA device {ordinal} "
                             f"({(KDL_CUDA, ordinal)})")
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is None:
        raise InputError(f"{where}: {type(obj).__name__} has neither __cuda_array_interface__ "
                         f"nor __dlpack__ (device tensors only)")
    if cai["typestr"] not in TYPESTRS[want]:
        raise InputError(f"{where}: typestr {cai['typestr']!r}, expected {want} "
                         f"(as {' or '.join(map(repr, TYPESTRS[want]))})")
    itemsize = ELEMENT_BYTES[want]
    shape = tuple(int(s) for s in cai["shape"])
    if cai.get("strides") is None:
        strides = tuple(packed_strides(list(shape)))
    else:
        if any(s % itemsize for s in cai["strides"]):
            raise InputError(f"{where}: byte strides {tuple(cai['strides'])} are not whole elements")
        strides = tuple(int(s) // itemsize for s in cai["strides"])
    return DeviceTensor(int(cai["data"][0] or 0), shape, strides, itemsize)


def shape_dims(meta: dict, tensors: dict[str, DeviceTensor], sets: dict) -> dict[str, int]:
    """The dims the shapes of inputs determine (no value is read), then the --set ones."""
    dims = {k: int(v) for k, v in sets.items() if k in meta["dims"]}
    for name, t in sorted(tensors.items()):
        info = meta["tensors"][name]
        if info["role"] not in ("input", "inout"):
            continue
        if len(t.shape) != len(info["shape"]):
            raise InputError(f"{meta['name']}: tensor {name} has shape {list(t.shape)}, expected "
                             f"{info['shape']} ({len(info['shape'])} dimensions)")
        for axis, (size, want) in enumerate(zip(t.shape, info["shape"])):
            if isinstance(want, str) and want.isidentifier():
                if dims.setdefault(want, size) != size:
                    raise InputError(f"{meta['name']}: tensor {name} axis {axis} ({want}) is {size}, "
                                     f"but {want} = {dims[want]} elsewhere")
    return dims


# cuTensorMapEncodeTiled's enum values (cuda.h; tests/loaders/test_device_launch.py checks them against
# cuda-python's), by the names tensor_maps.TensorMapEncoding uses.
TENSOR_MAP_ENUMS = {
    "data_type": {"UINT8": 0, "UINT16": 1, "UINT32": 2, "INT32": 3, "UINT64": 4, "INT64": 5,
                  "FLOAT16": 6, "FLOAT32": 7, "FLOAT64": 8, "BFLOAT16": 9},
    "interleave": {"NONE": 0},
    "swizzle": {"NONE": 0, "32B": 1, "64B": 2, "128B": 3},
    "l2_promotion": {"NONE": 0, "L2_64B": 1, "L2_128B": 2, "L2_256B": 3},
    "oob_fill": {"NONE": 0},
}


class Driver:
    """The driver calls the device path makes, through ctypes."""

    def __init__(self, path: str | None = None):
        path = path or os.environ.get("PTXC_LIBCUDA") or "libcuda.so.1"
        try:
            self.lib = ctypes.CDLL(path)
        except OSError as e:
            raise ToolchainError(f"no CUDA driver: cannot load {path} ({e})") from None
        self.lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        if hasattr(self.lib, "cuTensorMapEncodeTiled"):
            self.lib.cuTensorMapEncodeTiled.argtypes = (
                [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32] + [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4)

    def __call__(self, fn: str, *args):
        r = getattr(self.lib, fn)(*args)
        if r != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(r, ctypes.byref(name))
            raise PtxcError(f"CUDA error in {fn}: {(name.value or b'?').decode()} ({r})")


@dataclass
class DeviceRuntime:
    ordinal: int = 0
    libcuda: str | None = None
    modules: dict = field(default_factory=dict)      # (image sha, context) -> (module, functions)
    module_loads: int = 0

    def __post_init__(self):
        self.driver = drv = Driver(self.libcuda)
        drv("cuInit", 0)
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        drv("cuDeviceGet", ctypes.byref(dev), self.ordinal)
        drv("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        drv("cuCtxSetCurrent", ctx)
        self.device, self.context = dev, ctx.value

        def attr(a):
            v = ctypes.c_int()
            drv("cuDeviceGetAttribute", ctypes.byref(v), a, dev)
            return v.value
        self.sm = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR) * 10 + attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        self.num_sms = attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)

    def _tensor_map(self, meta: dict, name: str, t, source: dict) -> bytes:
        """The 128 bytes of a tensor-map parameter over device tensor `t` (address, shape, byte
        strides): encode_tensor_map's derivation (one-line InputError where TMA cannot
        describe the tensor), then the driver's encoder."""
        from .tensor_maps import encode_tensor_map
        enc = encode_tensor_map(f"{meta['name']}: tensor map of {name}", meta["tensors"][name]["dtype"],
                                t.shape, t.strides, t.address, source["box"], source["swizzle"])
        if not hasattr(self.driver.lib, "cuTensorMapEncodeTiled"):
            raise ToolchainError(f"{meta['name']}: this libcuda has no cuTensorMapEncodeTiled "
                                 f"(CUDA 12+ driver needed for tensor-map kernels)")
        raw = (ctypes.c_uint64 * 24)()                 # a 64-byte aligned 128-byte window
        at = ctypes.addressof(raw) + (-ctypes.addressof(raw) % 64)
        enum = {k: TENSOR_MAP_ENUMS[k][getattr(enc, k)] for k in TENSOR_MAP_ENUMS}
        u64, u32 = ctypes.c_uint64, ctypes.c_uint32
        self.driver("cuTensorMapEncodeTiled", at, enum["data_type"], enc.rank, enc.address,
                    (u64 * enc.rank)(*enc.dims), (u64 * max(1, len(enc.strides)))(*enc.strides),
                    (u32 * enc.rank)(*enc.box), (u32 * enc.rank)(*enc.element_strides),
                    enum["interleave"], enum["swizzle"], enum["l2_promotion"], enum["oob_fill"])
        return ctypes.string_at(at, 128)

    def _module(self, art, target: str, kind: str):
        t = art.meta["targets"][target]
        key = (t[f"{kind}_sha256"], self.context)
        if key not in self.modules:
            image = art.cubin(target) if kind == "cubin" else art.ptx(target).encode() + b"\0"
            module = ctypes.c_void_p()
            self.driver("cuModuleLoadData", ctypes.byref(module), ctypes.c_char_p(image))
            self.module_loads += 1
            functions = {}
            for k in t["kernels"]:
                fn = ctypes.c_void_p()
                self.driver("cuModuleGetFunction", ctypes.byref(fn), module, k["entry"].encode())
                if k["needs_smem_opt_in"]:
                    self.driver("cuFuncSetAttribute", fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                k["dynamic_smem_bytes"])
                functions[k["entry"]] = fn
            self.modules[key] = (module, functions, image)   # the image outlives the module
        return self.modules[key][1]

    def _pick(self, art) -> tuple[str, str]:
        picked = pick_target(art.meta["targets"], self.sm)
        if picked is None:
            raise ToolchainError(f"{art.name}: no target runs on sm_{self.sm} "
                                 f"(built: {', '.join(art.meta['targets'])})")
        return picked

    def prepare(self, art) -> str:
        """Load the module, look up the functions and raise their shared-memory limit now: what
        must happen before CUDA-graph capture (launch() then only enqueues). The target's name."""
        target, kind = self._pick(art)
        self._module(art, target, kind)
        return target

    def launch(self, art, tensors: dict, *, stream=None, sets: dict | None = None) -> dict[str, int]:
        """Check everything, then enqueue the launch list on `stream` (no allocation, copy or
        synchronisation: capturable once prepare() has run); returns the dims."""
        return self._enqueue(art, tensors, stream, sets, maxima=None)

    def graph_launch(self, art, tensors: dict, maxima: dict, *, stream=None,
                     sets: dict | None = None) -> dict[str, int]:
        """The capture-safe launch: the launch list at the capture-time `maxima` -- every dim of
        the metadata's graph.capture_dims, with "auto" dims resolved from them (a dim rule may be
        given as 0 = auto, or fixed) -- on tensors allocated at those maxima (docs/loaders.md
        pads a smaller step). Every step under the same maxima enqueues the same launches, so
        one captured graph replays them all. Refused, before any launch: a target whose graph
        class is NEVER, a module prepare() has not loaded (nothing loads inside a capture), a
        maximum a grid depends on that is 0 (the graph would hold no launch), and a tensor whose
        shape is not the maxima's. Returns the dims."""
        meta = art.meta
        target, kind = self._pick(art)
        graph = meta["graph"]
        contract = graph["targets"][target]
        if contract["class"] == "NEVER":
            raise InputError(f"{art.name} [{target}]: cannot be captured in a CUDA graph (class NEVER: "
                             f"{never_reason(meta['family'], meta['targets'][target])}); use launch()")
        rules = meta.get("dim_rules") or {}
        missing = [d for d in graph["capture_dims"] if d not in maxima]
        extra = sorted(set(maxima) - set(graph["capture_dims"]) - set(rules))
        if missing or extra:
            raise InputError(f"{art.name}: maxima " + (f"lack {', '.join(missing)}" if missing else
                                                       f"name {', '.join(extra)}, not capture dims")
                             + f"; capture dims are {', '.join(graph['capture_dims'])}")
        dims = {d: int(v) for d, v in maxima.items() if not (d in rules and int(v) == 0)}
        zero = [d for d in contract["grid_depends_on"] if dims.get(d, 1) <= 0]
        if zero:
            raise InputError(f"{art.name}: maximum {zero[0]} = {dims[zero[0]]}; capture at the step's "
                             f"maxima (a grid over {zero[0]} would hold no launch)")
        if (meta["targets"][target][f"{kind}_sha256"], self.context) not in self.modules:
            raise InputError(f"{art.name}: call prepare() before capture (a module loads outside it)")
        return self._enqueue(art, tensors, stream, sets, maxima=dims)

    def _enqueue(self, art, tensors: dict, stream, sets: dict | None, maxima: dict | None) -> dict[str, int]:
        meta = art.meta
        target, kind = self._pick(art)
        if any(i.get("derived_from") for i in meta["tensors"].values()):
            raise InputError(f"{art.name}: pointer-array caches are not taken by the device path yet")
        handle = stream_handle(stream)
        sets = dict(sets or {})
        names = [n for n, i in meta["tensors"].items()]
        missing = sorted(set(names) - set(tensors))
        extra = sorted(set(tensors) - set(names))
        if missing or extra:
            raise InputError(f"{art.name}: " + (f"missing tensor(s) {', '.join(missing)}" if missing else "")
                             + ("; " if missing and extra else "")
                             + (f"unexpected tensor(s) {', '.join(extra)}" if extra else "")
                             + f"; tensors are {', '.join(sorted(names))}")
        views = {n: device_tensor(meta, n, obj, self.ordinal, handle) for n, obj in tensors.items()}
        # a capture takes its dims from the maxima (every tensor must have their shapes, checked
        # below); otherwise the shapes determine them
        dims = dict(maxima) if maxima is not None else shape_dims(meta, views, sets)
        for name, rule in (meta.get("dim_rules") or {}).items():
            if name not in dims:
                dims[name] = apply_dim_rule(rule, dims, self.num_sms, rule_ctas_per_sm(meta, rule, target))
        unknown = [d for d in meta["dims"] if d not in dims]
        if unknown:
            raise InputError(f"{art.name}: cannot infer {', '.join(unknown)} from the shapes; "
                             f"give sets={{{unknown[0]!r}: N}}")
        for name in meta["dims"]:        # 32-bit parameters, a rule's split counts: as the host path
            check_dim(meta, name, int(dims[name]), "dim")
        for name, t in views.items():
            info = meta["tensors"][name]
            want = [s if isinstance(s, int) else exprs.evaluate(s, dims) for s in info["shape"]]
            if list(t.shape) != want:
                raise InputError(f"{art.name}: tensor {name} has shape {list(t.shape)}, expected "
                                 f"{want} ({info['shape']}" + (" at the capture maxima)" if maxima is not None
                                                               else ")"))
            if np.prod(t.shape, dtype=np.int64):
                check_tensor(meta, name, t.address, list(t.strides), want)
        values = {**dims, **{k: float(v) for k, v in sets.items() if k in (meta.get("scalars") or {})}}
        functions = self._module(art, target, kind)
        byte_views = {n: SimpleNamespace(address=t.address, strides=t.byte_strides, itemsize=t.itemsize,
                                         shape=tuple(t.shape))
                      for n, t in views.items()}     # pack_args reads numpy-style byte strides
        launches = []
        for k in meta["targets"][target]["kernels"]:
            grid, block = launch_geometry(k, values)
            raw = bytearray(k["param_bytes"])
            args = pack_args(k, byte_views, values, pointer=lambda n, t: np.uint64(t.address),
                             tensor_map=lambda n, t, src: self._tensor_map(meta, n, t, src))
            for p, v in zip(k["params"], args):
                raw[p["offset"]:p["offset"] + p["size"]] = \
                    v if p["type"] == "tmap" else np.asarray(v, NP_PARAM[p["type"]]).tobytes()
            launches.append((k, grid, block, raw))
        for k, grid, block, raw in launches:       # every check passed: now enqueue
            if 0 in grid:
                continue
            buf = (ctypes.c_char * len(raw)).from_buffer(raw)
            size = ctypes.c_size_t(len(raw))
            extra_args = (ctypes.c_void_p * 5)(CU_LAUNCH_PARAM_BUFFER_POINTER, ctypes.addressof(buf),
                                               CU_LAUNCH_PARAM_BUFFER_SIZE, ctypes.addressof(size), 0)
            self.driver("cuLaunchKernel", functions[k["entry"]], *grid, *block, k["dynamic_smem_bytes"],
                        handle, None, extra_args)
        return dims


__all__ = ["DeviceRuntime", "DeviceTensor", "device_tensor", "stream_handle", "Driver"]
