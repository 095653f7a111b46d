"""The attention kernel assembler: every attention body (prefill's, the GQA-packed tile of
varlen, decode's tensor-core path and MLA, and decode's SIMT rows) ends in `assemble`, which
runs one main loop from the table below over the pieces the body composed:

  KeyTiles   the scheduler's answer: which key tiles the CTA visits and which of them need the
             mask (prefill_cp_async.setup, attention/packed_tile.packed_tile_setup); decode's
             SIMT rows: KeyRows (mainloop/row_pipeline.py), its row range
  Buffers    where Q and the K/V stages live in shared memory (and the TMA loops' mbarriers)
  Loads      how a tile reaches shared memory: copies by the threads (`load_kv`, cp.async or
             plain loads) or TMA boxes (`copy_tile`), with the layout's hooks (FP8 staging,
             a gathered Q, a zeroed V tail)
  math       the fragment math (math/: SimtMath, MmaMath, WgmmaMath, Tcgen05Math, or a packed
             tile's Varlen* with its per-row epilogue), given as a factory: the
             warp-specialised loops build it inside their consumer branch
  transform  the variant's score transform through the math (soft-cap, ALiBi), or None

Main loops, one per load method (mainloop/):

  cp_async     kv_pipeline.run_kv_pipeline: threads' copies, a K and a V tile per stage
  latent       kv_pipeline.run_shared_kv_pipeline: one latent tile per stage read by both
               products (MLA)
  wgmma        wgmma_pipeline.run_wgmma_pipeline: threads' copies under wgmma's overlap
  latent_wgmma wgmma_pipeline.run_latent_wgmma_pipeline: the same overlap over one latent tile
               per stage (MLA on sm_90a)
  tma          tma_pipeline.run_tma_pipeline: TMA boxes on full mbarriers, one issuing CTA
  latent_tma   tma_pipeline.run_latent_tma_pipeline: the latent_wgmma overlap with the latent
               tiles as TMA boxes (MLA's dense latent cache on sm_90a)
  latent_seesaw seesaw_pipeline.run_seesaw_pipeline: MLA's latent TMA tile with the two
               warpgroups taking alternate tiles' softmax (FlashMLA's seesaw, tile.seesaw)
  latent_dequant dequant_pipeline.run_dequant_pipeline: MLA's FP8 rows copied and converted by
               a warpgroup of their own, the latent_wgmma loop on the converted tiles
  tma_ws       tma_ws_pipeline.run_tma_ws_pipeline: a producer warpgroup, consumer warpgroups
  tcgen05_ws   tcgen05_ws_pipeline.run_tcgen05_ws_pipeline: load, MMA and softmax warps
  rows         row_pipeline.run_row_pipeline: decode's SIMT rows, register loads or each
               thread's cp.async slots

The body picks the loop its config names (a path table's entry); what differs between bodies
is only what they compose: the layout's loads and the math.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ...ir import KernelBuilder, Reg
from ..mainloop.kv_pipeline import run_kv_pipeline, run_shared_kv_pipeline
from ..mainloop.row_pipeline import KeyRows, run_row_pipeline
from ..mainloop.dequant_pipeline import run_dequant_pipeline
from ..mainloop.tcgen05_ws_pipeline import run_tcgen05_ws_pipeline
from ..mainloop.seesaw_pipeline import run_seesaw_pipeline
from ..mainloop.tma_pipeline import run_latent_tma_pipeline, run_tma_pipeline
from ..mainloop.tma_ws_pipeline import run_tma_ws_pipeline
from ..mainloop.wgmma_pipeline import run_latent_wgmma_pipeline, run_wgmma_pipeline


@dataclass(frozen=True)
class KeyTiles:
    """Loop tile j (0 <= j < n_tiles) starts at key `key0_of(j)`; tiles j >= n_full cross the
    end of the keys or the causal diagonal and j < lo_full (a sliding window) its left edge:
    those take the mask. `mask_of(j)` -> (first key, pred) replaces both for a packed custom
    mask's visit order (mask_tiles.py)."""

    n_tiles: Reg
    n_full: Reg
    key0_of: Callable
    lo_full: Reg | None = None
    mask_of: Callable | None = None


