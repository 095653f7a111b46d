"""The machine constants of the launch model's sub-partition simulation (ptxc/report/issue_sim.py),
measured on the device: per instruction kind, the latency of a dependent chain and the issue
interval of independent work, plus the load latency from L2 and from DRAM.

    python bench/microbench.py [--json OUT]     # on a GPU: ~10 s
    python bench/microbench.py --dry DIR        # here: write every kernel's PTX to DIR, assemble
                                                # it for sm_90 and check in the SASS that every
                                                # timed copy is there

Each measurement is one hand-written PTX kernel of one CTA: every warp reads %clock64, runs an
unrolled body (`REPEAT` copies), reads %clock64 again and stores the difference (and a value
computed from the body, so nothing is dead code). Clocks per instruction = (the body's clocks
- the empty body's) / REPEAT / instructions per copy; the slowest warp's figure is reported.
  latency       one warp, each instruction depends on the previous one's result
  interval      one warp, 8 independent chains interleaved (the unit's issue interval for
                a warp alone); with `warps` > 1, one warp per sub-partition or more, which
                shows the pipe a sub-partition's warps share
  ld.global     a pointer chase (each load's address is the previous load's value) through
                random 128-byte lines of 2 MiB, which a first pass leaves in L2, and of 256 MiB
                (DRAM: the warm-up pass reads other lines)
The issue_sim table it checks: LATENCY / INTERVAL, L2_HIT_CLOCKS, and the calibrated DRAM
latency (calibration.H100_MMA_SYNC.dram_latency_ns at the clock of the GPU's row). Nothing
here is fitted: the figures are printed with the table's value beside them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

REPEAT = 256
CHAINS = 8


@dataclass(frozen=True)
class Micro:
    name: str           # "fp32 latency"
    unit: str           # the issue_sim unit it measures ("fp32", "hmma", "ldg_wide", ...)
    kind: str           # "latency" | "interval"
    setup: str          # PTX before the first clock read (registers, shared memory)
    body: str           # one copy of the timed body; {k} is the chain index for "interval"
    per_copy: int = 1   # instructions of the measured kind in one copy of the body
    warps: int = 1
    sink: str = "%f0"   # a register the body writes, stored so the chain is live
    chase: int = 0      # bytes of the pointer-chase buffer (0: none)
    target: str = "sm_80"   # the PTX target (the FP8 cvt needs sm_89)
    live: tuple[str, ...] = ()  # registers folded into `sink` after the clock: every chain stays live


F_REGS = ".reg .f32 %f<64>;\n.reg .b32 %r<64>;\n.reg .b64 %rd<16>;\n.reg .pred %p<4>;\n"
# Every operand starts from %r62, a small number ptxas cannot know (the buffer address's low bits
# plus the lane): constant inputs would be folded away, and identical chains merged
SEED = "cvt.u32.u64 %r62, %rd1;\nand.b32 %r62, %r62, 7;\nmov.u32 %r63, %tid.x;\nadd.u32 %r62, %r62, %r63;\n"
INIT_F = SEED + "".join(f"add.u32 %r61, %r62, {i};\ncvt.rn.f32.u32 %f{i}, %r61;\n"
                        f"mul.f32 %f{i}, %f{i}, 0f3C23D70A;\n" for i in range(40))     # x 0.01
INIT_R = SEED + "".join(f"add.u32 %r{i}, %r62, {i};\n" for i in range(40))
# The ldmatrix chains read rows of zeros below 4096 (each adds a loaded 0 to its address); the
# ld.shared chase's words, each holding its own address, sit above them: an address word among
# the rows made the ldsm chains walk out of the window (CUDA_ERROR_ILLEGAL_ADDRESS on the H200).
# Every warp zeroes the same bytes, so the address words are stored after a barrier.
SHARED = (".shared .align 16 .b8 smem[8192];\n"
          "mov.u32 %r40, smem;\nmov.u32 %r41, %tid.x;\nand.b32 %r41, %r41, 31;\n"
          "shl.b32 %r42, %r41, 8;\nadd.u32 %r43, %r40, %r42;\n"      # this lane's 256 bytes: zeros
          + "".join(f"st.shared.v4.u32 [%r43+{16 * i}], {{0, 0, 0, 0}};\n" for i in range(16))
          + "bar.sync 0;\nshl.b32 %r42, %r41, 4;\nadd.u32 %r43, %r40, %r42;\n"  # a row per lane
          "add.u32 %r44, %r43, 4096;\nst.shared.u32 [%r44], %r44;\nbar.sync 0;\n"
          + "".join(f"add.u32 %r{45 + k}, %r43, {512 * k};\n" for k in range(8)))
# ldmatrix k (x4) into %r4k..%r4k+3 from chain k's rows, then the next address += a loaded 0:
# chains the loads so identical ones cannot be merged (one IADD per LDSM rides along)
LDSM = ("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{%r{a},%r{b},%r{c},%r{d}}}, [%r{addr}];\n"
        "add.u32 %r{addr}, %r{addr}, %r{a};\n")
MMA = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{%f{a},%f{b},%f{c},%f{d}}}, "
       "{{%r0,%r1,%r2,%r3}}, {{%r4,%r5}}, {{%f{a},%f{b},%f{c},%f{d}}};\n")


def _mma(k: int) -> str:
    return MMA.format(a=4 * k, b=4 * k + 1, c=4 * k + 2, d=4 * k + 3)


def _ldsm(k: int) -> str:
    return LDSM.format(a=4 * k, b=4 * k + 1, c=4 * k + 2, d=4 * k + 3, addr=45 + k)


F8 = tuple(f"%f{k}" for k in range(1, CHAINS))
R8 = tuple(f"%r{k}" for k in range(1, CHAINS))


def _micros() -> list[Micro]:
    lat, ind = "latency", "interval"
    out = [
        Micro("empty", "-", lat, "", ""),
        Micro("fp32 latency", "fp32", lat, INIT_F, "fma.rn.f32 %f0, %f0, %f1, %f2;\n"),
        Micro("fp32 interval", "fp32", ind, INIT_F, "fma.rn.f32 %f{k}, %f{k}, %f20, %f21;\n", live=F8),
        Micro("int latency", "int", lat, INIT_R, "mad.lo.u32 %r0, %r0, %r1, %r2;\n", sink="%r0"),
        Micro("int interval", "int", ind, INIT_R, "mad.lo.u32 %r{k}, %r{k}, %r20, %r21;\n", sink="%r0",
              live=R8),
        Micro("mufu latency", "mufu", lat, INIT_F, "ex2.approx.f32 %f0, %f0;\n"),
        Micro("mufu interval", "mufu", ind, INIT_F, "ex2.approx.f32 %f{k}, %f{k};\n", live=F8),
        Micro("shfl latency", "shfl", lat, INIT_R, "shfl.sync.bfly.b32 %r0, %r0, 1, 31, -1;\n", sink="%r0"),
        Micro("shfl interval", "shfl", ind, INIT_R, "shfl.sync.bfly.b32 %r{k}, %r{k}, 1, 31, -1;\n",
              sink="%r0", live=R8),
        Micro("cvt e4m3x2 (+ unpack) latency", "pack", lat, INIT_R,
              "cvt.rn.f16x2.e4m3x2 %r0, %rs0;\nmov.b32 {%rs0, %rs1}, %r0;\n", sink="%r0", target="sm_89"),
        Micro("lds latency", "lds", lat, SHARED, "ld.shared.u32 %r44, [%r44];\n", sink="%r44"),
        Micro("ldsm (+ iadd) latency", "ldsm", lat, SHARED, _ldsm(0), sink="%r45"),
        Micro("ldsm (+ iadd) interval", "ldsm", ind, SHARED, "{ldsm}", sink="%r45",
              live=tuple(f"%r{45 + k}" for k in range(1, CHAINS))),
        Micro("hmma latency", "hmma", lat, INIT_F + INIT_R, _mma(0)),
        Micro("hmma interval", "hmma", ind, INIT_F + INIT_R, "{mma}",
              live=tuple(f"%f{k}" for k in range(1, 4 * CHAINS))),
        Micro("ld.global L2 latency", "ldg_index", lat, "", "ld.global.cg.u64 %rd1, [%rd1];\n",
              sink="%rd1", chase=2 << 20),
        Micro("ld.global DRAM latency", "ldg_wide", lat, "", "ld.global.cg.u64 %rd1, [%rd1];\n",
              sink="%rd1", chase=256 << 20),
    ]
    # the shared pipes: one warp per sub-partition (4) and two (8), independent work
    for unit, name in (("hmma", "hmma interval"), ("ldsm", "ldsm (+ iadd) interval"), ("mufu", "mufu interval")):
        base = next(m for m in out if m.name == name)
        out += [Micro(f"{name}, {w} warps", unit, ind, base.setup, base.body, warps=w, sink=base.sink,
                      target=base.target, live=base.live) for w in (4, 8)]
    return out


MICROS = _micros()


def _body(m: Micro) -> str:
    if m.kind == "latency":
        return m.body
    copies = []
    for k in range(CHAINS):
        if m.body == "{mma}":
            copies.append(_mma(k))
        elif m.body == "{ldsm}":
            copies.append(_ldsm(k))
        else:
            copies.append(m.body.format(k=k))
    return "".join(copies)


def per_copy(m: Micro) -> int:
    return m.per_copy * (CHAINS if m.kind == "interval" else 1)


def ptx(m: Micro) -> str:
    """The kernel of one measurement: params (out: u64 pointer, buf: u64 pointer)."""
    sink_store = {"%f": "st.global.f32", "%r": "st.global.u32", "%rd": "st.global.u64"}
    prefix = "%rd" if m.sink.startswith("%rd") else m.sink[:2]
    body = _body(m) * REPEAT
    op = {"%f": "add.f32", "%r": "add.u32", "%rd": "add.u64"}[prefix]
    fold = "".join(f"{op} {m.sink}, {m.sink}, {r};\n" for r in m.live)
    return f""".version 8.1
