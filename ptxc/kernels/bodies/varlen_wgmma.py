"""varlen (and any GQA-packed tile) on Hopper warpgroup MMA: target sm_90a, f16/bf16 caches,
head_dim and head_dim_v 64, 128, 192 or 256 (head_dim_v < head_dim only with TMA loads,
varlen_tma.py). When it applies and how the tile is
configured (WgmmaTileConfig, applies, configure) lives below this body, in varlen_tile.py.

The packed tile of varlen_attend.py (row R = token R / g, head R % g of the group; the same
sequence search, key range, split-KV share, per-row masks, variants and per-row epilogue) with
the tile math and K/V loop of the wgmma prefill (math/wgmma.py, wgmma_pipeline.py):

  tile       block_m 64 (one warpgroup of 4 warps) by default, the mma.sync path's tile, so the
             grid and the "auto" split rule stay target-independent (varlen.configure); a given
             block_m of 128 gives two warpgroups; 16 or 32 keep the mma.sync kernel.
  shared     Q (block_m rows), num_stages K and num_stages V tiles (block_n rows), each split
             along d into 128-byte slabs of rows x 128 B with the 128-byte swizzle, 1024-aligned
             (the wgmma prefill's layout, mainloop/tiles.py's SwizzledGeom; so WgmmaMath's descriptors apply unchanged).
  copies     per-thread cp.async 16-byte chunks at the swizzled addresses (swizzled_slot). A
             copy pass must cover whole 8-row groups, so a row wider than 2 x threads bytes
             (head_dim 256 with one warpgroup: 512 B, 128 threads), or one whose 16-byte chunks do
             not divide the threads into whole 8-row passes (head_dim 192: 24 chunks), is copied
             as column groups of whole slabs (WgmmaTileConfig.group_bytes): the same thread slot, +group bytes in global memory and +group
             slabs in shared memory per group (immediates), one row address for all groups.
             Q rows are gathered per packed row (token, head); contiguous K/V tiles carry
             their next address (StridedTiles); paged ones go through KVAccess, with their
             page ids loaded one tile ahead where a pass stays inside a page
             (kv_pages.py) -- the wgmma pipeline requests V(t) after K(t + 1), so V takes the
             ids one K request older (LaggedPages).
  math       VarlenWgmmaMath = VarlenMath (per-row epilogue: packed rows -> o / lse / split
             workspace) over WgmmaMath (S = Q·Kᵀ and O += P·V on wgmma, softmax overlapped with
             the previous P·V); the m64nN accumulator is the mma.sync fragment layout per warp,
             so masks, variants and the epilogue read it as they are.

FP8 caches (e4m3 / e5m2) take the same body with their bytes staged by cp.async and
dequantised into one swizzled tile each for K and V at the top of every iteration
(kv_fp8_stage.SwizzledFP8Staging, wgmma_pipeline's `landed`); TMA does not apply to them.
MLA's FP8 latent rows are converted either by every warp into two alternating tiles
(kv_fp8_latent.LatentFP8Staging, wgmma_pipeline._run_staged_latent) or, by default where it
fits (latent_tile.dequant_warpgroup), by a dequantising warpgroup of their own into a ring of
three (emit_dequant_tile, mainloop/dequant_pipeline.py).
e4m3_ds rows, other head dims, and head_dim_v != head_dim with cp.async loads (FP8 caches, pages
of fewer than 8 rows, kv_loads = "cp_async") keep the mma.sync kernel on sm_90a.
"""

from __future__ import annotations

from ...ir import S32, S64, U64, Addr, Imm, KernelBuilder, Reg
from ..attention.packed_tile import TileWork, packed_tile_setup
from ..attention.varlen_tile import (Tcgen05TileConfig, VarlenMath, VarlenTcgen05Math, WgmmaTileConfig,
                                     score_transform)
