"""What peer compilers emit, in small hand-written kernels: tf32 mma (m16n8k8, m16n8k4),
griddepcontrol, `.section .debug_*` blocks, module-scope .global/.const variables, by-value
struct parameters (StructArg) and inline-asm scopes declaring registers without '%'."""

import numpy as np
import pytest

from ptxc.emu import EmulationError, StructArg, launch, parse_module
from ptxc.errors import InputError

from .helpers import HEADER, run


def tf32_mma_kernel(k: int) -> str:
    na, nb = k // 2, k // 4
    a_regs = ", ".join(f"%a{i}" for i in range(na))
    b_regs = ", ".join(f"%b{i}" for i in range(nb))
    loads = [f"\tld.global.b32 %a{i}, [%rd4+{4 * i}];" for i in range(na)]
    loads += [f"\tld.global.b32 %b{i}, [%rd5+{4 * i}];" for i in range(nb)]
    return HEADER + rf"""
.visible .entry tf32_k{k}(.param .u64 a_p, .param .u64 b_p, .param .u64 c_p)
{{
	.reg .b32 %r<4>;
	.reg .b32 %a<{na}>;
	.reg .b32 %b<{nb}>;
	.reg .f32 %f<9>;
	.reg .b64 %rd<8>;
	ld.param.u64 %rd1, [a_p];
	ld.param.u64 %rd2, [b_p];
	ld.param.u64 %rd3, [c_p];
	mov.u32 %r1, %tid.x;
	mul.wide.u32 %rd6, %r1, {4 * na};
	add.s64 %rd4, %rd1, %rd6;
	mul.wide.u32 %rd6, %r1, {4 * nb};
	add.s64 %rd5, %rd2, %rd6;
{chr(10).join(loads)}
	mov.f32 %f0, 0f3F800000;
	mma.sync.aligned.m16n8k{k}.row.col.f32.tf32.tf32.f32 {{%f1, %f2, %f3, %f4}}, {{{a_regs}}}, {{{b_regs}}}, {{%f0, %f0, %f0, %f0}};
	mul.wide.u32 %rd6, %r1, 16;
	add.s64 %rd7, %rd3, %rd6;
	st.global.v4.f32 [%rd7], {{%f1, %f2, %f3, %f4}};
	ret;
}}
"""


