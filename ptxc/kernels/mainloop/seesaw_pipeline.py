"""MLA's latent tile loop on sm_90a under FlashMLA's seesaw schedule (tile.seesaw; FlashMLA
csrc/kernels/sm90/decode/dense/splitkv_mla.cuh): the two warpgroups of the 64-head-row tile
take alternate tiles' S = Q·Kᵀ and softmax, and each adds every tile's P·V into its half of O's
columns -- its own tiles' from its registers, the other's from the P that warpgroup hands over
(math/seesaw.py). One warpgroup's softmax runs while the other's products hold the tensor
cores, and nothing synchronises the CTA inside the loop: the hand-over barriers order the
softmax chain, the mbarriers the loads.

Tile t lands in buffer t mod S (S = 4) on full[t mod S], phase (t / S) & 1, as TMA boxes.
Warpgroup g owns tiles j = g, g + 2, ..; for each (all of its 128 threads):

  wait full[j]; the last tile's V rows past L zeroed (this warpgroup's threads, its barrier)
  issue S(j)                                               (commit group)
  j > 0:  wgmma.wait_group 0: its own P·V(j-2) and S(j) retired (S(j) ran while this
            warpgroup waited for the hand-over; the P·V it issues next would queue behind it)
          take P(j-1), m(j-1) from the other warpgroup (bar.sync on its barrier: every warp of
            this warpgroup past its wait, and the other's P·V(j-2) retired before it handed
            over), so tile j-2's buffer takes T(j+2) (j >= 2; this warpgroup's issuers, its
            own parity of tiles: 2 tiles in flight beyond j+1)
          (tile j-1 landed: the other waited for it before its hand-over, whose barrier
            orders it here too)
          the other's softmax step replayed (O, l scaled; m <- m(j-1); l += its row sums)
          issue O += P(j-1)·V(j-1)                          (commit group)
  j = 0:  an empty group
  wgmma.wait_group 1: S(j) done; mask, variant, softmax against m(j-1) (lazy rescale), P(j)
  packed
  wgmma.wait_group 0: P·V(j-1) retired (tile j-1 read by this warpgroup); hand over P(j), m(j)
  O *= alpha (if the warp voted), l += row sums; issue O += P(j)·V(j)  (commit group)

After the loop the warpgroup that does not own the last tile takes its P and adds its P·V, and
both meet on the CTA barrier (Q and the hand-over slots read) before the epilogue. Each
hand-over is taken exactly once: P(j) by the other warpgroup's next tile j+1, or after its loop
when j is the last. Both warpgroups apply every tile's softmax step in order to the same values,
so m and l agree bit for bit (math/seesaw.py); the order of floating-point additions differs
from the other loops', not the result's tolerance.
"""

from __future__ import annotations

from ...ir import U32, Addr, KernelBuilder, Reg
from .kv_pipeline import modify_scores
from .tma_pipeline import MBARRIER_BYTES, init_full_barriers

SEESAW_STAGES = 4      # two buffers a warpgroup: its tile j and j+2 (loading), and the other's


def run_seesaw_pipeline(b: KernelBuilder, *, kv_bytes: int, kv_smem: Reg, bars: Reg, leader: Reg,
                        second: Reg, n_tiles: Reg, n_full: Reg, key0_of, refill, math, exchange,
                        transform=None, lo_full: Reg | None = None, q_landed=None,
                        tail=None) -> None:
    """The loop of the module docstring. `refill(t, offset, bar)`: this warpgroup's issuers
    load tile t (if it exists) into kv_smem + offset on barrier `bar` (one phase, its leader
    arriving with the expect_tx); `exchange` a SeesawExchange over `math` (a WgmmaMath over
    half of O's columns); `tail(v_tile)` zeroes the last tile's rows past L by this
    warpgroup's threads and orders them before its wgmma (None: nothing to zero). `leader`:
    the CTA's thread that initialises the barriers; `second`: warpgroup 1's predicate."""
    S = SEESAW_STAGES
    assert S % 2 == 0 and S & (S - 1) == 0, "each warpgroup's tiles in whole buffers, t mod S by a mask"
    init_full_barriers(b, leader, bars, S)
    g = b.selp(1, 0, second, U32)

    def buffer(t: Reg) -> tuple[Reg, Addr, Reg]:
        """Tile t's buffer offset, its barrier and the phase's parity."""
        s = b.and_(t, S - 1)
        return (b.mul(s, kv_bytes), Addr(b.add(bars, b.mul(s, MBARRIER_BYTES))),
                b.and_(b.shr(t, S.bit_length() - 1), 1))

    def landed(t: Reg) -> Reg:
        off, bar, parity = buffer(t)
        b.mbarrier_wait_parity(bar, parity)
        return off

    for s in range(0, S, 2):                          # this warpgroup's T(g), T(g + 2)
        t = b.add(g, s)
        off, bar, _ = buffer(t)
        refill(t, off, bar)
    if q_landed is not None:
        q_landed()

    def take_other(t: Reg, in_loop: bool) -> None:
        """The other warpgroup's tile t: its P and m taken, O += P(t)·V(t) issued; in the loop
        tile t-1's buffer, read by both now, takes T(t-1+S)."""
        # this warpgroup's P·V(t-1) retired, and in the loop its S(t+1) too: the P·V issued
        # next would run after it anyway (one warpgroup's wgmma run in order), and with S(t+1)
        # left in flight ptxas loses track of which accumulators are free and serialises every
        # wgmma of the kernel (C7514)
        b.wgmma_wait(0)
        frags, m_new = exchange.receive()    # ... in every warp: the hand-over's bar.sync
        off, _, _ = buffer(t)    # landed: the owner waited for it before handing over
        if in_loop:
            with b.if_then(b.setp("ge", t, 1)):
                done = b.sub(t, 1)
                off_done, bar_done, _ = buffer(done)
                refill(b.add(done, S), off_done, bar_done)
        exchange.absorb(frags, m_new)
        math.issue_pv(b.add(kv_smem, off), frags)

    n_own = b.shr(b.sub(b.add(n_tiles, 1), g), 1)
    last = b.sub(n_tiles, 1)
    with b.for_range(0, n_own) as i:
        j = b.mad(i, 2, g)
        off = landed(j)
        if tail is not None:   # before S(j): those rows' scores are masked, whatever K holds
            with b.if_then(b.setp("eq", j, last)):
                tail(b.add(kv_smem, off))
        issued = math.issue_scores(b.add(kv_smem, off))
        with b.if_then(b.setp("gt", j, 0)):
            take_other(b.sub(j, 1), True)
        with b.else_():
            math.skip_pv()
        s = math.scores_ready(issued)
        modify_scores(b, math, s, j, key0_of, transform, n_full, lo_full)
        probs, rescale = math.softmax_early(s)
        math.pack_probs(probs)
        b.wgmma_wait(0)        # the other's P·V(j-1) retired: tile j-1 read here
        exchange.publish()
        math.rescale_o(rescale)
        math.add_row_sums()
        math.issue_pv(b.add(kv_smem, off))
    theirs = b.and_(b.setp("gt", n_tiles, 0), b.setp("ne", b.and_(last, 1), g))
    with b.if_then(theirs):                           # the other warpgroup's last tile
        take_other(last, False)
    b.wgmma_wait(0)
    b.bar_sync(0)        # Q and the hand-over slots read by both, before the epilogue


__all__ = ["SEESAW_STAGES", "run_seesaw_pipeline"]
