"""The decode attention body: one CTA attends one query token per head of a head chunk over a
range of KV rows, then either writes the final output or (split-KV) a partial result.

Work split inside the CTA (docs/kernels.md): `lanes_per_row` lanes share a KV row (one or more
128-bit chunks each); the warp's lane groups ("row slots") take consecutive rows; each lane
issues `kv_unroll` K and V loads before using them. Each row slot keeps an online-softmax state
in base 2; states merge across row slots with shuffles, then across warps in shared memory,
where all threads cooperate on the epilogue with 128-bit stores.
"""

from __future__ import annotations

from ...ir import F32, S32, S64, U32, Addr, KernelBuilder, Reg
from .. import common as C
from ..attention.split_plan import auto_split, emit_balanced_split
from ..attention.softmax import (
    exponentials, log_sum_exp, merge_states, merge_weights, normaliser, rescale_factor, safe_max)
from ..attention.variant import AttentionVariant, join_sink, load_head_f32
from ..kv.kv_access import KVAccess
from ..mainloop.row_pipeline import KeyRows
from .assemble import Loads, assemble, prebuilt


def emit_attention(b: KernelBuilder, spec, cfg, kv: KVAccess, ptrs: dict, strides: dict,
                   split_count: Reg | None, quant=None, target=None) -> None:
    """Emit the whole body. `strides[(t, axis)]` are byte strides of q and o; with
    `split_count`, CTA z handles the z-th of `split_count` row ranges and writes partials.
    With `quant` (kv_fp8.KVDequant) the cache holds FP8 bytes: a lane's chunk of `per_vec`
    elements is one 8- or 4-byte load, k_scale folds into the query multiplier and v_scale
    into the final normalisation. `target` picks the f16 rounding below sm_80."""
    fmt, lpr, hp = cfg.fmt, cfg.lanes_per_row, cfg.heads_per_cta
    tid = b.special("%tid.x")
    lane, warp = b.and_(tid, 31), b.shr(tid, 5)
    slot, sub = b.shr(lane, lpr.bit_length() - 1), b.and_(lane, lpr - 1)
    batch, cx = b.special("%ctaid.y"), b.special("%ctaid.x")
    kv_head = b.div(cx, cfg.head_chunks) if cfg.head_chunks > 1 else cx
    head0 = b.mad(kv_head, cfg.group_size, b.mul(b.rem(cx, cfg.head_chunks), hp)) \
        if cfg.head_chunks > 1 else b.mul(kv_head, cfg.group_size)

    seq_len = b.ld("global", U32, Addr(C.element_offset(b, ptrs["seq_lens"], batch, b.mov(4, S64))))
    seq_len = b.min(b.bitcast(b.max(b.bitcast(seq_len, S32), 0), U32), kv.capacity(b))
    variant = AttentionVariant.from_spec(spec)
    # The query sits at position L - 1: a sliding window starts the rows at its first key, so
    # rows (and pages) before it are never read and no row of the loop needs a window mask.
    win_begin = None
    if variant.bounded:
        pos = b.sub(b.bitcast(seq_len, S32), 1)
        win_begin = b.bitcast(b.max(variant.key_begin(b, pos), 0), U32)
    row_begin, row_end = (b.mov(0, U32) if win_begin is None else win_begin), seq_len
    if split_count is not None:  # a uniform, length-balanced chunk of the batch (split_plan.py)
        rows_per_iter = cfg.num_warps * cfg.rows_per_warp * cfg.kv_unroll
        span = seq_len if win_begin is None else b.sub(seq_len, win_begin)
        units = lambda rows: b.div(b.add(rows, rows_per_iter - 1), rows_per_iter)

        def seq_units(i):   # another sequence's clamped length: an upper bound of its span
            n = b.ld("global", U32, Addr(C.element_offset(b, ptrs["seq_lens"], i, b.mov(4, S64))))
            n = units(b.min(b.bitcast(b.max(b.bitcast(n, S32), 0), U32), kv.capacity(b)))
            return n, n
        z = b.special("%ctaid.z")

        def write_empty():   # lse_part [batch, H, splits] of this chunk's heads
            with b.if_then(b.setp("lt", tid, hp)):
                row = b.mad(b.mad(batch, spec.num_heads, b.add(head0, tid)), split_count, z)
                b.st("global", F32, Addr(C.element_offset(b, ptrs["lse_part"], row, b.mov(4, S64))),
                     [b.mov(C.NEG_INF, F32)])
        n_seqs = b.special("%nctaid.y")
        row_begin, row_end, _ = emit_balanced_split(
            b, split=z, num_splits=split_count, lane=lane, n_seqs=n_seqs, seq_units=seq_units,
            own=units(span), begin=row_begin, end=seq_len, rows=n_seqs,
            auto=auto_split(spec), keep_split0="sinks" in ptrs,
            write_empty=write_empty, unit=rows_per_iter)

    lane_byte = b.cvt(S64, b.mul(sub, C.VEC_BYTES))
    last_ok = b.setp("lt", sub, cfg.chunks - (cfg.chunks_per_lane - 1) * lpr) if cfg.chunks % lpr else None

    def chunk_pred(j: int, row_ok: Reg | None) -> Reg | None:
        ok = last_ok if j == cfg.chunks_per_lane - 1 else None
        if ok is None or row_ok is None:
            return ok or row_ok
        return b.and_(ok, row_ok)

    def head_row(t: str, head: Reg) -> Reg:
        base = C.element_offset(b, ptrs[t], batch, strides[(t, 0)])
        return b.add(C.element_offset(b, b.bitcast(base, C.U64), head, strides[(t, 1)]), lane_byte)

    qscale = spec.softmax_scale * C.LOG2E  # scores come out in log2 units
    v_scale, kv_lane_byte, kv_io = None, lane_byte, _plain_io(b, fmt)
    if quant is not None:
        k_scale, v_scale = quant.scales(b, kv_head)
        qscale = b.mul(k_scale, qscale)
        kv_lane_byte = b.cvt(S64, b.mul(sub, fmt.per_vec))     # one byte per element
        kv_io = (fmt.per_vec, lambda addr, pred: quant.load(b, addr, fmt.per_vec, pred),
                 lambda regs: quant.widen(b, regs))
    q_regs = []
    for i in range(hp):
        qb = head_row("q", b.add(head0, i))
        q_regs.append([[b.mul(x, qscale) for x in C.to_f32(b, fmt, C.load_vec(
            b, fmt, Addr(qb, j * lpr * C.VEC_BYTES), chunk_pred(j, None)))]
            for j in range(cfg.chunks_per_lane)])

    m = [b.mov(C.NEG_INF, F32) for _ in range(hp)]
    l = [b.mov(0.0, F32) for _ in range(hp)]
    acc = [[[b.mov(0.0, F32) for _ in range(fmt.per_vec)] for _ in range(cfg.chunks_per_lane)]
           for _ in range(hp)]
    bases = kv.bases(b, ptrs, batch, kv_head, kv_lane_byte)
    first_row = b.mad(warp, cfg.rows_per_warp * cfg.kv_unroll, slot)
    transform = None
    if variant.transforms:   # scores are in log2 units (q was scaled by softmax_scale * log2 e)
        transform = _score_transform(b, variant, ptrs, head0, hp, seq_len)
    rows = KeyRows(row_begin, row_end, cfg.num_warps * cfg.rows_per_warp * cfg.kv_unroll,
                   lambda it: [b.add(it, b.add(first_row, u * cfg.rows_per_warp))
                               for u in range(cfg.kv_unroll)])
    loader = RowLoader(b, cfg, kv, bases, chunk_pred, kv_io[0], rows)
    math = DecodeRows(b, spec, cfg, q_regs, m, l, acc, kv_io[2], transform,
                      finish=lambda: _finish(b, spec, cfg, m, l, acc, warp, slot, sub, tid, batch,
                                             head0, ptrs, strides, split_count, v_scale, target))
    assemble(b, "rows", tiles=rows, loads=Loads(rows=loader, read=kv_io[1]), math=prebuilt(math),
             transform_of=lambda _: None, cfg=cfg, tid=tid)


