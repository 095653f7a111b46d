"""The C header for every shipped spec compiles warning-free as C11 and C++17 against the CUDA
driver headers from the pip wheels, and is deterministic; headers of several build directories
compile together in one translation unit, and those that cannot meet stop with one #error.
(tests/loaders/test_loader_c.py runs it.)"""

import re
import shutil
from pathlib import Path
import subprocess

import pytest

from conftest import SPECS, require_rustc
from stubcuda import harness
from stubcuda.harness import cuda_include
from ptxc.emit.cheader import default_prefix, emit, render
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
    assert header.read_bytes() == before
    assert re.search(rb"#ifndef (PTXC_KERNELS_[0-9A-F]{16}_H) .*\n#define \1\n", before)


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


DECODE = '''
[[kernel]]
name = "{name}"
family = "decode"
dtype = "f16"
targets = ["sm_80"]
head_dim = {head_dim}
num_heads = 4
num_kv_heads = 2
'''
PREFILL = '''
[[kernel]]
name = "pre_bf16"
family = "prefill"
dtype = "bf16"
targets = ["sm_80"]
head_dim = 64
num_heads = 4
causal = true

[[kernel]]
name = "pre_f16"
family = "prefill"
dtype = "f16"
targets = ["sm_80"]
head_dim = 64
num_heads = 4
causal = true
'''


@pytest.fixture(scope="module")
def build_dirs(tmp_path_factory):
    """Headers of four build directories (PTX only): a decode kernel `dec`, two prefill kernels
    (emitted with --prefix prefill), another build of `dec` (head_dim 128) and `dec_graph` (whose
    run is dec's graph_run)."""
    root = tmp_path_factory.mktemp("two_headers")
    headers = {}
    for name, text, prefix in [("decode", DECODE.format(name="dec", head_dim=64), None),
                               ("prefill", PREFILL, "prefill"),
                               ("decode_d128", DECODE.format(name="dec", head_dim=128), None),
                               ("decode_graph", DECODE.format(name="dec_graph", head_dim=64), None)]:
        (root / f"{name}.toml").write_text(text)
        run_build([root / f"{name}.toml"], root / name, verify=False, progress=False)
        headers[name] = emit(root / name, prefix=prefix)
    return headers


def _compile(tmp_path, compiler, std, suffix, body):
    """Compile `body` (-fsyntax-only, warnings as errors); the CompletedProcess."""
    inc = cuda_include()
    if inc is None or shutil.which(compiler) is None:
        pytest.skip("needs gcc/g++ and cuda.h from the nvidia-cuda-runtime wheel (installed by `make test`)")
    src = tmp_path / f"main.{suffix}"
    src.write_text(body)
    return subprocess.run([compiler, f"-std={std}", "-Wall", "-Wextra", "-Werror", f"-I{inc}", "-fsyntax-only", str(src)],
                          capture_output=True, text=True)


@pytest.mark.parametrize("compiler,std,suffix", [("gcc", "c11", "c"), ("g++", "c++17", "cpp")])
def test_headers_of_two_build_dirs_compile_together(build_dirs, tmp_path, compiler, std, suffix):
    """One translation unit includes the headers of two build directories (each twice): every
    artifact's functions are declared, the shared types once, each header's variant lookup under
    its own prefix (the default one derived from its artifact names), each over its own table."""
    if harness.toolchain_missing():
        pytest.skip(harness.toolchain_missing())
    dec, pre = build_dirs["decode"], build_dirs["prefill"]
    p = default_prefix(["dec"])
    src = (f'#include <stdio.h>\n#include <string.h>\n'
           f'#include "{dec}"\n#include "{pre}"\n#include "{dec}"\n#include "{pre}"\n'
           'int main(int argc, char **argv) {\n'
           '    CUdevice dev = 0; ptxc_loader_t L; char e[4096]; (void)argc;\n'
           '    CUresult r = ptxc_dec_load(&L, dev, argv[1]);\n'
           '    ptxc_pre_f16_dims_t d; ptxc_pre_f16_tensors_t t; memset(&d, 0, sizeof d);\n'
           '    ptxc_pre_f16_packed_strides(&t, &d); (void)ptxc_pre_bf16_run;\n'
           f'    int i = ptxc_{p}_find_variant("family=decode", e, sizeof e);\n'
           f'    printf("%d %d %s\\n", (int)r, PTXC_{p.upper()}_NUM_VARIANTS, i >= 0 ? ptxc_{p}_variant_names[i] : e);\n'
           '    i = ptxc_prefill_find_variant("dtype=f16", e, sizeof e);\n'
           '    printf("%d %s\\n", PTXC_PREFILL_NUM_VARIANTS, i >= 0 ? ptxc_prefill_variant_names[i] : e);\n'
           '    i = ptxc_prefill_find_variant("family=decode", e, sizeof e);\n'
           '    printf("%s\\n", e);\n    return 0;\n}\n')
    stub = harness.build_stub(tmp_path / "stub")
    lines = harness.compile_and_run(src, tmp_path, stub, cxx=suffix == "cpp", args=[str(dec.parent / "dec")],
                                    env={"PTXC_STUB_SM": "80"}).splitlines()
    assert lines[:2] == ["0 1 dec", "2 pre_f16"]
    assert lines[2].startswith("not built: family=decode; built variants are pre_bf16: family=prefill,dtype=bf16,")


