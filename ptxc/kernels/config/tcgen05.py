"""The sm_100a / sm_103a tcgen05 prefill's tile: when it applies (`uses_tcgen05`), its config
(`Tcgen05Config`: the wgmma tile's swizzled slabs plus tensor memory and the MMA region) and the
checks on a given tile. Math: math/tcgen05.py; body: bodies/prefill_tma.py."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import SpecError
from ...spec.model import KernelSpec
from ...targets import Target
from .. import common as C
from ..attention.variant import head_dim_v
from ..mainloop.tcgen05_ws_pipeline import CORRECTION_THREADS, issue_threads
from ..mainloop.tiles import SWIZZLE
from ..math.tcgen05 import Exchange
from ..math.umma import mma_region_bytes, tile_columns, tmem_columns
from .wgmma import WgmmaConfig

TCGEN05_TARGETS = ("sm_100a", "sm_103a")
TCGEN05_HEAD_DIMS = (64, 128, 192, 256)   # whole 128-byte slabs; N <= 256 for P·V
TCGEN05_SHAPES = "f16/bf16, head_dim and head_dim_v 64, 128, 192 or 256, head_dim_v <= head_dim"
BLOCK_M = 128
TMEM_COLUMNS = 512                       # tensor memory per CTA: 128 lanes x 512 columns
# tile.q_tiles = 2 up to this head dim: at 192 / 128 ptxas 13.5 spilled 40 bytes (values the
# prologue carries across setmaxnreg), whatever the issuing warpgroup's budget
Q_TILES_MAX_HEAD_DIM = 128
# tile.correction up to this head_dim_v: 448 threads cap ptxas at 128 registers, and O's
# dv / 2 registers a thread in the epilogue (and its zeroing store) do not fit at 256
CORRECTION_MAX_HEAD_DIM_V = 128
# .minnctapersm 1: without it ptxas 13.5 gave the 4-warp varlen tile at d64 with every variant
# 96 registers and 8 bytes of spills; pinned, 102 registers and none
PIN_REGISTERS = 1
# The load / MMA / softmax warps of tcgen05_ws_pipeline.py (tile.warp_specialize) are the
# default from this head dim, on static figures alone (no Blackwell GPU lent): at d128 the
# softmax warps' loop is 270 instructions a tile against 298, and 510 for the warp that issues
# everything, in the one-issuer kernel, at the same one CTA per SM (shared memory bounds it;
# docs/performance.md "Blackwell"). At d64 the one-issuer kernel keeps two CTAs per SM, which
# the 320 threads of the warp-specialised one do not (99 registers; pinned to two CTAs, 96
# registers, ptxas spilled), so it stays the default there.
WS_MIN_HEAD_DIM = 128


def uses_tcgen05(spec: KernelSpec, target: Target) -> bool:
    """Whether prefill for `target` is this kernel."""
    return (target.name in TCGEN05_TARGETS and spec.dtype in ("f16", "bf16")
            and spec.head_dim in TCGEN05_HEAD_DIMS and head_dim_v(spec) in TCGEN05_HEAD_DIMS
            and head_dim_v(spec) <= spec.head_dim
            and spec.opt("custom_mask") in (None, "none"))


class TensorMemoryTile:
    """Mixed into a tile config on tcgen05 (before the WgmmaConfig it extends): the tensor-
    memory columns of its S, P and O, the MMA region of shared memory (umma.py) after the TMA
    barriers, and with warp_specialize the load and MMA warps (tcgen05_ws_pipeline.py) after
    the computing ones, not a warpgroup. `q_tiles` (prefill's tile.q_tiles; 1 elsewhere) Q
    tiles of block_m rows share each K/V tile: their warps, Q regions and columns one after
    the other."""

    @property
    def q_tiles(self) -> int:
        return 1

    @property
    def correction(self) -> bool:
        return False

    @property
    def cta_rows(self) -> int:
        return self.block_m * self.q_tiles

    @property
    def launch_threads(self) -> int:
        return (self.q_tiles * self.threads + (CORRECTION_THREADS if self.correction else 0)
                + (issue_threads(self.q_tiles) if self.warp_specialize else 0))

    @property
    def o_columns(self) -> int:
        """O's columns a CTA keeps in tensor memory: head_dim_v, or its share where the value
        columns are split between CTAs (MLA's latent tile: value_ctas)."""
        return self.dv // self.value_ctas

    @property
    def value_ctas(self) -> int:
        """CTAs that share a tile's rows, each owning o_columns of O (grid z; 1: none)."""
        return 1

    @property
    def row_sharers(self) -> int:
        return self.v_split // self.value_ctas

    @property
    def tile_columns(self) -> int:
        return tile_columns(self.block_n, self.o_columns, self.correction)

    @property
    def tmem_columns(self) -> int:
        return tmem_columns(self.block_n, self.o_columns, self.q_tiles, self.correction)

    @property
    def q_tile_bytes(self) -> int:
        """One Q tile's region (Q, then its O staging; 1024-aligned)."""
        return super().q_region_bytes

    @property
    def q_region_bytes(self) -> int:
        return self.q_tiles * self.q_tile_bytes

    @property
    def smem_bytes(self) -> int:
        exchange = self.q_tiles * Exchange.bytes(self.num_warps) if self.correction else 0
        return super().smem_bytes + mma_region_bytes(self.q_tiles, self.correction) + exchange


@dataclass(frozen=True)
class Tcgen05Config(TensorMemoryTile, WgmmaConfig):
    """WgmmaConfig's tiles (TMA) with 8 warps of 16 rows and tensor memory; warp_specialize
    adds the load and MMA warps (tcgen05_ws_pipeline.py), not a warpgroup. exp2_poly: of every 8
    exponentials of a row, how many the FMA polynomial computes (attention/softmax.exp2_poly)."""

    exp2_poly: int = 0
    q_tiles: int = 1     # tile.q_tiles: 2 is FlashAttention-4's two Q tiles per CTA
    correction: bool = False   # tile.correction: a correction warpgroup rescales O


def check_correction(ws: bool, dv: int, target: Target | str) -> None:
    """tile.correction's rule, prefill's and varlen's tile alike: the warp-specialised kernel
    (one Q tile or prefill's two), head_dim_v up to CORRECTION_MAX_HEAD_DIM_V; else one line
    naming the key."""
    if dv > CORRECTION_MAX_HEAD_DIM_V:
        raise SpecError(f"correction = true with head_dim_v {dv} on {target}: the correction "
                        f"warps' threads leave 128 registers a thread, and O's {dv} columns take "
                        f"{dv // 2} of them in the epilogue; it takes head_dim_v up to "
                        f"{CORRECTION_MAX_HEAD_DIM_V}", key="tile.correction")
    if not ws:
        raise SpecError(f"correction = true with warp_specialize = false on {target}: the "
                        f"correction warps serve the warp-specialised kernel's softmax warps; "
                        f"drop warp_specialize or correction", key="tile.correction")


def configure(spec: KernelSpec, target: Target) -> Tcgen05Config:
    given = spec.tile_dict()
    # pingpong is the sm_90a kernel's key: ignored here, as on the other targets (prefill.validate
    # refuses it when no target takes that kernel); warp_specialize picks the load / MMA warps
    for key, allowed in (("block_m", BLOCK_M), ("num_warps", 8), ("kv_loads", "tma")):
        if key in given and given[key] != allowed:
            raise SpecError(f"{key} = {given[key]!r} on {target}: the tcgen05 prefill kernel "
                            f"takes {key} = {allowed!r} (128 rows, 8 warps, TMA loads, one "
                            f"MMA-issuing thread)", key=f"tile.{key}")
    stages = given.get("num_stages", 2)
    q_tiles = given.get("q_tiles", 1)
    correction = given.get("correction", False)
    ws = given.get("warp_specialize", spec.head_dim >= WS_MIN_HEAD_DIM or q_tiles > 1 or correction)
    if q_tiles > 1 and not ws:
        raise SpecError(f"q_tiles = {q_tiles} with warp_specialize = false on {target}: two Q "
                        f"tiles share the load and MMA warps; drop warp_specialize or q_tiles",
                        key="tile.q_tiles")
    if correction:
        check_correction(ws, head_dim_v(spec), target)

    def make(bn: int) -> Tcgen05Config:
        return Tcgen05Config(C.FORMATS[spec.dtype], spec.head_dim, True, BLOCK_M, bn, 8, stages,
                             False, head_dim_v(spec), 1, kv_loads="tma", warp_specialize=ws,
                             min_ctas_per_sm=PIN_REGISTERS, exp2_poly=given.get("exp2_poly", 0),
                             q_tiles=q_tiles, correction=correction,
                             tma_store=given.get("tma_store", False))

    def fits(bn: int) -> bool:      # shared memory, and each Q tile's S, P and O in the columns
        return (make(bn).smem_bytes <= target.max_smem_per_cta
                and q_tiles * tile_columns(bn, head_dim_v(spec), correction) <= TMEM_COLUMNS)
    # 128 keys a tile where the stages fit in shared memory (O lives in tensor memory, so the
    # registers do not bound it as on sm_90a) and the Q tiles' columns in tensor memory, else
    # 64: d256, 192 / 192, and two Q tiles above d64
    bn = given.get("block_n", 128 if fits(128) else 64)
    if bn not in (64, 128):
        raise SpecError(f"block_n = {bn} on {target}: the tcgen05 prefill kernel takes 64 or 128",
                        key="tile.block_n")
    cfg = make(bn)
    if q_tiles > 1 and spec.head_dim > Q_TILES_MAX_HEAD_DIM:
        raise SpecError(f"q_tiles = {q_tiles} with head_dim {spec.head_dim} on {target}: two Q "
                        f"tiles take head_dim 64 or 128 (at 192 ptxas spills the values the "
                        f"warps carry across setmaxnreg); drop q_tiles", key="tile.q_tiles")
    if q_tiles * cfg.tile_columns > TMEM_COLUMNS:
        raise SpecError(f"q_tiles = {q_tiles} with block_n = {bn}, head_dim_v = {cfg.dv} on "
                        f"{target}: each Q tile keeps S, P and O in tensor memory "
                        f"({cfg.tile_columns} columns), {q_tiles * cfg.tile_columns} of "
                        f"{TMEM_COLUMNS}; two Q tiles take head_dim_v <= 128 (block_n 64) or 64 "
                        f"(block_n 128)", key="tile.q_tiles")
    if cfg.smem_bytes > target.max_smem_per_cta:
        raise SpecError(f"tile block_n={bn}, num_stages={stages} needs {cfg.smem_bytes} bytes of "
                        f"shared memory; {target} allows {target.max_smem_per_cta} per CTA: use "
                        f"fewer stages", key="tile.num_stages")
    return cfg


def resolve_tile(spec: KernelSpec, target: Target) -> dict:
    c = configure(spec, target)
    return {"block_m": c.block_m, "block_n": c.block_n, "num_warps": c.num_warps,
            "num_stages": c.num_stages, "path": "tcgen05.mma.m128", "cp_async": False,
            "kv_loads": "tma", "smem_swizzle": SWIZZLE, "smem_bytes": c.smem_bytes,
            "tmem_columns": c.tmem_columns, "min_ctas_per_sm": c.min_ctas_per_sm,
            **({"warp_specialize": True, "threads": c.launch_threads} if c.warp_specialize else {}),
            **({"q_tiles": c.q_tiles} if c.q_tiles > 1 else {}),
            **({"correction": True} if c.correction else {}),
            **({"tma_store": True} if c.tma_store else {}),
            **({"exp2_poly": c.exp2_poly} if c.exp2_poly else {})}
