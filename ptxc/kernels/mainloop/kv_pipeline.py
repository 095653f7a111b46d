"""The K/V tile loop shared by the tensor-core families (prefill, varlen): a `num_stages`-deep
cp.async pipeline of K and V tiles around the per-tile math (scores, mask, softmax, P·V).

Commit groups in order: Q+K0, V0, K1, V1, ..., K(S-1); iteration j then waits for K(j) and V(j)
with 2S-2 younger groups allowed in flight, and refills the buffers it has finished with:
V(j+S-1) after the first barrier, K(j+S) after the second. The family supplies how a tile is
loaded (`load_kv(t, j, stage_offset)`, which must commit exactly one group, empty or not) and
the math object; tiles j >= n_full get the mask. Each of K and V is requested in tile order
0, 1, 2, ..., so a family may carry its next global address in a register.

A latent cache (MLA: V is the first head_dim_v columns of each K row) runs
run_shared_kv_pipeline instead: one tile per stage serves both products, so each latent row is
read from global memory once per CTA.
"""

from __future__ import annotations

from ...ir import U32, KernelBuilder, Reg


def run_kv_pipeline(b: KernelBuilder, *, stages: int, kv_bytes: int, k_smem: Reg, v_smem: Reg,
                    use_async: bool, n_tiles: Reg, n_full: Reg, key0_of, load_kv, math,
                    transform=None, lo_full: Reg | None = None, landed=None, mask_of=None,
                    q_landed=None) -> None:
    """Prologue, loop over tiles [0, n_tiles) and drain. `key0_of(j)` is the first key of loop
    tile j (what the mask compares against); `transform(scores, key0)`, when given, modifies the
    raw scores before the mask (the variant seam: soft-cap, ALiBi). With `lo_full` (a sliding
    window), loop tiles j < lo_full cross a window's left edge and get the mask too.
    With `landed(t, stage)` the stage buffers hold raw tiles (kv_fp8_stage.py: FP8 bytes):
    after tile t's ("k" | "v") wait and before the barrier, it converts this thread's share of
    the tile at buffer offset `stage` and returns the address the math reads instead.
    With `mask_of(j)` -> (first key, pred needs the mask) the family orders the tiles itself
    (mask_tiles.TileList: loop tile j is any KV tile), replacing key0_of / n_full / lo_full for
    the scores.
    With `q_landed()` the Q tile is rewritten before the loop (MmaMath.rescale_q_to_f16): after
    the prologue, the wait for the first group (Q and K(0)) and a barrier; iteration 0's own
    barrier then orders the rewrite before every read."""

    def wait_and_sync(t: str):
        if use_async:
            b.cp_async_wait(2 * stages - 2)
        tile = landed(t, stage) if landed is not None else None
        b.bar_sync(0)
        return tile

    for s in range(stages):
        load_kv("k", b.mov(s, U32), s * kv_bytes)
        if s < stages - 1:
            load_kv("v", b.mov(s, U32), s * kv_bytes)
    q_rewrite(b, q_landed, 2 * stages - 1 if use_async else 0)

    # Buffer offsets of tile j (stage) and of tile j - 1 (prev, = the stage of j + S - 1), carried
    # in registers rather than recomputed from j % S every iteration.
    stage = b.mov(0, U32) if stages > 1 else 0
    prev = b.mov((stages - 1) * kv_bytes, U32) if stages > 1 else 0
    with b.for_range(0, n_tiles) as j:
        k_tile = wait_and_sync("k")                       # K(j) landed; V(j-1) no longer read
        load_kv("v", b.add(j, stages - 1), prev)
        if k_tile is None:
            k_tile = b.add(k_smem, stage) if stages > 1 else k_smem
        s = math.scores(k_tile)
        modify_scores(b, math, s, j, key0_of, transform, n_full, lo_full, mask_of)
        p = math.softmax(s)
        v_tile = wait_and_sync("v")                       # V(j) landed; K(j) no longer read
        load_kv("k", b.add(j, stages), stage)
        if v_tile is None:
            v_tile = b.add(v_smem, stage) if stages > 1 else v_smem
        math.pv(p, v_tile)
        if stages > 1:
            advance_stage(b, stage, prev, kv_bytes, stages)
    if use_async:
        b.cp_async_wait(0)   # the Q tile when no KV tile was visited (and empty groups)
    b.bar_sync(0)


