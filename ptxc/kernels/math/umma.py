"""The tensor-core side of the tcgen05 kernels (sm_100a): tensor memory and its allocation, the
shared-memory region of their MMA barriers, and the MMAs one elected lane of a warp issues (UmmaIssue). The
softmax side is math/tcgen05.py's Tcgen05Math; the one-issuer loop is tma_pipeline.py, the
warp-specialised one tcgen05_ws_pipeline.py."""

from __future__ import annotations

from ...ir import BF16, F16, U32, U64, Addr, Imm, KernelBuilder, Reg
from ..mainloop.tiles import CHUNK, SWIZZLE, SWIZZLE_PERIOD
from ..mainloop.tma_pipeline import MBARRIER_BYTES
from .wgmma import k_step

# The MMA region of shared memory (8-aligned), after the TMA barriers: per Q tile two barriers
# the MMAs arrive on, two the softmax warps arrive on (warp-specialised kernel), the allocation
# slot (tile 0's is the one used), and with a correction warpgroup its four (below); Q tile t's
# block starts t * tile_barriers(correction) into the region (tile.q_tiles).
BAR_S, BAR_O, S_FREE, P_FULL, TMEM_SLOT = (k * MBARRIER_BYTES for k in range(5))
Q_TILE_BARRIERS = 5 * MBARRIER_BYTES
# With a correction warpgroup (tile.correction): P(j) in buffer j mod 2, the P·V that reads
# buffer 1 commits to BAR_O1, O_READY is the correction warps' (O rescaled for tile j), and
# X_FREE0 / X_FREE1 (by j mod 2) theirs too: they have read tile j's exchange buffer
BAR_O1, O_READY, X_FREE0, X_FREE1 = (k * MBARRIER_BYTES for k in range(5, 9))
CORRECTION_BARRIERS = 4 * MBARRIER_BYTES


def tile_barriers(correction: bool = False) -> int:
    """One Q tile's block of MMA barriers (bytes): Q tile t's starts t times this in."""
    return Q_TILE_BARRIERS + correction * CORRECTION_BARRIERS


def mma_region_bytes(q_tiles: int, correction: bool = False) -> int:
    return q_tiles * tile_barriers(correction)


def allocate(b: KernelBuilder, warp0: Reg, bars: Reg, columns: int) -> Reg:
    """Warp 0 allocates the tensor memory and gives up the permit; every thread gets the base
    address after a CTA barrier (the caller's barrier inits go before it too)."""
    allocate_issue(b, warp0, bars, columns)
    b.bar_sync(0)
    return allocated_base(b, warp0, bars)


def allocate_issue(b: KernelBuilder, warp0: Reg, bars: Reg, columns: int) -> None:
    """allocate's first half, for a pipeline whose own CTA barrier follows: warp 0's
    tcgen05.alloc into the MMA region's slot."""
    with b.if_then(warp0):
        b.tcgen05_alloc(Addr(bars, TMEM_SLOT), columns)


def allocated_base(b: KernelBuilder, warp0: Reg, bars: Reg) -> Reg:
    """allocate's second half, after a CTA barrier: the base address from the slot; warp 0
    gives up the permit."""
    base = b.ld("shared", U32, Addr(bars, TMEM_SLOT))
    with b.if_then(warp0):
        b.tcgen05_relinquish()
    return base


