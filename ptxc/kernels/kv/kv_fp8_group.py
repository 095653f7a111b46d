"""The conversion of a staged tile of group-scaled latent rows (e4m3_ds, kv_fp8.GroupScaledRows)
into the f16/bf16 tile the tensor cores read, by a thread mapping of its own.

The copy lands 656-byte rows whole (41 16-byte chunks: 32 e4m3 latent chunks, one of four f32
scales, 8 of bf16 RoPE), each thread its chunks (tiles.thread_slot), and a latent chunk needs
its row's scale, which another thread copied: so the conversion already runs after a barrier
that follows the wait (kv_pipeline.run_shared_kv_pipeline, wgmma_pipeline._run_staged_latent),
where every landed byte is visible to every thread. Converting the chunks each thread copied
spends a whole e4m3 conversion on every chunk (the scale and RoPE chunks' results discarded) in
passes of 6 rows, the last partly idle: 6 passes of 32 rows x 41 chunks over 256 threads.
Here the work is split by kind instead:

  latent   octets of 8 threads take one slab (4 chunks, 64 bf16 columns) of a row pair: lane
           e of the octet row 2p + (e >> 2), chunk 4j + (e & 3). Each is ld.shared.v4, its
           group's scale (ld.shared.f32), 16 products in f32 rounded once, two 16-byte stores:
           32 rows x 512 columns over 256 threads is 4 passes, none idle. The octet's 8
           first-half stores fall in 8 different bank groups in the swizzled tile (the two
           rows' XOR patterns differ in bit 0), as staging_slot arranges for e4m3 tiles.
  RoPE     bf16 already: one 16-byte chunk copied per item, row-major (32 rows x 8 chunks:
           one pass of 256 threads).
  scales   nothing to write.

Every pass's octets start the same slab as the first's (rank 512: 8 slabs a row, 16 or more
octets a CTA), so row, column and destination are computed once and passes add immediates.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

from ...ir import B32, F32, U32, Addr, KernelBuilder, Reg
from .. import common as C
from ..mainloop.tiles import CHUNK, SWIZZLE, SWIZZLE_ROWS, zero_regs
from ..math import fp8
from .kv_fp8 import GroupScaledRows, KVDequant

OCTET = 8          # threads per latent slab of a row pair
QUAD = 4           # e4m3 chunks a slab of the converted row holds (64 columns of 2 bytes)


@dataclass(frozen=True)
class PaddedTile:
    """The mma.sync tile: row r's byte column c at r * stride + c."""

    stride: int

    def at(self, b: KernelBuilder, row: Reg, col: Reg | int) -> Reg:
        return b.mad(row, self.stride, col)

    def second(self, b: KernelBuilder, first: Reg) -> Reg:
        return b.add(first, CHUNK)

    def down(self, b: KernelBuilder, at: Reg, rows: int) -> Reg:
        """`at` (a chunk's offset) `rows` rows further down."""
        return b.add(at, rows * self.stride) if rows else at

    def steps(self, rows: int) -> bool:
        return True


