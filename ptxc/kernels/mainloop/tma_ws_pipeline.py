"""The warp-specialised K/V tile loop of the sm_90a TMA prefill and of varlen's packed tile
(tile.warp_specialize = true; the packed tile's differences are run_tma_ws_pipeline's options):
tma_pipeline.py's schedule with its copies moved to a producer warpgroup and the CTA barrier
of each iteration replaced by `empty[]` mbarriers (FlashAttention-3's producer/consumer split,
hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp).

  CTA        C = block_m / 64 consumer warpgroups (warps 0 .. 4C-1: warp w keeps query rows
             [16w, 16w + 16), so WgmmaMath and its epilogue are unchanged), then one producer
             warpgroup (warps 4C .. 4C+3): 128 (C + 1) threads.
  registers  after the common prologue the producer gives registers back (setmaxnreg.dec to
             PRODUCER_REGS) and the consumers take them (setmaxnreg.inc to consumer_regs(C));
             .maxntid 128 (C + 1) fixes the count every warp starts with.
  producer   the producer's first warp (one elected lane arriving and issuing) issues Q on its
             barrier, the first S refills, then for i = S .. n_tiles: wait empty[i mod S] (the
             consumers are done with K(i-S) and V(i-S-1)), refill B(i-S) = {K(i), V(i-1)} on
             full[i mod S] -- the phases tma_pipeline.py's single thread issues -- and exits.
             The other 96 threads exit after setmaxnreg.
  consumers  A(j) of tma_pipeline.py; once wgmma.wait_group 0 has retired the reads of K(j)
             and V(j-1), lane 0 of every consumer warp arrives on empty[j mod S] (arrival count
             4C), which is all the loop synchronises: no CTA barrier. After the loop they meet on
             named barrier 1 (128 C threads; the producer may have exited, and a whole-CTA
             bar.sync must not count on exited threads) before the epilogue stages O over Q, and
             the epilogue's own barrier is that named barrier too (WgmmaMath.cta_sync).

Ping-pong (tile.pingpong, two consumer warpgroups; FlashAttention-3's warp scheduler barriers):
the consumers take turns issuing their wgmma (S(j) and O += P(j-1)·V(j-1)), so that one
warpgroup's softmax runs while the other's products occupy the tensor cores. Warpgroup g waits
on named barrier PINGPONG_BARRIERS[g] (256 threads) before its issues and arrives on the other's
after them (Turns). Warpgroup 1 primes warpgroup 0's first turn and skips the arrival after its
last one (the final P·V), so each barrier sees as many arrivals as waits: n + 1 turns each.

Barriers: full[0 .. S) and Q (arrival count 1, as in tma_pipeline.py), then empty[0 .. S)
(arrival count 4C). Phase k of empty[s] completes when every consumer warp has finished tile
j = kS + s, the producer's wait for refill i = j + S uses parity (j / S) & 1. Memory model:
the arrive (release, CTA scope) after wgmma.wait_group 0 orders the warp's completed async-proxy
reads of the buffers before the producer's try_wait (acquire) and its TMA writes into them --
the WAR ordering CUTLASS's PipelineTmaAsync relies on (consumer_release after warpgroup_wait).
"""

from __future__ import annotations

import contextlib

from ...ir import U32, Addr, KernelBuilder, Reg
from .kv_pipeline import StageRing
from .tma_pipeline import MBARRIER_BYTES, advance_barrier, issue_refill, refill_phase
from .wgmma_pipeline import attend_tile

PRODUCER_THREADS = 128
CONSUMER_BARRIER = 1      # named barrier of the consumer warpgroups (0 is the whole CTA's)
PINGPONG_BARRIERS = (2, 3)   # warpgroup g's turn (tile.pingpong)
REGISTER_FILE = 65536     # 32-bit registers per SM (sm_90, sm_100)


