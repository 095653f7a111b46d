"""The CUDA backend: run an artifact's launch list on a real GPU through the driver API
(cuda-python's `cuda.bindings.driver`). Loads the cubin for the device's SM when the artifact has
one (else JIT-compiles the PTX of the newest target not above the device), sets the dynamic
shared-memory attribute above 48 KiB, launches per the metadata, times with CUDA events.

This module is imported only when the cuda backend is asked for; without a driver or device,
`CudaDevice.open()` raises a ToolchainError with a one-line reason (exit code 2).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

from ..errors import PtxcError, ToolchainError
from .abi import launch_geometry, pack_args, pick_target, row_pointer_offsets, sm_number

CTYPES = {"u32": ctypes.c_uint32, "s32": ctypes.c_int32, "u64": ctypes.c_uint64,
          "s64": ctypes.c_int64, "f32": ctypes.c_float}


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise ToolchainError(f"the cuda backend needs cuda-python ({e})") from None
    return driver


def _check(result, what: str):
    """Unwrap a cuda-python (err, value...) result; raise with the error's name."""
    drv = _driver()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != drv.CUresult.CUDA_SUCCESS:
        _, name = drv.cuGetErrorName(err)
        raise PtxcError(f"CUDA error in {what}: {name.decode() if isinstance(name, bytes) else name}")
    return rest[0] if len(rest) == 1 else tuple(rest) if rest else None


def tensor_map_call(enc) -> tuple:
    """The positional arguments of cuda-python's cuTensorMapEncodeTiled for a TensorMapEncoding
    (after the output map, which cuda-python returns): data type, rank, address, dims, strides,
    box, element strides, interleave, swizzle, L2 promotion, OOB fill. The rank, box and element
    strides are `cuuint32_t`, the dims and strides `cuuint64_t`: cuda-python refuses plain ints
    there (TypeError), which is how every TMA launch failed on the first H200 run."""
    drv = _driver()
    enum = lambda cls, prefix, name: getattr(cls, f"CU_TENSOR_MAP_{prefix}_{name}")
    u32 = lambda values: [drv.cuuint32_t(int(v)) for v in values]
    u64 = lambda values: [drv.cuuint64_t(int(v)) for v in values]
    return (enum(drv.CUtensorMapDataType, "DATA_TYPE", enc.data_type), drv.cuuint32_t(enc.rank), enc.address,
            u64(enc.dims), u64(enc.strides), u32(enc.box), u32(enc.element_strides),
            enum(drv.CUtensorMapInterleave, "INTERLEAVE", enc.interleave),
            enum(drv.CUtensorMapSwizzle, "SWIZZLE", enc.swizzle),
            enum(drv.CUtensorMapL2promotion, "L2_PROMOTION", enc.l2_promotion),
            enum(drv.CUtensorMapFloatOOBfill, "FLOAT_OOB_FILL", enc.oob_fill))


def encode_on_device(meta: dict, name: str, arr, source: dict, address: int):
    """A tensor-map parameter's 128 bytes (64-byte aligned ctypes buffer) for the device buffer
    of `name` at `address` (tensor_maps.encode_tensor_map, then cuTensorMapEncodeTiled)."""
    from .tensor_maps import encode_tensor_map
    enc = encode_tensor_map(f"{meta['name']}: tensor map of {name}", meta["tensors"][name]["dtype"],
                            arr.shape, arr.strides, address, source["box"], source["swizzle"])
    tmap = _check(_driver().cuTensorMapEncodeTiled(*tensor_map_call(enc)), "cuTensorMapEncodeTiled")
    raw = (ctypes.c_uint64 * 24)()                    # 192 bytes: a 64-aligned 128-byte window
    start = -ctypes.addressof(raw) % 64
    ctypes.memmove(ctypes.addressof(raw) + start, tmap.getPtr(), 128)
    return (ctypes.c_uint8 * 128).from_buffer(raw, start)


def launch_args(meta: dict, kernel: dict, buffers: dict, dims: dict, address_of) -> tuple[list, Any]:
    """(ctypes values, the void* array cuLaunchKernel takes) for one launch: pointers at
    `address_of(tensor)`, tensor maps encoded by the driver for that address, scalars as their
    parameter type. Keep the values alive as long as the array."""
    values = pack_args(kernel, buffers, dims, pointer=lambda n, a: address_of(n),
                       tensor_map=lambda n, a, src: encode_on_device(meta, n, a, src, address_of(n)))
    cvals = [v if p["type"] == "tmap" else CTYPES[p["type"]](float(v) if p["type"] == "f32" else int(v))
             for p, v in zip(kernel["params"], values)]
    return cvals, (ctypes.c_void_p * len(cvals))(*[ctypes.addressof(c) for c in cvals])


def fill_derived_pointers(meta: dict, buffers: dict, dptrs: dict) -> None:
    """Per-sequence pointer arrays (tensors `derived_from` a cache, the pointer_array layout):
    entry b = device address of slice b of the source tensor's first axis."""
    for name, info in meta["tensors"].items():
        source = info.get("derived_from")
        if source:
            buffers[name][...] = [int(dptrs[source]) + off for off in row_pointer_offsets(buffers[source])]