@dataclass(frozen=True)
class Buffers:
    """`stages` K and V stage buffers at k and v (strides k_bytes, v_bytes: None is k_bytes),
    the Q tile at q (q_bytes by TMA, 0 when the threads copy it), the TMA loops' mbarriers at
    `bars` (and tcgen05's MMA barriers at `mma_bars`)."""

    stages: int
    q: Reg
    k: Reg
    v: Reg
    k_bytes: int
    v_bytes: int | None = None
    q_bytes: int = 0
    bars: Reg | None = None
    mma_bars: Reg | None = None


@dataclass(frozen=True)
class Loads:
    """Threads' copies: `load_kv(t, j, stage_offset)` copies tile j of t ("k" | "v") if it
    exists and commits one cp.async group (`use_async`; plain loads below sm_80); `landed(t,
    stage)` converts a staged raw tile after its wait (FP8 bytes). TMA: `copy_tile(t, j, dst,
    bar)` issues tile j's boxes, called by `leader` (or each `issuer` for its share); hooks
    `q_landed()` (a Q tile the threads copied) and `last_v_landed(v_tile)` (the V tail rewritten
    before the last P·V). A load warp whose lanes share the boxes (tcgen05_ws):
    `issue_setup()` -> (copy_tile, leader, issuer), run by that warp. Decode's SIMT rows: `rows`
    (decode_attend.RowLoader) and `read`."""

    load_kv: Callable | None = None
    copy_tile: Callable | None = None
    use_async: bool = True
    landed: Callable | None = None
    leader: Reg | None = None
    issuer: Reg | None = None
    q_landed: Callable | None = None
    last_v_landed: Callable | None = None
    issue_setup: Callable | None = None
    rows: object | None = None       # decode's SIMT rows: fetch(rows, put), advance(fresh)
    read: Callable | None = None     # ... and a chunk's register load, read(addr, pred)
    scores_from: Callable | None = None   # latent on mma.sync: where S reads a stage's tile


def _cp_async(b, buf: Buffers, tiles: KeyTiles, loads: Loads, math, transform_of, **_):
    m = math()
    run_kv_pipeline(b, stages=buf.stages, kv_bytes=buf.k_bytes, k_smem=buf.k, v_smem=buf.v,
                    use_async=loads.use_async, n_tiles=tiles.n_tiles, n_full=tiles.n_full,
                    key0_of=tiles.key0_of, load_kv=loads.load_kv, math=m, transform=transform_of(m),
                    lo_full=tiles.lo_full, landed=loads.landed, mask_of=tiles.mask_of,
                    q_landed=loads.q_landed)
    return m


def _latent_tile(run):
    """The adapter of a loop over one latent tile per stage (run_shared_kv_pipeline on mma.sync,
    run_latent_wgmma_pipeline on wgmma: the same arguments)."""
    def adapter(b, buf: Buffers, tiles: KeyTiles, loads: Loads, math, transform_of, **_):
        assert tiles.mask_of is None, "a latent cache takes no packed mask"
        m = math()
        staged = {} if loads.scores_from is None else {"scores_from": loads.scores_from}
        run(b, stages=buf.stages, kv_bytes=buf.k_bytes, kv_smem=buf.k, n_tiles=tiles.n_tiles,
            n_full=tiles.n_full, key0_of=tiles.key0_of, load_kv=loads.load_kv, math=m,
            transform=transform_of(m), lo_full=tiles.lo_full, landed=loads.landed,
            q_landed=loads.q_landed, **staged)
        return m
    return adapter


def _wgmma(b, buf: Buffers, tiles: KeyTiles, loads: Loads, math, transform_of, **_):
    assert tiles.mask_of is None, "packed masks keep the mma.sync kernel (config/wgmma.uses_wgmma)"
    m = math()
    run_wgmma_pipeline(b, stages=buf.stages, kv_bytes=buf.k_bytes, v_bytes=buf.v_bytes,
                       k_smem=buf.k, v_smem=buf.v, n_tiles=tiles.n_tiles, n_full=tiles.n_full,
                       key0_of=tiles.key0_of, load_kv=loads.load_kv, math=m,
                       transform=transform_of(m), lo_full=tiles.lo_full, landed=loads.landed,
                       q_landed=loads.q_landed)
    return m


