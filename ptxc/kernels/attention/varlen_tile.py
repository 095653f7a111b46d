"""The GQA-packed tile below its bodies: its configuration (the mma.sync tile's metadata, the
sm_90a wgmma tile and when TMA loads its K/V), its per-row epilogue math, and the score
transform hook. varlen_attend.py (mma.sync), varlen_wgmma.py (cp.async on wgmma) and
varlen_tma.py (TMA on wgmma) build on these; nothing here imports a body.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...ir import B32, F32, S64, U64, Addr, KernelBuilder, Reg
from ...targets import TARGETS, occupancy
from .. import common as C
from ..config.prefill import PrefillConfig
from ..config.tcgen05 import (PIN_REGISTERS, TCGEN05_HEAD_DIMS, TCGEN05_TARGETS,
                              TensorMemoryTile, check_correction)
from ..config.wgmma import ROWS_PER_WARPGROUP, WgmmaConfig, uses_wgmma
from ..kv.kv_access import KVAccess
from ..kv.kv_fp8 import group_scaled, kind, kv_dtype
from ..kv.kv_fp8_stage import StagedFP8Config, StagingGeom
from ..mainloop.tiles import CHUNK, SWIZZLE, SwizzledGeom
from ..mainloop.tma_ws_pipeline import consumer_regs
from ..math.mma import MmaMath
from ..math.tcgen05 import Tcgen05Math
from .packed_tile import VarlenCtx
from .variant import finish_rows, spec_option


class VarlenMath(MmaMath):
    """prefill's tensor-core tile math; only the epilogue differs (per-row output addresses)."""

    def __init__(self, b: KernelBuilder, ctx: VarlenCtx, ptrs: dict, strides: dict, **math):
        super().__init__(b, ctx, **math)     # `math`: the next math class's own arguments
        self.ptrs, self.strides = ptrs, strides
        self.v_scale: Reg | None = None    # FP8 V: multiplies 1/l (set by emit_varlen)

    def epilogue(self) -> None:
        """1/l per row, then o in the dtype (and lse), or split: the log2 lse_part and the f32
        partial o_part -- except where split 0 covers the whole tile (ctx.whole): it stores the
        final o itself and, with S > 1, marks the row +inf in split 1's lse_part (split 1 has
        nothing there); split_reduce then only turns lse_part[.., 0] into the final lse."""
        b, ctx = self.b, self.ctx
        split = ctx.split is not None
        writer = self.writer()
        l_rows, lanes = self.row_sums()
        seen: list[Reg] = []
        invs = finish_rows(b, ctx, self.sums_max(), l_rows, self.rows, lanes, writer,
                           lse_scale=1.0 if split else C.LN2, seen=seen)
        if self.v_scale is not None:
            invs = [b.mul(inv, self.v_scale) for inv in invs]
        if not split:
            self.store_rows(invs)
            return
        if ctx.whole is None:
            self.store_parts(invs, seen)
            return
        with b.if_then(ctx.whole):
            self.store_rows(invs)
            for row in self.rows:      # ctx.whole implies num_splits > 1: split 1's slot exists
                with b.predicate(b.and_(writer, b.setp("lt", row, ctx.seq_q))):
                    b.st("global", F32, Addr(ctx.lse_addr(b, row), 4), [b.mov(C.POS_INF, F32)])
        with b.else_():
            self.store_parts(invs, seen)

    def store_rows(self, invs: list[Reg]) -> None:
        """o [total_q, H, dv] in the dtype (strided): this lane's columns 2t, 2t+1 of each row."""
        b, ctx = self.b, self.ctx
        o, strides = C.late(self.ptrs["o"]), [C.late(self.strides[("o", a)]) for a in (0, 1)]
        for r, row in enumerate(self.rows):
            ok = b.setp("lt", row, ctx.seq_q)
            tok = b.add(ctx.token0, ctx.token(row))
            base = C.element_offset(b, o, tok, strides[0])
            base = C.element_offset(b, b.bitcast(base, U64), ctx.head(row), strides[1])
            addr = b.bitcast(b.add(base, b.cvt(S64, b.shl(self.t, 2))), U64)
            if self.col0 is not None:   # this warp's slice of the value columns
                addr = b.add(addr, b.mul_wide(self.col0, ctx.cfg.fmt.bytes))
            for jd, acc in enumerate(self.o):
                lo, hi = (b.mul(acc[2 * r + e], invs[r]) for e in range(2))
                with b.predicate(ok):
                    b.st("global", B32, Addr(addr, jd * 16), [b.cvt_pack(self.out_pair, hi, lo)])

    def store_parts(self, invs: list[Reg], seen: list[Reg]) -> None:
        """o_part [total_q, H, splits, dv] f32: this lane's columns 2t, 2t+1 -- not for a row
        whose partial lse is -inf, which the reduce never reads (an idle split index of a
        64-row MLA tile leaves 128 KiB unwritten)."""
        b, ctx = self.b, self.ctx
        for r, row in enumerate(self.rows):
            ok = b.and_(b.setp("lt", row, ctx.seq_q), seen[r])
            addr = b.add(self.ptrs["o_part"], b.mul_wide(ctx.out_index(row), ctx.cfg.dv * 4))
            addr = b.add(addr, b.cvt(U64, b.shl(self.t, 3)))
            if self.col0 is not None:
                addr = b.add(addr, b.mul_wide(self.col0, 4))
            for jd, acc in enumerate(self.o):
                lo, hi = (b.mul(acc[2 * r + e], invs[r]) for e in range(2))
                with b.predicate(ok):
                    b.st("global", F32, Addr(addr, jd * 32), [lo, hi])


