"""The builder rejects ill-typed IR with a precise message; structured control flow prints the
expected branch/label shape."""

import pytest

from ptxc.errors import IRError
from ptxc.ir import F32, F64, S32, U32, U64, Addr, KernelBuilder
from ptxc.ir.printer import render_instr


def test_type_mismatch_names_operands():
    b = KernelBuilder("k")
    x, y = b.mov(1, U32), b.mov(1.0, F32)
    with pytest.raises(IRError, match=r"add: operands have types u32 and f32"):
        b.add(x, y)


def test_signed_unsigned_mix_is_an_error():
    b = KernelBuilder("k")
    with pytest.raises(IRError, match="u32 and s32"):
        b.add(b.mov(1, U32), b.mov(1, S32))


def test_float_immediate_for_int_and_bad_destination():
    b = KernelBuilder("k")
    x = b.mov(1, U32)
    with pytest.raises(IRError, match="float immediate"):
        b.add(x, 1.5)
    with pytest.raises(IRError, match="destination"):
        b.add(x, 1, out=b.mov(0.0, F32))


def test_shared_address_must_be_32_bit():
    b = KernelBuilder("k")
    with pytest.raises(IRError, match="expected 32-bit"):
        b.ld("shared", F32, Addr(b.mov(0, U64)))


def test_barrier_under_predicate_is_rejected():
    b = KernelBuilder("k")
    p = b.setp("lt", b.special("%tid.x"), 3)
    with b.predicate(p):
        with pytest.raises(IRError, match="bar.sync under a predicate"):
            b.bar_sync()


def test_if_else_and_loop_shapes():
    b = KernelBuilder("k")
    n = b.mov(10, U32)
    p = b.setp("lt", n, 3)
    with b.if_then(p):
        b.add(n, 1, out=n)
    with b.else_():
        b.sub(n, 1, out=n)
    with b.for_range(0, n, 2) as i:
        b.add(n, i, out=n)
    text = "\n".join(render_instr(i) for i in b.entry.body)
    assert text == (
        "\tmov.u32 %r1, 10;\n\tsetp.lt.u32 %p1, %r1, 3;\n\t@!%p1 bra $L__endif_1;\n"
        "\tadd.u32 %r1, %r1, 1;\n\tbra $L__endelse_2;\n$L__endif_1:\n\tsub.u32 %r1, %r1, 1;\n"
        "$L__endelse_2:\n\tmov.u32 %r2, 0;\n\tsetp.ge.u32 %p2, %r2, %r1;\n\t@%p2 bra $L__endloop_4;\n"
        "$L__loop_3:\n\tadd.u32 %r1, %r1, %r2;\n\tadd.u32 %r2, %r2, 2;\n\tsetp.lt.u32 %p3, %r2, %r1;\n"
        "\t@%p3 bra $L__loop_3;\n$L__endloop_4:")


def test_float_immediates_print_as_hex_bits():
    b = KernelBuilder("k")
    b.mov(float("-inf"), F32)
    b.mov(1.0, F32)
    assert [render_instr(i) for i in b.entry.body] == ["\tmov.f32 %f1, 0fFF800000;",
                                                       "\tmov.f32 %f2, 0f3F800000;"]


def test_a_finite_f32_immediate_that_overflows_is_refused_when_built():
    """1e39 has no f32: refused where the instruction is built, not printed as inf (or crashing
    the printer); infinities are meant as they are, and f64 holds it."""
    b = KernelBuilder("k")
    with pytest.raises(IRError, match="overflows f32"):
        b.mov(1e39, F32)
    with pytest.raises(IRError, match="overflows f32"):
        b.mul(b.mov(1.0, F32), -1e300)
    b.mov(3.4028234e38, F32)        # rounds to the largest f32
    b.mov(float("inf"), F32)
    b.mov(1e39, F64)


def _divrem_kernel():
    """out[t] for t = tid: unsigned div/rem by powers of two and not, u64 too, and signed."""
    b = KernelBuilder("divrem")
    out = b.to_global(b.load_param(b.param("out", U64)))
    t = b.special("%tid.x")
    x = b.mad(t, 37, 5)
    sx = b.sub(b.bitcast(x, S32), 600)
    vals = [b.div(x, 8), b.rem(x, 8), b.div(x, 1), b.rem(x, 1), b.div(x, 6), b.rem(x, 6),
            b.bitcast(b.cvt(U32, b.div(b.cvt(U64, x), 16)), U32), b.bitcast(b.div(sx, 4), U32),
            b.bitcast(b.rem(sx, 4), U32)]
    base = b.add(out, b.mul(b.cvt(U64, t), len(vals) * 4))
    for n, v in enumerate(vals):
        b.st("global", U32, Addr(base, 4 * n), [v])
    b.ret()
    return b.entry


def test_strength_reduction_pass_on_power_of_two_unsigned_div_rem():
    import numpy as np

    from ptxc.emu import launch
    from ptxc.ir import render_module
    from ptxc.ir.passes import run_passes
    entry = _divrem_kernel()
    [reduced] = run_passes([entry])
    text = "\n".join(render_instr(i) for i in reduced.body)
    assert "div.u32" in text and "rem.u32" in text          # by 6: left for ptxas
    assert text.count("shr.u32") == 2 and "and.b32" in text  # by 8 and by 1
    assert "shr.u64" in text and "div.s32" in text and "rem.s32" in text  # u64 reduced, signed kept
    before = "\n".join(render_instr(i) for i in entry.body)
    assert "shr" not in before
    ptx = render_module([reduced], kernel="divrem", family="test", target="sm_80", ptx_version="8.0")
    got = np.zeros(64 * 9, np.uint32)
    launch(ptx, "divrem", (1,), (64,), [got])
    x = np.arange(64, dtype=np.int64) * 37 + 5
    sx = x - 600
    want = np.stack([x // 8, x % 8, x, 0 * x, x // 6, x % 6, x // 16,
                     np.trunc(sx / 4).astype(np.int64), np.fmod(sx, 4)], axis=1)
    assert (got.reshape(64, 9).astype(np.int64) == (want & 0xFFFFFFFF)).all()
