"""The C header for every shipped spec compiles warning-free as C11 and C++17 against the CUDA
driver headers from the pip wheels, and is deterministic. (tests/test_loader_c.py runs it.)"""

import shutil
import subprocess

import pytest

from conftest import SPECS
from stubcuda.harness import cuda_include
from ptxc.emit.cheader import emit
from ptxc.pipeline.build import run_build


@pytest.fixture(scope="module")
def artifact_set(tmp_path_factory):
    out = tmp_path_factory.mktemp("hdr")
    run_build([SPECS], out, verify=False, progress=False)
    return out, emit(out)


@pytest.mark.parametrize("compiler,std,suffix", [("gcc", "c11", "c"), ("g++", "c++17", "cpp")])
def test_header_compiles_warning_free(artifact_set, tmp_path, compiler, std, suffix):
    inc = cuda_include()
    if inc is None or shutil.which(compiler) is None:
        pytest.skip("needs gcc/g++ and cuda.h from the nvidia-cuda-runtime wheel (installed by `make test`)")
    _, header = artifact_set
    src = tmp_path / f"main.{suffix}"
    src.write_text(f'#include "{header}"\nint main(void) {{ return 0; }}\n')
    subprocess.run([compiler, f"-std={std}", "-Wall", "-Wextra", "-Werror", f"-I{inc}", "-fsyntax-only", str(src)],
                   check=True, capture_output=True, text=True)


def test_header_is_deterministic(artifact_set):
    out, header = artifact_set
    before = header.read_bytes()
    emit(out)
    assert header.read_bytes() == before and b"PTXC_KERNELS_H" in before
