"""FP8 K/V tiles through the cp.async pipeline (the tensor-core body of varlen,
varlen_attend.emit_packed_tile): raw FP8 bytes in flight, dequantised after they land.

Each K/V tile's FP8 bytes move by cp.async in 16-byte chunks (16 elements) into a per-stage
staging buffer, as part of kv_pipeline's `num_stages`-deep pipeline, so the same number of
tiles is in flight as with an f16 cache at half the bytes each. After a tile's wait, and
before the barrier that precedes its use, every thread dequantises the chunks it copied itself
(a thread's own cp.async writes are visible to it after cp.async.wait_group, so no extra
barrier is needed): ld.shared.v4 of 16 FP8 bytes -> fp8.dequantize (cvt e4m3x2/e5m2x2 -> f16x2
on sm_89+, bit operations before) -> two st.shared.v4 into ONE f16/bf16 tile per K and V,
which the tile math reads with ldmatrix exactly as an f16 cache's tile. One f16 tile each is
enough: the K tile's last reader (scores of tile j-1) passed the barrier that ends
iteration j-1's softmax before any thread converts K(j), and the V tile's last reader (P·V of
tile j-1) passed the first barrier of iteration j before V(j) is converted.

Shared memory: Q | K f16 | V f16 | K staging x num_stages | V staging x num_stages. Staging rows
are not padded (a thread reads back only the chunks it wrote, 16 consecutive bytes per lane;
conflict-free either way), so a stage is block_n x head_dim bytes. Why this and not a
dequantisation at fragment-load time (ld.shared of FP8 -> cvt -> mma registers, no f16 copy):
the B fragments of K (pairs of k along a row) and of V (pairs of keys down a column, which
ldmatrix.trans transposes for f16) would need 2-byte and 1-byte shared loads per fragment
register -- 4 to 8 times the shared-memory instructions of ldmatrix -- where the f16 copy costs
one 16-byte load and two 16-byte stores per 16 elements once per CTA. docs/performance.md.

k_scale and v_scale keep their meaning (kv_fp8.py: k_scale joins the softmax scale, v_scale
the final 1/l); the staged tile holds fp8(x) exactly as f16/bf16.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

from ...ir import B32, Addr, KernelBuilder, Reg
from ...targets import Target, occupancy
from ..attention.variant import head_dim_v
from ..config.prefill import PrefillConfig
from ..mainloop.tiles import ThreadSlot, TileGeom, thread_slot, zero_regs
from ..math import fp8
from . import kv_fp8
from .kv_fp8_group import GroupScaledConversion, PaddedTile

MAX_STAGES = 4    # the num_stages tile key's largest choice


def applies(spec) -> bool:
    """FP8 caches whose K and V rows are whole 16-byte chunks (head_dim, head_dim_v multiples of
    16) are staged by cp.async; others keep kv_fp8.stage_rows_dequant (synchronous loads)."""
    return kv_fp8.kind(spec) is not None and spec.head_dim % 16 == 0 and head_dim_v(spec) % 16 == 0


@dataclass(frozen=True)
class StagingGeom(TileGeom):
    """A tile of FP8 rows as cp.async lands them: rows unpadded (row stride = row bytes)."""

    @property
    def stride(self) -> int:
        return self.row_bytes


@dataclass(frozen=True)
class StagedFP8Config(PrefillConfig):
    """PrefillConfig of a GQA-packed tile over an FP8 cache staged by cp.async: one f16/bf16
    tile each for K and V, and `num_stages` FP8 staging buffers each. With `rows` (a latent
    cache of kv_fp8.GroupScaledRows) a stage holds whole cache rows, scales and RoPE included."""

    rows: kv_fp8.GroupScaledRows | None = None
    # MLA's qk_products = "e4m3" where mma.m16n8k32 runs on FP8 tensor cores (sm_89, sm_120):
    # S reads the staged e4m3 rows themselves by ldmatrix (math/mma_qk8.py), so they land in
    # rows padded to an odd number of chunks (conflict-free, as the f16 tiles), each thread's
    # chunks in row order (tiles.thread_slot); the converted tile holds V's columns only
    qk_staged: bool = False

    @property
    def kv_geom(self) -> TileGeom:
        """The converted tile; with qk_staged only V's columns (S reads the staged bytes)."""
        return self._geom(self.block_n, self.dv if self.qk_staged else self.head_dim)

    def staging_geom(self, cols: int) -> TileGeom:
        if self.qk_staged:
            return TileGeom(self.block_n, cols, self.threads)
        return StagingGeom(self.block_n, cols, self.threads)

    @property
    def staged_row_bytes(self) -> int:
        """Bytes of a K row as it lands (V's rows are no longer: head_dim_v <= head_dim)."""
        return self.rows.row_bytes if self.rows else self.head_dim

    @property
    def staging_bytes(self) -> int:
        """One stage of K."""
        return self.staging_geom(self.staged_row_bytes).bytes

    @property
    def smem_bytes(self) -> int:
        return self.q_geom.bytes + self.kv_tiles * (self.kv_geom.bytes + self.num_stages * self.staging_bytes) + \
            self.tail_bytes


