"""S = Q·Kᵀ on FP8 tensor cores inside MmaMath (MLA's qk_products = "e4m3" where mma.m16n8k32
over e4m3 is native: sm_89, sm_120 -- fp8.has_fp8_mma): the scores' products read the cache's
e4m3 bytes where cp.async staged them and Q's rows as e4m3 fragments held in registers, at
twice the 16-bit products' rate; P·V keeps the 16-bit tile the staged V columns become.

  K   the staging buffer of the tile (kv_fp8_stage.FP8Staging, cfg.qk_staged): rows of
      head_dim bytes padded to an odd number of 16-byte chunks, so the 8 rows of an ldmatrix
      matrix fall in 8 bank groups. ldmatrix.x4 (not transposed) of keys n0..n0+15 at k-step
      ks gives lane (g, t) bytes 4t.. and 16 + 4t.. of keys n0 + g and n0 + 8 + g: the B
      fragments of two n8 tiles (matrices: keys +0 / +8, bytes +0 / +16).
  Q   after the rows were rounded to e4m3 values in the 16-bit tile (q_rescale.rescale_q_rows
      with e4m3_on), a barrier, then each lane's A fragments once: per k-step, rows g and g + 8
      at elements 4t.. and 16 + 4t.. (ld.shared.v2 of four 16-bit values, cvt to e4m3: exact).
      4 registers a k-step and m-tile, kept across the loop.

With score_split the warps sharing 16 rows take contiguous shares of the head_dim / 32 k-steps
(576: 18 over four warps, 5 5 4 4: the first `extra` warps run one more, a warp-uniform branch)
and add their partial scores in part order as MmaMath.add_partials does. Products of e4m3
values are exact, but an FP8 mma keeps 13 fraction bits of its sum, C included (emu/fp8.accumulate,
the H200's behaviour on wgmma; SageAttention2 found the same on Ada): chained through C, the
k-steps' truncations of the growing score put f16 kernels' lse 5x past the tolerance. So each
k-step's products go into a zero C and are added in f32 (DeepGEMM's promotion, here per k32
step: 4 FADD an mma), which leaves the scores within the alignment of one step's 32 products."""

from __future__ import annotations

from ...ir import B32, E4M3, Addr, Reg
from ..mainloop.tiles import zero_regs
from . import fp8
from .q_rescale import half_values

K_STEP = 32     # e4m3 elements (bytes) a k-step of mma.m16n8k32
# Where Q's fragments fit beside the tile's registers (bench/spill_sweep.py, ptxas 13.5): at most
# 5 k-steps a warp (20 registers: rank 512 with RoPE up to 128 under the four-way score split)
# and at most 8 warps (255 registers a thread). Unsplit depths (10-15 k-steps) spilled 28-488
# bytes, as did the 16-warp tile at 128 registers with 3 k-steps; those keep 16-bit products.
MAX_WARP_STEPS = 5
MAX_WARPS = 8