class RowLoader:
    """Where decode's rows live (kv_access), chunk by chunk; paged caches load the page ids of
    the rows an iteration further while the current ones are in flight (after their loads are
    issued), so no block-table round trip precedes a fetch."""

    def __init__(self, b, cfg, kv: KVAccess, bases, chunk_pred, chunk_bytes: int, rows: KeyRows):
        self.b, self.cfg, self.kv, self.bases, self.rows = b, cfg, kv, bases, rows
        self.chunk_pred, self.chunk_bytes = chunk_pred, chunk_bytes
        self.pages = None
        if kv.layout == "paged":
            self.pages = [kv.load_page(b, bases, r, b.setp("lt", r, rows.end))
                          for r in rows.rows_at(rows.begin)]

    def fetch(self, rows, put):
        """Addresses of `rows` (pages from `pages`), put(t, u, j, addr, pred) per chunk; returns
        the rows' validity and the page ids of the rows rows_per_iter further on (or None)."""
        b, cfg, kv, bases = self.b, self.cfg, self.kv, self.bases
        valid = [b.setp("lt", r, self.rows.end) for r in rows]
        page_cache = {}
        for u in range(cfg.kv_unroll) if self.pages else ():
            kv.use_page(b, page_cache, rows[u], valid[u], self.pages[u])
        for t in ("k_cache", "v_cache"):
            for u, (r, ok) in enumerate(zip(rows, valid)):
                addr, row_ok = kv.row_address(b, bases, t, r, ok, page_cache)
                for j in range(cfg.chunks_per_lane):
                    put(t, u, j, Addr(addr, j * cfg.lanes_per_row * self.chunk_bytes),
                        self.chunk_pred(j, row_ok))
        if not self.pages:
            return valid, None
        nxt = [b.add(r, self.rows.rows_per_iter) for r in rows]
        return valid, [kv.load_page(b, bases, r, b.setp("lt", r, self.rows.end)) for r in nxt]

    def advance(self, fresh) -> None:
        for cur, new in zip(self.pages or (), fresh or ()):
            self.b.mov(new, out=cur)