def f16_math_applies(spec) -> bool:
    """A bf16 kernel over a staged FP8 cache scaled per tensor or per head takes its tensor-core
    products on f16 inputs. Every FP8 value is an f16 value, so the tile a staged FP8 chunk
    becomes is one cvt.rn.f16x2.{e4m3x2,e5m2x2} a pair on sm_89+ (e5m2: one prmt anywhere),
    where bf16 takes four (the f16 pair, two widenings to f32, a prmt of the top halves) --
    the conversions were most of the FP8 decode loop (docs/kernels.md "FP8 on f16 products").
    Q, a bf16 tensor whose rows may exceed f16's range, is rescaled per row by a power of two
    into f16 before the loop (MmaMath.rescale_q_to_f16) and the softmax scale of each row takes
    the inverse power, so the scores are the bf16 path's up to f32 rounding; P is rounded to f16
    (finer than bf16). Not for e4m3_ds rows (a group scale times e4m3 can leave f16's range) nor
    under score transforms (soft-cap, ALiBi): they work in a row's raw-score units
    (MmaMath.fold_k_scale), 2^k_r / (k_scale · softmax_scale) here, past f32's range for the
    zero and tiny rows the rescale is for (a zero Q row: k_r = 126)."""
    from ..attention.variant import AttentionVariant
    return (applies(spec) and spec.dtype == "bf16" and kv_fp8.group_scaled(spec) is None
            and not AttentionVariant.from_spec(spec).transforms)


def default_stages(make, target: Target) -> int:
    """The most stages (up to MAX_STAGES) that fit one CTA and keep as many CTAs per SM as two
    stages do (shared memory decides: sm_80 4, sm_90 3, the 100 KiB parts 3 at head_dim 128)."""
    def ctas(cfg) -> int:
        return occupancy(target, cfg.threads, 0, cfg.smem_bytes)["ctas_per_sm"]
    base = ctas(make(2))
    for s in range(MAX_STAGES, 2, -1):
        cfg = make(s)
        if cfg.smem_bytes <= target.max_smem_per_cta and ctas(cfg) >= base:
            return s
    return 2


