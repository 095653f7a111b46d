"""Integer and bit instructions against Python-integer references of the PTX semantics."""

import numpy as np
import pytest

from .helpers import ew_kernel, run_ew

RNG = np.random.default_rng(1234)


def samples(t: str, n: int = 192):
    bits, signed = int(t[1:]), t[0] == "s"
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    special = [0, 1, 2, 3, hi, hi - 1, lo, lo + 1, -1 if signed else hi >> 1, 7, 255, 256]
    rnd = [int(x) for x in RNG.integers(lo, hi, n - len(special), dtype=np.int64,
                                        endpoint=True)] if bits < 64 else \
        [int.from_bytes(RNG.bytes(8), "little") - (1 << 63 if signed else 0)
         for _ in range(n - len(special))]
    vals = special + rnd
    return np.array(vals, dtype={"u": "uint", "s": "int", "b": "uint"}[t[0]] + str(bits))


def wrap(v: int, bits: int, signed: bool) -> int:
    v &= (1 << bits) - 1
    return v - (1 << bits) if signed and v >= 1 << (bits - 1) else v


def ctrunc_div(a, b):
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q


def check_binary(op: str, t: str, ref, bt: str | None = None, dt: str | None = None,
                 a=None, b=None):
    """Run `op %d, %a, %b` elementwise and compare with ref(a, b) (Python ints)."""
    bt, dt = bt or t, dt or t
    a = samples(t) if a is None else a
    b = np.roll(samples(bt), 5) if b is None else b
    k = ew_kernel("k", [("a", t), ("b", bt)], [("d", dt)], f"\t{op} %d, %a, %b;")
    (d,) = run_ew(k, "k", [a, b], [dt])
    bits, signed = int(dt[1:]), dt[0] == "s"
    expect = [wrap(ref(int(x), int(y)), bits, signed) for x, y in zip(a, b)]
    assert d.tolist() == expect, op


@pytest.mark.parametrize("t", ["u16", "u32", "s32", "u64", "s64"])
def test_add_sub_mul_lo_wrap(t):
    check_binary(f"add.{t}", t, lambda x, y: x + y)
    check_binary(f"sub.{t}", t, lambda x, y: x - y)
    check_binary(f"mul.lo.{t}", t, lambda x, y: x * y)


@pytest.mark.parametrize("t", ["u16", "s16", "u32", "s32", "u64", "s64"])
def test_mul_hi(t):
    bits = int(t[1:])
    check_binary(f"mul.hi.{t}", t, lambda x, y: (x * y) >> bits)


@pytest.mark.parametrize("t, wide", [("u16", "u32"), ("s16", "s32"), ("u32", "u64"),
                                     ("s32", "s64")])
def test_mul_wide(t, wide):
    check_binary(f"mul.wide.{t}", t, lambda x, y: x * y, dt=wide)


@pytest.mark.parametrize("t, mode", [("s32", "lo"), ("u32", "hi"), ("s64", "hi"),
                                     ("s32", "wide"), ("u64", "lo")])
def test_mad(t, mode):
    bits = int(t[1:])
    ct = t[0] + str(2 * bits) if mode == "wide" else t
    a, b, c = samples(t), np.roll(samples(t), 3), np.roll(samples(ct), 11)
    k = ew_kernel("k", [("a", t), ("b", t), ("c", ct)], [("d", ct)],
                  f"\tmad.{mode}.{t} %d, %a, %b, %c;")
    (d,) = run_ew(k, "k", [a, b, c], [ct])
    prod = {"lo": lambda x, y: x * y, "hi": lambda x, y: (x * y) >> bits,
            "wide": lambda x, y: x * y}[mode]
    dbits = int(ct[1:])
    expect = [wrap(wrap(prod(int(x), int(y)), dbits, t[0] == "s") + int(z), dbits, t[0] == "s")
              for x, y, z in zip(a, b, c)]
    assert d.tolist() == expect


