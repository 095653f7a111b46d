"""FlashInfer's CUDA kernels compiled here, without a GPU: the headers come from its wheel (a zip
of Python and CUDA sources; nothing is imported or installed), the drivers
bench/peers/flashinfer_{decode,prefill}.cu instantiate one kernel template each, and nvcc (the
nvidia-cuda-nvcc wheel, or NVCC=/path) compiles them to a cubin per target with the flags
FlashInfer's JIT uses (flashinfer/jit/cpp_ext.py: -O3 -use_fast_math, its vendored CCCL first).
Cubins are cached under the work directory by a hash of everything that determines them."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_WHEEL = Path("/tmp/fi/flashinfer_python-0.7.2.post1-py3-none-any.whl")
DRIVERS = {"decode": HERE / "flashinfer_decode.cu", "prefill": HERE / "flashinfer_prefill.cu",
           "prefill_fa3": HERE / "flashinfer_prefill_sm90.cu"}
# flashinfer/data/... members the drivers need: its headers, the CCCL and CUTLASS it vendors
_MEMBERS = ("include/", "cccl/cub/cub/", "cccl/libcudacxx/include/", "cccl/thrust/thrust/",
            "cutlass/include/", "cutlass/tools/util/include/")
FLAGS = ("-std=c++17", "-O3", "-DNDEBUG", "-use_fast_math", "--expt-relaxed-constexpr",
         "-DFLASHINFER_ENABLE_F16", "-DFLASHINFER_ENABLE_BF16", "-DFLASHINFER_ENABLE_FP8_E4M3",
         "-DFLASHINFER_ENABLE_FP8_E5M2", "-diag-suppress", "177")


class Unavailable(Exception):
    """Why FlashInfer's kernels cannot be compiled here (printed as one line)."""


def find_nvcc() -> str:
    if os.environ.get("NVCC"):
        if not os.access(os.environ["NVCC"], os.X_OK):
            raise Unavailable(f"NVCC={os.environ['NVCC']} is not an executable")
        return os.environ["NVCC"]
    if cand := shutil.which("nvcc"):
        return cand
    for inc in _nvidia_includes():
        if (inc.parent / "bin" / "nvcc").exists():
            return str(inc.parent / "bin" / "nvcc")
    raise Unavailable("nvcc not found (install nvidia-cuda-nvcc, or set NVCC=/path)")


def _nvidia_includes() -> list[Path]:
    spec = importlib.util.find_spec("nvidia")
    return [inc for root in ((spec.submodule_search_locations or []) if spec else [])
            for inc in sorted(Path(root).glob("cu*/include"))]


def find_curand() -> Path:
    """The directory with curand_kernel.h: the FA3 prefill includes CUTLASS's utility headers,
    which include it (FlashInfer's JIT finds it in the CUDA toolkit). CURAND_INCLUDE=/dir, the
    nvidia-curand wheel, or /usr/local/cuda/include."""
    cands = [Path(os.environ["CURAND_INCLUDE"])] if os.environ.get("CURAND_INCLUDE") else []
    cands += _nvidia_includes() + [Path("/usr/local/cuda/include")]
    for c in cands:
        if (c / "curand_kernel.h").exists():
            return c
    raise Unavailable("curand_kernel.h not found for the FA3 prefill (its CUTLASS utility headers"
                      " include it): set CURAND_INCLUDE to the include directory of the"
                      " nvidia-curand wheel (`pip download nvidia-curand --no-deps`)")


