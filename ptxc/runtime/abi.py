"""The launch ABI of an artifact, shared by every backend (emulator, cuda, the engine-facing
device runtime): the dims the inputs imply, host buffers laid out as the kernels read them, a
launch's parameter values in ABI order, its grid, and which target a device runs.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..errors import InputError
from ..pipeline import exprs
from ..pipeline.dim_rules import AUTO_RULE_NAMES, apply_dim_rule, rule_ctas_per_sm, sm_number  # noqa: F401  (re-exported)
from ..pipeline.metadata import ELEMENT_BYTES
from ..reference import to_device

NP_PARAM = {"u32": np.uint32, "s32": np.int32, "u64": np.uint64, "s64": np.int64, "f32": np.float32}
HOST_DTYPES = {"f32": (np.float32, np.float64, np.float16), "f16": (np.float16, np.float32, np.float64),
               "bf16": (np.float32, np.float64), "i32": (np.int32, np.int64), "i64": (np.int64, np.int32), "u64": (np.uint64,),
               "e4m3": (np.uint8,), "e5m2": (np.uint8,), "u8": (np.uint8,)}
EMU_NUM_SMS = 108  # the SM count "auto" rules assume on the emulator (an A100's)
INT_RANGE = {"i32": (-(1 << 31), (1 << 31) - 1), "i64": (-(1 << 63), (1 << 63) - 1), "u64": (0, (1 << 64) - 1), "u8": (0, 255)}
PARAM_RANGE = {"u32": (0, (1 << 32) - 1), "s32": (-(1 << 31), (1 << 31) - 1),
               "u64": (0, (1 << 64) - 1), "s64": (-(1 << 63), (1 << 63) - 1)}
DIM_MAX = (1 << 31) - 1
GRID_MAX = ((1 << 31) - 1, 65535, 65535)
def _default_max_run_bytes() -> int:
    """Refuse a launch whose buffers need more than 8 GiB or half the machine's memory,
    whichever is less (PTXC_MAX_RUN_BYTES overrides)."""
    import os
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 16 << 30
    return min(8 << 30, ram // 2)


DEFAULT_MAX_RUN_BYTES = _default_max_run_bytes()
POISON = {"f32": np.float32(np.nan), "f16": np.float16(np.nan), "bf16": np.uint16(0x7FC0),
          "i32": np.int32(-0x7FFFFFFF), "i64": np.int64(-0x7FFFFFFFFFFFFFFF), "u64": np.uint64(0), "e4m3": np.uint8(0x7F),
          "e5m2": np.uint8(0x7F), "u8": np.uint8(0xA5)}


def pick_target(targets: dict[str, dict], sm: int) -> tuple[str, str] | None:
    """The rule every ptxc loader (this runtime, the C and Rust ones) follows: the newest target
    not newer than the device (an arch-specific one, sm_90a, only on exactly its SM); its cubin
    when built for exactly this SM, else its PTX for the driver to JIT. None when no target runs."""
    fits = [t for t in targets if sm_number(t) <= sm and not (t[-1].isalpha() and sm_number(t) != sm)]
    if not fits:
        return None
    best = max(fits, key=lambda t: (sm_number(t), t[-1].isalpha()))
    return best, "cubin" if "cubin" in targets[best] and sm_number(best) == sm else "ptx"


def _dim_sets(meta: dict, sets: dict | None) -> dict:
    return {k: v for k, v in (sets or {}).items() if k not in (meta.get("scalars") or {})}


def split_scalars(meta: dict, inputs: dict, sets: dict) -> tuple[dict, dict[str, float]]:
    """(tensor inputs, runtime scalar values): each scalar of the metadata comes from `sets` or
    from the inputs as a 0-d float32 array, and must be finite."""
    declared = meta.get("scalars") or {}
    tensors = {k: v for k, v in inputs.items() if k not in declared}
    values: dict[str, float] = {}
    for name in sorted(declared):
        if name in sets:
            value = sets[name]
        elif name in inputs:
            arr = np.asarray(inputs[name])
            if arr.ndim != 0 or arr.dtype != np.float32:
                raise InputError(f"{meta['name']}: scalar {name} must be a 0-d float32 array, got "
                                 f"dtype {arr.dtype} shape {arr.shape}")
            value = arr[()]
        else:
            raise InputError(f"{meta['name']}: missing scalar {name} ({declared[name].get('doc', 'f32')}); "
                             f"give it in the inputs as a 0-d float32 array or as --set {name}=VALUE")
        # Overflow to inf is the finding itself, not something to warn about: silence numpy's
        # RuntimeWarning so the one-line error below is all the user sees.
        with np.errstate(over="ignore", invalid="ignore"):
            as_f32 = np.float32(value)
        if not np.isfinite(as_f32):
            raise InputError(f"{meta['name']}: scalar {name} = {value} is not a finite f32 "
                             f"(|value| <= {float(np.finfo(np.float32).max):.6g})")
        values[name] = float(as_f32)
    return tensors, values


def infer_dims(meta: dict, inputs: dict[str, np.ndarray], sets: dict[str, int],
               num_sms: int = EMU_NUM_SMS, target: str | None = None) -> dict[str, int]:
    """Match every input's shape against its tensor's named shape; return the runtime dims
    (runtime scalars among the inputs are not tensors and are passed over here)."""
    inputs = {k: v for k, v in inputs.items() if k not in (meta.get("scalars") or {})}
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
    derived: list = []
    for name, value in sets.items():
        if name not in meta["dims"]:
            scalars = sorted(meta.get("scalars") or {})
            raise InputError(f"{meta['name']}: --set {name}: not a dimension of this kernel "
                             f"(dims: {', '.join(meta['dims'])}"
                             + (f"; scalars: {', '.join(scalars)})" if scalars else ")"))
        if not isinstance(value, (int, np.integer)):
            raise InputError(f"{meta['name']}: --set {name}={value}: a dimension takes an integer")
        dims[name] = int(value)
        check_dim(meta, name, dims[name], "--set")
    for name in sorted(expected):
        arr, info = np.asarray(inputs[name]), tensors[name]
        if arr.dtype.type not in HOST_DTYPES[info["dtype"]]:
            allowed = ", ".join(np.dtype(t).name for t in HOST_DTYPES[info["dtype"]])
            raise InputError(f"{meta['name']}: input {name} has dtype {arr.dtype}, expected "
                             f"{info['dtype']} (as numpy {allowed})")
        if info["dtype"] in INT_RANGE and arr.size:   # range-check before narrowing (no wrap)
            lo, hi = INT_RANGE[info["dtype"]]
            if int(arr.min()) < lo or int(arr.max()) > hi:
                bad = int(arr.max()) if int(arr.max()) > hi else int(arr.min())
                raise InputError(f"{meta['name']}: input {name} holds {bad}, outside "
                                 f"{info['dtype']}'s range [{lo}, {hi}]")
        if arr.ndim != len(info["shape"]):
            raise InputError(f"{meta['name']}: input {name} has shape {arr.shape}, expected "
                             f"{_shape_text(info)} ({len(info['shape'])} dimensions)")
        for axis, (size, want) in enumerate(zip(arr.shape, info["shape"])):
            if isinstance(want, str) and not want.isidentifier():
                derived.append((name, axis, size, want, arr.shape, info))   # e.g. "batch + 1"
            elif isinstance(want, int):
                if size != want:
                    raise InputError(f"{meta['name']}: input {name} has shape {arr.shape}; axis {axis} "
                                     f"must be {want} ({_shape_text(info)})")
            elif dims.setdefault(want, size) != size:
                raise InputError(f"{meta['name']}: input {name} axis {axis} ({want}) is {size}, "
                                 f"but {want} = {dims[want]} from another input or --set")
    for name, axis, size, want, shape, info in derived:
        if exprs.evaluate(want, dims) != size:
            raise InputError(f"{meta['name']}: input {name} has shape {shape}; axis {axis} must be "
                             f"{want} = {exprs.evaluate(want, dims)} ({_shape_text(info)})")
    for name in sorted(expected):
        if tensors[name].get("prefix_sums"):
            check_prefix_sums(meta["name"], name, inputs[name], tensors[name]["prefix_sums"], dims)
    if "tree_indptr" in expected and "cu_seqlens_q" in expected:
        check_mask_indptr(meta["name"], "tree_indptr", inputs["tree_indptr"],
                          np.diff(np.asarray(inputs["cu_seqlens_q"], dtype=np.int64)) ** 2,
                          int(np.asarray(inputs["tree_mask"]).size))
    if "mask_indptr" in expected and "seq_q" in dims and "seq_k" in dims:   # prefill: seq_q x seq_k
        check_mask_indptr(meta["name"], "mask_indptr", inputs["mask_indptr"],
                          np.full(dims.get("batch", 0), dims["seq_q"] * dims["seq_k"], dtype=np.int64),
                          int(np.asarray(inputs["custom_mask"]).size))
    if "mask_indptr" in expected and "cu_seqlens_q" in expected:   # varlen: q_len x L bits
        lens = np.clip(np.asarray(inputs["seq_lens"], dtype=np.int64), 0, None)
        check_mask_indptr(meta["name"], "mask_indptr", inputs["mask_indptr"],
                          np.diff(np.asarray(inputs["cu_seqlens_q"], dtype=np.int64)) * lens,
                          int(np.asarray(inputs["custom_mask"]).size))
    for name, rule in (meta.get("dim_rules") or {}).items():
        if name not in dims:
            dims[name] = apply_dim_rule(rule, dims, num_sms, rule_ctas_per_sm(meta, rule, target))
    unknown = [d for d in meta["dims"] if d not in dims]
    if unknown:
        raise InputError(f"{meta['name']}: cannot infer {', '.join(unknown)} from the inputs; "
                         f"give --set {unknown[0]}=N")
    for name, value in dims.items():
        check_dim(meta, name, value, "dim")
    return dims


def check_dim(meta: dict, name: str, value: int, what: str) -> None:
    """A dim must fit the 32-bit parameters it becomes, and obey its rule: a fixed split count
    is the one the kernel was built for, an automatic one lies in [1, max]."""
    rule = (meta.get("dim_rules") or {}).get(name)
    if rule and "value" in rule:
        lo = hi = int(rule["value"])
    elif rule:
        lo, hi = 1, int(rule["auto"]["max"])
    else:
        lo, hi = 0, DIM_MAX
    if not lo <= value <= hi:
        allowed = f"{lo}" if lo == hi else f"{lo}..{hi}"
        raise InputError(f"{meta['name']}: {what} {name}={value} is out of range (allowed: {allowed})")


def check_prefix_sums(kernel: str, name: str, values, total: str, dims: dict[str, int]) -> None:
    """An input of prefix sums (cu_seqlens_q) must start at 0, never decrease, and end at the
    dim `total`: the kernel trusts the order to find each tile's sequence."""
    cu = np.asarray(values, dtype=np.int64)
    if cu.size == 0 or cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] != dims.get(total, cu[-1]):
        raise InputError(f"{kernel}: input {name} must be prefix sums: 0, non-decreasing, ending "
                         f"at {total} = {dims.get(total)} (got {cu[:8].tolist()}"
                         f"{' ...' if cu.size > 8 else ''})")


