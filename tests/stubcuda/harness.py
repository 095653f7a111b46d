"""Run a generated loader for real against the stub libcuda, then replay what it launched in
ptxc.emu: each recorded launch's parameter bytes are decoded by the PTX entry's own parameter
layout (independently of the metadata the loader used), its pointers resolved into the recorded
device memory (pointer arrays become emulator pointer tables), and the launch list run in order on that
memory, so outputs come from exactly what the loader passed (grid, block, smem, parameters)."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

STUB_SOURCE = Path(__file__).with_name("libcuda_stub.c")
PTX_SCALAR = {"u32": np.uint32, "s32": np.int32, "u64": np.uint64, "s64": np.int64, "f32": np.float32,
              "b32": np.uint32, "b64": np.uint64}


def cuda_include() -> Path | None:
    try:
        import nvidia
    except ImportError:
        return None
    for root in map(Path, nvidia.__path__):
        for header in sorted(root.glob("*/include/cuda.h")):
            return header.parent
    return None


def build_stub(dest: Path) -> Path:
    """libcuda.so from the stub source, in `dest`; returns the directory to link against."""
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["gcc", "-std=c11", "-O1", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC",
                    f"-I{cuda_include()}", str(STUB_SOURCE), "-o", str(dest / "libcuda.so")],
                   check=True, capture_output=True, text=True)
    return dest


def toolchain_missing() -> str | None:
    if shutil.which("gcc") is None or shutil.which("g++") is None:
        return "needs gcc and g++"
    if cuda_include() is None:
        return "needs cuda.h from the nvidia-cuda-runtime wheel (installed by `make test`)"
    return None


@dataclass
class Launch:
    index: int
    function: int
    entry: str
    grid: tuple
    block: tuple
    smem: int
    params: bytes


@dataclass
class StubLog:
    modules: list = field(default_factory=list)        # (kind, image bytes)
    functions: dict = field(default_factory=dict)      # id -> (module, entry)
    attributes: list = field(default_factory=list)     # (function id, attribute, value)
    launches: list = field(default_factory=list)
    memory: dict = field(default_factory=dict)         # address -> uint8 array (at the first launch)


def read_log(log_dir: Path) -> StubLog:
    log = StubLog()
    events = (log_dir / "events.txt").read_text().splitlines() if (log_dir / "events.txt").exists() else []
    for line in events:
        f = line.split()
        if f[0] == "module":
            log.modules.append((f[2], (log_dir / f"module_{f[1]}.bin").read_bytes()))
        elif f[0] == "function":
            log.functions[int(f[1])] = (int(f[2]), f[3])
        elif f[0] == "func_attribute":
            log.attributes.append((int(f[1]), int(f[2]), int(f[3])))
        elif f[0] == "launch":
            n = int(f[1])
            log.launches.append(Launch(n, int(f[2]), f[3], tuple(map(int, f[4:7])), tuple(map(int, f[7:10])),
                                       int(f[10]), (log_dir / f"launch_{n}.params").read_bytes()))
    if log.launches:
        raw = (log_dir / "launch_0.mem").read_bytes()
        pos = 0
        while pos < len(raw):
            addr, size = np.frombuffer(raw[pos:pos + 16], np.uint64)
            pos += 16
            log.memory[int(addr)] = np.frombuffer(raw[pos:pos + int(size)], np.uint8).copy()
            pos += int(size)
    return log


def c_main(meta: dict, header: Path, shape_dims: dict[str, int], perturb: str = "", graph: bool = False) -> str:
    """A C program: load the artifact (argv[1]), read every non-workspace tensor's device bytes
    from argv[2], run the launch list, print what happened. `graph`: through the capture-safe
    entry, with `shape_dims` as the capture-time maxima."""
    A = meta["name"]
    lines = ["#include <stdio.h>", "#include <string.h>", f'#include "{header}"',
             "int main(int argc, char **argv) {",
             "    CUdevice dev; CUcontext ctx; ptxc_loader_t L; CUresult r; int sms = 0;",
             "    if (argc != 3) return 2;",
             "    cuInit(0); cuDeviceGet(&dev, 0); cuDevicePrimaryCtxRetain(&ctx, dev); cuCtxSetCurrent(ctx);",
             f"    r = ptxc_{A}_load(&L, dev, argv[1]);",
             '    printf("load %d %d %s|%s\\n", (int)r, L.target, r == CUDA_SUCCESS ? L.image_kind : "-", L.error);',
             "    if (r != CUDA_SUCCESS) return 0;",
             "    cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev);",
             f"    ptxc_{A}_dims_t d; memset(&d, 0, sizeof d);"]
    if graph:
        lines.append(f"    ptxc_{A}_dims_t max; memset(&max, 0, sizeof max);")
        lines += [f"    max.{k} = {v};" for k, v in shape_dims.items()]
        resolve = f"ptxc_{A}_graph_dims(&L, &max, sms, &d)"
    else:
        lines += [f"    d.{k} = {v};" for k, v in shape_dims.items()]
        resolve = f"ptxc_{A}_resolve_dims(&L, &d, sms)"
    lines.append(f"    if ((r = {resolve}) != CUDA_SUCCESS) {{ printf(\"dims %d %s\\n\", (int)r, L.error); return 0; }}")
    lines.append('    printf("dims' + "".join(f" {d}=%lld" for d in meta["dims"]) + '\\n"'
                 + "".join(f", (long long)d.{d}" for d in meta["dims"]) + ");")
    lines += [f"    ptxc_{A}_tensors_t t; memset(&t, 0, sizeof t);",
              '    FILE *in = fopen(argv[2], "rb");', "    if (!in) return 3;"]
    for name, info in meta["tensors"].items():
        if info["role"] == "workspace":
            continue
        lines.append(f"    {{ size_t n = ptxc_{A}_bytes_{name}(&d); void *h = malloc(n ? n : 1);\n"
                     f"      if (fread(h, 1, n, in) != n) {{ printf(\"short read {name}\\n\"); return 4; }}\n"
                     f"      if (n) {{ cuMemAlloc(&t.{name}.ptr, n); cuMemcpyHtoD(t.{name}.ptr, h, n); }} free(h); }}")
    lines += ["    { char extra; if (fread(&extra, 1, 1, in) != 0) { printf(\"input file too long\\n\"); return 4; } }",
              "    fclose(in);",
              f"    size_t ws = ptxc_{A}_workspace_bytes(&d);",
              f"    if (ws) {{ CUdeviceptr w; cuMemAlloc(&w, ws); ptxc_{A}_bind_workspace(&t, w, &d); }}",
              f"    ptxc_{A}_packed_strides(&t, &d);"]
    for name, info in meta["tensors"].items():
        if info.get("derived_from"):
            lines.append(f"    {{ size_t n = ptxc_{A}_bytes_{name}(&d); uint64_t *h = (uint64_t *)malloc(n ? n : 8);\n"
                         f"      ptxc_{A}_row_pointers_{name}(&t, &d, h); if (n) cuMemcpyHtoD(t.{name}.ptr, h, n); free(h); }}")
    lines += [f"    {perturb}",
              f"    r = ptxc_{A}_graph_run(&L, &max, sms, &t, NULL);" if graph else f"    r = ptxc_{A}_run(&L, &d, &t, NULL);",
              '    printf("run %d|%s\\n", (int)r, r == CUDA_SUCCESS ? "" : L.error);']
    lines += [f'    printf("tensor {name} %llu %zu\\n", (unsigned long long)t.{name}.ptr, ptxc_{A}_bytes_{name}(&d));'
              for name in meta["tensors"]]
    lines += ["    ptxc_unload(&L);", "    return 0;", "}"]
    return "\n".join(lines) + "\n"


def compile_and_run(src_text: str, workdir: Path, stub_dir: Path, *, cxx: bool, args: list[str],
                    env: dict[str, str]) -> str:
    workdir.mkdir(parents=True, exist_ok=True)
    src = workdir / ("main.cpp" if cxx else "main.c")
    src.write_text(src_text)
    exe = workdir / "main"
    cmd = (["g++", "-std=c++17"] if cxx else ["gcc", "-std=c11"]) + [
        "-Wall", "-Wextra", "-Werror", f"-I{cuda_include()}", str(src), "-o", str(exe),
        f"-L{stub_dir}", f"-Wl,-rpath,{stub_dir}", "-lcuda"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return run_program([str(exe), *args], workdir, env)


def run_program(cmd: list[str], workdir: Path, env: dict[str, str]) -> str:
    log = workdir / "log"
    shutil.rmtree(log, ignore_errors=True)
    log.mkdir()
    full_env = {**os.environ, "PTXC_STUB_LOG": str(log), **env}
    return subprocess.run(cmd, check=True, capture_output=True, text=True, env=full_env).stdout


def parse_output(stdout: str) -> dict:
    out = {"tensors": {}}
    for line in stdout.splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "load":
            code, target, kind_error = rest.split(" ", 2)
            image, _, error = kind_error.partition("|")
            out["load"] = (int(code), int(target), image, error)
        elif kind == "dims":
            out["dims"] = {k: int(v) for k, v in (item.split("=") for item in rest.split())}
        elif kind == "run":
            code, _, error = rest.partition("|")
            out["run"] = (int(code), error)
        elif kind == "tensor":
            name, addr, size = rest.split()
            out["tensors"][name] = (int(addr), int(size))
    return out


def launch_records(log: StubLog, meta: dict, target: str, tensors: dict) -> list:
    """What a captured graph would hold of each launch, independent of where the allocator put
    the buffers: entry, grid, block, shared memory, and each parameter by the metadata's ABI --
    a pointer as (tensor, byte offset), a tensor map as its tensor, the offset of its base and
    its other bytes, anything else as its bytes."""
    kernels = {k["entry"]: k for k in meta["targets"][target]["kernels"]}
    out = []
    for launch in log.launches:
        params = []
        for p in kernels[launch.entry]["params"]:
            raw = launch.params[p["offset"]:p["offset"] + p["size"]]
            if p["source"]["kind"] in ("pointer", "workspace"):
                addr = int.from_bytes(raw, "little")
                name = p["source"]["tensor"]
                params.append((p["name"], name, addr - tensors[name][0]))
            elif p["source"]["kind"] == "tensor_map":   # the emulator's layout: the address at 16
                addr = int.from_bytes(raw[16:24], "little")
                name = p["source"]["tensor"]
                params.append((p["name"], name, addr - tensors[name][0], (raw[:16] + raw[24:]).hex()))
            else:
                params.append((p["name"], raw.hex()))
        out.append((launch.entry, launch.grid, launch.block, launch.smem, params))
    return out


def replay(log: StubLog, meta: dict, target: str, ptx: str, tensors: dict) -> dict[int, np.ndarray]:
    """Run every recorded launch in the emulator on the recorded memory; returns the memory."""
    from ptxc import emu
    memory = {addr: arr.copy() for addr, arr in log.memory.items()}
    by_entry = {k["entry"]: k for k in meta["targets"][target]["kernels"]}
    starts = {addr: size for addr, size in tensors.values()}
    derived = {addr for name, (addr, _) in tensors.items() if meta["tensors"][name].get("derived_from")}

    def pointer_table(address: int):
        """A pointer array in stub memory -> an emulator PointerTable into the same allocations."""
        entries = []
        for value in view(address).view(np.uint64):
            base = next(b for b, arr in memory.items() if b <= int(value) < b + arr.size)
            entries.append((memory[base], int(value) - base))
        return emu.PointerTable(tuple(entries))

    def view(address: int) -> np.ndarray:
        for base, arr in memory.items():
            if base <= address < base + arr.size:
                size = starts.get(address, base + arr.size - address)
                return arr[address - base:address - base + size]
        raise AssertionError(f"launch passes {address:#x}, which is no device allocation")

    from ptxc.emu.op_table import decode_program
    for launch in log.launches:
        # decode the bytes by the PTX's own parameter layout, not the metadata the loader used
        env = decode_program(ptx, launch.entry).env
        assert len(launch.params) == env.param_bytes, (launch.entry, len(launch.params), env.param_bytes)
        kinds = {p["name"]: p["source"]["kind"] for p in by_entry[launch.entry]["params"]}
        args = []
        for name, (offset, ptype) in env.params.items():
            if kinds[name] == "tensor_map":   # the stub wrote the emulator's layout: rebase it
                raw = launch.params[offset:offset + 128]
                address = int(np.frombuffer(raw[16:24], np.uint64)[0])
                args.append(emu.StructArg(raw, {16: view(address)}))
                continue
            value = np.frombuffer(launch.params[offset:offset + ptype.nbytes], PTX_SCALAR[ptype.name])[0]
            if kinds[name] not in ("pointer", "workspace"):
                args.append(value)
            else:
                args.append(pointer_table(int(value)) if int(value) in derived else view(int(value)))
        if 0 not in launch.grid:
            emu.launch(ptx, launch.entry, launch.grid, launch.block, args, dynamic_smem_bytes=launch.smem)
    return memory


def read_tensor(memory: dict, address: int, size: int) -> np.ndarray:
    for base, arr in memory.items():
        if base <= address < base + arr.size:
            return arr[address - base:address - base + size]
    raise AssertionError(f"no allocation at {address:#x}")


def rust_main(meta: dict, module: Path, shape_dims: dict[str, int], perturb: str = "", graph: bool = False) -> str:
    """The Rust twin of c_main: the module's images are embedded, argv[1] is the inputs file."""
    A = meta["name"]
    dims_fmt = " ".join(f"{d}={{}}" for d in meta["dims"])
    lines = [f'#[path = "{module}"]', "mod kernels;", "use kernels::*;", "use std::ffi::c_void;",
             '#[link(name = "cuda")]', 'extern "C" {',
             "    fn cuInit(flags: u32) -> i32;", "    fn cuDeviceGet(d: *mut i32, ordinal: i32) -> i32;",
             "    fn cuDeviceGetAttribute(v: *mut i32, a: i32, d: i32) -> i32;",
             "    fn cuMemAlloc_v2(p: *mut u64, n: usize) -> i32;",
             "    fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, n: usize) -> i32;", "}",
             "fn main() {", "    let args: Vec<String> = std::env::args().collect();",
             "    let mut dev = 0;", "    unsafe { cuInit(0); cuDeviceGet(&mut dev, 0); }",
             f"    let kernel = match {A}::Kernel::load(dev) {{",
             '        Ok(k) => { println!("load 0 {} {}|", k.loaded.target, k.loaded.image_kind); k }',
             '        Err(e) => { println!("load {} -1 -|{}", e.code, e.message); return; }', "    };",
             "    let mut sms = 0;", "    unsafe { cuDeviceGetAttribute(&mut sms, 16, dev); }",
             f"    let mut d = {A}::Dims::default();"]
    lines += [f"    d.{k} = {v};" for k, v in shape_dims.items()]
    if graph:   # d holds the maxima; graph_dims gives the dims of the captured list
        lines += ["    let max = d;",
                  '    d = match kernel.graph_dims(&max, sms) { Ok(d) => d, Err(e) => { println!("dims {} {}", e.code, e.message); return; } };']
    lines += [f'    if let Err(e) = kernel.resolve_dims(&mut d, sms) {{ println!("dims {{}} {{}}", e.code, e.message); return; }}',
              f'    println!("dims {dims_fmt}", ' + ", ".join(f"d.{x}" for x in meta["dims"]) + ");",
              "    let data = std::fs::read(&args[1]).expect(\"inputs\");", "    let mut pos = 0usize;",
              f"    let mut t = {A}::Tensors::default();"]
    for name, info in meta["tensors"].items():
        if info["role"] != "workspace":
            lines.append(f"    {{ let n = {A}::bytes_{name}(&d); if n > 0 {{ unsafe {{ cuMemAlloc_v2(&mut t.{name}.ptr, n); "
                         f"cuMemcpyHtoD_v2(t.{name}.ptr, data[pos..pos + n].as_ptr() as *const c_void, n); }} }} pos += n; }}")
    lines += ["    assert_eq!(pos, data.len());",
              f"    let ws = {A}::workspace_bytes(&d);",
              f"    if ws > 0 {{ let mut w = 0u64; unsafe {{ cuMemAlloc_v2(&mut w, ws); }} {A}::bind_workspace(&mut t, w, &d); }}",
              f"    {A}::packed_strides(&mut t, &d);"]
    for name, info in meta["tensors"].items():
        if info.get("derived_from"):
            lines.append(f"    {{ let h = {A}::row_pointers_{name}(&t, &d); if !h.is_empty() {{ unsafe {{ "
                         f"cuMemcpyHtoD_v2(t.{name}.ptr, h.as_ptr() as *const c_void, h.len() * 8); }} }} }}")
    lines += [f"    {perturb}",
              f"    match kernel.graph_run(&max, sms, &t, std::ptr::null_mut()).map(|_| ()) {{" if graph else
              f"    match launch_{A}(&kernel, &d, &t, std::ptr::null_mut()) {{",
              '        Ok(()) => println!("run 0|"),', '        Err(e) => println!("run {}|{}", e.code, e.message),', "    }"]
    lines += [f'    println!("tensor {name} {{}} {{}}", t.{name}.ptr, {A}::bytes_{name}(&d));' for name in meta["tensors"]]
    lines.append("}")
    return "\n".join(lines) + "\n"


def compile_rust_and_run(src_text: str, workdir: Path, stub_dir: Path, *, args: list[str], env: dict[str, str]) -> str:
    workdir.mkdir(parents=True, exist_ok=True)
    src = workdir / "main.rs"
    src.write_text(src_text)
    exe = workdir / "main"
    subprocess.run(["rustc", "--edition", "2021", "-D", "warnings", "-C", "opt-level=0", "-L", str(stub_dir),
                    "-C", f"link-arg=-Wl,-rpath,{stub_dir}", str(src), "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    return run_program([str(exe), *args], workdir, env)
