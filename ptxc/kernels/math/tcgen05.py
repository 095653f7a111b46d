"""Prefill on Blackwell's fifth-generation tensor core (target sm_100a / sm_103a, f16/bf16,
head_dim and head_dim_v 64, 128, 192 or 256, head_dim_v <= head_dim): the sm_90a TMA kernel's
schedule (tma_pipeline.py, one elected thread issuing every copy) with both products on
`tcgen05.mma` and S, P and O in tensor memory -- or, with tile.warp_specialize (the default
from head_dim 128), FlashAttention-4's load / MMA / softmax warps (tcgen05_ws_pipeline.py).

  CTA        128 query rows, 8 warps. Tensor memory gives warp w the 32 lanes of its
             sub-partition 32 (w % 4); warps w and w + 4 split them: warp w owns rows
             32 (w % 4) + 16 (w // 4) .. + 15, whose cells it reads with tcgen05.ld.16x256b --
             the mma.m16n8 C fragment layout per n8 block -- so MmaMath's per-row softmax,
             masks, variants and epilogue apply as they are.
  tensor     per CTA, allocated by warp 0: S (block_n f32 columns), P (block_n / 2 columns of
  memory     f16/bf16 pairs: column c holds keys 2c, 2c + 1), O (head_dim_v f32 columns),
             rounded up to a power of two (256 at d64, 512 at d128); the MMA-side objects
             and the allocation are umma.py's.
  shared     Q and the K/V stages in 128-byte-swizzled slabs, filled by TMA, as math/wgmma.py.
  S = Q·Kᵀ   warp 0 computes the descriptors and one lane (elect.sync) issues head_dim/16
             `tcgen05.mma.kind::f16` M128 N{block_n} K16 (A = Q, B = K, K-major descriptors),
             commits to mbarrier bar_s.
  O += P·V   the same lane issues block_n/16 MMAs M128 N{dv} K16 with A = P from tensor memory and
             B = V read MN-major, commits to bar_o. O is zeroed once, so every MMA accumulates.
  tile j     issue S(j) and O += P(j-1)·V(j-1) (an empty commit at j = 0); wait bar_s, load S,
             mask/variant, row max and exponentials (under P·V(j-1)); wait bar_o; when the max
             grew past the lazy-rescale slack, O *= alpha through registers (load, scale,
             store); store P; row sums by mma.sync against ones; tcgen05.fence + the
             pipeline's bar.sync before warp 0 issues tile j+1 (which overwrites S and P).
  epilogue   wait the last P·V, load O (16x256b), MmaMath's normalise + staged row stores,
             then warp 0 frees the tensor memory.

FA4's two Q tiles per CTA (tile.q_tiles: a Tcgen05Math per tile, its columns and barriers
from tcgen05_ws_pipeline.QTile) and its correction warpgroup (tile.correction: Correction and
Exchange below, P double-buffered) are the warp-specialised pipeline's. MLA's latent tile
(attention/latent_tcgen05.py) is this math at M = 64 over a 576-deep S with the value columns
split between two CTAs (`value_part` = %ctaid.z; O's `o_columns` = 256 of 512 each, V's
descriptor that many columns into the latent tile). Verified in the
emulator only (no Blackwell GPU has been lent).
"""

from __future__ import annotations

from ...ir import F32, U32, Addr, KernelBuilder, Reg
from ..attention.prefill_tile import Ctx
from .mma import MmaMath
from .umma import BAR_O, BAR_O1, BAR_S, X_FREE0, X_FREE1, UmmaIssue, allocate
from .wgmma import WgmmaMath