from ..kv.kv_access import KVAccess
from ..kv.kv_fp8_direct import DirectLatentStaging
from ..kv.kv_fp8_latent import LatentFP8Staging
from ..kv.kv_fp8_stage import SwizzledFP8Staging
from ..kv.kv_pages import PagedTiles, SparseSlots, prefetch_applies
from ..mainloop.dequant_pipeline import TILES as DEQUANT_TILES
from ..mainloop.tiles import SWIZZLE_PERIOD, ThreadSlot, load_tile_passes, swizzled_slot
from ..mainloop.tma_pipeline import MBARRIER_BYTES
from ..mainloop.tma_ws_pipeline import CONSUMER_BARRIER
from ..math.q_rescale import quantize_q_rows
from ..math.umma import BAR_O, BAR_S, allocate_issue, allocated_base
from ..math.wgmma import WgmmaMath
from .assemble import Buffers, KeyTiles, Loads, assemble, prebuilt

class VarlenWgmmaMath(VarlenMath, WgmmaMath):
    """WgmmaMath's tile math with VarlenMath's per-row epilogue (the MRO composes them:
    VarlenMath -> WgmmaMath -> MmaMath)."""


class LaggedPages(PagedTiles):
    """PagedTiles for wgmma_pipeline's request order (K(t+1) before V(t)): V uses the ids of
    the K request before the last one, and `advance` runs after every K request, issued or not,
    so the ids stay one tile per K request apart."""

    def __init__(self, b: KernelBuilder, kv: KVAccess, bases: dict, slot: ThreadSlot,
                 block_n: int, L: Reg):
        super().__init__(b, kv, bases, slot, block_n, L)
        self.previous = [b.mov(-1, p.type) for p in self.current]

    def ids_of(self, cache: str) -> list[Reg]:
        return self.ahead if cache == "k_cache" else self.previous

    def advance(self, row0: Reg) -> None:
        for prev, cur in zip(self.previous, self.current):
            self.b.mov(cur, out=prev)
        super().advance(row0)


class StridedTiles:
    """Contiguous caches: a sequence's K/V rows are evenly strided and each of K and V is
    requested in tile order, so each carries this thread's address in its next tile (as the
    prefill's loader does) instead of a 64-bit multiply per row and pass."""

    def __init__(self, b: KernelBuilder, bases: dict, slot: ThreadSlot, block_n: int, first: Reg):
        self.b, self.slot = b, slot
        self.next, self.tile_step, self.pass_step = {}, {}, {}
        row0 = b.cvt(S64, b.add(b.mul(first, block_n), slot.r0))
        for t in ("k_cache", "v_cache"):
            base, stride = bases[t]
            self.next[t] = b.mad(row0, stride[1], b.bitcast(base, S64))
            self.tile_step[t] = b.mul(stride[1], block_n)
            self.pass_step[t] = b.mul(stride[1], slot.geom.rows_per_pass)

    def chunks(self, cache: str, row0: Reg, nvalid: Reg, key_lo: Reg | None) -> list:
        """(address, validity) of every pass of the tile at row0 (the next one requested)."""
        b, rpp = self.b, self.slot.geom.rows_per_pass
        rem = b.sub(nvalid, b.bitcast(self.slot.r0, S32))
        out, addr = [], self.next[cache]
        for i in range(self.slot.geom.passes):
            if i:
                addr = b.add(addr, self.pass_step[cache])
            ok = b.setp("gt", rem, i * rpp)
            if key_lo is not None:
                row = b.add(row0, b.add(self.slot.r0, i * rpp))
                ok = b.and_(ok, b.setp("ge", b.bitcast(row, S32), key_lo))
            out.append((addr, ok))
        return out

    def advance(self, cache: str) -> None:
        self.b.add(self.next[cache], self.tile_step[cache], out=self.next[cache])


