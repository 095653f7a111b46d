"""MLA's latent tile on sm_90a's wgmma (`LatentWgmmaConfig`): when a latent spec runs on it
(`latent_wgmma`, `applies_latent`), how its rows arrive (`latent_loads`: TMA boxes or the
threads' copies; FP8 rows converted by every warp or by a dequantising warpgroup,
`dequant_warpgroup`), whether the warpgroups split Q·Kᵀ (`split_by_default`) and how many
stages fit (`configure_latent`). The packed tile it specialises is varlen_tile.py's; the body
is bodies/varlen_wgmma.py (cp.async, dequantising) or bodies/varlen_tma.py (TMA, seesaw)."""

from __future__ import annotations

from dataclasses import dataclass

from ...targets import TARGETS
from .. import common as C
from ..config.prefill import PrefillConfig
from ..config.wgmma import ROWS_PER_WARPGROUP, WGMMA_TARGETS
from ..kv.kv_access import KVAccess, sparse_keys
from ..kv.kv_fp8 import GroupScaledRows, group_scaled, kind
from ..kv.kv_fp8_direct import DIRECT_STAGES, direct_applies
from ..kv.kv_fp8_stage import StagingGeom, f16_math_applies
from ..mainloop.tiles import CHUNK, SwizzledGeom
from ..mainloop.dequant_pipeline import THREADS as DEQUANT_THREADS, TILES as DEQUANT_TILES
from ..mainloop.seesaw_pipeline import SEESAW_STAGES
from ..mainloop.tma_pipeline import MBARRIER_BYTES
from ..mainloop.tma_ws_pipeline import raised_regs
from ..math.seesaw import seesaw_slot_bytes
from .variant import head_dim_v, spec_option
from .varlen_tile import WgmmaTileConfig, tma_applies


class LatentFP8Rows:
    """Mixed into a latent tile's config (sm_90a's LatentWgmmaConfig, sm_100a's
    LatentTcgen05Config; fields `rows`, `dequant_warpgroup`): where its FP8 rows land and who
    converts them."""

    @property
    def converted_tiles(self) -> int:
        """FP8 rows: the converted tiles in shared memory -- two alternating (iteration j reads
        tile j and j - 1), or the dequantising warpgroup's ring of three (it writes j + 1)."""
        return DEQUANT_TILES if self.dequant_warpgroup else 2

    @property
    def copy_threads(self) -> int:
        """The threads that copy (and convert) the latent rows."""
        return DEQUANT_THREADS if self.dequant_warpgroup else self.threads

    @property
    def staging_geom(self) -> StagingGeom:
        """A stage's raw bytes: block_n rows of head_dim bytes, or e4m3_ds's whole rows."""
        return StagingGeom(self.block_n, self.rows.row_bytes if self.rows else self.head_dim, self.copy_threads)

    @property
    def fp8_box_bytes(self) -> int:
        """TMA-staged FP8 rows: the widest box (at most 256 one-byte columns, a multiple of 16
        bytes) that divides a row: 192 for DeepSeek's 576-byte rows."""
        return max(w for w in range(CHUNK, 257, CHUNK) if self.head_dim % w == 0)


