"""An artifact as the runtime holds it: its checked metadata and its images, read and re-hashed
when used; `run` lays out the inputs (abi.py) and launches on the emulator or a CUDA device.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError, UserError
from ..reference import from_device
from .abi import (EMU_NUM_SMS, _dim_sets, infer_dims, launch_geometry, launch_record, pack_args,
                  prepare_buffers, row_pointer_offsets, sm_number, split_scalars)


@dataclass
class Artifact:
    path: Path
    meta: dict[str, Any]

    @property
    def name(self) -> str:
        return self.meta["name"]

    def target(self, name: str | None = None) -> tuple[str, dict]:
        targets = self.meta["targets"]
        if name is None:
            name = min(targets, key=lambda t: (sm_number(t), t))
        if name not in targets:
            raise InputError(f"{self.path}: no target {name!r}; built for {', '.join(sorted(targets))}")
        return name, targets[name]

    def ptx(self, target: str | None = None) -> str:
        return self._image(target, "ptx").decode("utf-8", "replace")

    def cubin(self, target: str) -> bytes | None:
        _, t = self.target(target)
        return self._image(target, "cubin") if "cubin" in t else None

    def _image(self, target: str | None, kind: str) -> bytes:
        """A ptx/cubin file, re-read as a regular file and re-checked against its sha256
        (it may have changed since load_checked looked at it)."""
        from ..errors import VerifyError
        from ..files import sha256
        from ..pipeline.artifact_files import read_artifact_file
        _, t = self.target(target)
        data = read_artifact_file(self.path, t[kind])
        if sha256(data) != t[f"{kind}_sha256"]:
            raise VerifyError(f"{self.path / t[kind]}: changed since it was checked (sha256 differs)")
        return data

    def infer_dims(self, inputs: dict[str, np.ndarray], sets: dict[str, int] | None = None,
                   num_sms: int = EMU_NUM_SMS, target: str | None = None) -> dict[str, int]:
        tensors, _ = split_scalars(self.meta, inputs, sets or {})
        return infer_dims(self.meta, tensors, _dim_sets(self.meta, sets), num_sms, target)

    def run(self, inputs: dict[str, np.ndarray], *, target: str | None = None, backend: str = "emu",
            sets: dict[str, int | float] | None = None, device=None,
            record: list | None = None) -> dict[str, np.ndarray]:
        """Run the launch list; with `record` (a list), append one launch_record per launch."""
        tensors, scalars = split_scalars(self.meta, inputs, sets or {})
        tname, t = self.target(target)
        if backend not in ("emu", "cuda"):
            raise UserError(f"unknown backend {backend!r}; allowed: emu, cuda")
        dev = None
        if backend == "cuda":
            from .cuda import CudaDevice
            dev = device or CudaDevice.open()
        # "auto" dims (num_splits) are sized for the machine that runs them: the device's SM
        # count on cuda (as the C/Rust loaders pass theirs), the emulator's own otherwise.
        num_sms = (getattr(dev, "num_sms", 0) or EMU_NUM_SMS) if dev is not None else EMU_NUM_SMS
        dims = infer_dims(self.meta, tensors, _dim_sets(self.meta, sets), num_sms, tname)
        dims.update(scalars)     # scalar parameters travel with the dims to pack_args
        buffers = prepare_buffers(self.meta, tensors, dims)
        if dev is None:
            from .preconditions import check_buffers
            check_buffers(self.meta, buffers, dims, lambda name, arr: arr.ctypes.data)
            launch = _emu_launcher(self.ptx(tname), self.meta)
        else:
            launch = dev.launcher(self, tname)
        for k in t["kernels"]:
            if record is not None:
                record.append(launch_record(k, buffers, dims))
            launch(k, buffers, dims)
        return {name: from_device(buffers[name], info["dtype"])
                for name, info in self.meta["tensors"].items() if info["role"] in ("output", "inout")}


def load(path: str | Path) -> Artifact:
    """An artifact whose metadata passed ptxc.pipeline.checked.load_checked (schema, manifest
    hash, files, re-derivation from the recorded spec); VerifyError (exit 1) if tampered."""
    from ..pipeline.checked import load_checked
    path = Path(path)
    return Artifact(path, load_checked(path))


def _emu_launcher(ptx: str, meta: dict):
    from .. import emu

    def launch(kernel, buffers, dims):
        grid, block = launch_geometry(kernel, dims)
        if 0 in grid:
            return

        def pointer(name, arr):  # pointer arrays become tables of addresses into their source
            source = meta["tensors"][name].get("derived_from")
            if source is None:
                return arr
            return emu.PointerTable(tuple((buffers[source], off)
                                          for off in row_pointer_offsets(buffers[source])))

        from .tensor_maps import emu_tensor_map
        args = pack_args(kernel, buffers, dims, pointer=pointer, tensor_map=emu_tensor_map(meta))
        emu.launch(ptx, kernel["entry"], grid, block, args,
                   dynamic_smem_bytes=kernel["dynamic_smem_bytes"])
    return launch
