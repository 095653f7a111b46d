"""Floating-point arithmetic (.f32, .f64): add sub mul fma mad div min max neg abs, and
rcp sqrt rsqrt ex2 lg2 sin cos tanh.

Rounding: .rn results are IEEE correctly rounded (numpy float32/float64 arithmetic is, and fma
is done exactly, see `_fma_f32`). .rz/.rm/.rp are correctly rounded too, via exact error terms
(fp.round_to_format); the rare f64 forms numpy cannot round exactly use Python fractions.
Without a rounding modifier add/sub/mul are computed unfused with .rn; note ptxas may contract
such a mul+add pair into an fma on hardware, so bit-exact comparisons need explicit .rn.

`.approx` functions are computed (nearly) exactly: float64 math rounded to float32. Real hardware
is less precise (ex2/lg2 about 2 ulp, sin/cos absolute error ~2^-20.5 in [-pi, pi], tanh
relative error ~2^-11, div.approx/div.full 2 ulp): tests of kernels must use tolerances.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from ptxc.emu import fp
from ptxc.emu.decode import Mods, expect_operands, register
from ptxc.emu.operands import DecodeError
from ptxc.emu.opkit import simple_op

F32, F64 = np.float32, np.float64


def _float_type(m: Mods):
    t = m.one_type()
    if t.name == "f32x2":
        return t
    if t.kind != "f" or t.bits not in (32, 64):
        raise DecodeError(f"unsupported floating-point type .{t.name}")
    return t


# ----------------------------------------------------------------------------- f32 kernels

def _round_f32(s, e, mode):
    return fp.round_to_format(s, e, mode, fp.F32).astype(F32)


def _add_f32(a, b, mode):
    if mode == "rn":
        return np.add(a, b, dtype=F32)
    a64, b64 = np.asarray(a, F64), np.asarray(b, F64)
    s, e = fp.two_sum(a64, b64)
    r = fp.round_to_format(s, e, mode, fp.F32)
    return fp.exact_zero_sum(r, s == 0, a64, b64, mode).astype(F32)


def _mul_f32(a, b, mode):
    if mode == "rn":
        return np.multiply(a, b, dtype=F32)
    return _round_f32(np.asarray(a, F64) * np.asarray(b, F64), None, mode)   # product exact


_SMALLEST_NORMAL = 2.0 ** -126


def _fma_f32(a, b, c, mode):
    """Single-rounding fma: the product of two f32 is exact in f64; the sum is rounded to f64
    once and then to f32, which is only wrong (double rounding) when the f64 sum sits exactly
    on an f32 rounding tie or in the f32 subnormal range; those elements are redone exactly
    with TwoSum error terms."""
    p = np.asarray(a, F32).astype(F64) * b
    if mode != "rn":
        return _fma_exact(p, np.asarray(c, F64), mode)
    s = np.atleast_1d(p + c)
    r = s.astype(F32)
    # a tie has its 29 bits below f32 precision equal to 1000...0 (as a 64-bit shift: 1<<63)
    tie = (s.view(np.uint64) << np.uint64(35)) == np.uint64(1 << 63)
    risky = tie | (np.abs(s) < _SMALLEST_NORMAL)
    if risky.any():
        # Most flagged sums are exact (TwoSum error zero) and so already correctly rounded.
        idx = np.flatnonzero(risky)
        sr = s[idx]
        pr = p[idx] if np.ndim(p) else np.full(idx.size, p)
        cr = (c[idx] if np.ndim(c) else np.full(idx.size, c)).astype(F64)
        bb = sr - pr
        err = (pr - (sr - bb)) + (cr - bb)
        redo = (err != 0) | (np.abs(sr) < _SMALLEST_NORMAL)
        if redo.any():
            r[idx[redo]] = _fma_exact(pr[redo], cr[redo], mode)
    return r if np.ndim(p) or np.ndim(c) else r[0]


def _fma_exact(p, c64, mode):
    s, e = fp.two_sum(p, c64)
    res = fp.round_to_format(s, e, mode, fp.F32)
    return fp.exact_zero_sum(res, s == 0, p, c64, mode).astype(F32)


def _div_f32(a, b, mode):
    if mode == "rn":
        return np.divide(a, b, dtype=F32)
    # The f64 quotient cannot overflow or underflow for f32 operands, and the sign of the
    # exact residual a - q*b says on which side of q the true quotient lies.
    a64, b64 = np.asarray(a, F64), np.asarray(b, F64)
    q64 = a64 / b64
    e = fp.residual_sign(a64, q64, b64) * np.sign(b64)
    return _round_f32(q64, e, mode)


def _sqrt_f32(a, mode):
    if mode == "rn":
        return np.sqrt(np.asarray(a, F32))
    a64 = np.asarray(a, F64)
    q64 = np.sqrt(a64)
    return _round_f32(q64, fp.residual_sign(a64, q64, q64), mode)


def _rcp_f32(a, mode):
    return _div_f32(F32(1.0), a, mode)


# ----------------------------------------------------------------------------- f64 kernels

def _add_f64(a, b, mode):
    r = np.add(a, b, dtype=F64)
    if mode == "rn":
        return r
    out, zero = fp.exact_f64(lambda x, y: x + y, mode, r, a, b)
    return fp.exact_zero_sum(out, zero, a, b, mode)


def _mul_f64(a, b, mode):
    r = np.multiply(a, b, dtype=F64)
    return r if mode == "rn" else fp.exact_f64(lambda x, y: x * y, mode, r, a, b)[0]


def _fma_f64(a, b, c, mode):
    r = np.asarray(a, F64) * b + c
    out, zero = fp.exact_f64(lambda x, y, z: x * y + z, mode, r, a, b, c)
    return fp.exact_zero_sum(out, zero, np.asarray(a, F64) * b, c, mode)


def _div_f64(a, b, mode):
    r = np.divide(a, b, dtype=F64)
    return r if mode == "rn" else fp.exact_f64(lambda x, y: x / y, mode, r, a, b)[0]


def _sqrt_f64(a, mode):
    r = np.atleast_1d(np.sqrt(np.asarray(a, F64)))
    if mode == "rn":
        return r
    out = r.copy()
    a1 = np.broadcast_to(np.atleast_1d(a), r.shape)
    for i in range(r.size):
        v, x = float(r[i]), float(a1[i])
        if not math.isfinite(v) or v == 0:
            continue
        sq = Fraction(v) ** 2
        if sq == Fraction(x):
            continue
        above = sq > Fraction(x)           # v overshoots the exact root
        if mode in ("rz", "rm") and above:
            out[i] = math.nextafter(v, 0.0)
        elif mode == "rp" and not above:
            out[i] = math.nextafter(v, math.inf)
    return out


# ----------------------------------------------------------------------------- decoding

_ROUNDINGS = ("rn", "rz", "rm", "rp")


def _min_max(is_min: bool, nan_mode: bool, t):
    u = np.uint32 if t.bits == 32 else np.uint64
    canonical = u(fp.F32_NAN if t.bits == 32 else fp.F64_NAN).view(t.dtype)

    def fn(a, b):
        a, b = np.asarray(a, t.dtype), np.asarray(b, t.dtype)
        r = np.fmin(a, b) if is_min else np.fmax(a, b)     # a NaN operand yields the other
        if not nan_mode and not ((r == 0) | (r != r)).any():
            return r                                       # no signed-zero or NaN cases
        both_zero = (a == 0) & (b == 0)                    # -0 < +0 for min/max
        ua, ub = a.view(u), b.view(u)
        zero = (ua | ub) if is_min else (ua & ub)
        r = np.where(both_zero, zero.view(t.dtype), r)
        if nan_mode:
            r = np.where(np.isnan(a) | np.isnan(b), canonical, r)
        else:
            r = np.where(np.isnan(a) & np.isnan(b), canonical, r)
        return r
    return fn


def _wrap_f32(fn, ftz: bool, sat: bool):
    """Apply .ftz (flush subnormal inputs and result) and .sat (clamp to [0, 1])."""
    if not ftz and not sat:
        return fn

    def wrapped(*args):
        if ftz:
            args = [fp.flush_f32(x) for x in args]
        r = fn(*args)
        if ftz:
            r = fp.flush_f32(r)
        return fp.saturate(r) if sat else r
    return wrapped


def _f32x2(fn):
    """An f32 operation applied to both halves of .f32x2 operands (.b64 registers holding two
    f32, element 0 in the low word), as sm_100's packed add/sub/mul/fma are defined."""
    low, shift = np.uint64(0xFFFFFFFF), np.uint64(32)

    def half(w, hi):
        return np.asarray((w >> shift) if hi else (w & low)).astype(np.uint32).view(F32)

    def packed(*args):
        words = [np.asarray(a, np.uint64) for a in args]
        lo = np.asarray(fn(*[half(w, False) for w in words]), F32)
        hi = np.asarray(fn(*[half(w, True) for w in words]), F32)
        return lo.view(np.uint32).astype(np.uint64) | (hi.view(np.uint32).astype(np.uint64)
                                                        << shift)
    return packed


