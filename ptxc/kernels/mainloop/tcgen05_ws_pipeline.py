"""The warp-specialised K/V tile loop of the sm_100a tcgen05 kernels (prefill, and varlen's
packed tile; tile.warp_specialize = true): FlashAttention-4's roles on the one-issuer schedule
of tma_pipeline.py -- a load warp, an MMA warp and the softmax warps, handing tiles over on
mbarriers only (no CTA barrier in the loop).

  CTA        W softmax warps (rows as Tcgen05Math gives them: W = 8 for prefill's 128 rows,
             block_m / 16 for varlen's packed tile), then warp W, which issues the TMA boxes,
             and warp W + 1, the MMAs: 32 (W + 2) threads (320 for prefill). Both issuing
             warps run their loops warp-wide and issue from the lane elect.sync picks, so
             that ptxas can keep the operands in uniform registers (a `tid == k` region made
             it loop over the lanes around every UTCHMMA / UTMALDG). With one Q tile no
             setmaxnreg (it needs whole warpgroups, and a fourth of a warpgroup's registers
             would sit idle in the two issuing warps' lanes), so the CTA's register file is
             320 x the kernel's count.
  load warp  tma_ws_pipeline.issue_loads, the sm_90a producer's loop: Q on its barrier,
             refills B(i) = {K(i+S), V(i+S-1)} on full[i mod S] after waiting empty[i mod S].
             With `issue_setup` (varlen's paged boxes) the warp's lanes share the boxes: the
             setup, run by the load warp, returns its copy_tile and the lanes that arrive
             (`leader`) and issue (`issuer`), and computes their boxes and page ids there.
  MMA warp   (its loop unrolled by the S stages: each stage's descriptors are constants)
             per tile j: wait full[j mod S] (K(j), V(j-1)); for j > 0 wait s_free (every
             softmax warp has loaded S(j-1)), then issue S(j) -> bar_s; for j > 0 wait p_full
             (P(j-1) stored) and issue O += P(j-1)·V(j-1) -> bar_o (j = 0: an empty commit);
             commit to empty[j mod S] (the phase completes when both products did: the load
             warp may refill those buffers). After the loop the last P·V -- after
             `last_v_landed(v_tile)`, where the warp rewrites that V tile's rows past the keys
             (varlen: NaN there would reach O through 0 x NaN), fences them for the async
             proxy and meets on named barrier MMA_WARP_BARRIER before the MMA reads them.
  softmax    per tile j: wait bar_s, load S(j), arrive on s_free (so S(j+1) runs under this
             tile's softmax); mask / variant, row max and exponentials; wait bar_o (P·V(j-1)
             done: O and the P columns are free); O *= alpha when the max grew past the slack;
             store P(j); row sums; arrive on p_full. After the loop wait the last P·V and Q's
             barrier (with no tile nothing else orders Q's copy before O is staged over it: the
             emulator's race checker caught that), meet on named barrier 1 (the producer warps
             may have exited), epilogue.

Two Q tiles (tile.q_tiles = 2, prefill): 2W softmax warps, tile t's warps W t .. W t + W - 1
with their own S / P / O columns (QTile.tmem), barriers (QTile.bars) and named barrier, each
tile's copy of the loop emitted under its own branch (the offsets constants); the issuing
warps are a whole warpgroup (the two after them exit) so that setmaxnreg moves registers to
the softmax warps; the MMA warp issues both tiles' S, then both P·V; after both epilogues the
softmax warps meet on SOFTMAX_BARRIER before warp 0 frees the tensor memory.

The correction warps (tile.correction): four warps after the softmax warps
(math/tcgen05.Correction) rescale O between P·V(j - 1) and P·V(j) where a softmax warp voted --
with two Q tiles, tile 0's then tile 1's each K/V tile (each tile its barrier block,
umma.tile_barriers, and exchange; the issuing and correction warpgroups keep 48 registers,
the softmax warpgroups take what the CTA's pool then holds, softmax_regs);
the softmax warps hand P(j) to buffer j mod 2 (after P·V(j - 2)) and their alphas through
shared memory (Exchange), never touching O in the loop; the MMA warp issues P·V(j) after
O_READY(j) (not p_full), and tile 0 has no empty commit (each BAR_O / BAR_O1 phase is one P·V).

Barriers: full[0 .. S), Q and empty[0 .. S) as tma_ws_pipeline.py's (empty's count 1: the MMA
warp's commit), then in the MMA region bar_s, bar_o (count 1, tcgen05.commit) and s_free,
p_full (count W: lane 0 of each softmax warp, after tcgen05.fence::before_thread_sync; the MMA
warp's fence::after_thread_sync follows its waits). Every mbarrier phase is one tile's, so
parities are the tile index's low bit (s_free's and p_full's counted on the MMA warp's side).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from ...ir import U32, Addr, KernelBuilder, Reg
from ..math.tcgen05 import pair_barrier
from ..math.umma import (BAR_O, BAR_O1, BAR_S, O_READY, P_FULL, S_FREE, X_FREE0, X_FREE1,
                         allocate, tile_barriers)
from .kv_pipeline import modify_scores
from .tma_pipeline import MBARRIER_BYTES
from .tma_ws_pipeline import CONSUMER_BARRIER, issue_loads, raised_regs

SOFTMAX_WARPS = 8           # prefill's (128 rows); varlen's packed tile passes block_m / 16
ISSUE_THREADS = 64          # the load warp and the MMA warp
CORRECTION_THREADS = 128    # tile.correction: four correction warps after the softmax warps
# Two Q tiles: 16 softmax warps and a whole issuing warpgroup (the load warp, the MMA warp and
# two that leave), so that setmaxnreg can move registers. setmaxnreg.inc takes registers only
# from the CTA's pool, which holds what the .dec warpgroups released -- the CTA keeps the
# count it started with (ptxas's share of the file under .minnctapersm 1: 65536 / threads in
# multiples of 8) times its threads, as CUTLASS's 24 / 240 at 384 threads and 168 balance:
# 640 threads start with 96, the issuing warpgroup keeps ISSUE_REGS, and the softmax
# warpgroups take (640 x 96 - 128 x 48) / 512: 104 (a budget past the pool -- 112 at first --
# would leave the last softmax warpgroup's .inc waiting for ever on hardware, and did in the
# emulator once it modelled the pool: ops_hopper.RegisterPool). At 96 (576 threads, no
# setmaxnreg) ptxas spilled the d128 softmax (36 bytes); the MMA warp holds each tile's Q
# descriptor, not its k-steps (UmmaIssue hoist="desc"), so that 48 are enough for it
ISSUE_WARPGROUP = 128
ISSUE_REGS = 48
# Two Q tiles with the correction warpgroup: 768 threads start with 80; the correction warps
# keep 48 (an O chunk of 4 n8 blocks, 16 registers, a load), so the softmax warps take 96
CORRECTION_REGS = 48


def issue_threads(q_tiles: int) -> int:
    """The threads after the softmax warps: two issuing warps, or a warpgroup with two Q tiles."""
    return ISSUE_THREADS if q_tiles == 1 else ISSUE_WARPGROUP


MMA_WARP_BARRIER = 2        # named barrier of the MMA warp's own threads (last_v_landed)
Q_TILE_BARRIERS_IDS = (CONSUMER_BARRIER, 3)   # named barrier of each Q tile's softmax warps
SOFTMAX_BARRIER = 4         # every Q tile's softmax warps (before the tensor memory is freed)


def softmax_regs(q_tiles: int, softmax_warps: int, correction: bool = False) -> int:
    """The softmax warps' budget after setmaxnreg.inc (two Q tiles): what the CTA started with
    less what the issuing (and correction) warpgroups keep (tma_ws_pipeline.raised_regs)."""
    softmax = 32 * softmax_warps * q_tiles
    kept = ISSUE_WARPGROUP * ISSUE_REGS + correction * CORRECTION_THREADS * CORRECTION_REGS
    threads = softmax + ISSUE_WARPGROUP + correction * CORRECTION_THREADS
    return raised_regs(threads, kept, softmax)


@dataclass(frozen=True)
class QTile:
    """What one Q tile's softmax warps and the MMA warp's products for it share: `index`, its
    first tensor-memory column `tmem` (S, then P and O, umma.UmmaIssue's layout), its MMA
    barriers `bars` (umma.BAR_S ..) and the named barrier of its softmax warps (`barrier`;
    None with one tile: the math's own, CONSUMER_BARRIER)."""

    index: int
    tmem: Reg
    bars: Reg
    barrier: int | None = None


def run_tcgen05_ws_pipeline(b: KernelBuilder, *, stages: int, kv_bytes: int, v_bytes: int,
                            q_bytes: int, q_smem: Reg, k_smem: Reg, v_smem: Reg, bars: Reg,
                            mma_bars: Reg, tid: Reg, lane: Reg, warp0: Reg, columns: int,
                            n_tiles: Reg, n_full: Reg, key0_of, copy_tile, make_math,
                            make_issue, transform_of, lo_full: Reg | None = None,
                            softmax_warps: int = SOFTMAX_WARPS, issue_setup=None,
                            last_v_landed=None, q_tiles: int = 1,
                            tile_columns: int = 0, make_correction=None) -> None:
    """tma_pipeline's copy_tile / key0_of; `bars` the TMA barriers (barrier_bytes(stages,
    True)), `mma_bars` the MMA region (umma.BAR_S ..; Q tile t's barriers
    t * umma.tile_barriers(correction) further); `make_math(tile)` builds a Q tile's (QTile)
    softmax-warp Tcgen05Math, `make_issue(tile)` the MMA warp's UmmaIssue for it.
    `issue_setup()` (None: one elected lane issues copy_tile's boxes) and
    `last_v_landed(v_tile)`: see the module docstring. `q_tiles` Q tiles of `softmax_warps`
    warps each, `tile_columns` apart in tensor memory. `make_correction(tile, c)`
    (tile.correction): correction warp c's Correction for a Q tile."""
    S, W = stages, softmax_warps
    correction = make_correction is not None
    stride = tile_barriers(correction)                  # Q tile t's barriers t * stride in
    load_tid = 32 * W * q_tiles + (CORRECTION_THREADS if correction else 0)
    mma_tid = load_tid + 32
    full = lambda s: Addr(bars, s * MBARRIER_BYTES)                      # noqa: E731
    q_bar = full(S)
    empty0 = (S + 1) * MBARRIER_BYTES
    with b.if_then(b.setp("eq", tid, 0)):
        for s in range(S + 1):
            b.mbarrier_init(full(s), 1)
        for s in range(S):
            b.mbarrier_init(Addr(bars, empty0 + s * MBARRIER_BYTES), 1)
        for t in range(q_tiles):
            for at, count in ((BAR_S, 1), (BAR_O, 1), (S_FREE, W), (P_FULL, W)):
                b.mbarrier_init(Addr(mma_bars, t * stride + at), count)
            if correction:
                b.mbarrier_init(Addr(mma_bars, t * stride + BAR_O1), 1)
                for at in (O_READY, X_FREE0, X_FREE1):
                    b.mbarrier_init(Addr(mma_bars, t * stride + at), CORRECTION_THREADS // 32)
        b.fence_proxy_async()        # the initialised barriers, for the TMA's complete_tx
    tmem = allocate(b, warp0, mma_bars, columns)   # its CTA barrier publishes the inits too
    warp = b.shfl("idx", b.shr(tid, 5), 0)         # warp-uniform for ptxas (every lane, converged)

    def q_tile(t: int) -> QTile:
        if q_tiles == 1:
            return QTile(0, tmem, mma_bars)
        return QTile(t, b.add(tmem, t * tile_columns) if t else tmem,
                     b.add(mma_bars, t * stride) if t else mma_bars, Q_TILE_BARRIERS_IDS[t])

    with b.if_then(b.setp("ge", tid, load_tid)):                         # the load and MMA warps
        if q_tiles > 1:         # the issuing warpgroup gives registers to the softmax warps
            b.setmaxnreg(False, ISSUE_REGS)
        with b.if_then(b.setp("eq", warp, load_tid // 32)):    # the whole warp; one lane issues
            lanes = {"warp_wide": True}
            if issue_setup is not None:                        # or the lanes share the boxes
                copy_tile, leader, issuer = issue_setup()
                lanes = {"leader": leader, "issuer": issuer}
            issue_loads(b, stages=S, kv_bytes=kv_bytes, v_bytes=v_bytes, q_bytes=q_bytes,
                        q_smem=q_smem, k_smem=k_smem, v_smem=v_smem, bars=bars,
                        n_tiles=n_tiles, copy_tile=copy_tile, **lanes)
        with b.if_then(b.setp("eq", warp, mma_tid // 32)):   # the whole warp; one lane issues
            tiles = [q_tile(t) for t in range(q_tiles)]
            handed_on = O_READY if correction else P_FULL    # what P·V(j) waits for
            _mma_warp(b, S, kv_bytes, v_bytes, k_smem, v_smem, bars, q_bar, empty0,
                      [(Addr(t.bars, S_FREE), Addr(t.bars, handed_on), make_issue(t)) for t in tiles],
                      n_tiles, last_v_landed, correction)
    with b.else_():                                                      # the softmax warps
        def softmax() -> None:
            _softmax_tiles(b, q_tile, make_math, transform_of, lane, n_tiles, n_full, key0_of,
                           lo_full, q_bar, W, q_tiles, correction, tmem, warp, columns)
        if correction:        # ... and the correction warps after them
            with b.if_then(b.setp("ge", warp, W * q_tiles)):
                if q_tiles > 1:
                    b.setmaxnreg(False, CORRECTION_REGS)
                c = b.sub(warp, W * q_tiles)
                _correction_warps(b, [(q_tile(t), make_correction(q_tile(t), c))
                                      for t in range(q_tiles)], lane, n_tiles)
            with b.else_():
                softmax()
        else:
            softmax()


def _softmax_tiles(b, q_tile, make_math, transform_of, lane, n_tiles, n_full, key0_of, lo_full,
                   q_bar, W: int, q_tiles: int, corrected: bool, tmem, warp,
                   columns: int) -> None:
    """The softmax warps of every Q tile: one tile's run _softmax_warps; with two, each tile's
    warps their own copy of the loop (its offsets constants), under the registers the issuing
    (and correction) warpgroups gave up, then warp 0 frees the tensor memory."""
    if q_tiles == 1:
        _softmax_warps(b, q_tile(0), make_math, transform_of, lane, n_tiles, n_full, key0_of,
                       lo_full, q_bar, W, corrected=corrected)
        return
    b.setmaxnreg(True, softmax_regs(q_tiles, W, corrected))
    for t in range(q_tiles):
        with b.if_then(b.setp("eq", b.div(warp, W), t)):
            _softmax_warps(b, q_tile(t), make_math, transform_of, lane, n_tiles, n_full,
                           key0_of, lo_full, q_bar, W, corrected=corrected)
    # every tile's warps have loaded their O: warp 0 frees the tensor memory (its predicate
    # made here: one carried from the prologue across setmaxnreg, ptxas spilled)
    b.bar_sync(SOFTMAX_BARRIER, 32 * W * q_tiles)
    with b.if_then(b.setp("eq", warp, 0)):
        b.tcgen05_dealloc(tmem, columns)


def _correction_warps(b, tiles: list, lane: Reg, n_tiles: Reg) -> None:
    """The correction warps (tile.correction), `tiles` (QTile, Correction) per Q tile: per K/V
    tile j and Q tile, once its softmax warps handed P(j) over (p_full), rescale its O where
    they voted (Correction.tile: after its P·V(j - 1) completed), then lane 0 of each warp
    arrives on the tile's O_READY, which its P·V(j) waits for."""
    parity = b.mov(0, U32)
    first_lane = b.setp("eq", lane, 0)
    with b.for_range(0, n_tiles) as j:
        for i, (tile, correction) in enumerate(tiles):
            b.mbarrier_wait_parity(Addr(tile.bars, P_FULL), parity)
            if i == len(tiles) - 1:
                b.xor(parity, 1, out=parity)
            b.tcgen05_fence(before=False)
            correction.tile(j)                 # ends with its stores' wait, fence and warp sync
            with b.if_then(first_lane):
                b.mbarrier_arrive(Addr(tile.bars, O_READY))
                # its exchange buffer read: the softmax warps may write tile j + 2's there
                b.mbarrier_arrive(pair_barrier(b, tile.bars, X_FREE0, X_FREE1, j))


def _softmax_warps(b, tile: QTile, make_math, transform_of, lane, n_tiles, n_full, key0_of,
                   lo_full, q_bar, W: int, corrected: bool = False) -> None:
    """One Q tile's W softmax warps: the loop, then the epilogue (see the module docstring);
    `corrected`: the correction warps rescale O, P(j) goes to buffer j mod 2."""
    math = make_math(tile)
    transform = transform_of(math)
    first_lane = b.setp("eq", lane, 0)
    s_free, p_full = Addr(tile.bars, S_FREE), Addr(tile.bars, P_FULL)

    def arrive(bar: Addr) -> None:
        with b.if_then(first_lane):
            b.mbarrier_arrive(bar)

    with b.for_range(0, n_tiles) as j:
        s = math.scores_ready(None)
        b.tcgen05_fence(before=True)
        arrive(s_free)                               # S(j) loaded: S(j+1) may overwrite it
        modify_scores(b, math, s, j, key0_of, transform, n_full, lo_full)
        early = math.softmax_early(s)
        if corrected:                                # P(j)'s buffer free: P·V(j - 2) done
            math.p_free(j)
            math.hand_over(*early, j)                # ... fence and warp sync
        else:
            math.pv_done()
            math.softmax_late(*early)                # ends with fence::before_thread_sync
        arrive(p_full)
    if corrected:
        math.last_pv_done(n_tiles)
    else:
        with b.if_then(b.setp("gt", n_tiles, 0)):   # O += P(n-1)·V(n-1)
            math.pv_done()
    # Q has landed (with no tile, nothing else orders its copy before O is staged over it)
    b.mbarrier_wait_parity(q_bar, 0)
    # every warp of the tile done with its Q: O goes there
    b.bar_sync(CONSUMER_BARRIER if tile.barrier is None else tile.barrier, 32 * W)
    math.epilogue()


def _mma_warp(b, S, kv_bytes, v_bytes, k_smem, v_smem, bars, q_bar, empty0, tiles, n_tiles,
              last_v_landed=None, correction: bool = False) -> None:
    """The whole MMA warp runs this (umma issues under elect.sync); `tiles`: per Q tile its
    (s_free, p_full, UmmaIssue). The loop is unrolled by the S stages, so that tile j's buffers
    are copy (j mod S)'s constants: every stage's K and V descriptor is computed once, before
    the loop, where ptxas holds them in uniform registers (a stage offset carried through the
    wait loops would not be provably warp-uniform: a vector register, two R2UR moves and a
    64-bit add per MMA). Per K/V tile every Q tile's S, then every Q tile's P·V: while one
    tile's softmax warps work, the other's products run. With `correction` a P·V waits for
    O_READY (the tiles' second element) and reads P from buffer (j - 1) mod 2, and tile 0 has
    no empty commit (each BAR_O phase is one P·V's)."""
    umma0 = tiles[0][2]
    k_descs = [umma0.k_desc(b.add(k_smem, s * kv_bytes) if s else k_smem) for s in range(S)]
    v_descs = [umma0.v_desc(b.add(v_smem, s * v_bytes) if s else v_smem) for s in range(S)]
    parity = b.mov(0, U32)     # the phase parity of full[] in this round of S tiles
    handed = b.mov(0, U32)     # s_free's / p_full's parity: (j - 1) & 1 (every Q tile's)

    def wait(bar: Addr, phase: Reg) -> None:
        b.mbarrier_wait_parity(bar, phase)
        b.tcgen05_fence(before=False)

    def tile(s: int, r: Reg | None, rnd: Reg) -> None:
        """Tile j = r + s (K(j) in stage s, V(j-1) in stage s - 1). Copy 0 gets the round's
        first tile r, which may be tile 0 (no S(j-1) to wait for, no P·V); the others' j > 0."""
        wait(Addr(bars, s * MBARRIER_BYTES), parity)
        later = b.setp("gt", r, 0) if r is not None else None
        # P(j - 1)'s buffer: (s - 1) mod 2 when the rounds start at even tiles
        buffer = 0
        if correction and S % 2 == 0:
            buffer = (s - 1) % 2
        elif correction:
            j1 = b.sub(rnd, 1) if s == 0 else rnd if s == 1 else b.add(rnd, s - 1)   # j - 1
            buffer = b.setp("ne", b.and_(j1, 1), 0)
        for s_free, _, umma in tiles:
            with b.if_then(later) if later is not None else contextlib.nullcontext():
                wait(s_free, handed)
            umma.scores_from(k_descs[s])

        def pv() -> None:
            for i, (_, p_full, umma) in enumerate(tiles):
                wait(p_full, handed)
                if i == len(tiles) - 1:
                    b.xor(handed, 1, out=handed)
                umma.pv_from(v_descs[(s - 1) % S], buffer)
        if later is None:
            pv()
        elif correction:                      # tile 0: no P·V, no commit to BAR_O
            with b.if_then(later):
                pv()
        else:
            with b.if_then(later):
                pv()
            with b.else_():
                for _, _, umma in tiles:
                    umma.no_pv()
        umma0.commit(Addr(bars, empty0 + s * MBARRIER_BYTES))

    b.mbarrier_wait_parity(q_bar, 0)
    with b.for_range(0, n_tiles, S) as r:
        tile(0, r, r)
        for s in range(1, S):
            with b.if_then(b.setp("lt", b.add(r, s), n_tiles)):
                tile(s, None, r)
        b.xor(parity, 1, out=parity)
    with b.if_then(b.setp("gt", n_tiles, 0)):                            # O += P(n-1)·V(n-1)
        # V(n-1) lands with full[n mod S], in the round of tile n: this one's parity unless n
        # ended a round early (n mod S != 0: the loop flipped the parity once more)
        last = b.rem(n_tiles, S)
        wait(Addr(b.add(bars, b.mul(last, MBARRIER_BYTES))),
             b.xor(parity, b.selp(1, 0, b.setp("ne", last, 0), U32)))
        for _, p_full, _ in tiles:
            wait(p_full, handed)
        stage = b.rem(b.add(n_tiles, S - 1), S)               # (n - 1) mod S
        v_tile = b.add(v_smem, b.mul(stage, v_bytes))
        if last_v_landed is not None:
            last_v_landed(v_tile)
        buffer = b.setp("ne", b.and_(b.sub(n_tiles, 1), 1), 0) if correction else 0
        for _, _, umma in tiles:
            umma.pv(v_tile, buffer)