class DecodeRows:
    """The SIMT row math of decode: each row slot's online-softmax state (m, l, acc per head,
    base 2) over the rows it attends (`attend`: _attend_rows); `epilogue` merges the row slots
    by shuffles, the warps through shared memory, and writes O / LSE or the split partials."""

    def __init__(self, b, spec, cfg, q_regs, m, l, acc, widen, transform, finish):
        self.b, self.spec, self.cfg = b, spec, cfg
        self.q_regs, self.m, self.l, self.acc = q_regs, m, l, acc
        self.widen, self.transform, self.finish = widen, transform, finish

    def attend(self, tiles, rows, valid) -> None:
        _attend_rows(self.b, self.cfg, tiles, rows, valid, self.q_regs, self.m, self.l, self.acc,
                     self.widen, self.transform)

    def epilogue(self) -> None:
        self.finish()


def _finish(b, spec, cfg, m, l, acc, warp, slot, sub, tid, batch, head0, ptrs, strides,
            split_count, v_scale, target) -> None:
    """Merge the row slots (lanes that differ in the slot bits), stage every warp's state, then
    the cooperative epilogue."""
    off = cfg.lanes_per_row
    while off < 32:
        for i in range(cfg.heads_per_cta):
            flat = [x for ch in acc[i] for x in ch]
            merge_states(b, m[i], l[i], flat, b.shfl("bfly", m[i], off),
                         b.shfl("bfly", l[i], off), [b.shfl("bfly", x, off) for x in flat])
        off *= 2
    smem = _stage_warp_states(b, cfg, m, l, acc, warp, slot, sub)
    _epilogue(b, spec, cfg, smem, tid, batch, head0, ptrs, strides, split_count, v_scale, target)


def _plain_io(b, fmt):
    """(bytes per lane chunk, load, widen to f32) for a cache of the dtype itself."""
    return (C.VEC_BYTES, lambda addr, pred: C.load_vec(b, fmt, addr, pred),
            lambda regs: C.to_f32(b, fmt, regs))


