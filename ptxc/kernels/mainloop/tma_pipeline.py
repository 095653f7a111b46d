"""The K/V tile loop of the sm_90a wgmma prefill with its tiles fed by TMA (tile.kv_loads =
"tma"): the schedule of wgmma_pipeline.py, with cp.async groups replaced by mbarriers.

One elected thread (tid 0) issues every copy: per 64-column slab of a tile one
`cp.async.bulk.tensor` box (64 elements x rows), landing in the same 128-byte-swizzled slabs the
per-thread loader writes (the TMA's 128-byte swizzle is the wgmma operand's: the 16-byte chunk
index XOR address bits [7, 10), slabs 1024-byte aligned). Rows past the sequence end lie outside
the tensor map and are filled with zeros, so tail tiles need no predicate (the score mask still
applies).

Barriers (8 bytes each, after the K/V stages): `full[s]` for s < S and one for Q, each with
arrival count 1. Refill B(i) = {K(i+S), V(i+S-1)} is one phase of full[i mod S]: the elected
thread arrives with expect_tx = the bytes of the tiles that exist (0 when none: the phase then
completes at once), so every B(i) completes exactly one phase and A(j) waits on full[j mod S]
with parity (j / S) & 1 -- the pair K(j), V(j-1) -- without a CTA barrier:

  A(j)   wait full[j mod S]                       (each thread; K(j), V(j-1) landed)
         the wgmma / softmax body of wgmma_pipeline.py
  B(j)   bar.sync (every warpgroup is done reading K(j) and V(j-1): wgmma.wait_group 0 came
         first), then the elected thread refills the same buffers and the same barrier

Memory model (PTX ISA, "Memory Consistency Model" / "Async proxy"): the TMA writes are
async-proxy writes whose completion the mbarrier's complete_tx performs; a thread that observes
the phase completing (try_wait.parity) may then read the data, and wgmma's shared-memory operand
reads are async-proxy reads too, so no fence.proxy.async is needed between a copy and the
wgmma that reads it (FlashAttention-3 and CUTLASS's PipelineTmaAsync place none). The WAR side
(a refill overwriting a buffer wgmma read) is ordered by wgmma.wait_group 0 (the reads are
complete) and the bar.sync before the elected thread issues the copy. The barriers' init is
made visible to the async proxy with fence.proxy.async before the CTA barrier that publishes it
(the CUDA programming guide's TMA example).
"""

from __future__ import annotations

from ...ir import U32, Addr, KernelBuilder, Reg
from .kv_pipeline import StageRing, advance_stage
from .wgmma_pipeline import attend_tile

MBARRIER_BYTES = 8


def barrier_bytes(stages: int, warp_specialized: bool = False, persistent: bool = False) -> int:
    """full[0 .. stages) and the Q barrier (then empty[0 .. stages) when warp-specialised, and
    a persistent CTA's Q-empty barrier)."""
    return (2 * stages + 1 if warp_specialized else stages + 1) * MBARRIER_BYTES \
        + (MBARRIER_BYTES if persistent else 0)


def init_full_barriers(b: KernelBuilder, leader: Reg, bars: Reg, count: int) -> None:
    """`count` mbarriers at `bars` (8 bytes apart, arrival count 1: the thread that arrives
    with each phase's expect_tx) initialised by `leader`, fenced for the async proxy (the
    TMA's complete_tx) and published by a CTA barrier."""
    with b.if_then(leader):
        for s in range(count):
            b.mbarrier_init(Addr(bars, s * MBARRIER_BYTES), 1)
        b.fence_proxy_async()        # the initialised barriers, for the TMA's complete_tx
    b.bar_sync(0)


def issue_refill(b: KernelBuilder, *, kv_bytes: int, k_smem: Reg, v_smem: Reg, n_tiles: Reg,
                 copy_tile, k_tile: Reg, k_off, v_tile: Reg | None, v_off, bar: Addr,
                 copies: bool = True, v_bytes: int | None = None) -> None:
    """One phase of `bar` (by the one thread that arrives on it): K(k_tile) into k_off,
    V(v_tile) into v_off, those that exist, with expect_tx their bytes (kv_bytes a K tile,
    v_bytes a V tile, default kv_bytes; 0: the phase completes at the arrive). With
    copies=False the copies are left to refill_copies (other threads)."""
    has_k = b.setp("lt", k_tile, n_tiles)
    nbytes = b.selp(kv_bytes, 0, has_k, U32)
    has_v = None
    if v_tile is not None:
        has_v = b.setp("lt", v_tile, n_tiles)
        nbytes = b.add(nbytes, b.selp(kv_bytes if v_bytes is None else v_bytes, 0, has_v, U32))
    b.mbarrier_arrive_expect_tx(bar, nbytes)
    if copies:
        refill_copies(b, k_smem=k_smem, v_smem=v_smem, n_tiles=n_tiles, copy_tile=copy_tile,
                      k_tile=k_tile, k_off=k_off, v_tile=v_tile, v_off=v_off, bar=bar,
                      has_k=has_k, has_v=has_v)


