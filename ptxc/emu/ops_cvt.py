"""cvt (all int/float combinations, packed f16x2/bf16x2) and cvta.

Conversions are correctly rounded in every mode: the source is taken as an exact float64 (or
an exact float64 pair for 64-bit integers) and rounded once by fp.round_to_format.
Float -> int rounds per .rni/.rzi/.rmi/.rpi and saturates to the destination range (NaN -> 0);
int -> int truncates/extends, or clamps with .sat. A destination register wider than the
destination type receives the value sign-extended (signed types) or zero-extended.
FP8 pairs (sm_89+): cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32 and cvt.rn.f16x2.{e4m3x2,e5m2x2},
with the semantics of ptxc.emu.fp8.
"""

from __future__ import annotations

import numpy as np

from ptxc.emu import fp, fp8
from ptxc.emu.decode import Mods, expect_operands, register
from ptxc.emu.memory import GENERIC_SHARED_BASE, GENERIC_SHARED_END, PARAM_BASE, _at
from ptxc.emu.operands import TYPES, DecodeError, Fault
from ptxc.emu.opkit import simple_op

_FMT = {"f16": fp.F16, "bf16": fp.BF16, "f32": fp.F32, "f64": fp.F64}
_IRND = ("rni", "rzi", "rmi", "rpi")
_FRND = ("rn", "rz", "rm", "rp")


def float_to_f64(x, t):
    """Exact float64 value of a float operand of type t (f16/bf16 arrive as raw bits)."""
    if t.name == "bf16":
        return fp.bf16_bits_to_f32(x).astype(np.float64)
    return np.asarray(x).astype(np.float64)


def _int_value_pair(x, t):
    return fp.int_to_pair(np.asarray(x, t.dtype))


def encode_float(v64, dst):
    """float64 values already representable in dst -> dst's compute dtype/bits."""
    if dst.name == "f16":
        return fp.encode_f16(v64).view(np.float16)
    if dst.name == "bf16":
        return fp.encode_bf16(v64)
    return np.asarray(v64).astype(dst.dtype)


def _post_float(v64, dst, relu, satfinite, sat):
    if relu:
        v64 = np.where(np.isnan(v64), v64, np.maximum(v64, 0.0))
    if satfinite:
        mx = _FMT[dst.name].max_finite
        v64 = np.where(np.isinf(v64), np.copysign(mx, v64), v64)
    if sat:
        v64 = fp.saturate(v64)
    return v64


def float_convert(src, dst, mode, ftz, relu=False, satfinite=False, sat=False):
    """Return fn(x) converting float src -> float dst (x as read for src)."""
    narrowing = dst.bits < src.bits or (dst.bits == src.bits and dst.name != src.name)
    fast = (mode == "rn" and src.name == "f32" and not (relu or satfinite or sat or ftz))
    if fast and dst.name == "f16":
        return lambda x: fp.f32_to_f16_rn(x).view(np.float16)
    if fast and dst.name == "bf16":
        return fp.f32_to_bf16_rn

    def fn(x):
        if ftz and src.name == "f32":
            x = fp.flush_f32(x)
        v = float_to_f64(x, src)
        if mode in _IRND:
            v = fp.round_integral(v, mode)
        elif narrowing:
            v = fp.round_to_format(v, None, mode, _FMT[dst.name])
        v = _post_float(v, dst, relu, satfinite, sat)
        out = encode_float(v, dst)
        return fp.flush_f32(out) if ftz and dst.name == "f32" else out
    return fn


def int_convert(src, dst, sat):
    info = np.iinfo(dst.dtype)

    def fn(x):
        x = np.asarray(x, src.dtype)
        if not sat:
            return x.astype(dst.dtype)      # C casts: wrap on narrowing, extend on widening
        if not src.signed:
            return np.minimum(x.astype(np.uint64), np.uint64(info.max)).astype(dst.dtype)
        w = x.astype(np.int64)
        if info.min == 0:
            w = np.maximum(w, 0)
            return np.minimum(w.astype(np.uint64), np.uint64(info.max)).astype(dst.dtype)
        return np.clip(w, info.min, info.max).astype(dst.dtype)
    return fn


