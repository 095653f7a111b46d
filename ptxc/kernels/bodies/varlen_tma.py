"""varlen's sm_90a wgmma body with its K/V tiles fed by TMA (tile.kv_loads = "tma", the default
where varlen_tile.tma_applies): the packed tile of varlen_wgmma.py on the mbarrier pipeline of
tma_pipeline.py (full[stage] mbarriers, the elected thread arriving with each phase's
expect_tx; the same swizzled slabs, so WgmmaMath is unchanged).

  issuers    box k = (page p, slab s) of a tile is issued by lane 0 of warp (k + 1) %
             num_warps (run_tma_pipeline's issuer hook; warp_boxes): ptxas wraps every box in
             an ELECT issue loop of ~7 instructions, and one issuing thread made warp 0's
             iteration longer than the cp.async kernel's (docs/performance.md). Each warp's
             slabs, rows and shared offsets are computed from its id once, before the loop, so
             the loop issues its boxes without a branch per warp.

  Q          GQA-packed (token, head) rows are a gather, not a box: per-thread cp.async into
             the swizzled Q tile as the cp.async body does, issued before the K/V prologue and
             waited once before the loop (wait_group 0, fence.proxy.async, bar.sync).
  contiguous k_cache / v_cache [batch, max_seq_len, Hk, d] as 4D tensor maps (innermost first
             d, Hk, max_seq_len, batch), box [64, 1, block_n, 1] per 128-byte slab at
             {64 s, kv_head, row0, seq}. Rows past max_seq_len are the TMA's zeros.
  paged      [num_pages, page_size, Hk, d], box [64, 1, min(page_size, block_n), 1] per slab
             and page at {64 s, kv_head, row % page_size, page id}, landing at the page's row
             offset in the slab. The 128-byte swizzle is a function of the shared address
             (chunk ^ address bits [7, 10)), so a box starting at a multiple of 8 rows of a
             1024-aligned slab is itself 1024-aligned and lands exactly as the whole tile
             would: power-of-two pages of >= 8 rows and pages of whole 64-row tiles take TMA,
             others keep the cp.async body (varlen_tile.tma_applies). The issuing lanes read their pages' ids one
             K request ahead (IssuerPages); a row at or past L uses id -1, and an id outside
             [0, num_pages) (a corrupt table, or -1) lies outside the map's page dimension
             (num_pages, the cache's own extent), so the TMA fills the box with zeros and still
             counts its bytes: no bad id is dereferenced and expect_tx stays the full tile.
  latent     MLA's dense latent cache (kv_cache [num_pages, page_size, d] or [batch,
             max_seq_len, d], no head axis; latent_tile.latent_loads): one 3D tensor map
             (kv_tmap, box [64, rows, 1]), one tile per stage serving S and P·V
             (tma_pipeline.run_latent_tma_pipeline); the same issuers, page ids and V tail
             (the first head_dim_v columns' slabs are V). e4m3 rows (kv_loads = "tma" given):
             unswizzled boxes of fp8_box_bytes columns into kv_fp8_latent.LatentFP8Staging's
             buffers, converted there, the tail zeroed in the converted tile. On sm_100a
             (latent_tcgen05.py) the same loop with tcgen05's math, its MMA barriers after
             the stages' (each of the two value CTAs reads the whole tile).
  rows >= L  cache rows at or past the sequence's L may hold anything (NaN included). K rows
             there are masked to -inf before the softmax (P = 0 exactly, selp drops the NaN),
             but 0 x NaN in P·V would poison O, so the last V tile's rows [L - row0, block_n)
             are zeroed in shared memory after it lands (st.shared by every thread, then
             fence.proxy.async and bar.sync before the wgmma reads it; run_tma_pipeline's
             last_v_landed hook). Only the sequence's last tile holds such rows and it is
             always the loop's last V tile (the P·V after the loop), so the loop is untouched.
             Clamping boxes instead would need a box size per tail length.
"""

from __future__ import annotations

from contextlib import nullcontext

