"""The K/V tile loop of the sm_90a wgmma prefill: cp.async stages as in kv_pipeline.py, with
the tensor cores overlapped with the softmax inside each warpgroup (FlashAttention-3's
intra-warpgroup pipelining).

Iteration j (all warpgroups of the CTA in step, as the copies are shared):

  A(j)   cp.async.wait (K(j) and V(j-1) landed), bar.sync, fence.proxy.async
         issue S(j) = Q·K(j)ᵀ                    (commit group 1)
         issue O += P(j-1)·V(j-1), when j > 0      (commit group 2; empty for j = 0)
         wgmma.wait_group 1: S(j) is done, P·V(j-1) may still run on the tensor cores
         mask / variant transforms, row max, the lazy-rescale vote and the exponentials of
         S(j)  -- overlapping P·V(j-1)
         wgmma.wait_group 0; O *= alpha (when rescaling), P(j) packed, row sums (mma.sync)
  B(j)   bar.sync (every warpgroup is done reading K(j) and V(j-1)), then the copies of
         K(j+S) into K(j)'s buffer and V(j+S-1) into V(j-1)'s, two commit groups.

After the loop, O += P(n-1)·V(n-1). The copies of B(i) are K(i+S), V(i+S-1), so K(j+1) and
V(j) share the commit pair of B(j+1-S) and A(j) waits with 2S-2 younger groups in flight; the
prologue is B(-S)..B(-1) (V(-1) an empty group; the Q tile joins K(0)'s group). Only one
fence per tile: the generic-proxy writes of K(j) and V(j-1) both precede A(j)'s barrier.
"""

from __future__ import annotations

from contextlib import nullcontext

from ...ir import U32, KernelBuilder, Reg
from .kv_pipeline import StageRing, advance_stage, modify_scores, q_rewrite


def run_wgmma_pipeline(b: KernelBuilder, *, stages: int, kv_bytes: int, k_smem: Reg, v_smem: Reg,
                       n_tiles: Reg, n_full: Reg, key0_of, load_kv, math, transform=None,
                       lo_full: Reg | None = None, landed=None, v_bytes: int | None = None,
                       q_landed=None) -> None:
    """`load_kv(t, tile, stage_offset)` copies one K or V tile (if it exists) and commits exactly
    one group; `math` is a WgmmaMath. With `landed(t, stage)` the stage buffers hold raw tiles
    (FP8 bytes, kv_fp8_stage.SwizzledFP8Staging): after A(j)'s wait and before its barrier it
    converts this thread's share of K(j) and V(j-1) and returns the tile the math reads.
    `v_bytes`: a V stage buffer's size when it differs from K's `kv_bytes` (head_dim_v <
    head_dim). `q_landed()` rewrites the Q tile before the loop (q_rewrite)."""
    S = stages
    v_bytes = kv_bytes if v_bytes is None else v_bytes
    for s in range(S):                                  # B(-S) .. B(-1)
        load_kv("k", b.mov(s, U32), s * kv_bytes)
        if s == 0:
            b.cp_async_commit()                         # V(-1): an empty group
        else:
            load_kv("v", b.mov(s - 1, U32), (s - 1) * v_bytes)
    q_rewrite(b, q_landed, 2 * S)

    ring = StageRing(b, S, kv_bytes, v_bytes)   # buffer offsets of K(j) and of V(j - 1)

    def landed_and_fenced(j=None):
        """The wait and barrier of A(j) (j None: the last P·V's); returns where K(j) and V(j-1)
        are read: (base, offset) each."""
        b.cp_async_wait(2 * S - 2)
        tiles = (k_smem, ring.k), (v_smem, ring.v_prev)
        if landed is not None:   # the staged tiles converted (V(-1) does not exist)
            k = landed("k", ring.k) if j is not None else k_smem
            with b.if_then(b.setp("gt", j, 0)) if j is not None else nullcontext():
                v = landed("v", ring.v_prev)     # the tile's address: defined before the branch
            tiles = (k, 0), (v, 0)
        b.bar_sync(0)
        b.fence_proxy_async()
        return tiles

    with b.for_range(0, n_tiles) as j:
        (k_at, k_off), (v_at, v_off) = landed_and_fenced(j)                   # A(j)
        attend_tile(b, math, k_at, k_off, v_at, v_off, j, key0_of, transform, n_full,
                    lo_full)
        b.bar_sync(0)                                                         # B(j)
        load_kv("k", b.add(j, S), ring.k)
        load_kv("v", b.add(j, S - 1), ring.v_prev)
        ring.advance()
    with b.if_then(b.setp("gt", n_tiles, 0)):           # O += P(n-1)·V(n-1)
        _, (v_at, v_off) = landed_and_fenced()
        math.issue_pv(b.add(v_at, v_off))
        math.pv_done()
    b.cp_async_wait(0)   # the Q tile when no KV tile was visited (and empty groups)
    b.bar_sync(0)


def attend_tile(b: KernelBuilder, math, k_smem: Reg, stage: Reg, v_smem: Reg, prev: Reg, j: Reg,
                key0_of, transform, n_full: Reg, lo_full: Reg | None, reads_done=None,
                turn=None) -> None:
    """The MMA / softmax body of tile j (K(j) landed at k_smem + stage, V(j-1) at v_smem +
    prev): S(j) and O += P(j-1)·V(j-1) in flight together, the score-side softmax under them,
    the rest after the P·V completed -- after which `reads_done()` (if given) runs: both tiles
    are read. `turn` (a Turns, the consumers' ping-pong) brackets the two issues. `math`
    (WgmmaMath, or Tcgen05Math on sm_100a) says how products are issued and waited for:
    issue_scores, issue_pv / skip_pv, scores_ready, pv_done."""
    if turn is not None:
        turn.begin()
    issued = math.issue_scores(b.add(k_smem, stage))
    with b.if_then(b.setp("gt", j, 0)):
        math.issue_pv(b.add(v_smem, prev))
    with b.else_():
        math.skip_pv()
    if turn is not None:
        turn.end()
    s = math.scores_ready(issued)
    modify_scores(b, math, s, j, key0_of, transform, n_full, lo_full)
    early = math.softmax_early(s)
    math.pv_done()
    if reads_done is not None:
        reads_done()
    math.softmax_late(*early)