class VarlenTcgen05Math(VarlenMath, Tcgen05Math):
    """Tcgen05Math's tile math (sm_100a) with VarlenMath's per-row epilogue: O is fetched from
    tensor memory first and the tensor memory freed after."""

    def __init__(self, b: KernelBuilder, ctx: VarlenCtx, ptrs: dict, strides: dict, bars: Reg,
                 tmem: Reg | None = None, exchange: Reg | None = None,
                 barrier: tuple[int, int] | None = None):
        VarlenMath.__init__(self, b, ctx, ptrs, strides, bars=bars, tmem=tmem, exchange=exchange,
                            barrier=barrier)

    def epilogue(self) -> None:
        self.fetch_o()
        VarlenMath.epilogue(self)
        self.release()


def packed_tile_config(spec, c: PrefillConfig) -> dict:
    """The metadata `config` of a GQA-packed tile (varlen, and decode on tensor cores)."""
    return {"block_m": c.block_m, "block_n": c.block_n, "num_warps": c.num_warps,
            "num_stages": c.num_stages, "path": "mma.m16n8k16", "gqa_packing": spec.group_size,
            "smem_row_stride": c.q_geom.stride, "smem_bytes": c.smem_bytes,
            **({"value_split": c.v_split} if c.v_split > 1 else {}),
            **({"score_split": True, "exchange_bytes": c.exchange_bytes} if c.score_split else {}),
            **({"fp8_staging_bytes": c.staging_bytes} if isinstance(c, StagedFP8Config) else {}),
            **({"mma_inputs": c.math_fmt.name} if c.math_fmt is not c.fmt else {}),
            **({"q_values": "e4m3"} if c.q_e4m3 else {}),
            **({"qk_products": "e4m3"} if getattr(c, "qk_staged", False) else {}),
            **({"min_ctas_per_sm": c.min_ctas_per_sm} if c.min_ctas_per_sm else {})}


def score_transform(b: KernelBuilder, spec, math: MmaMath):
    """The pipeline's transform hook: the variant's (soft-cap, ALiBi) through the math's
    fragment layout, else variant.transform_scores (which emits nothing without an option)."""
    variant = math.ctx.variant
    unit = 1.0 / spec.softmax_scale                    # MmaMath's scores are raw q·k
    return math.transform if variant.transforms else \
        lambda s, key0: variant.transform_scores(b, s, key0, unit)


MIN_PAGE_ROWS = 8    # one swizzle period: a box must start 1024-byte aligned in its slab


