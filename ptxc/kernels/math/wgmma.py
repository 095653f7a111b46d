"""Prefill on Hopper warpgroup MMA (target sm_90a, f16/bf16, head_dim and head_dim_v 64, 128, 192
or 256: DeepSeek's 192 / 128 included).

The same FlashAttention-2 forward as prefill.py, with both products on `wgmma.mma_async`:

  CTA        block_m / 64 warpgroups (4 warps each); warpgroup g owns query rows [64g, 64g + 64),
             warp w of the CTA rows [16w, 16w + 16) -- exactly the rows the mma.sync path gives
             warp w, so the per-row softmax, masks, variants and epilogue of `MmaMath` apply as
             they are (the wgmma m64nN accumulator is N/8 mma.m16n8 C fragments per warp).
  shared     Q (block_m rows), then `num_stages` K tiles and `num_stages` V tiles (block_n rows;
             V's of head_dim_v columns, K's of head_dim),
             each split along d into 128-byte column slabs (64 elements; d = 128 has two) of
             rows x 128 B with the 128-byte swizzle: 16-byte chunk c of row r sits at chunk
             c ^ (r % 8). Every slab starts 1024-byte aligned (one swizzle period).
  loads      per-thread cp.async 16-byte chunks at the swizzled addresses (the loader of
             tiles.py with a swizzled thread slot), K/V stages tracked by cp.async groups in the
             shared pipeline of kv_pipeline.py; a `fence.proxy.async` after each barrier makes
             the landed tiles visible to the tensor cores' (async-proxy) reads.
             That is tile.kv_loads = "cp_async"; the default, "tma", loads one TMA box per slab
             from q/k/v tensor-map parameters under mbarriers instead (tma_pipeline.py).
  S = Q·Kᵀ   d/16 `wgmma m64n{block_n}k16` with A = Q and B = K from K-major descriptors
             (SBO 1024 = 8 rows; a k16 step moves the start 32 B inside a slab, the next slab
             by rows x 128 B), one commit group, waited at once.
  O += P·V   P rounded to f16x2/bf16x2 is the register-A fragment of `wgmma m64n{dv}k16`
             (block_n/16 of them); B = V read MN-major (transpose bit) from the same swizzled
             rows: SBO 1024 = 8 keys, LBO = the slab distance (block_n x 128 B).
  row sums   one mma.sync m16n8k16 per k16 step against ones, issued before the P·V chain
             (its A registers may not be read while a wgmma holding them is in flight).

With tile.warp_specialize (TMA only; the default there) a producer warpgroup issues the loads
under full/empty mbarriers and the warpgroups above only compute, optionally taking turns at
their wgmma (tile.pingpong) or three of them at block_m 192 (tma_ws_pipeline.py; prefill_tma.py
builds both TMA bodies). Other head dims and f32 take the mma.sync / SIMT kernels on sm_90a as
on sm_90.
"""

from __future__ import annotations

from ...ir import E4M3, F32, U64, Addr, Imm, KernelBuilder, Reg
from ..attention.prefill_tile import Ctx
from ..attention.softmax import exponentials, rescale_factor, rescale_vote, row_candidate, safe_max
from ..config.wgmma import ROWS_PER_WARPGROUP
from ..mainloop.tiles import CHUNK, NARROW_SWIZZLE, SWIZZLE, SWIZZLE_PERIOD, zero_regs
from ..mainloop.tma_ws_pipeline import CONSUMER_BARRIER
from .mma import MmaMath