def _tma(b, buf: Buffers, tiles: KeyTiles, loads: Loads, math, transform_of, **_):
    m = math()
    run_tma_pipeline(b, stages=buf.stages, kv_bytes=buf.k_bytes, v_bytes=buf.v_bytes,
                     q_bytes=buf.q_bytes, q_smem=buf.q, k_smem=buf.k, v_smem=buf.v, bars=buf.bars,
                     leader=loads.leader, n_tiles=tiles.n_tiles, n_full=tiles.n_full,
                     key0_of=tiles.key0_of, copy_tile=loads.copy_tile, math=m,
                     transform=transform_of(m), lo_full=tiles.lo_full, q_landed=loads.q_landed,
                     last_v_landed=loads.last_v_landed, issuer=loads.issuer)
    return m


def _latent_tma(b, buf: Buffers, tiles: KeyTiles, loads: Loads, math, transform_of, **_):
    assert tiles.mask_of is None, "a latent cache takes no packed mask"
    m = math()
    run_latent_tma_pipeline(b, stages=buf.stages, kv_bytes=buf.k_bytes, kv_smem=buf.k, bars=buf.bars,
                            leader=loads.leader, issuer=loads.issuer, n_tiles=tiles.n_tiles,
                            n_full=tiles.n_full, key0_of=tiles.key0_of, copy_tile=loads.copy_tile,
                            math=m, transform=transform_of(m), lo_full=tiles.lo_full,
                            q_landed=loads.q_landed, last_v_landed=loads.last_v_landed,
                            landed=loads.landed)
    return m


def _latent_seesaw(b, buf: Buffers, tiles: KeyTiles, loads: Loads, math, transform_of, *,
                   second: Reg, refill: Callable, exchange: Callable):
    """`refill(t, offset, bar)`: the calling warpgroup's load of tile t; `exchange(math)`: its
    SeesawExchange; the Loads' last_v_landed zeroes the V tail by one warpgroup's threads."""
    assert tiles.mask_of is None, "a latent cache takes no packed mask"
    m = math()
    run_seesaw_pipeline(b, kv_bytes=buf.k_bytes, kv_smem=buf.k, bars=buf.bars, leader=loads.leader,
                        second=second, n_tiles=tiles.n_tiles, n_full=tiles.n_full,
                        key0_of=tiles.key0_of, refill=refill, math=m, exchange=exchange(m),
                        transform=transform_of(m), lo_full=tiles.lo_full,
                        q_landed=loads.q_landed, tail=loads.last_v_landed)
    return m


def _tma_ws(b, buf: Buffers, tiles: KeyTiles, loads: Loads, math, transform_of, *, tid, lane,
            consumers: int, pingpong: bool, ctas_per_sm: int = 1, uniform_roles: bool = False):
    """A producer warpgroup and consumer warpgroups (the packed tile's: its producer's lanes
    sharing the boxes through `loads.issue_setup`, two CTAs an SM)."""
    assert tiles.mask_of is None, "packed masks keep the mma.sync kernel (config/wgmma.uses_wgmma)"
    run_tma_ws_pipeline(b, stages=buf.stages, consumers=consumers, kv_bytes=buf.k_bytes,
                        v_bytes=buf.v_bytes, q_bytes=buf.q_bytes, q_smem=buf.q, k_smem=buf.k,
                        v_smem=buf.v, bars=buf.bars, tid=tid, lane=lane, n_tiles=tiles.n_tiles,
                        n_full=tiles.n_full, key0_of=tiles.key0_of, copy_tile=loads.copy_tile,
                        make_math=math, transform_of=transform_of, lo_full=tiles.lo_full,
                        pingpong=pingpong, ctas_per_sm=ctas_per_sm,
                        issue_setup=loads.issue_setup, last_v_landed=loads.last_v_landed,
                        uniform_roles=uniform_roles)


