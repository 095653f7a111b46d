"""The latent wgmma loop with a dequantising warpgroup (tile.dequant_warpgroup: MLA over e4m3 or
e4m3_ds rows on sm_90a). In run_latent_wgmma_pipeline's staged loop every warp converts its
share of each FP8 tile between two CTA barriers, so the conversion (a third to a half of the
computing warps' instructions) sits in series with the products and the softmax. Here, as in
FlashMLA's FP8 kernels, a warpgroup of its own copies and converts the rows, and the two
computing warpgroups run the loop of a cache of the dtype over the tiles it hands them.

  CTA        warps 0-7 compute (WgmmaMath as in run_latent_wgmma_pipeline: 64 head rows, value
             split, split scores), warps 8-11 dequantise: 384 threads, .maxntid 384 and
             .minnctapersm 1; after the common prologue the dequantising warpgroup gives
             registers back (setmaxnreg.dec to DEQUANT_REGS) and the computing ones take them
             (setmaxnreg.inc: 216).
  shared     Q | converted tiles x 3 | staging x S | full[3], empty[3] | score exchange.
  dequant    tile i: wait for its own copies of T(i) (cp.async.wait_group S - 1), named
             barrier DEQUANT_BARRIER over its 128 threads (every copy visible: a group-scaled
             chunk reads the scale another thread copied), every pass's shared loads of T(i)
             into registers, the named barrier again (every thread has read T(i)'s staging
             buffer) and the copy of T(i + S) into it -- so with one staging buffer (S = 1, what
             fits beside the score exchange) the next tile's load runs under this one's
             conversion -- then from i >= 3 the wait on empty[i mod 3] (tile i - 3 released),
             the conversion into converted tile i mod 3, fence.proxy.async (its generic-proxy
             writes before the tensor cores' async-proxy reads), and the arrival on
             full[i mod 3] (arrival count 128).
  compute    Q by their own cp.async (rewritten into f16 for f16 products), fence.proxy.async,
             named barrier 1; tile j: wait on full[j mod 3] (parity (j / 3) & 1), attend_tile
             with S(j) from tile j and P·V(j - 1) from tile j - 1; once wgmma.wait_group 0 has
             retired P·V(j - 1), lane 0 of each warp arrives on empty[(j - 1) mod 3] (count 8).
             With split scores, named barrier 1 at the end of every iteration: the exchange's
             slots are rewritten only after every warp read them (the loop has no other
             barrier among the computing warps; the emulator's race checker caught the missing
             one). Then the last P·V and the epilogue (its barriers and the
             score exchange's are named barrier 1: the dequantising warpgroup never reaches
             them).

Sparse top-k's rows are gathered by the same warpgroup: its copies read their rows' offsets
from the slot ring its first warp fills two tiles ahead (kv_pages.SparseSlots, ordered by
DEQUANT_BARRIER), and that warp publishes each tile's valid rows as one word, released to the
computing warps with the tile by the arrival on full[] (their mask reads it: no slot loads).

Phases: full[s] completes phase k when tile s + 3k is converted; empty[s] when tile s + 3k is
released, in compute iteration s + 3k + 1, so the dequantising warpgroup's wait for tile i is
on phase i / 3 - 1 of empty[i mod 3]. Tiles n - 3 .. n - 1 are released (or not) with no
one waiting. Memory model: the converting threads' fence.proxy.async, then their arrive
(release, CTA scope) and the computing threads' wait (acquire) order the generic writes before
the wgmma operand reads (CUTLASS's rule for shared memory that threads fill and tensor cores
read); the WAR side -- a conversion overwriting a tile P·V read -- is ordered by
wgmma.wait_group 0 before the release.
"""

from __future__ import annotations

from ...ir import U32, Addr, KernelBuilder, Reg
from .kv_pipeline import advance_stage
from .tma_pipeline import MBARRIER_BYTES, advance_barrier
from .tma_ws_pipeline import CONSUMER_BARRIER
from .wgmma_pipeline import attend_tile

