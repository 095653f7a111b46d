"""SASS instruction mix of a cubin, from nvdisasm (the `nvidia-cuda-nvdisasm` wheel, or
NVDISASM=/path, or a CUDA toolkit found by cuda.pathfinder).

The counts are static (instructions in the code, not executed): enough to see whether the
tensor-core path is taken (HMMA), shared memory is read with ldmatrix (LDSM), global->shared
copies are asynchronous (LDGSTS), the softmax uses the fast exp2 (MUFU.EX2), and whether
registers spill to local memory (LDL/STL).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from functools import lru_cache
from pathlib import Path

# Column name -> predicate on the full opcode ("HMMA.16816.F32", "MUFU.EX2", ...).
MIX_CLASSES = {
    "HMMA": lambda op: op.split(".")[0] == "HMMA",
    "HGMMA": lambda op: op.split(".")[0] == "HGMMA",
    "LDSM": lambda op: op.split(".")[0] == "LDSM",
    "LDGSTS": lambda op: op.split(".")[0] == "LDGSTS",
    "MUFU.EX2": lambda op: op.startswith("MUFU.EX2"),
    "LDL": lambda op: op.split(".")[0] == "LDL",
    "STL": lambda op: op.split(".")[0] == "STL",
}
INSTALL_HINT = "pip install nvidia-cuda-nvdisasm (the `test` extra installs it), or set NVDISASM=/path"

_SECTION = re.compile(r"^\s*\.section\s+\.text\.([\w$]+)")
# "/*0140*/   @!P0 LDG.E R29, [R2.64] ;" -> "LDG.E" (an optional predicate guard first)
_INSTR = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")


class SassUnavailable(Exception):
    """Why no instruction mix can be given (shown as "SASS mix unavailable: <reason>")."""


@lru_cache(maxsize=1)
def find_nvdisasm() -> str:
    from ..pipeline.ptxas import find_nvidia_tool
    return find_nvidia_tool("nvdisasm", "NVDISASM", INSTALL_HINT, SassUnavailable)


def parse_disassembly(text: str) -> dict[str, Counter]:
    """Opcode counts per function from `nvdisasm -c` output."""
    out: dict[str, Counter] = {}
    current = None
    for line in text.splitlines():
        m = _SECTION.match(line)
        if m:
            current = out.setdefault(m.group(1), Counter())
            continue
        if current is not None and (m := _INSTR.match(line)):
            current[m.group(1)] += 1
    return out


def summarize(opcodes: Counter) -> dict[str, int]:
    mix = {name: sum(n for op, n in opcodes.items() if pred(op)) for name, pred in MIX_CLASSES.items()}
    mix["total"] = sum(opcodes.values())
    return mix


def instruction_mix(cubin: bytes, cache=None) -> dict[str, dict[str, int]]:
    """Per entry function: counts of the MIX_CLASSES and the total. Raises SassUnavailable.
    nvdisasm takes about half a second per cubin, so results are kept in the ptxc cache
    (stage "sass", keyed by the cubin's hash and the tool) when `cache` is given."""
    from ..pipeline.cache import canonical_json
    from ..files import sha256
    tool = find_nvdisasm()
    key = sha256(canonical_json({"stage": "sass", "v": 1, "cubin": sha256(cubin), "tool": tool,
                                 "classes": list(MIX_CLASSES)}))
    hit = cache.get_json("sass", key, lambda d: isinstance(d, dict)) if cache is not None else None
    if hit is not None:
        return hit
    mix = _disassemble(tool, cubin)
    if cache is not None:
        cache.put("sass", key, canonical_json(mix))
    return mix


def sass_profile(cubin: bytes, cache=None) -> dict[str, dict]:
    """Per entry function: {"mix": instruction_mix's counts, "loops": ptxc.report.loops'
    analysis (every loop's steady-state iteration, the main one's index)}, from one nvdisasm
    run, cached like instruction_mix."""
    import json

    from ..pipeline.cache import canonical_json
    from ..files import sha256
    from . import dependency, loops as loops_module, sass_instr
    tool = find_nvdisasm()
    # keyed by the analyser's own sources, so a changed analysis never reads a stale result
    analyser = sha256(b"".join(Path(m.__file__).read_bytes() for m in (sass_instr, dependency, loops_module)))
    key = sha256(canonical_json({"stage": "sass", "v": 2, "cubin": sha256(cubin), "tool": tool,
                                 "classes": list(MIX_CLASSES), "loops": analyser}))
    hit = cache.get("sass", key) if cache is not None else None
    if hit is not None:
        return json.loads(hit)
    text = disassembly_text(tool, cubin)
    loops = loops_module.analyze_disassembly(text)
    out = {fn: {"mix": summarize(ops), "loops": loops.get(fn, {"loops": [], "main": None})}
           for fn, ops in parse_disassembly(text).items()}
    if cache is not None:
        cache.put("sass", key, canonical_json(out))
    return out


def _disassemble(tool: str, cubin: bytes) -> dict[str, dict[str, int]]:
    text = disassembly_text(tool, cubin)
    return {fn: summarize(ops) for fn, ops in parse_disassembly(text).items()}


def disassembly_text(tool: str, cubin: bytes) -> str:
    """nvdisasm's text of a cubin (`tool`: find_nvdisasm()), for the loop analysis."""
    with tempfile.TemporaryDirectory(prefix="ptxc-sass-") as tmp:
        path = Path(tmp, "kernel.cubin")
        path.write_bytes(cubin)
        try:
            res = subprocess.run([tool, "-c", str(path)], capture_output=True, text=True, timeout=120)
        except OSError as e:
            raise SassUnavailable(f"cannot run nvdisasm at {tool}: {e.strerror}") from None
        except subprocess.TimeoutExpired:
            raise SassUnavailable(f"nvdisasm at {tool} took over 120 s") from None
    if res.returncode != 0:
        first = (res.stderr or res.stdout).strip().splitlines()[:1]
        raise SassUnavailable(f"nvdisasm exited {res.returncode}: {first[0] if first else 'no message'}")
    return res.stdout


__all__ = ["MIX_CLASSES", "SassUnavailable", "find_nvdisasm", "instruction_mix",
           "parse_disassembly", "sass_profile", "summarize"]
