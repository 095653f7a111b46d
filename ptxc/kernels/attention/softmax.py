"""The online softmax, in one place: a row's running state (max m in log2 units, sum l of
2^(s·scale - m), accumulator O against the same m), how a tile updates it, how two states
merge, and how a finished state becomes 1/l and the LSE.

Every body composes its softmax from these, over its own fragment layout (the fragment math
decides which registers hold row r and which lanes share it):

  row_candidate    the row's new max: its values, butterflied over the lanes sharing the row
  rescale_vote     the lazy rescale: one warp-uniform vote whether any row grew past
                   RESCALE_SLACK (mma.sync, wgmma, tcgen05 take probabilities against a stale
                   m otherwise -- exact all the same, O and l share the reference)
  exponentials     2^(s·scale - m) against a safe m: ex2.approx, or for `poly` of every 8
                   elements FlashAttention-4's FMA polynomial (exp2_poly, in f32x2 pairs),
                   where MUFU bounds
  online_update    the eager step (SIMT prefill; every row rescaled every tile)
  merge_states     two partial states into one (decode's warp slots)
  merge_weights    N partial states' weights against their common max (decode's epilogue;
                   split_reduce.py's loop takes the same safe_max / rescale_factor per split)
  normaliser       1/l, 0 for a row that saw no key (l = 0: never 1/0)
  log_sum_exp      (m + log2 l) · scale, -inf for a row that saw no key

`safe_max` is what keeps -inf rows NaN-free everywhere: ex2(-inf - m) must be 0, and
-inf - -inf is NaN, so a max of -inf is replaced by 0 before anything subtracts it.
"""

from __future__ import annotations

from ...ir import B64, F32, S32, U32, KernelBuilder, Reg
from ..common import LN2, NEG_INF

RESCALE_SLACK = 8.0   # log2 units: probabilities against a stale max stay <= 2^8
# log2 units f16 probabilities are lifted by where a bf16 kernel runs f16 products (MmaMath's
# f16_math): taken against m - P_HEADROOM they reach 2^15 < f16's 65504 and keep what lies
# 2^-32 below the running max, where f16 alone rounds below 2^-25 to 0 (bf16 keeps 2^-133);
# the row sums and O share the reference, so only its users (the lse, a sink) see m - 7
P_HEADROOM = 7.0
# 2^f on [0, 1) by a degree-3 polynomial, highest relative error 8.8e-5 (FlashAttention-4's
# coefficients): far below the rounding of P to f16 (4.9e-4) or bf16 (3.9e-3) before P·V
EXP2_POLY = (1.0, 0.695146143436431884765625, 0.227564394474029541015625,
             0.077119089663028717041015625)
ROUND_MAGIC = 12582912.0   # 1.5·2^23: x + it, rounded down, holds floor(x) in its low bits


def safe_max(b: KernelBuilder, m: Reg) -> Reg:
    """The max to subtract before ex2: 0 when m is -inf, so ex2(-inf - m) is 0, never NaN."""
    return b.selp(0.0, m, b.setp("eq", m, NEG_INF))


def rescale_factor(b: KernelBuilder, m_old: Reg, m_use: Reg) -> Reg:
    """2^(m_old - m_use): what a state accumulated against m_old is multiplied by."""
    return b.ex2(b.sub(m_old, m_use))


def row_candidate(b: KernelBuilder, m: Reg, vals: list[Reg], scale_log2: float, lanes) -> Reg:
    """max(m, scale · max of the row): `vals` are this lane's raw scores of the row, the rest of
    the row on the lanes that differ in the bits of `lanes`."""
    mx = vals[0]
    for x in vals[1:]:
        mx = b.max(mx, x)
    for off in lanes:
        mx = b.max(mx, b.shfl("bfly", mx, off))
    return b.max(m, b.mul(mx, scale_log2))


def rescale_vote(b: KernelBuilder, cands: list[Reg], m: list[Reg], lanes) -> Reg:
    """Predicate, uniform over the lanes of `lanes`: some row's candidate max grew past its
    running max by more than RESCALE_SLACK. (-inf - -inf is NaN: max.f32 drops a NaN operand.)"""
    grows = [b.sub(c, x) for c, x in zip(cands, m)]
    grow = grows[0]
    for x in grows[1:]:
        grow = b.max(grow, x)
    for off in lanes:
        grow = b.max(grow, b.shfl("bfly", grow, off))
    return b.setp("gt", grow, RESCALE_SLACK)


def exponentials(b: KernelBuilder, vals: list[Reg], m_safe: Reg, scale_log2: float | None,
                 poly: int = 0, lift: float = 0.0) -> list[Reg]:
    """2^(x·scale_log2 - m_safe + lift) for each raw score x (one fma each; `lift`: P_HEADROOM
    or 0, at no cost); with scale_log2 None the scores are already in log2 units:
    2^(x - m_safe). `poly` of every 8 (spread evenly) go through the FMA polynomial
    (exp2_poly_pairs, two at a time in f32x2: sm_100+) instead of ex2.approx on MUFU."""
    assert scale_log2 is not None or not lift, "a lift rides on the fma"
    neg = None if scale_log2 is None else b.sub(lift, m_safe) if lift else b.neg(m_safe)
    out: list[Reg | None] = []
    emulated: list[int] = []
    for i, x in enumerate(vals):
        y = b.sub(x, m_safe) if neg is None else b.fma(x, scale_log2, neg)
        if (i * poly) % 8 < poly:
            emulated.append(i)
            out.append(y)
        else:
            out.append(b.ex2(y))
    if emulated:
        for i, r in zip(emulated, exp2_poly_pairs(b, [out[i] for i in emulated])):
            out[i] = r
    return out


