"""Helpers for the emulator tests: ptxas validation of every test kernel, and a generator for
element-wise kernels (thread i loads inputs[i], runs a body, stores outputs[i])."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from ptxc.emu import launch


def find_ptxas() -> str | None:
    """ptxas from $PTXAS, PATH or the nvidia-cuda-nvcc wheel; None when there is none."""
    cand = os.environ.get("PTXAS") or shutil.which("ptxas")
    if cand and os.access(cand, os.X_OK):
        return cand
    try:
        import nvidia
        for root in nvidia.__path__:
            for p in sorted(Path(root).glob("cu*/bin/ptxas")):
                return str(p)
    except ImportError:
        pass
    return None


PTXAS = find_ptxas()


@functools.lru_cache(maxsize=None)
def ptxas_errors(ptx: str) -> str | None:
    """None if ptxas accepts the module (or ptxas is missing), else its message."""
    if PTXAS is None:
        return None
    target = re.search(r"\.target\s+(sm_\w+)", ptx)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        r = subprocess.run([PTXAS, f"-arch={target.group(1) if target else 'sm_80'}", f.name,
                            "-o", os.devnull], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    return None if r.returncode == 0 else r.stdout + r.stderr


def assert_assembles(ptx: str):
    err = ptxas_errors(ptx)
    assert err is None, f"ptxas rejects the test kernel:\n{err}"


def run(ptx: str, entry: str, grid, block, args, dynamic_smem_bytes: int = 0, **kw):
    """Launch after checking that ptxas accepts the PTX. Without ptxas the check is skipped
    (the emulator tests still run: ptxas only guards the test kernels' legality)."""
    assert_assembles(ptx)
    return launch(ptx, entry, grid, block, args, dynamic_smem_bytes, **kw)


def line_of(ptx: str, needle: str) -> int:
    """1-based number of the first line of `ptx` containing `needle`."""
    for i, line in enumerate(ptx.splitlines(), 1):
        if needle in line:
            return i
    raise AssertionError(f"{needle!r} not in the kernel")


HEADER = ".version 7.8\n.target sm_80\n.address_size 64\n"

_REG_CLASS = {"pred": "pred", "f32": "f32", "f64": "f64", "f16": "b16", "bf16": "b16"}
_NP = {"u8": np.uint8, "s8": np.int8, "u16": np.uint16, "s16": np.int16, "b16": np.uint16,
       "f16": np.uint16, "bf16": np.uint16, "u32": np.uint32, "s32": np.int32,
       "b32": np.uint32, "f32": np.float32, "u64": np.uint64, "s64": np.int64,
       "b64": np.uint64, "f64": np.float64, "pred": np.uint8}


def reg_class(t: str) -> str:
    if t in _REG_CLASS:
        return _REG_CLASS[t]
    return f"b{int(t[1:])}" if int(t[1:]) >= 16 else "b16"


def ew_kernel(name: str, inputs, outputs, body: str, extra_regs: str = "",
              version: str = "7.8", target: str = "sm_80") -> str:
    """PTX for: i = global thread index; %<in> = in[i]; body; out[i] = %<out>.

    inputs/outputs: lists of (register name without %, ptx type). Predicates travel as u8."""
    params = [f"\t.param .u64 p_{n}" for n, _ in inputs + outputs]
    header = HEADER.replace("7.8", version).replace("sm_80", target)
    lines = [header, f".visible .entry {name}(", ",\n".join(params), ")", "{",
             "\t.reg .b32 %ew_i<3>;", "\t.reg .b64 %ew_a<4>;", "\t.reg .b16 %ew_h;"]
    for n, t in inputs + outputs:
        lines.append(f"\t.reg .{reg_class(t)} %{n};")
    lines.append(extra_regs)
    lines += ["\tmov.u32 %ew_i0, %tid.x;", "\tmov.u32 %ew_i1, %ctaid.x;",
              "\tmov.u32 %ew_i2, %ntid.x;", "\tmad.lo.s32 %ew_i0, %ew_i1, %ew_i2, %ew_i0;"]

    def addr(n, t):
        size = np.dtype(_NP[t]).itemsize
        return [f"\tld.param.u64 %ew_a0, [p_{n}];", "\tcvta.to.global.u64 %ew_a0, %ew_a0;",
                f"\tmul.wide.u32 %ew_a1, %ew_i0, {size};", "\tadd.s64 %ew_a2, %ew_a0, %ew_a1;"]
    for n, t in inputs:
        lines += addr(n, t)
        if t == "pred":
            lines += ["\tld.global.u8 %ew_h, [%ew_a2];", f"\tsetp.ne.u16 %{n}, %ew_h, 0;"]
        else:
            lt = "b16" if t in ("f16", "bf16") else t
            lines.append(f"\tld.global.{lt} %{n}, [%ew_a2];")
    lines.append(body)
    for n, t in outputs:
        lines += addr(n, t)
        if t == "pred":
            lines += [f"\tselp.u16 %ew_h, 1, 0, %{n};", "\tst.global.u8 [%ew_a2], %ew_h;"]
        else:
            lt = "b16" if t in ("f16", "bf16") else t
            lines.append(f"\tst.global.{lt} [%ew_a2], %{n};")
    lines += ["\tret;", "}", ""]
    return "\n".join(lines)


def run_ew(ptx: str, name: str, inputs: list, out_types: list, block: int = 64):
    """Launch an ew_kernel on equal-length inputs (padded to whole blocks); return outputs."""
    n = len(inputs[0]) if inputs else block
    padded = -(-n // block) * block
    args = []
    for a in inputs:
        a = np.asarray(a)
        pad = np.zeros(padded, a.dtype)
        pad[:n] = a
        args.append(pad)
    outs = [np.zeros(padded, _NP[t]) for t in out_types]
    run(ptx, name, (padded // block,), (block,), args + outs)
    return [o[:n] for o in outs]


# ----------------------------------------------------------------------------- exact reference

FORMATS = {"f16": (11, -14, 15), "bf16": (8, -126, 127), "f32": (24, -126, 127),
           "f64": (53, -1022, 1023)}


def ref_round(x, mode: str, fmt: str) -> float:
    """Correctly round the exact rational `x` (a Fraction) to format `fmt` in `mode`
    ('rn' ties-to-even, 'rz', 'rm', 'rp'); returns a Python float (+-inf on overflow).
    Written from the IEEE 754 definition, independently of ptxc.emu.fp."""
    from fractions import Fraction
    import math
    p, emin, emax = FORMATS[fmt]
    if x == 0:
        return 0.0
    sign = -1 if x < 0 else 1
    a = abs(Fraction(x))
    e = a.numerator.bit_length() - a.denominator.bit_length()
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    q = max(e, emin) - (p - 1)
    scaled = a / Fraction(2) ** q
    fl = scaled.numerator // scaled.denominator
    rem = scaled - fl
    if mode == "rn":
        up = rem > Fraction(1, 2) or (rem == Fraction(1, 2) and fl % 2 == 1)
    elif mode == "rz":
        up = False
    elif mode == "rm":
        up = sign < 0 and rem > 0
    elif mode == "rp":
        up = sign > 0 and rem > 0
    else:
        raise ValueError(mode)
    mag = (fl + int(up)) * Fraction(2) ** q
    max_finite = (2 - Fraction(2) ** (1 - p)) * Fraction(2) ** emax
    if mag > max_finite:
        to_inf = mode == "rn" or (mode == "rm" and sign < 0) or (mode == "rp" and sign > 0)
        return sign * (math.inf if to_inf else float(max_finite))
    return float(sign * mag) if mag else math.copysign(0.0, sign)
