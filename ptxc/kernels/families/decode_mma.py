"""decode on tensor cores: the GQA math of a group of g >= 4 query heads as mma tiles.

A decode step is varlen with q_len = 1 for every sequence, so this path is varlen's GQA-packed
body (packed_paths.emit_packed_tile: Q tile -> cp.async K/V pipeline -> MmaMath -> epilogue,
split-KV share of the tiles included) with decode's own work assignment: one CTA per
(KV head x query tile, sequence, split), the same grid as the SIMT path with a query tile in
place of a head chunk. The g query heads of the KV head are the packed rows of the tile
(row R = head kv_head * g + R), padded to 16 rows per warp; each K/V row is read once per KV
head and is the mma operand (B of S = Q K^T, of O += P V).

When (math = "auto"): g >= 4, f16/bf16 queries over a cache of the same dtype or an FP8 cache
whose rows are whole 16-byte chunks (head_dim a multiple of 16, at most 128: the bytes travel by cp.async
through the pipeline and are dequantised after their wait, kv_fp8_stage.py, as in varlen;
other FP8 head dims keep the SIMT path, whose in-register dequantisation beats the synchronous
dequantising copy), head_dim <= 256 (one warp copies a row of Q), every target sm_80+
(mma.m16n8k16 and cp.async), and no SIMT tile keys (num_warps, kv_unroll) in the spec.
docs/kernels.md, "decode".
"""

from __future__ import annotations

from ...errors import SpecError
from ...ir import S32, U32, KernelBuilder, Reg
from ...spec.model import KernelSpec
from ...targets import TARGETS, Target
from .. import common as C
from ..config.register_floor import narrow_block_n, needs_floor
from ..kv import kv_fp8, kv_fp8_stage
from ..kv.kv_access import KVAccess
from ..math import fp8

MIN_GROUP = 4
MAX_HEAD_DIM = 256
MAX_FP8_HEAD_DIM = 128
MAX_BLOCK_M = 128            # 8 warps of 16 packed rows; larger groups take several CTAs
SIMT_TILE_KEYS = ("num_warps", "kv_unroll")
MMA_TILE_KEYS = ("block_n", "num_stages")
PACKED_TILE_KEYS = ("kv_loads", "warp_specialize")   # the wgmma / tcgen05 tile's (on_packed_tile)
DEFAULT_STAGES = 2


def page_size(spec: KernelSpec) -> int:
    return spec.opt("page_size") or 16


def kv_access(spec: KernelSpec) -> KVAccess:
    """The decode cache's layout (both paths; here because on_packed_tile needs it and decode.py
    imports this module)."""
    layout = spec.opt("kv_layout")
    return KVAccess(layout, kv_fp8.kv_format(spec), page_size(spec) if layout == "paged" else 0)


def mma_blocker(spec: KernelSpec) -> str | None:
    """Why this spec cannot take the tensor-core path (None: it can)."""
    if spec.group_size < MIN_GROUP:
        heads = "query head" if spec.group_size == 1 else "query heads"
        return f"the GQA group is {spec.group_size} {heads} per KV head (needs >= {MIN_GROUP})"
    if spec.dtype == "f32":
        return "dtype is f32 (tensor cores need f16 or bf16)"
    if kv_fp8.kv_dtype(spec) != spec.dtype and not kv_fp8_stage.applies(spec):
        return (f"kv_dtype is {kv_fp8.kv_dtype(spec)} with head_dim {spec.head_dim} (FP8 caches "
                f"need head_dim a multiple of 16 on tensor cores)")
    if spec.head_dim > MAX_HEAD_DIM:
        return f"head_dim = {spec.head_dim} > {MAX_HEAD_DIM}"
    if kv_fp8.kind(spec) and spec.head_dim > MAX_FP8_HEAD_DIM:
        # measured (bench/spill_sweep.py): the dequantisation beside d > 128 accumulators
        # spilled at 255 registers even at 16-key tiles (sm_80 with head/device scales)
        return f"kv_dtype is FP8 with head_dim {spec.head_dim} > {MAX_FP8_HEAD_DIM}"
    old = [t for t in spec.targets if not (TARGETS[t].has_mma_m16n8k16 and TARGETS[t].has_cp_async)]
    if old:
        return f"target {old[0]} has no mma.m16n8k16 / cp.async (sm_80+)"
    return None


def uses_mma(spec: KernelSpec) -> bool:
    math = spec.opt("math")
    if math == "simt":
        return False
    if math == "mma":
        return True          # validate() rejected it where mma_blocker says no
    tile = spec.tile_dict()
    return mma_blocker(spec) is None and not any(k in tile for k in SIMT_TILE_KEYS)


