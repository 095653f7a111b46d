"""The prefill bodies whose tiles are fed by TMA, after prefill_cp_async.setup: one box per
128-byte column slab, coordinates {64 s, head, row, batch} (innermost first). One body for both
tensor-core generations, the math and the main loop from the config:

  sm_90a wgmma     WgmmaMath; the "tma" loop (one elected thread issues), or with
                   tile.warp_specialize the "tma_ws" loop (a producer warpgroup); with
                   tile.persistent its CTAs take work tiles in turn (emit_persistent_body:
                   tma_ws_pipeline.run_persistent_ws_pipeline, each role placing itself on
                   a tile where it starts it)
  sm_100a tcgen05  Tcgen05Math (its MMA barriers after the TMA ones); the "tma" loop with the
                   math's issuer, or with tile.warp_specialize the "tcgen05_ws" loop (load, MMA
                   and softmax warps; UmmaIssue for the MMA warp)

Math: math/wgmma.py, math/tcgen05.py; loops: bodies/assemble.py."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from ...ir import S32, TMAP, Addr, KernelBuilder, Reg
from ...spec.model import KernelSpec
from ..attention.prefill_tile import Ctx, PersistentTiles
from ..base import LaunchParam, ParamSource
from ..config.tcgen05 import Tcgen05Config
from ..config.wgmma import ROWS_PER_WARPGROUP, WgmmaConfig
from ..mainloop.tiles import SWIZZLE
from ..mainloop.tma_pipeline import barrier_bytes
from ..mainloop.tma_ws_pipeline import run_persistent_ws_pipeline
from ..math.tcgen05 import Correction, Exchange, Tcgen05Math
from ..math.umma import UmmaIssue, mma_region_bytes
from ..math.wgmma import WgmmaMath
from .assemble import Buffers, KeyTiles, Loads, assemble, prebuilt
from .prefill_cp_async import Setup, setup


def emit_body(b: KernelBuilder, spec: KernelSpec, cfg, ptrs, strides, seq_q, seq_k,
              tmaps: dict) -> None:
    """Q, K and V by TMA (tile_copies) into 128-byte-swizzled slabs, the math and main loop
    cfg's generation and tile.warp_specialize name (see the module docstring)."""
    s = setup(b, spec, cfg, ptrs, strides, seq_q, seq_k)
    ctx = s.ctx(spec, cfg, ptrs, strides, seq_q, seq_k)
    if cfg.tma_store:         # O leaves by TMA stores (MmaMath.store_by_tma)
        ctx = dataclasses.replace(ctx, o_tmap=b.tensor_map_address(tmaps["o"]))
    stages, ws = cfg.num_stages, cfg.warp_specialize
    k_bytes, v_bytes = cfg.kv_geom.bytes, cfg.v_geom.bytes
    bars = b.add(s.k_smem, stages * (k_bytes + v_bytes))
    tcgen05 = isinstance(cfg, Tcgen05Config)
    mma_bars = b.add(bars, barrier_bytes(stages, ws)) if tcgen05 else None   # after the TMA ones
    buffers = Buffers(stages, s.smem, s.k_smem, s.v_smem, k_bytes, v_bytes,
                      getattr(cfg, "q_tiles", 1) * cfg.q_geom.bytes, bars, mma_bars)
    math = None if ws else Tcgen05Math(b, ctx, mma_bars) if tcgen05 else WgmmaMath(b, ctx)
    copy_tile, key0_of = tile_copies(b, cfg, s, tmaps)
    pieces = dict(buffers=buffers, tiles=KeyTiles(s.n_tiles, s.n_full, key0_of, s.lo_full),
                  transform_of=s.transform_of)
    if not ws:        # one issuing thread: tcgen05's MMA issuer, or thread 0
        leader = math.issuer if tcgen05 else b.setp("eq", s.tid, 0)
        assemble(b, "tma", loads=Loads(copy_tile=copy_tile, leader=leader), math=prebuilt(math),
                 **pieces)
    elif tcgen05:     # load, MMA and softmax warps (and two Q tiles: tile.q_tiles)
        q_smem = lambda t: b.add(s.smem, t * cfg.q_tile_bytes) if t else s.smem   # noqa: E731

        # tile.correction: each Q tile's softmax warps' hand-over to the correction warps,
        # after the MMA region
        exchange = (b.add(mma_bars, mma_region_bytes(cfg.q_tiles, True)) if cfg.correction
                    else None)

        def exchange_of(tile) -> Reg | None:
            if exchange is None or tile.index == 0:
                return exchange
            return b.add(exchange, tile.index * Exchange.bytes(cfg.num_warps))

        # with two Q tiles and the correction warps (768 threads: ptxas's budget at entry is
        # 80 registers, and it checks each instruction's against it, not setmaxnreg's), the
        # softmax warps move O 8 n8 blocks (32 registers) an instruction at most, the
        # correction warps (48 registers) 4
        two_corrected = cfg.q_tiles > 1 and cfg.correction

        def tile_math(tile) -> Tcgen05Math:
            if cfg.q_tiles == 1:
                return Tcgen05Math(b, ctx, tile.bars, tile.tmem, exchange=exchange)
            return Tcgen05Math(b, tile_ctx(b, ctx, cfg, tile.index, q_smem(tile.index)), tile.bars,
                               tile.tmem, barrier=(tile.barrier, cfg.threads), frees_tmem=False,
                               exchange=exchange_of(tile),
                               o_run=8 if two_corrected else None)
        assemble(b, "tcgen05_ws", loads=Loads(copy_tile=copy_tile), math=tile_math, tid=s.tid,
                 lane=s.lane, warp0=b.setp("eq", b.shfl("idx", s.warp, 0), 0),
                 columns=cfg.tmem_columns, q_tiles=cfg.q_tiles, tile_columns=cfg.tile_columns,
                 make_issue=lambda tile: UmmaIssue(b, cfg, q_smem(tile.index), tile.tmem, tile.bars,
                                                   hoist=True if cfg.q_tiles == 1 else "desc"),
                 make_correction=(lambda tile, c: Correction(b, cfg, tile.tmem, tile.bars,
                                                             exchange_of(tile), c, s.lane,
                                                             cfg.num_warps,
                                                             4 if two_corrected else 16))
                 if cfg.correction else None,
                 **pieces)
    else:             # a producer warpgroup and consumer warpgroups
        assemble(b, "tma_ws", loads=Loads(copy_tile=copy_tile), math=lambda: WgmmaMath(b, ctx),
                 tid=s.tid, lane=s.lane, consumers=cfg.block_m // ROWS_PER_WARPGROUP,
                 pingpong=cfg.pingpong, **pieces)