@dataclass(frozen=True)
class SwizzledTile:
    """The wgmma tile (mainloop/tiles.py's 128-byte swizzled slabs of block_n rows): byte column
    c of row r in slab c // 128, 16-byte chunk (c % 128) / 16 XOR r % 8."""

    rows: int

    def at(self, b: KernelBuilder, row: Reg, col: Reg | int) -> Reg:
        col = b.mov(col, U32) if isinstance(col, int) else col
        slab = b.mul(b.shr(col, 7), self.rows * SWIZZLE)
        chunk = b.xor(b.and_(b.shr(col, 4), 7), b.and_(row, SWIZZLE_ROWS - 1))
        return b.add(b.add(slab, b.shl(row, 7)), b.shl(chunk, 4))

    def second(self, b: KernelBuilder, first: Reg) -> Reg:
        return b.xor(first, CHUNK)     # chunk 2k + 1 of an even 2k: bit 0 of the chunk index

    def down(self, b: KernelBuilder, at: Reg, rows: int) -> Reg:
        """`at` `rows` rows further down: + rows x 128 bytes, and the row's XOR pattern moves by
        rows % 8 -- for a multiple of 4, bit 2 of the chunk index flips (r + 4 = r ^ 4 mod 8)."""
        moved = b.add(at, rows * SWIZZLE) if rows else at
        return b.xor(moved, CHUNK * SWIZZLE_ROWS // 2) if rows % SWIZZLE_ROWS else moved

    def steps(self, rows: int) -> bool:
        return rows % (SWIZZLE_ROWS // 2) == 0


class GroupScaledConversion:
    """One CTA's conversion of a staged tile of `block_n` group-scaled rows (row-major, `rows`
    .row_bytes apart) into `tile` (PaddedTile or SwizzledTile) by `threads` threads (see the
    module docstring). `convert(staged, dst)` emits it for the tile staged at `staged` into the
    converted tile at `dst`. `keep_offsets`: this thread's offsets are computed once, here, and
    stay live across the loop (the wgmma tile where every warp converts, and mma.sync tiles of
    up to 8 warps: 16-21 fewer instructions a tile); else where each tile is converted (the
    16-warp mma.sync tile's 128 registers and the dequantising warpgroup's 104 have no room to
    keep them)."""

    def __init__(self, b: KernelBuilder, rows: GroupScaledRows, block_n: int, threads: int,
                 tid: Reg, tile, quant: KVDequant, fmt, keep_offsets: bool = False):
        assert rows.rank % (QUAD * CHUNK) == 0 and rows.group % CHUNK == 0 and block_n % 2 == 0
        self.b, self.rows, self.bn, self.threads, self.tile = b, rows, block_n, threads, tile
        self.quant, self.fmt = quant, fmt
        self.slabs = rows.rank // (QUAD * CHUNK)          # latent slabs of a converted row
        octets = threads // OCTET
        self.latent_items = block_n // 2 * self.slabs     # (row pair, slab) octet items
        self.latent_passes = -(-self.latent_items // octets)
        # the slab of every pass is the first's (threads / 8 octets a multiple of the row's
        # slabs: e4m3_ds rows have rank 512, 8 slabs, and a CTA 128 or more threads), so row,
        # column and addresses are computed once and the passes add immediates
        assert octets % self.slabs == 0, (octets, self.slabs)
        self.row_step = 2 * octets // self.slabs
        assert tile.steps(self.row_step), "a pass moves the swizzle pattern by other than 4 rows"
        self.rope_chunks = 2 * rows.rope // CHUNK
        self.rope_items = block_n * self.rope_chunks
        self.rope_passes = -(-self.rope_items // threads)
        self.tid = tid
        self.kept = None
        if keep_offsets:
            e = b.and_(tid, OCTET - 1)
            octet, sub_row, quad = b.shr(tid, 3), b.shr(e, 2), b.and_(e, QUAD - 1)
            rope = b.div(tid, self.rope_chunks), b.mul(b.rem(tid, self.rope_chunks), CHUNK)
            self.kept = self._latent_at((octet, sub_row, quad)), rope

    def _latent_at(self, lane=None) -> tuple[Reg, Reg, Reg]:
        """(staged byte offset, staged offset of its scale, converted offset) of this thread's
        latent chunk in the first pass, from tid or from `lane` (octet, row in the pair, chunk
        in the slab)."""
        b, rows = self.b, self.rows
        octet, e = (b.shr(self.tid, 3), b.and_(self.tid, OCTET - 1)) if lane is None else (lane[0], None)
        pair, slab = b.div(octet, self.slabs), b.rem(octet, self.slabs)
        row = b.add(b.shl(pair, 1), b.shr(e, 2) if lane is None else lane[1])
        c = b.add(b.shl(slab, 2), b.and_(e, QUAD - 1) if lane is None else lane[2])   # the row's e4m3 chunk
        src = b.mad(row, rows.row_bytes, b.shl(c, 4))
        group = b.shr(c, (rows.group // CHUNK).bit_length() - 1)
        scale = b.mad(row, rows.row_bytes, b.add(b.shl(group, 2), rows.scales_at))
        return src, scale, self.tile.at(b, row, b.shl(c, 5))

    def convert(self, staged: Reg, dst: Reg, between=None) -> None:
        """Every latent and RoPE chunk of the tile staged at `staged` into the tile at `dst`,
        pass by pass (all loads first measured the same instructions and 40 more registers:
        255 on the wgmma tile) -- or, with `between`, every pass's loads first, then
        `between()` (the staging buffer is free once every thread got there), then the
        conversions and stores."""
        passes = list(self._loads(staged, dst))
        if between is None:
            for load, store in passes:
                store(*load())
            return
        loaded = [load() for load, _ in passes]
        between()
        for (_, store), got in zip(passes, loaded):
            store(*got)

    def _loads(self, staged: Reg, dst: Reg):
        """(load, store) per pass: load() issues the pass's shared loads and returns what
        store(...) converts and writes (the latent passes, then the RoPE ones)."""
        b, octets = self.b, self.threads // OCTET
        src0, scale0, out0 = self.kept[0] if self.kept else self._latent_at()
        for i in range(self.latent_passes):
            def load(i=i):
                shift = i * self.row_step * self.rows.row_bytes        # staged bytes, pass i
                src, scale_at = Addr(b.add(staged, src0), shift), Addr(b.add(staged, scale0), shift)
                out = self.tile.down(b, out0, i * self.row_step)
                guard = None
                if (i + 1) * octets > self.latent_items:
                    guard = b.setp("lt", b.add(b.shr(self.tid, 3), i * octets), self.latent_items)
                if guard is None:
                    return guard, b.ld("shared", B32, src, vec=4), b.ld("shared", F32, scale_at), out
                words, scale = zero_regs(b, 4), b.mov(0.0, F32)   # an octet item past the tile's:
                with b.predicate(guard):                           # zeros, nothing stored
                    b.ld("shared", B32, src, vec=4, out=words)
                    b.ld("shared", F32, scale_at, out=[scale])
                return guard, words, scale, out

            def store(guard, words, scale, out):
                self._scaled(guard, words, scale, b.add(dst, out))
            yield load, store
        yield from self._rope(staged, dst)

    def _scaled(self, guard: Reg | None, words: list[Reg], scale: Reg, out: Reg) -> None:
        """16 e4m3 values x their group's scale in f32, rounded once, as two 16-byte chunks."""
        b = self.b
        vals = [b.mul(v, scale) for v in fp8.dequantize(b, words, self.quant.kind, self.quant.target)]
        packed = C.from_f32(b, self.fmt, vals, self.quant.target)
        with b.predicate(guard) if guard is not None else nullcontext():
            b.st("shared", B32, Addr(out), packed[:4])
            b.st("shared", B32, Addr(self.tile.second(b, out)), packed[4:])

    def _rope(self, staged: Reg, dst: Reg):
        """(load, store) per pass of the bf16 RoPE chunks, copied as they are (row-major items
        over the threads); each pass's addresses where its load is emitted."""
        b, rows = self.b, self.rows
        step = self.threads // self.rope_chunks if self.threads % self.rope_chunks == 0 else None
        first = []

        def load(i):
            if not first:
                first.append(self.kept[1] if self.kept else
                             (b.div(self.tid, self.rope_chunks), b.mul(b.rem(self.tid, self.rope_chunks), CHUNK)))
            rope_row, rope_col = first[0]
            if step is not None:
                row, col = b.add(rope_row, i * step), rope_col
            else:
                item = b.add(self.tid, i * self.threads)
                row, col = b.div(item, self.rope_chunks), b.mul(b.rem(item, self.rope_chunks), CHUNK)
            guard = b.setp("lt", row, self.bn) if (i + 1) * self.threads > self.rope_items else None
            src = b.add(staged, b.mad(row, rows.row_bytes, b.add(col, rows.rope_at)))
            out = b.add(dst, self.tile.at(b, row, b.add(col, 2 * rows.rank)))
            if guard is None:
                return None, b.ld("shared", B32, Addr(src), vec=4), out
            words = zero_regs(b, 4)
            with b.predicate(guard):
                b.ld("shared", B32, Addr(src), vec=4, out=words)
            return guard, words, out

        def store(guard, words, out):
            with b.predicate(guard) if guard is not None else nullcontext():
                b.st("shared", B32, Addr(out), words)
        for i in range(self.rope_passes):
            yield (lambda i=i: load(i)), store


__all__ = ["GroupScaledConversion", "PaddedTile", "SwizzledTile"]