class WgmmaMath(MmaMath):
    """MmaMath with S = Q·Kᵀ and O += P·V on wgmma (see the module docstring)."""

    def __init__(self, b: KernelBuilder, ctx: Ctx):
        super().__init__(b, ctx)
        cfg = ctx.cfg
        self.bm = cfg.block_m
        # lane 0's warp index: the same value, but one ptxas can prove warp-uniform, so the Q
        # descriptors live in uniform registers (no R2UR per wgmma; Triton does the same)
        warpgroup = b.shr(b.shfl("idx", ctx.warp, 0), 2)
        vs = cfg.v_split   # warpgroups sharing 64 rows, each owning dv / vs columns of O
        q_rows = ctx.q_smem if vs > 1 else b.mad(warpgroup, ROWS_PER_WARPGROUP * SWIZZLE, ctx.q_smem)
        # qk_e4m3 (MLA's latent tile, qk_products = "e4m3"): S on m64nNk32 e4m3 wgmma over Q's
        # and the rows' e4m3 bytes in 64-byte slabs (a k32 step is half a slab row)
        self.narrow = getattr(cfg, "qk_e4m3", False)
        self.score_slab = NARROW_SWIZZLE if self.narrow else SWIZZLE
        self.q_desc = b.matrix_descriptor(q_rows, CHUNK, 8 * self.score_slab, self.score_slab)
        # its value columns: whole 128-byte slabs of V further (slab stride block_n x 128 B)
        self.v_off = None if vs == 1 else \
            b.mul(warpgroup, cfg.dv // vs * cfg.fmt.bytes // SWIZZLE * self.bn * SWIZZLE)
        self.s_acc = zero_regs(b, self.bn // 2, F32)   # written before use: scale_d = 0 at k 0
        # score chains (LatentWgmmaConfig.score_chains, FP8 products): S's k-steps dealt round
        # robin to this many accumulators, added in f32 once they retire -- Hopper's FP8 wgmma
        # keeps 13 fraction bits of each step's sum, C included (emu/fp8.accumulate), so a
        # shorter chain carries a smaller C past each step's products
        self.s_chains = [self.s_acc] + [zero_regs(b, self.bn // 2, F32)
                                        for _ in range(getattr(cfg, "score_chains", 1) - 1)]
        # split scores (MLA's latent tile, LatentWgmmaConfig.split_scores): warpgroup p issues
        # the k16 steps 2i + p of S (its descriptors 32 B further: inside a slab, steps 2i are
        # at 0 or 64 B, so 2i + 1 never crosses one) and the two exchange partial sums
        self.split = None
        if getattr(cfg, "split_scores", False):
            assert vs == 2 and self.ksteps % (4 if self.narrow else 2) == 0 and not self.half_k
            tid = b.and_(ctx.tid, 127)
            base = b.add(ctx.q_smem, cfg.smem_bytes - cfg.score_exchange_bytes)
            block = self.bn // 8 * 128 * 16          # a warpgroup's partial S: n8 tile jn, thread t
            slot0 = b.add(base, b.shl(tid, 4))       # ... at (jn * 128 + t) * 16: v4 stores
            mine = b.add(slot0, b.mul(warpgroup, block))
            other = b.add(slot0, b.mul(b.xor(warpgroup, 1), block))
            self.split = (b.mul(warpgroup, 2), mine, other)   # (descriptor step, slots)
            self.q_desc = b.add(self.q_desc, b.cvt(U64, self.split[0]))
        # P of the last softmax, kept for the P·V of the next iteration (A fragments per k16)
        self.p_frags = [[b.mov(0, self.pair) for _ in range(4)] for _ in range(self.bn // 16)]
        self.alpha = [b.mov(1.0, F32) for _ in range(2)]

    def warp_row0(self, b: KernelBuilder, ctx: Ctx) -> Reg:
        """Warp w of a warpgroup owns rows [16w, 16w + 16) of the warpgroup's 64 (wgmma's
        accumulator layout); under a value split (block_m 64) every warpgroup has the same rows."""
        if ctx.cfg.v_split == 1:
            return super().warp_row0(b, ctx)
        return b.mul(b.and_(ctx.warp, 3), 16)

    def value_part(self, b: KernelBuilder, ctx: Ctx) -> Reg:
        """The warpgroup's slice of O's columns (v_split warpgroups share the rows)."""
        return b.shr(ctx.warp, 2)

    def cta_sync(self) -> None:
        """The computing warpgroups' barrier (the epilogue's, the score exchange's): their named
        barrier when a producer warpgroup (which never reaches it) shares the CTA."""
        if getattr(self.ctx.cfg, "producer_warpgroup", False):
            self.b.bar_sync(CONSUMER_BARRIER, self.ctx.cfg.threads)
        else:
            self.b.bar_sync(0)

    def issue_scores(self, k_tile: Reg) -> list[list[Reg]]:
        """Issue S = Q·Kᵀ as one commit group (not waited); returns S as n8 accumulator tiles."""
        b, slab = self.b, self.score_slab
        k_desc = b.matrix_descriptor(k_tile, CHUNK, 8 * slab, slab)
        depth = 32 if self.narrow else 16
        steps = range(self.d // depth)
        if self.split is not None:        # this warpgroup's half of the depth: steps 2i + p
            k_desc = b.add(k_desc, b.cvt(U64, self.split[0]))
            steps = range(0, self.d // depth, 2)
        in_type, chains = E4M3 if self.narrow else self.in_type, len(self.s_chains)
        b.wgmma_fence()
        for i, kk in enumerate(steps):
            b.wgmma(self.s_chains[i % chains], k_step(b, self.q_desc, kk, self.bm, slab),
                    k_step(b, k_desc, kk, self.bn, slab), in_type, scale_d=i >= chains)
        b.wgmma_commit()
        return [self.s_acc[4 * j:4 * j + 4] for j in range(self.bn // 8)]

    def skip_pv(self) -> None:
        """No P·V this tile: an empty group, so that scores_ready's wait_group 1 retires S."""
        self.b.wgmma_commit()

    def scores_ready(self, s: list[list[Reg]]) -> list[list[Reg]]:
        """S issued by issue_scores, complete (the P·V issued after it may still run). Split
        scores: each warpgroup stores its partial sums, and after a barrier adds the other's
        (a + b == b + a, so both hold the same S bit for bit). The slots are written again only
        after the loop's next barrier, which every thread passes after these reads."""
        b = self.b
        b.wgmma_wait(1)
        for more in self.s_chains[1:]:    # the chains' partial sums, in f32
            s = [[b.add(x, y) for x, y in zip(acc, more[4 * jn:4 * jn + 4])] for jn, acc in enumerate(s)]
        if self.split is None:
            return s
        _, mine, other = self.split
        for jn, acc in enumerate(s):
            b.st("shared", F32, Addr(mine, jn * 128 * 16), acc)
        self.cta_sync()
        return [[b.add(x, y) for x, y in zip(acc, b.ld("shared", F32, Addr(other, jn * 128 * 16), vec=4))]
                for jn, acc in enumerate(s)]

    def pv_done(self) -> None:
        self.b.wgmma_wait(0)

    def p_visible(self) -> None:
        """Before a P·V that no loop barrier precedes (a latent loop's last): P is this
        warpgroup's own registers, nothing to order."""

    def issue_pv(self, v_tile: Reg, frags: list[list[Reg]] | None = None) -> None:
        """Issue O += P·V with the packed P of the previous softmax (or `frags`, another P's A
        fragments: the seesaw's received P) as one commit group."""
        b = self.b
        if self.narrow and not getattr(self.ctx.cfg, "qk_direct", False):
            v_tile = b.add(v_tile, self.bn * self.d)     # V's 16-bit columns after the e4m3 bytes
        if self.v_off is not None:      # this warpgroup's value columns
            v_tile = b.add(v_tile, self.v_off)
        v_desc = b.matrix_descriptor(v_tile, self.bn * SWIZZLE, SWIZZLE_PERIOD, SWIZZLE)
        acc = [r for tile in self.o for r in tile]
        b.wgmma_fence()
        for kk, a in enumerate(frags or self.p_frags):   # keys 16kk..16kk+15: 2 swizzle periods further
            desc = v_desc if kk == 0 else b.add(v_desc, Imm(kk * 2 * SWIZZLE_PERIOD >> 4, U64))
            b.wgmma(acc, a, desc, self.in_type, scale_d=True, trans_b=1)
        b.wgmma_commit()

    def softmax_early(self, s: list[list[Reg]]) -> tuple[list[list[Reg]], Reg]:
        """MmaMath.softmax up to the probabilities, touching neither O nor P (a P·V that reads
        them may still be in flight): row max, the warp-uniform lazy-rescale vote, the
        exponentials, then (in a branch) the new m, alpha and the row sums' rescale. Returns
        (probs, rescale)."""
        b = self.b
        rows = [[acc[2 * r + e] for acc in s for e in range(2)] for r in range(2)]
        cands = [row_candidate(b, self.m[r], rows[r], self.row_scale(r), (1, 2)) for r in range(2)]
        rescale = rescale_vote(b, cands, self.m, (4, 8, 16))
        # the exponentials first, against the max this tile will use (branch-free), so that
        # they sit in the basic block before the rescale branch and the wait that follows it
        m_use = [b.selp(cands[r], self.m[r], rescale) for r in range(2)]
        probs = [exponentials(b, rows[r], safe_max(b, m_use[r]), self.row_scale(r), self.exp2_poly,
                              lift=self.p_lift)
                 for r in range(2)]
        self.move_max(rescale, cands)
        return probs, rescale

    def move_max(self, rescale: Reg, m_new: list[Reg]) -> None:
        """Where the warp voted to rescale: alpha = 2^(m - m_new), the row sums scaled by it and
        m <- m_new (O follows in rescale_o, once no P·V holds it)."""
        b = self.b
        with b.if_then(rescale):
            for r in range(2):
                b.mov(rescale_factor(b, self.m[r], safe_max(b, m_new[r])), out=self.alpha[r])
                for e in range(2):
                    b.mul(self.l_acc[2 * r + e], self.alpha[r], out=self.l_acc[2 * r + e])
                b.mov(m_new[r], out=self.m[r])

    def softmax_late(self, probs: list[list[Reg]], rescale: Reg) -> None:
        """After the previous P·V retired: O *= alpha (when rescaling), P packed into the
        registers the next P·V reads, the row sums by mma.sync against ones."""
        self.rescale_o(rescale)
        self.pack_probs(probs)
        self.add_row_sums()

    def rescale_o(self, rescale: Reg) -> None:
        """O *= alpha where the warp voted to rescale (O not in flight)."""
        b = self.b
        with b.if_then(rescale):
            for r in range(2):
                for acc in self.o:
                    for e in range(2):
                        b.mul(acc[2 * r + e], self.alpha[r], out=acc[2 * r + e])

    def pack_probs(self, probs: list[list[Reg]]) -> None:
        """P rounded to f16x2/bf16x2 pairs in the A-fragment registers of the next P·V."""
        for jn in range(self.bn // 8):   # n8 tile jn is half of k-step jn // 2
            frag = self.p_frags[jn // 2]
            for r in range(2):
                self.b.cvt_pack(self.pair, probs[r][2 * jn + 1], probs[r][2 * jn],
                                out=frag[2 * (jn % 2) + r])

    def add_row_sums(self, frags: list[list[Reg]] | None = None) -> None:
        """The packed P's (or `frags`') row sums, by mma.sync against a fragment of ones."""
        for a in frags or self.p_frags:
            self.b.mma_m16n8k16(a, (self.ones, self.ones), self.l_acc, self.in_type,
                                out=self.l_acc)


def k_step(b: KernelBuilder, desc: Reg, kk: int, rows: int, slab: int = SWIZZLE) -> Reg:
    """Descriptor (wgmma's or tcgen05's: the start field is the same) of step kk (32 bytes of
    each row: k16 of 16-bit, k32 of 8-bit elements) of a K-major operand of `rows` rows in
    `slab`-byte swizzled slabs: +32 B per step inside a slab, + rows x slab per slab (the start
    field counts 16-byte units)."""
    per = slab // 32
    off = (kk % per) * 32 + (kk // per) * rows * slab
    return desc if off == 0 else b.add(desc, Imm(off >> 4, U64))
