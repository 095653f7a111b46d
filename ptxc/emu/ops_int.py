"""Integer arithmetic: add sub mul mad div rem min max neg abs (u/s/b 16/32/64).

numpy integer arithmetic wraps modulo 2^n exactly like PTX. Float-typed forms of the same
opcodes are handed to ops_float.
"""

from __future__ import annotations

import numpy as np

from ptxc.emu import ops_float
from ptxc.emu.decode import Mods, expect_operands, register
from ptxc.emu.operands import TYPES, DecodeError, Fault, sint_of, uint_of
from ptxc.emu.memory import _at
from ptxc.emu.opkit import simple_op


def _float_typed(ins) -> bool:
    return any(m in ("f16", "f32", "f64", "bf16", "f16x2", "bf16x2", "f32x2") for m in ins.mods)


def _int_type(m: Mods):
    t = m.one_type()
    if t.kind not in "usb" or t.bits < 16:
        raise DecodeError(f"unsupported type .{t.name}")
    return t


def _wide(t):
    return TYPES[f"{t.kind}{t.bits * 2}"]


def mul_hi(a, b, t):
    """High half of the 2n-bit product of two n-bit integers of type t."""
    n = t.bits
    if n <= 32:
        wide = sint_of(2 * n) if t.signed else uint_of(2 * n)
        p = np.asarray(a).astype(wide) * np.asarray(b).astype(wide)
        return (p >> wide(n)).astype(t.dtype)
    ua = np.asarray(a).view(np.uint64)
    ub = np.asarray(b).view(np.uint64)
    m32, s32 = np.uint64(0xFFFFFFFF), np.uint64(32)
    al, ah, bl, bh = ua & m32, ua >> s32, ub & m32, ub >> s32
    lolo, hilo, lohi, hihi = al * bl, ah * bl, al * bh, ah * bh
    cross = (lolo >> s32) + (hilo & m32) + lohi
    hi = hihi + (hilo >> s32) + (cross >> s32)
    if t.signed:   # signed high part = unsigned high part - (a<0)*b - (b<0)*a  (mod 2^64)
        hi = hi - np.where(np.asarray(a) < 0, ub, np.uint64(0))
        hi = hi - np.where(np.asarray(b) < 0, ua, np.uint64(0))
    return hi.view(t.dtype)


def _divmod(a, b, t):
    """C-style truncating division and remainder (sign of the dividend), wrapping."""
    if not t.signed:
        return a // b, a % b
    u = uint_of(t.bits)
    a, b = np.asarray(a), np.asarray(b)
    ua = np.where(a < 0, (~a.view(u)) + u(1), a.view(u))
    ub = np.where(b < 0, (~b.view(u)) + u(1), b.view(u))
    uq, ur = ua // ub, ua % ub
    q = np.where((a < 0) ^ (b < 0), (~uq) + u(1), uq).astype(u).view(t.dtype)
    r = np.where(a < 0, (~ur) + u(1), ur).astype(u).view(t.dtype)
    return q, r


def _checked_div(which: int, t):
    def fn(sel, a, b):
        a, b = np.atleast_1d(a), np.atleast_1d(b)
        zero = np.broadcast_to(b == 0, np.broadcast(a, b).shape)
        if zero.any():
            k = int(np.flatnonzero(zero)[0])
            raise Fault("integer division by zero (undefined in PTX)", _at(sel, k))
        return _divmod(a, b, t)[which]
    return fn


@register("add", "sub", "mul", "mad", "div", "rem", "min", "max", "neg", "abs")
def decode_arith(ins, env):
    if _float_typed(ins):
        return ops_float.decode_float_arith(ins, env)
    m = Mods(ins)
    op = ins.opcode
    if op in ("add", "sub"):
        sat = m.flag("sat")
        t = _int_type(m)
        m.done()
        expect_operands(ins, 3)
        d, a, b = ins.operands
        if sat and t.name != "s32":
            raise DecodeError(".sat is only defined for .s32")
        if sat:
            def fn(x, y, _sub=op == "sub"):
                w = np.asarray(x).astype(np.int64)
                r = w - y if _sub else w + y
                return np.clip(r, -2**31, 2**31 - 1).astype(np.int32)
        elif op == "add":
            fn = np.add
        else:
            fn = np.subtract
        return simple_op(ins, env, d, t, [(a, t), (b, t)], fn)
    if op in ("mul", "mad"):
        mode = m.need("lo", "hi", "wide")
        t = _int_type(m)
        m.done()
        expect_operands(ins, 3 if op == "mul" else 4)
        if mode == "wide" and t.bits == 64:
            raise DecodeError(".wide needs a 16- or 32-bit type")
        dty = _wide(t) if mode == "wide" else t
        if mode == "lo":
            prod = np.multiply
        elif mode == "hi":
            def prod(x, y):
                return mul_hi(x, y, t)
        else:
            def prod(x, y):
                return np.asarray(x).astype(dty.dtype) * np.asarray(y).astype(dty.dtype)
        srcs = [(ins.operands[1], t), (ins.operands[2], t)]
        if op == "mul":
            return simple_op(ins, env, ins.operands[0], dty, srcs, prod)
        return simple_op(ins, env, ins.operands[0], dty, srcs + [(ins.operands[3], dty)],
                         lambda x, y, z: prod(x, y) + z)
    if op in ("div", "rem"):
        t = _int_type(m)
        m.done()
        expect_operands(ins, 3)
        d, a, b = ins.operands
        return simple_op(ins, env, d, t, [(a, t), (b, t)],
                         _checked_div(0 if op == "div" else 1, t), wants_sel=True)
    if op in ("min", "max"):
        t = _int_type(m)
        m.done()
        expect_operands(ins, 3)
        d, a, b = ins.operands
        return simple_op(ins, env, d, t, [(a, t), (b, t)],
                         np.minimum if op == "min" else np.maximum)
    # neg / abs
    t = _int_type(m)
    m.done()
    expect_operands(ins, 2)
    if not t.signed:
        raise DecodeError(f"{op} needs a signed integer type")
    d, a = ins.operands
    return simple_op(ins, env, d, t, [(a, t)], np.negative if op == "neg" else np.abs)