def run_latent_wgmma_pipeline(b: KernelBuilder, *, stages: int, kv_bytes: int, kv_smem: Reg,
                              n_tiles: Reg, n_full: Reg, key0_of, load_kv, math, transform=None,
                              lo_full: Reg | None = None, landed=None, q_landed=None) -> None:
    """run_wgmma_pipeline for a latent cache (MLA: V is the first columns of each K row, one
    tile per stage, kv_pipeline.run_shared_kv_pipeline's contract for `load_kv`): iteration j
    issues S(j) from tile j and O += P(j-1)·V(j-1) from tile j-1 together (attend_tile), so
    both stay in place through it. One barrier per iteration, at its top: T(j) has landed
    (wait, barrier, fence.proxy.async for the tensor cores' reads), and every warp is past
    iteration j-1, whose P·V(j-2) retired there -- so tile j-2's buffer is refilled with
    T(j+S-2) right after it. Commit groups: Q+T0, T1, .., T(S-3) before the loop, one per
    iteration after; iteration j waits for T(j) with S-3 younger groups in flight (the tile
    loaded S-2 iterations ahead). Needs S >= 3 (tiles j-1 and j in use, one landing).
    With `landed(t, stage)` (FP8 bytes, kv_fp8_latent.LatentFP8Staging) the stages hold raw
    tiles: _run_staged_latent. `q_landed` as in run_wgmma_pipeline."""
    if landed is not None:
        _run_staged_latent(b, stages, kv_bytes, kv_smem, n_tiles, n_full, key0_of, load_kv, math,
                           transform, lo_full, landed, q_landed)
        return
    S = stages
    assert S >= 3, "the latent wgmma loop holds tiles j-1 and j and loads one ahead"
    for s in range(S - 2):
        load_kv("k", b.mov(s, U32), s * kv_bytes)
    q_rewrite(b, q_landed, S - 2)
    stage = b.mov(0, U32)                          # tile j's buffer offset
    prev = b.mov((S - 1) * kv_bytes, U32)          # tile j-1's
    fill = b.mov((S - 2) * kv_bytes, U32)          # tile j-2's: refilled with T(j+S-2)
    with b.for_range(0, n_tiles) as j:
        b.cp_async_wait(S - 3)
        b.bar_sync(0)
        b.fence_proxy_async()
        load_kv("k", b.add(j, S - 2), fill)
        attend_tile(b, math, kv_smem, stage, kv_smem, prev, j, key0_of, transform, n_full, lo_full)
        b.mov(prev, out=fill)
        advance_stage(b, stage, prev, kv_bytes, S)
    with b.if_then(b.setp("gt", n_tiles, 0)):           # O += P(n-1)·V(n-1)
        math.p_visible()
        math.issue_pv(b.add(kv_smem, prev))
        math.pv_done()
    b.cp_async_wait(0)   # the Q tile when no KV tile was visited (and empty groups)
    b.bar_sync(0)


def _run_staged_latent(b: KernelBuilder, S: int, stage_bytes: int, stage_smem: Reg, n_tiles: Reg,
                       n_full: Reg, key0_of, load_kv, math, transform, lo_full, landed,
                       q_landed=None) -> None:
    """The latent wgmma loop over FP8 staging buffers: T(j) lands raw in stage j % S and is
    converted into one of two alternating f16/bf16 tiles (`landed` returns it). Iteration j:
    wait for this thread's T(j) chunks (S-1 younger groups in flight: the staging ring is S
    tiles deep), a barrier (every warp past iteration j-1, whose P·V(j-2) read the converted
    tile T(j) now overwrites), the conversion of its own chunks, a barrier and
    fence.proxy.async (tile j complete for the tensor cores; T(j)'s stage read by all, so it is
    refilled with T(j+S)), then attend_tile over tile j and tile j-1. Commit groups: Q+T0, T1,
    .., T(S-1) before the loop, one per iteration after."""
    for s in range(S):
        load_kv("k", b.mov(s, U32), s * stage_bytes)
    q_rewrite(b, q_landed, S)
    stage = b.mov(0, U32)
    prev = b.mov(0, U32)        # the staging offset of T(j-1) (advance_stage's register pair)
    prev_tile = b.mov(0, U32)   # the converted tile j-1 (unread at j = 0: no P·V(-1))
    with b.for_range(0, n_tiles) as j:
        b.cp_async_wait(S - 1)
        b.bar_sync(0)
        tile = landed("k", stage)
        b.bar_sync(0)
        b.fence_proxy_async()
        load_kv("k", b.add(j, S), stage)
        attend_tile(b, math, tile, 0, prev_tile, 0, j, key0_of, transform, n_full, lo_full)
        b.mov(tile, out=prev_tile)
        advance_stage(b, stage, prev, stage_bytes, S)
    with b.if_then(b.setp("gt", n_tiles, 0)):           # O += P(n-1)·V(n-1)
        math.p_visible()
        math.issue_pv(prev_tile)
        math.pv_done()
    b.cp_async_wait(0)
    b.bar_sync(0)