@pytest.mark.parametrize("t", ["u32", "s32", "u64", "s64"])
def test_div_rem_truncate_toward_zero(t):
    a = samples(t)
    b = np.roll(samples(t), 7)
    b[b == 0] = 3
    signed = t[0] == "s"
    bits = int(t[1:])
    if signed:
        a[:2], b[:2] = -(1 << (bits - 1)), -1          # INT_MIN / -1 wraps to INT_MIN, rem 0
        a[2:6], b[2:6] = [7, -7, 7, -7], [2, 2, -2, -2]
    check_binary(f"div.{t}", t, ctrunc_div, a=a, b=b)
    check_binary(f"rem.{t}", t, lambda x, y: x - ctrunc_div(x, y) * y, a=a, b=b)


def test_sat_add_sub_and_min_max_neg_abs():
    lim = lambda v: max(-(1 << 31), min((1 << 31) - 1, v))  # noqa: E731
    check_binary("add.sat.s32", "s32", lambda x, y: lim(x + y))
    check_binary("sub.sat.s32", "s32", lambda x, y: lim(x - y))
    for t in ("u32", "s32", "u64", "s64", "u16"):
        check_binary(f"min.{t}", t, min)
        check_binary(f"max.{t}", t, max)
    for t in ("s32", "s64"):
        a = samples(t)
        k = ew_kernel("k", [("a", t)], [("n", t), ("m", t)],
                      f"\tneg.{t} %n, %a;\n\tabs.{t} %m, %a;")
        n, m = run_ew(k, "k", [a], [t, t])
        bits = int(t[1:])
        assert n.tolist() == [wrap(-int(x), bits, True) for x in a]
        assert m.tolist() == [wrap(abs(int(x)), bits, True) for x in a]


@pytest.mark.parametrize("t", ["b16", "b32", "b64"])
def test_logic(t):
    check_binary(f"and.{t}", "u" + t[1:], lambda x, y: x & y)
    check_binary(f"or.{t}", "u" + t[1:], lambda x, y: x | y)
    check_binary(f"xor.{t}", "u" + t[1:], lambda x, y: x ^ y)
    ut = "u" + t[1:]
    a = samples(ut)
    k = ew_kernel("k", [("a", ut)], [("n", ut), ("c", ut)],
                  f"\tnot.{t} %n, %a;\n\tcnot.{t} %c, %a;")
    n, c = run_ew(k, "k", [a], [ut, ut])
    assert n.tolist() == [wrap(~int(x), int(t[1:]), False) for x in a]
    assert c.tolist() == [int(int(x) == 0) for x in a]


@pytest.mark.parametrize("t", ["b32", "u32", "s32", "b64", "s64", "u16", "s16"])
def test_shifts_clamp_amounts_at_width(t):
    bits = int(t[1:])
    vt = ("s" if t[0] == "s" else "u") + str(bits)
    a = samples(vt, 80)
    amount = (np.arange(80) % (bits + 8)).astype(np.uint32)   # includes amounts >= width
    signed = t[0] == "s"
    if t[0] != "s":
        check_binary(f"shl.b{bits}", vt, lambda x, s: x << min(s, bits), bt="u32",
                     a=a, b=amount)
    check_binary(f"shr.{t}", vt, lambda x, s: x >> min(s, bits if not signed else bits - 1),
                 bt="u32", a=a, b=amount)
    k = ew_kernel("k", [("a", vt)], [("d", vt)], f"\tshr.{t} %d, %a, 3;")
    (d,) = run_ew(k, "k", [a], [vt])
    assert d.tolist() == [wrap(int(x) >> 3, bits, signed) for x in a]


@pytest.mark.parametrize("bits", [32, 64])
def test_popc_clz_brev_bfind(bits):
    ut, st = f"u{bits}", f"s{bits}"
    a = samples(ut)
    k = ew_kernel("k", [("a", ut)], [("p", "u32"), ("z", "u32"), ("r", ut), ("f", "u32"),
                                     ("g", "u32")],
                  f"\tpopc.b{bits} %p, %a;\n\tclz.b{bits} %z, %a;\n\tbrev.b{bits} %r, %a;\n"
                  f"\tbfind.u{bits} %f, %a;\n\tbfind.shiftamt.u{bits} %g, %a;")
    p, z, r, f, g = run_ew(k, "k", [a], ["u32", "u32", ut, "u32", "u32"])
    for x, pp, zz, rr, ff, gg in zip(a.tolist(), p, z, r, f, g):
        assert pp == bin(x).count("1")
        assert zz == bits - x.bit_length()
        assert rr == int(f"{x:0{bits}b}"[::-1], 2)
        assert ff == (x.bit_length() - 1 if x else 0xFFFFFFFF)
        assert gg == (bits - x.bit_length() if x else 0xFFFFFFFF)
    s = samples(st)
    k = ew_kernel("k", [("a", st)], [("f", "u32")], f"\tbfind.s{bits} %f, %a;")
    (f,) = run_ew(k, "k", [s], ["u32"])
    for x, ff in zip(s.tolist(), f):
        mag = ~x if x < 0 else x
        assert ff == (mag.bit_length() - 1 if mag else 0xFFFFFFFF)


