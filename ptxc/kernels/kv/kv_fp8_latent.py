"""FP8 latent rows (MLA's shared K/V cache) staged for the sm_90a wgmma latent tile: the raw
bytes land in a staging ring and are converted into the swizzled f16/bf16 tiles the wgmma
descriptors read (LatentFP8Staging). kv_fp8_stage.py holds the per-head K/V staging of the
varlen and prefill tiles; group-scaled (e4m3_ds) rows convert by kv_fp8_group.py's mapping."""

from __future__ import annotations

from contextlib import nullcontext

from ...ir import B32, U32, Addr, KernelBuilder, Reg
from ..mainloop.tiles import CHUNK, NARROW_SWIZZLE, thread_slot, zero_regs
from ..math import fp8
from . import kv_fp8
from .kv_fp8_group import GroupScaledConversion, SwizzledTile
from .kv_fp8_stage import StagingGeom


class LatentFP8Staging:
    """FP8 latent rows (e4m3 / e5m2 with a per-tensor scale) for the sm_90a wgmma latent tile
    (wgmma_pipeline.run_latent_wgmma_pipeline): each tile's bytes land unpadded by cp.async in
    `stages` staging buffers (tiles.thread_slot over StagingGeom: 576-byte rows are 36 chunks,
    so 256 threads take 7 rows a pass, the last pass guarded), and after the wait every thread
    converts the chunks it copied into the 128-byte-swizzled f16/bf16 tile the wgmma
    descriptors read: chunk c (16 FP8 bytes) of row r becomes 16-byte chunks 2(c % 4) and
    2(c % 4) + 1 of slab c / 4, XORed with r % 8. Two converted tiles alternate (`landed`
    toggles `cur`): iteration j's S reads tile j while its P·V reads tile j - 1.

    Group-scaled rows (`rows`, e4m3_ds: 656 bytes, 41 chunks, 6 rows a pass) land whole and
    are converted after the barrier by a mapping of their own (kv_fp8_group.py: the latent
    slabs scaled, the RoPE chunks copied to the slabs after them).

    Shared memory from `tiles_base`: converted tile x `converted` | staging x stages."""

    def __init__(self, b: KernelBuilder, geom: StagingGeom, tile_bytes: int, block_n: int,
                 stages: int, tid: Reg, tiles_base: Reg, quant: kv_fp8.KVDequant, pair: str,
                 fmt=None, rows: kv_fp8.GroupScaledRows | None = None, box_bytes: int | None = None,
                 converted: int = 2, keep_offsets: bool = True, narrow_dv: int | None = None):
        """`box_bytes`: the staged tiles are TMA boxes of that many columns (a stage holds
        row_bytes / box_bytes column blocks of block_n rows each, in box order) instead of
        whole rows copied by the threads. `converted`: the converted tiles before the staging
        (a dequantising warpgroup's ring of three writes them through `convert`);
        `keep_offsets`: GroupScaledConversion's. `narrow_dv` (qk_products = "e4m3"): a converted
        tile is the rows' e4m3 bytes for S -- 64-byte slabs of block_n x 64 B, chunk c of row r
        at slab c / 4, chunk (c % 4) ^ ((r / 2) % 4) (the 64-byte swizzle) -- then V's first
        narrow_dv columns converted as above, after them."""
        from ..mainloop.tiles import SWIZZLE
        self.b, self.geom, self.quant, self.pair, self.fmt, self.rows = b, geom, quant, pair, fmt, rows
        self.tiles, self.tile_bytes = tiles_base, tile_bytes
        self.stage_bytes = geom.bytes
        self.k_stage = b.add(tiles_base, converted * tile_bytes)
        self.v_stage = self.k_stage                # V is the latent tile's first columns
        self.slot = thread_slot(b, geom, tid)
        self.cur = b.mov(0, U32)                   # the converted tile `landed` writes next
        # per pass: this thread's first 16-byte destination chunk in a converted tile (the
        # second is it XOR 16: 2(c % 4) is even)
        c = b.shr(self.slot.col, 4)
        slab = b.mul(b.shr(c, 2), block_n * SWIZZLE)
        in_slab = b.shl(b.and_(c, 3), 1)
        self.group = None
        if rows is not None:    # converted by a mapping of their own (kv_fp8_group.py)
            self.group = GroupScaledConversion(b, rows, block_n, geom.threads, tid,
                                               SwizzledTile(block_n), quant, fmt, keep_offsets)
        self.dst, self.narrow = [], None
        for i in range(geom.passes if rows is None else 0):
            row = b.add(self.slot.r0, i * geom.rows_per_pass)
            chunk = b.xor(in_slab, b.and_(row, 7))
            self.dst.append(b.add(b.add(slab, b.shl(row, 7)), b.shl(chunk, 4)))
        self.is_v = None
        if narrow_dv is not None:   # the e4m3 chunk's place (per pass at the store: registers
            # are what the dequantising warpgroup has least of); V's chunks after the e4m3 bytes
            assert rows is None and box_bytes is None, "narrow products: threads' e4m3 rows"
            self.narrow = (b.mul(b.shr(c, 2), block_n * NARROW_SWIZZLE), b.and_(c, 3))
            self.dst = [b.add(d, block_n * geom.row_bytes) for d in self.dst]
            self.is_v = b.setp("lt", c, narrow_dv // CHUNK)
        # where this thread's chunk sits in a staged tile, and one pass further
        self.src_off, self.pass_stride = self.slot.soff, geom.rows_per_pass * geom.stride
        if box_bytes is not None:   # column block c // per of rows x box_bytes, in box order
            assert rows is None, "group-scaled rows are copied whole by the threads"
            per = box_bytes // CHUNK
            self.src_off = b.add(b.mad(b.div(c, per), block_n * box_bytes, b.mul(self.slot.r0, box_bytes)),
                                 b.shl(b.rem(c, per), 4))
            self.pass_stride = geom.rows_per_pass * box_bytes

    def landed(self, t: str, stage: Reg | int) -> Reg:
        """After this thread's wait for the tile staged at offset `stage`: its chunks
        dequantised into the next converted tile; returns that tile's address."""
        tile = self.b.add(self.tiles, self.cur)
        self.convert(stage, tile)
        self.b.xor(self.cur, self.tile_bytes, out=self.cur)
        return tile

    def convert(self, stage: Reg | int, tile: Reg, between=None) -> None:
        """This thread's share of the tile staged at offset `stage`, converted into `tile`
        (for group-scaled rows: after a barrier that made every thread's copies visible),
        pass by pass; with `between`, every pass's shared loads first, then `between()`, then
        the conversions (a dequantising warpgroup refills the staging buffer in between)."""
        b, geom = self.b, self.geom
        if self.group is not None:
            self.group.convert(b.add(self.k_stage, stage), tile, between)
            return
        src = b.add(b.add(self.k_stage, stage), self.src_off)
        loaded = []
        for i in range(geom.passes):
            guard = self.slot.guard(b, i)
            at = i * self.pass_stride
            if guard is None:
                words = b.ld("shared", B32, Addr(src, at), vec=4)
            else:              # a pass without a row for this thread converts zeros
                words = zero_regs(b, 4)
                with b.predicate(guard):
                    b.ld("shared", B32, Addr(src, at), vec=4, out=words)
            loaded.append((i, guard, words))
            if between is None:
                self._store(tile, *loaded.pop())
        if between is not None:
            between()
            for got in loaded:
                self._store(tile, *got)

    def _store(self, tile: Reg, i: int, guard: Reg | None, words: list[Reg]) -> None:
        """Pass i's 16 FP8 bytes as two 16-byte chunks of the converted tile (narrow: the bytes
        themselves first, and the two chunks only for V's columns)."""
        b = self.b
        if self.narrow is not None:
            slab, chunk = self.narrow
            row = b.add(self.slot.r0, i * self.geom.rows_per_pass)
            at = b.mad(row, NARROW_SWIZZLE, b.add(slab, b.shl(b.xor(chunk, b.and_(b.shr(row, 1), 3)), 4)))
            with b.predicate(guard) if guard is not None else nullcontext():
                b.st("shared", B32, Addr(b.add(tile, at)), words)
            guard = self.is_v if guard is None else b.and_(guard, self.is_v)
        first = b.add(tile, self.dst[i])
        vals = fp8.dequantize(b, words, self.quant.kind, self.quant.target, to=self.pair)
        with b.predicate(guard) if guard is not None else nullcontext():
            b.st("shared", B32, Addr(first), vals[:4])
            b.st("shared", B32, Addr(b.xor(first, 16)), vals[4:])


__all__ = ["LatentFP8Staging"]