def decode_float_arith(ins, env):
    """add sub mul fma mad div min max neg abs with a float type (called from ops_int)."""
    m = Mods(ins)
    op = ins.opcode
    mode = m.flag(*_ROUNDINGS)
    approx = m.flag("approx", "full") if op == "div" else None
    ftz, sat = m.flag("ftz"), m.flag("sat")
    nan = m.flag("NaN") if op in ("min", "max") else None
    t = _float_type(m)
    m.done()
    packed = t.name == "f32x2"
    if packed and op not in ("add", "sub", "mul", "fma"):
        raise DecodeError(f"{op} has no .f32x2 form (add, sub, mul and fma do)")
    f64 = t.bits == 64 and not packed
    if (ftz or sat) and f64:
        raise DecodeError(".ftz/.sat are only defined for .f32")
    if op == "fma" and mode is None:
        raise DecodeError("fma needs a rounding modifier (.rn/.rz/.rm/.rp)")
    if op == "div" and mode is None and approx is None:
        raise DecodeError("div needs .approx, .full or a rounding modifier")
    if op in ("min", "max", "neg", "abs") and mode is not None:
        raise DecodeError(f"{op} takes no rounding modifier")
    if op in ("min", "max", "neg", "abs") and sat:
        raise DecodeError(f"{op} has no .sat form")
    if approx and (f64 or mode):
        raise DecodeError(f"div.{approx} is only defined for .f32 without a rounding modifier")
    mode = mode or "rn"
    nops = {"neg": 2, "abs": 2, "fma": 4, "mad": 4}.get(op, 3)
    three = op in ("min", "max") and len(ins.operands) == 4 and t.bits == 32
    expect_operands(ins, 4 if three else nops)     # sm_100: min/max of three f32 inputs
    if op in ("neg", "abs"):
        u = np.uint32 if not f64 else np.uint64
        sign = u(1 << (t.bits - 1))
        if op == "neg":
            core = lambda a: (np.asarray(a, t.dtype).view(u) ^ sign).view(t.dtype)  # noqa
        else:
            core = lambda a: (np.asarray(a, t.dtype).view(u) & ~sign).view(t.dtype)  # noqa
    elif op in ("min", "max"):
        two = _min_max(op == "min", bool(nan), t)
        core = (lambda a, b, c: two(two(a, b), c)) if three else two
    elif f64:
        core = {"add": lambda a, b: _add_f64(a, b, mode),
                "sub": lambda a, b: _add_f64(a, -np.asarray(b, F64), mode),
                "mul": lambda a, b: _mul_f64(a, b, mode),
                "div": lambda a, b: _div_f64(a, b, mode),
                "fma": lambda a, b, c: _fma_f64(a, b, c, mode),
                "mad": lambda a, b, c: _fma_f64(a, b, c, mode)}[op]
    else:
        core = {"add": lambda a, b: _add_f32(a, b, mode),
                "sub": lambda a, b: _add_f32(a, -np.asarray(b, F32), mode),
                "mul": lambda a, b: _mul_f32(a, b, mode),
                "div": lambda a, b: _div_f32(a, b, mode),
                "fma": lambda a, b, c: _fma_f32(a, b, c, mode),
                "mad": lambda a, b, c: _fma_f32(a, b, c, mode)}[op]
    fn = _wrap_f32(core, bool(ftz), bool(sat))
    if packed:
        fn = _f32x2(fn)
    d, *srcs = ins.operands
    return simple_op(ins, env, d, t, [(s, t) for s in srcs], fn)