def int_to_float(src, dst, mode, sat):
    fmt = _FMT[dst.name]

    def fn(x):
        s, e = _int_value_pair(x, src)
        v = fp.round_to_format(s, e, mode, fmt)
        return encode_float(fp.saturate(v) if sat else v, dst)
    return fn


def float_to_int(src, dst, mode, ftz):
    def fn(x):
        if ftz and src.name == "f32":
            x = fp.flush_f32(x)
        return fp.float_to_int(float_to_f64(x, src), mode, dst.dtype)
    return fn


@register("cvt")
def decode_cvt(ins, env):
    m = Mods(ins)
    mode = m.flag(*_IRND, *_FRND)
    ftz, sat = m.flag("ftz"), m.flag("sat")
    relu, satfinite = m.flag("relu"), m.flag("satfinite")
    types = m.types()
    m.done()
    if len(types) != 2:
        raise DecodeError("cvt needs a destination and a source type")
    dst, src = types
    if dst.name in fp8.PAIR_TYPES or src.name in fp8.PAIR_TYPES:
        return _decode_fp8(ins, env, dst, src, mode, relu or ftz or sat, satfinite)
    if dst.name in ("f16x2", "bf16x2"):
        return _decode_x2(ins, env, dst, src, mode, relu, satfinite, sat or ftz)
    expect_operands(ins, 2)
    d, a = ins.operands
    if dst.kind == "p" or src.kind == "p":
        raise DecodeError("cvt does not take .pred")
    dfl, sfl = dst.is_float, src.is_float
    if (relu or satfinite) and dst.name not in ("f16", "bf16"):
        raise DecodeError(".relu/.satfinite apply to .f16/.bf16 destinations only")
    if ftz and not (src.name == "f32" or dst.name == "f32"):
        raise DecodeError(".ftz applies to .f32 operands only")
    if not dfl and not sfl:
        if mode or ftz:
            raise DecodeError("integer-to-integer cvt takes no rounding or .ftz")
        fn = int_convert(src, dst, bool(sat))
    elif dfl and not sfl:
        if mode not in _FRND:
            raise DecodeError("int-to-float cvt needs .rn/.rz/.rm/.rp")
        fn = int_to_float(src, dst, mode, bool(sat))
    elif sfl and not dfl:
        if mode not in _IRND:
            raise DecodeError("float-to-int cvt needs .rni/.rzi/.rmi/.rpi")
        fn = float_to_int(src, dst, mode, bool(ftz))
    else:
        if mode in _IRND and dst.bits < src.bits:
            raise DecodeError("integer rounding to a narrower float type is not supported")
        narrowing = dst.bits < src.bits or (dst.bits == src.bits and dst.name != src.name)
        if narrowing and mode not in _FRND:
            raise DecodeError(f"cvt.{dst.name}.{src.name} needs .rn/.rz/.rm/.rp")
        if not narrowing and mode in _FRND:
            raise DecodeError("a widening float cvt takes no .rn/.rz/.rm/.rp")
        fn = float_convert(src, dst, mode, bool(ftz), bool(relu), bool(satfinite), bool(sat))
    return simple_op(ins, env, d, dst, [(a, src)], fn)


def _decode_x2(ins, env, dst, src, mode, relu, satfinite, bad):
    if src.name != "f32" or mode not in ("rn", "rz") or bad:
        raise DecodeError(f"only cvt.{{rn,rz}}{{.relu}}{{.satfinite}}.{dst.name}.f32 is supported")
    expect_operands(ins, 3)
    d, a, b = ins.operands
    half = TYPES["f16" if dst.name == "f16x2" else "bf16"]
    one = float_convert(TYPES["f32"], half, mode, False, bool(relu), bool(satfinite))

    def fn(x, y):
        hi = np.asarray(one(x)).view(np.uint16).astype(np.uint32)
        lo = np.asarray(one(y)).view(np.uint16).astype(np.uint32)
        return (hi << np.uint32(16)) | lo        # a -> upper half, b -> lower half
    f32 = TYPES["f32"]
    return simple_op(ins, env, d, TYPES["b32"], [(a, f32), (b, f32)], fn)


