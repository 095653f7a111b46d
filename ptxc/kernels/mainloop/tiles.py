"""Row tiles staged in shared memory: padded or swizzled layout, global <-> shared copies with
bounds, and the ldmatrix lane addresses over either layout.

Padded layout: a tile of `rows` rows of `row_bytes` each, row stride padded to an odd number of
16-byte chunks. Eight consecutive rows then start in eight different 16-byte bank groups (an odd
stride permutes them mod 8), so ldmatrix (8 rows x 16 bytes per matrix) and row-parallel 128-bit
loads run without bank conflicts; the cost is one 16-byte chunk per row when the row is an even
number of chunks, and no address arithmetic (a k-step is an immediate offset).

Swizzled layout (`TileGeom.swizzled`, rows a multiple of 8 chunks = 128 bytes): no padding;
logical chunk c of row r sits at chunk c ^ (r & 7) of the row (the XOR touches the chunk's low
three bits, so it stays in its 128-byte group). The 8 rows an ldmatrix matrix reads, or 8 lanes
of a 128-bit copy write, are 8 consecutive rows at one logical chunk, or one row at 8 chunks of
a group: either way 8 different 16-byte bank groups, conflict-free. Addresses: a lane's chunk
(c0 + its own chunk) ^ (r & 7) = (lane's (chunk ^ r & 7)) ^ c0 for the even c0 of a k-step, so
each tile needs four lane addresses (c0 % 8 = 0, 2, 4, 6: the first XOR 32, 64, 96, which
needs the tile 128-byte aligned) and the rest is immediate (LdmatrixLanes).

Copies: thread `tid` moves 16-byte chunk `tid % chunks` of rows `tid // chunks + i * rows_per_pass`
for each pass i. Rows at or past the number of valid rows are zero-filled: `cp.async` with
src-size 0 (which reads nothing), or a predicated-off load of zeros on targets without cp.async.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...ir import B32, S32, S64, U32, U64, Addr, KernelBuilder, Reg

CHUNK = 16


def padded_stride(row_bytes: int) -> int:
    chunks = -(-row_bytes // CHUNK)
    return (chunks | 1) * CHUNK


SWIZZLE_ROWS = 8   # rows whose chunks the XOR permutes (one 128-byte group of bank columns)
SWIZZLE_ALIGN = 128   # shared-memory alignment a swizzled tile's base needs (LdmatrixLanes)


def swizzle_fits(rows: int, row_bytes: int, threads: int) -> bool:
    """The swizzled layout needs whole 128-byte chunk groups, rows in groups of 8, and copy
    passes that advance by a multiple of 8 rows (so each thread's XOR is the same every pass)."""
    chunks = row_bytes // CHUNK
    return (row_bytes % (CHUNK * SWIZZLE_ROWS) == 0 and rows % SWIZZLE_ROWS == 0
            and threads % chunks == 0 and (threads // chunks) % SWIZZLE_ROWS == 0)


@dataclass(frozen=True)
class TileGeom:
    rows: int
    row_bytes: int
    threads: int
    swizzled: bool = False    # see the module docstring; only where swizzle_fits

    def __post_init__(self):
        assert not self.swizzled or swizzle_fits(self.rows, self.row_bytes, self.threads), self

    @property
    def chunks(self) -> int:
        return self.row_bytes // CHUNK

    @property
    def stride(self) -> int:
        return self.row_bytes if self.swizzled else padded_stride(self.row_bytes)

    @property
    def bytes(self) -> int:
        return self.rows * self.stride

    @property
    def rows_per_pass(self) -> int:
        return self.threads // self.chunks

    @property
    def passes(self) -> int:
        return -(-self.rows // self.rows_per_pass)

    @property
    def idle_threads(self) -> bool:
        return self.threads % self.chunks != 0


@dataclass(frozen=True)
class ThreadSlot:
    """Where one thread's chunks sit: first row `r0` (== rows for idle threads), chunk offset."""

    geom: TileGeom
    r0: Reg          # u32
    col: Reg         # u32, byte offset of the chunk in the row
    soff: Reg        # u32, r0 * stride + col

    def guard(self, b: KernelBuilder, i: int) -> Reg | None:
        """Predicate 'this thread writes a row in pass i' (None when always true)."""
        g = self.geom
        if not g.idle_threads and (i + 1) * g.rows_per_pass <= g.rows:
            return None
        return b.setp("lt", self.r0, g.rows - i * g.rows_per_pass)


def thread_slot(b: KernelBuilder, geom: TileGeom, tid: Reg) -> ThreadSlot:
    r0 = b.div(tid, geom.chunks)
    if geom.idle_threads:
        r0 = b.selp(r0, geom.rows, b.setp("lt", tid, geom.rows_per_pass * geom.chunks))
    col = b.mul(b.rem(tid, geom.chunks), CHUNK)
    if not geom.swizzled:
        return ThreadSlot(geom, r0, col, b.mad(r0, geom.stride, col))
    # every pass moves rows_per_pass (a multiple of 8) rows on, so r & 7 is r0 & 7 in all passes
    phys = b.xor(col, b.shl(b.and_(r0, SWIZZLE_ROWS - 1), 4))
    return ThreadSlot(geom, r0, col, b.mad(r0, geom.stride, phys))


@dataclass(frozen=True)
class GlobalRows:
    """One tensor's rows for one (batch, head): this thread's first chunk address and the
    byte steps between rows and between passes."""

    thr_base: Reg    # u64: head base + r0 * row_stride + col
    row_stride: Reg  # s64 bytes
    pass_step: Reg   # s64 bytes: rows_per_pass * row_stride


def global_rows(b: KernelBuilder, slot: ThreadSlot, head_base: Reg, row_stride: Reg) -> GlobalRows:
    off = b.mad(b.cvt(S64, slot.r0), row_stride, b.cvt(S64, slot.col))
    thr = b.add(b.bitcast(head_base, S64), off)
    return GlobalRows(b.bitcast(thr, U64), row_stride, b.mul(row_stride, slot.geom.rows_per_pass))


def _pass_addrs(b: KernelBuilder, g: GlobalRows, row0: Reg, passes: int,
                first: Reg | None = None) -> list[Reg]:
    addr = first if first is not None else b.mad(b.cvt(S64, row0), g.row_stride, b.bitcast(g.thr_base, S64))
    out = [addr]
    for _ in range(1, passes):
        out.append(b.add(out[-1], g.pass_step))
    return [b.bitcast(a, U64) for a in out]


def load_tile(b: KernelBuilder, slot: ThreadSlot, src: GlobalRows, row0: Reg, nvalid: Reg,
              smem: Reg, use_cp_async: bool, first_addr: Reg | None = None) -> None:
    """Copy rows [row0, row0 + rows) into the tile at shared address `smem`; rows at or past
    `nvalid` (s32, may be <= 0) of the tile are zero-filled. With cp.async nothing is waited for.
    `first_addr` (s64), when the caller carries it, is this thread's address of row row0 + r0
    (`src.thr_base + row0 * row_stride`), saving the 64-bit multiply in a loop."""
    geom = slot.geom
    rem = b.sub(nvalid, b.bitcast(slot.r0, S32))      # valid rows left from this thread's r0
    dst = b.add(smem, slot.soff)
    addrs = _pass_addrs(b, src, row0, geom.passes, first_addr)
    _stage_chunks(b, slot, dst, lambda i: (addrs[i], b.setp("gt", rem, i * geom.rows_per_pass)),
                  use_cp_async)


def load_tile_rows(b: KernelBuilder, slot: ThreadSlot, row_address, row0: Reg, nvalid: Reg,
                   smem: Reg, use_cp_async: bool) -> None:
    """`load_tile` for rows that are not evenly strided (paged caches, GQA-packed query rows):
    `row_address(row, valid)` gets a row number (u32, row0 + the row's index in the tile) and
    returns (this thread's chunk address in that row, validity); invalid rows are zero-filled."""
    geom = slot.geom
    rem = b.sub(nvalid, b.bitcast(slot.r0, S32))
    dst = b.add(smem, slot.soff)

    def chunk(i: int) -> tuple[Reg, Reg]:
        valid = b.setp("gt", rem, i * geom.rows_per_pass)
        return row_address(b.add(row0, b.add(slot.r0, i * geom.rows_per_pass)), valid)
    _stage_chunks(b, slot, dst, chunk, use_cp_async)


def load_tile_passes(b: KernelBuilder, slot: ThreadSlot, pass_address, nvalid: Reg, smem: Reg,
                     use_cp_async: bool) -> None:
    """`load_tile_rows` when the caller computes each pass's address: `pass_address(i)` gives
    (this thread's chunk address for pass i, extra validity); rows at or past `nvalid` (s32) of
    the tile, or whose validity is false, are zero-filled."""
    geom = slot.geom
    rem = b.sub(nvalid, b.bitcast(slot.r0, S32))
    dst = b.add(smem, slot.soff)

    def chunk(i: int) -> tuple[Reg, Reg]:
        addr, ok = pass_address(i)
        return addr, b.and_(b.setp("gt", rem, i * geom.rows_per_pass), ok)
    _stage_chunks(b, slot, dst, chunk, use_cp_async)


def _stage_chunks(b: KernelBuilder, slot: ThreadSlot, dst: Reg, chunk_at, use_cp_async: bool) -> None:
    """Pass i copies this thread's 16-byte chunk from chunk_at(i) = (global address, valid) to
    `dst` + the pass's row offset; invalid chunks become zeros (cp.async src-size 0 reads nothing)."""
    geom = slot.geom
    staged = []
    for i in range(geom.passes):
        a, valid = chunk_at(i)
        doff = i * geom.rows_per_pass * geom.stride
        guard = slot.guard(b, i)
        if use_cp_async:
            size = b.selp(CHUNK, 0, valid, type=U32)
            if guard is None:
                b.cp_async(Addr(dst, doff), Addr(a), CHUNK, size)
            else:
                with b.predicate(guard):
                    b.cp_async(Addr(dst, doff), Addr(a), CHUNK, size)
        else:
            regs = zero_regs(b, 4)
            with b.predicate(valid):
                b.ld("global", B32, Addr(a), vec=4, nc=True, out=regs)
            staged.append((guard, doff, regs))
    for guard, doff, regs in staged:
        if guard is None:
            b.st("shared", B32, Addr(dst, doff), regs)
        else:
            with b.predicate(guard):
                b.st("shared", B32, Addr(dst, doff), regs)


def store_tile(b: KernelBuilder, slot: ThreadSlot, dst: GlobalRows, row0: Reg, nvalid: Reg,
               smem: Reg) -> None:
    """Write the tile's rows [0, nvalid) (s32) from shared memory to rows row0.. of `dst`."""
    geom = slot.geom
    rem = b.sub(nvalid, b.bitcast(slot.r0, S32))
    src = b.add(smem, slot.soff)
    for i, a in enumerate(_pass_addrs(b, dst, row0, geom.passes)):
        ok = b.setp("gt", rem, i * geom.rows_per_pass)
        guard = slot.guard(b, i)
        if guard is not None:
            ok = b.and_(ok, guard)
        with b.predicate(ok):
            vals = b.ld("shared", B32, Addr(src, i * geom.rows_per_pass * geom.stride), vec=4)
            b.st("global", B32, Addr(a), vals)


def ldmatrix_lane_offset(b: KernelBuilder, lane: Reg, stride: int) -> Reg:
    """Lane l addresses row (l & 15), 16-byte chunk (l >> 4) of a 16 x 16 block of halves.

    With .x4 this gives the matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15),
    (rows 8-15, k 8-15): an A fragment as is, two n8 B fragments of a [n][k] tile as (0, 2) and
    (1, 3), and with .trans two n8 B fragments of a [k][n] tile as (0, 1) and (2, 3). With .x2
    only lanes 0-15 matter: the k 0-7 halves (A rows 0-15, or two B tiles) of the same block.
    """
    return b.mad(b.and_(lane, 15), stride, b.mul(b.shr(lane, 4), CHUNK))


def ldmatrix_lane_offset_nk(b: KernelBuilder, lane: Reg, stride: int) -> Reg:
    """Lane l addresses row (l & 7) + 8 (l >> 4), 16-byte chunk (l >> 3) & 1 of a 16 x 16 block.

    With .x4 on a [n][k] tile this gives the matrices (n 0-7, k 0-7), (n 0-7, k 8-15),
    (n 8-15, k 0-7), (n 8-15, k 8-15): two n8 B fragments as (0, 1) and (2, 3), each landing in
    an adjacent register pair, which is what HMMA's B operand needs (the (0, 2) / (1, 3) pairs of
    ldmatrix_lane_offset cost ptxas a MOV per register, issue 13). Not for .x2.
    """
    row = b.add(b.and_(lane, 7), b.shl(b.shr(lane, 4), 3))
    return b.mad(row, stride, b.mul(b.and_(b.shr(lane, 3), 1), CHUNK))


class LdmatrixLanes:
    """One lane's ldmatrix addresses in a tile of `geom`: the lane reads row `row` and chunk
    `chunk` (0 or 1) of each 16 x 16 block, from the ldmatrix_lane_* helpers' pattern.
    `bind(base).at(row0, chunk0)` is the address for the block at rows row0.. (a multiple of 8)
    and chunks chunk0.. (even) of the tile at `base`; the padded layout needs one register per
    tile base, the swizzled one four (chunk0 % 8 = 0, 2, 4, 6), made by bind as the lane's
    address XOR 32, 64, 96. That XOR on the address needs `base` 128-byte aligned (the tiles
    start at multiples of 128 in a shared block declared .align 128), and costs one
    instruction where a per-k-step offset would cost an add, or a register held across the loop."""

    def __init__(self, b: KernelBuilder, geom: TileGeom, offset: Reg):
        self.b, self.geom, self.offset = b, geom, offset   # the lane's offset at chunk0 = 0

    @classmethod
    def at_lane(cls, b: KernelBuilder, geom: TileGeom, row: Reg, chunk: Reg) -> "LdmatrixLanes":
        if geom.swizzled:   # (chunk ^ row & 7) of the lane; chunk0 is XORed in by bind
            chunk = b.xor(chunk, b.and_(row, SWIZZLE_ROWS - 1))
            return cls(b, geom, b.mad(row, geom.stride, b.shl(chunk, 4)))
        return cls(b, geom, b.mad(row, geom.stride, b.mul(chunk, CHUNK)))

    def bind(self, base: Reg) -> "BoundLanes":
        """The addresses in the tile at `base` (registers made here, used where bound)."""
        return BoundLanes(self, base)

    def shifted(self, nbytes: Reg) -> "LdmatrixLanes":
        """The same lanes `nbytes` further on (a whole number of 128-byte groups if swizzled)."""
        return LdmatrixLanes(self.b, self.geom, self.b.add(self.offset, nbytes))


class BoundLanes:
    def __init__(self, lanes: LdmatrixLanes, base: Reg):
        self.geom = lanes.geom
        self.regs = [lanes.b.add(base, lanes.offset)]
        if self.geom.swizzled:
            self.regs += [lanes.b.xor(self.regs[0], 2 * k * CHUNK) for k in range(1, 4)]

    def at(self, row0: int, chunk0: int) -> Addr:
        assert row0 % SWIZZLE_ROWS == 0 and chunk0 % 2 == 0
        k = (chunk0 % SWIZZLE_ROWS) // 2 if self.geom.swizzled else 0
        return Addr(self.regs[k], row0 * self.geom.stride + (chunk0 - 2 * k) * CHUNK)


def ldmatrix_lanes_mk(b: KernelBuilder, lane: Reg, geom: TileGeom) -> LdmatrixLanes:
    """ldmatrix_lane_offset's pattern: row (l & 15), chunk (l >> 4)."""
    return LdmatrixLanes.at_lane(b, geom, b.and_(lane, 15), b.shr(lane, 4))


def ldmatrix_lanes_nk(b: KernelBuilder, lane: Reg, geom: TileGeom) -> LdmatrixLanes:
    """ldmatrix_lane_offset_nk's pattern: row (l & 7) + 8 (l >> 4), chunk (l >> 3) & 1."""
    return LdmatrixLanes.at_lane(b, geom, b.add(b.and_(lane, 7), b.shl(b.shr(lane, 4), 3)),
                                 b.and_(b.shr(lane, 3), 1))


def zero_regs(b: KernelBuilder, n: int, type=B32) -> list[Reg]:
    return [b.mov(0, type) if type.is_int or type.kind == "b" else b.mov(0.0, type) for _ in range(n)]


__all__ = ["TileGeom", "ThreadSlot", "GlobalRows", "thread_slot", "global_rows", "load_tile", "load_tile_rows",
           "LdmatrixLanes", "ldmatrix_lanes_mk", "ldmatrix_lanes_nk", "swizzle_fits",
           "SWIZZLE_ALIGN", "ldmatrix_lane_offset_nk", "load_tile_passes",
           "store_tile", "ldmatrix_lane_offset", "padded_stride", "zero_regs", "U32", "U64"]

SWIZZLE = 128            # bytes per swizzled row of a slab (the 128-byte swizzle mode)
SWIZZLE_PERIOD = 1024    # 8 rows x 128 B: the pattern repeats, descriptors' SBO
# e4m3 score operands (MLA's qk_products = "e4m3"): slabs of 64 one-byte columns with the 64-byte
# swizzle, so slab s covers the 16-bit tiles' columns 64s.. too (chunk c of row r at c ^ (r/2 % 4))
NARROW_SWIZZLE = 64


@dataclass(frozen=True)
class SwizzledGeom(TileGeom):
    """`rows` rows of `row_bytes` stored as row_bytes / 128 slabs of rows x 128 B (swizzled).
    `stride` is the distance between rows inside a slab, which is what the copy passes step."""

    @property
    def stride(self) -> int:
        return SWIZZLE

    @property
    def slab_bytes(self) -> int:
        return self.rows * SWIZZLE

    @property
    def bytes(self) -> int:
        return self.rows * self.row_bytes


def swizzled_slot(b: KernelBuilder, geom: SwizzledGeom, tid: Reg) -> ThreadSlot:
    """Thread `tid` copies chunk c = tid % chunks of rows tid // chunks + i * rows_per_pass:
    slab c // 8, swizzled chunk (c % 8) ^ (row % 8). rows_per_pass is a multiple of 8, so the
    swizzle of every pass is the first one's and the pass offsets stay immediates."""
    if geom.rows_per_pass % 8 or geom.idle_threads:
        raise AssertionError(f"swizzled copy needs whole 8-row groups per pass: {geom}")
    per_slab = SWIZZLE // CHUNK
    r0 = b.div(tid, geom.chunks)
    c = b.rem(tid, geom.chunks)
    swz = b.xor(b.rem(c, per_slab), b.rem(r0, 8))
    soff = b.mad(r0, SWIZZLE, b.shl(swz, 4))
    if geom.chunks > per_slab:
        soff = b.mad(b.div(c, per_slab), geom.slab_bytes, soff)
    return ThreadSlot(geom, r0, b.mul(c, CHUNK), soff)
