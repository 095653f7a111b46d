"""What every prefill body shares below itself (mma.sync, SIMT, wgmma, TMA): the per-CTA
context the tile math and the variant read (`Ctx`, the mask predicate over logical (query, key)),
a CTA's place in the grid (`cta_coords`, longest-first for causal), and the K/V tiles its query
rows visit (`tile_range`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from ...ir import S32, U32, U64, KernelBuilder, Reg
from ...spec.model import KernelSpec
from .. import common as C
from ..config.prefill import PrefillConfig
from .variant import AttentionVariant, MaskPredicate, load_head_f32


@dataclass
class Ctx(MaskPredicate):
    """Per-CTA values the tile math needs (all u32 unless noted)."""

    spec: KernelSpec
    cfg: PrefillConfig
    tid: Reg
    lane: Reg
    warp: Reg
    batch: Reg
    head: Reg
    m_start: Reg
    seq_q: Reg
    seq_k: Reg
    key_offset: Reg       # s32: seq_k - seq_q (bottom-right causal alignment)
    q_smem: Reg
    o_base: Reg           # u64: o[batch, 0, head, 0]
    o_row_stride: Reg     # s64 bytes
    lse: Reg | None       # u64 or None
    variant: AttentionVariant
    sinks: Reg | None = None    # u64 sinks [num_heads] f32 (attention_sinks)
    slopes: Reg | None = None   # u64 alibi_slopes [num_heads] f32 (alibi)
    mask_bits: Reg | None = None   # u64 first byte of the batch entry's mask bits (custom_mask)
    o_tmap: Reg | None = None   # u64 generic address of o's tensor map (tile.tma_store)
    # where the epilogue stages O (tile.persistent: a region of its own, so the next tile's Q
    # can land during this tile's epilogue); None: over Q, which the loop no longer reads
    o_stage: Reg | None = None
    # tile.persistent with TMA stores into O's own region: thread 0 does not wait for the boxes
    # to be read after issuing them; the pipeline does, before the next tile stages O
    store_wait_deferred: bool = False

    @property
    def o_smem(self) -> Reg:
        """The shared-memory region the epilogue stages O in."""
        return self.q_smem if self.o_stage is None else self.o_stage

    # variant.MaskPredicate over a batch entry's seq_q x seq_k bits: row = query, column = key
    def mask_rows(self, b: KernelBuilder) -> Reg:
        return self.seq_q

    def mask_width(self, b: KernelBuilder) -> Reg:
        return self.seq_k

    def mask_token(self, row: Reg) -> Reg:
        return row

    def mask_shift(self, b: KernelBuilder) -> None:
        return None

    def key_limit(self, b: KernelBuilder, row: Reg) -> Reg:
        """s32 number of keys query `row` sees (before clamping to >= 0)."""
        sk = b.bitcast(self.seq_k, S32)
        if not self.variant.causal:
            return sk
        return self.variant.key_end(b, b.add(b.bitcast(row, S32), self.key_offset), sk)

    def key_begin(self, b: KernelBuilder, row: Reg) -> Reg | None:
        """s32 first key query `row` sees (sliding window), or None."""
        if not self.variant.bounded:
            return None
        return self.variant.key_begin(b, b.add(b.bitcast(row, S32), self.key_offset))

    def sink_log2(self, b: KernelBuilder, row: Reg) -> Reg | None:
        """The row's sink logit in log2 units (attention_sinks), or None."""
        if self.sinks is None:
            return None
        return b.mul(load_head_f32(b, self.sinks, self.head), C.LOG2E)

    def alibi_row(self, b: KernelBuilder, row: Reg, lane_key: Reg, unit: float) -> tuple[Reg, Reg]:
        """(p - lane_key (s32), -unit · slope) of query `row` for variant.transform_scores."""
        pos = b.add(b.bitcast(row, S32), self.key_offset)
        return b.sub(pos, lane_key), b.mul(load_head_f32(b, self.slopes, self.head), -unit)

    def lse_addr(self, b: KernelBuilder, row: Reg) -> Reg:
        bh = b.mad(self.batch, self.spec.num_heads, self.head)
        idx = b.add(b.mul_wide(bh, self.seq_q), b.cvt(U64, row))
        return b.add(self.lse, b.shl(idx, 2))


def cta_coords(b: KernelBuilder, spec: KernelSpec, bm: int, ptrs: dict, strides: dict,
               place: tuple[Reg, Reg, Reg] | None = None):
    """A prefill CTA's place (grid: query block, head, batch): (tid, lane, warp, head, batch,
    kv_head, m_start, head_base), head_base(t, h) being tensor t's u64 address of (batch, h).
    Causal: CTA x takes query block nctaid.x - 1 - x, so each (head, batch) starts with its
    longest block (the most visible keys) and the short ones fill the tail of the launch --
    FlashAttention-3's and FlashInfer's longest-first order; the hardware dispatches x first.
    `place`: a persistent CTA's current work tile (query block, head, batch), from
    `PersistentTiles.place` in that same order."""
    tid = b.special("%tid.x")
    lane, warp = b.and_(tid, 31), b.shr(tid, 5)
    if place is not None:
        m_blk, head, batch = place
    else:
        m_blk, head, batch = b.special("%ctaid.x"), b.special("%ctaid.y"), b.special("%ctaid.z")
    if spec.opt("causal") and place is None:
        m_blk = b.sub(b.sub(b.special("%nctaid.x"), 1), m_blk)
    kv_head = b.div(head, spec.group_size) if spec.group_size > 1 else head
    m_start = b.mul(m_blk, bm)

    def head_base(t: str, h: Reg) -> Reg:
        base = b.bitcast(C.element_offset(b, ptrs[t], batch, strides[(t, 0)]), U64)
        return b.bitcast(C.element_offset(b, base, h, strides[(t, 2)]), U64)
    return tid, lane, warp, head, batch, kv_head, m_start, head_base