def _exact_unary_f32(f64fn):
    """An .approx function evaluated in float64 and rounded once to float32."""
    def fn(a):
        return f64fn(np.asarray(a, F64)).astype(F32)
    return fn


_APPROX_F32 = {
    "ex2": np.exp2, "lg2": np.log2, "sin": np.sin, "cos": np.cos, "tanh": np.tanh,
    "rsqrt": lambda x: 1.0 / np.sqrt(x),
}


@register("rcp", "sqrt", "rsqrt", "ex2", "lg2", "sin", "cos", "tanh")
def decode_float_unary(ins, env):
    m = Mods(ins)
    op = ins.opcode
    approx = m.flag("approx")
    mode = m.flag(*_ROUNDINGS)
    ftz = m.flag("ftz")
    t = _float_type(m)
    m.done()
    expect_operands(ins, 2)
    f64 = t.bits == 64
    if bool(approx) == bool(mode):
        raise DecodeError("needs exactly one of .approx or a rounding modifier")
    if ftz and f64:
        raise DecodeError(".ftz is only defined for .f32")
    if op in _APPROX_F32 and not approx:
        raise DecodeError(f"{op} is only defined with .approx")
    if approx and f64:
        raise DecodeError(f"{op}.approx.f64 is not supported (its hardware precision is "
                          f"reduced, so an exact result would mislead)")
    if op not in ("rcp", "sqrt") and f64:
        raise DecodeError(f"{op}.f64 does not exist")
    mode = mode or "rn"
    if op in _APPROX_F32:
        core = _exact_unary_f32(_APPROX_F32[op])
    elif op == "rcp":
        core = (lambda a: _div_f64(F64(1.0), a, mode)) if f64 else (lambda a: _rcp_f32(a, mode))
    else:
        core = (lambda a: _sqrt_f64(a, mode)) if f64 else (lambda a: _sqrt_f32(a, mode))
    fn = _wrap_f32(core, bool(ftz), False)
    return simple_op(ins, env, ins.operands[0], t, [(ins.operands[1], t)], fn)


@register("fma")
def decode_fma(ins, env):
    return decode_float_arith(ins, env)