@dataclass(frozen=True)
class LatentWgmmaConfig(LatentFP8Rows, WgmmaTileConfig):
    """MLA's latent tile on wgmma (sm_90a, f16/bf16 caches): 64 head rows, two warpgroups that
    each compute the whole S = Q·Kᵀ (576 deep) and own half of O's 512 columns (v_split 2:
    64 x 256 f32, 128 registers a thread); one swizzled latent tile per stage serves both
    products (V: its first 512 columns, warpgroup p's from slab 4p), copied by cp.async
    (wgmma_pipeline.run_latent_wgmma_pipeline) or as TMA boxes (kv_loads "tma", latent_loads:
    a dense cache of the dtype by default, e4m3 rows into the FP8 staging when given;
    tma_pipeline.run_latent_tma_pipeline) on one mbarrier per stage after the stages."""

    rows: GroupScaledRows | None = None    # e4m3_ds: whole 656-byte rows staged (scales, RoPE)
    # the warpgroups split Q·Kᵀ's depth and exchange partial scores (math/wgmma.py), at the end
    # of shared memory: each computes half of S instead of all of it
    split_scores: bool = False
    # FlashMLA's seesaw schedule (math/seesaw.py, mainloop/seesaw_pipeline.py): the warpgroups
    # take alternate tiles' S and softmax and hand each other P and the row max
    seesaw: bool = False
    # FP8 rows: a third warpgroup copies and dequantises them into a ring of DEQUANT_TILES
    # converted tiles, the two computing warpgroups only read those (dequant_pipeline.py)
    dequant_warpgroup: bool = False
    # qk_products = "e4m3" under the dequantising warpgroup: Q quantised per row into an e4m3
    # tile, S on FP8 wgmma over the rows' raw e4m3 bytes, which the dequantising warpgroup copies
    # into each converted tile beside the 16-bit V (64-byte slabs: tiles.NARROW_SWIZZLE)
    qk_e4m3: bool = False
    # ... S reading each tile's staging buffer where the copies landed it (kv_fp8_direct.py:
    # a ring of DIRECT_STAGES the computing warps release after S), the converted tiles V only
    qk_direct: bool = False
    # ... S's k-steps dealt to this many accumulators a warpgroup, added in f32 after they retire
    # (math/wgmma.WgmmaMath): promotion against the FP8 wgmma's 13-bit sums
    score_chains: int = 1

    @property
    def q_geom(self):
        """Q: 16-bit rows, or (qk_e4m3) its e4m3 rows in 64-byte slabs (64 x 576 B: 36 KiB)."""
        if self.qk_e4m3:
            return SwizzledGeom(self.block_m, self.head_dim, self.threads)
        return super().q_geom

    @property
    def converted_bytes(self) -> int:
        """One converted tile: the 16-bit latent rows (V: their first dv columns), or (qk_e4m3)
        the rows' e4m3 bytes for S, then V's dv columns in 16 bits."""
        if self.qk_direct:
            return self.block_n * self.dv * self.fmt.bytes
        if self.qk_e4m3:
            return self.block_n * self.head_dim + self.block_n * self.dv * self.fmt.bytes
        return self.kv_geom.bytes

    @property
    def producer_warpgroup(self) -> bool:
        return self.warp_specialize or self.dequant_warpgroup

    @property
    def producer_regs(self) -> int:
        return SPARSE_DEQUANT_REGS if self.slot_ring else DEQUANT_REGS

    @property
    def consumer_regs(self) -> int:
        return dequant_consumer_regs(self.threads, self.producer_regs)

    @property
    def score_exchange_bytes(self) -> int:
        """split_scores: each warpgroup's 64 x block_n f32 partial S."""
        return self.v_split * ROWS_PER_WARPGROUP * self.block_n * 4 if self.split_scores else 0

    @property
    def seesaw_exchange_bytes(self) -> int:
        """seesaw: each warpgroup's published P (its A fragments) and row max."""
        return self.v_split * seesaw_slot_bytes(self.block_n) if self.seesaw else 0

    @property
    def slot_ring_offset(self) -> int:
        return self.smem_bytes - self.score_exchange_bytes - self.seesaw_exchange_bytes - self.slot_ring_bytes

    @property
    def smem_bytes(self) -> int:
        # the mbarriers (TMA: one a stage; the dequantising warpgroup: full and empty a converted
        # tile), padded to 16 bytes for the score exchange's v4 slots after them
        bars = self.num_stages if self.tma else 2 * DEQUANT_TILES if self.dequant_warpgroup else 0
        bars += self.num_stages if self.qk_direct else 0     # the staging ring's sempty
        bars = -(-bars * MBARRIER_BYTES // 16) * 16
        # sparse top-k: the slot ring before the exchanges (slot_ring_offset), which end it
        if self.fp8:    # the converted tiles, then the FP8 staging ring (kv_fp8_latent.LatentFP8Staging)
            return (self.q_region_bytes + self.converted_tiles * self.converted_bytes
                    + self.num_stages * self.staging_geom.bytes + bars + self.score_exchange_bytes
                    + self.slot_ring_bytes)
        return (self.q_region_bytes + self.num_stages * self.kv_geom.bytes + bars + self.score_exchange_bytes
                + self.seesaw_exchange_bytes + self.slot_ring_bytes)



LATENT_WGMMA_DV = 512          # two warpgroups of n256 (wgmma's widest) P·V
LATENT_WGMMA_ROWS = 64
# the dequantising warpgroup's budget after setmaxnreg.dec: a staged tile's share in registers
# (at 88 the e4m3 conversion spilled; 96 leaves the computing warps the same 200)
DEQUANT_REGS = 104
# ... gathering sparse top-k's rows (the slot ring's registers beside a tile's share): 120,
# which leaves the computing warps 192 (rounded down to a multiple of 8) -- enough now that
# they read a tile's missing keys from one word the copies publish (ptxas spilled in the
# gathering warps at 104 / 200: 24 bytes for e4m3_ds rows, and at 112 / 192: 40 for e4m3)
SPARSE_DEQUANT_REGS = 120


# S on FP8 wgmma (qk_e4m3, qk_direct; qk_products = "e4m3" under the dequantising warpgroup).
# Hopper's FP8 wgmma keeps 13 fraction bits of each k32 step's sum, its accumulator input
# included, truncated toward zero (emu/fp8.accumulate, which reproduces the H200's errors bit
# for bit): over a 576-column score's 9-18 steps chained through one accumulator the lse error
# reached 1.6-1.9x launch-test's tolerance on the H200 (lease at 4078740, block_n 32). So the
# steps are dealt to FP8_SCORE_CHAINS accumulators a warpgroup and added in f32 (promotion, as
# DeepGEMM does): with split scores 3 chains of 3 steps, lse at 0.31-0.47x the tolerance on the
# lease's spec over seeds 0-5 (2 chains at block_n 32: up to 0.81x). Their registers fit beside O's
# 128 at block_n 16 (three chains of 8); at block_n 32 two chains already spilled 32 bytes at
# the computing warps' 200, and unsplit S (18 steps: six chains) spills at either width. And
# the sums' truncation is a floor no chain removes (each step's products are aligned to the
# largest of them): lse's error grows with softmax_scale -- 0.16-0.6x the tolerance at DeepSeek's
# 0.0723-0.1352 on launch-test's inputs, 0.76-1.16x at 0.3 (128 RoPE columns failed) -- and
# f16's tolerance (its probabilities rounded to 11 bits) is about a seventh of bf16's (three
# chains missed it by 2.9x). So the FP8-score tile is opt-in (tile.fp8_scores), bf16 with split
# scores at block_n 16 (fp8_score_chains); by default, and elsewhere, Q is rounded to e4m3
# values on 16-bit products (exact products, f32 sums), as sm_80 / sm_90 do (mma.sync's QMMA on
# sm_89 / sm_120 promotes every k-step: math/mma_qk8.py).
FP8_SCORE_CHAINS = 3
FP8_SCORE_BLOCK_N = 16


def fp8_score_chains(dtype: str, split: bool, block_n: int) -> int:
    """The accumulators a warpgroup's FP8 S is dealt to, 0 where the tile keeps 16-bit
    products (the comment above: bf16 with split scores at block_n 16 only)."""
    return FP8_SCORE_CHAINS if dtype == "bf16" and split and block_n == FP8_SCORE_BLOCK_N else 0


def dequant_consumer_regs(threads: int, dequant_regs: int = DEQUANT_REGS) -> int:
    """The computing warpgroups' budget after setmaxnreg.inc: what the dequantising warpgroup
    leaves of the CTA's pool (384 threads enter with 168: 200 beside 104)."""
    return raised_regs(threads + DEQUANT_THREADS, DEQUANT_THREADS * dequant_regs, threads)


def latent_wgmma(spec, target) -> bool:
    """Whether a latent spec's tile runs on wgmma for `target` once it holds 64 head rows:
    sm_90a, f16/bf16, a latent cache of the dtype or of FP8 bytes (e4m3 with one scale, or
    e4m3_ds's group-scaled rows), dense or sparse, kv_lora_rank 512 with whole 64-column slabs
    of RoPE, and the tile's latent stages left to the path (tile.num_stages of 2 keeps the
    mma.sync kernel: this loop holds three tiles) -- and its three stages fit in shared memory
    (e4m3_ds rows with 128 RoPE columns do not: they keep the mma.sync kernel)."""
    given, least = spec.tile_dict(), min_latent_stages(spec)
    return (target.name in WGMMA_TARGETS and spec.dtype in ("f16", "bf16")
            and head_dim_v(spec) == LATENT_WGMMA_DV and spec.head_dim % 64 == 0
            and given.get("num_stages", least) >= least
            and spec.opt("custom_mask") in (None, "none")
            and _latent_config(spec, least, False).smem_bytes <= target.max_smem_per_cta)


def dequant_warpgroup(spec) -> bool:
    """tile.dequant_warpgroup (the default) over FP8 rows the threads copy (e4m3, e4m3_ds; not
    TMA-staged): chosen on static figures and timed since (H200 at 4078740: 6-11 % faster than
    every warp converting) -- the computing warps' loop falls from
    508 instructions a tile to 224 (e4m3_ds) and from 360 to 227 (e4m3), bf16's is 265, the
    conversion moving to warps of its own (docs/performance.md "Dequantising warpgroup").
    Dense caches and sparse top-k (its copies publish each tile's valid rows, so the
    computing warps need no slot loads: 120 / 192 registers) but not sparse with qk_products
    = "e4m3" (its gathering warps spilled 60-84 bytes at 120), and e4m3_ds rows of 64 RoPE
    columns (FlashMLA's): 784-byte e4m3_ds rows need more than its 104 (ptxas spilled 20-260
    bytes)."""
    return bool(spec.tile_dict().get("dequant_warpgroup", True)) and dequant_fits(spec)


def dequant_fits(spec) -> bool:
    """Where the dequantising warpgroup assembles without spills (dequant_warpgroup)."""
    rows = group_scaled(spec)
    return (kind(spec) is not None and latent_loads(spec) == "cp_async"
            and (rows is None or rows.rope <= 64)
            and not (sparse_keys(spec) and spec_option(spec, "qk_products") == "e4m3"))


def min_latent_stages(spec) -> int:
    """The fewest latent stages the wgmma loop runs with: three (tiles j - 1 and j read, one
    landing), or one staging buffer under a dequantising warpgroup (its converted tiles are
    the ring)."""
    return 1 if dequant_warpgroup(spec) else 3


def seesaw_by_default(spec) -> bool:
    """tile.seesaw's default: on wherever it applies -- a dense latent cache of the dtype loaded
    by TMA, the tile's split_scores and stages left to the path, its four stages and exchange
    in shared memory. Timed on the H200 (lease at 4078740, batch 64, 4096 keys, against split
    scores): DeepSeek-V3 (128 heads) 0.207 -> 0.176 ms unsplit and 0.210 -> 0.180 at the
    launch's 3 splits, 0.745 -> 0.613 at 16384 keys; Kimi-K2 (64 heads) 0.200 -> 0.167, 0.124
    -> 0.114 (5 splits), 0.395 -> 0.335: 8-18 % faster everywhere."""
    tile = spec.tile_dict()
    return (kind(spec) is None and not sparse_keys(spec) and latent_loads(spec) == "tma"
            and "split_scores" not in tile and tile.get("num_stages", SEESAW_STAGES) == SEESAW_STAGES
            and _latent_config(spec, SEESAW_STAGES, False, seesaw=True).smem_bytes
            <= TARGETS[WGMMA_TARGETS[0]].max_smem_per_cta)


def _latent_config(spec, stages: int, split: bool | None = None, seesaw: bool | None = None) -> LatentWgmmaConfig:
    """The tile at `stages`; `split` (None: the spec's tile.split_scores, where the exchange fits
    beside three stages -- or beside the given tile.num_stages, which it never lowers) says
    whether the warpgroups split Q·Kᵀ; `seesaw` (None: tile.seesaw, seesaw_by_default)."""
    d, dv = spec.head_dim, head_dim_v(spec)
    if seesaw is None:
        seesaw = bool(spec.tile_dict().get("seesaw", seesaw_by_default(spec)))
    if seesaw:          # the seesaw's warpgroups each compute their tiles' whole S
        split = False
    dequant, least = dequant_warpgroup(spec), min_latent_stages(spec)
    q_e4m3 = spec_option(spec, "qk_products") == "e4m3"
    wants_fp8 = dequant and q_e4m3 and bool(spec.tile_dict().get("fp8_scores"))
    if split is None:
        room = max(least, spec.tile_dict().get("num_stages", least))
        split = spec.tile_dict().get("split_scores", split_by_default(spec)) and \
            _latent_config(spec, room, True).smem_bytes <= TARGETS[WGMMA_TARGETS[0]].max_smem_per_cta
    bn = spec.tile_dict().get("block_n", FP8_SCORE_BLOCK_N if wants_fp8
                              and fp8_score_chains(spec.dtype, split, FP8_SCORE_BLOCK_N) else 32)
    chains = fp8_score_chains(spec.dtype, split, bn) if wants_fp8 else 0
    return LatentWgmmaConfig(C.FORMATS[spec.dtype], d, True, LATENT_WGMMA_ROWS,
                             bn, 2 * ROWS_PER_WARPGROUP // 16,
                             stages, True, dv, dv // (LATENT_WGMMA_DV // 2), shared_kv=True,
                             kv_loads=latent_loads(spec), fp8=kind(spec) is not None,
                             rows=group_scaled(spec), split_scores=split, seesaw=seesaw,
                             f16_math=f16_math_applies(spec) and not seesaw,
                             dequant_warpgroup=dequant, min_ctas_per_sm=1 if dequant else 0,
                             slot_ring=bool(sparse_keys(spec)),
                             q_e4m3=q_e4m3, qk_e4m3=chains > 0,
                             qk_direct=chains > 0 and stages == DIRECT_STAGES
                             and direct_applies(bn, DEQUANT_THREADS) and not sparse_keys(spec),
                             score_chains=max(chains, 1))


def split_by_default(spec) -> bool:
    """tile.split_scores' default: split where the three stages that leave room for the
    exchange still keep two latent tiles in flight -- TMA loads and FP8 staging refill a buffer
    S - 1 tiles ahead -- and not on the dense cp.async loop, which refills S - 2 ahead (one
    tile at three stages). Static figures (docs/performance.md "MLA decode"): S's tensor work
    halves (the products' 1.53x becomes 1x), each warp issues fewer instructions, and the loop
    model's bound improves on H100 and H200. Where TMA loads apply the seesaw is the default
    (seesaw_by_default); FP8 staging was timed only split (H200 at 4078740)."""
    return kind(spec) is not None or latent_loads(spec) == "tma"


def latent_loads(spec) -> str:
    """How the wgmma latent tile's rows arrive: TMA boxes where the layout allows (tma_applies)
    for a dense latent cache of the dtype (the default; tile.kv_loads = "cp_async" opts out)
    or, with tile.kv_loads = "tma", of e4m3 bytes (landed in staging buffers and converted
    there as the threads' copies are: statically no better than cp.async -- the conversion
    dominates the loop -- so not the default); per-thread cp.async otherwise: e4m3_ds rows
    (656 bytes: no box width divides them into 16-byte multiples of at most 256) and sparse
    slots (a gather, not a box)."""
    layout = spec.opt("kv_layout")
    kv = KVAccess(layout, C.FORMATS[spec.dtype], spec.opt("page_size") or 0)
    given = spec.tile_dict().get("kv_loads")
    tma = ((given == "tma" or (given is None and kind(spec) is None)) and group_scaled(spec) is None
           and not sparse_keys(spec) and tma_applies(kv))
    return "tma" if tma else "cp_async"


def applies_latent(spec, target, cfg: PrefillConfig, kv: KVAccess) -> bool:
    """Whether the packed tile `cfg` (the mma.sync latent one) runs on wgmma for `target`:
    latent_wgmma, and 64 head rows."""
    return cfg.shared_kv and cfg.block_m == LATENT_WGMMA_ROWS and latent_wgmma(spec, target)


def configure_latent(spec, cfg: PrefillConfig, kv: KVAccess) -> LatentWgmmaConfig:
    """applies_latent's tile: block_n 32 (given: 16 or 32), the most stages up to 4 that fit
    (4 at block_n 32: 72 KiB of Q and 144 KiB of latent tiles; FP8: 72 KiB of Q, two converted
    36 KiB tiles and four 18 KiB staging buffers; under a dequantising warpgroup three converted
    tiles and what is left: one staging buffer beside the score exchange), 8 warps (+ 4)."""
    stages = spec.tile_dict().get("num_stages", 4)
    while stages > min_latent_stages(spec) and \
            _latent_config(spec, stages).smem_bytes > TARGETS[WGMMA_TARGETS[0]].max_smem_per_cta:
        stages -= 1
    return _latent_config(spec, stages)
