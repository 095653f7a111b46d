"""e4m3 latent rows staged straight into the e4m3 score operand (MLA's qk_products = "e4m3"
under the dequantising warpgroup, mainloop/dequant_pipeline.py's `direct` ring): the
dequantising warpgroup's cp.async lands each tile's raw bytes in the 64-byte-swizzled K-major
layout S's FP8 wgmma reads (64-byte slabs of block_n rows: chunk c of row r at slab c / 4,
16-byte chunk (c % 4) ^ ((r / 2) % 4) -- mainloop/tiles.NARROW_SWIZZLE), so no thread copies
the bytes again, and converts only V's columns into the 16-bit V ring. A staging buffer is then
S's operand for as long as the computing warps need it, so the buffers form a ring of their own
(DIRECT_STAGES) that the computing warps release after S retired -- which leaves the tiles
after the one being converted landing: two 18 KiB tiles in flight per SM where the copied-bytes
tile had one.

Thread slot: 128 threads, thread tid takes row tid / 4 of the 32-row tile and chunks
4k + tid % 4 of it (slab k = 0 .. head_dim / 64 - 1): one global row address per tile and
thread, each slab's copy an immediate further in both memories, and the swizzle the same for
every slab (it depends on the row only). V's chunks are the first dv / 64 slabs; the thread
converts the chunks it copied itself (its own cp.async writes are visible to it after its
wait_group), into 16-byte chunks 2(c % 4) + h ^ (r % 8) of V slab k (the 128-byte-swizzled
tile WgmmaMath.issue_pv reads)."""

from __future__ import annotations

from ...ir import B32, S32, S64, U32, Addr, KernelBuilder, Reg
from ..mainloop.tiles import CHUNK, NARROW_SWIZZLE, SWIZZLE
from ..math import fp8

DIRECT_STAGES = 4     # tiles i - 1 (S may still read it), i (converting), i + 1, i + 2 landing
ROW_THREADS = 4       # threads a row: 64-byte slab rows of 16-byte chunks


def direct_applies(block_n: int, threads: int) -> bool:
    """The slot needs one row per 4 threads: 32 rows for the dequantising warpgroup's 128."""
    return block_n * ROW_THREADS == threads


class DirectLatentStaging:
    """The dequantising warpgroup's copies into, and conversions out of, the direct ring
    (module docstring): `ring` is the staging ring's base (a buffer: block_n x head_dim bytes),
    offsets into it are the callers'."""

    def __init__(self, b: KernelBuilder, tid: Reg, ring: Reg, block_n: int, head_dim: int, dv: int,
                 quant, pair: str):
        assert head_dim % 64 == 0 and dv % 64 == 0, (head_dim, dv)
        self.b, self.quant, self.pair = b, quant, pair
        self.block_n, self.slabs, self.v_slabs = block_n, head_dim // 64, dv // 64
        self.stage_bytes = block_n * head_dim
        self.row = b.shr(tid, 2)
        t = b.and_(tid, ROW_THREADS - 1)
        self.col = b.shl(t, 4)                                   # byte column in a slab
        swz = b.and_(b.shr(self.row, 1), 3)
        self.soff = b.mad(self.row, NARROW_SWIZZLE, b.shl(b.xor(t, swz), 4))
        r8 = b.and_(self.row, 7)
        self.voff = [b.mad(self.row, SWIZZLE, b.shl(b.xor(b.add(b.shl(t, 1), h), r8), 4)) for h in range(2)]
        self.src = b.add(ring, self.soff)                        # this thread's chunk of slab 0

    def copies(self, kv, tile, ptrs: dict, work):
        """load_kv(j, stage_offset): tile j's rows (if it exists) by cp.async into the staging
        buffer at stage_offset, rows at or past L zero-filled; one commit group either way."""
        b = self.b
        bases = kv.bases(b, ptrs, work.seq, work.kv_head, b.cvt(S64, self.col))
        rows_of = tile.kv_rows(kv, bases, "k_cache", None)
        dst0 = self.src

        def load_kv(j: Reg, stage_off) -> None:
            with b.if_then(b.setp("lt", j, tile.n_tiles)):
                row = b.add(b.mul(b.add(tile.first, j), self.block_n), self.row)
                ok = b.setp("lt", b.bitcast(row, S32), tile.L)
                addr, ok = rows_of(row, ok)
                size = b.selp(CHUNK, 0, ok, type=U32)
                dst = b.add(dst0, stage_off)
                for k in range(self.slabs):
                    b.cp_async(Addr(dst, k * self.block_n * NARROW_SWIZZLE), Addr(addr, k * 64), CHUNK, size)
            b.cp_async_commit()
        return load_kv

    def convert(self, stage: Reg, v_tile: Reg, between=None) -> None:
        """This thread's V chunks of the tile staged at offset `stage` into the V tile at
        `v_tile`: the shared loads, then `between()` (the refill of an older buffer), then the
        conversions."""
        b = self.b
        src = b.add(self.src, stage)
        words = [b.ld("shared", B32, Addr(src, k * self.block_n * NARROW_SWIZZLE), vec=4)
                 for k in range(self.v_slabs)]
        if between is not None:
            between()
        dst = [b.add(v_tile, off) for off in self.voff]
        for k, w in enumerate(words):
            vals = fp8.dequantize(b, w, self.quant.kind, self.quant.target, to=self.pair)
            for h in range(2):
                b.st("shared", B32, Addr(dst[h], k * self.block_n * SWIZZLE), vals[4 * h:4 * h + 4])


__all__ = ["DIRECT_STAGES", "DirectLatentStaging", "direct_applies"]