def _latent_dequant(b, buf: Buffers, tiles: KeyTiles, loads: Loads, math, transform_of, *, tid,
                    lane, threads: int, regs: tuple[int | None, int | None], q_rewrite_of=None,
                    direct=None, before_split=None):
    """MLA's FP8 rows under a dequantising warpgroup: `buf.k` holds the converted tiles
    (`buf.k_bytes` each) and then the staging buffers (`buf.v_bytes` each), `buf.bars` the
    ring's mbarriers; `loads.issue_setup(tid)` builds that warpgroup's (load_kv, convert) in its
    branch, `loads.q_landed()` copies the Q tile in the computing branch; `regs`: the two
    branches' setmaxnreg budgets (None: none); `direct`: the staging ring's base when S reads it
    (kv_fp8_direct.py); `before_split()`: tcgen05's barriers and tensor memory, before the
    branches part."""
    run_dequant_pipeline(b, stages=buf.stages, stage_bytes=buf.v_bytes, tile_bytes=buf.k_bytes,
                         tiles=buf.k, bars=buf.bars, tid=tid, lane=lane, compute_threads=threads,
                         dequant_regs=regs[0], compute_regs=regs[1], n_tiles=tiles.n_tiles,
                         n_full=tiles.n_full, key0_of=tiles.key0_of, make_loads=loads.issue_setup,
                         make_math=math, transform_of=transform_of, copy_q=loads.q_landed,
                         lo_full=tiles.lo_full, q_rewrite_of=q_rewrite_of, direct=direct,
                         before_split=before_split)


def _tcgen05_ws(b, buf: Buffers, tiles: KeyTiles, loads: Loads, math, transform_of, *, tid,
                lane, warp0, columns: int, make_issue, softmax_warps: int = 8, q_tiles: int = 1,
                tile_columns: int = 0, make_correction=None):
    run_tcgen05_ws_pipeline(b, stages=buf.stages, kv_bytes=buf.k_bytes, v_bytes=buf.v_bytes,
                            q_bytes=buf.q_bytes, q_smem=buf.q, k_smem=buf.k, v_smem=buf.v,
                            bars=buf.bars, mma_bars=buf.mma_bars, tid=tid, lane=lane, warp0=warp0,
                            columns=columns, n_tiles=tiles.n_tiles, n_full=tiles.n_full,
                            key0_of=tiles.key0_of, copy_tile=loads.copy_tile, make_math=math,
                            make_issue=make_issue, transform_of=transform_of,
                            lo_full=tiles.lo_full, softmax_warps=softmax_warps,
                            issue_setup=loads.issue_setup, last_v_landed=loads.last_v_landed,
                            q_tiles=q_tiles, tile_columns=tile_columns,
                            make_correction=make_correction)


def _rows(b, buf, tiles: KeyRows, loads: Loads, math, transform_of, *, cfg, tid):
    m = math()       # its variant transform is the row math's own (scores in log2 units)
    run_row_pipeline(b, cfg, tiles, fetch=loads.rows.fetch, advance=loads.rows.advance,
                     read=loads.read, math=m, tid=tid)
    return m


# name -> (b, buffers, tiles, loads, math factory, transform_of, **the loop's own options);
# returns the math whose epilogue follows the loop (None: the loop ran it in its branch)
MAINLOOPS: dict[str, Callable] = {
    "cp_async": _cp_async, "latent": _latent_tile(run_shared_kv_pipeline), "wgmma": _wgmma,
    "latent_wgmma": _latent_tile(run_latent_wgmma_pipeline),
    "tma": _tma, "latent_tma": _latent_tma, "latent_seesaw": _latent_seesaw, "tma_ws": _tma_ws,
    "latent_dequant": _latent_dequant,
    "tcgen05_ws": _tcgen05_ws, "rows": _rows,
}


def assemble(b: KernelBuilder, mainloop: str, *, tiles: KeyTiles | KeyRows, loads: Loads,
             math: Callable, transform_of: Callable, buffers: Buffers | None = None,
             **options) -> None:
    """The K/V main loop `mainloop` (MAINLOOPS) over the pieces, then the math's epilogue."""
    built = MAINLOOPS[mainloop](b, buffers, tiles, loads, math, transform_of, **options)
    if built is not None:
        built.epilogue()


def prebuilt(math) -> Callable:
    """A math built before the loop (where the body's order places it) as assemble's factory."""
    return lambda: math
