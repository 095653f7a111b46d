"""SIMT (f32 FMA) tile math of the prefill kernel: the reference-precision path and the sm_75
fallback, on the same shared-memory tiles and pipeline as the tensor-core path.

A warp is 4 row groups of 8 lanes; a row group owns `rows_per_thread` consecutive query rows.
Lane tx of a group holds, for each of its rows, the scores of keys tx, tx + 8, ... of the tile
(128-bit K row reads, conflict-free thanks to the odd row stride) and the output chunks
tx, tx + 8, ... of head_dim (4 floats each). Row max and sum reduce over the group with
shfl.bfly 1, 2, 4; for P·V each probability is broadcast in the group with shfl.idx.
"""

from __future__ import annotations

from ...ir import F32, S32, Addr, KernelBuilder, Reg
from .. import common as C
from ..attention.prefill_tile import Ctx
from ..attention.softmax import online_update
from ..attention.variant import finish_rows
from ..config.prefill import SIMT_LANES_PER_ROW as X
from ..mainloop.tiles import zero_regs

GROUPS = 32 // X


class SimtMath:
    def __init__(self, b: KernelBuilder, ctx: Ctx):
        self.b, self.ctx, cfg = b, ctx, ctx.cfg
        self.ss, self.bn = cfg.q_geom.stride, cfg.block_n
        self.tm, self.jn = cfg.rows_per_thread, cfg.block_n // X
        self.c4 = cfg.head_dim // 4
        self.c4v = cfg.dv // 4                       # O / V chunks (head_dim_v)
        self.vs = cfg.v_geom.stride
        self.u = -(-self.c4v // X)
        self.scale_log2 = ctx.spec.softmax_scale * C.LOG2E
        lane = ctx.lane
        ry, self.tx = b.shr(lane, 3), b.and_(lane, X - 1)
        group_row = b.mad(ctx.warp, GROUPS * self.tm, b.mul(ry, self.tm))
        self.q_thr = b.mad(group_row, self.ss, ctx.q_smem)
        self.k_off, self.v_off = b.mul(self.tx, self.ss), b.mul(self.tx, 16)
        first = b.add(ctx.m_start, group_row)
        self.rows = [b.add(first, i) if i else first for i in range(self.tm)]
        tx_s = b.bitcast(self.tx, S32)
        self.limits = [b.sub(ctx.key_limit(b, r), tx_s) for r in self.rows]   # keys < limit - tx
        begins = [ctx.key_begin(b, r) for r in self.rows]                    # keys >= begin - tx
        self.begins = None if begins[0] is None else [b.sub(x, tx_s) for x in begins]
        self.unit = 1.0 / ctx.spec.softmax_scale        # scores are raw q·k (variant transforms)
        self.alibi = [ctx.alibi_row(b, r, tx_s, self.unit) for r in self.rows] \
            if ctx.variant.alibi else None
        group = b.and_(lane, 32 - X)
        self.src = [b.or_(group, n) if n else group for n in range(X)]
        self.chunk_ok = b.setp("lt", self.tx, self.c4v - (self.u - 1) * X) if self.c4v % X else None
        self.o = [[zero_regs(b, 4, F32) for _ in range(self.u)] for _ in range(self.tm)]
        self.m = [b.mov(C.NEG_INF, F32) for _ in range(self.tm)]
        self.l = zero_regs(b, self.tm, F32)

    def scores(self, k_tile: Reg) -> list[list[Reg]]:
        b, ss = self.b, self.ss
        k_thr = b.add(k_tile, self.k_off)
        s: list[list] = [[None] * self.jn for _ in range(self.tm)]
        for c in range(self.c4):
            q = [b.ld("shared", F32, Addr(self.q_thr, i * ss + c * 16), vec=4) for i in range(self.tm)]
            k = [b.ld("shared", F32, Addr(k_thr, jj * X * ss + c * 16), vec=4) for jj in range(self.jn)]
            for i in range(self.tm):
                for jj in range(self.jn):
                    for e in range(4):
                        prev = s[i][jj]
                        s[i][jj] = b.mul(q[i][e], k[jj][e]) if prev is None else \
                            b.fma(q[i][e], k[jj][e], prev, out=prev)
        return s

    def transform(self, s: list[list[Reg]], key0: Reg) -> None:
        """The variant's score transforms (soft-cap, ALiBi); score (i, jj) is key
        key0 + tx + 8 jj of row i."""
        b, v = self.b, self.ctx.variant
        rows = [[(x, jj * X) for jj, x in enumerate(row)] for row in s]
        alibi = None if self.alibi is None else \
            [(b.sub(rel, b.bitcast(key0, S32)), slope) for rel, slope in self.alibi]
        v.transform_scores(b, rows if v.alibi else s, key0, self.unit, alibi)

    def mask(self, s: list[list[Reg]], key0: Reg) -> None:
        """-inf where key (key0 + tx + 8 jj) >= the row's key limit (or, with a sliding
        window, < the row's first key)."""
        b = self.b
        for i, row in enumerate(s):
            rel = b.sub(self.limits[i], b.bitcast(key0, S32))
            rel_begin = None if self.begins is None else b.sub(self.begins[i], b.bitcast(key0, S32))
            for jj, x in enumerate(row):
                out = b.setp("le", rel, jj * X)
                if rel_begin is not None:
                    out = b.or_(out, b.setp("gt", rel_begin, jj * X))
                with b.predicate(out):
                    b.mov(C.NEG_INF, F32, out=x)

    def softmax(self, s: list[list[Reg]]) -> list[list[Reg]]:
        b = self.b
        alphas, probs = online_update(b, self.m, self.l, s, self.scale_log2, (1, 2, 4))
        for i, chunks in enumerate(self.o):
            for chunk in chunks:
                for x in chunk:
                    b.mul(x, alphas[i], out=x)
        return probs

    def _v_chunk(self, v_thr: Reg, n: int, u: int) -> list[Reg]:
        b = self.b
        addr = Addr(v_thr, n * self.vs + u * X * 16)
        if self.chunk_ok is None or u < self.u - 1:
            return b.ld("shared", F32, addr, vec=4)
        regs = zero_regs(b, 4, F32)
        with b.predicate(self.chunk_ok):
            b.ld("shared", F32, addr, vec=4, out=regs)
        return regs

    def pv(self, probs: list[list[Reg]], v_tile: Reg) -> None:
        b = self.b
        v_thr = b.add(v_tile, self.v_off)
        for n in range(self.bn):
            pn = [b.shfl("idx", probs[i][n // X], self.src[n % X]) for i in range(self.tm)]
            for u in range(self.u):
                v = self._v_chunk(v_thr, n, u)
                for i in range(self.tm):
                    for e, x in enumerate(self.o[i][u]):
                        b.fma(pn[i], v[e], x, out=x)

    def epilogue(self) -> None:
        b, ctx = self.b, self.ctx
        invs = finish_rows(b, ctx, self.m, self.l, self.rows, (1, 2, 4), b.setp("eq", self.tx, 0))
        col = b.cvt(C.S64, b.mul(self.tx, 16))
        for i, row in enumerate(self.rows):
            ok = b.setp("lt", row, ctx.seq_q)
            base = b.add(C.element_offset(b, ctx.o_base, row, ctx.o_row_stride), col)
            for u, chunk in enumerate(self.o[i]):
                pred = ok if self.chunk_ok is None or u < self.u - 1 else b.and_(ok, self.chunk_ok)
                vals = [b.mul(x, invs[i]) for x in chunk]
                with b.predicate(pred):
                    b.st("global", F32, Addr(base, u * X * 16), vals)