def run_shared_kv_pipeline(b: KernelBuilder, *, stages: int, kv_bytes: int, kv_smem: Reg,
                           n_tiles: Reg, n_full: Reg, key0_of, load_kv, math, transform=None,
                           lo_full: Reg | None = None, landed=None, q_landed=None,
                           scores_from=None) -> None:
    """run_kv_pipeline for a cache whose V rows are the leading columns of its K rows (MLA's
    latent rows): `load_kv("k", j, stage)` loads tile j once (load_kv is never asked for V),
    and the scores and P·V of iteration j read the same stage buffer -- or, with
    `scores_from(stage)`, the scores read that address (the staged e4m3 rows themselves,
    kv_fp8_stage's qk_staged: visible after the same second barrier, refilled only after the
    next iteration's first) and P·V the converted tile.

    Commit groups: Q+T0, T1, ..., T(S-2); iteration j waits for T(j) with S-2 younger groups in
    flight, then ONE barrier (T(j) visible to all; every warp is past P·V of tile j-1, whose
    buffer is then refilled with T(j+S-1)). With `landed` (FP8 bytes staged, kv_fp8_stage.py)
    the converted tile is read by both products, so its conversion sits between two barriers:
    the first ends every read of tile j-1's conversion. Needs S >= 2. `q_landed` as in
    run_kv_pipeline (after the wait for Q and T0)."""
    assert stages >= 2, "the latent pipeline refills tile j-1's buffer while tile j is in use"
    for s in range(stages - 1):
        load_kv("k", b.mov(s, U32), s * kv_bytes)
    q_rewrite(b, q_landed, stages - 1)
    stage = b.mov(0, U32)
    prev = b.mov((stages - 1) * kv_bytes, U32)
    with b.for_range(0, n_tiles) as j:
        b.cp_async_wait(stages - 2)
        b.bar_sync(0)                                     # T(j) landed; tile j-1 no longer read
        load_kv("k", b.add(j, stages - 1), prev)
        if landed is not None:
            tile = landed("k", stage)
            b.bar_sync(0)
        else:
            tile = b.add(kv_smem, stage)
        s = math.scores(tile if scores_from is None else scores_from(stage))
        modify_scores(b, math, s, j, key0_of, transform, n_full, lo_full)
        math.pv(math.softmax(s), tile)
        advance_stage(b, stage, prev, kv_bytes, stages)
    b.cp_async_wait(0)   # the Q tile when no KV tile was visited (and empty groups)
    b.bar_sync(0)


def q_rewrite(b: KernelBuilder, q_landed, groups: int) -> None:
    """`q_landed()` (MmaMath.rescale_q_to_f16) after a prologue of `groups` cp.async commit
    groups (0: plain loads): the wait for the first, the Q tile's, and a barrier. Iteration 0's
    barrier (and on wgmma its fence.proxy.async) then orders the rewrite before every read of Q,
    as it does a converted tile."""
    if q_landed is None:
        return
    if groups:
        b.cp_async_wait(groups - 1)
    b.bar_sync(0)
    q_landed()


def modify_scores(b: KernelBuilder, math, s, j: Reg, key0_of, transform, n_full: Reg,
                  lo_full: Reg | None, mask_of=None) -> None:
    """Loop tile j's raw scores -> the variant's transform, then the mask where the tile needs
    one (past n_full: the sequence end or the diagonal; before lo_full: a window's left edge;
    with mask_of, where the family's tile order says)."""
    if mask_of is not None:
        key0, needs_mask = mask_of(j)
        if transform is not None:
            transform(s, key0)
        with b.if_then(needs_mask):
            math.mask(s, key0)
        return
    if transform is not None:
        transform(s, key0_of(j))
    needs_mask = b.setp("ge", j, n_full)
    if lo_full is not None:
        needs_mask = b.or_(needs_mask, b.setp("lt", j, lo_full))
    with b.if_then(needs_mask):
        math.mask(s, key0_of(j))


def advance_stage(b: KernelBuilder, stage: Reg, prev: Reg, kv_bytes: int, stages: int) -> None:
    """prev <- stage, stage <- the next buffer offset (wrapping after `stages` buffers)."""
    nxt = b.add(stage, kv_bytes)
    nxt = b.selp(0, nxt, b.setp("eq", nxt, stages * kv_bytes))
    b.mov(stage, out=prev)
    b.mov(nxt, out=stage)


class StageRing:
    """The stage-buffer offsets a K/V tile loop walks, as registers: K(j)'s at `k`, V(j-1)'s
    at `v_prev`, for `stages` K buffers of k_bytes and as many V buffers of v_bytes. V tiles
    narrower than K (head_dim_v < head_dim) walk their own offset; equal sizes share one walk
    (advance_stage: V(j-1) sits where K(j-1) did)."""

    def __init__(self, b: KernelBuilder, stages: int, k_bytes: int, v_bytes: int):
        self.b, self.stages, self.k_bytes, self.v_bytes = b, stages, k_bytes, v_bytes
        self.k = b.mov(0, U32)
        self.v_prev = b.mov((stages - 1) * v_bytes, U32)
        self.v = None if k_bytes == v_bytes else b.mov(0, U32)   # V(j)'s, when it differs

    def advance(self) -> None:
        b, S = self.b, self.stages
        if self.v is None:
            advance_stage(b, self.k, self.v_prev, self.k_bytes, S)
            return
        b.mov(self.v, out=self.v_prev)
        for reg, size in ((self.v, self.v_bytes), (self.k, self.k_bytes)):
            nxt = b.add(reg, size)
            b.mov(b.selp(0, nxt, b.setp("eq", nxt, S * size)), out=reg)