.target {m.target}
.address_size 64
.visible .entry micro(.param .u64 out, .param .u64 buf)
{{
{F_REGS}.reg .b16 %rs<4>;
ld.param.u64 %rd10, [out];
ld.param.u64 %rd1, [buf];
mov.b16 %rs0, 0x3C38;
{m.setup}mov.u32 %r60, %tid.x;
shr.u32 %r61, %r60, 5;
mul.wide.u32 %rd11, %r61, 16;
add.u64 %rd12, %rd10, %rd11;
mov.u64 %rd13, %clock64;
{body}mov.u64 %rd14, %clock64;
sub.u64 %rd15, %rd14, %rd13;
{fold}st.global.u64 [%rd12], %rd15;
{sink_store[prefix]} [%rd12+8], {m.sink};
ret;
}}
"""


# the SASS opcode each unit's instruction becomes (the --dry check counts them)
SASS_OF = {"fp32": "FFMA", "int": "IMAD", "mufu": "MUFU", "shfl": "SHFL", "pack": "F2FP", "lds": "LDS",
           "ldsm": "LDSM", "hmma": "HMMA", "ldg_index": "LDG", "ldg_wide": "LDG"}


def assemble(m: Micro, arch: str, tool: str, where: Path) -> Path:
    """ptxas the kernel for `arch` (its PTX target or a later one); the cubin's path."""
    src = where / f"{''.join(c if c.isalnum() else '_' for c in m.name)}.ptx"
    src.write_text(ptx(m))
    cubin = src.with_suffix(f".{arch}.cubin")
    res = subprocess.run([tool, f"-arch={arch}", "-o", str(cubin), str(src)], capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"microbench: ptxas -arch={arch} refused {m.name!r}: {res.stderr.strip()[:300]}")
    return cubin