def refill_copies(b: KernelBuilder, *, k_smem: Reg, v_smem: Reg, n_tiles: Reg, copy_tile,
                  k_tile: Reg, k_off, v_tile: Reg | None, v_off, bar: Addr,
                  has_k: Reg | None = None, has_v: Reg | None = None) -> None:
    """The copies of one refill phase: K(k_tile), V(v_tile), those that exist."""
    if has_k is None:
        has_k = b.setp("lt", k_tile, n_tiles)
    with b.if_then(has_k):
        copy_tile("k", k_tile, b.add(k_smem, k_off), bar)
    if v_tile is not None:
        if has_v is None:
            has_v = b.setp("lt", v_tile, n_tiles)
        with b.if_then(has_v):
            copy_tile("v", v_tile, b.add(v_smem, v_off), bar)


def refill_phase(b: KernelBuilder, leader: Reg, issuer: Reg | None, **refill) -> None:
    """One phase of `bar` (issue_refill's arguments): the elected thread arrives with its
    expect_tx and issues the copies, or leaves them to the `issuer` threads (each its share)."""
    with b.if_then(leader):
        issue_refill(b, copies=issuer is None, **refill)
    if issuer is not None:
        refill.pop("kv_bytes"), refill.pop("v_bytes", None)
        with b.if_then(issuer):
            refill_copies(b, **refill)


def run_tma_pipeline(b: KernelBuilder, *, stages: int, kv_bytes: int, q_bytes: int, q_smem: Reg,
                     k_smem: Reg, v_smem: Reg, bars: Reg, leader: Reg, n_tiles: Reg, n_full: Reg,
                     key0_of, copy_tile, math, transform=None, lo_full: Reg | None = None,
                     q_landed=None, last_v_landed=None, issuer: Reg | None = None,
                     v_bytes: int | None = None) -> None:
    """`copy_tile(t, tile, smem_addr, bar)` issues the TMA boxes of tile `tile` of t ("q", "k"
    or "v"; the Q tile's index is unused) into `smem_addr` on mbarrier `bar` (called by the
    elected thread only, for tiles that exist); `bars` is the 8-byte-aligned shared address of
    barrier_bytes(stages) bytes; `leader` the predicate of the elected thread; `math` is a
    WgmmaMath. Optional hooks (None: nothing emitted): `q_landed()` runs after the prologue's
    copies are issued, before the loop (a Q tile loaded another way: q_bytes 0 and a copy_tile
    that issues nothing for "q"); `last_v_landed(v_addr)` runs once the last V tile has landed,
    before the P·V that reads it (every thread; it may rewrite the tile in shared memory);
    `issuer`: the predicate of the threads that call copy_tile for K/V (each issues its share
    of the boxes; the elected thread alone still arrives with the whole expect_tx, and a copy
    completing before that arrival leaves the transaction count transiently negative, which
    the mbarrier allows) instead of the elected thread. `v_bytes`: a V tile's bytes and
    stage stride when they differ from K's `kv_bytes` (head_dim_v < head_dim)."""
    S = stages
    v_bytes = kv_bytes if v_bytes is None else v_bytes
    q_bar = Addr(bars, S * MBARRIER_BYTES)
    init_full_barriers(b, leader, bars, S + 1)

    def refill(k_tile: Reg, k_off, v_tile: Reg | None, v_off, bar: Addr) -> None:
        """One phase of `bar`: K(k_tile) into k_off, V(v_tile) into v_off, those that exist."""
        refill_phase(b, leader, issuer, kv_bytes=kv_bytes, k_smem=k_smem, v_smem=v_smem,
                     n_tiles=n_tiles, copy_tile=copy_tile, k_tile=k_tile, k_off=k_off,
                     v_tile=v_tile, v_off=v_off, bar=bar, v_bytes=v_bytes)

    with b.if_then(leader):                              # Q, on its own barrier
        b.mbarrier_arrive_expect_tx(q_bar, q_bytes)
        copy_tile("q", None, q_smem, q_bar)
    for s in range(S):                                   # B(-S) .. B(-1)
        refill(b.mov(s, U32), s * kv_bytes, b.mov(s - 1, U32) if s else None,
               (s - 1) * v_bytes, Addr(bars, s * MBARRIER_BYTES))

    ring = StageRing(b, S, kv_bytes, v_bytes)   # buffer offsets of K(j) and of V(j - 1)
    bar_off = b.mov(0, U32)                  # full[j mod S] and the parity of its phase j / S
    parity = b.mov(0, U32)
    if q_landed is not None:
        q_landed()
    b.mbarrier_wait_parity(q_bar, 0)

    with b.for_range(0, n_tiles) as j:
        bar = Addr(b.add(bars, bar_off))
        b.mbarrier_wait_parity(bar, parity)                                 # A(j)
        attend_tile(b, math, k_smem, ring.k, v_smem, ring.v_prev, j, key0_of, transform, n_full,
                    lo_full)
        b.bar_sync(0)                                                       # B(j)
        refill(b.add(j, S), ring.k, b.add(j, S - 1), ring.v_prev, bar)
        ring.advance()
        advance_barrier(b, bar_off, parity, S)
    with b.if_then(b.setp("gt", n_tiles, 0)):           # O += P(n-1)·V(n-1)
        b.mbarrier_wait_parity(Addr(b.add(bars, bar_off)), parity)
        if last_v_landed is not None:
            last_v_landed(b.add(v_smem, ring.v_prev))
        math.issue_pv(b.add(v_smem, ring.v_prev))
        math.pv_done()
    b.bar_sync(0)        # every warpgroup done with Q before the epilogue stages O over it