def stage_groups(b: KernelBuilder, cfg: WgmmaTileConfig, slot: ThreadSlot, chunks: list,
                 nvalid: Reg, dst: Reg, groups: int | None = None) -> None:
    """cp.async every pass's chunk (address, validity) into the swizzled tile at `dst`, once
    per column group (cfg.groups unless `groups` says: FP8 staging rows are one):
    +group_bytes in the row, +group_bytes x rows in shared memory."""
    geom = slot.geom
    for h in range(cfg.groups if groups is None else groups):
        def at(i: int, h=h) -> tuple[Reg, Reg]:
            addr, ok = chunks[i]
            addr = b.bitcast(addr, U64) if addr.type != U64 else addr
            return (addr if h == 0 else b.add(addr, Imm(h * geom.row_bytes, U64))), ok
        load_tile_passes(b, slot, at, nvalid, dst if h == 0 else b.add(dst, h * geom.rows * geom.row_bytes),
                         True)


def row_chunks(b: KernelBuilder, slot: ThreadSlot, row_address, row0: Reg, nvalid: Reg) -> list:
    """Each pass's (chunk address, validity) from `row_address(row, valid)` (load_tile_rows'
    callback), computed once for all column groups."""
    geom = slot.geom
    rem = b.sub(nvalid, b.bitcast(slot.r0, S32))
    return [row_address(b.add(row0, b.add(slot.r0, i * geom.rows_per_pass)),
                        b.setp("gt", rem, i * geom.rows_per_pass)) for i in range(geom.passes)]


def kv_copies(b: KernelBuilder, cfg: WgmmaTileConfig, kv: KVAccess, tile, ptrs: dict,
              work: TileWork, kv_slot: ThreadSlot, k_stage: Reg, v_stage: Reg, staged: bool,
              ring: tuple | None = None):
    """load_kv(t, j, stage_offset) for the threads of `kv_slot`: tile j of t ("k" | "v") by
    cp.async into its stage buffer if the tile exists, one commit group either way; and the
    paged layout's ids a tile ahead (LaggedPages, or None), whose load_ahead the caller runs
    once before the first copy. `ring` (sparse top-k's latent tiles, cfg.slot_ring): the
    copying thread's id, the tiles the pipeline issues before its loop and the address of
    the valid-rows words the copies publish (or None) -- the rows' slots come two tiles ahead
    through the slot ring (kv_pages.SparseSlots) instead of a global round trip in front of
    each tile's copies."""
    bn, L, first, n_tiles = cfg.block_n, tile.L, tile.first, tile.n_tiles
    bases = kv.bases(b, ptrs, work.seq, work.kv_head, b.cvt(S64, kv_slot.col))
    pages = LaggedPages(b, kv, bases, kv_slot, bn, L) if prefetch_applies(kv, kv_slot, bn) else None
    strided = StridedTiles(b, bases, kv_slot, bn, first) if kv.layout == "contiguous" else None
    key_lo = tile.key_lo()
    sparse = None
    if ring is not None:
        assert cfg.slot_ring and cfg.shared_kv and key_lo is None and tile.order is None
        tid, prologue, valid_words = ring
        sparse = SparseSlots(b, kv, bases, kv_slot, bn, L, b.add(tile.smem, cfg.slot_ring_offset),
                             tid, prologue, tile.key0, valid_words)

    def load_kv(t: str, j: Reg, stage_off: Reg | int) -> None:
        cache = "k_cache" if t == "k" else "v_cache"
        row0 = b.mul(b.add(first, j), bn)
        with b.if_then(b.setp("lt", j, n_tiles)):
            dst = b.add(k_stage if t == "k" else v_stage, stage_off)
            nvalid = b.sub(L, b.bitcast(row0, S32))
            if sparse is not None and staged:
                # FP8 rows: one pass group, each pass's address worked out as it is copied (a
                # dequantising warpgroup holds its share of the previous tile meanwhile)
                sparse.issue(cache, j, nvalid, dst, tile.kv_rows(kv, bases, cache, key_lo))
            else:
                if pages is not None:
                    chunks = pages.pass_chunks(cache, pages.ids_of(cache), row0, key_lo)
                elif sparse is not None:
                    chunks = sparse.chunks(cache, j, nvalid, tile.kv_rows(kv, bases, cache, key_lo), row0)
                elif strided is not None:
                    chunks = strided.chunks(cache, row0, nvalid, key_lo)
                else:
                    chunks = row_chunks(b, kv_slot, tile.kv_rows(kv, bases, cache, key_lo), row0, nvalid)
                # FP8 rows land whole in one pass group (unpadded staging)
                stage_groups(b, cfg, kv_slot, chunks, nvalid, dst, groups=1 if staged else None)
                if sparse is not None:
                    sparse.advance(j)
        if pages is not None and t == "k":
            pages.advance(row0)
        if strided is not None:
            strided.advance(cache)
        b.cp_async_commit()
    return load_kv, pages


