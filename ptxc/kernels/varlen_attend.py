"""The varlen kernel body: one CTA = one packed query tile of one (sequence, KV head, split).

Work assignment is a policy in front of the shared body (emit_packed_tile, given a TileWork):
varlen's grid.x counts packed query tiles over the whole batch; sequence b's tiles start at
cu[b] * g // block_m + b, so a CTA finds its sequence by a binary search of cu_seqlens_q
(find_sequence) and at most `batch` tiles in all find no rows and exit. decode's tensor-core
path (decode_mma.py) gives one token per sequence straight from the grid instead.

Packed rows: row R of a sequence's query block is token R / g, query head kv_head * g + R % g
(g = group size), so a tile of block_m rows covers block_m / g tokens of all g heads and every
K/V tile it loads serves all of them. Per CTA:

    q_len, L      from cu_seqlens_q (clamped into [0, total_q]) and seq_lens (clamped to the
                  cache capacity); a tile whose first row is >= q_len * g exits at once
    tile range    keys visible to the tile's last token (variant.key_end) give the tiles to
                  visit; those visible to its first token, the tiles that need no mask; a split
                  takes an even share of the visited tiles
    Q tile        GQA-packed rows through load_tile_rows (strided per token and per head)
    K/V tiles     rows through KVAccess.row_address (the decode family's per-layout addressing:
                  page-table lookups guarded by row < L and page ids checked against num_pages)
    math          prefill's MmaMath (ldmatrix + mma.m16n8k16 + online softmax) and the shared
                  K/V pipeline (kv_pipeline.py), with this family's key limit per packed row
    epilogue      1/l per row (prefill.finish_rows), stores straight from the accumulators: o
                  in the dtype, or f32 o_part + log2 lse_part for split_reduce.py
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..ir import B32, F32, S32, S64, U32, U64, Addr, KernelBuilder, Reg
from . import common as C
from .kv_access import KVAccess
from .kv_fp8 import stage_rows_dequant
from .kv_fp8_stage import FP8Staging, StagedFP8Config
from .kv_pages import PagedTiles, prefetch_applies
from .kv_pipeline import run_kv_pipeline
from .prefill import PrefillConfig, finish_rows, load_head_f32
from .prefill_mma import MmaMath
from .split_plan import emit_balanced_split
from .tiles import load_tile_rows, thread_slot
from .variant import AttentionVariant


@dataclass
class VarlenCtx:
    """What MmaMath and finish_rows read (the same names as prefill's Ctx), for packed rows."""

    b: KernelBuilder
    spec: object
    cfg: PrefillConfig
    variant: AttentionVariant
    tid: Reg
    lane: Reg
    warp: Reg
    m_start: Reg          # u32 first packed row of the tile
    seq_q: Reg            # u32 packed rows of the sequence: q_len * g
    q_len: Reg            # s32
    kv_len: Reg           # s32 L after clamping
    q_smem: Reg
    kv_head: Reg
    token0: Reg           # u32 cu_seqlens_q[b] after clamping
    lse: Reg | None       # u64: lse, or lse_part with splits
    split: Reg | None     # u32 split index (None without split-KV)
    num_splits: Reg | None
    sinks: Reg | None = None    # u64 sinks [num_heads] f32 (attention_sinks)
    slopes: Reg | None = None   # u64 alibi_slopes [num_heads] f32 (alibi)

    def token(self, row: Reg) -> Reg:
        g = self.spec.group_size
        return self.b.div(row, g) if g > 1 else row

    def head(self, row: Reg) -> Reg:
        g = self.spec.group_size
        if g == 1:
            return self.kv_head
        return self.b.mad(self.kv_head, g, self.b.rem(row, g))

    def position(self, token: Reg) -> Reg:
        """s32 absolute position of a query token: L - q_len + token."""
        b = self.b
        return b.add(b.sub(self.kv_len, self.q_len), b.bitcast(token, S32))

    def key_limit(self, b: KernelBuilder, row: Reg) -> Reg:
        return self.variant.key_end(b, self.position(self.token(row)), self.kv_len)

    def key_begin(self, b: KernelBuilder, row: Reg) -> Reg | None:
        if self.variant.window is None:
            return None
        return self.variant.key_begin(b, self.position(self.token(row)))

    def sink_log2(self, b: KernelBuilder, row: Reg) -> Reg | None:
        """The row's sink logit in log2 units; with split-KV only split 0 adds it (the partial
        LSEs then merge to log(e^sink + sum e^s) in split_reduce), the others get -inf."""
        if self.sinks is None:
            return None
        sink = b.mul(load_head_f32(b, self.sinks, self.head(row)), C.LOG2E)
        if self.split is not None:
            sink = b.selp(sink, C.NEG_INF, b.setp("eq", self.split, 0))
        return sink

    def alibi_row(self, b: KernelBuilder, row: Reg, lane_key: Reg, unit: float) -> tuple[Reg, Reg]:
        """(p - lane_key (s32), -unit · slope of the row's head) for variant.transform_scores."""
        pos = self.position(self.token(row))
        return b.sub(pos, lane_key), b.mul(load_head_f32(b, self.slopes, self.head(row)), -unit)

    def out_index(self, row: Reg) -> Reg:
        """u32 (token, head) index into [total_q, H] (times num_splits, plus split, for parts)."""
        b = self.b
        idx = b.mad(b.add(self.token0, self.token(row)), self.spec.num_heads, self.head(row))
        return idx if self.split is None else b.mad(idx, self.num_splits, self.split)

    def lse_addr(self, b: KernelBuilder, row: Reg) -> Reg:
        return b.add(self.lse, b.mul_wide(self.out_index(row), 4))


class VarlenMath(MmaMath):
    """prefill's tensor-core tile math; only the epilogue differs (per-row output addresses)."""

    def __init__(self, b: KernelBuilder, ctx: VarlenCtx, ptrs: dict, strides: dict):
        super().__init__(b, ctx)
        self.ptrs, self.strides = ptrs, strides
        self.v_scale: Reg | None = None    # FP8 V: multiplies 1/l (set by emit_varlen)

    def epilogue(self) -> None:
        b, ctx = self.b, self.ctx
        split = ctx.split is not None
        writer = self.writer()
        l_rows, lanes = self.row_sums()
        invs = finish_rows(b, ctx, self.m, l_rows, self.rows, lanes, writer,
                           lse_scale=1.0 if split else C.LN2)
        if self.v_scale is not None:
            invs = [b.mul(inv, self.v_scale) for inv in invs]
        for r, row in enumerate(self.rows):
            ok = b.setp("lt", row, ctx.seq_q)
            if split:   # o_part [total_q, H, splits, d] f32: this lane's columns 2t, 2t+1
                addr = b.add(self.ptrs["o_part"], b.mul_wide(ctx.out_index(row), ctx.cfg.dv * 4))
                addr = b.add(addr, b.cvt(U64, b.shl(self.t, 3)))
                if self.col0 is not None:   # this warp's slice of the value columns
                    addr = b.add(addr, b.mul_wide(self.col0, 4))
            else:
                tok = b.add(ctx.token0, ctx.token(row))
                base = C.element_offset(b, self.ptrs["o"], tok, self.strides[("o", 0)])
                base = C.element_offset(b, b.bitcast(base, U64), ctx.head(row), self.strides[("o", 1)])
                addr = b.bitcast(b.add(base, b.cvt(S64, b.shl(self.t, 2))), U64)
                if self.col0 is not None:
                    addr = b.add(addr, b.mul_wide(self.col0, ctx.cfg.fmt.bytes))
            for jd, acc in enumerate(self.o):
                lo, hi = (b.mul(acc[2 * r + e], invs[r]) for e in range(2))
                with b.predicate(ok):
                    if split:
                        b.st("global", F32, Addr(addr, jd * 32), [lo, hi])
                    else:
                        b.st("global", B32, Addr(addr, jd * 16), [b.cvt_pack(self.pair, hi, lo)])


def packed_tile_config(spec, c: PrefillConfig) -> dict:
    """The metadata `config` of a GQA-packed tile (varlen, and decode on tensor cores)."""
    return {"block_m": c.block_m, "block_n": c.block_n, "num_warps": c.num_warps,
            "num_stages": c.num_stages, "path": "mma.m16n8k16", "gqa_packing": spec.group_size,
            "smem_row_stride": c.q_geom.stride, "smem_bytes": c.smem_bytes,
            **({"value_split": c.v_split} if c.v_split > 1 else {}),
            **({"fp8_staging_bytes": c.staging_bytes} if isinstance(c, StagedFP8Config) else {}),
            **({"min_ctas_per_sm": c.min_ctas_per_sm} if c.min_ctas_per_sm else {})}


SEARCH_STEPS = 31   # bits of the sequence index the binary search resolves (any u32 batch)


def tile_start(b: KernelBuilder, cu_ptr: Reg, seq: Reg, g: int, bm: int, total_q: Reg) -> Reg:
    """u32 first packed tile of sequence `seq`: cu[seq] * g // block_m + seq (cu clamped to
    [0, total_q]). Non-decreasing in seq, and sequence seq's tiles fit before seq + 1's."""
    t0 = _token(b, cu_ptr, seq, 0, total_q)
    return b.add(b.div(b.mul(t0, g), bm), seq)


def _token(b: KernelBuilder, cu_ptr: Reg, seq: Reg, offset: int, total_q: Reg) -> Reg:
    addr = C.element_offset(b, cu_ptr, seq, b.mov(4, S64))
    return b.min(b.bitcast(b.max(b.ld("global", S32, Addr(addr, offset), nc=True), 0), U32), total_q)


def kv_tiles_of(b: KernelBuilder, kv: KVAccess, ptrs: dict, seq: Reg, bn: int) -> Reg:
    """u32 KV tiles of `bn` keys sequence `seq` holds (seq_lens clamped to the capacity)."""
    n = b.ld("global", S32, Addr(C.element_offset(b, ptrs["seq_lens"], seq, b.mov(4, S64))), nc=True)
    n = b.min(b.bitcast(b.max(n, 0), U32), kv.capacity(b))
    return b.div(b.add(n, bn - 1), bn)


def find_sequence(b: KernelBuilder, cu_ptr: Reg, tile: Reg, batch: Reg, g: int, bm: int,
                  total_q: Reg) -> Reg:
    """The last sequence whose first tile is <= `tile`: a branch-free binary search over the
    bits of the index (a step's load is predicated off once it would pass `batch`)."""
    seq = b.mov(0, U32)
    for k in reversed(range(SEARCH_STEPS)):
        mid = b.add(seq, 1 << k)
        ok = b.setp("lt", mid, batch)
        start = b.mov(0xFFFFFFFF, U32)
        with b.predicate(ok):
            b.mov(tile_start(b, cu_ptr, mid, g, bm, total_q), out=start)
        b.mov(b.selp(mid, seq, b.setp("le", start, tile)), out=seq)
    return seq


@dataclass(frozen=True)
class TileWork:
    """What a CTA works on, from the family's work-assignment policy: packed rows
    [m_start, m_start + block_m) of sequence `seq`'s query block (q_len tokens from `token0`),
    for KV head `kv_head` and, with split-KV, split `split`."""

    seq: Reg            # u32 sequence index (seq_lens, block_table / caches)
    kv_head: Reg        # u32
    split: Reg | None   # u32 split index (None without split-KV)
    token0: Reg         # u32 first query token of the sequence in q / o
    q_len: Reg          # s32 query tokens of the sequence
    m_start: Reg        # u32 first packed row of this CTA's tile
    # Split-KV only (split_plan.emit_balanced_split): the batch the chunk is balanced over,
    # the split rows of the grid, and (work, KV span) in KV tiles of sequence i, per KV head.
    n_seqs: Reg | None = None
    split_rows: Reg | None = None
    seq_units: Callable[[Reg], tuple[Reg, Reg]] | None = None


def emit_varlen(b: KernelBuilder, spec, cfg: PrefillConfig, kv: KVAccess, ptrs: dict,
                strides: dict, batch: Reg, total_q: Reg, split_count: Reg | None, quant=None) -> None:
    """varlen's policy: grid.x counts packed query tiles over the whole batch (a binary search
    of cu_seqlens_q finds the tile's sequence), grid.y = KV head (x split)."""
    g, bm = spec.group_size, cfg.block_m
    tile, cy = b.special("%ctaid.x"), b.special("%ctaid.y")
    Hk = spec.num_kv_heads
    kv_head, split = (b.rem(cy, Hk), b.div(cy, Hk)) if split_count is not None else (cy, None)
    # Which sequence this tile belongs to; its query tokens [t0, t1), clamped so that corrupt
    # prefix sums can never address outside q/o.
    cu = ptrs["cu_seqlens_q"]
    seq = find_sequence(b, cu, tile, batch, g, bm, total_q)
    t0 = _token(b, cu, seq, 0, total_q)
    t1 = b.max(_token(b, cu, seq, 4, total_q), t0)
    m_start = b.mul(b.sub(tile, b.add(b.div(b.mul(t0, g), bm), seq)), bm)

    def seq_units(i):   # (query tiles x KV tiles, KV tiles) of sequence i: upper bounds
        a = _token(b, cu, i, 0, total_q)
        q_tiles = b.div(b.add(b.mul(b.sub(b.max(_token(b, cu, i, 4, total_q), a), a), g), bm - 1), bm)
        kv_tiles = kv_tiles_of(b, kv, ptrs, i, cfg.block_n)
        work = b.mul(q_tiles, kv_tiles)
        return work, b.min(kv_tiles, work)            # a sequence without queries has no span
    work = TileWork(seq, kv_head, split, t0, b.bitcast(b.sub(t1, t0), S32), m_start,
                    batch, b.special("%nctaid.x"), seq_units)
    emit_packed_tile(b, spec, cfg, kv, ptrs, strides, work, split_count, quant)


def emit_packed_tile(b: KernelBuilder, spec, cfg: PrefillConfig, kv: KVAccess, ptrs: dict,
                     strides: dict, work: TileWork, split_count: Reg | None, quant=None) -> None:
    """The body shared by varlen and decode's tensor-core path: one GQA-packed query tile of
    one (sequence, KV head, split) over its keys [0, L), L = seq_lens[seq] clamped.
    With `quant` (kv_fp8.KVDequant) the cache holds FP8 bytes: with a StagedFP8Config they
    travel by cp.async through the pipeline and are dequantised into f16/bf16 tiles after their
    wait (kv_fp8_stage.py); otherwise (head dims not a multiple of 16) a dequantising copy
    (kv_fp8.stage_rows_dequant: FP8 bytes -> registers -> exact f16/bf16 -> st.shared) stages
    them. Either way the tile math is unchanged; k_scale joins the softmax scale
    (MmaMath.scale_log2 becomes a register) and v_scale the final 1/l."""
    g, bm, bn, stages = spec.group_size, cfg.block_m, cfg.block_n, cfg.num_stages
    variant = AttentionVariant.from_spec(spec)
    tid = b.special("%tid.x")
    lane, warp = b.and_(tid, 31), b.shr(tid, 5)
    seq, kv_head, split, t0, q_len, m_start = (work.seq, work.kv_head, work.split, work.token0,
                                               work.q_len, work.m_start)
    # keys [0, L), clamped so that a corrupt length can never address outside the cache
    lens = C.element_offset(b, ptrs["seq_lens"], seq, b.mov(4, S64))
    L = b.min(b.bitcast(b.max(b.ld("global", S32, Addr(lens), nc=True), 0), U32), kv.capacity(b))
    L = b.bitcast(L, S32)
    rows = b.mul(b.bitcast(q_len, U32), g)
    with b.if_then(b.setp("ge", m_start, rows)):
        b.ret()                                        # no query rows for this tile: exit

    smem = b.address_of(b.shared("varlen_smem", 0))
    staging = None
    if isinstance(cfg, StagedFP8Config):   # FP8 bytes through the pipeline (kv_fp8_stage.py)
        staging = FP8Staging(b, cfg, tid, b.add(smem, cfg.q_geom.bytes), quant)
        kv_bytes, k_smem, v_smem = staging.stage_bytes, staging.k_stage, staging.v_stage
    else:
        kv_bytes = cfg.kv_geom.bytes
        k_smem = b.add(smem, cfg.q_geom.bytes)
        v_smem = b.add(k_smem, stages * kv_bytes)
    ctx = VarlenCtx(b, spec, cfg, variant, tid, lane, warp, m_start, rows, q_len, L, smem, kv_head,
                    t0, ptrs.get("lse_part" if split is not None else "lse"), split, split_count,
                    ptrs.get("sinks"), ptrs.get("alibi_slopes"))

    # KV tiles: [0, n_vis) visible to the tile's last token; [0, n_full) to its first as well.
    last_row = b.sub(b.min(b.add(m_start, bm), rows), 1)
    def keys_seen(row: Reg) -> Reg:
        return b.bitcast(b.max(ctx.key_limit(b, row), 0), U32)
    n_vis = b.div(b.add(keys_seen(last_row), bn - 1), bn)
    n_full = b.div(keys_seen(m_start), bn)
    # A sliding window: tiles before the first token's window are never read; tiles before
    # the first one wholly inside the last token's window cross its left edge (masked).
    w_first = lo_full = None
    if variant.window is not None:
        w_first = b.min(variant.first_tile(b, ctx.position(ctx.token(m_start)), bn), n_vis)
        lo_full = variant.first_unmasked_tile(b, ctx.position(ctx.token(last_row)), bn)
    first = b.mov(0, U32) if w_first is None else w_first
    if split is not None:                 # a uniform, length-balanced chunk (split_plan.py)
        # No early exit for idle split indices here (decode has one: split_plan.emit_idle_exit):
        # with it ptxas 13.0 caps the d64 split kernel on sm_120 at 128 registers and spills.
        # An idle split runs the batch pass and an empty KV loop, then writes an empty partial.
        span = n_vis if w_first is None else b.sub(n_vis, w_first)
        first, n_vis = emit_balanced_split(
            b, split=split, num_splits=split_count, lane=lane, n_seqs=work.n_seqs,
            seq_units=work.seq_units, own=span, begin=first, end=n_vis, rows=work.split_rows,
            auto=spec.opt("num_splits") == "auto", keep_split0="sinks" in ptrs, write_empty=None)
    n_tiles = b.sub(n_vis, first)
    n_full = b.sub(b.max(n_full, first), first)
    if lo_full is not None:
        lo_full = b.sub(b.max(lo_full, first), first)

    q_slot = thread_slot(b, cfg.q_geom, tid)
    kv_slot = thread_slot(b, cfg.kv_geom, tid) if staging is None else staging.slots["k_cache"]
    q_col = b.cvt(S64, q_slot.col)

    def q_row(row: Reg, valid: Reg) -> tuple[Reg, Reg]:
        tok = b.add(t0, ctx.token(row))
        base = C.element_offset(b, ptrs["q"], tok, strides[("q", 0)])
        addr = C.element_offset(b, b.bitcast(base, U64), ctx.head(row), strides[("q", 1)])
        return b.bitcast(b.add(addr, q_col), U64), valid

    def chunk_col(slot):   # FP8 caches hold a byte per element (staged: slots of FP8 rows)
        return slot.col if quant is None or staging is not None else b.shr(slot.col, 1)
    bases = kv.bases(b, ptrs, seq, kv_head, b.cvt(S64, chunk_col(kv_slot)))
    slots = {"k_cache": kv_slot, "v_cache": kv_slot}
    if cfg.dv != cfg.head_dim:   # head_dim_v: V rows are narrower, so a thread's chunk differs
        slots["v_cache"] = thread_slot(b, cfg.v_geom, tid) if staging is None else staging.slots["v_cache"]
        bases["v_cache"] = kv.bases(b, ptrs, seq, kv_head, b.cvt(S64, chunk_col(slots["v_cache"])))["v_cache"]

    # Paged caches: a tile's few page ids are loaded with the previous tile (kv_pages.py)
    pages = None
    if (quant is None or staging is not None) and cfg.dv == cfg.head_dim and \
            prefetch_applies(kv, kv_slot, bn):
        pages = PagedTiles(b, kv, bases, kv_slot, bn, L)

    # A sliding window: keys before the first token's window are needed by no row of the
    # tile, so they are zero-filled rather than read (the first tile may start before it).
    key_lo = None if variant.window is None else b.max(ctx.key_begin(b, m_start), 0)

    def load_kv(t: str, j: Reg, stage_off: Reg | int) -> None:
        with b.if_then(b.setp("lt", j, n_tiles)):
            row0 = b.mul(b.add(first, j), bn)
            dst = b.add(k_smem if t == "k" else v_smem, stage_off)
            cache = "k_cache" if t == "k" else "v_cache"

            def rows_of(row, ok):
                if key_lo is not None:
                    ok = b.and_(ok, b.setp("ge", b.bitcast(row, S32), key_lo))
                return _kv_row(b, kv, bases, cache, row, ok)
            if pages is not None:
                pages.issue(cache, row0, b.sub(L, b.bitcast(row0, S32)), dst, key_lo)
            elif quant is None or staging is not None:
                load_tile_rows(b, slots[cache], rows_of, row0, b.sub(L, b.bitcast(row0, S32)), dst, True)
            else:
                stage_rows_dequant(b, slots[cache], rows_of, row0, b.sub(L, b.bitcast(row0, S32)), dst,
                                   quant, "f16x2" if cfg.fmt.name == "f16" else "bf16x2")
        b.cp_async_commit()

    load_tile_rows(b, q_slot, q_row, m_start, b.sub(b.bitcast(rows, S32), b.bitcast(m_start, S32)),
                   smem, True)
    if pages is not None:
        pages.load_ahead(b.mul(first, bn))
    math = VarlenMath(b, ctx, ptrs, strides)
    if quant is not None:
        k_scale, math.v_scale = quant.scales(b, kv_head)
        math.scale_log2 = b.mul(k_scale, math.scale_log2)
    unit = 1.0 / spec.softmax_scale                    # MmaMath's scores are raw q·k
    run_kv_pipeline(b, stages=stages, kv_bytes=kv_bytes, k_smem=k_smem, v_smem=v_smem,
                    use_async=True, n_tiles=n_tiles, n_full=n_full,
                    key0_of=lambda j: b.mul(b.add(first, j), bn), load_kv=load_kv, math=math,
                    transform=math.transform if variant.transforms else
                    lambda s, key0: variant.transform_scores(b, s, key0, unit), lo_full=lo_full,
                    landed=None if staging is None else staging.landed)
    math.epilogue()


def _kv_row(b: KernelBuilder, kv: KVAccess, bases: dict, cache: str, row: Reg, ok: Reg):
    addr, valid = kv.row_address(b, bases, cache, row, ok, {})
    return b.bitcast(addr, U64) if addr.type != U64 else addr, valid
