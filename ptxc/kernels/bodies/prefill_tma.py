"""The sm_90a wgmma prefill's body with its tiles fed by TMA (tile.kv_loads = "tma"): the
tensor-map copies of one elected thread (tma_pipeline.py), or of a producer warpgroup with
tile.warp_specialize = true (tma_ws_pipeline.py). Setup: prefill_cp_async.py; math: math/wgmma.py."""

from __future__ import annotations

from ...ir import S32, TMAP, Addr, KernelBuilder, Reg
from ...spec.model import KernelSpec
from ..base import LaunchParam, ParamSource
from ..config.wgmma import ROWS_PER_WARPGROUP, WgmmaConfig
from ..mainloop.tiles import SWIZZLE
from ..mainloop.tma_pipeline import run_tma_pipeline
from ..mainloop.tma_ws_pipeline import run_tma_ws_pipeline
from ..math.wgmma import WgmmaMath
from .prefill_cp_async import Setup, setup


def emit_tma_prefill(b, spec, cfg, ptrs, strides, seq_q, seq_k, tmaps: dict) -> None:
    """prefill_cp_async.emit_body with the tiles fed by TMA (from the same setup): one
    box per 128-byte column slab, coordinates {64 s, head, row, batch} (innermost first), issued
    by one elected thread (tma_pipeline.py) or by the producer warpgroup (tile.warp_specialize,
    tma_ws_pipeline.py)."""
    s = setup(b, spec, cfg, ptrs, strides, seq_q, seq_k)
    stages = cfg.num_stages
    ctx = s.ctx(spec, cfg, ptrs, strides, seq_q, seq_k)
    math = None if cfg.warp_specialize else WgmmaMath(b, ctx)   # (ws: in the consumer branch)
    copy_tile, key0_of = tile_copies(b, cfg, s, tmaps)

    k_bytes, v_bytes = cfg.kv_geom.bytes, cfg.v_geom.bytes
    bars = b.add(s.k_smem, stages * (k_bytes + v_bytes))
    if cfg.warp_specialize:
        run_tma_ws_pipeline(
            b, stages=stages, consumers=cfg.block_m // ROWS_PER_WARPGROUP,
            kv_bytes=k_bytes, v_bytes=v_bytes, q_bytes=cfg.q_geom.bytes, q_smem=s.smem,
            k_smem=s.k_smem, v_smem=s.v_smem, bars=bars, tid=s.tid, lane=s.lane,
            n_tiles=s.n_tiles, n_full=s.n_full, key0_of=key0_of, copy_tile=copy_tile,
            make_math=lambda: WgmmaMath(b, ctx), transforms=bool(s.variant.transforms),
            lo_full=s.lo_full, pingpong=cfg.pingpong)
        return
    run_tma_pipeline(b, stages=stages, kv_bytes=k_bytes, v_bytes=v_bytes, q_bytes=cfg.q_geom.bytes,
                     q_smem=s.smem, k_smem=s.k_smem, v_smem=s.v_smem, bars=bars,
                     leader=b.setp("eq", s.tid, 0), n_tiles=s.n_tiles, n_full=s.n_full,
                     key0_of=key0_of, copy_tile=copy_tile, math=math, lo_full=s.lo_full,
                     transform=math.transform if s.variant.transforms else None)
    math.epilogue()


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

    def copy_tile(t: str, tile, dst: Reg, bar) -> None:
        row0, rows = (s.m_start, cfg.block_m) if t == "q" else (key0_of(tile), bn)
        h, n = coords[t]
        row0 = b.bitcast(row0, S32)
        width = cfg.dv if t == "v" else cfg.head_dim
        for k in range(width // slab_cols):
            b.tma_load(Addr(dst, k * rows * SWIZZLE), addr[t], [k * slab_cols, h, row0, n], bar)
    return copy_tile, key0_of


def tensor_map_params(b: KernelBuilder, spec: KernelSpec, cfg: WgmmaConfig, params: list) -> dict:
    """The q/k/v tensor-map parameters of the TMA loads (appended to `params`): one box is a
    64-element (128-byte) column slab of block_m (Q) or block_n (K, V) rows of one head."""
    maps = {}
    for t, rows in (("q", cfg.block_m), ("k", cfg.block_n), ("v", cfg.block_n)):
        box = (SWIZZLE // cfg.fmt.bytes, 1, rows, 1)    # innermost first: d, head, seq, batch
        src = ParamSource("tensor_map", tensor=t, box=box, swizzle=SWIZZLE)
        params.append(LaunchParam(f"{t}_tmap", TMAP, src))
        maps[t] = b.param(f"{t}_tmap", TMAP)
    return maps