def _attend_rows(b, cfg, tiles, rows, valid, q_regs, m, l, acc, widen, transform):
    """Scores of the rows against every head, then the online-softmax update of m, l, acc."""
    fmt, lpr, hp = cfg.fmt, cfg.lanes_per_row, cfg.heads_per_cta
    scores = []  # [u][i]
    for u in range(cfg.kv_unroll):
        k = [widen(regs) for regs in tiles["k_cache"][u]]
        row_scores = []
        for i in range(hp):
            s = b.mov(0.0, F32)
            for j in range(cfg.chunks_per_lane):
                for e in range(fmt.per_vec):
                    s = b.fma(q_regs[i][j][e], k[j][e], s)
            s = C.warp_sum(b, s, [lpr >> n for n in range(1, lpr.bit_length())])
            if transform is not None:   # the variant's score transforms (soft-cap, ALiBi)
                transform(s, rows[u], i)
            row_scores.append(b.selp(s, C.NEG_INF, valid[u]))
        scores.append(row_scores)
    v = [[widen(regs) for regs in tiles["v_cache"][u]] for u in range(cfg.kv_unroll)]
    for i in range(hp):
        m_new = m[i]
        for u in range(cfg.kv_unroll):
            m_new = b.max(m_new, scores[u][i])
        m_use = safe_max(b, m_new)
        alpha = rescale_factor(b, m[i], m_use)
        p = exponentials(b, [scores[u][i] for u in range(cfg.kv_unroll)], m_use, None)
        psum = p[0]
        for x in p[1:]:
            psum = b.add(psum, x)
        b.mad(l[i], alpha, psum, out=l[i])
        for j in range(cfg.chunks_per_lane):
            for e in range(fmt.per_vec):
                a = b.mul(acc[i][j][e], alpha, out=acc[i][j][e])
                for u in range(cfg.kv_unroll):
                    b.fma(p[u], v[u][j][e], a, out=a)
        b.mov(m_new, out=m[i])


def _score_transform(b, variant, ptrs, head0, hp, seq_len):
    """transform(score, key row, head i) for the variant: the query sits at p = L - 1, so
    |p - j| = L - 1 - j; ALiBi slopes of the CTA's heads are loaded once, in log2 units."""
    if not variant.alibi:
        return lambda s, row, i: variant.transform_scores(b, s, None, C.LOG2E)
    slopes = [b.mul(load_head_f32(b, ptrs["alibi_slopes"], b.add(head0, i)), -C.LOG2E) for i in range(hp)]
    last = b.sub(b.bitcast(seq_len, S32), 1)

    def transform(s, row, i):
        rel = b.sub(last, b.bitcast(row, S32))
        variant.transform_scores(b, [[(s, 0)]], None, C.LOG2E, [(rel, slopes[i])])
    return transform


def _stage_warp_states(b, cfg, m, l, acc, warp, slot, sub) -> Reg:
    """Row slot 0 of every warp writes (m, l) and its accumulator chunks to shared memory."""
    fmt, d, hp = cfg.fmt, cfg.head_dim, cfg.heads_per_cta
    smem = b.address_of(b.shared("merge_smem", cfg.merge_smem_bytes))
    ml_base = b.mad(warp, hp * 8, smem)                                  # [warp][head] -> (m, l)
    acc_base = b.mad(warp, hp * d * 4, b.add(smem, cfg.ml_smem_bytes))   # [warp][head][d]
    with b.if_then(b.setp("eq", slot, 0)):
        with b.if_then(b.setp("eq", sub, 0)):
            for i in range(hp):
                b.st("shared", F32, Addr(ml_base, i * 8), [m[i], l[i]])
        lane_off = b.mad(sub, fmt.per_vec * 4, acc_base)
        for j in range(cfg.chunks_per_lane):
            ok = b.setp("lt", sub, cfg.chunks - j * cfg.lanes_per_row) \
                if (j + 1) * cfg.lanes_per_row > cfg.chunks else None
            for i in range(hp):
                base = (i * d + j * cfg.lanes_per_row * fmt.per_vec) * 4
                if ok is None:
                    _store_f32_row(b, lane_off, base, acc[i][j])
                else:
                    with b.if_then(ok):
                        _store_f32_row(b, lane_off, base, acc[i][j])
    b.bar_sync(0)
    return smem


def _store_f32_row(b, lane_off, base, vals):
    for q in range(0, len(vals), 4):
        b.st("shared", F32, Addr(lane_off, base + q * 4), vals[q:q + 4])