def check_mask_indptr(kernel: str, name: str, values, bits, nbytes: int) -> None:
    """Byte offsets of per-sequence mask bits (tree_indptr): start at 0, never decrease, each
    segment holds its sequence's `bits` (ceil(bits / 8) bytes) and the last one ends inside the
    `nbytes` buffer -- the kernel reads any bit of a segment without a bound of its own."""
    ptr = np.asarray(values, dtype=np.int64)
    need = (np.asarray(bits, dtype=np.int64) + 7) // 8
    if ptr.size == 0 or ptr[0] != 0 or np.any(np.diff(ptr) < 0):
        raise InputError(f"{kernel}: input {name} must start at 0 and never decrease "
                         f"(got {ptr[:8].tolist()}{' ...' if ptr.size > 8 else ''})")
    short = np.nonzero(np.diff(ptr) < need)[0] if need.size == ptr.size - 1 else []
    if len(short):
        b = int(short[0])
        raise InputError(f"{kernel}: input {name}: sequence {b}'s segment has "
                         f"{int(ptr[b + 1] - ptr[b])} bytes, its mask needs {int(need[b])} "
                         f"(ceil({int(bits[b])} bits / 8))")
    if int(ptr[-1]) > nbytes:
        raise InputError(f"{kernel}: input {name} ends at byte {int(ptr[-1])}, past the "
                         f"{nbytes}-byte mask buffer")