def tile_ctx(b: KernelBuilder, ctx: Ctx, cfg: Tcgen05Config, t: int, q_smem: Reg) -> Ctx:
    """Q tile t's context (tile.q_tiles): its rows from m_start + t block_m, its Q region, and
    its warps' and threads' indices within the tile (its warp w is the CTA's 8 t + w: the same
    tensor-memory sub-partition, w mod 4)."""
    if t == 0:
        return dataclasses.replace(ctx, q_smem=q_smem)
    return dataclasses.replace(ctx, tid=b.sub(ctx.tid, t * cfg.threads),
                               warp=b.sub(ctx.warp, t * cfg.num_warps),
                               m_start=b.add(ctx.m_start, t * cfg.block_m), q_smem=q_smem)


def build_body(b, spec, cfg, ptrs, strides, seq_q, seq_k, params, batch: Reg | None = None) -> None:
    """emit_body (or with tile.persistent, given the batch dim, emit_persistent_body) with the
    q/k/v tensor maps after the other parameters."""
    tmaps = tensor_map_params(b, spec, cfg, params)
    if getattr(cfg, "persistent", False):
        emit_persistent_body(b, spec, cfg, ptrs, strides, seq_q, seq_k, tmaps, batch)
    else:
        emit_body(b, spec, cfg, ptrs, strides, seq_q, seq_k, tmaps)


@dataclass(frozen=True)
class WorkTile:
    """What a persistent CTA's role needs of its current work tile (run_persistent_ws_pipeline):
    the key tiles it visits, their copies, the shared regions, and the consumers' math."""

    n_tiles: Reg
    n_full: Reg
    lo_full: Reg | None
    key0_of: Callable
    copy_tile: Callable
    q_smem: Reg
    k_smem: Reg
    v_smem: Reg
    math: Callable        # () -> (WgmmaMath, its score transform or None)