def _epilogue(b, spec, cfg, smem, tid, batch, head0, ptrs, strides, split_count, v_scale=None, target=None):
    """Every thread takes 128-bit output chunks (head i, chunk c): merge the warps' states,
    then write the final O (and LSE) or, for a split, the partial O and its log2-sum-exp."""
    fmt, d, hp, nw = cfg.fmt, cfg.head_dim, cfg.heads_per_cta, cfg.num_warps
    total, nthreads = hp * cfg.chunks, nw * 32
    acc_all = b.add(smem, cfg.ml_smem_bytes)
    for rnd in range(-(-total // nthreads)):
        item = b.add(tid, rnd * nthreads)
        with b.if_then(b.setp("lt", item, total)):
            i, c = b.div(item, cfg.chunks), b.rem(item, cfg.chunks)
            ms = [b.ld("shared", F32, Addr(b.mad(i, 8, smem), w * hp * 8)) for w in range(nw)]
            ls = [b.ld("shared", F32, Addr(b.mad(i, 8, smem), w * hp * 8 + 4)) for w in range(nw)]
            m_tot, weights = merge_weights(b, ms)
            l_tot = b.mul(ls[0], weights[0])
            for x, w in zip(ls[1:], weights[1:]):
                l_tot = b.fma(x, w, l_tot)
            if "sinks" in ptrs:   # the sink joins the denominator; split-KV: split 0 only
                head = b.add(head0, i)
                sink = b.mul(load_head_f32(b, ptrs["sinks"], head), C.LOG2E)
                if split_count is not None:
                    sink = b.selp(sink, C.NEG_INF, b.setp("eq", b.special("%ctaid.z"), 0))
                l_tot, alpha, m_tot = join_sink(b, m_tot, l_tot, sink)
                weights = [b.mul(w, alpha) for w in weights]
            inv, has_keys = normaliser(b, l_tot)
            if v_scale is not None:     # FP8 V: its scale rides on the normalisation
                inv = b.mul(inv, v_scale)
            src = b.mad(b.mad(i, d, b.mul(c, fmt.per_vec)), 4, acc_all)
            out = [b.mov(0.0, F32) for _ in range(fmt.per_vec)]
            for w in range(nw):
                part = [x for q in range(fmt.per_vec // 4) for x in
                        b.ld("shared", F32, Addr(src, w * hp * d * 4 + q * 16), vec=4)]
                for e in range(fmt.per_vec):
                    b.fma(part[e], weights[w], out[e], out=out[e])
            out = [b.mul(x, inv) for x in out]
            head = b.add(head0, i) if "sinks" not in ptrs else head
            lse2 = log_sum_exp(b, m_tot, l_tot, has_keys, 1.0)  # log2 units
            if split_count is None:
                base = C.element_offset(b, ptrs["o"], batch, strides[("o", 0)])
                row = C.element_offset(b, b.bitcast(base, C.U64), head, strides[("o", 1)])
                C.store_vec(b, fmt, Addr(b.add(row, b.cvt(S64, b.mul(c, C.VEC_BYTES)))), C.from_f32(b, fmt, out, target))
                if spec.opt("return_lse"):
                    with b.if_then(b.setp("eq", c, 0)):
                        idx = b.mad(batch, spec.num_heads, head)
                        b.st("global", F32, Addr(C.element_offset(b, ptrs["lse"], idx, b.mov(4, S64))),
                             [b.mul(lse2, C.LN2)])
            else:  # workspace o_part [batch, H, splits, d] f32, lse_part [batch, H, splits] f32
                part_row = b.mad(b.mad(batch, spec.num_heads, head), split_count, b.special("%ctaid.z"))
                dst = C.element_offset(b, ptrs["o_part"], b.mad(part_row, d, b.mul(c, fmt.per_vec)), b.mov(4, S64))
                for q in range(0, fmt.per_vec, 4):
                    b.st("global", F32, Addr(dst, q * 4), out[q:q + 4])
                with b.if_then(b.setp("eq", c, 0)):
                    b.st("global", F32, Addr(C.element_offset(b, ptrs["lse_part"], part_row, b.mov(4, S64))), [lse2])
