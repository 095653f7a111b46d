"""The C header for every shipped spec compiles warning-free as C11 and C++17 against the CUDA
driver headers from the pip wheels, and is deterministic. (tests/loaders/test_loader_c.py runs it.)"""

import shutil
from pathlib import Path
import subprocess

import pytest

from conftest import SPECS, require_rustc
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


def _doc_block(lang: str, index: int = 0) -> str:
    text = (Path(__file__).resolve().parents[2] / "docs" / "loaders.md").read_text()
    return text.split(f"```{lang}\n")[index + 1].split("```", 1)[0]


@pytest.mark.parametrize("block", [0, 1], ids=["step", "graph_capture"])
@pytest.mark.parametrize("compiler,std,suffix", [("gcc", "c11", "c"), ("g++", "c++17", "cpp")])
def test_docs_c_example_compiles(artifact_set, tmp_path, compiler, std, suffix, block):
    inc = cuda_include()
    if inc is None or shutil.which(compiler) is None:
        pytest.skip("needs gcc/g++ and cuda.h")
    out, header = artifact_set
    src = tmp_path / f"example.{suffix}"
    src.write_text(_doc_block("c", block).replace('#include "ptxc_kernels.h"', f'#include "{header}"'))
    subprocess.run([compiler, f"-std={std}", "-Wall", "-Wextra", "-Werror", f"-I{inc}", "-fsyntax-only", str(src)],
                   check=True, capture_output=True, text=True)


@pytest.mark.parametrize("block", [0, 1], ids=["step", "graph_capture"])
def test_docs_rust_example_compiles(artifact_set, tmp_path, block):
    require_rustc()
    from ptxc.emit.rust import emit as emit_rust
    out, _ = artifact_set
    emit_rust(out, tmp_path / "ptxc_kernels.rs")
    (tmp_path / "lib.rs").write_text(_doc_block("rust", block))
    subprocess.run(["rustc", "--edition", "2021", "--crate-type", "lib", "--emit=metadata", "-D", "warnings",
                    "-o", str(tmp_path / "libexample.rmeta"), str(tmp_path / "lib.rs")],
                   check=True, capture_output=True, text=True)


def test_docs_python_example_runs(tmp_path, monkeypatch):
    out = tmp_path / "out"
    run_build([SPECS / "mha_d64_prefill.toml"], out, targets=["sm_80"], verify=False, progress=False)
    monkeypatch.chdir(tmp_path)
    exec(compile(_doc_block("python"), "docs/loaders.md", "exec"), {})
    compile(_doc_block("python", 1), "docs/loaders.md", "exec")   # the device example needs a GPU: syntax only
