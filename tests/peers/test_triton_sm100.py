"""Triton's sm_100a PTX (GPUTarget("cuda", 100, 32)): `tl.dot` becomes tcgen05.mma with the
accumulator in tensor memory (allocated, committed to an mbarrier, read back with
tcgen05.ld), operands in swizzled shared memory -- copied there by cp.async or by TMA -- and,
for P.V in attention, P from tensor memory. It runs unmodified in the emulator and matches
numpy, which anchors the emulator's Blackwell model (descriptors, data-path layouts, ld/st
shapes, commit and mbarrier completion) to a code generator validated on B200s. Mistakes
planted in that PTX are caught with the line and the thread."""

import re

import numpy as np
import pytest

from ptxc.emu import TensorMap
from ptxc.errors import EmulationError
from tests.peers.cases import (ATTENTION_SIG, check_attention, check_matmul, matmul_inputs,
                               matmul_signature, run)
from tests.peers.conftest import cached

tk = pytest.importorskip("tests.peers.triton_kernels", reason="triton not installed",
                         exc_type=ImportError)
DIVISIBLE = ("K", "stride_am", "stride_bk", "stride_cm")


def _matmul(triton_ptx, dtype, bm, bn, bk, stages=2):
    return triton_ptx(tk.matmul_kernel, matmul_signature(dtype), {"BM": bm, "BN": bn, "BK": bk},
                      num_stages=stages, arch=100, divisible=DIVISIBLE)


@pytest.mark.parametrize("dtype, bm, bn, bk, K, shape", [
    ("fp16", 128, 64, 32, 96, "32x32b.x64"),
    ("bf16", 128, 128, 64, 160, "32x32b.x128"),
    ("fp16", 128, 32, 16, 112, "32x32b.x32"),
    ("fp16", 64, 64, 32, 96, "16x32bx2.x32"),        # M = 64: data-path layout F
    ("fp32", 128, 64, 32, 96, "32x32b.x64"),          # kind::tf32
])
def test_matmul_sm100a(triton_ptx, dtype, bm, bn, bk, K, shape):
    c = _matmul(triton_ptx, dtype, bm, bn, bk)
    ptx = c[0]
    kind = "tf32" if dtype == "fp32" else "f16"
    assert ".target sm_100a" in ptx and f"tcgen05.mma.cta_group::1.kind::{kind}" in ptx
    assert f"tcgen05.ld.sync.aligned.{shape}.b32" in ptx and "mma.sync" not in ptx
    check_matmul(c, dtype, K, seed=bm + bn + K, bm=bm, bn=bn)