def entry_regs(threads: int, ctas: int = 1) -> int:
    """ptxas's register count at entry under .minnctapersm `ctas` (which every kernel that
    moves registers carries): the file's share in multiples of 8, at most 255 (256 threads at
    one CTA an SM: 255)."""
    return min(255, REGISTER_FILE // (threads * ctas) // 8 * 8)


def raised_regs(threads: int, kept: int, raised_threads: int, ctas: int = 1) -> int:
    """The budget setmaxnreg.inc can give `raised_threads` threads: the CTA's pool is what it
    started with (threads x the entry count, allocated in granules of 8) less the registers
    the other warpgroups keep (`kept`, in all) -- an .inc takes only what a .dec released, and
    one asking more waits for ever. In multiples of 8, at most 256."""
    held = -(-entry_regs(threads, ctas) // 8) * 8
    return min(256, (threads * held - kept) // raised_threads // 8 * 8)


def producer_regs(consumers: int) -> int:
    """The producer's budget after setmaxnreg.dec: its loop needs few registers; with one
    consumer warpgroup the file has room to spare (FlashAttention-3: 24 for two consumer
    warpgroups, 56 for one)."""
    return 24 if consumers > 1 else 56


def consumer_regs(consumers: int, ctas: int = 1) -> int:
    """The consumers' budget after setmaxnreg.inc: what the producer leaves of the CTA's
    pool (two consumer warpgroups at one CTA an SM: 240, as FlashAttention-3's 24 / 240 at 168
    on entry; the packed tile's one consumer warpgroup at two CTAs an SM: 200 of 128)."""
    threads = PRODUCER_THREADS + 128 * consumers
    return raised_regs(threads, PRODUCER_THREADS * producer_regs(consumers), 128 * consumers, ctas)


class Turns:
    """Two consumer warpgroups taking turns at issuing their wgmma (see the module docstring):
    begin() waits for this warpgroup's turn, end() hands it to the other; the final turn (the
    last P·V) of warpgroup 1 hands nothing on."""

    def __init__(self, b: KernelBuilder, warp: Reg, n_tiles: Reg):
        self.b = b
        self.second = b.setp("ge", warp, 4)                 # warpgroup 1 (warps 4..7)
        with b.if_then(b.and_(self.second, b.setp("gt", n_tiles, 0))):
            b.bar_arrive(PINGPONG_BARRIERS[0], 256)        # warpgroup 0 goes first

    def _each(self, first, second) -> None:
        with self.b.if_then(self.second):
            second()
        with self.b.else_():
            first()

    def begin(self) -> None:
        b = self.b
        self._each(lambda: b.bar_sync(PINGPONG_BARRIERS[0], 256),
                   lambda: b.bar_sync(PINGPONG_BARRIERS[1], 256))

    def end(self, final: bool = False) -> None:
        """After this warpgroup's issues; `final`: the last turn (warpgroup 1 hands nothing on)."""
        b = self.b
        self._each(lambda: b.bar_arrive(PINGPONG_BARRIERS[1], 256),
                   (lambda: None) if final else lambda: b.bar_arrive(PINGPONG_BARRIERS[0], 256))


def issue_loads(b: KernelBuilder, *, stages: int, kv_bytes: int, v_bytes: int, q_bytes: int,
                q_smem: Reg, k_smem: Reg, v_smem: Reg, bars: Reg, n_tiles: Reg,
                copy_tile, warp_wide: bool = False, leader: Reg | None = None,
                issuer: Reg | None = None) -> None:
    """The producer thread's whole loop (the barriers' layout as in the module docstring): Q
    on its barrier, refills B(-S) .. B(-1), then for i = S .. n_tiles: wait empty[i mod S]
    and refill B(i - S) = {K(i), V(i - 1)} on full[i mod S]. With `warp_wide` a whole warp
    runs it and one elected lane arrives and issues the copies; with `leader` and `issuer`
    (predicates over a warp that runs it whole) the leader arrives with each phase's
    expect_tx and every issuer issues its share of copy_tile's boxes (tma_pipeline's
    refill_phase)."""
    S = stages
    full = lambda s: Addr(bars, s * MBARRIER_BYTES)                      # noqa: E731
    q_bar, empty0 = full(S), (S + 1) * MBARRIER_BYTES

    def issue():
        if leader is not None:
            return b.if_then(leader)
        return b.if_then(b.elect_sync()) if warp_wide else contextlib.nullcontext()

    def refill(k_tile: Reg, k_off, v_tile: Reg | None, v_off, bar: Addr) -> None:
        phase = dict(kv_bytes=kv_bytes, k_smem=k_smem, v_smem=v_smem, n_tiles=n_tiles,
                     copy_tile=copy_tile, k_tile=k_tile, k_off=k_off, v_tile=v_tile,
                     v_off=v_off, bar=bar, v_bytes=v_bytes)
        if leader is not None:
            refill_phase(b, leader, issuer, **phase)
            return
        with issue():
            issue_refill(b, **phase)

    with issue():
        b.mbarrier_arrive_expect_tx(q_bar, q_bytes)
        copy_tile("q", None, q_smem, q_bar)
    for s in range(S):                                                   # B(-S) .. B(-1)
        refill(b.mov(s, U32), s * kv_bytes, b.mov(s - 1, U32) if s else None,
               (s - 1) * v_bytes, full(s))
    ring = StageRing(b, S, kv_bytes, v_bytes)   # buffer offsets of K(i) and of V(i - 1)
    bar_off = b.mov(0, U32)          # i mod S (x 8 bytes), and the parity of empty's
    parity = b.mov(0, U32)           # phase (i - S) / S
    with b.for_range(S, b.add(n_tiles, 1)) as i:                         # B(i - S)
        b.mbarrier_wait_parity(Addr(b.add(bars, b.add(bar_off, empty0))), parity)
        refill(i, ring.k, b.sub(i, 1), ring.v_prev, Addr(b.add(bars, bar_off)))
        ring.advance()
        advance_barrier(b, bar_off, parity, S)


def init_barriers(b: KernelBuilder, tid: Reg, bars: Reg, stages: int, consumers: int,
                  q_empty: Addr | None = None) -> None:
    """Thread 0 initialises full[0 .. S) and Q's (arrival count 1), empty[0 .. S) (4C: every
    consumer warp) and a persistent CTA's q_empty (1), fenced for the TMA's complete_tx; then
    the kernel's one whole-CTA barrier (every thread is still there)."""
    with b.if_then(b.setp("eq", tid, 0)):
        for s in range(stages + 1):
            b.mbarrier_init(Addr(bars, s * MBARRIER_BYTES), 1)
        for s in range(stages):
            b.mbarrier_init(Addr(bars, (stages + 1 + s) * MBARRIER_BYTES), 4 * consumers)
        if q_empty is not None:
            b.mbarrier_init(q_empty, 1)
        b.fence_proxy_async()
    b.bar_sync(0)


def run_tma_ws_pipeline(b: KernelBuilder, *, stages: int, consumers: int, kv_bytes: int,
                        q_bytes: int, q_smem: Reg, k_smem: Reg, v_smem: Reg, bars: Reg, tid: Reg,
                        lane: Reg, n_tiles: Reg, n_full: Reg, key0_of, copy_tile, make_math,
                        transform_of, lo_full: Reg | None = None,
                        v_bytes: int | None = None, pingpong: bool = False,
                        ctas_per_sm: int = 1, issue_setup=None,
                        last_v_landed=None, uniform_roles: bool = False) -> None:
    """run_tma_pipeline's arguments (see there) for a CTA of `consumers` warpgroups and a
    producer after them; `make_math()` builds the consumers' WgmmaMath inside their branch,
    after setmaxnreg.inc (its accumulators would otherwise be live under the launch budget:
    ptxas spills them at d128), and `transform_of(math)` gives its score transform (or None);
    its epilogue ends the branch. `pingpong` (two consumer warpgroups): they take turns at
    issuing their wgmma (Turns).

    For the GQA-packed tile (varlen_tma.py): `ctas_per_sm` 2 (its .minnctapersm: the budgets
    are shares of a CTA's pool at 128 registers on entry); `issue_setup()` -> (copy_tile,
    leader, issuer), built in the producer's first warp, shares a tile's boxes among its lanes
    (leader arrives with the expect_tx); and
    `last_v_landed(v_addr)` runs on the consumers once the last V tile landed, before the P·V
    that reads it (they may rewrite it: the rows past the sequence's end; the hook ends with
    their named barrier). `uniform_roles`: the roles by the warp index lane 0 holds (a shfl),
    which ptxas proves warp-uniform -- the packed tile needs it: with `tid >= 128 C` ptxas took
    its consumers' branch for a divergent path and serialised their wgmma (C7519)."""
    S, C = stages, consumers
    assert not pingpong or C == 2, "ping-pong takes two consumer warpgroups"
    v_bytes = kv_bytes if v_bytes is None else v_bytes
    full = lambda s: Addr(bars, s * MBARRIER_BYTES)                      # noqa: E731
    q_bar = full(S)
    empty0 = (S + 1) * MBARRIER_BYTES
    init_barriers(b, tid, bars, S, C)

    producer = b.setp("ge", tid, 128 * C)
    if uniform_roles:    # the warp index as lane 0 holds it: a value ptxas proves warp-uniform
        producer = b.setp("ge", b.shfl("idx", b.shr(tid, 5), 0), 4 * C)
    with b.if_then(producer):                                            # the producer
        b.setmaxnreg(False, producer_regs(C))
        # its first warp runs the loop (warp-uniform for ptxas: no loop over the lanes around
        # each TMA box), one elected lane issuing -- or its lanes sharing the boxes
        warp = b.shfl("idx", b.shr(tid, 5), 0)
        with b.if_then(b.setp("eq", warp, 4 * C)):
            issuing = dict(copy_tile=copy_tile, warp_wide=True)
            if issue_setup is not None:
                tile_copy, leader, issuer = issue_setup()
                issuing = dict(copy_tile=tile_copy, leader=leader, issuer=issuer)
            issue_loads(b, stages=S, kv_bytes=kv_bytes, v_bytes=v_bytes, q_bytes=q_bytes,
                        q_smem=q_smem, k_smem=k_smem, v_smem=v_smem, bars=bars,
                        n_tiles=n_tiles, **issuing)
    with b.else_():                                                      # the consumers
        b.setmaxnreg(True, consumer_regs(C, ctas_per_sm))
        math = make_math()
        transform = transform_of(math)
        first_lane = b.setp("eq", lane, 0)
        turns = Turns(b, b.shr(tid, 5), n_tiles) if pingpong else None
        ring = StageRing(b, S, kv_bytes, v_bytes)
        bar_off = b.mov(0, U32)
        parity = b.mov(0, U32)
        b.mbarrier_wait_parity(q_bar, 0)
        with b.for_range(0, n_tiles) as j:
            b.mbarrier_wait_parity(Addr(b.add(bars, bar_off)), parity)  # A(j)

            def release() -> None:       # K(j), V(j-1) read: the producer may refill them
                with b.if_then(first_lane):
                    b.mbarrier_arrive(Addr(b.add(bars, b.add(bar_off, empty0))))

            attend_tile(b, math, k_smem, ring.k, v_smem, ring.v_prev, j, key0_of, transform, n_full,
                        lo_full, reads_done=release, turn=turns)
            ring.advance()
            advance_barrier(b, bar_off, parity, S)
        with b.if_then(b.setp("gt", n_tiles, 0)):       # O += P(n-1)·V(n-1)
            b.mbarrier_wait_parity(Addr(b.add(bars, bar_off)), parity)
            if last_v_landed is not None:
                last_v_landed(b.add(v_smem, ring.v_prev))
            if turns is not None:
                turns.begin()
            math.issue_pv(b.add(v_smem, ring.v_prev))
            if turns is not None:
                turns.end(final=True)
            math.pv_done()
        b.bar_sync(CONSUMER_BARRIER, 128 * C)   # every consumer done with Q before O goes there
        math.epilogue()


def run_persistent_ws_pipeline(b: KernelBuilder, *, stages: int, consumers: int, kv_bytes: int,
                               v_bytes: int, q_bytes: int, bars: Reg, tid: Reg, lane: Reg, tiles,
                               work, o_apart: bool, pingpong: bool = False,
                               store_reads=None) -> None:
    """run_tma_ws_pipeline over a persistent CTA's work tiles (tile.persistent): `tiles` (a
    prefill_tile.PersistentTiles) gives the CTA's tiles t, `work(t)` what a role needs of tile
    t (its n_tiles, n_full, lo_full, key0_of, copy_tile, q/k/v regions, and `math()`: the
    consumers' WgmmaMath with its transform, built where it is called).

    Both roles walk the same stream of refill phases across tiles: tile t with n > 0 key
    tiles takes n + 1 phases (phase i brings K(i) if i < n and V(i - 1) if i > 0, at the ring's
    next stage), so bar_off, the parities and the stage offsets run on from tile to tile, and the
    consumers release every phase, the last P·V's too. The producer's first lap of empty[]
    waits on parity 1, which a fresh mbarrier reports complete (its "previous" phase), so no
    prologue is special. Q: a full barrier (the producer's expect_tx, parity = the tile count's)
    and q_empty (arrival count 1): a consumer thread arrives once every consumer is done with Q --
    after the loop when O is staged apart (`o_apart`: the next Q then lands during this epilogue),
    after the epilogue when O is staged over Q -- and the producer waits on it before each Q box
    (its first wait passes the same way). `store_reads()` (O's TMA stores left in flight by the
    epilogue, store_wait_deferred) is what thread 0 runs before the consumers' barrier that
    precedes each epilogue, and after the last tile: the boxes of tile t are read while tile
    t + 1's loop runs."""
    S, C = stages, consumers
    full = lambda s: Addr(bars, s * MBARRIER_BYTES)                      # noqa: E731
    q_full, empty0 = full(S), (S + 1) * MBARRIER_BYTES
    q_empty = Addr(bars, (2 * S + 1) * MBARRIER_BYTES)
    init_barriers(b, tid, bars, S, C, q_empty)

    with b.if_then(b.setp("ge", tid, 128 * C)):                          # the producer
        b.setmaxnreg(False, producer_regs(C))
        warp = b.shfl("idx", b.shr(tid, 5), 0)
        with b.if_then(b.setp("eq", warp, 4 * C)):
            ring = StageRing(b, S, kv_bytes, v_bytes)
            bar_off, parity, q_parity = b.mov(0, U32), b.mov(1, U32), b.mov(1, U32)
            with tiles.loop() as t:
                w = work(t)
                b.mbarrier_wait_parity(q_empty, q_parity)      # the consumers are done with Q
                b.xor(q_parity, 1, out=q_parity)
                with b.if_then(b.elect_sync()):
                    b.mbarrier_arrive_expect_tx(q_full, q_bytes)
                    w.copy_tile("q", None, w.q_smem, q_full)
                with b.if_then(b.setp("gt", w.n_tiles, 0)):
                    with b.for_range(0, b.add(w.n_tiles, 1)) as i:       # phase i of the tile
                        b.mbarrier_wait_parity(Addr(b.add(bars, b.add(bar_off, empty0))), parity)
                        with b.if_then(b.elect_sync()):
                            issue_refill(b, kv_bytes=kv_bytes, k_smem=w.k_smem, v_smem=w.v_smem,
                                         n_tiles=w.n_tiles, copy_tile=w.copy_tile, k_tile=i,
                                         k_off=ring.k, v_tile=b.sub(i, 1), v_off=ring.v_prev,
                                         bar=Addr(b.add(bars, bar_off)), v_bytes=v_bytes)
                        ring.advance()
                        advance_barrier(b, bar_off, parity, S)
    with b.else_():                                                      # the consumers
        b.setmaxnreg(True, consumer_regs(C))
        first_lane = b.setp("eq", lane, 0)
        ring = StageRing(b, S, kv_bytes, v_bytes)
        bar_off, parity, q_parity = b.mov(0, U32), b.mov(0, U32), b.mov(0, U32)

        def release() -> None:           # this phase's tiles read: the producer may refill them
            with b.if_then(first_lane):
                b.mbarrier_arrive(Addr(b.add(bars, b.add(bar_off, empty0))))

        def release_q() -> None:         # every consumer is past its last read of Q (or O)
            with b.if_then(b.setp("eq", tid, 0)):
                b.mbarrier_arrive(q_empty)

        with tiles.loop() as t:
            w = work(t)
            math, transform = w.math()
            turns = Turns(b, b.shr(tid, 5), w.n_tiles) if pingpong else None
            b.mbarrier_wait_parity(q_full, q_parity)
            b.xor(q_parity, 1, out=q_parity)
            with b.for_range(0, w.n_tiles) as j:
                b.mbarrier_wait_parity(Addr(b.add(bars, bar_off)), parity)   # A(j)
                attend_tile(b, math, w.k_smem, ring.k, w.v_smem, ring.v_prev, j, w.key0_of,
                            transform, w.n_full, w.lo_full, reads_done=release, turn=turns)
                ring.advance()
                advance_barrier(b, bar_off, parity, S)
            with b.if_then(b.setp("gt", w.n_tiles, 0)):      # O += P(n-1)·V(n-1), phase n
                b.mbarrier_wait_parity(Addr(b.add(bars, bar_off)), parity)
                if turns is not None:
                    turns.begin()
                math.issue_pv(b.add(w.v_smem, ring.v_prev))
                if turns is not None:
                    turns.end(final=True)
                math.pv_done()
                release()
                ring.advance()
                advance_barrier(b, bar_off, parity, S)
            # Q was read by wgmma only, but a variant may have rewritten it in place (generic
            # writes, q_rescale) and the epilogue stages O with generic stores: fenced for the
            # TMA that writes the next Q there
            b.fence_proxy_async()
            if store_reads is not None:              # the last tile's O boxes read: O is free
                with b.if_then(b.setp("eq", tid, 0)):
                    store_reads()
            b.bar_sync(CONSUMER_BARRIER, 128 * C)   # every consumer done with Q
            if o_apart:
                release_q()
            math.epilogue()
            if not o_apart:                          # O was staged over Q: done with it too
                b.fence_proxy_async()
                b.bar_sync(CONSUMER_BARRIER, 128 * C)
                release_q()
        if store_reads is not None:                  # the CTA's shared memory outlives them
            with b.if_then(b.setp("eq", tid, 0)):
                store_reads()