def find_source(given: str | None) -> Path:
    """The wheel (or an extracted flashinfer/data directory): the argument, FLASHINFER_WHEEL,
    an installed flashinfer package's data directory, or /tmp/fi's wheel."""
    cands = [given, os.environ.get("FLASHINFER_WHEEL")]
    spec = importlib.util.find_spec("flashinfer")   # located, not imported (it needs torch)
    if spec and spec.submodule_search_locations:
        cands.append(str(Path(next(iter(spec.submodule_search_locations))) / "data"))
    cands.append(str(DEFAULT_WHEEL))
    for c in filter(None, cands):
        p = Path(c)
        if p.is_file() and p.suffix == ".whl" or (p / "include" / "flashinfer").is_dir():
            return p
        if c in (given, os.environ.get("FLASHINFER_WHEEL")):
            raise Unavailable(f"{c}: not a flashinfer wheel or flashinfer/data directory")
    raise Unavailable(f"flashinfer wheel not found (pass --flashinfer WHEEL or set FLASHINFER_WHEEL;"
                      f" `pip download flashinfer-python==0.7.2.post1 --no-deps` fetches it)")


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    if path.is_file():
        h.update(path.read_bytes())
    else:
        h.update(str(path.resolve()).encode())
    return h.hexdigest()


def data_dir(source: Path, work: Path) -> tuple[Path, str]:
    """(flashinfer/data directory with the headers, the source's version tag), extracting the
    needed members of a wheel once into the work directory."""
    if not source.is_file():
        return source, source.parent.name
    tag = _digest(source)[:12] + hashlib.sha256(repr(_MEMBERS).encode()).hexdigest()[:4]
    out = work / f"flashinfer-{tag}"
    if not (out / ".complete").exists():
        with zipfile.ZipFile(source) as z:
            for name in z.namelist():
                rel = name.removeprefix("flashinfer/data/")
                if rel != name and rel.startswith(_MEMBERS) and not name.endswith("/"):
                    z.extract(name, out / "x")
        (out / ".complete").write_text(source.name)
    return out / "x" / "flashinfer" / "data", source.name


def compile_kernel(kind: str, arch: str, source: Path, work: Path) -> dict:
    """{"cubin": bytes, "entry": mangled name, "ptxas": its `Used N registers` line} for one
    driver and target (sm_80 -> -arch=sm_80), cached."""
    nvcc = find_nvcc()
    data, version = data_dir(source, work)
    inc = [f"-I{data / 'cccl/cub'}", f"-I{data / 'cccl/libcudacxx/include'}",
           f"-I{data / 'cccl/thrust'}", f"-I{data / 'include'}"]
    nvcc_inc = Path(nvcc).resolve().parent.parent / "include"
    if (nvcc_inc / "cuda_runtime.h").exists():
        inc += ["-isystem", str(nvcc_inc)]
    if kind == "prefill_fa3":
        inc += [f"-I{data / 'cutlass/include'}", f"-I{data / 'cutlass/tools/util/include'}",
                "-isystem", str(find_curand())]
    driver = DRIVERS[kind]
    key = hashlib.sha256(repr((driver.read_bytes(), version, _digest(source), FLAGS, arch,
                               _digest(Path(nvcc)))).encode()).hexdigest()[:24]
    cubin = work / f"flashinfer-{kind}-{arch}-{key}.cubin"
    log = cubin.with_suffix(".log")
    if not cubin.exists():
        r = subprocess.run([nvcc, f"-arch={arch}", "-cubin", *FLAGS, *inc, "--resource-usage",
                            str(driver), "-o", str(cubin.with_suffix(".tmp"))],
                           capture_output=True, text=True)
        if r.returncode:
            first = next((ln for ln in r.stderr.splitlines() if "error" in ln), r.stderr.strip()[:200])
            raise Unavailable(f"nvcc failed on {driver.name} for {arch}: {first}")
        log.write_text(r.stdout + r.stderr)
        cubin.with_suffix(".tmp").rename(cubin)
    text = log.read_text()
    entry = re.search(r"Compiling entry function '(\w+)'", text)
    used = re.search(r"ptxas info\s*: (Used \d+ registers[^\n]*)", text)
    return {"cubin": cubin.read_bytes(), "entry": entry.group(1) if entry else None,
            "ptxas": used.group(1) if used else None, "version": version}
