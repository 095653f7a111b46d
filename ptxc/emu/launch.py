"""launch(): check arguments, lay out memory, run CTAs in batches, copy buffers back."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ptxc.emu.op_table import decode_program
from ptxc.emu.context import BatchContext
from ptxc.emu.executor import BatchRun
from ptxc.emu.memory import GlobalMemory
from ptxc.emu.args import StructArg
from ptxc.emu.tensormap import TensorMap
from ptxc.emu.traffic import Traffic, TrafficCounter
from ptxc.errors import InputError

# Maximum shared memory per CTA (opt-in) by target; the default is the sm_90 value.
SMEM_LIMIT = {"sm_75": 65536, "sm_80": 166912, "sm_86": 101376, "sm_87": 166912,
              "sm_89": 101376, "sm_90": 232448, "sm_100": 232448, "sm_120": 101376}
MAX_THREADS_PER_CTA = 1024

_SCALAR_DTYPES = {"u8": np.uint8, "u16": np.uint16, "u32": np.uint32, "u64": np.uint64,
                  "s8": np.int8, "s16": np.int16, "s32": np.int32, "s64": np.int64,
                  "f16": np.float16, "f32": np.float32, "f64": np.float64}


@dataclass(frozen=True)
class LaunchStats:
    """What one launch executed. A thread-instruction is one instruction issued for one thread
    (guarded-off threads included); a step is one instruction issued for a group of threads."""
    kernel: str
    grid: tuple
    block: tuple
    thread_instructions: int
    steps: int
    wall_time_s: float
    traffic: Traffic | None = None      # with launch(..., traffic=True): see traffic.py

    @property
    def thread_instructions_per_s(self) -> float:
        return self.thread_instructions / self.wall_time_s if self.wall_time_s > 0 else 0.0


def _dims(name: str, value) -> tuple:
    if not isinstance(value, tuple) or not 1 <= len(value) <= 3 or \
            not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1
                    for v in value):
        raise InputError(f"{name} must be a tuple of 1 to 3 positive ints, got {value!r}")
    return tuple(int(v) for v in value) + (1,) * (3 - len(value))


def _describe(value) -> str:
    if isinstance(value, np.ndarray):
        return f"numpy array of {value.dtype} with shape {value.shape}"
    if isinstance(value, np.generic):
        return f"numpy.{value.dtype} scalar {value!r}"
    return f"{type(value).__name__} {value!r}"


@dataclass(frozen=True)
class PointerTable:
    """A .u64 buffer of device pointers into host arrays that are not parameters themselves
    (e.g. per-sequence KV caches reached through `k_ptrs`): entry k is the device address of
    `targets[k][0]` plus `targets[k][1]` bytes. The target arrays are laid out in global memory
    like any buffer and copied back after the launch; one array may be named by many entries."""

    targets: tuple

    def __post_init__(self):
        for arr, offset in self.targets:
            if not isinstance(arr, np.ndarray) or not (0 <= int(offset) <= arr.nbytes):
                raise InputError(f"PointerTable entry ({_describe(arr)}, {offset!r}): expected a numpy "
                                 f"array and a byte offset within it")


def _struct_bytes(kernel, i, p, a):
    """-> (bytes, ((offset, label, array), ...)) of a by-value struct argument."""
    if isinstance(a, TensorMap) and p.nbytes == 128:
        a = a.struct_arg(f"kernel '{kernel}': param {i} '{p.name}'")
    pointers = a.buffers if isinstance(a, StructArg) else ()
    data = a.data if isinstance(a, StructArg) else a
    if isinstance(data, np.ndarray) and data.shape == () and data.dtype.names:
        data = data[()]
    fields = data.dtype.fields if isinstance(data, np.void) and data.dtype.names else {}
    raw = data.tobytes() if isinstance(data, np.void) else data
    if not isinstance(raw, (bytes, bytearray)) or len(raw) != p.nbytes:
        got = f"{len(raw)} bytes" if isinstance(raw, (bytes, bytearray)) else _describe(data)
        raise InputError(f"kernel '{kernel}': param {i} '{p.name}' is a {p.nbytes}-byte struct "
                         f"(.b8[{p.nbytes}]): expected bytes, a numpy structured scalar or a "
                         f"StructArg of exactly {p.nbytes} bytes, got {got}")
    out = []
    for key, arr in pointers:
        off = fields[key][1] if isinstance(key, str) and key in fields else key
        if not isinstance(off, (int, np.integer)) or not 0 <= off <= p.nbytes - 8 or off % 8 \
                or not isinstance(arr, np.ndarray) or arr.dtype.hasobject:
            raise InputError(f"kernel '{kernel}': param {i} '{p.name}': StructArg buffer "
                             f"{key!r} must be an aligned u64 field of the struct holding a "
                             f"numpy array, got {_describe(arr)}")
        out.append((int(off), f"{p.name}.{key}" if isinstance(key, str) else f"{p.name}+{off}",
                    arr))
    return bytes(raw), out


def _pack_params(kernel: str, env, args: list):
    """-> (param bytes, [(arg index or None, array)] device buffers, their names, GlobalMemory)."""
    params = env.entry.params
    if not isinstance(args, (list, tuple)):
        raise InputError(f"kernel '{kernel}': args must be a list, got {type(args).__name__}")
    if len(args) != len(params):
        names = ", ".join(f"{p.name} (.{p.ptype})" for p in params) or "none"
        raise InputError(f"kernel '{kernel}' takes {len(params)} parameter(s) ({names}), "
                         f"got {len(args)} argument(s)")
    buffers, names, tables, targets, structs = [], [], {}, {}, {}
    for i, (p, a) in enumerate(zip(params, args)):
        if p.nbytes is not None:
            structs[i] = _struct_bytes(kernel, i, p, a)
            continue
        if isinstance(a, PointerTable):
            if p.ptype not in ("u64", "s64", "b64"):
                raise InputError(f"kernel '{kernel}': param {i} '{p.name}' (.{p.ptype}) is not "
                                 f"a pointer (.u64) parameter, got a PointerTable")
            tables[i] = a
            buffers.append((i, np.zeros(len(a.targets), np.uint64)))
            names.append(p.name)
            for arr, _ in a.targets:
                targets.setdefault(id(arr), arr)
            continue
        if isinstance(a, np.ndarray):
            if a.dtype.hasobject:
                raise InputError(f"kernel '{kernel}': param {i} '{p.name}': a device buffer "
                                 f"cannot hold Python objects ({_describe(a)})")
            if p.ptype not in ("u64", "s64", "b64"):
                raise InputError(f"kernel '{kernel}': param {i} '{p.name}' (.{p.ptype}) is not "
                                 f"a pointer (.u64) parameter, got a {_describe(a)}")
            buffers.append((i, a))
            names.append(p.name)
    first_target = len(buffers)
    buffers += [(None, arr) for arr in targets.values()]
    names += [f"pointer-table target {k}" for k in range(len(targets))]
    struct_slot = {}
    placed = {id(a): k for k, (_, a) in enumerate(buffers)}
    for i, (_, ptrs) in structs.items():
        for off, label, arr in ptrs:
            if id(arr) in placed:       # also a pointer argument (a tensor map's array): one buffer
                struct_slot[(i, off)] = placed[id(arr)]
                continue
            struct_slot[(i, off)] = placed[id(arr)] = len(buffers)
            buffers.append((None, arr))
            names.append(label)
    globals_slot = None
    if env.globals_image:
        globals_slot = len(buffers)
        buffers.append((None, np.frombuffer(env.globals_image, np.uint8).copy()))
        names.append("module globals")
    gmem = GlobalMemory([(f"arg {i} '{params[i].name}'" if i is not None else name, a.nbytes)
                         for (i, a), name in zip(buffers, names)])
    if globals_slot is not None:
        gmem.globals_base = int(gmem.starts[globals_slot])
    address_of = {i: int(gmem.starts[k]) for k, (i, _) in enumerate(buffers) if i is not None}
    target_address = {key: int(gmem.starts[first_target + k]) for k, key in enumerate(targets)}
    for i, table in buffers[:first_target]:
        if i in tables:
            table[:] = [target_address[id(arr)] + int(off) for arr, off in tables[i].targets]
    out = bytearray(env.param_bytes)
    for i, (p, a) in enumerate(zip(params, args)):
        off, ptype = env.params[p.name]
        if i in structs:
            raw = bytearray(structs[i][0])
            for poff, _, _ in structs[i][1]:
                raw[poff:poff + 8] = np.uint64(gmem.starts[struct_slot[(i, poff)]]).tobytes()
            out[off:off + p.nbytes] = raw
            continue
        if i in address_of:
            value = np.uint64(address_of[i])
        else:
            value = _check_scalar(kernel, i, p, ptype, a)
        out[off:off + ptype.nbytes] = value.tobytes()
    return bytes(out), buffers, names, gmem


def _check_scalar(kernel, i, p, ptype, a):
    if ptype.kind == "b":
        ok = isinstance(a, np.generic) and a.dtype.itemsize * 8 == ptype.bits and \
            a.dtype.kind in "uif"
        want = f"a {ptype.bits}-bit numpy scalar"
    else:
        dt = _SCALAR_DTYPES.get(ptype.name)
        ok = dt is not None and isinstance(a, np.generic) and a.dtype == np.dtype(dt)
        want = f"a numpy.{np.dtype(dt).name} scalar" if dt else "an unsupported type"
    if not ok:
        hint = " (a device buffer goes in a .u64 parameter)" if isinstance(a, np.ndarray) else ""
        raise InputError(f"kernel '{kernel}': param {i} '{p.name}' (.{ptype.name}) expects "
                         f"{want}, got {_describe(a)}{hint}")
    return a


def _shared_bytes(kernel: str, env, target: str, dynamic: int) -> int:
    if not isinstance(dynamic, (int, np.integer)) or dynamic < 0:
        raise InputError(f"dynamic_smem_bytes must be a non-negative int, got {dynamic!r}")
    total = (env.dynamic_offset if dynamic else env.static_shared_bytes) + int(dynamic)
    limit = SMEM_LIMIT.get(target.split(",")[0].strip().rstrip("af"), 232448)
    if total > limit:
        raise InputError(f"kernel '{kernel}' needs {total} bytes of shared memory "
                         f"({env.static_shared_bytes} static + {dynamic} dynamic), more than "
                         f"the {limit} bytes a CTA may have on {target or 'this target'}")
    return total


def launch(ptx: str, entry: str, grid: tuple, block: tuple, args: list,
           dynamic_smem_bytes: int = 0, *, batch_threads: int = 32768,
           step_limit: int = 50_000_000, racecheck: bool = True,
           traffic: bool = False) -> LaunchStats:
    """Emulate one kernel launch. See the package docstring for the full contract."""
    t0 = time.perf_counter()
    g, b = _dims("grid", grid), _dims("block", block)
    nthreads = b[0] * b[1] * b[2]
    if nthreads > MAX_THREADS_PER_CTA:
        raise InputError(f"block {block} has {nthreads} threads, more than "
                         f"{MAX_THREADS_PER_CTA}")
    program = decode_program(ptx, entry)
    env = program.env
    if program.entry.reqntid and _dims(".reqntid", program.entry.reqntid) != b:
        raise InputError(f"kernel '{entry}' requires block {program.entry.reqntid} (.reqntid), "
                         f"launched with {block}")
    if program.entry.maxntid:
        mx = _dims(".maxntid", program.entry.maxntid)
        if nthreads > mx[0] * mx[1] * mx[2]:
            raise InputError(f"kernel '{entry}' allows at most {mx} threads (.maxntid), "
                             f"launched with {block}")
    smem = _shared_bytes(entry, env, program.module.target, dynamic_smem_bytes)
    param_bytes, buffers, names, gmem = _pack_params(entry, env, args)
    for k, (_, a) in enumerate(buffers):
        gmem.region(k)[:] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    counter = None
    if traffic:
        counter = TrafficCounter(gmem, names, {ins.line: ins.text for ins in program.entry.body})
    tpad = -(-nthreads // 32) * 32
    ctas = g[0] * g[1] * g[2]
    per_batch = max(1, batch_threads // tpad)
    thread_instructions = steps = 0
    for start in range(0, ctas, per_batch):
        nctas = min(per_batch, ctas - start)
        ctx = BatchContext(program, g, b, start, nctas, gmem, param_bytes, smem, racecheck,
                           counter)
        run = BatchRun(program, ctx, step_limit)
        run.run()
        thread_instructions += run.thread_instructions
        steps += run.steps
    for k, (i, a) in enumerate(buffers):
        result = gmem.region(k).view(a.dtype).reshape(a.shape) if a.nbytes else a
        if a.flags.writeable:
            a[...] = result
        elif not np.array_equal(result.reshape(-1).view(np.uint8),
                                np.ascontiguousarray(a).reshape(-1).view(np.uint8)):
            what = f"arg {i}" if i is not None else f"'{names[k]}'"
            raise InputError(f"kernel '{entry}' wrote to {what}, a read-only numpy array")
    return LaunchStats(entry, g, b, thread_instructions, steps, time.perf_counter() - t0,
                       counter.result() if counter else None)