class Tcgen05Math(WgmmaMath):
    """WgmmaMath's softmax over S and O kept in tensor memory (see the module docstring); the
    pipeline calls the same hooks (issue_scores, issue_pv / skip_pv, scores_ready, pv_done,
    softmax_early / softmax_late, epilogue). M = block_m: 128 rows on 8 warps, or 64 on 4
    (data-path layout F: row i at lane 32 (i // 16) + i % 16, so warp w's 16 rows are the
    first half of its sub-partition). `bars`: the MMA region of shared memory (BAR_S ..
    TMEM_SLOT). Without `tmem` it initialises its barriers
    and allocates the tensor memory itself (one-issuer kernels); the warp-specialised pipeline
    does both before its warps part and passes the base -- with two Q tiles (tile.q_tiles) this
    tile's first column and barriers, `barrier` the named barrier (id, threads) of the tile's
    warps for the epilogue, and `frees_tmem` False: the pipeline frees the tensor memory once
    both tiles have loaded their O."""

    def __init__(self, b: KernelBuilder, ctx: Ctx, bars: Reg, tmem: Reg | None = None,
                 barrier: tuple[int, int] | None = None, frees_tmem: bool = True,
                 exchange: Reg | None = None, o_run: int | None = None):
        MmaMath.__init__(self, b, ctx)
        # n8 blocks of O one tcgen05.ld / st moves at most (None: all): ptxas checks each
        # instruction's registers against the kernel's launch budget, not setmaxnreg's
        self.o_run = o_run
        self.barrier, self.frees_tmem = barrier, frees_tmem
        # tile.correction: O is rescaled by the correction warps (Correction), which read
        # this warp's alpha and vote from `exchange` (shared memory, after the MMA region)
        self.exchange = Exchange(b, exchange, ctx.cfg.num_warps) if exchange is not None else None
        cfg = ctx.cfg
        self.bm, self.dv = cfg.block_m, cfg.o_columns     # this CTA's columns of O
        self.p_frags = [[b.mov(0, self.pair) for _ in range(4)] for _ in range(self.bn // 16)]
        self.alpha = [b.mov(1.0, F32) for _ in range(2)]
        self.issuer = b.setp("eq", ctx.tid, 0)
        self.warp0 = b.setp("eq", b.shfl("idx", ctx.warp, 0), 0)    # warp-uniform
        if tmem is None:
            with b.if_then(self.issuer):
                b.mbarrier_init(Addr(bars, BAR_S), 1)
                b.mbarrier_init(Addr(bars, BAR_O), 1)
            tmem = allocate(b, self.warp0, bars, cfg.tmem_columns)
        self.tmem = tmem
        # value_ctas: this CTA's V slabs start col0 columns into each tile (slabs of block_n rows)
        v_off = None if self.col0 is None else b.mul(self.col0, cfg.fmt.bytes * cfg.block_n)
        self.umma = UmmaIssue(b, cfg, ctx.q_smem, tmem, bars, v_off=v_off)
        self.bar_s, self.bar_o = self.umma.bar_s, self.umma.bar_o
        lane_bits = b.shl(self._lane0(b, ctx), 16)           # this warp's 16 lanes (rows)
        self.s_warp, self.p_warp, self.o_warp = (b.add(c, lane_bits) for c in (
            self.umma.s_cols, self.umma.p_cols, self.umma.o_cols))
        self.s_phase, self.o_phase = b.mov(0, U32), b.mov(0, U32)
        zeros = [self.fzero[0]] * (4 * (self.dv // 8))
        self._store_o(zeros)                               # O = 0: every P·V accumulates
        b.tcgen05_fence(before=True)

    def _lane0(self, b: KernelBuilder, ctx: Ctx) -> Reg:
        """Warp w's first tensor-memory lane: 32 (w % 4) + 16 (w // 4) at M = 128 (warps w and
        w + 4 split a sub-partition), 32 w at M = 64."""
        if ctx.cfg.block_m == 64:
            return b.shl(ctx.warp, 5)
        return b.add(b.shl(b.and_(ctx.warp, 3), 5), b.shl(b.shr(ctx.warp, 2), 4))

    def value_part(self, b: KernelBuilder, ctx: Ctx) -> Reg:
        """Which share of O's columns this CTA owns when the value is split (value_ctas: the
        CTAs of one tile along grid z)."""
        return b.special("%ctaid.z")

    def warp_row0(self, b: KernelBuilder, ctx: Ctx) -> Reg:
        """Warp w's first row: its first lane at M = 128, 16 w at M = 64 (layout F)."""
        if ctx.cfg.block_m == 64:
            return b.shl(ctx.warp, 4)
        return self._lane0(b, ctx)

    # ---- the tensor-core side (warp 0: every lane computes, one issues) -----------------
    def issue_scores(self, k_tile: Reg) -> None:
        with self.b.if_then(self.warp0):
            self.umma.scores(k_tile)

    def issue_pv(self, v_tile: Reg) -> None:
        with self.b.if_then(self.warp0):
            self.umma.pv(v_tile)

    def skip_pv(self) -> None:
        """No P·V this tile: an empty commit completes bar_o's phase, so pv_done's wait holds."""
        with self.b.if_then(self.warp0):
            self.umma.no_pv()

    def _wait(self, bar: Addr, phase: Reg) -> None:
        b = self.b
        b.mbarrier_wait_parity(bar, phase)
        b.xor(phase, 1, out=phase)
        b.tcgen05_fence(before=False)

    def scores_ready(self, _issued) -> list[list[Reg]]:
        """Wait for S(j) and load this warp's rows of it: 16x256b per n8 block = mma C tiles."""
        b = self.b
        self._wait(self.bar_s, self.s_phase)
        regs = b.tcgen05_ld("16x256b", self.bn // 8, self.s_warp, F32)
        b.tcgen05_wait("ld")
        return [regs[4 * j:4 * j + 4] for j in range(self.bn // 8)]

    def pv_done(self) -> None:
        self._wait(self.bar_o, self.o_phase)

    def p_visible(self) -> None:
        """Before a P·V that no loop barrier precedes (a latent loop's last): every warp's P
        stores (waited and fenced in softmax_late) reach the issuing warp through a barrier."""
        self.cta_sync()
        self.b.tcgen05_fence(before=False)

    # ---- with a correction warpgroup (tile.correction) -------------------------------------
    def p_free(self, j: Reg) -> None:
        """Before P(j) goes to buffer j mod 2: the P·V that read it, P·V(j - 2), completed."""
        b = self.b
        with b.if_then(b.setp("ge", j, 2)):
            wait_pv(b, self.umma.bars, b.sub(j, 2))

    def hand_over(self, probs: list[list[Reg]], rescale: Reg, j: Reg) -> None:
        """softmax_late without the O rescale: the vote and (when rescaling) this lane's two
        alphas to the correction warps through exchange buffer j mod 2, P(j) into tensor-memory
        buffer j mod 2, the row sums; then the stores' wait and fence, and a warp sync, so
        that lane 0's arrival on p_full orders every lane's stores."""
        b, buf = self.b, buffer_of(self.b, j)
        with b.if_then(b.setp("ge", j, 2)):     # the correction warps read tile j - 2's there
            wait_pair(b, self.umma.bars, X_FREE0, X_FREE1, b.sub(j, 2), fence=False)
        self.exchange.put(buf, self.ctx.warp, self.ctx.lane, rescale, self.alpha)
        self.pack_probs(probs)
        p = b.add(self.p_warp, b.mul(buf, self.bn // 2))
        b.tcgen05_st("16x128b", p, [x for frag in self.p_frags for x in frag])
        self.add_row_sums()
        b.tcgen05_wait("st")
        b.tcgen05_fence(before=True)
        b.warp_sync()

    def last_pv_done(self, n_tiles: Reg) -> None:
        """After the loop: the last P·V, P·V(n - 1), completed (n > 0)."""
        b = self.b
        with b.if_then(b.setp("gt", n_tiles, 0)):
            wait_pv(b, self.umma.bars, b.sub(n_tiles, 1))

    # ---- the softmax side (every warp) --------------------------------------------------
    def softmax_late(self, probs: list[list[Reg]], rescale: Reg) -> None:
        """After the previous P·V completed: O *= alpha in tensor memory (when rescaling), P
        into tensor memory, the row sums; then the fence for the next tile's MMAs."""
        b = self.b
        with b.if_then(rescale):          # warp-uniform (the vote of softmax_early)
            o = self._load_o()
            for i, x in enumerate(o):
                b.mul(x, self.alpha[(i // 2) % 2], out=x)
            self._store_o(o)
        self.pack_probs(probs)
        # 16x128b: register 2 jn + r is row g + 8r, column 4 jn + t = keys 8 jn + 2t, + 1
        b.tcgen05_st("16x128b", self.p_warp, [x for frag in self.p_frags for x in frag])
        self.add_row_sums()
        b.tcgen05_wait("st")
        b.tcgen05_fence(before=True)

    def _o_blocks(self) -> list[tuple[int, int]]:
        """O's n8 blocks as (first, count) runs of power-of-two 16x256b repetitions (dv 192:
        16 + 8), each run one instruction 8 columns a block further."""
        return power_of_two_runs(self.dv // 8, self.o_run)

    def _load_o(self) -> list[Reg]:
        """This warp's rows of O (the mma C layout, 4 registers an n8 block), loaded and waited."""
        b, out = self.b, []
        for first, n in self._o_blocks():
            at = self.o_warp if first == 0 else b.add(self.o_warp, 8 * first)
            out += b.tcgen05_ld("16x256b", n, at, F32)
        b.tcgen05_wait("ld")
        return out

    def _store_o(self, regs: list[Reg]) -> None:
        """Store this warp's rows of O from `regs` (_load_o's order), and wait."""
        b = self.b
        for first, n in self._o_blocks():
            at = self.o_warp if first == 0 else b.add(self.o_warp, 8 * first)
            b.tcgen05_st("16x256b", at, regs[4 * first:4 * (first + n)])
        b.tcgen05_wait("st")

    def fetch_o(self) -> None:
        """After the last P·V: this warp's rows of O into registers (the mma C layout)."""
        b = self.b
        o = self._load_o()
        self.o_tiles = [[o[4 * j:4 * j + 4] for j in range(self.dv // 8)]]
        self.o = self.o_tiles[0]
        b.tcgen05_fence(before=True)

    def cta_sync(self) -> None:
        if self.barrier is None:
            super().cta_sync()
        else:                       # this Q tile's warps only
            self.b.bar_sync(*self.barrier)

    def release(self) -> None:
        """Warp 0 frees the tensor memory once every warp has loaded its O (a barrier of the
        warps that compute); with two Q tiles the pipeline does, after both."""
        if not self.frees_tmem:
            return
        self.cta_sync()
        with self.b.if_then(self.warp0):
            self.b.tcgen05_dealloc(self.tmem, self.ctx.cfg.tmem_columns)

    def epilogue(self) -> None:
        self.fetch_o()
        MmaMath.epilogue(self)
        self.release()


def buffer_of(b: KernelBuilder, j: Reg) -> Reg:
    """j mod 2: which P buffer and exchange buffer tile j uses (tile.correction)."""
    return b.and_(j, 1)


def wait_pv(b: KernelBuilder, bars: Reg, i: Reg) -> None:
    """Wait for P·V(i) (tile.correction): it committed to BAR_O / BAR_O1 by i mod 2."""
    wait_pair(b, bars, BAR_O, BAR_O1, i)


def pair_barrier(b: KernelBuilder, bars: Reg, even: int, odd: int, i: Reg) -> Addr:
    """Event i's barrier of a pair taking turns (i mod 2: the one at `even`, or at `odd`)."""
    second = b.setp("ne", buffer_of(b, i), 0)
    return Addr(b.add(bars, b.selp(odd, even, second, U32)))


def wait_pair(b: KernelBuilder, bars: Reg, even: int, odd: int, i: Reg, fence: bool = True) -> None:
    """Wait for event i of a pair of barriers taking turns (pair_barrier): the (i div 2)-th
    phase of its barrier, parity (i >> 1) & 1. Neither runs two phases ahead of its waiter:
    event i + 2 needs what the waiter has still to give."""
    b.mbarrier_wait_parity(pair_barrier(b, bars, even, odd, i), b.and_(b.shr(i, 1), 1))
    if fence:
        b.tcgen05_fence(before=False)


class Exchange:
    """The softmax warps' hand-over to the correction warps (tile.correction), two buffers (tile
    j uses j mod 2): per softmax warp w a u32 vote (its O rows need rescaling) and per lane its
    two rows' alpha, lane l of warp w at alpha[w][l] -- where the correction warp reading the
    same 16 rows of O (16x256b, the mma C layout) finds it in its own lane l."""

    def __init__(self, b: KernelBuilder, base: Reg, warps: int):
        self.b, self.base, self.warps = b, base, warps
        self.votes, self.buffer = self.layout(warps)

    @staticmethod
    def layout(warps: int) -> tuple[int, int]:
        """(bytes of the votes, 16-aligned; bytes of one buffer: the votes, then the alphas)."""
        votes = -(-4 * warps // 16) * 16
        return votes, votes + warps * 32 * 8

    @staticmethod
    def bytes(warps: int) -> int:
        return 2 * Exchange.layout(warps)[1]

    def _at(self, buf: Reg) -> Reg:
        return self.b.add(self.base, self.b.mul(buf, self.buffer))

    def put(self, buf: Reg, warp: Reg, lane: Reg, rescale: Reg, alpha: list[Reg]) -> None:
        b = self.b
        at = self._at(buf)
        with b.if_then(b.setp("eq", lane, 0)):
            b.st("shared", U32, Addr(b.add(at, b.shl(warp, 2))), [b.selp(1, 0, rescale, U32)])
        with b.if_then(rescale):
            slot = b.add(at, b.add(b.shl(b.add(b.shl(warp, 5), lane), 3), self.votes))
            b.st("shared", F32, Addr(slot), list(alpha))

    def vote(self, buf: Reg, warp: int) -> Reg:
        """Softmax warp `warp`'s vote in buffer `buf` (a warp-uniform predicate)."""
        b = self.b
        return b.setp("ne", b.ld("shared", U32, Addr(self._at(buf), 4 * warp)), 0)

    def alpha(self, buf: Reg, warp: int, lane: Reg) -> list[Reg]:
        b = self.b
        slot = b.add(self._at(buf), b.add(b.shl(lane, 3), self.votes + warp * 256))
        return b.ld("shared", F32, Addr(slot), 2)


class Correction:
    """A correction warp (tile.correction; FlashAttention-4's correction warpgroup): warp c of
    the four reads sub-partition c of tensor memory, where softmax warps c and c + 4 keep
    their rows of O (layout of Tcgen05Math._lane0). Per tile j, after the softmax warps handed
    P(j) over (p_full) and P·V(j - 1) completed, it rescales the rows whose warp voted (the
    running max grew past the lazy slack) by their alpha, and arrives on O_READY: the MMA warp
    issues P·V(j) after it."""

    def __init__(self, b: KernelBuilder, cfg, tmem: Reg, bars: Reg, exchange: Reg, warp: int | Reg,
                 lane: Reg, softmax_warps: int, o_run: int = 16):
        self.b, self.cfg, self.bars, self.lane = b, cfg, bars, lane
        self.o_run = o_run          # n8 blocks of O a load at most (4 registers each), as Tcgen05Math
        self.exchange = Exchange(b, exchange, softmax_warps)
        o_cols = b.add(tmem, cfg.block_n + cfg.block_n)     # S, P's two buffers, then O
        self.rows = []                                     # (softmax warp, its O address)
        for w in range(softmax_warps):
            lane0 = 32 * w if cfg.block_m == 64 else 32 * (w % 4) + 16 * (w // 4)
            self.rows.append((w, lane0 // 32, b.add(o_cols, (lane0 % 32) << 16)))
        self.warp = warp            # this correction warp's sub-partition (0..3), a register
        self.sub = b.shl(warp, 21)  # its lanes 32 c .. (bits 16+ of the address: lane 32 c)

    def tile(self, j: Reg) -> None:
        b = self.b
        buf = buffer_of(b, j)
        with b.if_then(b.setp("ge", j, 1)):
            wait_pv(b, self.bars, b.sub(j, 1))
        for w, part, o_cols in self.rows:
            mine = b.setp("eq", self.warp, part)
            with b.if_then(b.and_(mine, self.exchange.vote(buf, w))):
                alpha = self.exchange.alpha(buf, w, self.lane)
                at = b.add(o_cols, self.sub)
                for first, n in power_of_two_runs(self.cfg.o_columns // 8, self.o_run):
                    cols = at if first == 0 else b.add(at, 8 * first)
                    o = b.tcgen05_ld("16x256b", n, cols, F32)
                    b.tcgen05_wait("ld")
                    for i, x in enumerate(o):
                        b.mul(x, alpha[(i // 2) % 2], out=x)
                    b.tcgen05_st("16x256b", cols, o)
                b.tcgen05_wait("st")
        b.tcgen05_fence(before=True)
        b.warp_sync()


def power_of_two_runs(blocks: int, most: int | None = None) -> list[tuple[int, int]]:
    """(first, count) runs of power-of-two counts (at most `most`) covering `blocks` n8 blocks:
    each one 16x256b instruction (dv 192: 16 + 8)."""
    runs, first = [], 0
    while first < blocks:
        n = 1 << ((blocks - first).bit_length() - 1)
        n = n if most is None else min(most, n)
        runs.append((first, n))
        first += n
    return runs