def validate(spec: KernelSpec) -> None:
    """math = "mma" must be possible, and the tile keys must belong to the path taken."""
    tile = spec.tile_dict()
    if spec.opt("math") == "mma":
        why = mma_blocker(spec)
        if why is not None:
            raise SpecError(f'math = "mma": {why}; use math = "auto" or "simt"', key="math")
        for k in SIMT_TILE_KEYS:
            if k in tile:
                raise SpecError(f'tile.{k} belongs to the SIMT path, but math = "mma"; use '
                                f'tile.block_n / tile.num_stages', key=f"tile.{k}")
    if uses_mma(spec):
        from ..bodies.packed_paths import check_tile_keys
        check_tile_keys(spec, [configure(spec, TARGETS[t]) for t in spec.targets])
    else:
        for k in MMA_TILE_KEYS + PACKED_TILE_KEYS:
            if k in tile:
                raise SpecError(f"tile.{k} belongs to the tensor-core path, which this kernel does "
                                f"not take ({mma_blocker(spec) or 'SIMT tile keys or math = simt'})",
                                key=f"tile.{k}")


def block_m(spec: KernelSpec) -> int:
    """Packed rows per CTA: the group padded to 16 rows per warp, at most MAX_BLOCK_M."""
    return min(MAX_BLOCK_M, 16 * -(-spec.group_size // 16))


def tiles_per_seq(spec: KernelSpec) -> int:
    """Query tiles (CTAs) per (sequence, KV head): 1 unless the group exceeds MAX_BLOCK_M."""
    return -(-spec.group_size // block_m(spec))


def configure(spec: KernelSpec, target: Target | None):
    """The mma.sync tile (mma_tile), moved on sm_90a / sm_100a onto varlen's wgmma or tcgen05
    tile where one applies (on_packed_tile)."""
    cfg = mma_tile(spec, target)
    return cfg if target is None else on_packed_tile(spec, target, cfg)


def on_packed_tile(spec: KernelSpec, target: Target, cfg):
    """The first of packed_paths.PATHS that applies to a 64-row tile -- sm_100a's tcgen05 tile,
    sm_90a's wgmma tile (by TMA with a producer warpgroup where varlen's rules give it,
    varlen_tile.configure) -- as varlen's one-token steps run (an H200 timed those 11 % faster
    on wgmma than the same kernel's mma.sync cubin, docs/performance.md "GPU results"); the
    mma.sync tile `cfg` where none does. The tile is one warpgroup's 64 rows, g of them the
    group's heads, the rest masked: decode is bandwidth-bound (64 rows x head_dim x 4 FLOPs a
    key against its K/V bytes, 64 FLOP per byte at d128: a fifth of an H100's ridge). Groups
    of more than 64 heads keep mma.sync: their query tiles per sequence (the grid) would differ
    from the other targets'. So does a sliding window of fewer than SHORT_WINDOW_TILES key
    tiles unless a tile key asks for the packed tile: each CTA's loop is then a few tiles, and
    the lighter CTAs (five per SM for gpt-oss's 128-key window against four) overlap more
    prologues -- the launch model puts the wgmma tile 19 % slower there, as an H200 timed the
    prefill's one-issuer kernel faster under that window (config/wgmma.py). And so does a
    tcgen05 tile that would run one CTA per SM (below), unless a tile key asks."""
    from ..attention.variant import spec_option
    from ..bodies.packed_paths import PATHS
    from ..config.prefill import PrefillConfig
    from ..config.tcgen05 import TMEM_COLUMNS
    from ..config.wgmma import ROWS_PER_WARPGROUP, SHORT_WINDOW_TILES
    asked = bool(spec.tile_dict().keys() & set(PACKED_TILE_KEYS))   # a tile key: the packed tile
    window = spec_option(spec, "sliding_window")
    short = window is not None and window < SHORT_WINDOW_TILES * cfg.block_n and not asked
    if spec.group_size > ROWS_PER_WARPGROUP or short:
        return cfg
    try:     # a tile the user sized for the 16-row CTA may not hold 64 rows of Q
        wide, kv = mma_tile(spec, target, rows=ROWS_PER_WARPGROUP), kv_access(spec)
    except SpecError:
        return cfg
    path = next(p for p in PATHS if p.applies(spec, target, wide, kv))
    if path.config_type is PrefillConfig:
        return cfg
    packed = path.configure(spec, wide, kv)
    # a tcgen05 tile that takes all of an SM's tensor memory (d256: 512 columns) runs one CTA
    # per SM, half the bytes in flight of the mma.sync tile's three (64 KiB against 125)
    whole_sm = getattr(packed, "tmem_columns", 0) > TMEM_COLUMNS // 2
    return cfg if whole_sm and not asked else packed


def mma_tile(spec: KernelSpec, target: Target | None, rows: int | None = None):
    """block_m = the padded group (1 warp up to g = 16), or `rows`; block_n 64 (32 above
    head_dim 128), two stages: one K/V tile pair in flight while the previous one is
    multiplied. FP8 caches (kv_fp8_stage.StagedFP8Config) take varlen's rule: the most stages
    that keep the CTAs per SM two stages allow (a stage is half an f16 tile), and
    .minnctapersm 1 so ptxas does not cap the registers at the occupancy shared memory never
    allows and spill the dequantisation."""
    from ..config.prefill import PrefillConfig, _check_shape
    tile = {**C.tuned_tile("decode", spec, target, MMA_TILE_KEYS), **spec.tile_dict()}   # user wins
    bm = rows or block_m(spec)
    bn = 64 if spec.head_dim <= 128 else 32
    if kv_fp8_stage.applies(spec) and target is not None and not fp8.has_fp8_cvt(target):
        bn = 32   # software FP8 conversion: 64 keys reached 255 registers and spilled (d64 .. d128)
    bn = tile.get("block_n") or narrow_block_n("decode", spec, target, bn)
    if kv_fp8_stage.applies(spec):
        def make(stages):
            return kv_fp8_stage.StagedFP8Config(C.FORMATS[spec.dtype], spec.head_dim, True, bm, bn,
                                                bm // 16, stages, True, min_ctas_per_sm=1,
                                                f16_math=kv_fp8_stage.f16_math_applies(spec))
        stages = tile.get("num_stages") or (
            kv_fp8_stage.default_stages(make, target) if target is not None else DEFAULT_STAGES)
        cfg = make(stages)
    else:
        stages = tile.get("num_stages") or DEFAULT_STAGES
        cfg = PrefillConfig(C.FORMATS[spec.dtype], spec.head_dim, True, bm, bn, bm // 16, stages, True,
                            min_ctas_per_sm=1 if needs_floor("decode", spec, target) else 0)
    if target is not None:
        if cfg.smem_bytes > target.max_smem_per_cta:
            raise SpecError(f"tile block_n={bn}, num_stages={stages} needs {cfg.smem_bytes} bytes of "
                            f"shared memory; {target} allows {target.max_smem_per_cta} per CTA: use "
                            f"a smaller tile", key="tile.block_n")
        _check_shape(cfg, target)
    return cfg


def resolve_tile(spec: KernelSpec, target: Target) -> dict:
    from ..attention.varlen_tile import WgmmaTileConfig, packed_tile_config, tile_config
    cfg = configure(spec, target)
    conf = packed_tile_config(spec, cfg)
    return tile_config(conf, cfg) if isinstance(cfg, WgmmaTileConfig) else conf


def emit_attention(b: KernelBuilder, spec, cfg, kv: KVAccess, ptrs: dict, strides: dict,
                   split_count: Reg | None, quant=None, tmaps: dict | None = None) -> None:
    """decode's work assignment for the packed body: ctaid.x = KV head x query tile,
    ctaid.y = sequence (its one token is q[seq]), ctaid.z = split."""
    from ..attention.packed_tile import TileWork
    from ..bodies.packed_paths import emit_packed_tile
    from ..bodies.varlen_attend import kv_tiles_of
    tps = tiles_per_seq(spec)
    cx, seq = b.special("%ctaid.x"), b.special("%ctaid.y")
    kv_head = b.div(cx, tps) if tps > 1 else cx
    m_start = b.mul(b.rem(cx, tps), cfg.block_m) if tps > 1 else b.mov(0, U32)
    split = b.special("%ctaid.z") if split_count is not None else None

    def seq_units(i):   # (query tiles x KV tiles, KV tiles) of sequence i per KV head
        kv_tiles = kv_tiles_of(b, kv, ptrs, i, cfg.block_n)
        return (b.mul(kv_tiles, tps) if tps > 1 else kv_tiles), kv_tiles
    batch = b.special("%nctaid.y")
    work = TileWork(seq, kv_head, split, seq, b.mov(1, S32), m_start, batch,
                    b.mul(batch, tps) if tps > 1 else batch, seq_units)
    emit_packed_tile(b, spec, cfg, kv, ptrs, strides, work, split_count, quant, tmaps)