def tma_applies(kv: KVAccess) -> bool:
    """Whether the layout's K/V tiles can be TMA boxes (else the cp.async body runs): a box of
    min(page_size, block_n) rows must sit inside one page, so a page that is not a power of two
    takes TMA only when it is a whole number of the largest K/V tile (64 rows). Never for
    sparse top-k slots: each row is gathered from a slot of its own, not a box of a page."""
    if kv.sparse:
        return False
    if kv.layout == "contiguous":
        return True
    ps = kv.page_size
    return kv.layout == "paged" and ps >= MIN_PAGE_ROWS and (kv.pow2_pages or ps % 64 == 0)


PATH = "wgmma.m64nNk16"
WS_TWO_CTA_MAX_DV = 128   # the widest V whose P·V fits 128 registers (ws_ctas_per_sm)


@dataclass(frozen=True)
class WgmmaTileConfig(WgmmaConfig):
    """WgmmaConfig without the O staging region (the packed epilogue stores from registers).
    With `fp8` the cache holds FP8 bytes: they land by cp.async in `num_stages` unpadded staging
    buffers each for K and V and are dequantised into one swizzled tile each
    (kv_fp8_stage.SwizzledFP8Staging)."""

    finishes_whole_tiles: ClassVar[bool] = True   # registers to spare (PrefillConfig)
    fp8: bool = False

    @property
    def consumer_regs(self) -> int:
        """tile.warp_specialize: the consumers' share at min_ctas_per_sm CTAs an SM."""
        return consumer_regs(self.block_m // ROWS_PER_WARPGROUP, max(1, self.min_ctas_per_sm))

    @property
    def q_region_bytes(self) -> int:
        return self.q_geom.bytes

    @property
    def staging_geom(self) -> StagingGeom:
        return StagingGeom(self.block_n, self.head_dim, self.threads)

    @property
    def smem_bytes(self) -> int:
        if not self.fp8:
            return super().smem_bytes
        return self.q_region_bytes + 2 * (self.kv_geom.bytes + self.num_stages * self.staging_geom.bytes)

    @property
    def group_bytes(self) -> int:
        """Bytes of a row one copy pass covers: whole 128-byte slabs that divide the row, and
        few enough that a pass moves threads / (bytes / 16) rows, a multiple of 8 (whole
        swizzle groups): 256 at d128 and d256 with one warpgroup, 128 at d192 (three groups)."""
        row = self.head_dim * self.fmt.bytes
        return max(g for g in range(SWIZZLE, row + 1, SWIZZLE)
                   if row % g == 0 and self.threads % (g // CHUNK) == 0
                   and self.threads // (g // CHUNK) % 8 == 0)

    @property
    def groups(self) -> int:
        return self.head_dim * self.fmt.bytes // self.group_bytes

    def copy_geom(self, rows: int) -> SwizzledGeom:
        return SwizzledGeom(rows, self.group_bytes, self.threads)


@dataclass(frozen=True)
class Tcgen05TileConfig(TensorMemoryTile, WgmmaTileConfig):
    """The packed tile on tcgen05 (sm_100a; TMA loads): WgmmaTileConfig's shared memory plus
    the MMA barriers and the tensor-memory address, S/P/O in tensor memory; `correction`: the
    warp-specialised tile's correction warps (tile.correction)."""

    correction: bool = False


def applies_tcgen05(spec, target, cfg: PrefillConfig, kv: KVAccess) -> bool:
    """Whether the packed tile `cfg` runs on tcgen05 for `target` (math/tcgen05.py's math
    on varlen_tma.py's body): sm_100a / sm_103a, caches of the dtype loaded by TMA, head_dim
    and head_dim_v 64, 128, 192 or 256 (head_dim_v <= head_dim: DeepSeek's 192 / 128), block_m
    64 (M = 64) or 128, no custom mask."""
    return (target.name in TCGEN05_TARGETS and spec.dtype in ("f16", "bf16")
            and kv_dtype(spec) == spec.dtype and cfg.head_dim in TCGEN05_HEAD_DIMS
            and cfg.dv in TCGEN05_HEAD_DIMS and cfg.dv <= cfg.head_dim
            and _loads_by_tma(spec, kv) and spec_option(spec, "custom_mask") in (None, "none")
            and cfg.v_split == 1 and cfg.block_m in (64, 128)
            and cfg.num_warps == cfg.block_m // 16)


def applies(spec, target, cfg: PrefillConfig, kv: KVAccess) -> bool:
    """Whether the packed tile `cfg` (the mma.sync one) runs on wgmma for `target`: caches of
    the dtype, or FP8 (e4m3 / e5m2) staged by cp.async. V narrower than K (head_dim_v <
    head_dim) only where TMA loads the tiles (the per-thread copy's groups are K's rows)."""
    narrow_v = cfg.dv != cfg.head_dim
    return (uses_wgmma(spec, target)
            and (kv_dtype(spec) == spec.dtype or (fp8_staged(spec, cfg) and not narrow_v))
            and (not narrow_v or _loads_by_tma(spec, kv))
            and cfg.v_split == 1 and cfg.block_m in (ROWS_PER_WARPGROUP, 2 * ROWS_PER_WARPGROUP)
            and cfg.num_warps == cfg.block_m // 16)


def _loads_by_tma(spec, kv: KVAccess) -> bool:
    """K/V tiles by TMA: the default where the layout allows, for caches of the dtype (TMA
    cannot dequantise)."""
    return spec.tile_dict().get("kv_loads", "tma") == "tma" and tma_applies(kv) and kind(spec) is None


def fp8_staged(spec, cfg: PrefillConfig) -> bool:
    """An FP8 cache whose staged rows cover whole 8-row swizzle groups per copy pass."""
    if kind(spec) is None or group_scaled(spec):
        return False
    geom = StagingGeom(cfg.block_n, spec.head_dim, cfg.threads)
    return geom.rows_per_pass % 8 == 0 and not geom.idle_threads and cfg.block_n % geom.rows_per_pass == 0


def configure(spec, cfg: PrefillConfig, kv: KVAccess) -> WgmmaTileConfig:
    """The mma.sync tile (block_m, block_n, stages) on swizzled tiles: never more shared memory
    than the padded layout (whose padding exceeds the TMA path's barrier bytes), so it fits
    wherever that one did. K/V tiles come by TMA (tile.kv_loads = "tma", the default) where
    the layout allows (tma_applies: contiguous, or pages of >= 8 rows), else, or
    with kv_loads = "cp_async", by per-thread cp.async."""
    fp8 = kind(spec) is not None      # TMA cannot dequantise: FP8 bytes come by cp.async
    tma = _loads_by_tma(spec, kv)
    ws = tma and warp_specialized(spec, cfg)
    block_n, stages = ws_shape(spec, cfg) if ws else (cfg.block_n, cfg.num_stages)
    return WgmmaTileConfig(cfg.fmt, cfg.head_dim, True, cfg.block_m, block_n, cfg.num_warps,
                           stages, True, cfg.dv, 1,
                           kv_loads="tma" if tma else "cp_async", fp8=fp8, f16_math=cfg.f16_math,
                           warp_specialize=ws,
                           min_ctas_per_sm=ws_ctas_per_sm(cfg, block_n, stages) if ws else 0,
                           pingpong=ws and cfg.block_m == 2 * ROWS_PER_WARPGROUP
                           and bool(spec.tile_dict().get("pingpong", False)))


# The warp-specialised tile is the default where it keeps the bytes in flight per SM of the
# one-issuer tile, on static figures alone (no Hopper GPU lent since; ptxas 13.5,
# bench/loop_quality.py, docs/performance.md "varlen on wgmma"), and the launch model does not
# rank it slower at any serving shape: at d128 two CTAs either way, 64 KiB in flight each, and
# every consumer warp's iteration is 228 instructions against 286-313 (1.73 against 2.37 per
# HGMMA-equivalent); at DeepSeek's 192 / 128 (64-row pages) two CTAs of three stages (120 KiB
# in flight per SM) against three of two (121), 176 instructions against 228-255 (its tile is
# 64 keys since: WS_TILES). At d64 four stages at two CTAs would keep the bytes (128 KiB) too,
# but with two consumer warpgroups per SM where the one-issuer tile has four the model ranks it
# 3-5 % slower on prefill chunks, so there (and at d256, one CTA against two: 8-11 %) it is
# opt-in. Keys: (head_dim, head_dim_v).
WS_DEFAULT_SHAPES = ((128, 128), (192, 128))
# The warp-specialised tile's (block_n, stages) where they are not the family's (None: its
# block_n). d64 and d256 run fewer CTAs per SM than the one-issuer tile (whose 2 stages the
# family's configure chose): as many more stages as keep its bytes in flight per SM -- d64 4 CTAs
# x 2 stages = 2 x 4; d256 2 x 2 = 1 x 4. DeepSeek's 192 / 128 takes 64-key tiles, two stages
# at two CTAs (160 KiB in flight per SM): the family's 32 keys made S = Q.K^T twelve
# m64n32k16 wgmmas reading Q and K from shared memory, (64 + 32) x 32 bytes each for 65536
# FLOPs -- 24 clocks of the SM's 128 bytes a clock against 16 of math, so the operands paced
# it (report.sass_instr.operand_stall_flops) and the varlen prefill measured 421-509 TFLOP/s
# on an H200 where the prefill family's 128-key tile reached 718-723. At 64 keys the operands
# take 32 clocks of 32; a tree mask, whose per-row state spills beside a 64 x 64 S, keeps 32 keys
# in three stages (120 KiB in flight per SM). The first choice that applies and fits; none where
# block_n or num_stages is given (then the family's).
WS_TILES = {(64, 64): ((None, 4),), (192, 128): ((64, 2), (None, 3)), (256, 256): ((None, 4),)}


def warp_specialized(spec, cfg: PrefillConfig) -> bool:
    """tile.warp_specialize on the sm_90a TMA tile: a producer warpgroup's first warp issues
    the K/V boxes under full/empty mbarriers and the block_m / 16 consumer warps only compute
    (tma_ws_pipeline.py; docs/kernels.md "wgmma (sm_90a): the packed tile"). Default: one
    consumer warpgroup at (head_dim, head_dim_v) in WS_DEFAULT_SHAPES."""
    default = (cfg.block_m == ROWS_PER_WARPGROUP and (cfg.head_dim, cfg.dv) in WS_DEFAULT_SHAPES
               and ws_ctas_per_sm(cfg, *ws_shape(spec, cfg)) == 2)
    return bool(spec.tile_dict().get("warp_specialize", default))


def ws_shape(spec, cfg: PrefillConfig) -> tuple[int, int]:
    """The warp-specialised tile's (block_n, stages): the first of WS_TILES' choices for one
    consumer warpgroup that fits (a tree mask: only those keeping the family's block_n, whose
    per-row state beside a 64 x 64 S spilled 324 bytes at 192 / 128) where neither
    tile.block_n nor tile.num_stages is given, else the family's."""
    if spec.tile_dict().keys() & {"num_stages", "block_n"} or cfg.block_m != ROWS_PER_WARPGROUP:
        return cfg.block_n, cfg.num_stages
    tree = spec_option(spec, "custom_mask") == "tree"
    for block_n, stages in WS_TILES.get((cfg.head_dim, cfg.dv), ()):
        if block_n is not None and tree:
            continue
        block_n = block_n or cfg.block_n
        if _ws_tile(cfg, block_n, stages).smem_bytes <= TARGETS["sm_90a"].max_smem_per_cta:
            return block_n, stages
    return cfg.block_n, cfg.num_stages


def _ws_tile(cfg: PrefillConfig, block_n: int, stages: int) -> WgmmaTileConfig:
    return WgmmaTileConfig(cfg.fmt, cfg.head_dim, True, cfg.block_m, block_n, cfg.num_warps,
                           stages, True, cfg.dv, 1, kv_loads="tma", warp_specialize=True)


def ws_ctas_per_sm(cfg: PrefillConfig, block_n: int, stages: int) -> int:
    """The warp-specialised tile's CTAs per SM (its .minnctapersm, which setmaxnreg's budgets
    divide) at `block_n` x `stages`: two for one consumer warpgroup where two fit in shared
    memory and V is at most 128 wide, as the one-issuer tile runs (128 registers on entry; the producer
    keeps 56, the consumers get 200), else one (two consumer warpgroups at two CTAs would get
    104; ptxas checks every instruction against the entry count, not setmaxnreg's, and d256's
    m64n256 P·V needs 158)."""
    tile = _ws_tile(cfg, block_n, stages)
    by_smem = occupancy(TARGETS["sm_90a"], tile.launch_threads, 0, tile.smem_bytes)["ctas_per_sm"]
    return 2 if (cfg.block_m == ROWS_PER_WARPGROUP and cfg.dv <= WS_TWO_CTA_MAX_DV
                 and by_smem >= 2) else 1


# The load / MMA / softmax warps (tile.warp_specialize) are the default for the 64-row tile at
# every head dim, on static figures alone (no Blackwell GPU lent; docs/performance.md
# "Blackwell"): the softmax warps' loop is 166 instructions a tile at d64 and d128 (114 at
# 192 / 128 and d256) against 226-344 for the warps of the one-issuer tile, with fewer
# registers, at the same CTAs per SM -- tensor memory bounds both (the tile's 256 columns: two
# CTAs of an SM's 512; one at d256's 512) -- and for the 128-row tile at d64 (two CTAs either
# way, by registers). The 128-row tile keeps one issuing warp from d128, where the 64 more
# threads cost its second CTA (registers: 1 against 2).


def configure_tcgen05(spec, cfg: PrefillConfig) -> Tcgen05TileConfig:
    """The packed tile on tcgen05 (applies_tcgen05 holds): the same tile, TMA loads; with
    tile.warp_specialize (the default at block_m 64, and at d64) a load warp and an MMA warp
    besides (tcgen05_ws_pipeline.py)."""
    given = spec.tile_dict()
    correction = given.get("correction", False)
    ws = given.get("warp_specialize", cfg.block_m == 64 or cfg.head_dim == 64 or correction)
    if correction:
        check_correction(ws, cfg.dv, "sm_100a")
    return Tcgen05TileConfig(cfg.fmt, cfg.head_dim, True, cfg.block_m, cfg.block_n, cfg.num_warps,
                             cfg.num_stages, False, cfg.dv, 1, kv_loads="tma",
                             min_ctas_per_sm=PIN_REGISTERS, warp_specialize=ws,
                             correction=correction)


def tile_config(base: dict, cfg: WgmmaTileConfig) -> dict:
    """The metadata config: the packed tile's, with the path and the swizzle (as prefill),
    kv_loads = "tma" when TMA loads the K/V tiles (absent: per-thread cp.async), MLA's split
    scores and their exchange bytes and e4m3 score products, and on tcgen05 the tensor-memory
    columns."""
    tc = isinstance(cfg, Tcgen05TileConfig)
    out = {**base, "path": f"tcgen05.mma.m{cfg.block_m}" if tc else PATH,
           "smem_swizzle": SWIZZLE, **({"kv_loads": "tma"} if cfg.tma else {}),
           **({"fp8_staging_bytes": cfg.staging_geom.bytes} if cfg.fp8 else {}),
           **({"split_scores": True, "exchange_bytes": cfg.score_exchange_bytes}
              if getattr(cfg, "split_scores", False) else {}),
           **({"seesaw": True, "exchange_bytes": cfg.seesaw_exchange_bytes}
              if getattr(cfg, "seesaw", False) else {}),
           **({"dequant_warpgroup": True, "threads": cfg.launch_threads}
              if getattr(cfg, "dequant_warpgroup", False) else {}),
           **({"setmaxnreg": [cfg.producer_regs, cfg.consumer_regs]}
              if getattr(cfg, "dequant_warpgroup", False) and cfg.producer_regs is not None else {}),
           **({"qk_products": "e4m3", "score_chains": cfg.score_chains}
              if getattr(cfg, "qk_e4m3", False) else {}),
           **({"tmem_columns": cfg.tmem_columns} if tc else {}),
           **({"value_ctas": cfg.value_ctas} if tc and cfg.value_ctas > 1 else {}),
           **({"warp_specialize": True, "threads": cfg.launch_threads}
              if cfg.warp_specialize else {}),
           **({"setmaxnreg": [cfg.producer_regs, cfg.consumer_regs]}
              if cfg.warp_specialize and not tc else {}),
           **({"pingpong": True} if cfg.pingpong else {}),
           **({"correction": True} if tc and cfg.correction else {})}
    out.pop("smem_row_stride")
    return out
