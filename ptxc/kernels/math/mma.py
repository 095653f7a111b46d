"""Tensor-core tile math of the prefill kernel (f16/bf16, mma.sync.m16n8k16, f32 accumulate).

Warp w owns query rows [16w, 16w + 16) of the CTA's tile -- or, with warp_rows = 32, rows
[32w, 32w + 32) as two m16 tiles that share every K and V fragment (each ldmatrix of K or V
feeds two mma; score and P lists are then m-tile-major: n8 tile jn of m-tile mt at
mt * (block_n / 8) + jn). Per KV tile:
  S = Q·Kᵀ   block_n/8 accumulator tiles (16 x 8 f32, 4 registers each); A = Q fragments by
             ldmatrix.x4 from the Q tile, B = two n8 tiles of K per ldmatrix.x4 ([n][k] rows,
             matrices ordered so each B fragment is an adjacent register pair);
  softmax    lane (g = lane/4, t = lane%4) holds rows g and g+8, columns 2t, 2t+1 of every n8
             tile; row max by shfl.bfly 1 and 2, probabilities by one fma + ex2 each; row
             sums by one extra mma per k-step of P·V against a fragment of ones;
  O += P·V   the S accumulators of n8 tiles 2k, 2k+1, rounded to f16x2/bf16x2, are the A
             fragment of k-step k (no shared-memory round trip); B = two n8 tiles of V per
             ldmatrix.x4.trans ([k][n] rows).
A head_dim that is an odd multiple of 8 ends with a half k-step (zero upper A/B halves) and a
single n8 tile of V (ldmatrix.x2).
"""

from __future__ import annotations

from ...ir import B32, BF16, BF16X2, F16, F16X2, F32, S32, U32, Addr, KernelBuilder, Reg
from .. import common as C
from ..attention.prefill_tile import Ctx
from ..attention.softmax import (P_HEADROOM, exponentials, rescale_factor, rescale_vote, row_candidate,
                                 safe_max)
from ..mainloop.tiles import ldmatrix_lanes_mk, ldmatrix_lanes_nk, zero_regs
from .mma_output import MmaOutput
from .mma_qk8 import StagedE4m3Scores
from .q_rescale import rescale_q_rows