@pytest.mark.parametrize("k", [8, 4])
def test_tf32_mma(k):
    rng = np.random.default_rng(k)
    a = rng.standard_normal((16, k)).astype(np.float32)
    b = rng.standard_normal((k, 8)).astype(np.float32)
    lane = np.arange(32)
    g, t = lane >> 2, lane & 3
    A = np.stack([a[g + 8 * (i & 1), t + 4 * (i >> 1)] for i in range(k // 2)], 1)
    B = np.stack([b[t + 4 * i, g] for i in range(k // 4)], 1)
    C = np.zeros((32, 4), np.float32)
    run(tf32_mma_kernel(k), f"tf32_k{k}", (1,), (32,), [A.copy(), B.copy(), C])
    D = np.zeros((16, 8))
    for i in range(4):
        D[g + 8 * (i >> 1), 2 * t + (i & 1)] = C[:, i]

    def tf32(x):   # the hardware reads the upper 19 bits
        return (x.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)
    np.testing.assert_allclose(D, tf32(a) @ tf32(b) + 1.0, rtol=1e-6, atol=1e-6)
    assert np.abs(D - (a.astype(np.float64) @ b + 1.0)).max() > 0   # truncation is visible


GLOBALS = HEADER.replace("sm_80", "sm_90") + r"""
.global .align 4 .u32 counter = 7;
.global .align 8 .b8 unused_object[1];
.const .align 4 .b8 table[16] = {0, 0, 128, 63, 0, 0, 0, 64, 0, 0, 64, 64, 0, 0, 128, 64};
.global .align 4 .f32 zeros[3];

.visible .entry globals(.param .u64 out_p)
{
	.reg .b32 %r<8>;
	.reg .f32 %f<4>;
	.reg .b64 %rd<8>;
	griddepcontrol.wait;
	ld.param.u64 %rd1, [out_p];
	mov.u32 %r1, %tid.x;
	ld.global.u32 %r2, [counter];
	mov.u64 %rd2, table;
	mul.wide.u32 %rd3, %r1, 4;
	add.s64 %rd4, %rd2, %rd3;
	ld.const.f32 %f1, [%rd4];
	ld.global.f32 %f2, [zeros+4];
	add.f32 %f3, %f1, %f2;
	mov.b32 %r3, %f3;
	add.u32 %r4, %r3, %r2;
	add.s64 %rd5, %rd1, %rd3;
	st.global.u32 [%rd5], %r4;
	griddepcontrol.launch_dependents;
	ret;
}
	.section	.debug_abbrev
	{
.b8 1                                   // Abbreviation Code
.b8 17                                  // DW_TAG_compile_unit
	}
	.section	.debug_macinfo	{	}
"""


def test_module_globals_const_debug_sections_and_griddepcontrol():
    out = np.zeros(4, np.uint32)
    run(GLOBALS, "globals", (1,), (4,), [out])
    want = np.array([1, 2, 3, 4], np.float32).view(np.uint32) + np.uint32(7)
    np.testing.assert_array_equal(out, want)
    assert [v.name for v in parse_module(GLOBALS).globals] == ["counter", "unused_object",
                                                               "table", "zeros"]


def test_reading_past_a_module_variable_is_out_of_bounds():
    ptx = GLOBALS.replace("ld.global.f32 %f2, [zeros+4];", "ld.global.f32 %f2, [zeros+12];")
    with pytest.raises(EmulationError, match="out-of-bounds global load.*module globals"):
        launch(ptx, "globals", (1,), (4,), [np.zeros(4, np.uint32)])


STRUCT = HEADER + r"""
// struct { float* out; u32 n; f32 scale; }: out[i] = i * scale for i < n
.visible .entry structk(.param .align 8 .b8 p[16])
{
	.reg .pred %p<2>;
	.reg .b32 %r<4>;
	.reg .f32 %f<4>;
	.reg .b64 %rd<4>;
	ld.param.u64 %rd1, [p];
	ld.param.u32 %r1, [p+8];
	ld.param.f32 %f1, [p+12];
	mov.u32 %r2, %tid.x;
	setp.ge.u32 %p1, %r2, %r1;
	@%p1 bra $L__done;
	cvt.rn.f32.u32 %f2, %r2;
	mul.f32 %f3, %f2, %f1;
	mul.wide.u32 %rd2, %r2, 4;
	add.s64 %rd3, %rd1, %rd2;
	st.global.f32 [%rd3], %f3;
$L__done:
	ret;
}
"""

STRUCT_DT = np.dtype([("out", "u8"), ("n", "u4"), ("scale", "f4")], align=True)


def test_struct_parameter_by_field_name_and_by_offset():
    s = np.zeros((), STRUCT_DT)
    s["n"], s["scale"] = 17, 0.5
    for buffers in ({"out": None}, {0: None}):
        out = np.zeros(32, np.float32)
        run(STRUCT, "structk", (1,), (32,), [StructArg(s, {k: out for k in buffers})])
        np.testing.assert_array_equal(out[:17], np.arange(17) * 0.5)
        assert not out[17:].any()


def test_struct_parameter_errors_are_one_line_input_errors():
    with pytest.raises(InputError, match=r"param 0 'p' is a 16-byte struct.*got 8 bytes"):
        launch(STRUCT, "structk", (1,), (32,), [bytes(8)])
    with pytest.raises(InputError, match="must be an aligned u64 field"):
        launch(STRUCT, "structk", (1,), (32,), [StructArg(bytes(16), {4: np.zeros(4)})])
    launch(STRUCT, "structk", (1,), (32,), [bytes(16)])      # n = 0: nothing is written


SCOPED = HEADER + r"""
.visible .entry scoped(.param .u64 out_p)
{
	.reg .b32 %r<4>;
	.reg .b64 %rd<4>;
	.reg .pred %p<2>;
	ld.param.u64 %rd1, [out_p];
	mov.u32 %r1, %tid.x;
	{
	.reg .b32 low;
	.reg .pred p;
	mov.b32 low, %r1;
	setp.eq.u32 p, low, 3;
	add.u32 low, low, 100;
	@p add.u32 low, low, 1000;
	mov.b32 %r2, low;
	}
	{
	.reg .b64 low;
	mov.b64 low, 7;
	cvt.u32.u64 %r3, low;
	}
	add.u32 %r2, %r2, %r3;
	mul.wide.u32 %rd2, %r1, 4;
	add.s64 %rd3, %rd1, %rd2;
	st.global.u32 [%rd3], %r2;
	ret;
}
"""


def test_inline_asm_scopes_declare_registers_without_percent():
    out = np.zeros(8, np.uint32)
    run(SCOPED, "scoped", (1,), (8,), [out])
    want = np.arange(8) + 107
    want[3] += 1000
    np.testing.assert_array_equal(out, want)