def timed_count(m: Micro, sass: str) -> int:
    """Instructions of the measured kind between the two clock reads of the kernel's SASS: ptxas
    must have kept every copy (no constant folding, no merged chains)."""
    from ptxc.report.sass_instr import parse_functions
    [(instrs, _)] = parse_functions(sass).values()
    clocks = [n for n, i in enumerate(instrs) if "SR_CLOCK" in i.operands]
    return sum(i.base == SASS_OF.get(m.unit) for i in instrs[clocks[0]:clocks[-1]])


def chase_buffer(nbytes: int, address: int, seed: int = 1):
    """u64 words: at the start of every 128-byte line, the absolute address of the next line of
    one random cycle through all lines (so every load misses the line before); with two starts
    half the cycle apart (a warm-up pass from the second leaves the first's lines cold)."""
    import numpy as np
    lines = nbytes // 128
    order = np.random.default_rng(seed).permutation(lines)
    words = np.zeros(nbytes // 8, dtype=np.uint64)
    nxt = np.roll(order, -1)
    words[order * 16] = np.uint64(address) + nxt.astype(np.uint64) * np.uint64(128)
    return words, address + int(order[0]) * 128, address + int(order[lines // 2]) * 128


def run_on_device(micros: list[Micro]) -> list[dict]:
    import ctypes

    import numpy as np

    from ptxc.runtime.cuda import CudaDevice, _check, _driver
    drv = _driver()
    dev = CudaDevice.open()
    out = []
    for m in micros:
        module = _check(drv.cuModuleLoadData(ptx(m).encode() + b"\0"), f"cuModuleLoadData({m.name})")
        fn = _check(drv.cuModuleGetFunction(module, b"micro"), "cuModuleGetFunction")
        res = np.zeros(2 * m.warps, dtype=np.uint64)
        d_out = _check(drv.cuMemAlloc(res.nbytes), "cuMemAlloc")
        d_buf = _check(drv.cuMemAlloc(max(8, m.chase)), "cuMemAlloc")
        start = warm = int(d_buf)
        if m.chase:
            words, start, far = chase_buffer(m.chase, int(d_buf))
            _check(drv.cuMemcpyHtoD(d_buf, words.ctypes.data, words.nbytes), "cuMemcpyHtoD")
            warm = start if m.unit == "ldg_index" else far     # L2: the same lines; DRAM: others
        for first in (warm, start):   # the first pass warms the instruction cache (L2: the lines)
            args = [ctypes.c_uint64(int(d_out)), ctypes.c_uint64(first)]
            ptrs = (ctypes.c_void_p * 2)(*[ctypes.addressof(a) for a in args])
            _check(drv.cuLaunchKernel(fn, 1, 1, 1, 32 * m.warps, 1, 1, 0, 0, ctypes.addressof(ptrs), 0),
                   f"cuLaunchKernel({m.name})")
            _check(drv.cuCtxSynchronize(), "cuCtxSynchronize")
        _check(drv.cuMemcpyDtoH(res.ctypes.data, d_out, res.nbytes), "cuMemcpyDtoH")
        drv.cuMemFree(d_out)
        drv.cuMemFree(d_buf)
        drv.cuModuleUnload(module)
        out.append({"name": m.name, "unit": m.unit, "kind": m.kind, "warps": m.warps,
                    "clocks": int(res[0::2].max())})
    empty = next(r["clocks"] for r in out if r["name"] == "empty")
    for r, m in zip(out, micros):
        r["per_instruction"] = round((r["clocks"] - empty) / REPEAT / per_copy(m), 2)
    return [{**r, "device": dev.name} for r in out]


def table(rows: list[dict]) -> str:
    from ptxc.report.gpus import match_device
    from ptxc.report.issue_sim import INTERVAL, L2_HIT_CLOCKS, LATENCY
    from ptxc.report.calibration import H100_MMA_SYNC
    from ptxc.report.launch_model import tensor_clocks_per_flop
    gpu = match_device(rows[0]["device"]) if rows else None
    clock = gpu.clock_mhz * 1e6 if gpu else None
    model = {"ldg_index": L2_HIT_CLOCKS,
             "ldg_wide": H100_MMA_SYNC.dram_latency_ns * 1e-9 * clock if gpu else None,
             # the HMMA pipe at the calibrated share of the peak: one m16n8k16 (4096 FLOPs)
             "hmma interval": 4096 * tensor_clocks_per_flop(gpu, H100_MMA_SYNC) if gpu else None}
    # with w warps the figure is a warp's: a pipe the sub-partition's warps share shows as
    # about w / 4 times the interval
    lines = ["| measurement | warps | clocks per instruction | issue_sim's |", "|---|---:|---:|---:|"]
    for r in rows:
        if r["unit"] == "-":
            continue
        ours = model.get(f"{r['unit']} {r['kind']}") or model.get(r["unit"]) \
            or (LATENCY if r["kind"] == "latency" else INTERVAL).get(r["unit"])
        lines.append(f"| {r['name']} | {r['warps']} | {r['per_instruction']} | "
                     f"{'-' if ours is None else round(ours, 1)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry", type=Path, help="write the PTX here and assemble it (no GPU)")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON")
    a = ap.parse_args(argv)
    if a.dry:
        from ptxc.pipeline.ptxas import find_ptxas
        a.dry.mkdir(parents=True, exist_ok=True)
        tool = find_ptxas()
        from ptxc.report.sass import disassembly_text, find_nvdisasm
        for m in MICROS:
            cubin = assemble(m, "sm_90", tool, a.dry)
            got = timed_count(m, disassembly_text(find_nvdisasm(), cubin.read_bytes()))
            if m.unit in SASS_OF and got != REPEAT * per_copy(m):
                raise SystemExit(f"microbench: {m.name!r} times {got} {SASS_OF[m.unit]}, "
                                 f"not {REPEAT * per_copy(m)}: ptxas folded or merged its body")
        print(f"microbench: {len(MICROS)} kernels assembled for sm_90 in {a.dry}, every timed copy kept")
        return 0
    rows = run_on_device(MICROS)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"{rows[0]['device']}:\n{table(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