class MmaMath(MmaOutput):
    def __init__(self, b: KernelBuilder, ctx: Ctx):
        self.b, self.ctx, cfg = b, ctx, ctx.cfg
        # the products' inputs (Q, K, V tiles, P: cfg.math_fmt) and the output's format
        self.in_type = F16 if cfg.math_fmt.name == "f16" else BF16
        self.pair = F16X2 if cfg.math_fmt.name == "f16" else BF16X2
        self.out_pair = F16X2 if cfg.fmt.name == "f16" else BF16X2
        self.ss = cfg.q_geom.stride
        self.d, self.bn = cfg.head_dim, cfg.block_n
        self.mt = cfg.warp_rows // 16   # m16 tiles per warp
        self.ksteps, self.half_k = -(-self.d // 16), self.d % 16 == 8
        self.dtiles = cfg.dv // 8 // cfg.v_split  # n8 tiles of O (head_dim_v) this warp owns
        self.vs, self.os = cfg.v_geom.stride, cfg.o_geom.stride   # == ss unless head_dim_v < d
        self.scale_log2 = ctx.spec.softmax_scale * C.LOG2E
        # the soft-cap's (c·unit, 1 / (c·unit)) where the unit is a register (fold_k_scale)
        self.runtime_cap: tuple[Reg, Reg] | None = None
        # Q rescaled per row into f16 (rescale_q_to_f16): each of this lane's rows' scale_log2
        self.row_scales: list[Reg] | None = None
        # f16 P under f16 products: probabilities lifted by P_HEADROOM (softmax.py)
        self.p_lift = P_HEADROOM if cfg.f16_math else 0.0
        self.exp2_poly = getattr(ctx.cfg, "exp2_poly", 0)   # the tcgen05 tile's (config/tcgen05.py)
        lane = ctx.lane
        # ldmatrix lane addresses (tiles.LdmatrixLanes: padded or swizzled): Q and K's .x2 tail
        # by rows (l & 15), K by the adjacent-pair order, V (.trans) by k rows (l & 15).
        self.mk_lanes = ldmatrix_lanes_mk(b, lane, cfg.q_geom)
        self.k_lanes = ldmatrix_lanes_nk(b, lane, cfg.kv_geom)
        self.v_lanes = self.mk_lanes if cfg.v_geom.stride == self.ss and \
            cfg.v_geom.swizzled == cfg.q_geom.swizzled else ldmatrix_lanes_mk(b, lane, cfg.v_geom)
        vs = cfg.v_split   # warps sharing 16 rows; warp w owns O columns slice w % vs
        warp_rows = self.warp_row0(b, ctx)
        self.q_lanes = self.mk_lanes.bind(b.mad(warp_rows, self.ss, ctx.q_smem))
        self.partials = None   # score_split: this lane's slot of its row group's partial scores
        if cfg.score_split:
            assert not cfg.q_geom.swizzled and not self.half_k and self.ksteps % vs == 0
            part = b.rem(ctx.warp, vs)                       # which share of the depth
            depth = b.mul(part, self.ksteps // vs * 2 * 16)  # bytes: 2 chunks per k-step
            self.q_lanes = self.mk_lanes.shifted(depth).bind(b.mad(warp_rows, self.ss, ctx.q_smem))
            self.k_lanes = self.k_lanes.shifted(depth)
            group = b.mul(b.div(ctx.warp, vs), vs * self.bn // 8 * 512)
            base = b.add(b.add(ctx.q_smem, cfg.smem_bytes - cfg.exchange_bytes), group)
            self.partials = (b.add(base, b.shl(lane, 4)), b.mul(part, self.bn // 8 * 512))
        g, t = b.shr(lane, 2), b.and_(lane, 3)
        self.t = t
        row0 = b.add(ctx.m_start, b.add(warp_rows, g))
        self.rows = [row0] + [b.add(row0, 8 * i) for i in range(1, 2 * self.mt)]  # i = 2 mt + r
        two_t = b.bitcast(b.shl(t, 1), S32)
        self.two_t = two_t
        self.limits = [b.sub(ctx.key_limit(b, r), two_t) for r in self.rows]   # keys < limit - 2t
        # An attention chunk's first key (C * floor(p / C)) is a division ptxas keeps live per row
        # rather than recompute, and spilled for: where a row's key limit is its position + 1
        # (causal, no tree) the mask, which only tiles crossing a bound run, recomputes it
        v = ctx.variant
        self.begin_from_limit = v.chunk is not None and v.causal and not v.tree
        begins = None if self.begin_from_limit else [ctx.key_begin(b, r) for r in self.rows]
        self.begins = None if begins is None or begins[0] is None else \
            [b.sub(x, two_t) for x in begins]                                   # keys >= begin - 2t
        self.unit = 1.0 / ctx.spec.softmax_scale        # scores are raw q·k (variant transforms)
        # The custom mask's predicate (packed_tile.VarlenCtx.key_hidden): per-row state, and
        # the lane's first draft key offset (key0 is added per tile)
        self.mask_rows = None if getattr(ctx, "mask_bits", None) is None else \
            [ctx.mask_row(b, r) for r in self.rows]
        self.mask_key = None if self.mask_rows is None else ctx.draft_key(b, two_t)
        self.alibi = [ctx.alibi_row(b, r, two_t, self.unit) for r in self.rows] \
            if ctx.variant.alibi else None
        self.place_o(b, ctx, lane, warp_rows, g, t)
        self.col0 = None   # first O column of this warp's slice (u32), when the value is split
        if vs > 1:
            self.col0 = b.mul(self.value_part(b, ctx), cfg.dv // vs)
            col_bytes = b.mul(self.col0, cfg.fmt.bytes)
            self.o_smem = b.add(self.o_smem, col_bytes)
            self.v_lanes = self.v_lanes.shifted(col_bytes)
        self.zero = b.mov(0, B32)
        self.fzero = zero_regs(b, 4, F32)
        self.o_tiles = [[zero_regs(b, 4, F32) for _ in range(self.dtiles)] for _ in range(self.mt)]
        self.o = self.o_tiles[0]    # the first m-tile's (all of them with 16 rows per warp)
        self.m = [b.mov(C.NEG_INF, F32) for _ in range(2 * self.mt)]
        # Row sums on the tensor cores: P times a B fragment of ones adds each row's probabilities
        # of a k-step into every column of l_acc (rows g, g + 8 as for O), so no FADD chain and
        # no cross-lane reduction at the end; rescaled by alpha like O. One per m-tile.
        self.l_accs = [zero_regs(b, 4, F32) for _ in range(self.mt)]
        self.l_acc = self.l_accs[0]
        self.ones = b.mov(0x3C003C00 if cfg.math_fmt.name == "f16" else 0x3F803F80, B32)
        # S on FP8 tensor cores over the staged e4m3 rows (cfg.qk_staged: MLA's qk_products
        # where mma.m16n8k32 is native); set up by q_rewrite, which knows the target
        self.qk8: StagedE4m3Scores | None = None

    def warp_row0(self, b: KernelBuilder, ctx: Ctx) -> Reg:
        """This warp's first row in the CTA's tile: warp_rows per warp (warps sharing rows
        under a value split take the same ones)."""
        vs = ctx.cfg.v_split
        return b.mul(b.div(ctx.warp, vs) if vs > 1 else ctx.warp, ctx.cfg.warp_rows)

    def value_part(self, b: KernelBuilder, ctx: Ctx) -> Reg:
        """Which of the v_split slices of O's columns this warp owns (adjacent warps share rows)."""
        return b.rem(ctx.warp, ctx.cfg.v_split)

    def scores(self, k_tile: Reg) -> list[list[Reg]]:
        """Raw scores of the K tile at `k_tile` (with qk8: the staged e4m3 rows there)."""
        if self.qk8 is not None:
            return self.qk8.scores(k_tile)
        b = self.b
        k_lanes = self.k_lanes.bind(k_tile)
        k_lanes_half = self.mk_lanes.bind(k_tile) if self.half_k else None
        nt = self.bn // 8
        s: list = [None] * (self.mt * nt)
        steps = self.ksteps // self.ctx.cfg.v_split if self.partials is not None else self.ksteps
        for kk in range(steps):
            half = self.half_k and kk == self.ksteps - 1
            a = [b.ldmatrix(self.q_lanes.at(16 * mt, 2 * kk), 2 if half else 4)
                 for mt in range(self.mt)]
            if half:
                a = [x + [self.zero, self.zero] for x in a]
            for pair in range(self.bn // 16):
                kb = b.ldmatrix((k_lanes_half if half else k_lanes).at(pair * 16, 2 * kk),
                                2 if half else 4)
                frags = [(kb[0], self.zero), (kb[1], self.zero)] if half else \
                    [(kb[0], kb[1]), (kb[2], kb[3])]
                for e, frag in enumerate(frags):
                    for mt in range(self.mt):
                        jn = mt * nt + 2 * pair + e
                        s[jn] = b.mma_m16n8k16(a[mt], frag, s[jn] or self.fzero, self.in_type,
                                               out=s[jn])
        return s if self.partials is None else self.add_partials(s)

    def add_partials(self, s: list[list[Reg]]) -> list[list[Reg]]:
        """score_split: every warp of a row group stores its share of the depth (n8 tile jn of
        part p at ((p * nt + jn) * 32 + lane) * 16: a quarter-warp's v4 stores cover 128
        contiguous bytes), then, after a barrier, adds all parts in part order - so every warp
        of the group holds the same scores, bit for bit. The buffer is written again only after
        the next K/V tile's barrier, which every warp passes after these reads."""
        b, vs = self.b, self.ctx.cfg.v_split
        lane_slot, own = self.partials
        mine = b.add(lane_slot, own)
        for jn, acc in enumerate(s):
            b.st("shared", F32, Addr(mine, jn * 512), acc)
        b.bar_sync(0)
        total = []
        for jn in range(len(s)):
            parts = [b.ld("shared", F32, Addr(lane_slot, (p * len(s) + jn) * 512), vec=4) for p in range(vs)]
            acc = parts[0]
            for part in parts[1:]:
                acc = [b.add(x, y) for x, y in zip(acc, part)]
            total.append(acc)
        return total

    def transform(self, s: list[list[Reg]], key0: Reg) -> None:
        """The variant's score transforms (soft-cap, ALiBi); score (r, e) of n8 tile jn is key
        key0 + 2t + 8 jn + e of row r. (16 rows per warp: config/prefill.py refuses the others.)"""
        b, v = self.b, self.ctx.variant
        rows = [[(acc[2 * r + e], 8 * jn + e) for jn, acc in enumerate(s) for e in range(2)]
                for r in range(2)]
        alibi = None if self.alibi is None else \
            [(b.sub(rel, b.bitcast(key0, S32)), slope) for rel, slope in self.alibi]
        v.transform_scores(b, rows if v.alibi else s, key0, self.unit, alibi, self.runtime_cap)

    def _row_begin(self, i: int) -> Reg | None:
        """Row i's first key less 2t (s32), or None without a lower bound: held, or for a chunk
        recomputed from the row's key limit (p = (limit - 2t) + 2t - 1)."""
        if not self.begin_from_limit:
            return None if self.begins is None else self.begins[i]
        b = self.b
        pos = b.add(self.limits[i], b.sub(self.two_t, 1))
        return b.sub(self.ctx.variant.key_begin(b, pos), self.two_t)

    def mask(self, s: list[list[Reg]], key0: Reg) -> None:
        """-inf where key (key0 + 8 jn + 2t + e) >= the row's key limit (or, with a sliding
        window, < the row's first key; with a custom mask, where variant.MaskPredicate hides it:
        one bit window per row per 4 n8 tiles, then the predicate per score; with sparse keys,
        where the key has no cache row -- from the copies' valid-rows word, then alone, or each
        lane's slot loads)."""
        b, nt = self.b, self.bn // 8
        missing = getattr(self.ctx, "missing_key", None)
        valid_word = getattr(self.ctx, "valid_word", None)
        if valid_word is not None:   # sparse keys: the tile's word of rows with a cache row
            bits = b.shr(valid_word(key0), b.bitcast(self.two_t, U32))
            missing = [[b.setp("eq", b.and_(bits, 1 << (8 * jn + e)), 0) for e in range(2)]
                       for jn in range(nt)]
        elif missing is not None:   # sparse keys: the lane's keys key0 + 2t + 8 jn + e, any row
            lane_key = b.add(b.bitcast(key0, S32), self.two_t)
            missing = [[missing(b.add(lane_key, 8 * jn + e) if jn or e else lane_key)
                        for e in range(2)] for jn in range(nt)]
        # the valid-rows word already clears every key at or past the token's count, which is
        # every row's limit (sparse keys have no causal rule): that word is the whole mask
        only_word = (valid_word is not None and self.mask_rows is None
                     and not self.begin_from_limit and self.begins is None)
        for i in range(2 * self.mt):
            mt, r = divmod(i, 2)
            if only_word:
                for jn, acc in enumerate(s[mt * nt:(mt + 1) * nt]):
                    for e in range(2):
                        with b.predicate(missing[jn][e]):
                            b.mov(C.NEG_INF, F32, out=acc[2 * r + e])
                continue
            rel = b.sub(self.limits[i], b.bitcast(key0, S32))
            rel_begin = self._row_begin(i)
            if rel_begin is not None:
                rel_begin = b.sub(rel_begin, b.bitcast(key0, S32))
            k0 = None if self.mask_rows is None else b.add(self.mask_key, b.bitcast(key0, S32))
            window = None
            for jn, acc in enumerate(s[mt * nt:(mt + 1) * nt]):
                if k0 is not None and jn % 4 == 0:   # the row's bits of n8 tiles jn .. jn + 3
                    kc = b.add(k0, 8 * jn) if jn else k0
                    window = self.ctx.mask_window(b, self.mask_rows[i], kc, 8 * (min(4, nt - jn) - 1) + 2)
                for e in range(2):
                    out = b.setp("le", rel, 8 * jn + e)
                    if rel_begin is not None:
                        out = b.or_(out, b.setp("gt", rel_begin, 8 * jn + e))
                    if k0 is not None:   # the custom mask: one predicate over (row, key)
                        out = b.or_(out, self.ctx.key_hidden(b, window, kc, 8 * (jn % 4) + e))
                    if missing is not None:
                        out = b.or_(out, missing[jn][e])
                    with b.predicate(out):
                        b.mov(C.NEG_INF, F32, out=acc[2 * r + e])

    def softmax(self, s: list[list[Reg]]) -> list[list[Reg]]:
        """Online softmax with a lazy rescale: the running max m (log2 units) moves, and O and
        the row sums are rescaled, only when some row of the warp grew by more than
        RESCALE_SLACK; otherwise probabilities are taken against the stale m, so they reach at
        most 2^RESCALE_SLACK (exact all the same: O and l share the reference). The decision
        is warp-uniform (a butterfly max over all lanes), so the branch never diverges, and in
        steady state the 64 + 4 rescale multiplies per tile are skipped."""
        b, nt, n_rows = self.b, self.bn // 8, 2 * self.mt
        # rows[i]: row i = 2 mt + r of this lane (r = 0: g, 1: g + 8 of m-tile mt)
        rows = [[acc[2 * (i % 2) + e] for acc in s[i // 2 * nt:(i // 2 + 1) * nt] for e in range(2)]
                for i in range(n_rows)]
        cands = [row_candidate(b, self.m[i], rows[i], self.row_scale(i), (1, 2)) for i in range(n_rows)]
        with b.if_then(rescale_vote(b, cands, self.m, (4, 8, 16))):
            for i in range(n_rows):
                mt, r = divmod(i, 2)
                alpha = rescale_factor(b, self.m[i], safe_max(b, cands[i]))
                for acc in self.o_tiles[mt] + [self.l_accs[mt]]:
                    for e in range(2):
                        b.mul(acc[2 * r + e], alpha, out=acc[2 * r + e])
                b.mov(cands[i], out=self.m[i])
        a_frags = []
        for mt in range(self.mt):
            probs = []
            for r in range(2):
                probs.append(exponentials(b, rows[2 * mt + r], safe_max(b, self.m[2 * mt + r]),
                                          self.row_scale(2 * mt + r), lift=self.p_lift))
            # probs[r][2 jn + e] is element (r, e) of n8 tile jn; k-step k packs tiles 2k, 2k+1.
            pk = [[b.cvt_pack(self.pair, probs[r][2 * jn + 1], probs[r][2 * jn]) for r in range(2)]
                  for jn in range(nt)]
            a_frags += [pk[2 * k] + pk[2 * k + 1] for k in range(self.bn // 16)]
        return a_frags

    def sums_max(self) -> list[Reg]:
        """The reference the row sums and O are against, per row: m, or m - P_HEADROOM where
        the probabilities are lifted (what the lse and a sink must be taken against)."""
        return self.m if not self.p_lift else [self.b.sub(m, self.p_lift) for m in self.m]

    def fold_k_scale(self, k_scale: Reg) -> None:
        """An FP8 cache's k_scale joins the softmax factor: the scores stay q·fp8(K), so the
        spec's score is scale · k_scale · x and the score transforms' unit becomes
        1 / (softmax_scale · k_scale), a register. Their constants -- the soft-cap's c·unit and
        its inverse, the ALiBi slopes -unit·slope -- are made here, once before the loop."""
        b, v = self.b, self.ctx.variant
        self.scale_log2 = b.mul(k_scale, self.scale_log2)
        if not v.transforms:
            return
        inv_k = b.rcp(k_scale)
        if v.soft_cap is not None:
            c = v.soft_cap * self.unit
            self.runtime_cap = (b.mul(inv_k, c), b.mul(k_scale, 1.0 / c))
        if self.alibi is not None:     # -unit·slope at the constant unit, over k_scale
            self.alibi = [(rel, b.mul(slope, inv_k)) for rel, slope in self.alibi]

    def row_scale(self, i: int):
        """The factor from row i's raw scores to log2 units (a float, or a register with a
        runtime k_scale or a rescaled Q)."""
        return self.scale_log2 if self.row_scales is None else self.row_scales[i]

    def rescale_q_to_f16(self) -> None:
        """The Q tile's bf16 rows into f16 in place before the loop (q_rescale.rescale_q_rows),
        each row's softmax factor taking the inverse power (row_scale). Never under a score
        transform (kv_fp8_stage.f16_math_applies): its unit would be the row's."""
        assert not self.ctx.variant.transforms, "score transforms over per-row Q powers"
        self.row_scales = rescale_q_rows(self)

    def q_rewrite(self, target):
        """What rewrites the landed Q tile before the loop, or None: its rows rounded to e4m3
        values (cfg.q_e4m3: MLA's qk_products; conversions for `target`) or rescaled into f16
        (cfg.f16_math); each row's softmax factor takes the inverse power either way."""
        cfg = self.ctx.cfg
        if getattr(cfg, "q_e4m3", False):
            staged = getattr(cfg, "qk_staged", False)
            if staged:      # the A fragments' lane addresses, before the loop
                self.qk8 = StagedE4m3Scores(self, cfg.staging_geom(cfg.staged_row_bytes).stride, target)

            def round_rows() -> None:
                self.row_scales = rescale_q_rows(self, e4m3_on=target)
                if staged:   # every lane's rounded chunks visible, then its e4m3 fragments
                    self.cta_sync()
                    self.qk8.load_q()
            return round_rows
        return self.rescale_q_to_f16 if cfg.f16_math else None

    def pv(self, a_frags: list[list[Reg]], v_tile: Reg) -> None:
        b, kt = self.b, self.bn // 16
        v_lanes = self.v_lanes.bind(v_tile)
        for kk in range(kt):
            a = [a_frags[mt * kt + kk] for mt in range(self.mt)]   # this k-step of each m-tile
            for mt, l_acc in enumerate(self.l_accs):
                b.mma_m16n8k16(a[mt], (self.ones, self.ones), l_acc, self.in_type, out=l_acc)
            for pair in range(-(-self.dtiles // 2)):
                both = 2 * pair + 1 < self.dtiles
                vb = b.ldmatrix(v_lanes.at(kk * 16, 2 * pair), 4 if both else 2, trans=True)
                frags = [(vb[0], vb[1]), (vb[2], vb[3])] if both else [(vb[0], vb[1])]
                for e, frag in enumerate(frags):
                    for mt in range(self.mt):
                        acc = self.o_tiles[mt][2 * pair + e]
                        b.mma_m16n8k16(a[mt], frag, acc, self.in_type, out=acc)

    def writer(self) -> Reg:
        """The lanes that write a row's LSE: t == 0, of the first warp sharing the row."""
        b = self.b
        w = b.setp("eq", self.t, 0)
        return w if self.col0 is None else b.and_(w, b.setp("eq", self.col0, 0))

    def row_sums(self) -> tuple[list[Reg], tuple[int, ...]]:
        """Each of this lane's rows' softmax denominators, and the lanes finish_rows must still
        reduce over: none, the tensor-core row sums are complete in every lane."""
        return [l_acc[2 * r] for l_acc in self.l_accs for r in range(2)], ()

    def cta_sync(self) -> None:
        """A barrier of every thread that computes (the whole CTA here)."""
        self.b.bar_sync(0)