@pytest.mark.parametrize("compiler,std,suffix", [("gcc", "c11", "c"), ("g++", "c++17", "cpp")])
def test_the_same_header_twice_is_one(build_dirs, tmp_path, compiler, std, suffix):
    """Included twice, a header is included once: the single-header names (ptxc_find_variant,
    ptxc_variant_names, PTXC_NUM_VARIANTS) stay its own."""
    dec = build_dirs["decode"]
    r = _compile(tmp_path, compiler, std, suffix,
                 f'#include "{dec}"\n#include "{dec}"\n'
                 'int main(void) {\n    char e[256];\n'
                 '    int i = ptxc_find_variant("family=decode", e, sizeof e);\n'
                 '    return i >= 0 && i < PTXC_NUM_VARIANTS ? (int)ptxc_variant_names[i][0] : 1;\n}\n')
    assert r.returncode == 0, r.stderr


def _abi(text: str) -> str:
    return re.search(r"#define PTXC_LOADER_ABI (0x[0-9A-F]{8})", text).group(1)


@pytest.mark.parametrize("case", ["same_artifact", "graph_names", "graph_names_reversed", "other_loader_code",
                                  "old_header", "unprefixed_lookup"])
def test_headers_that_cannot_meet_fail_with_one_clear_error(build_dirs, tmp_path, case):
    """Two headers defining one artifact name, artifacts of two headers whose identifiers collide
    (in either order), headers whose shared code differs (another ptxc), a header of the old
    single guard, and the single-header lookup name with two headers included: a compile error
    that says so, not a wall of redefinitions."""
    dec, pre, dec128 = build_dirs["decode"], build_dirs["prefill"], build_dirs["decode_d128"]
    main = "int main(void) { return 0; }\n"
    if case == "same_artifact":
        body, want = [dec, pre, dec128], '#error "ptxc: artifact dec is defined by two included headers'
    elif case.startswith("graph_names"):
        body = [dec, build_dirs["decode_graph"]][::-1 if case.endswith("reversed") else 1]
        first, second = ("dec", "dec_graph") if case.endswith("reversed") else ("dec_graph", "dec")
        want = (f'#error "ptxc: artifacts {first} and {second} (of two included headers) both generate the C '
                f'identifier ptxc_dec_graph_run: rename one"')
    elif case == "other_loader_code":   # another ptxc's shared code: another ABI hash
        text = dec128.read_text().replace(_abi(dec128.read_text()), "0x00000001")
        text = text.replace("#define PTXC_MAX_RANK 8", "#define PTXC_MAX_RANK 9")
        (tmp_path / "other.h").write_text(text.replace("ptxc_fail(ptxc_loader_t *L,", "ptxc_fail(ptxc_loader_t *L, int x,"))
        body, want = [pre, tmp_path / "other.h"], ('#error "ptxc: another included ptxc header has different shared '
                                                   'loader code (PTXC_LOADER_ABI): regenerate every header')
    elif case == "old_header":   # what a header of the single guard leaves defined
        body, want = ["#define PTXC_KERNELS_H", dec], ('#error "ptxc: a header generated by an older ptxc (guard '
                                                       'PTXC_KERNELS_H) is included')
    else:
        body, want = [dec, pre], "ptxc_find_variant__several_ptxc_headers__use_ptxc_PREFIX_find_variant"
        main = 'int main(void) {\n    char e[64];\n    return ptxc_find_variant("family=decode", e, sizeof e);\n}\n'
    body = "".join(f'#include "{h}"\n' if isinstance(h, Path) else h + "\n" for h in body) + main
    r = _compile(tmp_path, "gcc", "c11", "c", body)
    assert r.returncode != 0 and want in r.stderr, r.stderr
    assert r.stderr.count("error:") == 1 + (case == "same_artifact"), r.stderr   # and its variant table's


def test_prefix_names_the_variant_lookup(build_dirs, tmp_path):
    """--prefix must be a lowercase C identifier (one line, exit 2, nothing written); without it
    the header's prefix is derived from its artifact names, the same for every build of them."""
    from click.testing import CliRunner
    from ptxc.cli import main
    out = build_dirs["decode"].parent
    r = CliRunner().invoke(main, ["emit-c-header", str(out), "-o", str(tmp_path / "k.h"), "--prefix", "Decode-1"])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "--prefix 'Decode-1'" in r.output, r.output
    assert not (tmp_path / "k.h").exists()
    other = render(build_dirs["decode_d128"].parent)
    assert f"ptxc_{default_prefix(['dec'])}_find_variant(" in other
    assert _abi(other) == _abi(build_dirs["decode"].read_text())   # one ptxc: one shared code
    assert re.search(r"#ifndef (PTXC_KERNELS_\w+_H)", other).group(1) not in build_dirs["decode"].read_text()