def advance_barrier(b: KernelBuilder, bar_off: Reg, parity: Reg, stages: int) -> None:
    """bar_off <- the next of `stages` barriers (8 bytes apart); the parity flips on the wrap."""
    nxt = b.add(bar_off, MBARRIER_BYTES)
    wrap = b.setp("eq", nxt, stages * MBARRIER_BYTES)
    b.mov(b.selp(0, nxt, wrap, U32), out=bar_off)
    b.xor(parity, b.selp(1, 0, wrap, U32), out=parity)


def run_latent_tma_pipeline(b: KernelBuilder, *, stages: int, kv_bytes: int, kv_smem: Reg,
                            bars: Reg, leader: Reg, issuer: Reg | None, n_tiles: Reg, n_full: Reg,
                            key0_of, copy_tile, math, transform=None, lo_full: Reg | None = None,
                            q_landed=None, last_v_landed=None, landed=None) -> None:
    """wgmma_pipeline.run_latent_wgmma_pipeline with TMA boxes on mbarriers (MLA's dense latent
    tile on sm_90a): tile t lands in buffer t mod S on full[t mod S], phase t / S. Iteration j
    waits for T(j), issues S(j) from tile j and O += P(j-1)·V(j-1) from tile j-1 together
    (attend_tile), and ends in a barrier (every warp's wgmma.wait_group 0 retired its reads of
    tile j-1) after which tile j-1's buffer and barrier take T(j+S-1): S-1 tiles in flight
    while two are read, one more than the cp.async loop, whose refill has to wait for the
    barrier at the top of the next iteration. `copy_tile("k", t, dst, bar)` issues tile t's
    boxes (by `issuer` threads, each its share, or by `leader`, which always arrives with the
    whole expect_tx); the Q tile comes another way (`q_landed()` waits for it).
    `last_v_landed(tile)` may rewrite the last tile's rows before the P·V after the loop (the
    loop's last barrier has retired every read of it). Barriers: `bars` holds S of them.
    With `landed(t, stage)` the stages are FP8 staging buffers: _run_staged_latent_tma."""
    S = stages
    assert S >= 2, "the latent TMA loop reads tiles j-1 and j"
    init_full_barriers(b, leader, bars, S)

    def refill(tile: Reg, off, bar: Addr) -> None:
        refill_phase(b, leader, issuer, kv_bytes=kv_bytes, k_smem=kv_smem, v_smem=kv_smem,
                     n_tiles=n_tiles, copy_tile=copy_tile, k_tile=tile, k_off=off, v_tile=None,
                     v_off=0, bar=bar)

    if landed is not None:
        _run_staged_latent_tma(b, S, kv_bytes, bars, refill, n_tiles, n_full, key0_of, math,
                               transform, lo_full, q_landed, last_v_landed, landed)
        return

    for s in range(S - 1):                                   # T(0) .. T(S-2)
        refill(b.mov(s, U32), s * kv_bytes, Addr(bars, s * MBARRIER_BYTES))
    if q_landed is not None:
        q_landed()
    stage = b.mov(0, U32)                       # tile j's buffer offset
    prev = b.mov((S - 1) * kv_bytes, U32)       # tile j-1's: refilled with T(j+S-1)
    bar_off = b.mov(0, U32)                     # full[j mod S], its phase's parity
    prev_bar = b.mov((S - 1) * MBARRIER_BYTES, U32)
    parity = b.mov(0, U32)
    with b.for_range(0, n_tiles) as j:
        b.mbarrier_wait_parity(Addr(b.add(bars, bar_off)), parity)            # T(j) landed
        attend_tile(b, math, kv_smem, stage, kv_smem, prev, j, key0_of, transform, n_full, lo_full)
        b.bar_sync(0)                      # every warp's reads of tile j-1 retired
        refill(b.add(j, S - 1), prev, Addr(b.add(bars, prev_bar)))
        advance_stage(b, stage, prev, kv_bytes, S)
        b.mov(bar_off, out=prev_bar)
        advance_barrier(b, bar_off, parity, S)
    with b.if_then(b.setp("gt", n_tiles, 0)):           # O += P(n-1)·V(n-1)
        if last_v_landed is not None:
            last_v_landed(b.add(kv_smem, prev))
        math.issue_pv(b.add(kv_smem, prev))
        math.pv_done()
    b.bar_sync(0)        # the Q tile's readers, before the epilogue


