"""FP8 building blocks (ptxc/kernels/math/fp8.py) in the emulator, on the software path (sm_80) and
the hardware path (sm_89): the quantiser bit-exactly against a table-search implementation of
OCP satfinite rounding (every f16 value, random and edge f32 values), the dequantiser over all
256 codes to f32, f16x2 and bf16x2, and both paths assembled by ptxas."""

from __future__ import annotations

import numpy as np
import pytest

from ptxc import emu
from ptxc.emu import fp8 as emu_fp8
from ptxc.ir import B32, F32, S64, U64, Addr, KernelBuilder, render_module
from ptxc.kernels.math import fp8
from ptxc.reference import fp8_decode, fp8_quantize
from ptxc.targets import TARGETS

from tests.emu.helpers import assert_assembles

PATHS = ["sm_75", "sm_80", "sm_89", "sm_120"]        # software x2, hardware x2
KINDS = list(fp8.KINDS)


def _ptx(b: KernelBuilder, target: str) -> str:
    t = TARGETS[target]
    return render_module([b.entry], kernel="k", family="test", target=t.name,
                         ptx_version=fp8.ptx_version(t))


def _thread_base(b, name, nbytes):
    """This thread's address in buffer `name`: base + global thread index * nbytes."""
    ptr = b.to_global(b.load_param(b.param(name, U64)))
    gid = b.add(b.mul(b.special("%ctaid.x"), b.special("%ntid.x")), b.special("%tid.x"))
    return b.bitcast(b.mad(b.cvt(S64, gid), nbytes, b.bitcast(ptr, S64)), U64)


def quantize_kernel(kind: str, target: str) -> str:
    b = KernelBuilder("k")
    src, dst = _thread_base(b, "x", 16), _thread_base(b, "q", 4)
    vals = b.ld("global", F32, Addr(src), vec=4)
    (word,) = fp8.quantize(b, vals, kind, TARGETS[target])
    b.st("global", B32, Addr(dst), [word])
    b.ret()
    return _ptx(b, target)


def dequantize_kernel(kind: str, target: str, outs=("f32", "f16x2", "bf16x2")) -> str:
    b = KernelBuilder("k")
    src = _thread_base(b, "codes", 4)
    outs = {to: _thread_base(b, to, 16 if to == "f32" else 8) for to in outs}
    word = b.ld("global", B32, Addr(src))
    for to, addr in outs.items():
        vals = fp8.dequantize(b, [word], kind, TARGETS[target], to=to)
        b.st("global", F32 if to == "f32" else B32, Addr(addr), vals)
    b.ret()
    return _ptx(b, target)


