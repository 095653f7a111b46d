"""`ptxc launch-test` and `ptxc run`: random inputs (or given ones), the artifact's whole launch
list on a backend, and a comparison with the fp64 reference under the tolerance rule."""

from __future__ import annotations

import contextlib
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InputError, UserError
from ..reference import PROBS_SHIFTS, TOLERANCE_RULE, Precision, max_abs_error, tolerance
from .abi import DIM_MAX


@dataclass
class CheckRow:
    kernel: str
    target: str
    backend: str
    shape: str
    tensor: str
    max_error: float
    tol: float
    seconds: float
    ms: float | None = None   # device time per launch list (cuda)
    features: tuple[str, ...] = ()   # what these inputs exercised (exercised_features)
    note: str = ""                   # a failure's diagnosis (the unread rows' part in it)

    @property
    def ok(self) -> bool:
        return self.max_error <= self.tol

    def to_dict(self) -> dict[str, Any]:
        return {"kernel": self.kernel, "target": self.target, "backend": self.backend,
                "shape": self.shape, "tensor": self.tensor, "max_error": self.max_error,
                "tolerance": self.tol, "pass": self.ok, "seconds": round(self.seconds, 3),
                "device_ms": self.ms, "features": list(self.features),
                **({"note": self.note} if self.note else {})}


def resolve_backend(backend: str) -> str:
    if backend != "auto":
        return backend
    from .cuda import available
    return "cuda" if available() else "emu"


def artifacts_for(paths, workdir: Path, verify: bool) -> list:
    """Artifact objects for artifact dirs, output dirs, or spec files (built into workdir)."""
    from ..pipeline.build import run_build
    from .artifact import load
    from ..pipeline.verify import is_artifact_dir, is_output_dir
    arts = []
    for p in map(Path, paths):
        if is_artifact_dir(p):
            arts.append(load(p))
        elif p.is_dir() and is_output_dir(p):
            arts += [load(c) for c in sorted(p.iterdir()) if is_artifact_dir(c)]
        else:
            out = workdir / f"build{len(arts)}"
            summary = run_build([p], out, verify=verify, progress=False)
            arts += [load(out / k["name"]) for k in summary["kernels"]]
    return arts