def _shape_text(info: dict) -> str:
    return "[" + ", ".join(map(str, info["shape"])) + "]"


def prepare_buffers(meta: dict, inputs: dict[str, np.ndarray], dims: dict[str, int]) -> dict[str, np.ndarray]:
    """Device-format contiguous arrays for every tensor; outputs and workspaces start poisoned
    (NaN), so any element a kernel fails to write is visible. The total size is checked first:
    absurd dims are refused with an estimate instead of an attempt to allocate them."""
    check_buffer_budget(meta, inputs, dims)
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




def check_buffer_budget(meta: dict, inputs: dict[str, np.ndarray] | None, dims: dict[str, int]) -> int:
    """Bytes of every buffer a launch at `dims` needs (inputs counted from `inputs` when given,
    else from their shapes); InputError with the estimate when over the limit."""
    import math
    import os
    from ..env import env_int
    limit = env_int("PTXC_MAX_RUN_BYTES", DEFAULT_MAX_RUN_BYTES)
    dims = dict(dims)
    for name, rule in (meta.get("dim_rules") or {}).items():
        try:
            dims.setdefault(name, apply_dim_rule(rule, dims, EMU_NUM_SMS, rule_ctas_per_sm(meta, rule)))
        except InputError:
            if inputs is not None:
                raise   # before the inputs exist, a rule over a dim they carry waits for them
    total = 0
    for name, info in meta["tensors"].items():
        if inputs is not None and info["role"] in ("input", "inout") and not info.get("derived_from"):
            total += np.asarray(inputs[name]).size * ELEMENT_BYTES[info["dtype"]]
        else:
            names = {n for s in info["shape"] if isinstance(s, str) for n in exprs.names(s)}
            if inputs is None and not names <= set(dims):
                continue   # sized by a dim the inputs will carry (varlen's total_q): checked with them
            shape = [exprs.evaluate(s, dims) if isinstance(s, str) else s for s in info["shape"]]
            total += math.prod(shape) * (8 if info.get("derived_from") else ELEMENT_BYTES[info["dtype"]])
    if total > limit:
        raise InputError(f"{meta['name']}: these dims need about {total / 2**30:.1f} GiB of buffers "
                         f"(limit {limit / 2**30:.1f} GiB; set PTXC_MAX_RUN_BYTES to raise it): "
                         + ", ".join(f"{k}={v}" for k, v in sorted(dims.items())))
    return total