def _run_staged_latent_tma(b: KernelBuilder, S: int, stage_bytes: int, bars: Reg, refill,
                           n_tiles: Reg, n_full: Reg, key0_of, math, transform, lo_full,
                           q_landed, last_v_landed, landed) -> None:
    """The latent TMA loop over FP8 staging buffers (wgmma_pipeline._run_staged_latent's
    schedule): T(t) lands raw in stage t mod S on full[t mod S] and is converted into one of two
    alternating f16/bf16 tiles (`landed` returns it). Iteration j: wait for T(j); a barrier
    (every warp past iteration j-1, whose P·V(j-2) read the converted tile T(j) now
    overwrites); the conversion; a barrier and fence.proxy.async (tile j complete for the
    tensor cores, T(j)'s stage read by all: it takes T(j+S) at once); attend_tile over tiles j
    and j-1. S tiles are in flight from the prologue on. The last tile's rows may be rewritten
    by `last_v_landed` once every warp is past its S (a barrier first)."""
    for s in range(S):                                          # T(0) .. T(S-1)
        refill(b.mov(s, U32), s * stage_bytes, Addr(bars, s * MBARRIER_BYTES))
    if q_landed is not None:
        q_landed()
    stage = b.mov(0, U32)
    prev = b.mov(0, U32)                 # advance_stage's register pair (T(j-1)'s stage)
    prev_tile = b.mov(0, U32)            # the converted tile j-1 (unread at j = 0)
    bar_off = b.mov(0, U32)
    parity = b.mov(0, U32)
    with b.for_range(0, n_tiles) as j:
        bar = Addr(b.add(bars, bar_off))
        b.mbarrier_wait_parity(bar, parity)                                # T(j) landed
        b.bar_sync(0)
        tile = landed("k", stage)
        b.bar_sync(0)
        b.fence_proxy_async()
        refill(b.add(j, S), stage, bar)
        attend_tile(b, math, tile, 0, prev_tile, 0, j, key0_of, transform, n_full, lo_full)
        b.mov(tile, out=prev_tile)
        advance_stage(b, stage, prev, stage_bytes, S)
        advance_barrier(b, bar_off, parity, S)
    with b.if_then(b.setp("gt", n_tiles, 0)):           # O += P(n-1)·V(n-1)
        if last_v_landed is not None:
            b.bar_sync(0)                # every warp's S(n-1) read the tile before it is rewritten
            last_v_landed(prev_tile)
        math.issue_pv(prev_tile)
        math.pv_done()
    b.bar_sync(0)
