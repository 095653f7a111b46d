"""ptxc.runtime: load an artifact and run its launch list on given arrays.

    art = ptxc.runtime.load("out/llama3_8b_decode")
    outputs = art.run({"q": q, "k_cache": k, "v_cache": v, "seq_lens": lens}, backend="emu")

Used by `ptxc run`, `ptxc launch-test` and the test suite; the cuda backend (ptxc.runtime.cuda)
is the same code path with device pointers instead of host arrays. Host arrays: f32/f16 as
numpy float32/float16 (bf16 as float32, rounded on the way in), i32 as int32.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..pipeline import exprs
from ..errors import InputError, UserError
from .reference import from_device, to_device

NP_PARAM = {"u32": np.uint32, "s32": np.int32, "u64": np.uint64, "s64": np.int64, "f32": np.float32}
HOST_DTYPES = {"f32": (np.float32, np.float64, np.float16), "f16": (np.float16, np.float32, np.float64),
               "bf16": (np.float32, np.float64), "i32": (np.int32, np.int64), "u64": (np.uint64,)}
EMU_NUM_SMS = 108  # the SM count "auto" rules assume on the emulator (an A100's)
POISON = {"f32": np.float32(np.nan), "f16": np.float16(np.nan), "bf16": np.uint16(0x7FC0),
          "i32": np.int32(-0x7FFFFFFF), "u64": np.uint64(0)}


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
        _, t = self.target(target)
        return (self.path / t["ptx"]).read_text()

    def cubin(self, target: str) -> bytes | None:
        _, t = self.target(target)
        return (self.path / t["cubin"]).read_bytes() if "cubin" in t else None

    def infer_dims(self, inputs: dict[str, np.ndarray], sets: dict[str, int] | None = None,
                   num_sms: int = EMU_NUM_SMS) -> dict[str, int]:
        return infer_dims(self.meta, inputs, sets or {}, num_sms)

    def run(self, inputs: dict[str, np.ndarray], *, target: str | None = None, backend: str = "emu",
            sets: dict[str, int] | None = None, device=None) -> dict[str, np.ndarray]:
        dims = self.infer_dims(inputs, sets)
        tname, t = self.target(target)
        buffers = prepare_buffers(self.meta, inputs, dims)
        if backend == "emu":
            from .preconditions import check_buffers
            check_buffers(self.meta, buffers, dims, lambda name, arr: arr.ctypes.data)
            launch = _emu_launcher(self.ptx(tname), self.meta)
        elif backend == "cuda":
            from .cuda import CudaDevice
            dev = device or CudaDevice.open()
            launch = dev.launcher(self, tname)
        else:
            raise UserError(f"unknown backend {backend!r}; allowed: emu, cuda")
        for k in t["kernels"]:
            launch(k, buffers, dims)
        return {name: from_device(buffers[name], info["dtype"])
                for name, info in self.meta["tensors"].items() if info["role"] in ("output", "inout")}


def sm_number(target: str) -> int:
    """"sm_90a" -> 90."""
    return int("".join(c for c in target[3:] if c.isdigit()))


def pick_target(targets: dict[str, dict], sm: int) -> tuple[str, str] | None:
    """The rule every ptxc loader (this runtime, the C and Rust ones) follows: the newest target
    not newer than the device (an arch-specific one, sm_90a, only on exactly its SM); its cubin
    when built for exactly this SM, else its PTX for the driver to JIT. None when no target runs."""
    fits = [t for t in targets if sm_number(t) <= sm and not (t[-1].isalpha() and sm_number(t) != sm)]
    if not fits:
        return None
    best = max(fits, key=lambda t: (sm_number(t), t[-1].isalpha()))
    return best, "cubin" if "cubin" in targets[best] and sm_number(best) == sm else "ptx"


def load(path: str | Path) -> Artifact:
    path = Path(path)
    meta_path = path / f"{path.name}.json"
    try:
        meta = json.loads(meta_path.read_text())
    except OSError:
        raise UserError(f"{path}: not an artifact directory (no {meta_path.name})") from None
    except ValueError as e:
        raise UserError(f"{meta_path}: not valid JSON ({e})") from None
    return Artifact(path, meta)


def apply_dim_rule(rule: dict, dims: dict[str, int], num_sms: int) -> int:
    """A dim the shapes do not determine: a fixed value, or an "auto" rule such as
    num_splits = min(max, max(1, cdiv(2 * num_sms, ctas))) (enough CTAs for two waves)."""
    if "value" in rule:
        return int(rule["value"])
    auto = rule["auto"]
    ctas = max(1, exprs.evaluate(auto["ctas"], dims))
    return int(min(auto["max"], max(1, -(-2 * num_sms // ctas))))


def infer_dims(meta: dict, inputs: dict[str, np.ndarray], sets: dict[str, int],
               num_sms: int = EMU_NUM_SMS) -> dict[str, int]:
    """Match every input's shape against its tensor's named shape; return the runtime dims."""
    tensors = meta["tensors"]
    expected = {n for n, t in tensors.items() if t["role"] in ("input", "inout") and not t.get("derived_from")}
    missing = sorted(expected - set(inputs))
    extra = sorted(set(inputs) - expected)
    if missing:
        raise InputError(f"{meta['name']}: missing input(s) {', '.join(missing)}; expected "
                         + ", ".join(f"{n} {_shape_text(tensors[n])}" for n in sorted(expected)))
    if extra:
        raise InputError(f"{meta['name']}: unexpected input(s) {', '.join(extra)}; "
                         f"inputs are {', '.join(sorted(expected))}")
    dims: dict[str, int] = {}
    for name, value in sets.items():
        if name not in meta["dims"]:
            raise InputError(f"{meta['name']}: --set {name}: not a dimension of this kernel "
                             f"(dims: {', '.join(meta['dims'])})")
        dims[name] = int(value)
    for name in sorted(expected):
        arr, info = np.asarray(inputs[name]), tensors[name]
        if arr.dtype.type not in HOST_DTYPES[info["dtype"]]:
            allowed = ", ".join(np.dtype(t).name for t in HOST_DTYPES[info["dtype"]])
            raise InputError(f"{meta['name']}: input {name} has dtype {arr.dtype}, expected "
                             f"{info['dtype']} (as numpy {allowed})")
        if arr.ndim != len(info["shape"]):
            raise InputError(f"{meta['name']}: input {name} has shape {arr.shape}, expected "
                             f"{_shape_text(info)} ({len(info['shape'])} dimensions)")
        for axis, (size, want) in enumerate(zip(arr.shape, info["shape"])):
            if isinstance(want, int):
                if size != want:
                    raise InputError(f"{meta['name']}: input {name} has shape {arr.shape}; axis {axis} "
                                     f"must be {want} ({_shape_text(info)})")
            elif dims.setdefault(want, size) != size:
                raise InputError(f"{meta['name']}: input {name} axis {axis} ({want}) is {size}, "
                                 f"but {want} = {dims[want]} from another input or --set")
    for name, rule in (meta.get("dim_rules") or {}).items():
        if name not in dims:
            dims[name] = apply_dim_rule(rule, dims, num_sms)
    unknown = [d for d in meta["dims"] if d not in dims]
    if unknown:
        raise InputError(f"{meta['name']}: cannot infer {', '.join(unknown)} from the inputs; "
                         f"give --set {unknown[0]}=N")
    return dims


def _shape_text(info: dict) -> str:
    return "[" + ", ".join(map(str, info["shape"])) + "]"


def prepare_buffers(meta: dict, inputs: dict[str, np.ndarray], dims: dict[str, int]) -> dict[str, np.ndarray]:
    """Device-format contiguous arrays for every tensor; outputs and workspaces start poisoned
    (NaN), so any element a kernel fails to write is visible."""
    buffers = {}
    for name, info in meta["tensors"].items():
        if info.get("derived_from"):  # filled with device addresses by the backend
            shape = tuple(exprs.evaluate(s, dims) if isinstance(s, str) else s for s in info["shape"])
            buffers[name] = np.zeros(shape, np.uint64)
        elif info["role"] in ("input", "inout"):
            buffers[name] = to_device(np.asarray(inputs[name]), info["dtype"])
        else:
            shape = tuple(exprs.evaluate(s, dims) if isinstance(s, str) else s for s in info["shape"])
            buffers[name] = np.full(shape, POISON[info["dtype"]],
                                    dtype=type(POISON[info["dtype"]]))
    return buffers


def pack_args(kernel: dict, buffers: dict[str, np.ndarray], dims: dict[str, int],
              pointer: Callable[[str, np.ndarray], Any]) -> list[Any]:
    """Values for a launch's parameters, in ABI order: `pointer(tensor, array)` for pointers,
    numpy scalars of the parameter's type for strides, dims and constants."""
    values = []
    for p in kernel["params"]:
        src, np_type = p["source"], NP_PARAM[p["type"]]
        kind = src["kind"]
        if kind in ("pointer", "workspace"):
            values.append(pointer(src["tensor"], buffers[src["tensor"]]))
        elif kind == "stride":
            arr = buffers[src["tensor"]]
            values.append(np_type(arr.strides[src["axis"]] // arr.itemsize))
        elif kind == "dim":
            values.append(np_type(dims[src["name"]]))
        elif kind == "const":
            values.append(np_type(src["value"]))
        else:
            raise InputError(f"{kernel['entry']}: parameter {p['name']} has unknown source {kind!r}")
    return values


def launch_geometry(kernel: dict, dims: dict[str, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    grid = tuple(exprs.evaluate(g, dims) for g in kernel["grid"])
    return grid, tuple(kernel["block"])


def row_pointer_offsets(source: np.ndarray) -> list[int]:
    """Byte offsets of each leading-axis slice: the per-sequence pointers of a pointer array."""
    return [b * source.strides[0] for b in range(source.shape[0])]


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

        args = pack_args(kernel, buffers, dims, pointer=pointer)
        emu.launch(ptx, kernel["entry"], grid, block, args,
                   dynamic_smem_bytes=kernel["dynamic_smem_bytes"])
    return launch
from .dispatch import find_variant  # noqa: E402  (re-exported: ptxc.runtime.find_variant)