def ref_bfe(a, pos, ln, bits, signed):
    pos, ln = pos & 0xFF, ln & 0xFF
    msb = bits - 1
    sbit = 0 if ln == 0 else (a >> min(pos + ln - 1, msb)) & 1 if signed else 0
    out = 0
    for i in range(bits):
        bit = (a >> (pos + i)) & 1 if (i < ln and pos + i <= msb) else sbit
        out |= bit << i
    return out


def ref_bfi(a, b, pos, ln, bits):
    pos, ln = pos & 0xFF, ln & 0xFF
    out = b
    for i in range(ln):
        if pos + i <= bits - 1:
            out = (out & ~(1 << (pos + i))) | (((a >> i) & 1) << (pos + i))
    return out


@pytest.mark.parametrize("t", ["u32", "s32", "u64", "s64"])
def test_bfe_bfi(t):
    bits = int(t[1:])
    n = 128
    a = samples("u" + t[1:], n)
    b = np.roll(samples("u" + t[1:], n), 9)
    pos = RNG.integers(0, bits + 12, n).astype(np.uint32)
    ln = RNG.integers(0, bits + 12, n).astype(np.uint32)
    pos[:4], ln[:4] = [0, bits - 1, 300, 5], [0, 1, 3, 256 + 4]   # only the low byte counts
    ut = "u" + t[1:]
    k = ew_kernel("k", [("a", ut), ("b", ut), ("c", "u32"), ("l", "u32")], [("d", ut), ("f", ut)],
                  f"\tbfe.{t} %d, %a, %c, %l;\n\tbfi.b{bits} %f, %a, %b, %c, %l;")
    d, f = run_ew(k, "k", [a, b, pos, ln], [ut, ut])
    for i in range(n):
        x, y, p, q = int(a[i]), int(b[i]), int(pos[i]), int(ln[i])
        assert int(d[i]) == ref_bfe(x, p, q, bits, t[0] == "s"), (x, p, q)
        assert int(f[i]) == ref_bfi(x, y, p, q, bits), (x, y, p, q)


def test_prmt_default_mode_and_lop3():
    a, b = samples("u32", 96), np.roll(samples("u32", 96), 13)
    c = RNG.integers(0, 1 << 16, 96).astype(np.uint32)
    c[:3] = [0x3210, 0x7654, 0x8888]
    k = ew_kernel("k", [("a", "u32"), ("b", "u32"), ("c", "u32")], [("d", "u32"), ("l", "u32")],
                  "\tprmt.b32 %d, %a, %b, %c;\n\tlop3.b32 %l, %a, %b, %c, 0x96;")
    d, lut = run_ew(k, "k", [a, b, c], ["u32", "u32"])
    for x, y, z, dd, ll in zip(a.tolist(), b.tolist(), c.tolist(), d, lut):
        src = (y << 32) | x
        expect = 0
        for i in range(4):
            s = (z >> (4 * i)) & 0xF
            byte = (src >> (8 * (s & 7))) & 0xFF
            if s & 8:
                byte = 0xFF if byte & 0x80 else 0
            expect |= byte << (8 * i)
        assert dd == expect
        assert ll == x ^ y ^ z            # 0x96 = 0xF0 ^ 0xCC ^ 0xAA