from ...ir import S32, S64, U32, Addr, KernelBuilder, Reg
from .. import common as C
from ..attention.packed_tile import TileWork, packed_tile_setup
from ..attention.varlen_tile import Tcgen05TileConfig, VarlenTcgen05Math, score_transform
from ..kv.kv_access import KVAccess
from ..kv.kv_boxes import IssuerPages, box_rows, tensor_map_params, warp_boxes, zero_tail_rows
from ..kv.kv_fp8_latent import LatentFP8Staging
from ..mainloop.tiles import SWIZZLE, SWIZZLE_PERIOD, swizzled_slot
from ..mainloop.tcgen05_ws_pipeline import MMA_WARP_BARRIER
from ..mainloop.seesaw_pipeline import SEESAW_STAGES
from ..mainloop.tma_pipeline import MBARRIER_BYTES, barrier_bytes, refill_phase
from ..math.seesaw import WARPGROUP, SeesawExchange, warpgroup_barrier
from ..config.wgmma import ROWS_PER_WARPGROUP as WARPGROUP_ROWS
from ..math.tcgen05 import Correction
from ..math.umma import UmmaIssue, mma_region_bytes
from .assemble import Buffers, KeyTiles, Loads, assemble, prebuilt
from .varlen_wgmma import VarlenWgmmaMath, row_chunks, stage_groups