def pack_args(kernel: dict, buffers: dict[str, np.ndarray], dims: dict[str, int],
              pointer: Callable[[str, np.ndarray], Any],
              tensor_map: Callable[[str, np.ndarray, dict], Any] | None = None) -> list[Any]:
    """Values for a launch's parameters, in ABI order: `pointer(tensor, array)` for pointers,
    `tensor_map(tensor, array, source)` for tensor maps (the backend's encoding; the emulator's:
    tensor_maps.emu_tensor_map), numpy scalars of the parameter's type for strides, dims and
    constants."""
    values = []
    for p in kernel["params"]:
        src, kind = p["source"], p["source"]["kind"]
        if kind == "tensor_map":
            if tensor_map is None:
                raise InputError(f"{kernel['entry']}: parameter {p['name']} is a tensor map, and "
                                 f"this launcher encodes none")
            values.append(tensor_map(src["tensor"], buffers[src["tensor"]], src))
            continue
        np_type = NP_PARAM[p["type"]]
        if kind in ("pointer", "workspace"):
            values.append(pointer(src["tensor"], buffers[src["tensor"]]))
        elif kind == "stride":
            arr = buffers[src["tensor"]]
            values.append(_narrow(arr.strides[src["axis"]] // arr.itemsize, p, kernel))
        elif kind == "dim":
            values.append(_narrow(dims[src["name"]], p, kernel))
        elif kind == "const":
            values.append(np_type(src["value"]) if p["type"] == "f32" else _narrow(src["value"], p, kernel))
        elif kind == "scalar":
            values.append(np_type(dims[src["name"]]))
        else:
            raise InputError(f"{kernel['entry']}: parameter {p['name']} has unknown source {kind!r}")
    return values


def _narrow(value, p: dict, kernel: dict):
    """`value` as the parameter's integer type, refusing (not wrapping) what does not fit."""
    lo, hi = PARAM_RANGE[p["type"]]
    if value != int(value) or not lo <= int(value) <= hi:
        raise InputError(f"{kernel['entry']}: parameter {p['name']} = {value} does not fit "
                         f"{p['type']} [{lo}, {hi}]")
    return NP_PARAM[p["type"]](int(value))


def launch_geometry(kernel: dict, dims: dict[str, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    grid = tuple(exprs.evaluate(g, dims) for g in kernel["grid"])
    for axis, (g, hi) in enumerate(zip(grid, GRID_MAX)):
        if not 0 <= g <= hi:
            raise InputError(f"{kernel['entry']}: grid[{axis}] = {g} is outside [0, {hi}] at "
                             + ", ".join(f"{k}={v}" for k, v in sorted(dims.items())))
    return grid, tuple(kernel["block"])


def launch_record(kernel: dict, buffers: dict[str, np.ndarray], dims: dict[str, int]) -> dict:
    """One launch as a graph would capture it: entry, grid, block, dynamic shared memory, and
    every parameter's bytes -- a device pointer as [buffer name, byte offset] (its address is the
    caller's), a tensor map as the tensor, box and swizzle it encodes, any other parameter as its
    little-endian bytes in hex. Two steps whose records are equal replay the same captured launch
    with only the contents of device buffers changed (`ptxc run --record-launches`)."""
    grid, block = launch_geometry(kernel, dims)
    values = pack_args(kernel, buffers, dims, pointer=lambda name, arr: ("pointer", name),
                       tensor_map=lambda name, arr, src: ("tensor_map", name, src))
    params = []
    for p, v in zip(kernel["params"], values):
        if isinstance(v, tuple) and v[0] == "pointer":
            params.append({"name": p["name"], "pointer": [v[1], 0]})
        elif isinstance(v, tuple):
            params.append({"name": p["name"], "tensor_map": {"tensor": v[1], "box": list(v[2]["box"]),
                                                             "swizzle": v[2]["swizzle"]}})
        else:
            params.append({"name": p["name"], "type": p["type"],
                           "bytes": np.asarray(v, NP_PARAM[p["type"]]).astype(
                               np.dtype(NP_PARAM[p["type"]]).newbyteorder("<")).tobytes().hex()})
    return {"entry": kernel["entry"], "grid": list(grid), "block": list(block),
            "dynamic_smem_bytes": kernel["dynamic_smem_bytes"], "params": params}


def row_pointer_offsets(source: np.ndarray) -> list[int]:
    """Byte offsets of each leading-axis slice: the per-sequence pointers of a pointer array."""
    return [b * source.strides[0] for b in range(source.shape[0])]