def _matmul_tma(triton):
    """Triton's TMA matmul (host tensor descriptors): PTX, name, shared bytes, swizzles."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = {"a_desc": "tensordesc<fp16[128, 32]>", "b_desc": "tensordesc<fp16[32, 64]>",
           "c_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "stride_cm": "i32",
           "BM": "constexpr", "BN": "constexpr", "BK": "constexpr"}

    def build():
        src = ASTSource(fn=tk.matmul_tma_kernel, signature=sig,
                        constexprs={"BM": 128, "BN": 64, "BK": 32},
                        attrs={(2,): [["tt.divisibility", 16]]})
        k = triton.compile(src, target=GPUTarget("cuda", 100, 32),
                           options={"num_warps": 4, "num_stages": 2})
        # the host driver encodes each map with the kernel's swizzle (1/2/3: 32/64/128 bytes)
        swizzles = [{0: 0, 1: 32, 2: 64, 3: 128}[d["swizzle"]]
                    for d in k.metadata.tensordesc_meta]
        return k.asm["ptx"], k.metadata.name, int(k.metadata.shared), swizzles
    return cached(("triton-tma", triton.__version__, tk.matmul_tma_kernel.src), build)


def _run_tma(ptx, name, shared, swizzles, M=70, N=80, K=96):
    a, b, av, bv = matmul_inputs("fp16", M, N, K, seed=M + K)
    out = np.zeros((M, N), np.float32)
    u32, u64 = np.uint32, np.uint64
    # each host descriptor is passed as the map, then its shape (i32) and strides (i64)
    run((ptx, name, shared), (-(-M // 128), -(-N // 64)), 4,
        [TensorMap(a, (32, 128), swizzles[0]), u32(M), u32(K), u64(K), u64(1),
         TensorMap(b, (64, 32), swizzles[1]), u32(K), u32(N), u64(N), u64(1),
         out, u32(M), u32(N), u32(K), u32(N)])
    return out, av @ bv


@pytest.mark.parametrize("M, N, K", [(70, 80, 96), (130, 64, 32)])
def test_matmul_tma_sm100a(M, N, K):
    triton = pytest.importorskip("triton")
    ptx, name, shared, swizzles = _matmul_tma(triton)
    assert "cp.async.bulk.tensor.2d" in ptx and "tcgen05.mma" in ptx
    out, ref = _run_tma(ptx, name, shared, swizzles, M, N, K)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)


def _attention(triton_ptx, causal):
    return triton_ptx(tk.attention_kernel, ATTENTION_SIG,
                      {"D": 64, "BM": 128, "BN": 64, "CAUSAL": causal}, arch=100)


@pytest.mark.parametrize("causal, seq_q, seq_k", [(False, 70, 90), (True, 70, 90),
                                                  (True, 1, 17), (False, 113, 333),
                                                  (True, 200, 333)])
def test_flash_attention_forward_sm100a(triton_ptx, causal, seq_q, seq_k):
    c = _attention(triton_ptx, causal)
    ptx = c[0]
    assert "tcgen05.mma.cta_group::1.kind::f16 [ %r" in ptx
    assert re.search(r"tcgen05\.mma\S* \[ %r\d+ \+ 0 \], \[ %r\d+ \+ 0 \]", ptx)  # P in TMEM
    check_attention(c, causal, seq_q, seq_k, bm=128)


# ----------------------------------------------------------------------------- planted mistakes

def _planted(compiled, ptx, dtype="fp16", K=96, bm=128, bn=64):
    with pytest.raises(EmulationError) as e:
        check_matmul((ptx,) + tuple(compiled[1:]), dtype, K, seed=1, bm=bm, bn=bn)
    return str(e.value)


def _line_of(ptx, needle):
    return next(i for i, text in enumerate(ptx.splitlines(), 1) if needle in text)


def test_missing_commit_leaves_its_mbarrier_wait_stuck(triton_ptx):
    """Without the last tcgen05.commit nothing arrives on the MMA barrier: the wait on it is
    reported as a deadlock, with its line and a thread."""
    c = _matmul(triton_ptx, "fp16", 128, 64, 32)
    lines = c[0].splitlines()
    last = [i for i, t in enumerate(lines) if "tcgen05.commit" in t][-1]
    broken = "\n".join(t if i != last else "" for i, t in enumerate(lines))
    msg = _planted(c, broken)
    assert re.search(r"line \d+: `mbarrier.try_wait.parity", msg) and "deadlock" in msg
    assert "thread tid=(" in msg


def test_read_of_tensor_memory_before_the_mbarrier_wait(triton_ptx):
    """The attention kernel's first S = QK^T read, moved before the wait on its commit."""
    c = _attention(triton_ptx, False)
    lines = c[0].splitlines()
    ld = next(i for i, t in enumerate(lines) if "tcgen05.ld.sync" in t)
    wait = max(i for i in range(ld) if "mbarrier.try_wait" in lines[i])
    # the wait's loop: `waitLoop:`, try_wait, `@!complete bra` -> skip it entirely
    broken = lines[:wait - 1] + lines[wait + 2:]
    with pytest.raises(EmulationError) as e:
        check_attention(("\n".join(broken),) + tuple(c[1:]), False, 70, 90, bm=128)
    msg = str(e.value)
    line = _line_of("\n".join(broken), "tcgen05.ld.sync")
    assert f"line {line}:" in msg and "a tcgen05.mma still writes" in msg


def test_wrong_descriptor_swizzle_is_caught_with_its_line():
    """B's descriptor says 64-byte swizzle where TMA wrote the tile with 128-byte swizzle."""
    triton = pytest.importorskip("triton")
    ptx, name, shared, swizzles = _matmul_tma(triton)
    assert swizzles[1] == 128 and "mov.b32 \t%r38, 1073758272;" in ptx   # layout 2: 128B
    broken = ptx.replace("mov.b32 \t%r38, 1073758272;", f"mov.b32 \t%r38, {0x80004040 - 2**32};")
    with pytest.raises(EmulationError) as e:
        _run_tma(broken, name, shared, swizzles)
    msg = str(e.value)
    assert f"line {_line_of(broken, 'tcgen05.mma')}:" in msg
    assert "the B descriptor" in msg and "a 64-byte swizzle" in msg and \
        "TMA wrote with a 128-byte swizzle" in msg


def test_unsupported_swizzle_mode_is_refused_with_its_line(triton_ptx):
    c = _matmul(triton_ptx, "fp16", 128, 64, 32)
    broken = c[0].replace("mov.b32 \t%r91, 1073758272;", f"mov.b32 \t%r91, {0x60004040};")
    msg = _planted(c, broken)
    assert "B descriptor" in msg and "swizzle mode 3" in msg
    assert f"line {_line_of(broken, 'tcgen05.mma')}:" in msg