def emit_persistent_body(b: KernelBuilder, spec: KernelSpec, cfg: WgmmaConfig, ptrs, strides,
                         seq_q, seq_k, tmaps: dict, batch: Reg) -> None:
    """tile.persistent: the producer-warpgroup kernel's CTAs each take work tiles in turn
    (prefill_tile.PersistentTiles), each role placing itself on tile t where it starts it
    (setup at the tile's coordinates); O staged in its own region when cfg.o_separate."""
    tiles = PersistentTiles(b, spec, cfg.cta_rows, seq_q, batch)
    smem = b.address_of(b.shared("prefill_smem", 0, align=cfg.smem_align))
    tid = b.special("%tid.x")
    o_tmap = b.tensor_map_address(tmaps["o"]) if cfg.tma_store else None
    o_stage = b.add(smem, cfg.o_region_offset) if cfg.o_separate else None
    k_bytes, v_bytes = cfg.kv_geom.bytes, cfg.v_geom.bytes
    bars = b.add(b.add(smem, cfg.q_region_bytes), cfg.num_stages * (k_bytes + v_bytes))
    # TMA stores from O's own region are read while the next tile runs (FlashAttention-3's
    # epilogue overlap): thread 0 waits for them before O is staged again, and at exit
    deferred = cfg.tma_store and cfg.o_separate

    def work(t: Reg) -> WorkTile:
        s = setup(b, spec, cfg, ptrs, strides, seq_q, seq_k, place=tiles.place(t), smem=smem)
        copy_tile, key0_of = tile_copies(b, cfg, s, tmaps)

        def math():
            ctx = dataclasses.replace(s.ctx(spec, cfg, ptrs, strides, seq_q, seq_k),
                                      o_tmap=o_tmap, o_stage=o_stage,
                                      store_wait_deferred=deferred)
            m = WgmmaMath(b, ctx)
            return m, s.transform_of(m)
        return WorkTile(s.n_tiles, s.n_full, s.lo_full, key0_of, copy_tile, s.smem, s.k_smem,
                        s.v_smem, math)

    run_persistent_ws_pipeline(b, stages=cfg.num_stages, consumers=cfg.block_m // ROWS_PER_WARPGROUP,
                               kv_bytes=k_bytes, v_bytes=v_bytes, q_bytes=cfg.q_geom.bytes,
                               bars=bars, tid=tid, lane=b.and_(tid, 31), tiles=tiles, work=work,
                               o_apart=cfg.o_separate, pingpong=cfg.pingpong,
                               store_reads=(lambda: b.bulk_wait_read(0)) if deferred else None)


def tile_copies(b, cfg, s: Setup, tmaps: dict):
    """(copy_tile, key0_of) of the pipelines: copy_tile(t, tile, dst, bar) issues tile `tile` of
    t ("q": the CTA's Q tile; "k", "v") as one box per 128-byte column slab, coordinates
    {64 s, head, row, batch} (innermost first), each slab rows x 128 B at dst (1024-aligned);
    key0_of(j) is tile j's first key."""
    bn, first_tile = cfg.block_n, s.first_tile
    addr = {t: b.tensor_map_address(tmaps[t]) for t in "qkv"}
    coords = {t: (b.bitcast(s.head if t == "q" else s.kv_head, S32), b.bitcast(s.batch, S32))
              for t in "qkv"}
    slab_cols = SWIZZLE // cfg.fmt.bytes

    def key0_of(j: Reg) -> Reg:
        return b.mul(j if first_tile is None else b.add(j, first_tile), bn)

    q_tiles = getattr(cfg, "q_tiles", 1)

    def copy_tile(t: str, tile, dst: Reg, bar) -> None:
        if t == "q" and q_tiles > 1:      # each Q tile into its region, on the one barrier
            for q in range(q_tiles):
                copy_box(t, b.add(s.m_start, q * cfg.block_m) if q else s.m_start,
                         b.add(dst, q * cfg.q_tile_bytes) if q else dst, bar)
            return
        copy_box(t, s.m_start if t == "q" else key0_of(tile), dst, bar)

    def copy_box(t: str, row0: Reg, dst: Reg, bar) -> None:
        rows = cfg.block_m if t == "q" else bn
        h, n = coords[t]
        row0 = b.bitcast(row0, S32)
        width = cfg.dv if t == "v" else cfg.head_dim
        for k in range(width // slab_cols):
            b.tma_load(Addr(dst, k * rows * SWIZZLE), addr[t], [k * slab_cols, h, row0, n], bar)
    return copy_tile, key0_of


def tensor_map_params(b: KernelBuilder, spec: KernelSpec, cfg: WgmmaConfig | Tcgen05Config,
                      params: list) -> dict:
    """The q/k/v tensor-map parameters of the TMA loads (appended to `params`): one box is a
    64-element (128-byte) column slab of block_m (Q) or block_n (K, V) rows of one head; with
    tile.tma_store o's too (block_m rows, as Q's)."""
    maps = {}
    names = (("q", cfg.block_m), ("k", cfg.block_n), ("v", cfg.block_n)) + \
        ((("o", cfg.block_m),) if cfg.tma_store else ())
    for t, rows in names:
        box = (SWIZZLE // cfg.fmt.bytes, 1, rows, 1)    # innermost first: d, head, seq, batch
        src = ParamSource("tensor_map", tensor=t, box=box, swizzle=SWIZZLE)
        params.append(LaunchParam(f"{t}_tmap", TMAP, src))
        maps[t] = b.param(f"{t}_tmap", TMAP)
    return maps