def copy_q(b: KernelBuilder, cfg: WgmmaTileConfig, tile, q_slot: ThreadSlot, q_row) -> None:
    """The packed Q tile's rows by cp.async into the swizzled Q region (no commit: the first
    group the caller commits takes it)."""
    ctx = tile.ctx
    q_valid = b.sub(b.bitcast(ctx.seq_q, S32), b.bitcast(ctx.m_start, S32))
    stage_groups(b, cfg, q_slot, row_chunks(b, q_slot, q_row, ctx.m_start, q_valid), q_valid,
                 tile.smem)


def packed_math(b: KernelBuilder, ctx, ptrs: dict, strides: dict, quant, work: TileWork,
                mma_bars: Reg | None = None, **tcgen05):
    """The tile math -- wgmma's, or on sm_100a tcgen05's with its MMA barriers at `mma_bars`
    (MLA's latent tile copied by the threads; `tcgen05`: Tcgen05Math's tmem and barrier where
    a pipeline set them up) --; an FP8 cache's k_scale joins the softmax scale and v_scale the
    final 1/l (group scales are applied where the rows are converted)."""
    math = VarlenWgmmaMath(b, ctx, ptrs, strides) if mma_bars is None else \
        VarlenTcgen05Math(b, ctx, ptrs, strides, mma_bars, **tcgen05)
    if quant is not None and quant.mode != "group":
        k_scale, math.v_scale = quant.scales(b, work.kv_head)
        math.fold_k_scale(k_scale)
    return math


