"""The varlen family's tile: how many query rows, keys and stages a CTA takes on a target
(`configure`), the head rows of a wide latent (MLA) tile (`latent_block_m`, which tries
`configure` at each size), and where the KV rows live (`kv_access`). varlen.py holds the
family's fields, checks, interface and launch list; mla.py configures through the same rules."""

from __future__ import annotations

import dataclasses
import math

from ...errors import SpecError
from ...spec.model import KernelSpec
from ...targets import TARGETS, Target
from .. import common as C
from ..attention.mask_tiles import classified_tiles
from ..attention.latent_tcgen05 import latent_tcgen05
from ..attention.latent_tile import latent_wgmma
from ..attention.variant import head_dim_v, spec_option
from ..config.prefill import PrefillConfig, _check_shape, value_split
from ..config.register_floor import narrow_block_n, needs_floor
from ..kv import kv_fp8, kv_fp8_stage
from ..kv.kv_access import KVAccess, latent_cache, sparse_keys
from ..math import fp8, mma_qk8


def page_size(spec: KernelSpec) -> int:
    return spec.opt("page_size") or 16


def configure(spec: KernelSpec, target: Target | None) -> PrefillConfig:
    """Tiles: block_m 64 (4 warps) whatever the target, so the grid and the "auto" split rule
    are target-independent (above head_dim 256 four warps share 16 rows: value_split); block_n
    64 (32 above head_dim 128, 16 above 256: 32 spilled on sm_80); 2 stages (FP8 caches
    staged by cp.async: kv_fp8_stage.default_stages), fewer to fit. A latent cache (MLA) above
    256 columns takes latent_block_m's rows instead, and with them the most stages that fit."""
    given = spec.tile_dict()
    vsplit = value_split(head_dim_v(spec), True)
    latent = latent_cache(spec)     # MLA: one tile per stage, at least two stages (kv_pipeline.py)
    wide = latent and vsplit > 1 and "block_m" not in given and "num_warps" not in given
    bm = given.get("block_m") or (latent_block_m(spec) if wide else 16 * given.get("num_warps", 4) // vsplit)
    if sparse_keys(spec) and "block_m" not in given:   # a tile holds one token's heads
        bm = math.gcd(bm, spec.num_heads)
        # ... and one warp's 32 threads cannot copy a Q row of more 16-byte chunks
        # (tiles.thread_slot: a thread a chunk; 16 heads of 256 + 32 columns): warps share the
        # 16 rows instead, each with a slice of O's columns and of Q·Kᵀ's depth, as above 256
        # value columns
        row_chunks = -(-spec.head_dim * C.FORMATS[spec.dtype].bytes // 16)
        while ("num_warps" not in given and bm // 16 * vsplit * 32 < row_chunks and vsplit < 4
               and head_dim_v(spec) // 8 % (2 * vsplit) == 0):
            vsplit *= 2
    warps = given.get("num_warps") or bm // 16 * vsplit
    bn = given.get("block_n") or narrow_block_n(
        spec.family, spec, target, 64 if spec.head_dim <= 128 else 32 if spec.head_dim <= 256 else 16)
    if "block_n" not in given and tree_on_wgmma(spec, target) and (
            spec.head_dim == 128 or given.get("warp_specialize")):
        # the tree's per-row state on top of a 64 x 64 S: 255 registers, spills with a variant;
        # on the producer warpgroup's tile (128 registers before the consumers' setmaxnreg) at d64
        bn = 32
    smem_limit = target.max_smem_per_cta if target is not None else 1 << 30
    cp_async = target.has_cp_async if target is not None else True
    # FP8 caches staged by cp.async (kv_fp8_stage.py) take the most stages that keep the CTAs
    # per SM two stages allow (their stages are half an f16 tile each), and .minnctapersm 1:
    # left alone, ptxas caps 4-warp CTAs at 168 registers (three per SM, which shared memory
    # never allows them) and spills the dequantisation
    staged = kv_fp8_stage.applies(spec)
    # MLA's 512-wide V: the four warps sharing 16 rows split the 576-deep Q·Kᵀ between them
    split_scores = latent and vsplit > 1 and -(-spec.head_dim // 16) % vsplit == 0
    config_type = kv_fp8_stage.StagedFP8Config if staged else PrefillConfig
    # e4m3_ds: whole rows staged; per-tensor / per-head scales under bf16: f16 products
    q_e4m3 = spec_option(spec, "qk_products") == "e4m3"
    rows = {"rows": kv_fp8.group_scaled(spec), "f16_math": kv_fp8_stage.f16_math_applies(spec),
            "q_e4m3": q_e4m3,
            # ... on FP8 tensor cores where mma.sync has them (math/mma_qk8.py)
            "qk_staged": q_e4m3 and latent and target is not None and fp8.has_fp8_mma(target)
            and mma_qk8.fits(spec.head_dim, vsplit if split_scores else 1, warps)} if staged else {}

    def make(stages=None):
        return config_type(C.FORMATS[spec.dtype], spec.head_dim, True, bm, bn, warps, stages, cp_async,
                           head_dim_v(spec), vsplit,
                           min_ctas_per_sm=1 if staged or needs_floor(spec.family, spec, target) else 0,
                           shared_kv=latent, score_split=split_scores, mask_tiles=classified_tiles(spec),
                           slot_ring=bool(sparse_keys(spec)) and warps <= RING_MAX_WARPS, **rows)

    stages = given.get("num_stages") or (   # a wide latent tile is one CTA per SM: all it holds
        kv_fp8_stage.default_stages(make, target) if (staged or bm > 16 and wide) and target is not None else 2)
    cfg = make(stages)
    while cfg.smem_bytes > smem_limit:
        if "num_stages" not in given and stages > 1 + latent:
            stages -= 1
        elif "block_n" not in given and bn > 16:
            bn //= 2
        else:
            raise SpecError(f"tile block_m={bm}, block_n={bn}, num_stages={stages} needs "
                            f"{cfg.smem_bytes} bytes of shared memory; {target} allows "
                            f"{smem_limit} per CTA: use a smaller tile", key="tile.block_n")
        cfg = make(stages)
    if target is not None:
        _check_shape(cfg, target)
        from ..bodies import packed_paths   # the same tile on wgmma / tcgen05 where one applies
        return packed_paths.configure(spec, target, cfg, kv_access(spec))
    return cfg


def tree_on_wgmma(spec: KernelSpec, target: Target | None) -> bool:
    """A tree mask on sm_90a's wgmma body (varlen_tile.applies decides the rest)."""
    from ..config.wgmma import uses_wgmma
    return spec.opt("custom_mask") == "tree" and target is not None and uses_wgmma(spec, target)


# FlashMLA's head rows per CTA: a latent row read from global memory serves 64 query heads
WIDE_LATENT_ROWS = 64
# Sparse top-k's slot ring (kv_pages.SparseSlots) where its registers fit: up to 8 warps. A
# 16-warp CTA has 128 registers a thread and spills it, so there (tile.block_m = 64) each copy
# loads its rows' slots itself, as before the ring.
RING_MAX_WARPS = 8


def latent_block_m(spec: KernelSpec) -> int:
    """Head rows per CTA of a latent cache above 256 columns (four warps per 16 rows): as many as
    the heads fill, up to WIDE_LATENT_ROWS (16 warps, 128 registers each: the whole register
    file of an SM), where every target of the spec holds that tile in shared memory (sm_80,
    sm_90, sm_100: about 128 KiB; the 99 KiB parts, sm_86/89/120, keep 16 rows), so the grid
    and the "auto" split rule stay target-independent. Sparse top-k takes at most 32 -- at 64
    rows x 128 registers the slot ring (kv_pages.SparseSlots) spills -- unless every target
    runs the sm_90a wgmma tile (latent_tile.latent_wgmma: 8 warps of up to 255 registers) or
    the sm_100a tcgen05 one (latent_tcgen05.latent_tcgen05: O in tensor memory)."""
    rows = 16
    cap = 32 if sparse_keys(spec) else WIDE_LATENT_ROWS
    if all(latent_wgmma(spec, TARGETS[t]) or latent_tcgen05(spec, TARGETS[t]) for t in spec.targets):
        cap = WIDE_LATENT_ROWS       # the wgmma and tcgen05 tiles have the registers the mma.sync one lacks
    while rows * 2 <= min(cap, spec.num_heads):
        rows *= 2
    while rows > 16 and not all(_fits(spec, rows, TARGETS[t]) for t in spec.targets):
        rows //= 2
    return rows


def _fits(spec: KernelSpec, rows: int, target: Target) -> bool:
    try:
        configure(dataclasses.replace(spec, tile=tuple(sorted({**spec.tile_dict(), "block_m": rows}.items()))),
                  target)
    except SpecError:
        return False
    return True


def kv_access(spec: KernelSpec) -> KVAccess:
    layout = spec.opt("kv_layout")
    return KVAccess(layout, kv_fp8.kv_format(spec), page_size(spec) if layout == "paged" else 0,
                    latent=latent_cache(spec), sparse=sparse_keys(spec))


__all__ = ["configure", "kv_access", "latent_block_m", "page_size", "tree_on_wgmma",
           "RING_MAX_WARPS", "WIDE_LATENT_ROWS"]