# tile.persistent's grid: the persistent_ctas dim, a CTA per resident slot (an "auto" rule over
# pipeline.dim_rules' names, which the loaders evaluate with the device's SM count)
PERSISTENT_DIM = "persistent_ctas"
PERSISTENT_RULE = "min(ctas, num_sms * ctas_per_sm)"
PERSISTENT_MAX = 65535          # a dim rule's cap (the metadata schema's): far above SMs x CTAs


class PersistentTiles:
    """tile.persistent's scheduler: the grid's P CTAs (the persistent_ctas dim: the SMs x the
    CTAs each holds) take the non-persistent grid's tiles in its launch order -- query block
    fastest (longest first when causal), then head, then batch -- in rounds of P, so the tiles
    in flight at once are those the hardware would have run together (the same K/V in L2):
    round k gives tile kP + c to CTA c when k is even and kP + P - 1 - c when it is odd (a
    snake, so the CTA that took a round's longest tile takes the next round's shortest: in
    `ptxc report`'s model of causal grids it balances as well as the hardware's own dispatch,
    where striding by P was 2-23 % slower; bench/persistent_order.py)."""

    def __init__(self, b: KernelBuilder, spec: KernelSpec, bm: int, seq_q: Reg, batch: Reg):
        self.b, self.spec = b, spec
        self.blocks = b.div(b.add(seq_q, bm - 1), bm)
        self.total = b.mul(b.mul(self.blocks, spec.num_heads), batch)

    @contextmanager
    def loop(self) -> Iterator[Reg]:
        """for each of this CTA's work tiles t (the body runs under `t < total`)."""
        b = self.b
        c, P = b.special("%ctaid.x"), b.special("%nctaid.x")
        mirror = b.sub(b.sub(P, 1), c)
        with b.for_range(0, b.div(b.add(self.total, b.sub(P, 1)), P)) as k:
            odd = b.setp("ne", b.and_(k, 1), 0)
            t = b.mad(k, P, b.selp(mirror, c, odd, U32))
            with b.if_then(b.setp("lt", t, self.total)):
                yield t

    def place(self, t: Reg) -> tuple[Reg, Reg, Reg]:
        """Work tile t's (query block, head, batch)."""
        b = self.b
        hb = b.div(t, self.blocks)
        m_blk = b.sub(t, b.mul(hb, self.blocks))
        if self.spec.opt("causal"):
            m_blk = b.sub(b.sub(self.blocks, 1), m_blk)
        batch = b.div(hb, self.spec.num_heads)
        return m_blk, b.sub(hb, b.mul(batch, self.spec.num_heads)), batch


def tile_range(b: KernelBuilder, spec: KernelSpec, bm: int, bn: int, m_start: Reg, seq_q: Reg,
               seq_k: Reg):
    """The K/V tiles of query rows [m_start, m_start + bm) (the mma.sync and wgmma bodies alike):
    (key_offset = seq_k - seq_q, n_tiles visited, n_full needing no mask, and with a sliding
    window first_tile, where the loop starts: earlier tiles are never read, and lo_full: loop
    tiles before it cross the window's left edge and get the mask; then the variant)."""
    sq, sk = b.bitcast(seq_q, S32), b.bitcast(seq_k, S32)
    key_offset = b.sub(sk, sq)
    last_row = None
    if spec.opt("causal"):
        last_row = b.sub(b.min(b.add(m_start, bm), seq_q), 1)
        visible = b.add(b.add(b.bitcast(last_row, S32), key_offset), 1)
        full = b.add(b.add(b.bitcast(m_start, S32), key_offset), 1)
        visible, full = (b.bitcast(b.min(b.max(x, 0), sk), U32) for x in (visible, full))
    else:
        visible = full = seq_k
    n_tiles, n_full = b.div(b.add(visible, bn - 1), bn), b.div(full, bn)
    variant = AttentionVariant.from_spec(spec)
    first_tile = lo_full = None
    if variant.bounded:
        if last_row is None:
            last_row = b.sub(b.min(b.add(m_start, bm), seq_q), 1)
        first_tile = variant.first_tile(b, b.add(b.bitcast(m_start, S32), key_offset), bn)
        lo_full = variant.first_unmasked_tile(b, b.add(b.bitcast(last_row, S32), key_offset), bn)
        n_tiles = b.sub(b.max(n_tiles, first_tile), first_tile)
        n_full = b.sub(b.max(n_full, first_tile), first_tile)
        lo_full = b.sub(b.max(lo_full, first_tile), first_tile)
    return key_offset, n_tiles, n_full, first_tile, lo_full, variant