class UmmaIssue:
    """The tensor-core side: S (block_n f32 columns), P (block_n / 2 pairs) and O (head_dim_v
    f32 columns) from the tensor-memory base `tmem`, the kind::f16 descriptors, and the MMAs.

    A whole warp runs each method -- warp 0 (Tcgen05Math), or the MMA warp (warp-specialised):
    every lane computes the descriptors, and the MMAs and their commit are issued by the lane
    elect.sync picks. ptxas then holds the descriptors in uniform registers (the warp computed
    them from warp-uniform values), where a single-thread region (`tid == 0`) made it wrap every
    MMA in a loop over the lanes with R2UR moves (7 instructions each). `hoist` computes Q's
    k-step descriptors and P's columns once, here (for a warp of its own; in a kernel whose
    softmax warps build this too they would hold those registers); hoist="desc" only Q's
    descriptor and P's columns, its k-steps added at each S (two Q tiles: both tiles' steps
    would hold 2 x head_dim / 16 64-bit registers of the MMA warp)."""

    def __init__(self, b: KernelBuilder, cfg, q_smem: Reg, tmem: Reg, bars: Reg,
                 hoist: bool | str = False, v_off: Reg | None = None):
        in_type = F16 if cfg.math_fmt.name == "f16" else BF16   # f16 products over FP8 (f16_math)
        self.b, self.bm, self.bn, self.d = b, cfg.block_m, cfg.block_n, cfg.head_dim
        # O's columns here: head_dim_v, or this CTA's share (value_ctas), whose V starts
        # `v_off` bytes into each V tile (whole slabs further)
        self.dv, self.v_off = cfg.o_columns, v_off
        self.corrected = getattr(cfg, "correction", False)
        self.s_cols, self.p_cols = tmem, b.add(tmem, self.bn)
        # with a correction warpgroup P is double-buffered: buffer 1 right after buffer 0
        self.o_cols = b.add(tmem, self.bn + self.bn // 2 * (2 if self.corrected else 1))
        self.idesc_s = b.umma_instr_descriptor(self.bm, self.bn, in_type)
        self.idesc_o = b.umma_instr_descriptor(self.bm, self.dv, in_type, b_mn_major=True)
        self.q_smem = q_smem
        self.bar_s, self.bar_o = Addr(bars, BAR_S), Addr(bars, BAR_O)
        self.bars = bars
        self.q_steps = self.p_steps = self.q_desc = None
        if hoist == "desc":
            self.q_desc, self.p_steps = self._q_desc(), self._p_steps()
        elif hoist:
            self.q_steps, self.p_steps = self._q_steps(), self._p_steps()

    def _q_desc(self) -> Reg:
        return self.b.umma_descriptor(self.q_smem, CHUNK, SWIZZLE_PERIOD, SWIZZLE)

    def _q_steps(self) -> list[Reg]:
        q_desc = self.q_desc or self._q_desc()
        return [k_step(self.b, q_desc, kk, self.bm) for kk in range(self.d // 16)]

    def _p_steps(self) -> list[Reg]:
        return [self.p_cols if kk == 0 else self.b.add(self.p_cols, 8 * kk)
                for kk in range(self.bn // 16)]

    def _issue(self):
        """The lane that issues: elect.sync over the calling warp."""
        return self.b.if_then(self.b.elect_sync())

    def k_desc(self, k_tile: Reg) -> Reg:
        return self.b.umma_descriptor(k_tile, CHUNK, SWIZZLE_PERIOD, SWIZZLE)

    def v_desc(self, v_tile: Reg) -> Reg:
        at = v_tile if self.v_off is None else self.b.add(v_tile, self.v_off)
        return self.b.umma_descriptor(at, self.bn * SWIZZLE, SWIZZLE_PERIOD, SWIZZLE)

    def scores(self, k_tile: Reg) -> None:
        """S = Q·K(tile)ᵀ, committed to bar_s."""
        self.scores_from(self.k_desc(k_tile))

    def scores_from(self, k_desc: Reg) -> None:
        """S = Q·Kᵀ from K's descriptor (a loop may hold one per stage), committed to bar_s."""
        b = self.b
        b.tcgen05_fence(before=False)
        steps = [(q, k_step(b, k_desc, kk, self.bn))
                 for kk, q in enumerate(self.q_steps or self._q_steps())]
        with self._issue():
            for kk, (a, kb) in enumerate(steps):
                b.tcgen05_mma(self.s_cols, a, kb, self.idesc_s, kk > 0)
            b.tcgen05_commit(self.bar_s)

    def pv(self, v_tile: Reg, buffer: int | Reg = 0) -> None:
        """O += P·V(tile), committed to bar_o (pv_from's `buffer`)."""
        self.pv_from(self.v_desc(v_tile), buffer)

    def pv_from(self, v_desc: Reg, buffer: int | Reg = 0) -> None:
        """O += P·V from V's descriptor (keys 16kk..: P columns 8kk.., V two swizzle periods
        further), committed to bar_o -- with a correction warpgroup, P from `buffer` (0, 1, or
        a predicate: buffer 1 where true) and committed to that buffer's BAR_O / BAR_O1."""
        b = self.b
        descs = [v_desc if kk == 0 else b.add(v_desc, Imm(kk * 2 * SWIZZLE_PERIOD >> 4, U64))
                 for kk in range(self.bn // 16)]
        with self._issue():
            steps, bar = self.p_steps or self._p_steps(), self.bar_o
            if self.corrected and not isinstance(buffer, int):      # chosen at run time
                half = self.bn // 2
                steps = [b.selp(b.add(p, half), p, buffer, U32) for p in steps]
                bar = Addr(b.add(self.bars, b.selp(BAR_O1, BAR_O, buffer, U32)))
            elif self.corrected and buffer:
                steps = [b.add(p, self.bn // 2) for p in steps]
                bar = Addr(self.bars, BAR_O1)
            for p, desc in zip(steps, descs):
                b.tcgen05_mma(self.o_cols, p, desc, self.idesc_o, True)
            b.tcgen05_commit(bar)

    def commit(self, bar: Addr) -> None:
        """The issuing lane's MMAs so far arrive once on `bar` when they complete."""
        with self._issue():
            self.b.tcgen05_commit(bar)

    def no_pv(self) -> None:
        """An empty commit: bar_o's phase completes with the issuing lane's earlier MMAs."""
        self.commit(self.bar_o)


def tile_columns(block_n: int, dv: int, correction: bool = False) -> int:
    """One Q tile's tensor-memory columns: S (block_n f32), P (block_n / 2 pairs; two such
    buffers with a correction warpgroup), O (dv f32); Q tile t's start t times this into the
    allocation."""
    return block_n + block_n // 2 * (2 if correction else 1) + dv


def tmem_columns(block_n: int, dv: int, q_tiles: int = 1, correction: bool = False) -> int:
    """The allocation: q_tiles tiles' columns, rounded up to the power of two tcgen05.alloc
    takes."""
    need = q_tiles * tile_columns(block_n, dv, correction)
    return max(32, 1 << (need - 1).bit_length())
