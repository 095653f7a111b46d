"""Parsing: the PTX dialect ptxc emits, the module cache, and decode-time errors."""

import numpy as np
import pytest

from ptxc.emu import EmulationError, parse_module
from ptxc.emu.parser import parse_instruction
from ptxc.emu.ptx_ast import Addr, Imm, Pair, Reg, Sink, Sym, Vec

from .helpers import HEADER, line_of, run

MODULE = HEADER + r"""
/* a block comment
   spanning lines */
.file 1 "decode.cu"
.extern .shared .align 16 .b8 dyn_smem[];

.visible .entry first(
	.param .u64 q,
	.param .u32 n,
	.param .s64 stride_b,
	.param .f32 scale
)
.maxntid 128, 1, 1
{
	.reg .pred %p<3>;
	.reg .b32 %r<4>, %x;          // a range and a single register in one declaration
	.reg .b64 %rd<3>;
	.reg .f32 %f<2>;
	.shared .align 16 .b8 smem_merge[64];
	.loc 1 12 3
	ld.param.u64 %rd1, [q];       // trailing comment
	@!%p1 bra.uni $L__done_4;
$L__loop_3:
	mov.u32 %r1, smem_merge;
	ld.shared.v2.f32 {%f0, %f1}, [%r1+-8];
	setp.lt.s32 %p1|%p2, %r1, 0x10;
	mov.f32 %f0, 0f3F800000;
$L__done_4:
	ret;
}

.visible .entry second()
{
	exit;
}
"""


def test_module_structure():
    m = parse_module(MODULE)
    assert (m.version, m.target, m.address_size) == ("7.8", "sm_80", 64)
    assert [e.name for e in m.entries] == ["first", "second"]
    e = m.entry("first")
    assert [(p.name, p.ptype) for p in e.params] == [("q", "u64"), ("n", "u32"),
                                                     ("stride_b", "s64"), ("scale", "f32")]
    regs = dict(e.regs)
    assert regs["%p2"] == "pred" and "%p3" not in regs and regs["%x"] == "b32"
    assert regs["%r3"] == "b32" and regs["%rd2"] == "b64"
    assert [(v.name, v.nbytes, v.align) for v in e.shared] == [("dyn_smem", None, 16),
                                                                ("smem_merge", 64, 16)]
    assert dict(e.labels) == {"$L__loop_3": 2, "$L__done_4": 6}
    assert e.maxntid == (128, 1, 1)
    ins = e.body[1]
    assert ins.line == line_of(MODULE, "@!%p1 bra.uni") and ins.text.startswith("@!%p1 bra.uni")
    assert ins.guard == Reg("%p1", neg=True) and ins.opcode == "bra" and ins.mods == ("uni",)
    assert e.body[3].operands == (Vec((Reg("%f0"), Reg("%f1"))), Addr(Reg("%r1"), -8))
    assert e.body[4].operands[0] == Pair(Reg("%p1"), Reg("%p2"))
    assert e.body[4].operands[2] == Imm(16, "int")
    assert e.body[5].operands[1] == Imm(0x3F800000, "f32bits")


def test_parse_is_cached_by_text():
    assert parse_module(MODULE) is parse_module(MODULE)
    assert parse_module(MODULE + "\n") is not parse_module(MODULE)


@pytest.mark.parametrize("text, operands", [
    ("mov.b32 {%h1, %h2}, %r1", (Vec((Reg("%h1"), Reg("%h2"))), Reg("%r1"))),
    ("ld.param.u64 %rd1, [q+8]", (Reg("%rd1"), Addr(Sym("q"), 8))),
    ("st.global.u32 [%rd1], -7", (Addr(Reg("%rd1"), 0), Imm(-7, "int"))),
    ("mov.f64 %fd1, 0d3FF0000000000000", (Reg("%fd1"), Imm(0x3FF0000000000000, "f64bits"))),
    ("shfl.sync.bfly.b32 %r1|%p1, %r2, 1, 0x1f, -1",
     (Pair(Reg("%r1"), Reg("%p1")), Reg("%r2"), Imm(1, "int"), Imm(31, "int"), Imm(-1, "int"))),
    ("setp.eq.and.s32 %p1, %r1, 5, !%p2", (Reg("%p1"), Reg("%r1"), Imm(5, "int"),
                                            Reg("%p2", neg=True))),
    ("mov.u32 %r1, %tid.x", (Reg("%r1"), Reg("%tid.x"))),
    ("shfl.sync.up.b32 _|%p1, %r2, 1, 0, -1",
     (Pair(Sink(), Reg("%p1")), Reg("%r2"), Imm(1, "int"), Imm(0, "int"), Imm(-1, "int"))),
])
def test_operand_forms(text, operands):
    assert parse_instruction(text, 1).operands == operands


def test_cp_async_modifiers_keep_double_colons():
    ins = parse_instruction("cp.async.cg.shared::cta.global.L2::128B [%r1], [%rd1], 16, %r2", 1)
    assert ins.opcode == "cp"
    assert ins.mods == ("async", "cg", "shared::cta", "global", "L2::128B")


def test_second_entry_launches_alone():
    run(MODULE, "second", (1,), (32,), [])


def test_unknown_entry():
    with pytest.raises(EmulationError, match="'third' is not an .entry"):
        run(MODULE, "third", (1,), (32,), [])


UNSUPPORTED = HEADER + r"""
.visible .entry uses_dp4a(.param .u64 out)
{
	.reg .b32 %r<4>;
	mov.u32 %r1, 7;
	dp4a.u32.u32 %r2, %r1, %r1, %r1;
	ret;
}
"""


def test_unsupported_opcode_is_reported_before_running():
    out = np.zeros(1, np.uint32)
    with pytest.raises(EmulationError) as exc:
        run(UNSUPPORTED, "uses_dp4a", (1,), (32,), [out])
    msg = str(exc.value)
    line = line_of(UNSUPPORTED, "dp4a.u32")
    assert "uses_dp4a" in msg and f"line {line}:" in msg
    assert "dp4a.u32.u32 %r2, %r1, %r1, %r1" in msg
    assert "'dp4a'" in msg and "unsupported opcode" in msg
    assert exc.value.line == line


UNSUPPORTED_MODIFIER = HEADER + r"""
.visible .entry uses_prmt_mode(.param .u64 out)
{
	.reg .b32 %r<4>;
	mov.u32 %r1, 7;
	prmt.b32.f4e %r2, %r1, %r1, %r1;
	ret;
}
"""


def test_unsupported_modifier_is_reported():
    line = line_of(UNSUPPORTED_MODIFIER, "prmt.b32")
    with pytest.raises(EmulationError,
                       match=rf"line {line}: `prmt.b32.f4e.*unsupported modifier .f4e"):
        run(UNSUPPORTED_MODIFIER, "uses_prmt_mode", (1,), (32,), [np.zeros(1, np.uint32)])


POINTER_PARAMS = HEADER + r"""
.visible .entry ptr_params(.param .u64 .ptr .global .align 16 a,
                           .param .u64 .ptr.global.align 8 b, .param .u32 n)
{
	ret;
}
"""


def test_pointer_parameter_attributes():
    entry = parse_module(POINTER_PARAMS).entry("ptr_params")
    assert [(p.name, p.ptype) for p in entry.params] == [("a", "u64"), ("b", "u64"),
                                                         ("n", "u32")]
    run(POINTER_PARAMS, "ptr_params", (1,), (32,),
        [np.zeros(4, np.float32), np.zeros(4, np.float32), np.uint32(4)])
