"""Peer compilers for the emulator's cross-check suite: Triton (pinned in the `test` extra) and
nvcc from the nvidia-cuda-nvcc wheel (with the CCCL headers of nvidia-cuda-cccl). Compiled PTX
is cached by a content hash of everything that determines it, for the whole test session."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

# Triton 3.9's default (FP fusion on), pinned for every peer that compiles with it -- the PTX the
# tests read stays the same when 3.10 flips the default, and 3.9 stops warning about it
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

_CACHE: dict = {}


def cached(key_parts, build):
    """build() once per session for the same key (a sha256 of key_parts)."""
    key = hashlib.sha256(repr(key_parts).encode()).hexdigest()
    if key not in _CACHE:
        _CACHE[key] = build()
    return _CACHE[key]


# ----------------------------------------------------------------------------- nvcc

def _nvidia_roots():
    try:
        import nvidia
        return [Path(p) for p in nvidia.__path__]
    except ImportError:
        return []


def find_nvcc():
    cand = os.environ.get("NVCC") or shutil.which("nvcc")
    if cand:
        return cand
    for root in _nvidia_roots():
        for p in sorted(root.glob("cu*/bin/nvcc")):
            return str(p)
    return None


def cccl_includes():
    """-I flags for CCCL (nv/target, cuda/std): the wheels keep it beside the CUDA headers."""
    flags = []
    for root in _nvidia_roots():
        for inc in sorted(root.glob("cu*/include")):
            if (inc / "nv" / "target").exists():
                flags.append(f"-I{inc}")
            if (inc / "cccl" / "nv" / "target").exists():
                flags.append(f"-I{inc / 'cccl'}")
    return flags


@pytest.fixture(scope="session")
def nvcc_ptx():
    """nvcc_ptx(source, arch='sm_80') -> PTX text; skips when nvcc or CCCL are missing."""
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (install the `toolchain` extra: nvidia-cuda-nvcc)")
    includes = cccl_includes()

    def compile_ptx(source: str, arch: str = "sm_80") -> str:
        def build():
            with tempfile.TemporaryDirectory() as tmp:
                src, out = Path(tmp) / "k.cu", Path(tmp) / "k.ptx"
                src.write_text(source)
                r = subprocess.run([nvcc, f"-arch={arch}", "-ptx", "-O3", *includes, str(src),
                                    "-o", str(out)], capture_output=True, text=True)
                if r.returncode:
                    if "nv/target" in r.stderr and not includes:
                        pytest.skip("CCCL headers (nvidia-cuda-cccl) not installed")
                    raise AssertionError(f"nvcc failed:\n{r.stderr}")
                return out.read_text()
        return cached(("nvcc", nvcc, arch, includes, source), build)
    return compile_ptx


# ----------------------------------------------------------------------------- triton

@pytest.fixture(scope="session")
def triton_ptx():
    """triton_ptx(fn, signature, constexprs, num_warps, num_stages) -> (ptx, name, shared)."""
    triton = pytest.importorskip("triton", reason="triton not installed (the `test` extra)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def compile_ptx(fn, signature: dict, constexprs: dict, num_warps: int = 4,
                    num_stages: int = 2, arch: int = 80, divisible=()):
        # real launches specialise pointers (and ints) on divisibility by 16 (vector loads)
        attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(signature.items())
                 if t.startswith("*") or n in divisible}
        sig = {**signature, **{k: "constexpr" for k in constexprs}}

        def build():
            src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
            k = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                               options={"num_warps": num_warps, "num_stages": num_stages})
            return k.asm["ptx"], k.metadata.name, int(k.metadata.shared)
        return cached(("triton", triton.__version__, fn.src, sorted(sig.items()),
                       sorted(constexprs.items()), num_warps, num_stages, arch, tuple(divisible)),
                      build)
    return compile_ptx