def emit_tma_tile(b: KernelBuilder, spec, cfg, kv: KVAccess, ptrs: dict, strides: dict,
                  work: TileWork, split_count: Reg | None, tmaps: dict,
                  mask_bytes: Reg | None = None, quant=None) -> None:
    """varlen_wgmma.emit_wgmma_tile with TMA K/V loads (see the module docstring); on sm_100a
    with tile.warp_specialize, tcgen05_ws_pipeline's load, MMA and softmax warps."""
    bn, stages = cfg.block_n, cfg.num_stages
    ws = getattr(cfg, "warp_specialize", False)
    tile = packed_tile_setup(b, spec, cfg, kv, ptrs, work, split_count, smem_align=SWIZZLE_PERIOD,
                             mask_bytes=mask_bytes)
    ctx, L, first, n_tiles = tile.ctx, tile.L, tile.first, tile.n_tiles
    # Q: the softmax warps gather it (the load and MMA warps of a warp-specialised CTA do not)
    with b.if_then(b.setp("lt", ctx.tid, cfg.threads)) if ws else nullcontext():
        q_slot = swizzled_slot(b, cfg.copy_geom(cfg.block_m), ctx.tid)
        q_row = tile.q_row(ptrs, strides, b.cvt(S64, q_slot.col))
        q_valid = b.sub(b.bitcast(ctx.seq_q, S32), b.bitcast(ctx.m_start, S32))
        stage_groups(b, cfg, q_slot, row_chunks(b, q_slot, q_row, ctx.m_start, q_valid), q_valid,
                     tile.smem)
        b.cp_async_commit()
        if ws:      # landed and fenced before the pipeline's first CTA barrier (the allocation's)
            b.cp_async_wait(0)
            b.fence_proxy_async()

    addr = {t: b.tensor_map_address(tmaps[t]) for t in tmaps}
    seq = b.bitcast(work.seq, S32)
    head = () if kv.latent else (b.bitcast(work.kv_head, S32),)     # a latent cache has no head axis
    slab_cols, slabs = SWIZZLE // cfg.fmt.bytes, cfg.head_dim * cfg.fmt.bytes // SWIZZLE
    v_slabs = cfg.dv * cfg.fmt.bytes // SWIZZLE      # V narrower than K: its first slabs' boxes
    rows = box_rows(kv, bn)
    staging, slab_row = None, SWIZZLE
    if kv.latent and cfg.fp8:    # e4m3 rows: boxes of fp8_box_bytes columns into staging buffers
        slab_cols = slab_row = cfg.fp8_box_bytes
        slabs = v_slabs = cfg.head_dim // slab_cols
        staging = LatentFP8Staging(b, cfg.staging_geom, cfg.kv_geom.bytes, bn, stages, ctx.tid,
                                   tile.k_smem, quant, cfg.math_pair,
                                   cfg.fmt, box_bytes=slab_cols)

    def copies(issuing: Reg, issuers: int, first_tile: Reg | int = 0, step: int = 1):
        """(copy_tile, issuer): the boxes of a tile shared by `issuers` issuing units (box k
        by unit (k + 1) % issuers: warp_boxes), `issuing` this thread's unit -- its warp, lane
        0 of each issuing (the one-issuer loop), or its lane in the load warp -- and the page
        ids those threads load: `first_tile`'s here, then after each K tile t's request those
        of t + `step`, the next these threads request (the seesaw's warpgroups: every other)."""
        boxes = warp_boxes(b, issuing, slabs, slab_cols, bn // rows, rows, bn, issuers, slab_row)
        if ws:      # the lanes with a box: (lane - 1) mod 32 < the tile's box count
            mine = b.rem(b.add(issuing, issuers - 1), issuers)
            issuer = b.setp("lt", mine, min(issuers, slabs * (bn // rows)))
        else:
            issuer = b.setp("eq", ctx.lane, 0)
        pages = None
        if kv.layout == "paged":
            pages = IssuerPages(b, kv, C.element_offset(b, ptrs["block_table"], work.seq,
                                                        b.mul(kv.regs["bt_stride"], 4)),
                                first, bn, rows, L, n_tiles, tile.key_lo(), boxes)
            with b.if_then(issuer):
                pages.load(b.mov(first_tile, U32) if isinstance(first_tile, int) else first_tile)

        def copy_tile(t: str, j, dst: Reg, bar: Addr) -> None:
            if t == "q":
                return                                   # Q came by cp.async (q_bytes 0)
            cache = kv.caches[0] if kv.latent else "k_cache" if t == "k" else "v_cache"
            row0 = b.mul(b.add(first, j), bn)
            ids = None if pages is None else pages.k_ids() if t == "k" else pages.v_ids(j)
            in_page = {}     # each distinct box row's coordinate, before the boxes' predicates
            for box in boxes:
                if id(box.row) not in in_page:
                    row = row0 if box.row == 0 else b.add(row0, box.row)
                    in_page[id(box.row)] = b.bitcast(row if ids is None else kv.offset_in_page(b, row), S32)
            for i, box in enumerate(boxes):
                active = box.active
                if t == "v" and v_slabs < slabs:         # V's boxes: its first slabs only
                    narrow = b.setp("lt", box.slab, v_slabs)
                    active = narrow if active is None else b.and_(active, narrow)
                with b.if_then(active) if active is not None else nullcontext():
                    coords = (*head, in_page[id(box.row)], seq if ids is None else ids[pages.slot(i)])
                    b.tma_load(Addr(b.add(dst, box.offset)), addr[cache], [box.col, *coords], bar)
            if pages is not None and t == "k":
                pages.load(b.add(j, step))               # the next K request's ids
        return copy_tile, issuer

    def q_landed() -> None:
        b.cp_async_wait(0)
        b.fence_proxy_async()     # the cp.async-written Q, for wgmma's async-proxy reads
        b.bar_sync(0)

    def tail_rows() -> Reg:
        """Valid rows of the last V tile (< bn only in the sequence's last tile)."""
        return b.sub(L, b.bitcast(b.mul(b.add(first, b.sub(n_tiles, 1)), bn), S32))

    def last_v_landed(v_tile: Reg) -> None:
        nvalid = tail_rows()
        with b.if_then(b.setp("lt", nvalid, bn)):          # CTA-uniform
            zero_tail_rows(b, cfg, ctx.tid, v_tile, nvalid)
            b.fence_proxy_async()
            b.bar_sync(0)

    kv_bytes, v_bytes = cfg.kv_geom.bytes, cfg.v_geom.bytes
    key_tiles = KeyTiles(n_tiles, tile.n_full, lambda j: b.mul(b.add(first, j), bn), tile.lo_full)

    def transform_of(m):
        return score_transform(b, spec, m)

    if ws and not isinstance(cfg, Tcgen05TileConfig):     # sm_90a: a producer warpgroup
        emit_ws_tile(b, cfg, tile, ctx, copies, tail_rows, key_tiles, transform_of,
                           lambda: VarlenWgmmaMath(b, ctx, ptrs, strides))
        return
    if ws:          # sm_100a: load, MMA and softmax warps (tcgen05_ws_pipeline.py)
        bars = b.add(tile.v_smem, stages * v_bytes)
        mma_bars = b.add(bars, barrier_bytes(stages, True))

        def issue_setup():
            copy_tile, issuer = copies(ctx.lane, 32)
            return copy_tile, b.setp("eq", ctx.lane, 0), issuer

        def mma_warp_tail(v_tile: Reg) -> None:
            """The MMA warp's 32 threads zero the last V tile's rows past L (warp-uniform)."""
            nvalid = tail_rows()
            with b.if_then(b.setp("lt", nvalid, bn)):
                zero_tail_rows(b, cfg, ctx.lane, v_tile, nvalid, threads=32)
                b.fence_proxy_async()
                b.bar_sync(MMA_WARP_BARRIER, 32)   # memory order among the lanes (PTX: bar.sync)

        # tile.correction: the softmax warps' hand-over to the correction warps
        exchange = b.add(mma_bars, mma_region_bytes(1, True)) if cfg.correction else None
        assemble(b, "tcgen05_ws", buffers=Buffers(stages, tile.smem, tile.k_smem, tile.v_smem,
                                                  kv_bytes, v_bytes, 0, bars, mma_bars),
                 tiles=key_tiles, loads=Loads(issue_setup=issue_setup, last_v_landed=mma_warp_tail),
                 math=lambda q: VarlenTcgen05Math(b, ctx, ptrs, strides, q.bars, q.tmem, exchange),
                 make_correction=(lambda q, c: Correction(b, cfg, q.tmem, q.bars, exchange, c,
                                                          ctx.lane, cfg.num_warps))
                 if cfg.correction else None,
                 transform_of=transform_of, tid=ctx.tid, lane=ctx.lane,
                 warp0=b.setp("eq", b.shfl("idx", ctx.warp, 0), 0), columns=cfg.tmem_columns,
                 make_issue=lambda q: UmmaIssue(b, cfg, tile.smem, q.tmem, q.bars, hoist=True),
                 softmax_warps=cfg.num_warps)
        return
    if kv.latent and getattr(cfg, "seesaw", False):
        emit_seesaw(b, cfg, tile, ctx, copies, q_landed, tail_rows, key_tiles, transform_of,
                    VarlenWgmmaMath(b, ctx, ptrs, strides))
        return
    copy_tile, issuer = copies(ctx.warp, cfg.num_warps)

    def loads(q_hook=q_landed, **hooks) -> Loads:
        return Loads(copy_tile=copy_tile, leader=b.setp("eq", ctx.tid, 0), issuer=issuer,
                     q_landed=q_hook, last_v_landed=last_v_landed, **hooks)
    if kv.latent:    # MLA: one latent tile per stage serves both products, its barriers after
        stage, stage_bytes = (staging.k_stage, staging.stage_bytes) if staging else (tile.k_smem, kv_bytes)
        bars = None
        if isinstance(cfg, Tcgen05TileConfig):   # sm_100a: the MMA barriers after the stages'
            bars = b.add(stage, stages * stage_bytes)
            math = VarlenTcgen05Math(b, ctx, ptrs, strides, b.add(bars, stages * MBARRIER_BYTES))
        else:
            math = VarlenWgmmaMath(b, ctx, ptrs, strides)

        rewrite = math.q_rewrite(quant.target) if quant is not None else None

        def q_rescaled() -> None:
            """f16 products over a bf16 Q (e4m3 rows): Q's rows rescaled into f16 (or rounded
            to e4m3 values: qk_products) once it landed, fenced for the tensor cores' reads
            before a barrier."""
            q_landed()
            rewrite()
            b.fence_proxy_async()
            b.bar_sync(0)
        if quant is not None:       # e4m3: k_scale in the softmax scale, v_scale in 1/l
            k_scale, math.v_scale = quant.scales(b, work.kv_head)
            math.fold_k_scale(k_scale)
        if bars is None:            # wgmma's math takes none: its barriers' address, here
            bars = b.add(stage, stages * stage_bytes)
        assemble(b, "latent_tma", buffers=Buffers(stages, tile.smem, stage, stage, stage_bytes, bars=bars),
                 tiles=key_tiles,
                 loads=loads(q_rescaled if rewrite is not None else q_landed,
                             landed=staging.landed if staging else None),
                 math=prebuilt(math), transform_of=transform_of)
        return
    if isinstance(cfg, Tcgen05TileConfig):      # sm_100a: its MMA barriers after the TMA ones
        bars = b.add(tile.v_smem, stages * v_bytes)
        math = VarlenTcgen05Math(b, ctx, ptrs, strides, b.add(bars, barrier_bytes(stages)))
    else:
        math = VarlenWgmmaMath(b, ctx, ptrs, strides)
        bars = b.add(tile.v_smem, stages * v_bytes)
    assemble(b, "tma", buffers=Buffers(stages, tile.smem, tile.k_smem, tile.v_smem, kv_bytes, v_bytes,
                                       0, bars),   # Q came by cp.async
             tiles=key_tiles, loads=loads(), math=prebuilt(math), transform_of=transform_of)


def emit_ws_tile(b: KernelBuilder, cfg, tile, ctx, copies, tail_rows, key_tiles: KeyTiles,
                       transform_of, make_math) -> None:
    """The packed tile warp-specialised on sm_90a (tile.warp_specialize; tma_ws_pipeline.py):
    warps 0 .. 4C-1 compute (C = block_m / 64 consumer warpgroups, each warp its 16 rows as
    in the one-issuer tile), then a producer warpgroup whose first warp issues, at the CTAs
    per SM of cfg.min_ctas_per_sm (setmaxnreg's budgets are shares of that). Its lanes share
    a tile's boxes (box k by lane (k + 1) mod 32, lane 0 arriving with the expect_tx) and load
    the page ids one K request ahead; the consumers' loop has no issue block and no CTA
    barrier: they wait full[s] and release empty[s]. Q was gathered by the consumers before
    the pipeline's first barrier (q_bytes 0). The rows of the last V tile at or past L are zeroed by the consumers once it
    landed, fenced for wgmma and published on their named barrier."""
    from ..mainloop.tma_ws_pipeline import CONSUMER_BARRIER

    def issue_setup():
        copy_tile, issuer = copies(ctx.lane, 32)
        return copy_tile, b.setp("eq", ctx.lane, 0), issuer

    def tail(v_tile: Reg) -> None:
        nvalid = tail_rows()
        with b.if_then(b.setp("lt", nvalid, cfg.block_n)):     # uniform over the consumers
            zero_tail_rows(b, cfg, ctx.tid, v_tile, nvalid)   # cfg.threads: the consumers
            b.fence_proxy_async()
            b.bar_sync(CONSUMER_BARRIER, cfg.threads)

    stages, kv_bytes, v_bytes = cfg.num_stages, cfg.kv_geom.bytes, cfg.v_geom.bytes
    bars = b.add(tile.v_smem, stages * v_bytes)
    assemble(b, "tma_ws", buffers=Buffers(stages, tile.smem, tile.k_smem, tile.v_smem, kv_bytes,
                                          v_bytes, 0, bars),    # Q came by cp.async
             tiles=key_tiles, loads=Loads(issue_setup=issue_setup, last_v_landed=tail),
             math=make_math, transform_of=transform_of, tid=ctx.tid, lane=ctx.lane,
             consumers=cfg.block_m // WARPGROUP_ROWS, pingpong=cfg.pingpong,
             ctas_per_sm=cfg.min_ctas_per_sm, uniform_roles=True)


def emit_seesaw(b: KernelBuilder, cfg, tile, ctx, copies, q_landed, tail_rows, key_tiles: KeyTiles,
                transform_of, math) -> None:
    """MLA's latent tile under the seesaw schedule (tile.seesaw; seesaw_pipeline.py): each
    warpgroup's four warps issue the boxes of its own tiles (every other one: their page ids
    step by 2), thread 0 of the warpgroup arriving with the expect_tx; the V tail is zeroed by
    the warpgroup that owns the last tile once it has landed, before its S (whose scores of
    those rows are masked) and its hand-over."""
    # warpgroup 1's predicate from lane 0's warp index: a value ptxas can prove warp-uniform,
    # so the loop's trip count and its branches around wgmma are not divergent paths (there
    # ptxas serialises every wgmma: C7520)
    second = b.setp("ge", b.shfl("idx", ctx.warp, 0), 4)
    t = b.and_(ctx.tid, WARPGROUP - 1)          # the thread's index in its warpgroup
    copy_tile, issuer = copies(b.and_(ctx.warp, 3), 4, b.selp(1, 0, second, U32), 2)
    kv_bytes = cfg.kv_geom.bytes

    def refill(j: Reg, off: Reg, bar: Addr) -> None:
        refill_phase(b, b.setp("eq", t, 0), issuer, kv_bytes=kv_bytes, k_smem=tile.k_smem,
                     v_smem=tile.k_smem, n_tiles=tile.n_tiles, copy_tile=copy_tile, k_tile=j,
                     k_off=off, v_tile=None, v_off=0, bar=bar)

    def tail(v_tile: Reg) -> None:
        nvalid = tail_rows()
        with b.if_then(b.setp("lt", nvalid, cfg.block_n)):     # warpgroup-uniform
            zero_tail_rows(b, cfg, t, v_tile, nvalid, threads=WARPGROUP)
            b.fence_proxy_async()
            warpgroup_barrier(b, second)   # the writes before any of its warps' wgmma reads

    bars = b.add(tile.k_smem, SEESAW_STAGES * kv_bytes)
    slots = b.add(ctx.q_smem, cfg.smem_bytes - cfg.seesaw_exchange_bytes)
    assemble(b, "latent_seesaw", buffers=Buffers(SEESAW_STAGES, tile.smem, tile.k_smem, tile.k_smem,
                                                 kv_bytes, bars=bars),
             tiles=key_tiles, loads=Loads(leader=b.setp("eq", ctx.tid, 0), q_landed=q_landed,
                                          last_v_landed=tail),
             math=prebuilt(math), transform_of=transform_of, second=second, refill=refill,
             exchange=lambda m: SeesawExchange(b, m, slots, t, second))


__all__ = ["emit_tma_tile", "tensor_map_params"]