def test_selp_and_setp_combinations():
    a = samples("s32", 96)
    b = np.roll(a, 3)
    p = (np.arange(96) % 3 == 0).astype(np.uint8)
    body = "\n".join([
        "\tsetp.lt.s32 %p1|%p2, %a, %b;",
        "\tsetp.lo.u32 %p3, %a, %b;",
        "\tsetp.ge.and.s32 %p4, %a, %b, %q;",
        "\tsetp.ne.or.s32 %p5|%p6, %a, %b, !%q;",
        "\tsetp.hs.xor.u32 %p7, %a, %b, %q;",
        "\tselp.s32 %d, %a, %b, %p1;",
        "\tand.pred %p8, %p1, %q;",
        "\tor.pred %p9, %p3, %q;",
        "\txor.pred %p10, %p1, %p3;",
        "\tnot.pred %p11, %q;",
        "\tmov.pred %p12, %p4;",
    ])
    outs = [(f"p{i}", "pred") for i in range(1, 8)] + [("d", "s32")] + \
        [(f"p{i}", "pred") for i in range(8, 13)]
    k = ew_kernel("k", [("a", "s32"), ("b", "s32"), ("q", "pred")], outs, body)
    res = run_ew(k, "k", [a, b, p], [t for _, t in outs])
    for i in range(96):
        x, y, q = int(a[i]), int(b[i]), bool(p[i])
        ux, uy = x & 0xFFFFFFFF, y & 0xFFFFFFFF
        expect = [x < y, not x < y, ux < uy, (x >= y) and q, (x != y) or not q,
                  (x == y) or not q, (ux >= uy) != q, x if x < y else y,
                  x < y and q, ux < uy or q, (x < y) != (ux < uy), not q, (x >= y) and q]
        assert [int(r[i]) for r in res] == [int(e) for e in expect], i


@pytest.mark.parametrize("cmp", ["eq", "ne", "lt", "le", "gt", "ge", "equ", "neu", "ltu", "leu",
                                 "gtu", "geu", "num", "nan"])
def test_setp_float_comparisons(cmp):
    vals = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 1e-45, 3.5], np.float32)
    a = np.repeat(vals, len(vals))
    b = np.tile(vals, len(vals))
    k = ew_kernel("k", [("a", "f32"), ("b", "f32")], [("p", "pred")],
                  f"\tsetp.{cmp}.f32 %p, %a, %b;")
    (p,) = run_ew(k, "k", [a, b], ["pred"])
    ops = {"eq": lambda x, y: x == y, "ne": lambda x, y: x != y, "lt": lambda x, y: x < y,
           "le": lambda x, y: x <= y, "gt": lambda x, y: x > y, "ge": lambda x, y: x >= y}
    for x, y, r in zip(a.tolist(), b.tolist(), p):
        nan = x != x or y != y
        if cmp == "num":
            e = not nan
        elif cmp == "nan":
            e = nan
        elif cmp.endswith("u"):
            e = nan or ops[cmp[:-1]](x, y)
        else:
            e = (not nan) and ops[cmp](x, y)
        assert bool(r) == e, (cmp, x, y)


def test_mov_pack_unpack_and_special_values():
    a = samples("u64")
    body = "\n".join([
        "\tmov.b64 {%lo, %hi}, %a;",
        "\tmov.b32 {%h0, %h1}, %lo;",
        "\tmov.b32 %x, {%h1, %h0};",          # swap the halves back together
        "\tmov.b64 %y, {%hi, %lo};",
        "\tmov.b64 {%q0, %q1, %q2, %q3}, %a;",
        "\tmov.b64 %z, {%q3, %q2, %q1, %q0};",
    ])
    regs = "\t.reg .b16 %h0, %h1, %q0, %q1, %q2, %q3;\n\t.reg .b32 %lo, %hi;"
    k = ew_kernel("k", [("a", "u64")], [("x", "u32"), ("y", "u64"), ("z", "u64")], body, regs)
    x, y, z = run_ew(k, "k", [a], ["u32", "u64", "u64"])
    for v, xx, yy, zz in zip(a.tolist(), x, y, z):
        lo, hi = v & 0xFFFFFFFF, v >> 32
        assert xx == ((lo & 0xFFFF) << 16) | (lo >> 16)
        assert yy == (lo << 32) | hi
        halves = [(v >> (16 * i)) & 0xFFFF for i in range(4)]
        assert zz == sum(h << (16 * (3 - i)) for i, h in enumerate(halves))
