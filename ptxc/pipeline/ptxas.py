"""ptxas: locate it, run it on PTX text, and parse the resources it reports.

Located by `PTXAS=/path` or `cuda.pathfinder.find_nvidia_binary_utility("ptxas")` (which looks in
CUDA_HOME, the nvidia-cuda-nvcc wheel, then PATH) — never by a hand-written search.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

from ..errors import AssemblyError, ToolchainError

INSTALL_HINT = "install it with `pip install nvidia-cuda-nvcc` (or `make build`), or set PTXAS=/path/to/ptxas"
PTXAS_OPTIONS = ("-v", "--warn-on-spills", "-O3")


@dataclass(frozen=True)
class Resources:
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack: int = 0
    shared_bytes: int = 0
    constant_bytes: int = 0
    barriers: int = 0
    # ptxas's C75xx "Potential Performance Loss" notes for the entry: wgmma serialised (every
    # one waits for the last), setmaxnreg ignored (every warp at the entry count) -- plans the
    # kernel was not written without, which ptxas drops and still succeeds. Kept out of the
    # metadata while 0, so that artifacts without one read the same.
    performance_notes: int = 0

    def to_dict(self) -> dict:
        d = asdict(self)
        if not d["performance_notes"]:
            del d["performance_notes"]
        return d


@dataclass(frozen=True)
class Toolchain:
    path: str
    version: str   # "13.5.37"

    @property
    def options(self) -> tuple[str, ...]:
        return PTXAS_OPTIONS


def find_nvidia_tool(tool: str, env_var: str, hint: str, error: type[Exception] = ToolchainError) -> str:
    """`$env_var` if set (must be executable), else cuda.pathfinder's lookup (CUDA_HOME, the
    nvidia-* pip wheels, PATH); anything else raises `error` with `hint`."""
    from ..env import env_path
    override = env_path(env_var)
    if override:
        if not (Path(override).is_file() and os.access(override, os.X_OK)):
            raise error(f"{env_var}={override} is not an executable file; {hint}")
        return override
    try:
        from cuda.pathfinder import find_nvidia_binary_utility
    except ImportError:
        raise error(f"cuda-pathfinder is not installed, so {tool} cannot be located; {hint}") from None
    found = find_nvidia_binary_utility(tool)
    if not found:
        raise error(f"{tool} not found; {hint}")
    return str(found)


def find_ptxas() -> str:
    return find_nvidia_tool("ptxas", "PTXAS", INSTALL_HINT)


@lru_cache(maxsize=4)
def _toolchain_at(path: str) -> Toolchain:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except OSError as e:
        raise ToolchainError(f"cannot run ptxas at {path}: {e.strerror}; {INSTALL_HINT}") from None
    except subprocess.TimeoutExpired:
        raise ToolchainError(f"ptxas at {path} did not answer `--version` within 60 s") from None
    m = re.search(r"release [\d.]+, V([\d.]+)", out.stdout)
    if out.returncode != 0 or not m:
        first = (out.stderr or out.stdout).strip().splitlines()[:1]
        raise ToolchainError(f"ptxas at {path} is broken: `--version` exited {out.returncode}"
                             f"{': ' + first[0] if first else ''}; {INSTALL_HINT}")
    return Toolchain(path, m.group(1))


def toolchain() -> Toolchain:
    return _toolchain_at(find_ptxas())


_RES = {
    "registers": re.compile(r"Used (\d+) registers"),
    "barriers": re.compile(r"used (\d+) barriers"),
    "shared_bytes": re.compile(r"(\d+) bytes smem"),
    "constant_bytes": re.compile(r"(\d+) bytes cmem\[0\]"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


_PERFORMANCE_NOTE = re.compile(r"\((C75\d\d)\) Potential Performance Loss: (.*?)\.?(?: in the "
                               r"function '([\w$]+)'.*)?$")
_COMPILING = re.compile(r"Compiling entry function '([\w$]+)'")


def performance_notes(log: str) -> dict[str, list[str]]:
    """Entry -> ptxas's performance-loss notes ("C7514: wgmma.mma_async instructions are
    serialized due to ...", "C7508: 'setmaxnreg' ignored; ..."): the entry a note names, else
    the one being compiled (the last "Compiling entry function" before it), else every entry
    of the log ('' in the result)."""
    out: dict[str, list[str]] = {}
    current = ""
    for line in log.splitlines():
        if (c := _COMPILING.search(line)):
            current = c.group(1)
        elif (m := _PERFORMANCE_NOTE.search(line)):
            out.setdefault(m.group(3) or current, []).append(f"{m.group(1)}: {m.group(2)}")
    return out


def parse_resources(stderr: str) -> dict[str, Resources]:
    """Per entry function, the resources in `ptxas -v` output."""
    found: dict[str, dict[str, int]] = {}
    notes = performance_notes(stderr)
    current = None
    for line in stderr.splitlines():
        m = re.search(r"(?:Compiling entry function|Function properties for) '?([\w$]+)'?", line)
        if m:
            current = m.group(1)
            found.setdefault(current, {})
            continue
        if current is None:
            continue
        for key, rx in _RES.items():
            if (mm := rx.search(line)):
                found[current][key] = int(mm.group(1))
    for name, vals in found.items():
        n = len(notes.get(name, ())) + len(notes.get("", ()))
        if n:
            vals["performance_notes"] = n
    return {name: Resources(**vals) for name, vals in found.items()}


def assemble(ptx: str, target: str, tc: Toolchain, label: str) -> tuple[bytes, dict[str, Resources], str]:
    """Assemble PTX for `target`; returns (cubin, resources per entry, ptxas log).

    Raises AssemblyError with ptxas's message and the PTX line it names.
    """
    with tempfile.TemporaryDirectory(prefix="ptxc-ptxas-") as tmp:
        src, dst = Path(tmp, "kernel.ptx"), Path(tmp, "kernel.cubin")
        src.write_text(ptx)
        try:
            out = subprocess.run([tc.path, *tc.options, f"-arch={target}", str(src), "-o", str(dst)],
                                 capture_output=True, text=True, timeout=600)
        except OSError as e:
            raise ToolchainError(f"cannot run ptxas at {tc.path}: {e.strerror}") from None
        log = out.stderr + out.stdout
        if out.returncode != 0 or not dst.exists():
            _raise_toolchain_problem(log, out.returncode, tc, target)
            raise AssemblyError(_explain_failure(log, ptx, label, target, out.returncode))
        return dst.read_bytes(), parse_resources(log), log


_TOO_OLD = re.compile(r"Unsupported \.version ([\d.]+); current version is '([\d.]+)'")


def _raise_toolchain_problem(log: str, rc: int, tc: Toolchain, target: str) -> None:
    """Failures that are the toolchain's, not the PTX's: one line, exit code 2."""
    if rc < 0 or (rc > 128 and "error" not in log and "fatal" not in log):
        raise ToolchainError(f"ptxas {tc.version} at {tc.path} crashed (exit {rc}) on {target}; "
                             f"reinstall it ({INSTALL_HINT})")
    m = _TOO_OLD.search(log)
    if m:
        raise ToolchainError(f"ptxas {tc.version} at {tc.path} is too old: ptxc emits PTX ISA "
                             f"{m.group(1)} for {target}, this ptxas reads up to {m.group(2)}; "
                             f"install a newer one (pip install -U nvidia-cuda-nvcc) or set PTXAS=")
    if re.search(r"is not defined for option 'gpu-name'|Unknown target", log):
        raise ToolchainError(f"ptxas {tc.version} at {tc.path} does not support {target}: "
                             f"{log.strip().splitlines()[0] if log.strip() else 'no message'}")


def _explain_failure(log: str, ptx: str, label: str, target: str, rc: int) -> str:
    lines = ptx.splitlines()
    msgs = [l.strip() for l in log.splitlines() if "error" in l or "fatal" in l] or \
        [f"ptxas exited {rc} with no message"]
    text = f"{label} [{target}]: ptxas rejected the PTX:\n  " + "\n  ".join(msgs[:8])
    m = re.search(r"line (\d+)", msgs[0])
    if m and 0 < int(m.group(1)) <= len(lines):
        text += f"\n  PTX line {m.group(1)}: {lines[int(m.group(1)) - 1].strip()}"
    return text