def run_quantize(x: np.ndarray, kind: str, target: str) -> np.ndarray:
    n = -(-len(x) // 1024) * 1024
    xs = np.zeros(n, np.float32)
    xs[:len(x)] = x
    out = np.zeros(n, np.uint8)
    ptx = quantize_kernel(kind, target)
    emu.launch(ptx, "k", (n // 4 // 256,), (256,), [xs, out])
    return out[:len(x)]


def edge_f32() -> np.ndarray:
    vals = [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 448.0, 464.0, 463.9, 480.0, 1e30, -1e30,
            57344.0, 61440.0, 61439.9, 2.0 ** -6, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -11, 2.0 ** -16,
            2.0 ** -17, 3 * 2.0 ** -18, 2.0 ** -14, 1e-40, -1e-40, 1.0625, 1.1875, 1.125, 1.375,
            3.4028235e38, 2.0 ** -7 * 1.0625, 2.0 ** -15 * 1.25]
    nan_payload = np.array([0x7FC00001, 0xFF800001], np.uint32).view(np.float32)
    return np.concatenate([np.array(vals, np.float32), nan_payload])


def all_f16_and_random_f32(n_random: int) -> np.ndarray:
    rng = np.random.default_rng(12)
    f16 = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    r = (rng.standard_normal(n_random) * np.exp2(rng.integers(-24, 20, n_random))).astype(np.float32)
    bits = rng.integers(0, 1 << 32, n_random, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return np.concatenate([edge_f32(), f16, r, bits])


def test_reference_quantizer_known_values():
    q = fp8_quantize(np.array([0.0, -0.0, 448.0, 1e9, -np.inf, np.nan, 2.0 ** -9, 2.0 ** -10,
                               3 * 2.0 ** -10, 1.0625, 1.1875], np.float32), "e4m3")
    assert list(q) == [0x00, 0x80, 0x7E, 0x7E, 0xFE, 0x7F, 0x01, 0x00, 0x02, 0x38, 0x3A]
    q = fp8_quantize(np.array([57344.0, np.inf, 2.0 ** -16, 1.125, 1.375], np.float32), "e5m2")
    assert list(q) == [0x7B, 0x7B, 0x01, 0x3C, 0x3E]
    assert np.all(fp8_quantize(fp8_decode(np.arange(256), "e4m3"), "e4m3")[
        np.arange(256) & 0x7F != 0x7F] == np.arange(256)[np.arange(256) & 0x7F != 0x7F])


@pytest.mark.parametrize("kind", KINDS)
def test_emulator_fp8_cvt_matches_reference(kind):
    x = all_f16_and_random_f32(4096)
    assert np.array_equal(emu_fp8.quantize(x, kind), fp8_quantize(x, kind))


@pytest.mark.parametrize("target", PATHS)
@pytest.mark.parametrize("kind", KINDS)
def test_quantizer_bit_exact(kind, target):
    x = all_f16_and_random_f32(1 << 16)
    got = run_quantize(x, kind, target)
    want = fp8_quantize(x, kind)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (f"{bad.size} mismatches, first: x={x[bad[0]]!r} "
                           f"(bits {x[bad[:1]].view(np.uint32)[0]:#010x}) got {got[bad[0]]:#04x} "
                           f"want {want[bad[0]]:#04x}")


@pytest.mark.parametrize("target", PATHS)
@pytest.mark.parametrize("kind", KINDS)
def test_dequantizer_all_codes(kind, target):
    codes = np.arange(256, dtype=np.uint8)
    f32, f16, bf16 = np.zeros(256, np.float32), np.zeros(128, np.uint32), np.zeros(128, np.uint32)
    emu.launch(dequantize_kernel(kind, target), "k", (1,), (64,), [codes, f32, f16, bf16])
    want = fp8_decode(codes, kind)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(f32), nan)
    assert np.array_equal(f32[~nan].astype(np.float64), want[~nan])
    assert np.array_equal(np.signbit(f32[~nan]), np.signbit(want[~nan]))   # -0 stays -0
    halves = f16.view(np.uint16)
    assert np.array_equal(halves[~nan], want[~nan].astype(np.float16).view(np.uint16))
    assert np.all(np.isnan(halves[nan].view(np.float16)))
    if kind == "e4m3":   # canonical NaN on both paths
        assert np.all(halves[nan] == 0x7FFF)
    bf = bf16.view(np.uint16).astype(np.uint32) << 16
    assert np.array_equal(bf.view(np.float32)[~nan].astype(np.float64), want[~nan])
    assert np.all(np.isnan(bf.view(np.float32)[nan]))


def f16_pairs_kernel(kind: str, target: str) -> str:
    b = KernelBuilder("k")
    src, dst = _thread_base(b, "codes", 4), _thread_base(b, "pairs", 8)
    b.st("global", B32, Addr(dst), fp8.f16_pairs(b, [b.ld("global", B32, Addr(src))], kind, TARGETS[target]))
    b.ret()
    return _ptx(b, target)


@pytest.mark.parametrize("target", PATHS)
@pytest.mark.parametrize("kind", KINDS)
def test_f16_pairs_all_codes(kind, target):
    """f16_pairs: every code as the f16 of its value times f16_pair_factor, exactly -- 2^-8 for
    e4m3 placed by bits without a hardware cvt (its subnormals as f16 subnormals, -0 kept), 1
    elsewhere -- and NaN as a NaN; the bit path is 8 integer operations a pair (PTX) or fewer."""
    codes = np.arange(256, dtype=np.uint8)
    pairs = np.zeros(128, np.uint32)
    ptx = f16_pairs_kernel(kind, target)
    emu.launch(ptx, "k", (1,), (64,), [codes, pairs])
    factor = fp8.f16_pair_factor(kind, TARGETS[target])
    assert factor == (2.0 ** -8 if kind == "e4m3" and target in ("sm_75", "sm_80") else 1.0)
    got = pairs.view(np.float16)
    want = fp8_decode(codes, kind) * factor
    nan = np.isnan(want)
    assert np.all(np.isnan(got[nan]))
    assert np.array_equal(got[~nan].view(np.uint16), want[~nan].astype(np.float16).view(np.uint16))
    if factor != 1.0:
        body = ptx.split("ld.global.b32", 1)[1]
        ops = [ln for ln in body.splitlines() if ln.strip().split(" ")[0].split(".")[0]
               in ("prmt", "and", "or", "shr", "add", "sub")]
        assert len(ops) <= 2 * 8, ops


@pytest.mark.parametrize("target", ["sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_120"])
@pytest.mark.parametrize("kind", KINDS)
def test_both_paths_assemble(kind, target):
    assert_assembles(quantize_kernel(kind, target))
    assert_assembles(dequantize_kernel(kind, target))
    assert_assembles(f16_pairs_kernel(kind, target))


def test_hardware_path_uses_cvt_and_software_path_does_not():
    assert "cvt.rn.satfinite.e4m3x2.f32" in quantize_kernel("e4m3", "sm_89")
    assert "e4m3x2" not in quantize_kernel("e4m3", "sm_80")
    assert "cvt.rn.f16x2.e5m2x2" in dequantize_kernel("e5m2", "sm_89")
    assert "e5m2x2" not in dequantize_kernel("e5m2", "sm_86")


@pytest.mark.parametrize("target", PATHS)
@pytest.mark.parametrize("kind", KINDS)
def test_load_kv_dequant_with_scale_and_predicate(kind, target):
    """The attention kernels' block: 16 bytes -> 16 f32 values x scale; a false predicate reads 0."""
    b = KernelBuilder("k")
    src, dst = _thread_base(b, "codes", 16), _thread_base(b, "out", 64)
    scale = b.load_param(b.param("scale", F32))
    tid = b.special("%tid.x")
    vals = fp8.load_kv_dequant(b, Addr(src), kind, TARGETS[target], scale=scale,
                               pred=b.setp("lt", tid, 15))
    for i in range(0, 16, 4):
        b.st("global", F32, Addr(dst, 4 * i), vals[i:i + 4])
    b.ret()
    ptx = _ptx(b, target)
    assert_assembles(ptx)
    codes = np.arange(256, dtype=np.uint8)
    out = np.zeros(256, np.float32)
    emu.launch(ptx, "k", (1,), (16,), [codes, out, np.float32(0.375)])
    want = (fp8_decode(codes, kind).astype(np.float32) * np.float32(0.375))
    want[240:] = 0.0                                 # thread 15's predicate is false
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(out), nan) and np.array_equal(out[~nan], want[~nan])


@pytest.mark.parametrize("line,why", [("cvt.rn.e4m3x2.f32 %h, %a, %a;", "needs .satfinite"),
                                      ("cvt.rz.satfinite.e5m2x2.f32 %h, %a, %a;", "takes .rn"),
                                      ("cvt.rn.bf16x2.e4m3x2 %r, %h;", "unsupported FP8 cvt")])
def test_emulator_rejects_unsupported_fp8_cvt(line, why):
    from ptxc.errors import EmulationError
    ptx = ("\n.version 8.1\n.target sm_89\n.address_size 64\n.visible .entry k()\n{\n"
           "\t.reg .b16 %h;\n\t.reg .b32 %r;\n\t.reg .f32 %a;\n\tmov.f32 %a, 0f00000000;\n"
           f"\t{line}\n\tret;\n}}\n")
    with pytest.raises(EmulationError, match=why):
        emu.launch(ptx, "k", (1,), (1,), [])