def fits(head_dim: int, parts: int, warps: int) -> bool:
    """Whether a tile of `warps` warps, `parts` of them sharing a row group's depth, holds Q's
    e4m3 fragments in registers (the score product here applies)."""
    steps = head_dim // K_STEP
    return head_dim % K_STEP == 0 and warps <= MAX_WARPS and -(-steps // parts) <= MAX_WARP_STEPS


class StagedE4m3Scores:
    """The score product of an MmaMath `math` over staged e4m3 rows of `k_stride` bytes."""

    def __init__(self, math, k_stride: int, target):
        b, ctx, cfg = math.b, math.ctx, math.ctx.cfg
        assert cfg.head_dim % K_STEP == 0 and not cfg.q_geom.swizzled and k_stride % 16 == 0, cfg
        self.math, self.k_stride, self.target = math, k_stride, target
        steps = cfg.head_dim // K_STEP
        parts = cfg.v_split if cfg.score_split else 1
        self.base, self.extra = divmod(steps, parts)
        assert self.base >= 1, (steps, parts)
        part = math.value_part(b, ctx) if parts > 1 else None
        # this warp's first k-step: part * base + min(part, extra)
        first = None if part is None else \
            b.add(b.mul(part, self.base), b.min(part, self.extra)) if self.extra else b.mul(part, self.base)
        self.first = first
        self.tail = b.setp("lt", part, self.extra) if self.extra else None
        # ldmatrix lanes: lane l (matrix m = l >> 3, row i = l & 7) gives the address of key
        # i + 8 (m >> 1) at byte 16 (m & 1) of the warp's first k-step
        lane = ctx.lane
        m, i = b.shr(lane, 3), b.and_(lane, 7)
        col = b.shl(b.and_(m, 1), 4)
        if first is not None:
            col = b.add(col, b.shl(first, 5))
        self.k_lane = b.mad(b.add(i, b.shl(b.shr(m, 1), 3)), k_stride, col)
        self.q: list[list[list[Reg]]] | None = None    # [m-tile][k-step] -> 4 A registers

    def load_q(self) -> None:
        """This lane's e4m3 A fragments of the warp's k-steps, from the Q tile whose rows hold
        e4m3 values in the 16-bit format (called after a barrier that made the rounding
        visible). The tail step's are loaded only by the warps that run it (zeros elsewhere)."""
        math = self.math
        b, ctx, cfg = math.b, math.ctx, math.ctx.cfg
        ss, fmt = math.ss, cfg.math_fmt
        g = b.shr(ctx.lane, 2)
        lane_col = b.shl(math.t, 3)                       # 4t elements, 2 bytes each
        if self.first is not None:
            lane_col = b.add(lane_col, b.shl(self.first, 6))   # 32 elements a k-step
        row0 = b.add(math.warp_row0(b, ctx), g)
        addrs = [b.add(b.mad(b.add(row0, 16 * mt + 8 * r), ss, ctx.q_smem), lane_col)
                 for mt in range(math.mt) for r in range(2)]

        def fragment(mt: int, kk: int, pred: Reg | None) -> list[Reg]:
            regs = []
            for half in range(2):                           # elements 4t.. and 16 + 4t..
                for r in range(2):                          # rows g and g + 8
                    at = Addr(addrs[2 * mt + r], 64 * kk + 32 * half)
                    if pred is None:
                        words = b.ld("shared", B32, at, vec=2)
                    else:
                        words = zero_regs(b, 2)
                        with b.predicate(pred):
                            b.ld("shared", B32, at, vec=2, out=words)
                    vals = [x for w in words for x in half_values(b, w, fmt)]
                    regs += fp8.quantize(b, vals, "e4m3", self.target)
            return [regs[0], regs[1], regs[2], regs[3]]     # (g, lo) (g+8, lo) (g, hi) (g+8, hi)

        self.q = [[fragment(mt, kk, None) for kk in range(self.base)] +
                  ([fragment(mt, self.base, self.tail)] if self.tail is not None else [])
                  for mt in range(math.mt)]

    def scores(self, staged: Reg) -> list[list[Reg]]:
        """Raw scores of the tile staged at `staged` (this warp's share of the depth, summed
        over the warps sharing its rows under score_split)."""
        math = self.math
        b = math.b
        nt = math.bn // 8
        s: list = [None] * (math.mt * nt)
        lanes = b.add(staged, self.k_lane)

        def step(kk: int) -> None:
            for pair in range(math.bn // 16):
                kb = b.ldmatrix(Addr(lanes, pair * 16 * self.k_stride + kk * K_STEP), 4)
                for e, frag in enumerate(((kb[0], kb[1]), (kb[2], kb[3]))):
                    for mt in range(math.mt):
                        jn = mt * nt + 2 * pair + e
                        part = b.mma_m16n8k32(self.q[mt][kk], frag, math.fzero, E4M3)
                        s[jn] = part if s[jn] is None else [b.add(x, y, out=x) for x, y in zip(s[jn], part)]

        for kk in range(self.base):
            step(kk)
        if self.tail is not None:
            with b.if_then(self.tail):
                step(self.base)
        return s if math.partials is None else math.add_partials(s)


__all__ = ["K_STEP", "StagedE4m3Scores"]
