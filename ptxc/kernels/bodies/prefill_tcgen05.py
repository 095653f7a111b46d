"""The sm_100a / sm_103a tcgen05 prefill body: prefill_tma.py's one-issuer schedule with
Tcgen05Math, or with tile.warp_specialize the load / MMA / softmax warps of
tcgen05_ws_pipeline.py. Layout and math: math/tcgen05.py; tile: config/tcgen05.py."""

from __future__ import annotations

from ...ir import KernelBuilder
from ...spec.model import KernelSpec
from ..config.tcgen05 import Tcgen05Config
from ..mainloop.tcgen05_ws_pipeline import run_tcgen05_ws_pipeline
from ..mainloop.tma_pipeline import barrier_bytes, run_tma_pipeline
from ..math.tcgen05 import Tcgen05Math
from ..math.umma import UmmaIssue
from .prefill_cp_async import Setup, setup
from .prefill_tma import tensor_map_params, tile_copies


def emit_body(b: KernelBuilder, spec: KernelSpec, cfg: Tcgen05Config, ptrs, strides, seq_q,
              seq_k, tmaps: dict) -> None:
    """prefill_tma.emit_tma_prefill's one-issuer body with Tcgen05Math, or with
    tile.warp_specialize the load / MMA / softmax warps of tcgen05_ws_pipeline.py."""
    s: Setup = setup(b, spec, cfg, ptrs, strides, seq_q, seq_k)
    ctx = s.ctx(spec, cfg, ptrs, strides, seq_q, seq_k)
    k_bytes, v_bytes, stages = cfg.kv_geom.bytes, cfg.v_geom.bytes, cfg.num_stages
    bars = b.add(s.k_smem, stages * (k_bytes + v_bytes))
    mma_bars = b.add(bars, barrier_bytes(stages, cfg.warp_specialize))
    if cfg.warp_specialize:
        copy_tile, key0_of = tile_copies(b, cfg, s, tmaps)
        run_tcgen05_ws_pipeline(
            b, stages=stages, kv_bytes=k_bytes, v_bytes=v_bytes, q_bytes=cfg.q_geom.bytes,
            q_smem=s.smem, k_smem=s.k_smem, v_smem=s.v_smem, bars=bars, mma_bars=mma_bars,
            tid=s.tid, lane=s.lane, warp0=b.setp("eq", b.shfl("idx", s.warp, 0), 0),
            columns=cfg.tmem_columns, n_tiles=s.n_tiles, n_full=s.n_full, key0_of=key0_of,
            copy_tile=copy_tile, make_math=lambda tmem: Tcgen05Math(b, ctx, mma_bars, tmem),
            make_issue=lambda tmem: UmmaIssue(b, cfg, s.smem, tmem, mma_bars, hoist=True),
            transforms=bool(s.variant.transforms), lo_full=s.lo_full)
        return
    math = Tcgen05Math(b, ctx, mma_bars)
    copy_tile, key0_of = tile_copies(b, cfg, s, tmaps)
    run_tma_pipeline(b, stages=stages, kv_bytes=k_bytes, v_bytes=v_bytes,
                     q_bytes=cfg.q_geom.bytes, q_smem=s.smem, k_smem=s.k_smem, v_smem=s.v_smem,
                     bars=bars, leader=math.issuer, n_tiles=s.n_tiles, n_full=s.n_full,
                     key0_of=key0_of, copy_tile=copy_tile, math=math, lo_full=s.lo_full,
                     transform=math.transform if s.variant.transforms else None)
    math.epilogue()


def build_body(b, spec, cfg, ptrs, strides, seq_q, seq_k, params) -> None:
    emit_body(b, spec, cfg, ptrs, strides, seq_q, seq_k, tensor_map_params(b, spec, cfg, params))
