"""The C header compiles (C and C++) against the CUDA driver headers from the pip wheels, and
its structs have exactly the metadata ABI's offsets and sizes."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import SPECS
from ptxc.pipeline.build import run_build
from ptxc.emit.cheader import emit


def cuda_include() -> Path | None:
    try:
        import nvidia
    except ImportError:
        return None
    for root in map(Path, nvidia.__path__):
        for header in sorted(root.glob("*/include/cuda.h")):
            return header.parent
    return None


@pytest.fixture(scope="module")
def artifact_set(tmp_path_factory):
    out = tmp_path_factory.mktemp("hdr")
    run_build([SPECS], out, verify=False, progress=False)
    return out, emit(out)


def test_header_matches_abi_when_compiled(artifact_set, tmp_path):
    inc = cuda_include()
    if inc is None or shutil.which("gcc") is None:
        pytest.skip("needs gcc and cuda.h from the nvidia-cuda-runtime wheel (installed by `make test`)")
    out, header = artifact_set
    checks = []
    expected = []
    for meta_path in sorted(out.glob("*/*.json")):
        meta = json.loads(meta_path.read_text())
        _, t = sorted(meta["targets"].items())[0]
        for k in t["kernels"]:
            cname = k["entry"].removeprefix("ptxc_")
            for p in k["params"]:
                checks.append(f'printf("%zu %zu\\n", offsetof(ptxc_{cname}_params_t, {p["name"]}), '
                              f'sizeof(((ptxc_{cname}_params_t*)0)->{p["name"]}));')
                expected.append(f"{p['offset']} {p['size']}")
            checks.append(f"{{ ptxc_{meta['name']}_dims_t d = {{0}}; unsigned g[3], b[3]; "
                          + "".join(f"d.{dim} = 5; " for dim in meta["dims"])
                          + f"ptxc_{cname}_geometry(&d, g, b); printf(\"%u %u %u %u\\n\", g[0], g[1], g[2], b[0]); }}")
            from ptxc.runtime import launch_geometry
            grid, block = launch_geometry(k, {d: 5 for d in meta["dims"]})
            expected.append(f"{grid[0]} {grid[1]} {grid[2]} {block[0]}")
    src = tmp_path / "main.c"
    src.write_text(f'#include <stdio.h>\n#include "{header}"\nint main(void) {{\n' + "\n".join(checks) + "\nreturn 0;\n}\n")
    exe = tmp_path / "abi"
    subprocess.run(["gcc", "-std=c11", "-Wall", "-Werror", f"-I{inc}", str(src), "-o", str(exe)], check=True,
                   capture_output=True, text=True)
    lines = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split("\n")
    assert lines[:-1] == expected
    if shutil.which("g++"):
        cpp = tmp_path / "main.cpp"
        cpp.write_text(f'#include "{header}"\nint main() {{ return 0; }}\n')
        subprocess.run(["g++", "-std=c++17", "-Wall", "-Werror", f"-I{inc}", "-fsyntax-only", str(cpp)],
                       check=True, capture_output=True, text=True)


def test_header_is_deterministic(artifact_set):
    out, header = artifact_set
    before = header.read_bytes()
    emit(out)
    assert header.read_bytes() == before and b"PTXC_KERNELS_H" in before