DEQUANT_BARRIER = 2       # named barrier of the dequantising warpgroup (1: the computing ones')
TILES = 3                 # the converted ring: j - 1 and j read, j + 1 written
THREADS = 128             # the dequantising warpgroup


def run_dequant_pipeline(b: KernelBuilder, *, stages: int, stage_bytes: int, tile_bytes: int,
                         tiles: Reg, bars: Reg, tid: Reg, lane: Reg, compute_threads: int,
                         dequant_regs: int, compute_regs: int, n_tiles: Reg, n_full: Reg,
                         key0_of, make_loads, make_math, transform_of, copy_q,
                         lo_full: Reg | None = None, q_rewrite_of=None,
                         direct: Reg | None = None, before_split=None) -> None:
    """`make_loads(tid)` (in the dequantising warpgroup's branch, `tid` its 0..127) returns
    (load_kv, convert): load_kv(j, stage_offset) copies T(j) if it exists and commits one
    cp.async group, convert(stage_offset, tile, between) loads this thread's share of the
    staged tile, runs between(), and converts it into the converted tile at `tile`. In the
    computing branch: `copy_q()` copies the Q tile (cp.async, one group), `make_math()` builds
    the WgmmaMath, `transform_of(math)` its score transform, `q_rewrite_of(math)` (or None)
    the hook that rewrites Q once it landed.

    `direct` (the staging ring's base: kv_fp8_direct.py, qk_products = "e4m3"): the `stages`
    staging buffers hold S's operand as they landed, the converted tiles only V; the computing
    warps read tile j's staging buffer for S(j) and release it on sempty[j mod stages] (after
    the empty barriers) once S(j) retired; the dequantising warpgroup refills it with T(j +
    stages) after that release, two tiles behind the one it converts (_dequantise_direct).

    On sm_100a (MLA's tcgen05 latent tile) the computing warps are one warpgroup of softmax
    warps with S, P and O in tensor memory: `before_split()` initialises the MMA barriers and
    allocates the tensor memory before the last CTA barrier, `dequant_regs` / `compute_regs`
    are None (256 threads: every thread may hold 255 registers, no setmaxnreg), and the math's
    `p_visible` -- a named barrier of the computing warps there, nothing on wgmma -- orders
    every warp's P in tensor memory before the next P·V the issuing warp starts."""
    full = lambda s: Addr(bars, s * MBARRIER_BYTES)                        # noqa: E731
    empty0 = TILES * MBARRIER_BYTES
    with b.if_then(b.setp("eq", tid, 0)):
        for s in range(TILES):
            b.mbarrier_init(full(s), THREADS)
            b.mbarrier_init(Addr(bars, empty0 + s * MBARRIER_BYTES), compute_threads // 32)
        for s in range(stages if direct is not None else 0):
            b.mbarrier_init(Addr(bars, 2 * empty0 + s * MBARRIER_BYTES), compute_threads // 32)
    if before_split is not None:
        before_split()
    b.bar_sync(0)                    # the last whole-CTA barrier: every thread is still here

    with b.if_then(b.setp("ge", tid, compute_threads)):                    # dequantise
        if dequant_regs is not None:
            b.setmaxnreg(False, dequant_regs)
        load_kv, convert = make_loads(b.sub(tid, compute_threads))
        if direct is not None:
            _dequantise_direct(b, stages, stage_bytes, tile_bytes, tiles, bars, n_tiles, load_kv, convert)
        else:
            _dequantise(b, stages, stage_bytes, tile_bytes, tiles, bars, n_tiles, load_kv, convert)
    with b.else_():                                                         # compute
        if compute_regs is not None:
            b.setmaxnreg(True, compute_regs)
        copy_q()
        math = make_math()
        b.cp_async_wait(0)
        rewrite = q_rewrite_of(math) if q_rewrite_of else None
        if rewrite is not None:      # rows other threads copied: after a barrier
            b.bar_sync(CONSUMER_BARRIER, compute_threads)
            rewrite()
        b.fence_proxy_async()        # Q (copied, perhaps rewritten) for the tensor cores
        b.bar_sync(CONSUMER_BARRIER, compute_threads)
        _compute(b, tile_bytes, tiles, bars, lane, n_tiles, n_full, key0_of, math,
                 transform_of(math), lo_full, compute_threads,
                 None if direct is None else (direct, stages, stage_bytes))
        math.epilogue()


def _dequantise(b: KernelBuilder, S: int, stage_bytes: int, tile_bytes: int, tiles: Reg,
                bars: Reg, n_tiles: Reg, load_kv, convert) -> None:
    for s in range(S):
        load_kv(b.mov(s, U32), s * stage_bytes)
    stage, staged_prev = b.mov(0, U32), b.mov(0, U32)     # T(i)'s staging buffer
    tile, tile_prev = b.mov(0, U32), b.mov(0, U32)        # converted tile i mod 3
    bar_off, parity = b.mov(0, U32), b.mov(0, U32)        # full[i mod 3], (i / 3) & 1
    with b.for_range(0, n_tiles) as i:
        b.cp_async_wait(S - 1)
        b.bar_sync(DEQUANT_BARRIER, THREADS)

        def between(i=i) -> None:    # T(i) is in registers
            b.bar_sync(DEQUANT_BARRIER, THREADS)              # ... every thread's: refill its buffer
            load_kv(b.add(i, S), stage)
            with b.if_then(b.setp("ge", i, TILES)):       # tile i - 3 released: phase i / 3 - 1
                b.mbarrier_wait_parity(Addr(b.add(bars, b.add(bar_off, TILES * MBARRIER_BYTES))),
                                       b.xor(parity, 1))
        convert(stage, b.add(tiles, tile), between)
        b.fence_proxy_async()
        b.mbarrier_arrive(Addr(b.add(bars, bar_off)))
        advance_stage(b, stage, staged_prev, stage_bytes, S)
        advance_stage(b, tile, tile_prev, tile_bytes, TILES)
        advance_barrier(b, bar_off, parity, TILES)
    b.cp_async_wait(0)               # the empty groups past the last tile


def await_staging(b: KernelBuilder, bar: Addr, parity: Reg) -> None:
    """The direct ring's producer waits for a staging buffer's release (a seam: the tests
    leave it out and the emulator must catch the refill)."""
    b.mbarrier_wait_parity(bar, parity)


def release_staging(b: KernelBuilder, bar: Addr) -> None:
    """A computing warp releases a staging buffer (a seam, as await_staging)."""
    b.mbarrier_arrive(bar)


def _dequantise_direct(b: KernelBuilder, S: int, stage_bytes: int, tile_bytes: int, tiles: Reg,
                       bars: Reg, n_tiles: Reg, load_kv, convert) -> None:
    """The direct ring's producer: T(0), T(1) before the loop; tile i waits for its own copies
    (T(i + 1)'s group may still be in flight), loads its V chunks, then -- once the computing warps
    released T(i - 2)'s buffer (sempty, after S(i - 2) retired; buffers 2 and 3 start free) --
    refills that buffer with T(i + 2), waits for V tile i - 3's release and converts tile i's V
    into converted tile i mod 3. Buffer b's sempty completes phase k when T(b + S k) is
    released, so iteration i waits on phase (i - 2) / S of buffer (i + 2) mod S."""
    for s in range(2):
        load_kv(b.mov(s, U32), s * stage_bytes)
    stage, staged_prev = b.mov(0, U32), b.mov(0, U32)                  # T(i)'s buffer
    refill, refill_prev = b.mov(2 * stage_bytes, U32), b.mov(0, U32)   # T(i + 2)'s buffer
    sbar, sparity = b.mov(2 * MBARRIER_BYTES, U32), b.mov(1, U32)      # its sempty, phase parity
    tile, tile_prev = b.mov(0, U32), b.mov(0, U32)                     # converted tile i mod 3
    bar_off, parity = b.mov(0, U32), b.mov(0, U32)                     # full[i mod 3], (i / 3) & 1
    sempty0 = 2 * TILES * MBARRIER_BYTES
    with b.for_range(0, n_tiles) as i:
        b.cp_async_wait(1)

        def between(i=i) -> None:    # T(i)'s V chunks are in registers
            with b.if_then(b.setp("ge", i, 2)):
                await_staging(b, Addr(b.add(bars, b.add(sbar, sempty0))), sparity)
            load_kv(b.add(i, 2), refill)
            with b.if_then(b.setp("ge", i, TILES)):       # V tile i - 3 released: phase i / 3 - 1
                b.mbarrier_wait_parity(Addr(b.add(bars, b.add(bar_off, TILES * MBARRIER_BYTES))),
                                       b.xor(parity, 1))
        convert(stage, b.add(tiles, tile), between)
        b.fence_proxy_async()        # the V tile's stores and T(i)'s cp.async bytes, for wgmma
        b.mbarrier_arrive(Addr(b.add(bars, bar_off)))
        advance_stage(b, stage, staged_prev, stage_bytes, S)
        advance_stage(b, refill, refill_prev, stage_bytes, S)
        advance_barrier(b, sbar, sparity, S)
        advance_stage(b, tile, tile_prev, tile_bytes, TILES)
        advance_barrier(b, bar_off, parity, TILES)
    b.cp_async_wait(0)               # the empty groups past the last tile


def _compute(b: KernelBuilder, tile_bytes: int, tiles: Reg, bars: Reg, lane: Reg, n_tiles: Reg,
             n_full: Reg, key0_of, math, transform, lo_full: Reg | None,
             compute_threads: int, direct=None) -> None:
    """`direct`: (staging ring base, buffers, buffer bytes) -- S(j) reads T(j)'s buffer, which
    is released on its sempty with P·V(j - 1)'s V tile (both retired by then)."""
    first_lane = b.setp("eq", lane, 0)
    tile, prev = b.mov(0, U32), b.mov(0, U32)             # converted tiles j and j - 1
    bar_off, parity = b.mov(0, U32), b.mov(0, U32)        # full[j mod 3], (j / 3) & 1
    prev_bar = b.mov(0, U32)                              # empty[(j - 1) mod 3]
    if direct is not None:
        ring, S, stage_bytes = direct
        assert S & (S - 1) == 0, "T(j)'s staging buffer is j mod S, by a mask"
        sempty0 = 2 * TILES * MBARRIER_BYTES
    with b.for_range(0, n_tiles) as j:
        b.mbarrier_wait_parity(Addr(b.add(bars, bar_off)), parity)
        math.p_visible()             # P(j - 1) of every computing warp, before P·V(j - 1)
        if direct is not None:       # T(j)'s staging buffer and its sempty (three instructions)
            slot = b.and_(j, S - 1)
            sstage, sbar = b.mul(slot, stage_bytes), b.mul(slot, MBARRIER_BYTES)

        def release(j=j) -> None:    # P·V(j - 1) retired: tile j - 1 may be overwritten
            with b.if_then(b.and_(first_lane, b.setp("gt", j, 0))):
                b.mbarrier_arrive(Addr(b.add(bars, b.add(prev_bar, TILES * MBARRIER_BYTES))))
            if direct is not None:   # ... and S(j): T(j)'s staging buffer
                with b.if_then(first_lane):
                    release_staging(b, Addr(b.add(bars, b.add(sbar, sempty0))))

        if direct is None:
            attend_tile(b, math, tiles, tile, tiles, prev, j, key0_of, transform, n_full, lo_full,
                        reads_done=release)
        else:
            attend_tile(b, math, ring, sstage, tiles, prev, j, key0_of, transform, n_full, lo_full,
                        reads_done=release)
        if getattr(math, "split", None) is not None:   # the score exchange's slots: read by all
            b.bar_sync(CONSUMER_BARRIER, compute_threads)   # before they are rewritten
        advance_stage(b, tile, prev, tile_bytes, TILES)
        b.mov(bar_off, out=prev_bar)
        advance_barrier(b, bar_off, parity, TILES)
    with b.if_then(b.setp("gt", n_tiles, 0)):             # O += P(n-1)·V(n-1)
        math.p_visible()
        math.issue_pv(b.add(tiles, prev))
        math.pv_done()


__all__ = ["run_dequant_pipeline", "DEQUANT_BARRIER", "THREADS", "TILES"]
