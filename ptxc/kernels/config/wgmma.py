"""The sm_90a wgmma prefill's tile: when it applies (`uses_wgmma`), its frozen config
(`WgmmaConfig`: swizzled Q/K/V slabs, the load method, the producer warpgroup and ping-pong) and
the checks on a given tile. The math is math/wgmma.py, the bodies bodies/prefill_cp_async.py
(cp.async) and bodies/prefill_tma.py (TMA, one issuer or warp-specialised)."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import SpecError
from ...spec.model import KernelSpec
from ...targets import Target
from .. import common as C
from ..attention.variant import head_dim_v, spec_option
from ..mainloop.tiles import SWIZZLE, SWIZZLE_PERIOD, SwizzledGeom, TileGeom
from ..mainloop.tma_pipeline import barrier_bytes
from ..mainloop.tma_ws_pipeline import PRODUCER_THREADS, consumer_regs, producer_regs
from .prefill import PrefillConfig

WGMMA_TARGETS = ("sm_90a",)
WGMMA_HEAD_DIMS = (64, 128, 192, 256)   # head_dim and head_dim_v: whole 128-byte slabs, n <= 256
WGMMA_SHAPES = "f16/bf16, head_dim and head_dim_v 64, 128, 192 or 256"   # for refusals
ROWS_PER_WARPGROUP = 64
SHORT_WINDOW_TILES = 4   # a sliding window under this many key tiles keeps the one-issuer kernel
SHORT_WINDOW_BLOCK_M = 64   # ... on query tiles of one warpgroup
PERSISTENT_MAX_HEAD_DIM = 192   # tile.persistent: wider heads take ...
PERSISTENT_WIDE_BLOCK_N = 32    # ... 32-key tiles (64 spill: configure)
# ... and 16 with an attention chunk (ptxas 13.5 spilled 8 bytes with 32 beside every other variant
# at d256: the chunk's bound, the window's, sinks, soft-cap and ALiBi in 168 registers)
PERSISTENT_CHUNK_BLOCK_N = 16
D64_WS_STAGES = 4        # the warp-specialised d64 tile's default stages (timed, see configure)


def uses_wgmma(spec: KernelSpec, target: Target) -> bool:
    """Whether prefill for `target` is this kernel (else the mma.sync / SIMT one)."""
    # packed custom masks keep the mma.sync kernel (their tile list, mask_tiles.py, is not on
    # the wgmma pipelines); a tree mask (varlen) is MmaMath's per-row predicate over the wgmma
    # accumulator, which is the mma.sync fragment layout per warp
    return (target.name in WGMMA_TARGETS and spec.dtype in ("f16", "bf16")
            and spec.head_dim in WGMMA_HEAD_DIMS and head_dim_v(spec) in WGMMA_HEAD_DIMS
            and spec_option(spec, "custom_mask") in (None, "none", "tree"))


@dataclass(frozen=True)
class WgmmaConfig(PrefillConfig):
    # "tma" (tma_pipeline.py; prefill's default, set by configure) or "cp_async" (per-thread
    # copies; the dataclass default, so other builders of a WgmmaConfig keep their layout)
    kv_loads: str = "cp_async"
    warp_specialize: bool = False   # tma only: + a producer warpgroup (tma_ws_pipeline.py)
    pingpong: bool = False          # warp_specialize with two consumer warpgroups taking turns
    # tile.tma_store: O leaves through shared memory by TMA stores (MmaMath.epilogue), one box
    # a 128-byte column slab, like the loads; TMA kernels only
    tma_store: bool = False
    # tile.persistent: CTAs that take work tiles in turn (prefill_tile.PersistentTiles), and
    # whether O is staged in a region of its own (where it fits: the next tile's Q then lands
    # during this tile's epilogue) or over Q
    persistent: bool = False
    o_separate: bool = False

    @property
    def tma(self) -> bool:
        return self.kv_loads == "tma"

    @property
    def producer_warpgroup(self) -> bool:
        """A warpgroup besides the computing ones (which then meet on a named barrier, not the
        CTA's): the TMA producer here, MLA's dequantising one (LatentWgmmaConfig)."""
        return self.warp_specialize

    @property
    def launch_threads(self) -> int:
        return self.threads + (PRODUCER_THREADS if self.producer_warpgroup else 0)

    @property
    def producer_regs(self) -> int:
        return producer_regs(self.block_m // ROWS_PER_WARPGROUP)

    @property
    def consumer_regs(self) -> int:
        return consumer_regs(self.block_m // ROWS_PER_WARPGROUP)

    @property
    def q_geom(self) -> TileGeom:
        return SwizzledGeom(self.block_m, self.head_dim * self.fmt.bytes, self.threads)

    @property
    def kv_geom(self) -> TileGeom:
        return SwizzledGeom(self.block_n, self.head_dim * self.fmt.bytes, self.threads)

    @property
    def v_geom(self) -> TileGeom:
        return SwizzledGeom(self.block_n, self.dv * self.fmt.bytes, self.threads)

    @property
    def smem_align(self) -> int:   # one swizzle period: the descriptors' pattern starts there
        return SWIZZLE_PERIOD

    @property
    def q_region_bytes(self) -> int:
        """Q, and after the loop the padded O staging tile of the epilogue, 1024-aligned."""
        need = max(self.q_geom.bytes, self.o_geom.bytes)
        return -(-need // SWIZZLE_PERIOD) * SWIZZLE_PERIOD * (2 if self.o_separate else 1)

    @property
    def o_region_offset(self) -> int:
        """tile.persistent with O staged apart: its region's offset (after Q's)."""
        return self.q_region_bytes // 2

    @property
    def smem_bytes(self) -> int:
        bars = barrier_bytes(self.num_stages, self.warp_specialize, self.persistent) \
            if self.tma else 0
        return self.q_region_bytes + self.num_stages * (self.kv_geom.bytes + self.v_geom.bytes) + bars

    @property
    def registers_estimate(self) -> int:   # S and O accumulators, P, per thread
        return self.block_n // 2 + self.dv // 2 + self.block_n // 4 + 40


def configure(spec: KernelSpec, target: Target) -> WgmmaConfig:
    given = spec.tile_dict()
    d, dv = spec.head_dim, head_dim_v(spec)
    # 128 keys a tile where O has at most 128 columns (64 registers) and the stages fit
    # (DeepSeek's 192 / 128: 208 KiB); else 64 (d256: O alone is 128 registers)
    bm, bn, stages = 128, 128, 2
    if dv > 128 or _config(spec, target, bm, 128, stages, "tma", False).smem_bytes > target.max_smem_per_cta:
        bn = 64
    if "num_warps" in given and "block_m" not in given:
        bm = 16 * given["num_warps"]
    if given.get("persistent") and max(d, dv) > PERSISTENT_MAX_HEAD_DIM:
        # a persistent CTA's tile loop keeps its state live through the consumers' loop: at
        # d256 the 64-key tile's accumulators leave no room (256 bytes spilled), 32 keys do
        bn = PERSISTENT_CHUNK_BLOCK_N if spec_option(spec, "attention_chunk") else PERSISTENT_WIDE_BLOCK_N
    bm, bn, stages = given.get("block_m", bm), given.get("block_n", bn), given.get("num_stages", stages)
    loads = given.get("kv_loads", "tma")
    window = spec_option(spec, "sliding_window")
    short_window = window is not None and window < SHORT_WINDOW_TILES * bn
    if (short_window and loads == "tma"
            and not given.keys() & {"block_m", "num_warps", "pingpong", "persistent"}
            and not given.get("warp_specialize")):   # timed: 64 rows with one issuer
        # one consumer warpgroup of 64 rows (160 registers, 3 CTAs per SM, against one at 128):
        # under a window of a few key tiles each CTA's loop is short, so its prologue and
        # epilogue are much of its time, and resident CTAs overlap them -- gpt-oss's 128-key
        # window ran 0.361 -> 0.254 ms (4 x 4096^2) and 0.363 -> 0.258 (16k^2) on an H200
        bm = SHORT_WINDOW_BLOCK_M
    if bm % ROWS_PER_WARPGROUP or bm > 192:
        raise SpecError(f"block_m = {bm} on {target}: the wgmma prefill kernel gives each "
                        f"warpgroup 64 query rows, so block_m must be 64 or 128 (192: three "
                        f"consumer warpgroups of the warp-specialised kernel)", key="tile.block_m")
    if bm == 192 and max(d, dv) > 64:   # 160 registers per consumer thread (setmaxnreg)
        raise SpecError(f"block_m = 192 with head_dim {d}" + (f" / head_dim_v {dv}" if dv != d else "")
                        + f" on {target}: three consumer warpgroups get 160 registers per thread, "
                        f"which hold the accumulators of head dims up to 64 (ptxas spills at 128); "
                        f"use block_m = 128", key="tile.block_m")
    if bm == 192 and (loads != "tma" or given.get("warp_specialize") is False):
        raise SpecError(f"block_m = 192 on {target} takes three consumer warpgroups and a producer "
                        f"warpgroup: kv_loads = \"tma\" with warp_specialize (the default)",
                        key="tile.block_m")
    def copyable(m: int) -> bool:   # rows per pass (threads / 16-byte chunks): whole 8-row groups
        return all(2 * m % (w // 8) == 0 and 2 * m // (w // 8) % 8 == 0 for w in (d, dv))
    if loads == "cp_async" and not copyable(bm):
        fits = [m for m in (64, 128) if copyable(m)]
        width = f"head_dim {d}" + (f" / head_dim_v {dv}" if dv != d else "")
        if not fits:
            raise SpecError(f"kv_loads = \"cp_async\" with {width} on {target}: the swizzled tile "
                            f"copy moves whole 8-row groups per pass, which rows of this width "
                            f"do not allow with 128 or 256 threads; use kv_loads = \"tma\" (the "
                            f"default)", key="tile.kv_loads")
        raise SpecError(f"block_m = {bm} with {width} and kv_loads = \"cp_async\" on {target}: "
                        f"the swizzled tile copy moves whole 8-row groups per pass, which needs "
                        f"block_m = {fits[0]} ({2 * fits[0]} threads) for {width}", key="tile.block_m")
    if given.get("num_warps", bm // 16) != bm // 16:
        raise SpecError(f"num_warps = {given['num_warps']} with block_m = {bm} on {target}: the "
                        f"wgmma prefill kernel needs num_warps = block_m / 16 = {bm // 16}",
                        key="tile.num_warps")
    # a producer warpgroup by default where TMA feeds the tiles: 4-7 % faster on an H100 at d64,
    # d128 and 192 / 128, 2-11 % on an H200 at d128 / d256 with ALiBi, soft-cap and a 4096 window
    # (docs/performance.md, "GPU results") -- except under a window of fewer than
    # SHORT_WINDOW_TILES key tiles, where each Q tile runs a few K tiles and the producer's
    # pipeline never fills: gpt-oss's 128-key window ran 9-10 % faster with one issuer (H200)
    pingpong = given.get("pingpong", False)
    persistent = given.get("persistent", False)
    # producer-warpgroup tiles, all three
    needs_producer = pingpong or bm == 192 or persistent
    ws = given.get("warp_specialize", loads == "tma" and (needs_producer or not short_window))
    if ws and loads != "tma":
        raise SpecError(f"warp_specialize = true with kv_loads = \"{loads}\" on {target}: the "
                        f"producer warpgroup issues TMA loads; use kv_loads = \"tma\" or drop "
                        f"warp_specialize", key="tile.warp_specialize")
    if ws and bm == 128 and max(d, dv) <= 64 and not pingpong and "num_stages" not in given:
        # d64's tile is short (16 KiB of K and V a stage): 4 stages ran 5 % faster than 2 with
        # the producer warpgroup, on an H100 (415 vs 394 TFLOP/s) and an H200 (426 vs 406 at
        # 4 x 4096^2, 456 vs 444 at 16k^2); at 146 KiB the registers still bind (one CTA per SM)
        stages = D64_WS_STAGES
    if pingpong and not (ws and bm == 2 * ROWS_PER_WARPGROUP):
        raise SpecError(f"pingpong = true with block_m = {bm}, warp_specialize = "
                        f"{str(ws).lower()} on {target}: the consumers' ping-pong takes two "
                        f"consumer warpgroups of the warp-specialised TMA kernel (block_m = 128, "
                        f"kv_loads = \"tma\", warp_specialize = true)", key="tile.pingpong")
    tma_store = given.get("tma_store", False)
    if tma_store and loads != "tma":
        raise SpecError(f"tma_store = true with kv_loads = \"{loads}\" on {target}: the TMA "
                        f"stores use the TMA kernel's tensor maps; use kv_loads = \"tma\" or "
                        f"drop tma_store", key="tile.tma_store")
    if persistent and not ws:
        raise SpecError(f"persistent = true with kv_loads = \"{loads}\", warp_specialize = "
                        f"{str(ws).lower()} on {target}: the persistent CTAs are the "
                        f"warp-specialised TMA kernel's (kv_loads = \"tma\", warp_specialize = "
                        f"true)", key="tile.persistent")
    wide = max(d, dv) > PERSISTENT_MAX_HEAD_DIM
    if persistent and (bm > 2 * ROWS_PER_WARPGROUP or (wide and bn > PERSISTENT_WIDE_BLOCK_N)):
        # the tile loop's own state (its index, the ring's stage and parities across tiles)
        # is live through the consumers' loop: ptxas spills 256 bytes at d256 with 64-key
        # tiles (240 registers) and 32 at block_m 192 (160)
        raise SpecError(f"persistent = true with block_m = {bm}, block_n = {bn}, head_dim {d}"
                        + (f" / head_dim_v {dv}" if dv != d else "") + f" on {target}: the "
                        f"persistent kernel takes block_m 64 or 128, and block_n up to "
                        f"{PERSISTENT_WIDE_BLOCK_N} for head dims over {PERSISTENT_MAX_HEAD_DIM} "
                        f"(its consumers would spill); drop persistent or the tile key",
                        key="tile.persistent")
    cfg = _config(spec, target, bm, bn, stages, loads, ws, pingpong, tma_store, persistent)
    if persistent:    # O in a region of its own where it fits
        apart = _config(spec, target, bm, bn, stages, loads, ws, pingpong, tma_store, True, True)
        if apart.smem_bytes <= target.max_smem_per_cta:
            cfg = apart
    if cfg.smem_bytes > target.max_smem_per_cta:
        raise SpecError(f"tile block_m={bm}, block_n={bn}, num_stages={stages} needs "
                        f"{cfg.smem_bytes} bytes of shared memory; {target} allows "
                        f"{target.max_smem_per_cta} per CTA: use fewer stages or a smaller tile",
                        key="tile.num_stages" if "num_stages" in given else "tile.block_n")
    return cfg


def _config(spec: KernelSpec, target: Target, bm: int, bn: int, stages: int, loads: str,
            ws: bool, pingpong: bool = False, tma_store: bool = False, persistent: bool = False,
            o_separate: bool = False) -> WgmmaConfig:
    return WgmmaConfig(C.FORMATS[spec.dtype], spec.head_dim, True, bm, bn, bm // 16, stages,
                       loads != "tma", head_dim_v(spec), 1, kv_loads=loads, warp_specialize=ws,
                       pingpong=pingpong, tma_store=tma_store, persistent=persistent,
                       o_separate=o_separate,
                       # .minnctapersm 1 pins the register count at entry (65536 / threads),
                       # without which ptxas drops setmaxnreg (C7508, "unable to determine
                       # register count at entry") -- and setmaxnreg's budgets assume it
                       min_ctas_per_sm=1 if ws else 0)


def resolve_tile(spec: KernelSpec, target: Target) -> dict:
    c = configure(spec, target)
    return {"block_m": c.block_m, "block_n": c.block_n, "num_warps": c.num_warps,
            "num_stages": c.num_stages, "path": "wgmma.m64nNk16", "cp_async": c.cp_async,
            "smem_swizzle": SWIZZLE, "smem_bytes": c.smem_bytes,
            **({"kv_loads": "tma"} if c.tma else {}),
            **({"warp_specialize": True, "threads": c.launch_threads, "min_ctas_per_sm": 1,
                "setmaxnreg": [c.producer_regs, c.consumer_regs]} if c.warp_specialize else {}),
            **({"pingpong": True} if c.pingpong else {}),
            **({"tma_store": True} if c.tma_store else {}),
            **({"persistent": True, "o_staging": "apart" if c.o_separate else "over_q"}
               if c.persistent else {})}
