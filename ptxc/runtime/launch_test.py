"""`ptxc launch-test` and `ptxc run`: random inputs (or given ones), the artifact's whole launch
list on a backend, and a comparison with the fp64 reference under the tolerance rule."""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InputError, UserError
from .reference import TOLERANCE_RULE, max_abs_error, tolerance


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

    @property
    def ok(self) -> bool:
        return self.max_error <= self.tol

    def to_dict(self) -> dict[str, Any]:
        return {"kernel": self.kernel, "target": self.target, "backend": self.backend,
                "shape": self.shape, "tensor": self.tensor, "max_error": self.max_error,
                "tolerance": self.tol, "pass": self.ok, "seconds": round(self.seconds, 3),
                "device_ms": self.ms}


def resolve_backend(backend: str) -> str:
    if backend != "auto":
        return backend
    from .cuda import available
    return "cuda" if available() else "emu"


def artifacts_for(paths, workdir: Path, verify: bool) -> list:
    """Artifact objects for artifact dirs, output dirs, or spec files (built into workdir)."""
    from ..pipeline.build import run_build
    from . import load
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
    from ..spec.model import KernelSpec
    spec = KernelSpec.from_dict(art.meta["spec"])
    family = FAMILIES[spec.family]
    dims = {**family.interface(spec).defaults, **shapes}
    unknown = set(shapes) - set(art.meta["dims"])
    if unknown:
        raise InputError(f"{art.name}: --shape {', '.join(sorted(unknown))}: not a dimension "
                         f"(dims: {', '.join(art.meta['dims'])})")
    rng = np.random.default_rng(seed)
    inputs = family.make_inputs(spec, dims, rng)
    ref = family.reference(spec, inputs)
    naive = family.reference(spec, inputs, dtype=spec.dtype)
    shape = ",".join(f"{k}={v}" for k, v in sorted(dims.items()))
    rows = []
    for target in targets or sorted(art.meta["targets"]):
        if target not in art.meta["targets"]:
            raise InputError(f"{art.name}: not built for {target}")
        t0 = time.perf_counter()
        if device is not None:
            device.last_ms.clear()
        out = art.run(inputs, target=target, backend=backend, device=device)
        secs = time.perf_counter() - t0
        ms = sum(device.last_ms) if device is not None and device.last_ms else None
        for name in sorted(ref):
            rows.append(CheckRow(art.name, target, backend, shape, name,
                                 max_abs_error(out[name], ref[name]), tolerance(naive[name], ref[name]),
                                 secs, ms))
    return rows


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
            backend: str, sets: dict[str, int]) -> dict[str, Any]:
    import numpy as np

    from ..pipeline.cache import atomic_write
    from . import load
    art = load(artifact_dir)
    try:
        with np.load(inputs_path, allow_pickle=False) as npz:
            inputs = {k: npz[k] for k in npz.files}
    except (OSError, ValueError) as e:
        raise InputError(f"{inputs_path}: cannot read as .npz ({e})") from None
    backend = resolve_backend(backend)
    outputs = art.run(inputs, target=target, backend=backend, sets=sets)
    import io
    buf = io.BytesIO()
    np.savez(buf, **outputs)
    atomic_write(output_path, buf.getvalue())
    return {"backend": backend, "outputs": {k: list(v.shape) for k, v in outputs.items()}}


__all__ = ["launch_test", "run_npz", "parse_assignments", "TOLERANCE_RULE", "CheckRow"]
