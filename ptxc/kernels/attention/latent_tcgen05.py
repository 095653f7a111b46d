"""MLA's latent tile on sm_100a's tcgen05 (`LatentTcgen05Config`): when a latent spec runs on it
(`latent_tcgen05`, `applies_latent_tcgen05`), how its rows arrive (`tcgen05_loads`) and its
stages (`configure_latent_tcgen05`). The bodies are bodies/varlen_tma.py's latent branch (TMA
boxes) and bodies/varlen_wgmma.py's (the threads' cp.async: e4m3_ds rows, sparse slots), both
with math/tcgen05.py's math.

Tensor memory holds 128 lanes x 512 f32 columns per SM, and a 64-row tile's O over the 512
latent columns would take all of them with no room for S and P. So the value columns are split
between two CTAs of the same rows (grid z, `value_ctas`): each computes the whole S = Q·Kᵀ
(576 deep) from the same latent tile and owns 256 columns of O (its P·V reads V's slabs from
4 z on), as sm_90a's two warpgroups split them inside one CTA. A latent row is read from
global memory by both, so once per 32 head rows of a tile -- the same L2 traffic per head row
as the wgmma tile's 64 rows with one read (its two warpgroups share the CTA's copy)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...targets import TARGETS
from .. import common as C
from ..config.prefill import PrefillConfig
from ..config.tcgen05 import PIN_REGISTERS, TCGEN05_TARGETS
from ..kv.kv_access import KVAccess, sparse_keys
from ..kv.kv_fp8 import GroupScaledRows, group_scaled, kind
from ..kv.kv_fp8_stage import f16_math_applies
from ..mainloop.dequant_pipeline import THREADS as DEQUANT_THREADS, TILES as DEQUANT_TILES
from ..mainloop.tma_pipeline import MBARRIER_BYTES
from ..math.umma import mma_region_bytes
from .latent_tile import LatentFP8Rows
from .variant import head_dim_v, spec_option
from .varlen_tile import Tcgen05TileConfig, tma_applies

LATENT_ROWS = 64             # tcgen05.mma M = 64: the family's 64-row latent tile
                             # (varlen_config.latent_block_m)
LATENT_DV = 512              # two CTAs of 256 value columns (tcgen05's widest N)
VALUE_CTAS = 2
DEFAULT_BLOCK_N = 32
# tiles j - 1 (P·V) and j (S) are read while the rest land (tma_pipeline.run_latent_tma_pipeline,
# wgmma_pipeline.run_latent_wgmma_pipeline): three stages keep one tile in flight, four two
MIN_STAGES, MAX_STAGES = 3, 4


@dataclass(frozen=True)
class LatentTcgen05Config(LatentFP8Rows, Tcgen05TileConfig):
    """The 64-row latent tile on tcgen05: four softmax warps (M = 64, data-path layout F), one
    swizzled latent tile per stage serving S and P·V -- TMA boxes on one mbarrier per stage, or
    the threads' cp.async (kv_loads); FP8 rows staged raw and converted by a dequantising
    warpgroup into a ring of three 16-bit tiles, or by every warp into two alternating ones --
    S (block_n), P (block_n / 2) and this CTA's 256 columns of O in tensor memory; v_split =
    value_ctas = 2 CTAs of the same rows (grid z) own half of O each."""

    rows: GroupScaledRows | None = None    # e4m3_ds: whole 656-byte rows staged (scales, RoPE)
    # FP8 rows the threads copy: a warpgroup of its own copies and converts them into a ring of
    # DEQUANT_TILES converted tiles (mainloop/dequant_pipeline.py), the softmax warps only read
    dequant_warpgroup: bool = False
    # sm_90a's e4m3 score products over the dequantising warpgroup's tiles: not on this tile
    qk_e4m3: ClassVar[bool] = False
    qk_direct: ClassVar[bool] = False
    # 128 softmax + 128 converting threads: 255 registers each at one CTA per SM, no setmaxnreg
    producer_regs: ClassVar[None] = None
    consumer_regs: ClassVar[None] = None

    @property
    def value_ctas(self) -> int:
        return self.v_split

    @property
    def launch_threads(self) -> int:
        return super().launch_threads + (DEQUANT_THREADS if self.dequant_warpgroup else 0)

    @property
    def converted_bytes(self) -> int:
        return self.kv_geom.bytes

    @property
    def smem_bytes(self) -> int:
        """Q (one swizzled 64 x head_dim tile), the latent stages -- or, FP8, the converted
        16-bit tiles (S reads tile j while P·V reads j - 1; the dequantising warpgroup writes
        j + 1) and the stages of raw bytes -- a full mbarrier per stage where TMA loads them
        (the ring's full and empty ones under a dequantising warpgroup), then the MMA barriers
        (umma.py)."""
        stages = self.converted_tiles * self.kv_geom.bytes + self.num_stages * self.staging_geom.bytes \
            if self.fp8 else self.num_stages * self.kv_geom.bytes
        bars = 2 * DEQUANT_TILES if self.dequant_warpgroup else self.num_stages if self.tma else 0
        return (self.q_region_bytes + stages + bars * MBARRIER_BYTES + mma_region_bytes(1)
                + self.slot_ring_bytes)    # sparse top-k's slot ring last (slot_ring_offset)


def tcgen05_loads(spec) -> str:
    """How the tile's rows arrive: TMA boxes for a dense cache of the dtype -- or of e4m3 with
    tile.kv_loads = "tma" or dequant_warpgroup = false -- where the layout allows (contiguous,
    or pages of >= 8 rows that are a power of two or a multiple of 64); the threads' cp.async
    for FP8 rows a dequantising warpgroup converts, e4m3_ds rows (656 bytes: no box width
    divides them), sparse slots (a gather, not a box), other page sizes, or given
    tile.kv_loads = "cp_async"."""
    kv = KVAccess(spec.opt("kv_layout"), C.FORMATS[spec.dtype], spec.opt("page_size") or 0)
    tma = (spec.tile_dict().get("kv_loads", "tma") == "tma" and group_scaled(spec) is None
           and not sparse_keys(spec) and tma_applies(kv) and not dequant_warpgroup(spec))
    return "tma" if tma else "cp_async"


def dequant_warpgroup(spec) -> bool:
    """tile.dequant_warpgroup (the default) over FP8 rows (e4m3, e4m3_ds), dense or sparse,
    that the threads copy -- not given kv_loads = "tma": a warpgroup of its own copies (sparse:
    gathers through the slot ring, publishing each tile's valid rows) and converts them, as on
    sm_90a (mainloop/dequant_pipeline.py), so the four softmax warps run the loop of a cache
    of the dtype. Chosen on static figures, not timed (docs/performance.md "MLA decode": the
    softmax warps' loop falls to about the bf16 tile's)."""
    given = spec.tile_dict()
    return (bool(given.get("dequant_warpgroup", True)) and kind(spec) is not None
            and given.get("kv_loads") != "tma")


def min_stages(spec) -> int:
    """The fewest stages the tile runs with: three (tiles j - 1 and j read, one landing), or one
    staging buffer under a dequantising warpgroup (its converted tiles are the ring)."""
    return 1 if dequant_warpgroup(spec) else MIN_STAGES


def latent_tcgen05(spec, target) -> bool:
    """Whether a latent spec's tile runs on tcgen05 for `target` once it holds 64 head rows:
    sm_100a / sm_103a, f16/bf16, a latent cache of the dtype, of e4m3 bytes (one scale) or of
    e4m3_ds rows, dense or sparse, kv_lora_rank 512 with whole 64-column slabs of RoPE, the
    fewest stages it runs with (min_stages: tile.num_stages 2 keeps the mma.sync kernel where
    every warp converts) fitting in shared memory (e4m3_ds rows with 128 RoPE columns and every
    warp converting do not: they keep it too), no custom mask."""
    least = min_stages(spec)
    return (target.name in TCGEN05_TARGETS and spec.dtype in ("f16", "bf16")
            and kind(spec) in (None, "e4m3")
            and head_dim_v(spec) == LATENT_DV and spec.head_dim % 64 == 0
            and spec_option(spec, "custom_mask") in (None, "none")
            and spec.tile_dict().get("num_stages", least) >= least
            and _config(spec, least).smem_bytes <= target.max_smem_per_cta)


def applies_latent_tcgen05(spec, target, cfg: PrefillConfig, kv: KVAccess) -> bool:
    """Whether the mma.sync latent tile `cfg` runs on tcgen05 for `target`: latent_tcgen05, and
    64 head rows (the family's tile where the heads fill it: 64 or more). Elsewhere -- 16 or 32
    heads, and sparse top-k on a kernel with a target whose mma.sync tile stops at 32 rows --
    the mma.sync tile runs."""
    return cfg.shared_kv and cfg.block_m == LATENT_ROWS and latent_tcgen05(spec, target)


def configure_latent_tcgen05(spec, cfg: PrefillConfig, kv: KVAccess) -> LatentTcgen05Config:
    """applies_latent_tcgen05's tile: block_n 32 (given: 16 or 32), tile.num_stages or the most
    up to four that fit (DeepSeek's 576 columns: 72 KiB of Q and four 36 KiB latent tiles)."""
    stages = spec.tile_dict().get("num_stages", MAX_STAGES)
    limit = TARGETS["sm_100a"].max_smem_per_cta
    while stages > min_stages(spec) and _config(spec, stages).smem_bytes > limit:
        stages -= 1
    return _config(spec, stages)


def _config(spec, stages: int) -> LatentTcgen05Config:
    bn = spec.tile_dict().get("block_n", DEFAULT_BLOCK_N)
    # FP8: the rows land raw and are converted into 16-bit tiles (dequant_warpgroup); a bf16
    # kernel's products take f16 inputs (Q rescaled per row) as on the other tiles, except over
    # e4m3_ds rows (a group scale times e4m3 can leave f16's range)
    return LatentTcgen05Config(C.FORMATS[spec.dtype], spec.head_dim, True, LATENT_ROWS, bn,
                               LATENT_ROWS // 16, stages, False, head_dim_v(spec), VALUE_CTAS,
                               shared_kv=True, kv_loads=tcgen05_loads(spec),
                               min_ctas_per_sm=PIN_REGISTERS, fp8=kind(spec) is not None,
                               f16_math=f16_math_applies(spec), rows=group_scaled(spec),
                               q_e4m3=spec_option(spec, "qk_products") == "e4m3",
                               dequant_warpgroup=dequant_warpgroup(spec),
                               slot_ring=bool(sparse_keys(spec)))