def check_artifact(art, *, backend: str, shapes: dict[str, int], seed: int,
                   targets: list[str] | None = None, device=None) -> list[CheckRow]:
    import numpy as np

    from ..kernels import FAMILIES
    from ..kernels.attention.unread_rows import poison, restore
    from ..spec.model import KernelSpec
    from .abi import DIM_MAX, check_buffer_budget
    spec = KernelSpec.from_dict(art.meta["spec"])
    family = FAMILIES[spec.family]
    dims = {**family.interface(spec).defaults, **shapes}
    unknown = set(shapes) - set(art.meta["dims"])
    if unknown:
        raise InputError(f"{art.name}: --shape {', '.join(sorted(unknown))}: not a dimension "
                         f"(dims: {', '.join(art.meta['dims'])})")
    for name, value in dims.items():
        if name in art.meta["dims"] and not 1 <= value <= DIM_MAX:
            raise InputError(f"{art.name}: --shape {name}={value} is out of range (allowed: 1..{DIM_MAX}; "
                             f"launch-test needs non-empty tensors to compare)")
    check_buffer_budget(art.meta, None, dims)   # before generating inputs of an absurd size
    rng = np.random.default_rng(seed)
    inputs = family.make_inputs(spec, dims, rng)
    ref = family.reference(spec, inputs)
    # Each output's tolerance comes from the naive computation in *that output's* dtype: o in the
    # spec's dtype, but lse is an f32 output computed from f32 scores, so its naive baseline is
    # the f32 computation (the spec-dtype one allowed ~10^4 times the error the kernel makes).
    # An FP8 output (a quantised cache) keeps the spec-dtype baseline: its values are compared
    # dequantised, and its bytes exactly by the FP8 tests.
    # With tensor-core row sums, the f32 baseline is the largest of PROBS_SHIFTS draws of the
    # probabilities' rounding (reference.py: the kernel's grid follows its lazy running max).
    naive_by_dtype = {spec.dtype: [family.reference(spec, inputs, dtype=spec.dtype)]}
    sums_in = family.row_sum_dtype(spec) if family.row_sum_dtype else None

    def baseline(name: str) -> str:
        out_dtype = art.meta["tensors"].get(name, {}).get("dtype", spec.dtype)
        return out_dtype if out_dtype in ("f32", "f16", "bf16") else spec.dtype

    for name in ref:
        out_dtype = baseline(name)
        if out_dtype not in naive_by_dtype:
            precs = [Precision(out_dtype, probs=sums_in, probs_scale=c) for c in PROBS_SHIFTS] \
                if out_dtype == "f32" and sums_in else [out_dtype]
            naive_by_dtype[out_dtype] = [family.reference(spec, inputs, dtype=p) for p in precs]
    tol = {name: max(tolerance(n[name], ref[name]) for n in naive_by_dtype[baseline(name)])
           for name in ref}
    shape = ",".join(f"{k}={v}" for k, v in sorted(dims.items()))
    features = exercised_features(art, spec, dims, inputs)
    # NaN in every cache row no query reads (attention/unread_rows.py): the references above
    # saw the clean inputs, the kernel runs on them poisoned in place
    unread = family.unread(spec, inputs) if family.unread else {}
    saved = poison(inputs, unread)
    if unread:
        rows_nan = int(next(iter(unread.values())).sum())
        features += (f"NaN in {rows_nan} unread cache rows" if rows_nan else "NOT unread cache rows",)
    rows = []
    # on a GPU, every target the device can run: its own cubin and older targets' PTX (JIT)
    default = device.runnable_targets(art) if device is not None else sorted(art.meta["targets"])
    for target in targets or default:
        if target not in art.meta["targets"]:
            raise InputError(f"{art.name}: not built for {target}")
        t0 = time.perf_counter()
        if device is not None:
            device.last_ms.clear()
        with progress_notes(f"{backend}: {art.name} [{target}] at {shape}"):
            out = art.run(inputs, target=target, backend=backend, device=device)
        secs = time.perf_counter() - t0
        ms = sum(device.last_ms) if device is not None and device.last_ms else None
        errors = {}
        for name in sorted(ref):
            got, err = out[name], 0.0
            if name in unread:   # an inout cache: its unread rows must come back as they went in
                got, err = unread_rows_kept(got, ref[name], inputs[name], unread[name])
            errors[name] = max(err, max_abs_error(got, ref[name]))
        note = ""
        if unread and any(errors[n] > tol[n] for n in errors):
            # what a user debugging it asks first: do the clean caches pass?
            restore(inputs, unread, saved)
            clean = art.run(inputs, target=target, backend=backend, device=device)
            saved = poison(inputs, unread)
            if all(max_abs_error(clean[n], ref[n]) <= tol[n] for n in ref if n not in unread):
                note = ("passes on clean caches: the kernel reads cache rows no query may see "
                        "(NaN there reached its outputs) or writes them")
        rows += [CheckRow(art.name, target, backend, shape, name, errors[name], tol[name], secs, ms,
                          features, note if errors[name] > tol[name] else "")
                 for name in sorted(ref)]
    return rows


def unread_rows_kept(got, want, sent, mask):
    """(`got` with its unread rows taken from the reference `want`, inf if any of them is not
    what the kernel was given in `sent` (NaN stays NaN, FP8 bytes stay those bytes) -- a write
    outside the rows it owns)."""
    import numpy as np
    got = np.asarray(got)
    a, b = got[mask], np.asarray(sent)[mask]
    floats = np.issubdtype(a.dtype, np.floating) and np.issubdtype(b.dtype, np.floating)
    kept = np.array_equal(a.astype(np.float64), b.astype(np.float64), equal_nan=True) if floats \
        else a.dtype == b.dtype and np.array_equal(a, b)
    fixed = np.array(got, copy=True)
    fixed[mask] = np.asarray(want)[mask]
    return fixed, (0.0 if kept else float("inf"))