def emit_dequant_tile(b: KernelBuilder, spec, cfg, kv: KVAccess, ptrs: dict, strides: dict,
                      work: TileWork, tile, quant) -> None:
    """MLA's FP8 latent rows under a dequantising warpgroup (tile.dequant_warpgroup;
    mainloop/dequant_pipeline.py): the computing warpgroups copy Q, the dequantising one copies
    the rows into its staging buffers and converts them (LatentFP8Staging over its 128 threads)
    into the ring of converted tiles at the start of the K region."""
    ctx, bn = tile.ctx, cfg.block_n
    tile_bytes = cfg.converted_bytes
    staging_at = cfg.converted_tiles * tile_bytes
    valid_words = None
    if cfg.slot_ring:    # sparse: the copies publish each tile's rows with a cache row
        valid_words = ctx.mask_from_valid_words(b, tile.smem)

    def make_loads(tid: Reg):
        if cfg.qk_direct:            # S reads the staging ring: copies into its layout, V converted
            direct = DirectLatentStaging(b, tid, b.add(tile.k_smem, staging_at), bn, cfg.head_dim,
                                         cfg.dv, quant, cfg.math_pair)
            return direct.copies(kv, tile, ptrs, work), direct.convert
        staging = LatentFP8Staging(b, cfg.staging_geom, tile_bytes, bn, cfg.num_stages, tid,
                                   tile.k_smem, quant, cfg.math_pair, cfg.fmt, cfg.rows,
                                   converted=cfg.converted_tiles, keep_offsets=False,
                                   narrow_dv=cfg.dv if cfg.qk_e4m3 else None)
        load_kv, pages = kv_copies(b, cfg, kv, tile, ptrs, work, staging.slot, staging.k_stage,
                                   staging.v_stage, True,   # its loop refills S tiles ahead
                                   ring=(tid, cfg.num_stages, valid_words) if cfg.slot_ring else None)
        if pages is not None:
            pages.load_ahead(b.mul(tile.first, bn))
        return (lambda j, off: load_kv("k", j, off)), staging.convert

    def copy_q_tile() -> None:
        if cfg.qk_e4m3:              # Q is read and quantised by q_rewrite below
            return
        q_slot = swizzled_slot(b, cfg.copy_geom(cfg.block_m), ctx.tid)
        copy_q(b, cfg, tile, q_slot, tile.q_row(ptrs, strides, b.cvt(S64, q_slot.col)))
        b.cp_async_commit()

    def q_rewrite(m):
        if cfg.qk_e4m3:              # Q's rows into the e4m3 tile, each row's factor in the softmax
            def quantize() -> None:
                rows = b.sub(b.bitcast(ctx.seq_q, S32), b.bitcast(ctx.m_start, S32))
                m.row_scales = quantize_q_rows(m, tile.q_row(ptrs, strides, b.mov(0, S64)), rows,
                                               quant.target)
            return quantize
        return m.q_rewrite(quant.target)

    bars = b.add(tile.k_smem, staging_at + cfg.num_stages * cfg.staging_geom.bytes)
    make_math, before_split = (lambda: packed_math(b, ctx, ptrs, strides, quant, work)), None
    if isinstance(cfg, Tcgen05TileConfig):   # sm_100a: the MMA barriers after the ring's
        make_math, before_split = tcgen05_setup(b, cfg, ctx, ptrs, strides, quant, work,
                                                b.add(bars, 2 * DEQUANT_TILES * MBARRIER_BYTES))
    assemble(b, "latent_dequant",
             buffers=Buffers(cfg.num_stages, tile.smem, tile.k_smem, tile.k_smem, tile_bytes,
                             cfg.staging_geom.bytes, bars=bars),
             tiles=KeyTiles(tile.n_tiles, tile.n_full, lambda j: b.mul(b.add(tile.first, j), bn),
                            tile.lo_full),
             loads=Loads(issue_setup=make_loads, q_landed=copy_q_tile),
             math=make_math,
             transform_of=lambda m: score_transform(b, spec, m), tid=ctx.tid, lane=ctx.lane,
             threads=cfg.threads, regs=(cfg.producer_regs, cfg.consumer_regs),
             q_rewrite_of=q_rewrite if (cfg.qk_e4m3 or cfg.q_e4m3 or cfg.f16_math) else None,
             direct=b.add(tile.k_smem, staging_at) if cfg.qk_direct else None,
             before_split=before_split)


def tcgen05_setup(b: KernelBuilder, cfg, ctx, ptrs: dict, strides: dict, quant, work: TileWork,
                  mma_bars: Reg):
    """(make_math, before_split) of the dequantising pipeline on sm_100a: before the branches
    part, thread 0 initialises the MMA barriers and warp 0 allocates the tensor memory; in the
    computing branch the math reads the base (warp 0 gives up the permit) and meets the other
    softmax warps on their named barrier (the converting warpgroup never reaches it)."""
    warp0 = b.setp("eq", b.shfl("idx", ctx.warp, 0), 0)      # warp-uniform

    def before_split() -> None:
        with b.if_then(b.setp("eq", ctx.tid, 0)):
            b.mbarrier_init(Addr(mma_bars, BAR_S), 1)
            b.mbarrier_init(Addr(mma_bars, BAR_O), 1)
        allocate_issue(b, warp0, mma_bars, cfg.tmem_columns)

    def make_math():
        return packed_math(b, ctx, ptrs, strides, quant, work, mma_bars,
                           tmem=allocated_base(b, warp0, mma_bars),
                           barrier=(CONSUMER_BARRIER, cfg.threads))
    return make_math, before_split


