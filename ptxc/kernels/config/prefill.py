"""Prefill tile configuration: the frozen PrefillConfig, the default tile per target and
head_dim (sized for occupancy, docs/kernels.md) and the checks on a given tile.
Shared by the prefill family (prefill.py) and varlen, which reuses PrefillConfig for its
GQA-packed tensor-core body."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...errors import SpecError
from ...spec.model import KernelSpec
from ...targets import KIB, MAX_REGS_PER_THREAD, Target
from .. import common as C
from ..attention.mask_tiles import classified_tiles
from ..attention.variant import head_dim_v
from ..kv.kv_pages import RING_ENTRY, VALID_WORDS
from ..mainloop.tiles import SWIZZLE_ALIGN, TileGeom, swizzle_fits
from .register_floor import narrow_block_n, needs_floor

MAX_SIMT_HEAD_DIM = 256   # f32 path: a 2 KiB row would not fit Q + K/V tiles in shared memory
SIMT_LANES_PER_ROW = 8    # f32 path: lanes sharing a query row (its keys and its head_dim chunks)
REG_OVERHEAD = 40         # addresses, loop state, softmax temporaries (register estimate)


@dataclass(frozen=True)
class PrefillConfig:
    fmt: C.ElemFormat
    head_dim: int
    tensor_cores: bool
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    cp_async: bool
    head_dim_v: int = 0      # V/O head size; 0: head_dim
    v_split: int = 1         # warps sharing 16 query rows, each owning dv / v_split O columns
    min_ctas_per_sm: int = 0  # .minnctapersm: registers capped so this many CTAs fit (0: no cap)
    swizzle: bool = False     # XOR-swizzled tiles (tiles.py) wherever their geometry allows
    warp_rows: int = 16       # tensor cores: query rows per warp (16, or 32 = two m16 tiles)
    # V is the first head_dim_v columns of each K row (MLA's latent cache): one tile per stage
    # serves both products, and P·V reads it with K's row stride (kv_pipeline.py)
    shared_kv: bool = False
    # The v_split warps sharing 16 rows split Q·Kᵀ's depth (each ksteps / v_split k-steps) and
    # add their partial scores through shared memory (math.mma.MmaMath.scores) instead of
    # each computing all of it
    score_split: bool = False
    # A packed custom mask: the KV tiles a CTA classifies from the bits before its loop
    # (mask_tiles.py), whose visit list and bitmaps sit after the K/V stages
    mask_tiles: int = 0
    # Sparse top-k (a cache slot per key): the slots of the next K tile parked in a two-tile
    # ring before the mask list (kv_pages.SparseSlots)
    slot_ring: bool = False
    # The tensor-core products on f16 inputs over a bf16 kernel's FP8 cache (Q rescaled per
    # row into f16 first: kv_fp8_stage.f16_math_applies, math.mma.MmaMath.rescale_q_to_f16)
    f16_math: bool = False
    # MLA's qk_products = "e4m3": Q's rows rounded to e4m3 values (a power-of-two scale per row)
    # in the products' 16-bit tile before the loop (math.mma.MmaMath.q_rewrite), so every tile
    # computes the scores of the FP8 tile (latent_tile.LatentWgmmaConfig.qk_e4m3)
    q_e4m3: bool = False
    # Split-KV on the GQA-packed tile: split 0 stores the final o of a tile it covers whole
    # (VarlenMath.epilogue). Not on mma.sync: its split kernels sit at ptxas's 128-register
    # cap, and the second epilogue made 20 of the spill sweep's 14963 combinations spill.
    finishes_whole_tiles: ClassVar[bool] = False

    @property
    def dv(self) -> int:
        return self.head_dim_v or self.head_dim

    @property
    def row_sharers(self) -> int:
        """Warps (or warpgroups) of one CTA that hold the same query rows, each owning a slice
        of O's columns: v_split, or 1 where the slices are CTAs of their own (value_ctas)."""
        return self.v_split

    @property
    def math_fmt(self) -> C.ElemFormat:
        """The format of the tensor-core products' inputs (Q, K, V tiles and P): the dtype's,
        or f16 with f16_math."""
        return C.FORMATS["f16"] if self.f16_math else self.fmt

    @property
    def math_pair(self) -> str:
        """The packed pair a converted K/V tile holds: "f16x2" or "bf16x2" (math_fmt's)."""
        return f"{self.math_fmt.name}x2"

    def _geom(self, rows: int, elems: int) -> TileGeom:
        row_bytes = elems * self.fmt.bytes
        return TileGeom(rows, row_bytes, self.threads,
                        self.swizzle and swizzle_fits(rows, row_bytes, self.threads))

    @property
    def v_geom(self) -> TileGeom:
        """V tiles (block_n x head_dim_v), in stage buffers sized for K (head_dim_v <= head_dim);
        with shared_kv, the K tile itself (its first head_dim_v columns)."""
        return self.kv_geom if self.shared_kv else self._geom(self.block_n, self.dv)

    @property
    def o_geom(self) -> TileGeom:
        """The output tile staged in the Q tile's shared memory (block_m x head_dim_v)."""
        return self._geom(self.block_m, self.dv)

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def launch_threads(self) -> int:
        """The CTA's threads (the block of the launch): the computing warps."""
        return self.threads

    @property
    def cta_rows(self) -> int:
        """Query rows per CTA: block_m (tcgen05's two Q tiles: 2 x block_m)."""
        return self.block_m

    @property
    def q_geom(self) -> TileGeom:
        return self._geom(self.block_m, self.head_dim)

    @property
    def q_region_bytes(self) -> int:
        """Shared memory before the K stages: the Q tile (the epilogue stages O there too)."""
        return self.q_geom.bytes

    @property
    def smem_align(self) -> int:
        """The shared region's alignment: swizzled tiles' ldmatrix XORs need 128 bytes."""
        return SWIZZLE_ALIGN if self.q_geom.swizzled or self.v_geom.swizzled else 16

    @property
    def kv_geom(self) -> TileGeom:
        return self._geom(self.block_n, self.head_dim)

    @property
    def smem_bytes(self) -> int:
        return self.q_geom.bytes + self.kv_tiles * self.num_stages * self.kv_geom.bytes + self.tail_bytes

    @property
    def tail_bytes(self) -> int:
        """What follows the K/V stages: the slot ring, the mask-tile list, the score exchange."""
        return self.slot_ring_bytes + self.mask_list_bytes + self.exchange_bytes

    @property
    def slot_ring_bytes(self) -> int:
        """slot_ring: two tiles of s64 row offsets, then the ring of valid-rows words
        (kv_pages.SparseSlots)."""
        return 2 * RING_ENTRY * self.block_n + 4 * VALID_WORDS if self.slot_ring else 0

    @property
    def slot_ring_offset(self) -> int:
        """Byte offset of the slot ring in shared memory (before the mask list)."""
        return self.smem_bytes - self.tail_bytes

    @property
    def valid_words_offset(self) -> int:
        """Byte offset of the valid-rows words in shared memory (after the slot ring's offsets)."""
        return self.slot_ring_offset + 2 * RING_ENTRY * self.block_n

    @property
    def mask_list_bytes(self) -> int:
        """mask_tiles: a u32 visit-list entry and two bitmap bits per classified tile."""
        return 4 * self.mask_tiles + self.mask_tiles // 4 if self.mask_tiles else 0

    @property
    def mask_list_offset(self) -> int:
        """Byte offset of the mask-tile list in shared memory (before the score exchange)."""
        return self.smem_bytes - self.exchange_bytes - self.mask_list_bytes

    @property
    def exchange_bytes(self) -> int:
        """score_split: the partial scores, at the end of shared memory - per 16-row group,
        v_split x (block_n / 8) n8 tiles of 32 lanes x 16 bytes."""
        return self.block_m // 16 * self.v_split * self.block_n // 8 * 512 if self.score_split else 0

    @property
    def kv_tiles(self) -> int:
        """Tiles per pipeline stage: K and V, or the one latent tile (shared_kv)."""
        return 1 if self.shared_kv else 2

    @property
    def rows_per_thread(self) -> int:
        """f32 path: query rows per lane (a warp holds 32 / SIMT_LANES_PER_ROW row groups)."""
        return self.block_m // (self.num_warps * 32 // SIMT_LANES_PER_ROW)

    @property
    def registers_estimate(self) -> int:
        if self.tensor_cores:   # O and S accumulators: 16 x head_dim and 16 x block_n f32 per m16 tile
            mt = self.warp_rows // 16
            return mt * (self.dv // 2 // self.v_split + self.block_n // 2) + REG_OVERHEAD
        chunks = -(-self.dv // 4 // SIMT_LANES_PER_ROW)
        tm = self.rows_per_thread
        return tm * chunks * 4 + tm * self.block_n // SIMT_LANES_PER_ROW + REG_OVERHEAD


def _defaults(spec: KernelSpec, target: Target, tc: bool) -> tuple[int, int, int]:
    """(block_m, block_n, num_stages) before the shared-memory fit (docs/kernels.md)."""
    d, smem = spec.head_dim, target.max_smem_per_cta
    if not tc:
        return 32, 32, 1
    large, medium = smem >= 200 * KIB, smem >= 160 * KIB      # sm_90/sm_100, sm_80/sm_87
    if d > 256:    # 4 warps per 16 rows (value_split); the same block on every target
        return 16, 32, 2 if smem >= 160 * KIB else 1
    if d <= 128:   # d64 with block_n 128 took ~140 registers (1 CTA/SM); 64 keeps <= 128 (2)
        bm, bn = 128, 64
    else:
        bm, bn = (128 if large else 64), 64
    stages = (3 if d <= 128 else 2) if large else 2 if medium else 1
    return bm, bn, stages


def _warps_for(bm: int, tc: bool, v_split: int = 1, warp_rows: int = 16) -> int:
    return max(1, bm // warp_rows) * v_split if tc else max(1, min(8, bm // 8))


def value_split(dv: int, tc: bool) -> int:
    """Warps that share a 16-row query slice, each accumulating dv / v_split columns of O: 1
    up to head_dim_v 256; above, 4 (a 16 x 512 f32 accumulator would need 256 registers per
    thread; 16 x 128 needs 64). The scores and softmax are computed by each of them alike."""
    return 4 if tc and dv > 256 else 1


def configure(spec: KernelSpec, target: Target) -> PrefillConfig:
    tc = spec.dtype != "f32"
    given = spec.tile_dict()
    bm, bn, stages = _defaults(spec, target, tc)
    # A tile `ptxc tune` measured on this target replaces the heuristic's defaults (it may
    # still shrink to fit below); keys the spec gives win over both.
    tuned = C.tuned_tile("prefill", spec, target, ("block_m", "block_n", "num_stages", "num_warps"),
                         causal=spec.opt("causal"))
    bm, bn, stages = tuned.get("block_m", bm), tuned.get("block_n", bn), tuned.get("num_stages", stages)
    bm, bn, stages = given.get("block_m", bm), given.get("block_n", bn), given.get("num_stages", stages)
    if spec.opt("custom_mask") not in (None, "none") and spec.head_dim > 128 and "block_n" not in given:
        bn = min(bn, 32)   # a mask's bit windows beside d256's O accumulators: 64 keys spilled
    if "block_n" not in given:   # where even 255 registers spill (register_floor.NARROW_TILES)
        bn = narrow_block_n("prefill", spec, target, bn)
    vsplit = value_split(head_dim_v(spec), tc)
    wrows = given.get("warp_rows", 16)
    if wrows != 16:
        _check_warp_rows(spec, tc, vsplit, wrows)
        if head_dim_v(spec) > 64 and bn > 32:
            # two m16 tiles of O (d128: 128 f32) plus their scores over 64 keys (64) came to
            # 254-255 registers, spilling 8-124 bytes on most targets; 32 keys: 234-245, none
            if "block_n" in given:
                raise SpecError(f"warp_rows = 32 with head_dim_v {head_dim_v(spec)} and block_n = "
                                f"{bn}: two 16-row tiles of O and scores need more than the 255 "
                                f"registers a thread has (ptxas spills); use block_n = 32 or "
                                f"warp_rows = 16", key="tile.block_n")
            bn = 32
    if "num_warps" in given and "block_m" not in given:
        bm = wrows * given["num_warps"] // vsplit if tc else 8 * given["num_warps"]
    tuned_warps = tuned.get("num_warps") if bm == tuned.get("block_m") and wrows == 16 else None
    warps = given.get("num_warps") or tuned_warps or _warps_for(bm, tc, vsplit, wrows)

    min_ctas = 0

    # Swizzled tiles save the padding but cost ptxas ~4-9 registers of ldmatrix addresses (a
    # lane's XOR per k-step): padded by default, swizzled when asked or when only that fits.
    swizzle = given.get("smem_layout") == "swizzled"
    if swizzle:
        _check_swizzle(spec, tc, vsplit, bm, bn, warps)
    can_swizzle = "smem_layout" not in given and tc and vsplit == 1

    def make():
        return PrefillConfig(C.FORMATS[spec.dtype], spec.head_dim, tc, bm, bn, warps, stages,
                             target.has_cp_async, head_dim_v(spec), vsplit, min_ctas, swizzle,
                             wrows, mask_tiles=classified_tiles(spec))

    cfg = make()
    while cfg.smem_bytes > target.max_smem_per_cta:   # shrink what the spec left to us
        if can_swizzle and _swizzled(cfg).smem_bytes <= target.max_smem_per_cta:
            swizzle = True      # what makes this tile fit: keep the tile, drop the padding
        elif "num_stages" not in given and stages > 1:
            stages -= 1
        elif "block_n" not in given and bn > 16:
            bn //= 2
        elif "block_m" not in given and "num_warps" not in given and bm > max(16, wrows):
            bm //= 2
            warps = _warps_for(bm, tc, vsplit, wrows)
        else:
            key = next((k for k in ("block_n", "num_stages", "block_m", "num_warps") if k in given),
                       "block_n")
            raise SpecError(f"tile block_m={bm}, block_n={bn}, num_stages={stages} needs "
                            f"{cfg.smem_bytes} bytes of shared memory (Q {cfg.q_geom.bytes} + "
                            f"{stages} x K/V {2 * cfg.kv_geom.bytes}); {target} allows "
                            f"{target.max_smem_per_cta} per CTA: use a smaller tile", key=f"tile.{key}")
        cfg = make()
    shape_given = given.keys() - {"smem_layout", "warp_rows", "kv_loads", "warp_specialize",
                                  "pingpong", "exp2_poly", "q_tiles", "correction",
                                  "tma_store", "persistent"}
    # (not shapes: the others are sm_90a / sm_100a keys)
    # (not with a custom mask: its bit windows need more than the 128 registers two CTAs leave)
    floor = needs_floor("prefill", spec, target)
    if tc and not shape_given and not tuned and _two_ctas_target(spec, target) and \
            spec.opt("custom_mask") in (None, "none") and not floor:
        # Two CTAs per SM (docs/kernels.md "Prefill tiles"): the most stages (<= the default)
        # with which two fit the SM's shared memory, and ptxas told to stay within the 128
        # registers per thread two 8-warp CTAs leave (it needs 130 unconstrained, no spills at 128).
        while stages > 1 and not _fits_per_sm(cfg, target, 2):
            stages -= 1
            cfg = make()
        if _fits_per_sm(cfg, target, 2):
            min_ctas = 2
            cfg = make()
    if floor and not min_ctas:   # ptxas's own register cap spills this shape (register_floor.py)
        min_ctas = 1
        cfg = make()
    if wrows == 32 and not min_ctas:
        # Left alone, ptxas caps a 4-warp CTA's registers to fit three per SM (168 on sm_90)
        # and spills the 32-row accumulators; .minnctapersm 1 lets it use what they need.
        min_ctas = 1
        cfg = make()
    _check_shape(cfg, target)
    return cfg


def _two_ctas_target(spec: KernelSpec, target: Target) -> bool:
    """Head dims 65..128 on sm_80/sm_87 (164 KiB of shared memory per SM): the 128 x 64 tile
    with two K/V stages takes 102 KiB at d128 and so ran one CTA (8 warps) per SM. d <= 64
    already gets two without a cap; sm_86/sm_89 (100 KiB per SM) cannot hold two 64 KiB tiles;
    sm_90 keeps its three stages at one CTA per SM (not re-evaluated here)."""
    return 64 < spec.head_dim <= 128 and 160 * KIB <= target.max_smem_per_cta < 200 * KIB


def _swizzled(cfg: PrefillConfig) -> PrefillConfig:
    from dataclasses import replace
    return replace(cfg, swizzle=True)


def _check_swizzle(spec: KernelSpec, tc: bool, vsplit: int, bm: int, bn: int, warps: int) -> None:
    threads, row_bytes = 32 * warps, spec.head_dim * C.FORMATS[spec.dtype].bytes
    why = "it needs the tensor-core path (dtype f16 or bf16)" if not tc else \
        f"head_dim_v {head_dim_v(spec)} splits the value columns over warps" if vsplit > 1 else \
        None if all(swizzle_fits(rows, row_bytes, threads) for rows in (bm, bn)) else \
        (f"it needs head_dim a multiple of 64 and copy passes of a multiple of 8 rows "
         f"({threads} threads / {row_bytes // 16} chunks per row)")
    if why:
        raise SpecError(f"smem_layout = \"swizzled\" with head_dim {spec.head_dim}, block_m {bm}, "
                        f"block_n {bn}: {why}; use \"padded\"", key="tile.smem_layout")


MAX_WARP_ROWS_32_HEAD_DIM = 152


def _check_warp_rows(spec: KernelSpec, tc: bool, vsplit: int, wrows: int) -> None:
    from ..attention.variant import AttentionVariant
    why = "it needs the tensor-core path (dtype f16 or bf16)" if not tc else \
        f"head_dim_v {head_dim_v(spec)} splits the value columns over warps" if vsplit > 1 else \
        "score transforms (softcap, alibi) address 16-row score tiles" \
        if AttentionVariant.from_spec(spec).transforms else None
    if why:
        raise SpecError(f"warp_rows = {wrows}: {why}; use 16", key="tile.warp_rows")
    widest = max(spec.head_dim, head_dim_v(spec))
    if wrows == 32 and widest > MAX_WARP_ROWS_32_HEAD_DIM:
        # measured (bench/spill_sweep.py, ptxas 13.5): two m16 tiles of O at 160-176 columns
        # reach 254-255 registers with 32 keys and spill 16-488 bytes on every target
        raise SpecError(f"warp_rows = 32 with head_dim {widest}: two 16-row O tiles spill above "
                        f"head_dim {MAX_WARP_ROWS_32_HEAD_DIM}; use 16", key="tile.warp_rows")


def _fits_per_sm(cfg: PrefillConfig, target: Target, ctas: int) -> bool:
    return ctas * (cfg.smem_bytes + target.reserved_smem_per_cta) <= target.smem_per_sm


def _check_shape(cfg: PrefillConfig, target: Target) -> None:
    if cfg.tensor_cores and cfg.block_m * cfg.v_split != cfg.warp_rows * cfg.num_warps:
        split = f" / {cfg.v_split} (head_dim_v {cfg.dv}: {cfg.v_split} warps share 16 rows)" \
            if cfg.v_split > 1 else ""
        w = cfg.warp_rows
        raise SpecError(f"block_m = {cfg.block_m} with num_warps = {cfg.num_warps}: on tensor cores "
                        f"each warp owns {w} query rows, so block_m must be {w} * num_warps{split}",
                        key="tile.block_m")
    if not cfg.tensor_cores and (cfg.block_m % (4 * cfg.num_warps) or cfg.rows_per_thread > 8):
        raise SpecError(f"block_m = {cfg.block_m} with num_warps = {cfg.num_warps}: the f32 path "
                        f"needs block_m = 4 * num_warps * r with r in 1..8 rows per lane",
                        key="tile.block_m")
    if cfg.q_geom.chunks > cfg.threads:
        raise SpecError(f"num_warps = {cfg.num_warps}: a {cfg.q_geom.row_bytes}-byte row needs at "
                        f"least {cfg.q_geom.chunks} threads to copy; use more warps",
                        key="tile.num_warps")
    if cfg.registers_estimate > MAX_REGS_PER_THREAD and cfg.warp_rows > 16:
        raise SpecError(f"warp_rows = {cfg.warp_rows} with head_dim_v {cfg.dv} needs about "
                        f"{cfg.registers_estimate} registers per thread (limit "
                        f"{MAX_REGS_PER_THREAD} on {target}); use warp_rows = 16",
                        key="tile.warp_rows")
    if cfg.registers_estimate > MAX_REGS_PER_THREAD:
        raise SpecError(f"block_m = {cfg.block_m}, block_n = {cfg.block_n} needs about "
                        f"{cfg.registers_estimate} registers per thread for head_dim "
                        f"{cfg.head_dim} (limit {MAX_REGS_PER_THREAD} on {target}); use a smaller "
                        f"tile", key="tile.block_n")
