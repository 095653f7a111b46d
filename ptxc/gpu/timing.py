"""Device-side timing for `ptxc bench` and `ptxc tune`: one artifact's launch list, timed with
CUDA events, inputs resident on the device for the whole run.

ptxc.runtime.cuda's launcher is built for correctness runs (it allocates and copies around
every launch); timing needs the buffers allocated once, the module loaded once, and nothing
but the kernels between the two events. An optional L2 flush (a cuMemsetD8 of a scratch buffer
at least twice the L2 size) runs before each timed run, outside the events, so a decode kernel
reads its KV cache from DRAM as it would in serving rather than from the previous run's L2.
"""

from __future__ import annotations

import ctypes
from typing import Any

from ..runtime import cuda as rcuda
from ..runtime import launch_geometry
from ..runtime.cuda import fill_derived_pointers, launch_args

def _driver():
    return rcuda._driver()


def check(result, what: str):
    """Unwrap a cuda-python (err, value...) result; raise with the error's name."""
    return rcuda._check(result, what)


def l2_cache_bytes(device) -> int:
    drv = _driver()
    return int(check(drv.cuDeviceGetAttribute(
        drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, device.device), "L2 size"))


def sm_count(device) -> int:
    """Multiprocessors of the device: what "auto" dim rules (num_splits) are sized by."""
    drv = _driver()
    return int(check(drv.cuDeviceGetAttribute(
        drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device.device), "SM count"))


class LaunchListTimer:
    """Times `artifact`'s launch list for `target` on buffers already laid out (host arrays from
    runtime.prepare_buffers); `time()` returns one duration in ms per timed run."""

    def __init__(self, device, artifact, target: str | None, buffers: dict, dims: dict,
                 flush_bytes: int = 0):
        drv = _driver()
        self.drv, self.dims, self.meta = drv, dims, artifact.meta
        self.target, image = device.pick_image(artifact, target)
        self.module = check(drv.cuModuleLoadData(image), f"cuModuleLoadData({artifact.name} {self.target})")
        self.ptrs: dict[str, Any] = {}
        self.launches = []
        try:
            for name, arr in buffers.items():
                self.ptrs[name] = check(drv.cuMemAlloc(max(arr.nbytes, 1)), "cuMemAlloc")
            fill_derived_pointers(artifact.meta, buffers, self.ptrs)
            for name, arr in buffers.items():
                if arr.nbytes:
                    check(drv.cuMemcpyHtoD(self.ptrs[name], arr.ctypes.data, arr.nbytes), "cuMemcpyHtoD")
            for k in artifact.meta["targets"][self.target]["kernels"]:
                self.launches.append(self._prepare(k, buffers))
            self.flush_bytes = flush_bytes
            self.scratch = check(drv.cuMemAlloc(flush_bytes), "cuMemAlloc(L2 flush)") if flush_bytes else None
            self.events = [check(drv.cuEventCreate(0), "cuEventCreate") for _ in range(2)]
        except Exception:
            self.close()
            raise

    def _prepare(self, k: dict, buffers: dict):
        drv = self.drv
        fn = check(drv.cuModuleGetFunction(self.module, k["entry"].encode()), "cuModuleGetFunction")
        if k["needs_smem_opt_in"]:
            check(drv.cuFuncSetAttribute(fn, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                         k["dynamic_smem_bytes"]), "cuFuncSetAttribute")
        cvals, argv = launch_args(self.meta, k, buffers, self.dims, lambda n: int(self.ptrs[n]))
        grid, block = launch_geometry(k, self.dims)
        return fn, grid, block, k["dynamic_smem_bytes"], cvals, argv   # cvals keeps argv's targets alive

    def run_once(self) -> None:
        for fn, grid, block, smem, _cvals, argv in self.launches:
            if 0 not in grid:
                check(self.drv.cuLaunchKernel(fn, *grid, *block, smem, 0, ctypes.addressof(argv), 0),
                      "cuLaunchKernel")

    def time(self, warmup: int, repeat: int) -> list[float]:
        drv = self.drv
        start, stop = self.events
        samples = []
        for i in range(warmup + repeat):
            if self.scratch is not None:   # evict the previous run's lines from L2
                check(drv.cuMemsetD8Async(self.scratch, i & 0xFF, self.flush_bytes, 0), "cuMemsetD8Async")
            check(drv.cuEventRecord(start, 0), "cuEventRecord")
            self.run_once()
            check(drv.cuEventRecord(stop, 0), "cuEventRecord")
            check(drv.cuEventSynchronize(stop), "cuEventSynchronize")
            if i >= warmup:
                samples.append(float(check(drv.cuEventElapsedTime(start, stop), "cuEventElapsedTime")))
        return samples

    def read(self, name: str, arr) -> None:
        """Copy device tensor `name` back into host array `arr` (for a correctness spot check)."""
        check(self.drv.cuMemcpyDtoH(arr.ctypes.data, self.ptrs[name], arr.nbytes), "cuMemcpyDtoH")

    def close(self) -> None:
        drv = self.drv
        for p in list(self.ptrs.values()) + ([self.scratch] if getattr(self, "scratch", None) else []):
            drv.cuMemFree(p)
        for e in getattr(self, "events", []):
            drv.cuEventDestroy(e)
        drv.cuModuleUnload(self.module)
        self.ptrs = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


__all__ = ["LaunchListTimer", "check", "fill_derived_pointers", "l2_cache_bytes", "sm_count"]
