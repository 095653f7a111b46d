"""Bitwise and predicate ops: and or xor not cnot shl shr popc clz brev bfe bfi bfind prmt
lop3, selp, setp, and mov (including vector pack/unpack)."""

from __future__ import annotations

import numpy as np

from ptxc.emu.decode import NORMAL, Mods, Op, expect_operands, register
from ptxc.emu.operands import TYPES, DecodeError, dst_plan, src_plan, uint_of
from ptxc.emu.opkit import multi_op, simple_op
from ptxc.emu.ptx_ast import Imm, Pair, Vec

U32 = TYPES["u32"]
PRED = TYPES["pred"]


def _bits_type(m: Mods, allow_pred=True):
    t = m.one_type()
    if t.kind == "p" and not allow_pred:
        raise DecodeError(".pred is not allowed here")
    if t.kind not in "pusb" or (t.kind != "p" and t.bits < 16):
        raise DecodeError(f"unsupported type .{t.name}")
    return t


@register("and", "or", "xor", "not", "cnot")
def decode_bitwise(ins, env):
    m = Mods(ins)
    t = _bits_type(m, allow_pred=ins.opcode != "cnot")
    m.done()
    op = ins.opcode
    if op in ("not", "cnot"):
        expect_operands(ins, 2)
        if op == "cnot":
            fn = lambda a: (np.asarray(a) == 0).astype(t.dtype)  # noqa: E731
        else:
            fn = np.logical_not if t.kind == "p" else np.invert
        return simple_op(ins, env, ins.operands[0], t, [(ins.operands[1], t)], fn)
    expect_operands(ins, 3)
    if t.kind == "p":
        fn = {"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}[op]
    else:
        fn = {"and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor}[op]
    d, a, b = ins.operands
    return simple_op(ins, env, d, t, [(a, t), (b, t)], fn)


@register("shl", "shr")
def decode_shift(ins, env):
    m = Mods(ins)
    t = _bits_type(m, allow_pred=False)
    m.done()
    expect_operands(ins, 3)
    if ins.opcode == "shl" and t.kind == "s":
        raise DecodeError("shl takes a .b type")
    d, a, b = ins.operands
    n, dt = t.bits, t.dtype
    left = ins.opcode == "shl"
    # PTX clamps shift amounts >= the width: shl/shr.u give 0, shr.s fills with the sign bit.
    if isinstance(b, Imm) and 0 <= b.value < n:
        amount = dt(b.value)
        fn = (lambda x: x << amount) if left else (lambda x: x >> amount)
        return simple_op(ins, env, d, t, [(a, t)], fn)

    def fn(x, s):
        s = np.asarray(s, np.uint32)
        clamped = np.minimum(s, n - 1).astype(dt)
        if left:
            return np.where(s >= n, dt(0), x << clamped)
        if t.signed:
            return x >> clamped   # for s >= n this is the sign fill, as required
        return np.where(s >= n, dt(0), x >> clamped)
    return simple_op(ins, env, d, t, [(a, t), (b, U32)], fn)


def bit_length(x):
    """Number of significant bits of unsigned values (0 for 0), exact for 64-bit."""
    x = np.array(x, copy=True)
    shift = 1
    while shift < x.dtype.itemsize * 8:
        x |= x >> x.dtype.type(shift)
        shift *= 2
    return np.bitwise_count(x).astype(np.int64)


_BYTE_REVERSED = np.array([int(f"{i:08b}"[::-1], 2) for i in range(256)], np.uint8)


def bit_reverse(x):
    x = np.ascontiguousarray(np.atleast_1d(x))
    b = x.view(np.uint8).reshape(x.size, x.dtype.itemsize)
    return np.ascontiguousarray(_BYTE_REVERSED[b[:, ::-1]]).view(x.dtype).reshape(x.shape)


@register("popc", "clz", "brev", "bfind")
def decode_bitcount(ins, env):
    m = Mods(ins)
    shiftamt = m.flag("shiftamt") if ins.opcode == "bfind" else None
    t = _bits_type(m, allow_pred=False)
    m.done()
    expect_operands(ins, 2)
    if t.bits < 32:
        raise DecodeError(f"unsupported type .{t.name}")
    n, u = t.bits, uint_of(t.bits)
    d, a = ins.operands
    if ins.opcode == "popc":
        return simple_op(ins, env, d, U32, [(a, t)],
                         lambda x: np.bitwise_count(np.asarray(x).view(u)).astype(np.uint32))
    if ins.opcode == "clz":
        return simple_op(ins, env, d, U32, [(a, t)],
                         lambda x: (n - bit_length(np.asarray(x).view(u))).astype(np.uint32))
    if ins.opcode == "brev":
        return simple_op(ins, env, d, t, [(a, t)], bit_reverse)

    def bfind(x):
        x = np.asarray(x)
        mag = np.where(x < 0, ~x, x).view(u) if t.signed else x
        pos = bit_length(mag) - 1
        if shiftamt:
            pos = np.where(pos < 0, -1, n - 1 - pos)
        return np.where(pos < 0, np.uint32(0xFFFFFFFF), pos.astype(np.uint32))
    return simple_op(ins, env, d, U32, [(a, t)], bfind)


def _mask64(nbits):
    """(1 << nbits) - 1 as uint64 for nbits in [0, 64]."""
    nbits = np.asarray(nbits, np.int64)
    full = np.uint64(0xFFFFFFFFFFFFFFFF)
    return np.where(nbits >= 64, full,
                    (np.uint64(1) << np.minimum(nbits, 63).astype(np.uint64)) - np.uint64(1))


def bfe(a, b, c, t):
    n, u = t.bits, uint_of(t.bits)
    pos = np.asarray(b, np.int64) & 0xFF
    ln = np.asarray(c, np.int64) & 0xFF
    ua = np.asarray(a).view(u).astype(np.uint64)
    shifted = np.where(pos >= n, np.uint64(0), ua >> np.minimum(pos, 63).astype(np.uint64))
    nbits = np.clip(np.minimum(ln, n - np.minimum(pos, n)), 0, n)
    mask = _mask64(nbits)
    val = shifted & mask
    if t.signed:
        spos = np.clip(np.minimum(pos + ln - 1, n - 1), 0, 63).astype(np.uint64)
        sbit = np.where(ln == 0, np.uint64(0), (ua >> spos) & np.uint64(1))
        val = np.where(sbit == 1, val | ~mask, val)
    return val.astype(u).view(t.dtype)


def bfi(a, b, c, d, t):
    n, u = t.bits, uint_of(t.bits)
    pos = np.asarray(c, np.int64) & 0xFF
    ln = np.asarray(d, np.int64) & 0xFF
    nbits = np.clip(np.minimum(ln, n - np.minimum(pos, n)), 0, n)
    sh = np.minimum(pos, n - 1).astype(np.uint64)
    mask = np.where(pos >= n, np.uint64(0), _mask64(nbits) << sh)
    ua = np.asarray(a).view(u).astype(np.uint64)
    ub = np.asarray(b).view(u).astype(np.uint64)
    return ((ub & ~mask) | ((ua << sh) & mask)).astype(u).view(t.dtype)


@register("bfe", "bfi")
def decode_bitfield(ins, env):
    m = Mods(ins)
    t = _bits_type(m, allow_pred=False)
    m.done()
    if t.bits < 32:
        raise DecodeError(f"unsupported type .{t.name}")
    if ins.opcode == "bfe":
        expect_operands(ins, 4)
        d, a, b, c = ins.operands
        return simple_op(ins, env, d, t, [(a, t), (b, U32), (c, U32)],
                         lambda x, y, z: bfe(x, y, z, t))
    expect_operands(ins, 5)
    f, a, b, c, dd = ins.operands
    return simple_op(ins, env, f, t, [(a, t), (b, t), (c, U32), (dd, U32)],
                     lambda w, x, y, z: bfi(w, x, y, z, t))


def prmt(a, b, c):
    tmp = (np.asarray(b, np.uint32).astype(np.uint64) << np.uint64(32)) | np.asarray(a, np.uint32)
    c = np.asarray(c, np.uint32)
    out = np.zeros(np.broadcast(tmp, c).shape, np.uint32)
    for i in range(4):
        s = (c >> np.uint32(4 * i)) & np.uint32(0xF)
        byte = ((tmp >> (np.uint64(8) * (s & np.uint32(7)).astype(np.uint64))) & np.uint64(0xFF))
        byte = byte.astype(np.uint32)
        byte = np.where((s & np.uint32(8)) != 0,
                        np.where((byte & np.uint32(0x80)) != 0, np.uint32(0xFF), np.uint32(0)),
                        byte)
        out |= byte << np.uint32(8 * i)
    return out


@register("prmt")
def decode_prmt(ins, env):
    m = Mods(ins)
    t = m.one_type()
    m.done()   # only the default mode: .f4e/.b4e/.rc8/.ecl/.ecr/.rc16 are rejected here
    if t.name != "b32":
        raise DecodeError("prmt needs .b32")
    expect_operands(ins, 4)
    d, a, b, c = ins.operands
    return simple_op(ins, env, d, t, [(a, t), (b, t), (c, t)], prmt)


@register("lop3")
def decode_lop3(ins, env):
    m = Mods(ins)
    t = m.one_type()
    m.done()
    expect_operands(ins, 5)
    d, a, b, c, lut = ins.operands
    if t.name != "b32" or not isinstance(lut, Imm):
        raise DecodeError("only lop3.b32 d, a, b, c, immLut is supported")
    terms = [k for k in range(8) if (lut.value >> k) & 1]

    def fn(x, y, z):
        out = np.zeros(np.broadcast(x, y, z).shape, np.uint32)
        for k in terms:
            out |= (x if k & 4 else ~x) & (y if k & 2 else ~y) & (z if k & 1 else ~z)
        return out
    return simple_op(ins, env, d, t, [(a, t), (b, t), (c, t)], fn)


@register("selp")
def decode_selp(ins, env):
    m = Mods(ins)
    t = m.one_type()
    m.done()
    expect_operands(ins, 4)
    d, a, b, c = ins.operands
    return simple_op(ins, env, d, t, [(a, t), (b, t), (c, PRED)],
                     lambda x, y, p: np.where(p, x, y).astype(t.dtype))


_INT_CMP = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
            "gt": np.greater, "ge": np.greater_equal, "lo": np.less, "ls": np.less_equal,
            "hi": np.greater, "hs": np.greater_equal}
_FLOAT_ORDERED = {"eq": np.equal, "lt": np.less, "le": np.less_equal, "gt": np.greater,
                  "ge": np.greater_equal,
                  # IEEE != is true for NaN; PTX's ordered .ne is false when either is NaN
                  "ne": lambda a, b: (a == a) & (b == b) & (a != b)}
_BOOL = {"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}


def compare(cmp: str, t):
    if t.kind == "f":
        if cmp in _FLOAT_ORDERED:
            return _FLOAT_ORDERED[cmp]
        if cmp == "num":
            return lambda a, b: ~(np.isnan(a) | np.isnan(b))
        if cmp == "nan":
            return lambda a, b: np.isnan(a) | np.isnan(b)
        base = _FLOAT_ORDERED[cmp[:-1]]   # equ/neu/ltu/...: true when either is NaN
        return lambda a, b: base(a, b) | np.isnan(a) | np.isnan(b)
    if cmp in ("lo", "ls", "hi", "hs") and t.signed:
        raise DecodeError(f".{cmp} is an unsigned comparison")
    return _INT_CMP[cmp]


@register("setp")
def decode_setp(ins, env):
    from ptxc.emu.fp import flush_f32
    m = Mods(ins)
    cmp = m.need(*_INT_CMP, "equ", "neu", "ltu", "leu", "gtu", "geu", "num", "nan")
    boolop = m.flag("and", "or", "xor")
    ftz = m.flag("ftz")
    t = m.one_type()
    m.done()
    if t.kind == "p" or t.kind == "bf" or (t.kind == "f" and t.bits == 16):
        raise DecodeError(f"unsupported type .{t.name}")
    if t.kind != "f" and (cmp not in _INT_CMP or ftz):
        raise DecodeError(f"unsupported comparison .{cmp}{' with .ftz' if ftz else ''} "
                          f"for .{t.name}")
    expect_operands(ins, 4 if boolop else 3)
    if bool(boolop) != (len(ins.operands) == 4):
        raise DecodeError("a predicate operand c needs .and/.or/.xor and vice versa")
    dst = ins.operands[0]
    dsts = [(dst.first, PRED), (dst.second, PRED)] if isinstance(dst, Pair) else [(dst, PRED)]
    f = compare(cmp, t)
    if ftz and t.bits == 32:
        base = f
        f = lambda a, b: base(flush_f32(a), flush_f32(b))  # noqa: E731
    srcs = [(ins.operands[1], t), (ins.operands[2], t)]
    if boolop:
        combine = _BOOL[boolop]
        srcs.append((ins.operands[3], PRED))

        def fn(a, b, c):
            r = f(a, b)
            return combine(r, c), combine(~r, c)
    else:
        def fn(a, b):
            r = f(a, b)
            return r, ~r
    return multi_op(ins, env, dsts, srcs, fn)


@register("mov")
def decode_mov(ins, env):
    m = Mods(ins)
    t = m.one_type()
    m.done()
    expect_operands(ins, 2)
    d, a = ins.operands
    if isinstance(d, Vec) or isinstance(a, Vec):
        return _pack_unpack(ins, env, t, d, a)
    return simple_op(ins, env, d, t, [(a, t)], lambda x: x)


def _pack_unpack(ins, env, t, d, a):
    vec = d if isinstance(d, Vec) else a
    k = len(vec.items)
    if t.kind == "p" or t.bits % k or t.bits // k < 8 or k not in (2, 4):
        raise DecodeError(f"cannot split .{t.name} into {k} elements")
    esize = t.bits // k
    et, wide = TYPES[f"b{esize}"], uint_of(t.bits)
    if isinstance(d, Vec) and isinstance(a, Vec):
        raise DecodeError("mov cannot have vector operands on both sides")
    if isinstance(d, Vec):   # unpack: element 0 = lowest bits
        dsts = [(item, et) for item in d.items]

        def unpack(x):
            x = np.asarray(x).view(wide)
            return tuple((x >> wide(esize * i)).astype(et.dtype) for i in range(k))
        return multi_op(ins, env, dsts, [(a, t)], unpack)
    splans = [src_plan(env, item, et) for item in a.items]
    dplan = dst_plan(env, d, TYPES[f"b{t.bits}"])

    def bind(ctx):
        readers = [p(ctx) for p in splans]
        write = dplan(ctx)

        def run(sel):
            out = np.asarray(readers[0](sel)).astype(wide)
            for i in range(1, k):
                out = out | (np.asarray(readers[i](sel)).astype(wide) << wide(esize * i))
            write(sel, out)
        return run
    return Op(NORMAL, ins, bind)