def _decode_fp8(ins, env, dst, src, mode, bad, satfinite):
    if mode != "rn" or bad:
        raise DecodeError("FP8 cvt takes .rn (and .satfinite when converting to FP8) only")
    if dst.name in fp8.PAIR_TYPES and src.name == "f32":
        if not satfinite:
            raise DecodeError(f"cvt.rn.{dst.name}.f32 needs .satfinite")
        expect_operands(ins, 3)
        d, a, b = ins.operands
        kind = dst.name[:4]

        def pack(x, y):   # a -> upper byte, b -> lower byte
            hi = fp8.quantize(x, kind).astype(np.uint16)
            return (hi << np.uint16(8)) | fp8.quantize(y, kind).astype(np.uint16)
        f32 = TYPES["f32"]
        return simple_op(ins, env, d, TYPES["b16"], [(a, f32), (b, f32)], pack)
    if dst.name == "f16x2" and src.name in fp8.PAIR_TYPES:
        if satfinite:
            raise DecodeError("cvt.rn.f16x2 from FP8 takes no .satfinite")
        expect_operands(ins, 2)
        d, a = ins.operands
        kind = src.name[:4]

        def unpack(x):
            x = np.asarray(x, np.uint16)
            lo = fp8.to_f16_bits(x & np.uint16(0xFF), kind).astype(np.uint32)
            hi = fp8.to_f16_bits(x >> np.uint16(8), kind).astype(np.uint32)
            return (hi << np.uint32(16)) | lo
        return simple_op(ins, env, d, TYPES["b32"], [(a, TYPES["b16"])], unpack)
    raise DecodeError(f"unsupported FP8 cvt .{dst.name}.{src.name}; supported: "
                      f".rn.satfinite.{{e4m3x2,e5m2x2}}.f32 and .rn.f16x2.{{e4m3x2,e5m2x2}}")


@register("cvta")
def decode_cvta(ins, env):
    m = Mods(ins)
    to = m.flag("to")
    space = m.need("global", "shared", "param")
    t = m.one_type()
    m.done()
    expect_operands(ins, 2)
    if t.name not in ("u64", "b64", "s64"):
        raise DecodeError("only the 64-bit form (.u64) of cvta is supported")
    d, a = ins.operands
    u64 = TYPES["u64"]
    if space == "param" and not to:   # a parameter-space offset (below PARAM_BASE) or an
        base = np.uint64(PARAM_BASE)  # address already generic (a 64-bit mov of a parameter)
        return simple_op(ins, env, d, u64, [(a, u64)],
                         lambda x: np.where(np.asarray(x, np.uint64) < base, x + base, x))
    if space == "param":
        raise DecodeError("cvta.to.param is not supported")
    if space == "global":   # global addresses are their own generic addresses
        return simple_op(ins, env, d, u64, [(a, u64)], lambda x: x)
    if not to:
        return simple_op(ins, env, d, u64, [(a, u64)],
                         lambda x: np.asarray(x, np.uint64) + np.uint64(GENERIC_SHARED_BASE))

    def to_shared(sel, x):
        x = np.atleast_1d(np.asarray(x, np.uint64))
        bad = (x < np.uint64(GENERIC_SHARED_BASE)) | (x >= np.uint64(GENERIC_SHARED_END))
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise Fault(f"cvta.to.shared of 0x{int(x[k]):x}, which is not a generic address "
                        f"of shared memory", _at(sel, k), int(x[k]))
        return x - np.uint64(GENERIC_SHARED_BASE)
    return simple_op(ins, env, d, u64, [(a, u64)], to_shared, wants_sel=True)