def exercised_features(art, spec, dims: dict, inputs: dict) -> tuple[str, ...]:
    """The features of `spec` these inputs reach, said in launch-test's output so that a pass
    is not mistaken for coverage it did not have: keys outside a sliding window, a sequence
    crossing pages, more than one split, empty sequences, and the variant options in use."""
    import numpy as np
    opts = dict(spec.options)
    lens = np.asarray(inputs["seq_lens"]) if "seq_lens" in inputs else None
    longest = int(lens.max()) if lens is not None and lens.size else int(dims.get("seq_k", 0))
    if lens is None and "positions" in inputs and "num_new" in dims:   # kv_append: rows written up to
        pos = np.asarray(inputs["positions"])
        longest = int((pos + dims["num_new"]).max()) if pos.size else 0
    out = []
    window = opts.get("sliding_window")
    if window:
        out.append(f"keys outside the window ({longest} > {window})" if longest > window
                   else f"NOT keys outside the window ({longest} <= {window})")
    chunk = opts.get("attention_chunk")
    if chunk:
        out.append(f"keys before the chunk ({longest} > {chunk})" if longest > chunk
                   else f"NOT keys before the chunk ({longest} <= {chunk})")
    if "slot_mapping" in inputs:   # kv_append by slot: the pages its tokens land on
        ps = int(opts.get("page_size") or 16)
        slots = np.asarray(inputs["slot_mapping"], np.int64)
        pages = len({int(s) // ps for s in slots if 0 <= s < dims["num_pages"] * ps})
        out.append(f"slots on {pages} pages" if pages > 1 else f"NOT pages crossed (slots on {pages} page)")
        out.append(f"{int((slots < 0).sum())} padding slots")
    elif "indices" in inputs:        # sparse top-k: the slots the tokens read
        ps = int(opts.get("page_size") or 16)
        idx = np.asarray(inputs["indices"], np.int64)
        inside = (idx >= 0) & (idx < dims["num_pages"] * ps)
        pages = len({int(s) // ps for s in idx[inside]})
        out.append(f"slots on {pages} pages" if pages > 1 else f"NOT pages crossed (slots on {pages} page)")
        out.append(f"{int((~inside).sum())} skipped slots (-1 or outside the cache)")
    elif opts.get("kv_layout") == "paged":
        ps = int(opts.get("page_size") or 16)
        out.append(f"pages crossed ({longest} rows, page_size {ps})" if longest > ps
                   else f"NOT pages crossed ({longest} <= page_size {ps})")
    if "num_splits" in art.meta.get("dims", ()):
        from .abi import EMU_NUM_SMS
        try:
            n = art.infer_dims(inputs, {}, EMU_NUM_SMS)["num_splits"]
            out.append(f"splits (num_splits={n})" if n > 1 else "NOT splits (num_splits=1)")
        except Exception:   # a description only: never fail a check over it
            pass
    if lens is not None and lens.size and int(lens.min()) == 0:
        out.append("empty sequence")
    for key in ("logits_soft_cap", "attention_sinks", "alibi", "rope", "append_kv"):
        if opts.get(key):
            out.append(key if opts[key] is True else f"{key}={opts[key]}")
    if opts.get("kv_dtype") in ("e4m3", "e5m2"):
        out.append(f"fp8 cache ({opts['kv_dtype']})")
    if "lse_a" in inputs and "lse_b" in inputs:   # merge_states: empty states (lse +-inf)
        empty = sum(int(np.isinf(np.asarray(inputs[t])).sum()) for t in ("lse_a", "lse_b"))
        out.append(f"{empty} empty states (lse +-inf)" if empty else "NOT empty states")
    return tuple(out)


@contextlib.contextmanager
def progress_notes(label: str, first: float = 10.0, every: float = 20.0):
    """A long emulation is not silent: after `first` seconds, and then every `every` seconds,
    one line on stderr says what is still running (short runs print nothing)."""
    import sys
    import threading
    done = threading.Event()
    t0 = time.perf_counter()

    def note():
        wait = first
        while not done.wait(wait):
            print(f"  still running {label} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
            wait = every
    thread = threading.Thread(target=note, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def launch_test(paths, *, backend: str = "auto", shapes: dict[str, int] | None = None,
                seed: int = 0, targets: list[str] | None = None) -> tuple[str, list[CheckRow]]:
    backend = resolve_backend(backend)
    device = None
    if backend == "cuda":
        from .cuda import CudaDevice
        device = CudaDevice.open()
    with tempfile.TemporaryDirectory(prefix="ptxc-launch-test-") as tmp:
        arts = artifacts_for(paths, Path(tmp), verify=backend == "cuda")
        rows = []
        for art in arts:
            rows += check_artifact(art, backend=backend, shapes=shapes or {}, seed=seed,
                                   targets=targets, device=device)
    return backend, rows


def parse_assignments(text_items, what: str, floats: bool = False) -> dict[str, int | float]:
    """`name=value[,name=value]` items -> dict (for --shape, and --set, whose runtime scalars
    such as k_scale=0.02 may be numbers: `floats`)."""
    out: dict[str, int | float] = {}
    for item in text_items:
        for part in filter(None, item.split(",")):
            name, sep, value = part.partition("=")
            try:
                if not sep:
                    raise ValueError
                out[name.strip()] = _number(value, floats)
            except ValueError:
                raise UserError(f"{what} {part!r}: expected name=" + ("number" if floats else "integer")) from None
            if out[name.strip()] < 0:
                raise UserError(f"{what} {part!r}: must not be negative")
            if isinstance(out[name.strip()], int) and out[name.strip()] > DIM_MAX:
                raise UserError(f"{what} {part!r}: must be below 2^31 (the kernels' 32-bit dims)")
    return out


def _number(text: str, floats: bool) -> int | float:
    try:
        return int(text)
    except ValueError:
        if not floats:
            raise
        value = float(text)
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(text) from None
        return value


def run_npz(artifact_dir: Path, inputs_path: Path, output_path: Path, *, target: str | None,
            backend: str, sets: dict[str, int], record_path: Path | None = None) -> dict[str, Any]:
    import numpy as np

    from ..files import atomic_write
    from .artifact import load
    art = load(artifact_dir)
    inputs = read_npz(inputs_path)
    backend = resolve_backend(backend)
    record = [] if record_path is not None else None
    outputs = art.run(inputs, target=target, backend=backend, sets=sets, record=record)
    if record_path is not None:
        import json
        atomic_write(record_path, (json.dumps({"artifact": art.name, "launches": record},
                                              indent=1, sort_keys=True) + "\n").encode())
    import io
    buf = io.BytesIO()
    np.savez(buf, **outputs)
    atomic_write(output_path, buf.getvalue())
    return {"backend": backend, "outputs": {k: list(v.shape) for k, v in outputs.items()}}


def read_npz(path: Path) -> dict:
    """The arrays of an .npz input file: a regular file, a valid zip whose members are .npy
    arrays (no pickles), and whose declared uncompressed size fits the run budget — so a
    truncated, empty, foreign or bomb-sized file is one InputError line."""
    import io
    import zipfile

    import numpy as np

    from ..files import read_regular_file
    from .abi import DEFAULT_MAX_RUN_BYTES
    from ..env import env_int
    limit = env_int("PTXC_MAX_RUN_BYTES", DEFAULT_MAX_RUN_BYTES)
    try:
        raw = read_regular_file(Path(path), limit)
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror or e}); --inputs takes a regular .npz file") from None
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as z:
            declared = sum(i.file_size for i in z.infolist())
        if declared > limit:
            raise InputError(f"{path}: arrays would take {declared / 2**30:.1f} GiB uncompressed "
                             f"(limit {limit / 2**30:.1f} GiB; PTXC_MAX_RUN_BYTES raises it)")
        with np.load(io.BytesIO(raw), allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}
    except InputError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError, MemoryError) as e:
        raise InputError(f"{path}: cannot read as .npz ({type(e).__name__}: {str(e)[:120]})") from None


__all__ = ["launch_test", "run_npz", "parse_assignments", "TOLERANCE_RULE", "CheckRow"]