def emit_wgmma_tile(b: KernelBuilder, spec, cfg: WgmmaTileConfig, kv: KVAccess, ptrs: dict,
                    strides: dict, work: TileWork, split_count: Reg | None,
                    quant=None, mask_bytes: Reg | None = None) -> None:
    """varlen_mma.emit_mma_tile on wgmma with cp.async K/V loads (see the module
    docstring; tile.kv_loads = "tma" runs varlen_tma.py's body instead). With `quant` (an FP8 cache, cfg.fp8) the
    copies land FP8 bytes in staging buffers, converted at the top of each iteration; k_scale
    joins the softmax scale and v_scale the final 1/l, as on the mma.sync path."""
    bn = cfg.block_n
    tile = packed_tile_setup(b, spec, cfg, kv, ptrs, work, split_count, smem_align=SWIZZLE_PERIOD,
                             mask_bytes=mask_bytes)
    ctx, L, first, n_tiles = tile.ctx, tile.L, tile.first, tile.n_tiles
    if getattr(cfg, "dequant_warpgroup", False):
        emit_dequant_tile(b, spec, cfg, kv, ptrs, strides, work, tile, quant)
        return
    q_slot = swizzled_slot(b, cfg.copy_geom(cfg.block_m), ctx.tid)
    staging = None
    if cfg.fp8 and cfg.shared_kv:   # MLA's FP8 latent rows: two alternating converted tiles
        staging = LatentFP8Staging(b, cfg.staging_geom, cfg.kv_geom.bytes, bn, cfg.num_stages,
                                   ctx.tid, tile.k_smem, quant,
                                   cfg.math_pair, cfg.fmt, cfg.rows)
        kv_slot = staging.slot
    elif cfg.fp8:
        staging = SwizzledFP8Staging(b, cfg.staging_geom, cfg.kv_geom.bytes, cfg.kv_geom.slab_bytes,
                                     cfg.num_stages, ctx.tid, tile.k_smem, quant,
                                     cfg.math_pair)
        kv_slot = staging.slot
    else:
        kv_slot = swizzled_slot(b, cfg.copy_geom(bn), ctx.tid)
    k_stage, v_stage = (staging.k_stage, staging.v_stage) if staging else (tile.k_smem, tile.v_smem)
    q_row = tile.q_row(ptrs, strides, b.cvt(S64, q_slot.col))
    # the latent loops issue S tiles before the loop over converted FP8 rows, S - 2 otherwise
    ring = None
    if cfg.slot_ring:    # the copies publish each tile's rows with a cache row
        words = ctx.mask_from_valid_words(b, tile.smem)
        ring = (ctx.tid, cfg.num_stages - (0 if staging else 2), words)
    load_kv, pages = kv_copies(b, cfg, kv, tile, ptrs, work, kv_slot, k_stage, v_stage,
                               staging is not None, ring)
    copy_q(b, cfg, tile, q_slot, q_row)
    if pages is not None:
        pages.load_ahead(b.mul(first, bn))
    stage_bytes = staging.stage_bytes if staging else cfg.kv_geom.bytes
    # sm_100a (MLA's latent tile on tcgen05): its MMA barriers after the stages
    mma_bars = b.add(k_stage, cfg.num_stages * stage_bytes) if isinstance(cfg, Tcgen05TileConfig) else None
    math = packed_math(b, ctx, ptrs, strides, quant, work, mma_bars)
    assemble(b, "latent_wgmma" if cfg.shared_kv else "wgmma",   # MLA: one latent tile per stage
             buffers=Buffers(cfg.num_stages, tile.smem, k_stage, v_stage, stage_bytes),
             tiles=KeyTiles(n_tiles, tile.n_full, lambda j: b.mul(b.add(first, j), bn), tile.lo_full),
             loads=Loads(load_kv=load_kv, landed=staging.landed if staging else None,
                         # f16 products over a bf16 Q: its rows rescaled into f16 first (or
                         # rounded to e4m3 values: qk_products)
                         q_landed=math.q_rewrite(quant.target) if quant is not None else None),
             math=prebuilt(math), transform_of=lambda m: score_transform(b, spec, m))


__all__ = ["VarlenWgmmaMath", "emit_wgmma_tile", "row_chunks", "stage_groups"]
