"""Small CUDA C++ kernels compiled by nvcc (the nvidia-cuda-nvcc wheel) run unmodified in the
emulator and match numpy: warp reductions with __shfl_down_sync, an mma.sync tile through
inline asm (scoped `.reg` without '%'), cp.async via __pipeline_memcpy_async, a by-value struct
parameter holding pointers, and module-scope __device__ / __constant__ variables."""

import re

import numpy as np
import pytest

from ptxc.emu import StructArg, launch, parse_module

SOURCE = r"""
#include <cuda_fp16.h>
#include <cuda_pipeline.h>

struct Params { const float* x; float* out; int n; float scale; };

__global__ void struct_k(Params p) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < p.n) p.out[i] = p.x[i] * p.scale;
}

__device__ int bias_var = 5;
__constant__ float weights[4] = {1.f, 2.f, 3.f, 4.f};

__global__ void reduce_k(const float* x, float* out, unsigned n) {
  float v = 0.f;
  for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x)
    v += x[i];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffff, v, o);
  __shared__ float warp_sums[32];
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    v = threadIdx.x < (blockDim.x >> 5) ? warp_sums[threadIdx.x] : 0.f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffff, v, o);
    if (threadIdx.x == 0) atomicAdd(out, v * weights[blockIdx.x & 3] + (float)(bias_var - 5));
  }
}

__global__ void pipe_k(const float4* x, float4* out) {
  __shared__ float4 buf[128];
  unsigned g = blockIdx.x * blockDim.x + threadIdx.x;
  __pipeline_memcpy_async(&buf[threadIdx.x], &x[g], sizeof(float4));
  __pipeline_commit();
  __pipeline_wait_prior(0);
  __syncthreads();
  out[g] = buf[blockDim.x - 1 - threadIdx.x];
}

__global__ void mma_k(const unsigned* a, const unsigned* b, float* c) {
  int l = threadIdx.x;
  unsigned a0 = a[l * 4], a1 = a[l * 4 + 1], a2 = a[l * 4 + 2], a3 = a[l * 4 + 3];
  unsigned b0 = b[l * 2], b1 = b[l * 2 + 1];
  float d0 = 0, d1 = 0, d2 = 0, d3 = 0;
  asm volatile("{\n .reg .b32 low;\n mov.b32 low, %4;\n"
      " mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {low,%5,%6,%7},"
      " {%8,%9}, {%0,%1,%2,%3};\n}\n"
      : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  c[l * 4] = d0; c[l * 4 + 1] = d1; c[l * 4 + 2] = d2; c[l * 4 + 3] = d3;
}
"""


@pytest.fixture(scope="module")
def module(nvcc_ptx):
    ptx = nvcc_ptx(SOURCE)
    names = {re.match(r"_Z\d+(\w+?_k)", e.name).group(1): e.name
             for e in parse_module(ptx).entries}
    return ptx, names


def test_struct_parameter_with_pointers(module):
    ptx, names = module
    assert ".param .align 8 .b8" in ptx
    n = 1000
    x = np.random.default_rng(0).random(n, np.float32)
    out = np.zeros(n, np.float32)
    dt = np.dtype([("x", "u8"), ("out", "u8"), ("n", "i4"), ("scale", "f4")], align=True)
    p = np.zeros((), dt)
    p["n"], p["scale"] = n, 2.5
    launch(ptx, names["struct_k"], (8,), (128,), [StructArg(p, {"x": x, "out": out})])
    np.testing.assert_array_equal(out, x * np.float32(2.5))


@pytest.mark.parametrize("n, grid", [(1, 1), (1000, 4), (4099, 3)])
def test_shfl_down_reduction_with_module_variables(module, n, grid):
    ptx, names = module
    assert ".global .align 4 .u32 bias_var = 5" in ptx and ".const" in ptx
    x = np.random.default_rng(n).random(n, np.float32)
    out = np.zeros(1, np.float32)
    launch(ptx, names["reduce_k"], (grid,), (256,), [x, out, np.uint32(n)])
    stride = grid * 256
    per_cta = [x[np.arange(n)[(np.arange(n) % stride) // 256 == c]].astype(np.float64).sum()
               for c in range(grid)]
    want = sum(s * (1 + (c & 3)) for c, s in enumerate(per_cta))
    np.testing.assert_allclose(out[0], want, rtol=1e-5)


def test_pipeline_memcpy_async(module):
    ptx, names = module
    assert "cp.async" in ptx
    x = np.random.default_rng(1).random((256, 4)).astype(np.float32)
    out = np.zeros_like(x)
    launch(ptx, names["pipe_k"], (2,), (128,), [x, out])
    np.testing.assert_array_equal(out.reshape(2, 128, 4), x.reshape(2, 128, 4)[:, ::-1])


def test_mma_inline_asm_tile(module):
    ptx, names = module
    assert ".reg .b32 low;" in ptx
    rng = np.random.default_rng(2)
    a = rng.standard_normal((16, 16)).astype(np.float16)
    b = rng.standard_normal((8, 16)).astype(np.float16)       # B column-major: b[n, k]
    lane = np.arange(32)
    g, t = lane >> 2, lane & 3

    def pack(lo, hi):
        return lo.view(np.uint16).astype(np.uint32) | (hi.view(np.uint16).astype(np.uint32) << 16)
    A = np.stack([pack(a[g + 8 * (i & 1), 2 * t + 8 * (i >> 1)],
                       a[g + 8 * (i & 1), 2 * t + 8 * (i >> 1) + 1]) for i in range(4)], 1)
    B = np.stack([pack(b[g, 2 * t + 8 * i], b[g, 2 * t + 8 * i + 1]) for i in range(2)], 1)
    C = np.zeros((32, 4), np.float32)
    launch(ptx, names["mma_k"], (1,), (32,), [A, B, C])
    D = np.zeros((16, 8))
    for i in range(4):
        D[g + 8 * (i >> 1), 2 * t + (i & 1)] = C[:, i]
    np.testing.assert_allclose(D, a.astype(np.float64) @ b.astype(np.float64).T, atol=1e-5)
