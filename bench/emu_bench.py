"""Throughput benchmark of the PTX emulator (ptxc.emu).

    python bench/emu_bench.py [--iters N] [--repeat R]

`bench(ptx, entry, grid, block, args)` runs any kernel and returns its LaunchStats; the default
kernel is a hand-written decode-attention-like loop (vector loads, fma, shfl.sync.bfly
reductions, online-softmax max/ex2, a shared-memory round trip and bar.sync) so the numbers
reflect the instruction mix of ptxc's kernels.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ptxc.emu import LaunchStats, launch  # noqa: E402

DECODE_LIKE_PTX = r"""
.version 7.8
.target sm_80
.address_size 64

// Each thread streams 16-byte rows of K and V, one row per loop iteration: a dot product
// with its q slice, a warp-wide bfly reduction, an online-softmax update and an accumulate.
.visible .entry decode_like(
	.param .u64 k_ptr,
	.param .u64 v_ptr,
	.param .u64 out_ptr,
	.param .u32 n_iters,
	.param .f32 scale
)
{
	.reg .pred %p<4>;
	.reg .b32 %r<24>;
	.reg .b64 %rd<16>;
	.reg .f32 %f<48>;
	.shared .align 16 .b8 red_smem[512];

	ld.param.u64 %rd1, [k_ptr];
	ld.param.u64 %rd2, [v_ptr];
	ld.param.u64 %rd3, [out_ptr];
	ld.param.u32 %r1, [n_iters];
	ld.param.f32 %f1, [scale];
	cvta.to.global.u64 %rd1, %rd1;
	cvta.to.global.u64 %rd2, %rd2;
	cvta.to.global.u64 %rd3, %rd3;
	mov.u32 %r2, %tid.x;
	mov.u32 %r3, %ctaid.x;
	mov.u32 %r4, %ctaid.y;
	mov.u32 %r5, %nctaid.x;
	mad.lo.s32 %r6, %r4, %r5, %r3;          // linear CTA id
	shl.b32 %r7, %r6, 7;
	add.s32 %r8, %r7, %r2;                  // global thread id
	and.b32 %r9, %r2, 31;                   // lane
	mul.wide.u32 %rd4, %r9, 16;
	add.s64 %rd5, %rd1, %rd4;               // this lane's K column
	add.s64 %rd6, %rd2, %rd4;
	mov.u32 %r10, red_smem;
	shl.b32 %r11, %r2, 2;
	add.s32 %r12, %r10, %r11;
	mov.f32 %f2, 0f3F3B4A5C;                // q slice: 0.7316, 0.4187, -0.2093, 0.9981
	mov.f32 %f3, 0f3ED66CF4;
	mov.f32 %f4, 0fBE5652BD;
	mov.f32 %f5, 0f3F7F8A09;
	mov.f32 %f6, 0fFF800000;                // running max
	mov.f32 %f7, 0f00000000;                // running sum
	mov.f32 %f8, 0f00000000;                // accumulators
	mov.f32 %f9, 0f00000000;
	mov.f32 %f10, 0f00000000;
	mov.f32 %f11, 0f00000000;
	mov.u32 %r13, 0;
$L__loop:
	and.b32 %r14, %r13, 63;
	mul.wide.u32 %rd7, %r14, 512;
	add.s64 %rd8, %rd5, %rd7;
	add.s64 %rd9, %rd6, %rd7;
	ld.global.nc.v4.f32 {%f12, %f13, %f14, %f15}, [%rd8];
	ld.global.nc.v4.f32 {%f16, %f17, %f18, %f19}, [%rd9];
	mul.rn.f32 %f20, %f2, %f12;
	fma.rn.f32 %f20, %f3, %f13, %f20;
	fma.rn.f32 %f20, %f4, %f14, %f20;
	fma.rn.f32 %f20, %f5, %f15, %f20;
	mov.b32 %r15, %f20;
	shfl.sync.bfly.b32 %r16, %r15, 16, 31, -1;
	mov.b32 %f21, %r16;
	add.f32 %f20, %f20, %f21;
	mov.b32 %r15, %f20;
	shfl.sync.bfly.b32 %r16, %r15, 8, 31, -1;
	mov.b32 %f21, %r16;
	add.f32 %f20, %f20, %f21;
	mov.b32 %r15, %f20;
	shfl.sync.bfly.b32 %r16, %r15, 4, 31, -1;
	mov.b32 %f21, %r16;
	add.f32 %f20, %f20, %f21;
	mov.b32 %r15, %f20;
	shfl.sync.bfly.b32 %r16, %r15, 2, 31, -1;
	mov.b32 %f21, %r16;
	add.f32 %f20, %f20, %f21;
	mov.b32 %r15, %f20;
	shfl.sync.bfly.b32 %r16, %r15, 1, 31, -1;
	mov.b32 %f21, %r16;
	add.f32 %f20, %f20, %f21;
	mul.f32 %f22, %f20, %f1;                // logit * scale * log2(e)
	max.f32 %f23, %f6, %f22;
	sub.f32 %f24, %f6, %f23;
	ex2.approx.ftz.f32 %f25, %f24;          // rescale of the old state
	sub.f32 %f26, %f22, %f23;
	ex2.approx.ftz.f32 %f27, %f26;          // p
	mov.f32 %f6, %f23;
	fma.rn.f32 %f7, %f7, %f25, %f27;
	mul.f32 %f8, %f8, %f25;
	mul.f32 %f9, %f9, %f25;
	mul.f32 %f10, %f10, %f25;
	mul.f32 %f11, %f11, %f25;
	fma.rn.f32 %f8, %f27, %f16, %f8;
	fma.rn.f32 %f9, %f27, %f17, %f9;
	fma.rn.f32 %f10, %f27, %f18, %f10;
	fma.rn.f32 %f11, %f27, %f19, %f11;
	and.b32 %r17, %r13, 255;
	setp.ne.s32 %p1, %r17, 0;
	@%p1 bra $L__no_sync;
	st.shared.f32 [%r12], %f7;
	bar.sync 0;
	ld.shared.f32 %f28, [%r12];
	add.f32 %f7, %f28, 0f00000000;
	bar.sync 0;
$L__no_sync:
	add.s32 %r13, %r13, 1;
	setp.lt.u32 %p2, %r13, %r1;
	@%p2 bra $L__loop;
	rcp.approx.ftz.f32 %f29, %f7;
	mul.f32 %f8, %f8, %f29;
	mul.f32 %f9, %f9, %f29;
	mul.f32 %f10, %f10, %f29;
	mul.f32 %f11, %f11, %f29;
	mul.wide.u32 %rd10, %r8, 16;
	add.s64 %rd11, %rd3, %rd10;
	st.global.v4.f32 [%rd11], {%f8, %f9, %f10, %f11};
	ret;
}
"""


@dataclass(frozen=True)
class BenchResult:
    stats: LaunchStats          # of the fastest run
    cpu_time_s: float           # this process's CPU time for that run: on a busy machine it
                                # is closer to the emulator's own cost than wall time

    @property
    def cpu_thread_instructions_per_s(self) -> float:
        return self.stats.thread_instructions / self.cpu_time_s if self.cpu_time_s else 0.0


def bench(ptx: str, entry: str, grid: tuple, block: tuple, args: list,
          dynamic_smem_bytes: int = 0, repeat: int = 1) -> BenchResult:
    """Launch `entry` `repeat` times; return the fastest run."""
    best = None
    for _ in range(repeat):
        cpu = time.process_time()
        stats = launch(ptx, entry, grid, block, args, dynamic_smem_bytes)
        cpu = time.process_time() - cpu
        if best is None or stats.wall_time_s < best.stats.wall_time_s:
            best = BenchResult(stats, cpu)
    return best


def decode_like_args(iters: int):
    rng = np.random.default_rng(0)
    k = rng.standard_normal((64, 32, 4)).astype(np.float32)
    v = rng.standard_normal((64, 32, 4)).astype(np.float32)
    out = np.zeros((32 * 128, 4), np.float32)
    return [k, v, out, np.uint32(iters), np.float32(0.5 * 1.4426950408889634)]


def real_decode_launch(batch: int, seq: int):
    """ptxc's own decode kernel (Llama-3-8B shape: 32 heads, 8 KV heads, d128, f16: the
    tensor-core path) with every sequence `seq` keys long: (ptx, entry, grid, block, args,
    dynamic shared memory)."""
    from ptxc.pipeline.compiler import lower
    from ptxc.kernels import FAMILIES
    from ptxc.runtime import infer_dims, launch_geometry, pack_args, prepare_buffers
    from ptxc.kernels import load_text
    text = (Path(__file__).resolve().parents[1] / "specs" / "llama3_8b.toml").read_text()
    [spec] = load_text(text.replace('num_splits = "auto"', "num_splits = 1"))   # one launch
    ptx, launches, _, _ = lower(spec, "sm_80")
    fam = FAMILIES["decode"]
    inputs = fam.make_inputs(spec, {"batch": batch, "max_seq_len": seq}, np.random.default_rng(0))
    inputs["seq_lens"][:] = seq
    meta = {"name": spec.name, "tensors": {t.name: t.to_dict() for t in fam.interface(spec).tensors},
            "dims": ["batch", "max_seq_len"], "dim_rules": {}}
    dims = infer_dims(meta, inputs, {})
    buffers = prepare_buffers(meta, inputs, dims)
    [kernel] = launches
    grid, block = launch_geometry(kernel, dims)
    return (ptx, kernel["entry"], grid, block, pack_args(kernel, buffers, dims, pointer=lambda n, a: a),
            kernel["dynamic_smem_bytes"])


def real_prefill_launch(batch: int, seq: int):
    """ptxc's prefill kernel (FA2: mma.sync, ldmatrix, cp.async pipeline; Llama-3-8B prefill
    spec: f16 d128, GQA 32/8, causal) over `seq` queries and keys: (ptx, entry, grid, block,
    args, dynamic shared memory)."""
    from ptxc.pipeline.compiler import lower
    from ptxc.kernels import FAMILIES
    from ptxc.runtime import POISON, launch_geometry, pack_args
    from ptxc.reference import to_device
    from ptxc.kernels import load_file
    [spec] = load_file(Path(__file__).resolve().parents[1] / "specs" / "llama3_8b_prefill.toml")
    ptx, launches, _, _ = lower(spec, "sm_80")
    fam = FAMILIES["prefill"]
    dims = {"batch": batch, "seq_q": seq, "seq_k": seq}
    inputs = fam.make_inputs(spec, dims, np.random.default_rng(0))
    arrays = {}
    for t in fam.interface(spec).tensors:
        if t.role == "input":
            arrays[t.name] = to_device(inputs[t.name], t.dtype)
        else:
            shape = [dims[d] if isinstance(d, str) else d for d in t.shape]
            arrays[t.name] = np.full(shape, POISON[t.dtype], dtype=type(POISON[t.dtype]))
    kernel = launches[0]
    grid, block = launch_geometry(kernel, dims)
    args = pack_args(kernel, arrays, dims, pointer=lambda n, a: a)
    return ptx, kernel["entry"], grid, block, args, kernel["dynamic_smem_bytes"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=1000, help="loop iterations per thread")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--decode", action="store_true",
                    help="run ptxc's real decode kernel (batch 4, 32 heads, d128, seq 1000) instead")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1000)
    ap.add_argument("--prefill", action="store_true",
                    help="run ptxc's prefill kernel (batch 1, 32 heads, d128, causal, --seq "
                         "queries and keys) instead")
    ns = ap.parse_args(argv)
    smem = 0
    if ns.prefill:
        ptx, entry, grid, block, args, smem = real_prefill_launch(1, ns.seq)
        label = f"{entry} (llama3_8b_prefill, batch=1, seq={ns.seq})"
    elif ns.decode:
        ptx, entry, grid, block, args, smem = real_decode_launch(ns.batch, ns.seq)
        label = f"{entry} (llama3_8b_decode, batch={ns.batch}, seq={ns.seq})"
    else:
        ptx, entry, grid, block, args = (DECODE_LIKE_PTX, "decode_like", (8, 4), (128,),
                                         decode_like_args(ns.iters))
        label = f"decode_like iters={ns.iters}"
    result = bench(ptx, entry, grid, block, args, smem, repeat=ns.repeat)
    stats = result.stats
    print(f"kernel {label} grid={grid} block={block}")
    print(f"  thread-instructions : {stats.thread_instructions:,}")
    print(f"  instruction issues  : {stats.steps:,}")
    print(f"  wall time           : {stats.wall_time_s:.3f} s  (CPU {result.cpu_time_s:.3f} s)")
    print(f"  throughput          : {stats.thread_instructions_per_s / 1e6:.1f} M "
          f"thread-instructions/s (wall), "
          f"{result.cpu_thread_instructions_per_s / 1e6:.1f} M/s (CPU)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