def staging_slot(b: KernelBuilder, geom: StagingGeom, tid: Reg) -> ThreadSlot:
    """Which chunk of the staging tile thread `tid` copies and converts. The conversion writes
    16 FP8 bytes as f16 chunks 2c and 2c + 1 of its row, so with tiles.thread_slot's order (8
    consecutive threads = 8 chunks of one row) the stores of a quarter-warp would fall in 4 of
    the 8 16-byte bank groups, a 2-way conflict. Here 8 consecutive threads take 4 chunks of two
    adjacent rows instead (quad q of a row pair: row 2p + (q & 1), chunks 4 (q >> 1) ..): the
    padded f16 row stride is an odd number of chunks, so the two rows' stores land in the even
    and the odd bank groups -- conflict-free. The staging bytes themselves are laid out in
    thread order (offset 16 tid per pass), so the cp.async writes and the ld.shared reads of a
    quarter-warp cover 128 contiguous bytes whatever the (row, chunk) order.
    Applies when the rows are a multiple of 4 chunks and every thread copies (else thread_slot)."""
    chunks, threads = geom.chunks, geom.threads
    if geom.idle_threads or chunks % 4 or (threads // chunks) % 2:
        return thread_slot(b, geom, tid)
    quad, quads_per_pair = b.shr(tid, 2), chunks // 2
    j = b.rem(quad, quads_per_pair)
    r0 = b.add(b.shl(b.div(quad, quads_per_pair), 1), b.and_(j, 1))
    col = b.shl(b.add(b.shl(b.shr(j, 1), 2), b.and_(tid, 3)), 4)
    return ThreadSlot(geom, r0, col, b.shl(tid, 4))


class FP8Staging:
    """One CTA's staged FP8 K/V: the shared-memory regions, each thread's chunk of the staging
    tiles (`slots`, tiles.ThreadSlot over StagingGeom: r0, FP8 byte column) and the conversion
    kv_pipeline calls once a tile has landed (`landed`)."""

    def __init__(self, b: KernelBuilder, cfg: StagedFP8Config, tid: Reg, tiles_base: Reg,
                 quant: kv_fp8.KVDequant):
        self.b, self.cfg, self.quant = b, cfg, quant
        self.pair = cfg.math_pair
        # f16 tiles hold the values times this (fp8.f16_pair_factor: 2^-8 for e4m3 placed by
        # bits below sm_89); the body folds its inverse into k_scale and v_scale
        self.factor = fp8.f16_pair_factor(quant.kind, quant.target) \
            if self.pair == "f16x2" and cfg.rows is None else 1.0
        kv_bytes = cfg.kv_geom.bytes
        self.tile = {"k": tiles_base, "v": b.add(tiles_base, kv_bytes)}
        self.stage_bytes = cfg.staging_bytes
        self.k_stage = b.add(tiles_base, cfg.kv_tiles * kv_bytes)
        self.v_stage = b.add(self.k_stage, cfg.num_stages * self.stage_bytes)
        slot_of = thread_slot if cfg.qk_staged else staging_slot
        k_slot = slot_of(b, cfg.staging_geom(cfg.staged_row_bytes), tid)
        v_slot = k_slot if cfg.dv == cfg.head_dim else staging_slot(b, cfg.staging_geom(cfg.dv), tid)
        self.slots = {"k_cache": k_slot, "v_cache": v_slot}
        # qk_staged: S reads the staged bytes, so only V's columns are converted
        self.v_only = b.setp("lt", k_slot.col, cfg.dv) if cfg.qk_staged else None
        # this thread's two f16 chunks (element columns 2 x the FP8 byte column) in each tile
        self.geoms = {"k": cfg.kv_geom, "v": cfg.v_geom}
        self.f16_off = {t: b.mad(s.r0, self.geoms[t].stride, b.shl(s.col, 1))
                        for t, s in (("k", k_slot), ("v", v_slot))}
        # group-scaled latent rows: converted by a mapping of their own after the barrier
        self.group = None
        if cfg.rows is not None:
            assert cfg.shared_kv, "group-scaled rows are latent (one tile, converted after a barrier)"
            # offsets kept across the loop where registers allow (up to 8 warps: 255 a thread);
            # the 16-warp tile's 128 spilled them
            self.group = GroupScaledConversion(b, cfg.rows, cfg.block_n, cfg.threads, tid,
                                               PaddedTile(cfg.kv_geom.stride), quant, cfg.fmt,
                                               keep_offsets=cfg.threads <= 256)

    def landed(self, t: str, stage: Reg | int) -> Reg:
        """After the wait for tile `t` ("k" | "v") in the staging buffer at offset `stage`:
        dequantise this thread's chunks into the f16/bf16 tile; returns the tile's address.
        All passes' shared loads are issued before the first conversion."""
        b = self.b
        if self.group is not None:
            self.group.convert(b.add(self.k_stage, stage), self.tile["k"])
            return self.tile["k"]
        slot = self.slots["k_cache" if t == "k" else "v_cache"]
        geom, f16 = slot.geom, self.geoms[t]
        src = b.add(b.add(self.k_stage if t == "k" else self.v_stage, stage), slot.soff)
        dst = b.add(self.tile[t], self.f16_off[t])
        loaded = []
        for i in range(geom.passes):
            guard = slot.guard(b, i)
            if self.v_only is not None:
                guard = self.v_only if guard is None else b.and_(guard, self.v_only)
            loaded.append((guard, self._load(src, i * geom.rows_per_pass * geom.stride, guard)))
        for i, (guard, words) in enumerate(loaded):
            vals = fp8.f16_pairs(b, words, self.quant.kind, self.quant.target) if self.pair == "f16x2" \
                else fp8.dequantize(b, words, self.quant.kind, self.quant.target, to=self.pair)
            doff = i * geom.rows_per_pass * f16.stride
            for h in range(2):
                with b.predicate(guard) if guard is not None else nullcontext():
                    b.st("shared", B32, Addr(dst, doff + 16 * h), vals[4 * h:4 * h + 4])
        return self.tile[t]

    def staged(self, stage: Reg | int) -> Reg:
        """The staging buffer at offset `stage` (qk_staged: where S reads the tile's rows)."""
        return self.b.add(self.k_stage, stage)

    def _load(self, src: Reg, off: int, guard: Reg | None, vec: int = 4, elem=B32) -> list[Reg]:
        """ld.shared of this thread's chunk (or a word of its row) in one pass; zeros where
        the pass has no row for it."""
        b = self.b
        if guard is None:
            words = b.ld("shared", elem, Addr(src, off), vec=vec)
            return words if isinstance(words, list) else [words]
        words = zero_regs(b, vec) if elem is B32 else [b.mov(0.0, elem) for _ in range(vec)]
        with b.predicate(guard):
            b.ld("shared", elem, Addr(src, off), vec=vec, out=words)
        return words


class SwizzledFP8Staging:
    """FP8Staging for the wgmma tiles (the wgmma prefill's layout: 128-byte slabs of rows x 128 B,
    chunk k of row r at swizzled chunk k ^ (r % 8)). The FP8 rows land unpadded (staging_slot
    over StagingGeom); after the wait each thread converts the 16 bytes it copied into bf16/f16
    chunks 2c and 2c + 1 of its row: slab 2c // 8, swizzled chunks (2c % 8) ^ (r % 8) and
    (2c % 8 + 1) ^ (r % 8) (rows_per_pass is a multiple of 8, so every pass has the first's
    swizzle and an immediate offset); staging_slot's thread order keeps those stores
    bank-conflict-free. One converted tile each for K and V: the wgmma pipeline
    converts K(j) and V(j-1) at the top of iteration j, after the barrier that ended every read
    of K(j-1) and V(j-2) (wgmma_pipeline.py), and its fence.proxy.async follows the barrier.

    Shared memory from `tiles_base`: K tile | V tile | K staging x stages | V staging x stages."""

    def __init__(self, b: KernelBuilder, geom: StagingGeom, tile_bytes: int, slab_bytes: int,
                 stages: int, tid: Reg, tiles_base: Reg, quant: kv_fp8.KVDequant, pair: str):
        assert geom.rows_per_pass % 8 == 0 and not geom.idle_threads and geom.rows % geom.rows_per_pass == 0, geom
        self.b, self.geom, self.quant, self.pair = b, geom, quant, pair
        self.tile = {"k": tiles_base, "v": b.add(tiles_base, tile_bytes)}
        self.stage_bytes = geom.bytes
        self.k_stage = b.add(tiles_base, 2 * tile_bytes)
        self.v_stage = b.add(self.k_stage, stages * self.stage_bytes)
        # staging_slot's order: a quarter-warp converts 4 chunks of two adjacent rows, whose
        # swizzles (r % 8 even / odd) put its 8 stores in 8 different bank groups
        self.slot = staging_slot(b, geom, tid)
        k2 = b.shr(self.slot.col, 3)                       # bf16 chunk 2c of the row (c = col / 16)
        r8 = b.and_(self.slot.r0, 7)
        row = b.mad(b.shr(k2, 3), slab_bytes, b.shl(self.slot.r0, 7))
        in_slab = b.and_(k2, 7)
        self.dst = [b.add(row, b.shl(b.xor(b.add(in_slab, h), r8), 4)) for h in range(2)]

    def landed(self, t: str, stage: Reg | int) -> Reg:
        """After the wait for tile `t` ("k" | "v") staged at offset `stage`: this thread's
        chunks dequantised into the swizzled tile; returns the tile's address."""
        b, geom = self.b, self.geom
        src = b.add(b.add(self.k_stage if t == "k" else self.v_stage, stage), self.slot.soff)
        words = [b.ld("shared", B32, Addr(src, i * geom.rows_per_pass * geom.stride), vec=4)
                 for i in range(geom.passes)]
        dst = [b.add(self.tile[t], d) for d in self.dst]
        for i, w in enumerate(words):
            vals = fp8.dequantize(b, w, self.quant.kind, self.quant.target, to=self.pair)
            for h in range(2):
                b.st("shared", B32, Addr(dst[h], i * geom.rows_per_pass * 128), vals[4 * h:4 * h + 4])
        return self.tile[t]


__all__ = ["applies", "f16_math_applies", "StagingGeom", "StagedFP8Config", "default_stages", "staging_slot", "FP8Staging",
           "SwizzledFP8Staging", "MAX_STAGES"]
