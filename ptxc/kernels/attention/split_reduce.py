"""The reduce kernel of split-KV flash-decoding: merge the per-split partial outputs exactly.

Split s of (b, h) left o_s = Σ_j∈s 2^(x_j − m_s) v_j / l_s and λ_s = m_s + log2 l_s (or −inf when
the split saw no key). With M = max_s λ_s and w_s = 2^(λ_s − M):

    o = Σ_s w_s o_s / Σ_s w_s,        lse = (M + log2 Σ_s w_s) · ln 2

which is exactly softmax over the union of the splits; empty splits have w_s = 0 (their o_s is
not read: split_plan.emit_idle_exit leaves it unwritten), and a
sequence with no keys at all gives o = 0, lse = −inf. A row whose split 0 covered all its keys
(the GQA-packed tile's ctx.whole, S > 1) has its o from the split kernel and λ_1 = +inf as the
mark (no partial lse is +inf: a finite running max m gives l in [1, keys], m = +inf makes l
NaN): the reduce writes lse = λ_0 · ln 2 and leaves. One CTA per (head, sequence); each thread
owns 4 consecutive elements of the head.
"""

from __future__ import annotations

from ...ir import F32, S64, U32, Addr, KernelBuilder
from .. import common as C
from ..base import Launch, LaunchParam, ParamSource, TensorInfo
from .softmax import log_sum_exp, normaliser, rescale_factor, safe_max
from .split_plan import MAX_AUTO_SPLITS, SPLIT_HEADROOM

AUTO_RULE = f"min(max, max(1, cdiv({SPLIT_HEADROOM} * num_sms * ctas_per_sm, ctas)))"


def split_interface(rows_dim: str, num_heads: int, head_dim: int, splits, ctas: str,
                    entry: str, max_splits: int = MAX_AUTO_SPLITS) -> tuple[list, dict]:
    """The split-KV workspace of a family whose rows (`rows_dim`: batch for decode, total_q for
    varlen) are split `splits` ways (an int > 1 or "auto"), and the num_splits dim rule: the
    built count, or "auto" = SPLIT_HEADROOM split indices per resident CTA slot (num_sms x the
    split kernel `entry`'s CTAs per SM on the launched target) over the launch's `ctas`
    expression, capped at `max_splits` (MAX_AUTO_SPLITS, split_plan.py, unless the family knows
    fewer KV tiles). The workspace needs no cap of its
    own: rows x num_splits stays near SPLIT_HEADROOM x slots x rows / ctas, whatever the batch."""
    tensors = [TensorInfo("o_part", "f32", (rows_dim, num_heads, "num_splits", head_dim), "workspace",
                          "per-split normalised partial outputs"),
               TensorInfo("lse_part", "f32", (rows_dim, num_heads, "num_splits"), "workspace",
                          "per-split log2-sum-exp (-inf for an empty split)")]
    rule = {"value": splits} if splits != "auto" else {"auto": {
        "max": max_splits, "ctas": ctas, "occupancy_of": entry, "rule": AUTO_RULE}}
    return tensors, rule


def build_reduce(spec, entry: str, has_lse: bool, rows_dim: str = "batch") -> tuple:
    """The merge kernel over o [rows, H, d] (rows = `rows_dim`: batch for decode, total_q for
    varlen), o_part [rows, H, splits, d] and lse_part [rows, H, splits]."""
    from .variant import head_dim_v
    fmt, d, H = C.FORMATS[spec.dtype], head_dim_v(spec), spec.num_heads   # O's head size
    b = KernelBuilder(entry)
    params: list[LaunchParam] = []

    param = C.param_loader(b, params)

    ptrs = {t: b.to_global(param(t, C.U64, ParamSource("pointer", tensor=t)))
            for t in ("o_part", "lse_part", "o") + (("lse",) if has_lse else ())}
    o_strides = {a: C.byte_stride(b, param(f"o_stride{a}", S64, ParamSource("stride", "o", a)), fmt)
                 for a in (0, 1)}
    splits = param("num_splits", U32, ParamSource("dim", name="num_splits"))

    tid = b.special("%tid.x")
    head, batch = b.special("%ctaid.x"), b.special("%ctaid.y")
    part_row0 = b.mul(b.mad(batch, H, head), splits)            # (b, h, split 0)
    lse_row = C.element_offset(b, ptrs["lse_part"], part_row0, b.mov(4, S64))

    # A row split 0 finished whole (VarlenMath.epilogue) holds its o already and is marked +inf
    # in split 1's lse (splits past 1 may be unwritten, so nothing more is read): only its lse
    # is left, split 0's log2 lse in natural-log units.
    marker = b.mov(C.NEG_INF, F32)
    with b.predicate(b.setp("gt", splits, 1)):
        b.ld("global", F32, Addr(lse_row, 4), out=[marker])
    with b.if_then(b.setp("eq", marker, C.POS_INF)):
        if has_lse:
            with b.if_then(b.setp("eq", tid, 0)):
                idx = b.mad(batch, H, head)
                lse = b.mul(b.ld("global", F32, Addr(lse_row)), C.LN2)
                b.st("global", F32, Addr(C.element_offset(b, ptrs["lse"], idx, b.mov(4, S64))), [lse])
        b.ret()
    m = b.mov(C.NEG_INF, F32)
    with b.for_range(0, splits) as s:
        b.max(m, b.ld("global", F32, Addr(C.element_offset(b, lse_row, s, b.mov(4, S64)))), out=m)
    m_use = safe_max(b, m)
    with b.if_then(b.setp("lt", tid, d // 4)):
        total = b.mov(0.0, F32)
        acc = [b.mov(0.0, F32) for _ in range(4)]
        elem = b.mul(tid, 4)
        with b.for_range(0, splits) as s:
            w = rescale_factor(b, b.ld("global", F32, Addr(C.element_offset(b, lse_row, s, b.mov(4, S64)))), m_use)
            b.add(total, w, out=total)
            src = C.element_offset(b, ptrs["o_part"], b.mad(b.add(part_row0, s), d, elem), b.mov(4, S64))
            part = [b.mov(0.0, F32) for _ in range(4)]
            with b.predicate(b.setp("gt", w, 0.0)):   # an empty split may have left o_part unwritten
                b.ld("global", F32, Addr(src), vec=4, out=part)
            for x, y in zip(acc, part):
                b.fma(y, w, x, out=x)
        inv, has_keys = normaliser(b, total)
        out = [b.mul(x, inv) for x in acc]
        row = C.element_offset(b, b.bitcast(C.element_offset(b, ptrs["o"], batch, o_strides[0]), C.U64),
                               head, o_strides[1])
        dst = b.add(row, b.cvt(S64, b.mul(elem, fmt.bytes)))
        packed = C.from_f32(b, fmt, out)
        b.st("global", fmt.load_type, Addr(dst), packed)
        if has_lse:
            with b.if_then(b.setp("eq", tid, 0)):
                lse = log_sum_exp(b, m, total, has_keys)
                idx = b.mad(batch, H, head)
                b.st("global", F32, Addr(C.element_offset(b, ptrs["lse"], idx, b.mov(4, S64))), [lse])
    b.ret()
    threads = max(32, -(-(d // 4) // 32) * 32)
    launch = Launch(entry=entry, params=tuple(params), grid=(str(H), rows_dim, "1"), block=(threads, 1, 1))
    return b.entry, launch
