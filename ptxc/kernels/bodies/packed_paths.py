"""The GQA-packed tile's paths -- varlen's, decode's tensor-core path's and MLA's body -- in one
table, most specific first: which instruction set and main loop a (spec, target) gets, how its
tile is configured, and which body builds it.

  tcgen05 latent (sm_100a, MLA) varlen_tma.py's latent branch (TMA) or varlen_wgmma.py
                                (cp.async: e4m3_ds rows, sparse slots) with math/tcgen05.py's
                                math: a latent tile per stage, two CTAs sharing the rows (grid z)
  tcgen05 (sm_100a / sm_103a)   varlen_tma.py's body with math/tcgen05.py's math, TMA loads
  wgmma latent (sm_90a, MLA)    varlen_tma.py (TMA: dense and e4m3 rows) or varlen_wgmma.py
                                (cp.async: e4m3_ds rows, sparse slots), a latent tile per stage
  wgmma (sm_90a)                varlen_tma.py (TMA loads, the default where the layout allows)
                                or varlen_wgmma.py (per-thread cp.async: pages < 8 rows, FP8)
  mma.sync (every other case)   varlen_mma.py, the cp.async pipeline of kv_pipeline.py

The family configures the mma.sync tile first (its block_m / block_n / stages fix the grid and
the split rule on every target); `configure` then moves it onto the first path that applies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ...errors import SpecError
from .. import common as C
from ..attention import latent_tcgen05 as ltc
from ..attention import latent_tile as lt
from ..attention import varlen_tile as vt
from ..config.prefill import PrefillConfig
from ..kv import kv_fp8
from .varlen_mma import emit_mma_tile
from .varlen_tma import emit_tma_tile
from .varlen_wgmma import emit_wgmma_tile


@dataclass(frozen=True)
class PackedPath:
    name: str
    applies: Callable       # (spec, target, mma.sync cfg, kv) -> bool
    configure: Callable     # (spec, mma.sync cfg, kv) -> this path's config
    config_type: type       # what `configure` returns: how a built config names its path
    body: Callable          # (b, spec, cfg, kv, ptrs, strides, work, split_count, quant, tmaps, mask_bytes)


def _tma_body(b, spec, cfg, kv, ptrs, strides, work, split_count, quant, tmaps, mask_bytes):
    emit_tma_tile(b, spec, cfg, kv, ptrs, strides, work, split_count, tmaps, mask_bytes, quant)


def _wgmma_body(b, spec, cfg, kv, ptrs, strides, work, split_count, quant, tmaps, mask_bytes):
    if cfg.tma:      # tile.kv_loads = "tma": K/V tiles by TMA boxes
        _tma_body(b, spec, cfg, kv, ptrs, strides, work, split_count, quant, tmaps, mask_bytes)
    else:
        emit_wgmma_tile(b, spec, cfg, kv, ptrs, strides, work, split_count, quant, mask_bytes)


def _mma_body(b, spec, cfg, kv, ptrs, strides, work, split_count, quant, tmaps, mask_bytes):
    emit_mma_tile(b, spec, cfg, kv, ptrs, strides, work, split_count, quant, mask_bytes)


PATHS = (
    PackedPath("the sm_100a tcgen05 latent tile", ltc.applies_latent_tcgen05,
               ltc.configure_latent_tcgen05, ltc.LatentTcgen05Config, _wgmma_body),
    PackedPath("the sm_100a tcgen05 tile", vt.applies_tcgen05,
               lambda spec, cfg, kv: vt.configure_tcgen05(spec, cfg), vt.Tcgen05TileConfig, _tma_body),
    PackedPath("the sm_90a wgmma latent tile", lt.applies_latent, lt.configure_latent,
               lt.LatentWgmmaConfig, _wgmma_body),
    PackedPath("the sm_90a wgmma tile", vt.applies, vt.configure, vt.WgmmaTileConfig, _wgmma_body),
    PackedPath("the mma.sync tile", lambda spec, target, cfg, kv: True, lambda spec, cfg, kv: cfg,
               PrefillConfig, _mma_body),
)


def configure(spec, target, cfg: PrefillConfig, kv) -> PrefillConfig:
    """The mma.sync tile `cfg` on the first path that applies to `target`."""
    path = next(p for p in PATHS if p.applies(spec, target, cfg, kv))
    return path.configure(spec, cfg, kv)


def path_of(cfg: PrefillConfig) -> PackedPath:
    """The path a configured tile belongs to (table order: the most specific type first)."""
    return next(p for p in PATHS if isinstance(cfg, p.config_type))


def emit_packed_tile(b, spec, cfg: PrefillConfig, kv, ptrs: dict, strides: dict, work,
                     split_count, quant=None, tmaps: dict | None = None, mask_bytes=None) -> None:
    """One GQA-packed query tile of the work `work` (a scheduler's TileWork) on cfg's path."""
    path_of(cfg).body(b, spec, cfg, kv, ptrs, strides, work, split_count, quant, tmaps, mask_bytes)


def check_tile_keys(spec, configs: list) -> None:
    """The packed tile's path keys given where no target's path takes them (`configs`: the
    spec's tile on each of its targets): one-line errors naming the key."""
    tile, targets = spec.tile_dict(), ", ".join(spec.targets)
    if tile.get("kv_loads") == "tma" and kv_fp8.kind(spec):
        raise SpecError(f"kv_loads = \"tma\" with kv_dtype {spec.opt('kv_dtype')!r}: TMA copies bytes "
                        f"as they are, and FP8 tiles are dequantised after cp.async lands them; "
                        f"allowed: \"cp_async\" or drop the key", key="tile.kv_loads")
    if tile.get("correction") and not any(isinstance(c, vt.Tcgen05TileConfig) for c in configs):
        raise SpecError(f"correction = true with dtype {spec.dtype}, head_dim "
                        f"{spec.head_dim}, targets {targets}: only the sm_100a "
                        f"tcgen05 kernel has correction warps (f16/bf16 caches loaded by TMA, "
                        f"head_dim and head_dim_v 64, 128, 192 or 256, block_m 64 or 128); "
                        f"{C.path_key_fix(spec.targets, ('sm_100a', 'sm_103a'))}", key="tile.correction")

    def specialised(cfg) -> bool:   # tcgen05's roles, or the sm_90a TMA tile's producer
        return isinstance(cfg, vt.Tcgen05TileConfig) or (
            isinstance(cfg, vt.WgmmaTileConfig) and not isinstance(cfg, lt.LatentWgmmaConfig)
            and cfg.tma)
    if tile.get("warp_specialize") and not any(specialised(c) for c in configs):
        raise SpecError(f"warp_specialize = true with dtype {spec.dtype}, head_dim "
                        f"{spec.head_dim}, kv_dtype {kv_fp8.kv_dtype(spec)}, targets "
                        f"{targets}: only the kernels fed by TMA have a "
                        f"producer (the sm_90a wgmma tile: f16/bf16 caches, contiguous or "
                        f"pages of >= 8 rows, head_dim and head_dim_v 64, 128, 192 or 256, "
                        f"block_m 64 or 128; the sm_100a tcgen05 tile); "
                        f"{C.path_key_fix(spec.targets, ('sm_90a', 'sm_100a', 'sm_103a'))}",
                        key="tile.warp_specialize")
    if tile.get("pingpong") and not any(getattr(c, "pingpong", False) for c in configs):
        raise SpecError(f"pingpong = true with block_m {tile.get('block_m', 64)}, "
                        f"targets {targets}: the consumers' ping-pong needs the "
                        f"sm_90a warp-specialised TMA tile with two consumer warpgroups "
                        f"(block_m = 128, num_warps = 8, warp_specialize = true); "
                        f"{'add them' if 'sm_90a' in spec.targets else 'add sm_90a'} or drop the "
                        f"key", key="tile.pingpong")
    if tile.get("kv_loads") == "tma" and not any(isinstance(c, vt.WgmmaTileConfig) for c in configs):
        raise SpecError(f"kv_loads = \"tma\" with dtype {spec.dtype}, head_dim "
                        f"{spec.head_dim}, targets {targets}: TMA feeds only "
                        f"the sm_90a wgmma kernel (f16/bf16 caches, head_dim and head_dim_v "
                        f"64, 128, 192 or 256, block_m 64 or 128) and the sm_100a tcgen05 "
                        f"one (head_dim 64 or 128); "
                        f"{C.path_key_fix(spec.targets, ('sm_90a', 'sm_100a', 'sm_103a'))}",
                        key="tile.kv_loads")