@dataclass
class CudaDevice:
    device: Any
    context: Any
    sm: int
    name: str
    num_sms: int = 0   # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: what "auto" rules size for
    modules: dict = field(default_factory=dict)
    last_ms: list = field(default_factory=list)

    @classmethod
    def open(cls, ordinal: int = 0) -> "CudaDevice":
        drv = _driver()
        try:
            err, = drv.cuInit(0)
        except Exception as e:  # no libcuda.so: cuda-python raises at call time
            raise ToolchainError(f"no CUDA driver available ({e.__class__.__name__}: {e})") from None
        if err != drv.CUresult.CUDA_SUCCESS:
            raise ToolchainError(f"no usable CUDA driver/device (cuInit: {err.name})")
        count = _check(drv.cuDeviceGetCount(), "cuDeviceGetCount")
        if count == 0:
            raise ToolchainError("no CUDA device present")
        dev = _check(drv.cuDeviceGet(ordinal), "cuDeviceGet")
        ctx = _check(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        _check(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        attr = drv.CUdevice_attribute
        major = _check(drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "attr")
        minor = _check(drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "attr")
        sms = _check(drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev), "attr")
        name = _check(drv.cuDeviceGetName(256, dev), "cuDeviceGetName")
        return cls(dev, ctx, major * 10 + minor, name.split(b"\0")[0].decode(), int(sms))

    def runnable_targets(self, artifact) -> list[str]:
        """The artifact's targets this device can run: its own SM's cubin, and the PTX of every
        older target (JIT-compiled by the driver). A cubin of another SM never loads."""
        return sorted((t for t in artifact.meta["targets"] if pick_target({t: {}}, self.sm)), key=sm_number)

    def pick_image(self, artifact, target: str | None) -> tuple[str, bytes]:
        """The cubin built for exactly this SM, else the PTX of the newest target <= this SM.
        An explicit older target runs from its PTX (cubins are not portable across SM versions);
        a newer one is refused."""
        targets = artifact.meta["targets"]
        if target is None:
            picked = pick_target(targets, self.sm)
            if picked is None:
                raise ToolchainError(f"{artifact.name}: no target runs on sm_{self.sm} (built: {', '.join(targets)})")
            target, kind = picked
            return target, artifact.cubin(target) if kind == "cubin" else artifact.ptx(target).encode() + b"\0"
        if pick_target({target: {}}, self.sm) is None:   # newer, or arch-specific for another SM
            raise ToolchainError(f"{artifact.name}: {target} cannot run on this sm_{self.sm} device")
        image = artifact.cubin(target) if sm_number(target) == self.sm else None
        return target, image if image is not None else artifact.ptx(target).encode() + b"\0"

    def launcher(self, artifact, target: str | None, repeat: int = 1):
        drv = _driver()
        tname, image = self.pick_image(artifact, target)
        module = _check(drv.cuModuleLoadData(image), f"cuModuleLoadData({artifact.name} {tname})")
        self.modules[(artifact.name, tname)] = module

        functions = {}

        def function(kernel):  # looked up, and its shared-memory limit raised, once
            if kernel["entry"] not in functions:
                fn = _check(drv.cuModuleGetFunction(module, kernel["entry"].encode()), "cuModuleGetFunction")
                if kernel["needs_smem_opt_in"]:
                    _check(drv.cuFuncSetAttribute(
                        fn, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        kernel["dynamic_smem_bytes"]), "cuFuncSetAttribute")
                functions[kernel["entry"]] = fn
            return functions[kernel["entry"]]

        def launch(kernel, buffers, dims):
            fn = function(kernel)
            smem = kernel["dynamic_smem_bytes"]
            dptrs = {}
            for name, arr in buffers.items():
                dptrs[name] = _check(drv.cuMemAlloc(max(arr.nbytes, 1)), "cuMemAlloc")
            fill_derived_pointers(artifact.meta, buffers, dptrs)
            for name, arr in buffers.items():
                if arr.nbytes:
                    _check(drv.cuMemcpyHtoD(dptrs[name], arr.ctypes.data, arr.nbytes), "cuMemcpyHtoD")
            try:
                from .preconditions import check_buffers
                check_buffers(artifact.meta, buffers, dims, lambda name, arr: int(dptrs[name]))
                _cvals, ptrs = launch_args(artifact.meta, kernel, buffers, dims, lambda n: int(dptrs[n]))
                grid, block = launch_geometry(kernel, dims)
                start, stop = (_check(drv.cuEventCreate(0), "cuEventCreate") for _ in range(2))
                _check(drv.cuEventRecord(start, 0), "cuEventRecord")
                for _ in range(repeat):
                    _check(drv.cuLaunchKernel(fn, *grid, *block, smem, 0, ctypes.addressof(ptrs), 0),
                           f"cuLaunchKernel({kernel['entry']})")
                _check(drv.cuEventRecord(stop, 0), "cuEventRecord")
                _check(drv.cuEventSynchronize(stop), "cuEventSynchronize")
                self.last_ms.append(_check(drv.cuEventElapsedTime(start, stop), "cuEventElapsedTime") / repeat)
                for name, arr in buffers.items():
                    if arr.nbytes:
                        _check(drv.cuMemcpyDtoH(arr.ctypes.data, dptrs[name], arr.nbytes), "cuMemcpyDtoH")
            finally:
                for d in dptrs.values():
                    drv.cuMemFree(d)
        return launch


def available() -> bool:
    try:
        CudaDevice.open()
        return True
    except PtxcError:
        return False
    except Exception:
        return False


__all__ = ["CudaDevice", "available", "fill_derived_pointers", "launch_args", "CTYPES"]