def exp2_poly(b: KernelBuilder, x: Reg) -> Reg:
    """2^x for x <= 127 without MUFU (FlashAttention-4's emulation): floor(x) by the magic add
    rounded down, 2^frac by Horner's rule on EXP2_POLY, and floor(x) added into the result's
    exponent field. x <= -127 (a masked score's -inf included) gives exactly +0."""
    xc = b.max(x, -127.0)
    rounded = b.add_rm(xc, ROUND_MAGIC)                 # floor(xc) in the low mantissa bits
    frac = b.sub(xc, b.sub(rounded, ROUND_MAGIC))       # in [0, 1), exact
    c0, c1, c2, c3 = EXP2_POLY
    p = b.fma(b.fma(b.fma(frac, c3, c2), frac, c1), frac, c0)
    return _with_exponent(b, p, rounded)


def exp2_poly_pairs(b: KernelBuilder, xs: list[Reg]) -> list[Reg]:
    """exp2_poly of each of `xs`, two at a time on Blackwell's f32x2 FP32 pipe (the clamp stays
    scalar: max has no f32x2 form): 4 packed instructions and 2 scalar per pair, against 7 per
    value. An odd last value takes the scalar form."""
    out = []
    if len(xs) >= 2:
        pair = lambda v: b.pack(B64, [b.mov(v, F32), b.mov(v, F32)])   # noqa: E731
        magic, coeffs = pair(ROUND_MAGIC), [pair(c) for c in EXP2_POLY]
    for k in range(0, len(xs) - 1, 2):
        xc = b.pack(B64, [b.max(xs[k], -127.0), b.max(xs[k + 1], -127.0)])
        rounded = b.f32x2("add", xc, magic, mode="rm")
        frac = b.f32x2("sub", xc, b.f32x2("sub", rounded, magic))
        p = coeffs[3]
        for c in (coeffs[2], coeffs[1], coeffs[0]):
            p = b.f32x2("fma", p, frac, c)
        for lo_hi_p, lo_hi_r in zip(b.unpack(p, F32), b.unpack(rounded, F32)):
            out.append(_with_exponent(b, lo_hi_p, lo_hi_r))
    if len(xs) % 2:
        out.append(exp2_poly(b, xs[-1]))
    return out


def _with_exponent(b: KernelBuilder, p: Reg, rounded: Reg) -> Reg:
    """p · 2^floor, floor held in `rounded`'s low bits: added into p's exponent field (the
    shift wraps a negative floor to its two's complement)."""
    scale = b.shl(b.bitcast(rounded, U32), 23)
    return b.bitcast(b.add(b.bitcast(p, S32), b.bitcast(scale, S32)), F32)


def online_update(b: KernelBuilder, m: list[Reg], l: list[Reg] | None, rows: list[list[Reg]],
                  scale_log2: float, lanes) -> tuple[list[Reg], list[list[Reg]]]:
    """The eager step for each row a thread holds (`rows[r]`: its raw scores of row r). m and l
    (this lane's partial sum) are updated in place; returns per-row rescale factors alpha and
    the probabilities. With l None the caller keeps the sums itself."""
    alphas, probs = [], []
    for r, vals in enumerate(rows):
        m_new = row_candidate(b, m[r], vals, scale_log2, lanes)
        m_use = safe_max(b, m_new)
        alphas.append(rescale_factor(b, m[r], m_use))
        p = exponentials(b, vals, m_use, scale_log2)
        if l is not None:
            total = p[0]
            for x in p[1:]:
                total = b.add(total, x)
            b.fma(l[r], alphas[-1], total, out=l[r])
        b.mov(m_new, out=m[r])
        probs.append(p)
    return alphas, probs


def merge_states(b: KernelBuilder, m: Reg, l: Reg, acc: list[Reg],
                 m_o: Reg, l_o: Reg, acc_o: list[Reg]) -> None:
    """(m, l, acc) <- the exact merge with another partial state (m_o, l_o, acc_o), in place."""
    m_new = b.max(m, m_o)
    m_use = safe_max(b, m_new)
    a, c = rescale_factor(b, m, m_use), rescale_factor(b, m_o, m_use)
    b.mad(l, a, b.mul(l_o, c), out=l)
    for x, y in zip(acc, acc_o):
        b.mad(x, a, b.mul(y, c), out=x)
    b.mov(m_new, out=m)


def merge_weights(b: KernelBuilder, ms: list[Reg]) -> tuple[Reg, list[Reg]]:
    """(m_tot, weights) of N partial states with maxima `ms`: state i's l and O count
    weights[i] = 2^(ms[i] - m_tot) in the merged state."""
    m_tot = ms[0]
    for x in ms[1:]:
        m_tot = b.max(m_tot, x)
    m_use = safe_max(b, m_tot)
    return m_tot, [rescale_factor(b, x, m_use) for x in ms]


def normaliser(b: KernelBuilder, total: Reg, alpha: Reg | None = None) -> tuple[Reg, Reg]:
    """(inv, has_keys): inv = alpha / total (alpha: a factor O still needs, e.g. a sink's), 0
    for a row that saw no key; has_keys the predicate total > 0."""
    has_keys = b.setp("gt", total, 0.0)
    inv = b.rcp(total) if alpha is None else b.mul(b.rcp(total), alpha)
    return b.selp(inv, 0.0, has_keys), has_keys


def log_sum_exp(b: KernelBuilder, m: Reg, total: Reg, has_keys: Reg, scale: float = LN2) -> Reg:
    """(m + log2 total) · scale -- ln 2 gives the natural-log LSE, 1.0 keeps log2 units (as
    split-KV partials want) -- and -inf for a row that saw no key."""
    lse = b.add(m, b.lg2(total))
    return b.selp(b.mul(lse, scale) if scale != 1.0 else lse, NEG_INF, has_keys)
