"""Where the mma.sync fragment math's O goes (MmaMath's output half): the epilogue that rounds
O / l into shared memory and stores it by the threads' 128-bit rows, or -- tile.tma_store --
stages it as TMA boxes by stmatrix and stores it by TMA. WgmmaMath and VarlenMath inherit it;
the addresses are made once, in MmaMath's constructor (place_o), where the PTX wants them."""

from __future__ import annotations

from ...ir import B32, S32, Addr, KernelBuilder, Reg
from ..attention.variant import finish_rows


def o_staging(ctx) -> Reg:
    """Where the epilogue stages O: the prefill Ctx's o_smem (tile.persistent's own region), else
    over Q (the packed tiles' contexts)."""
    return getattr(ctx, "o_smem", ctx.q_smem)


class MmaOutput:
    """The epilogue of a tile whose lane (g = lane / 4, t = lane % 4) holds rows g and g + 8 of
    every n8 tile of O (self.o_tiles, m-tile-major), with the row sums of row_sums()."""

    def place_o(self, b: KernelBuilder, ctx, lane: Reg, warp_rows: Reg, g: Reg, t: Reg) -> None:
        """This lane's O addresses in the staging tile: o_smem (rows g, g + 8, column pair 2t),
        o_slab (tile.tma_store) or o_lanes (a swizzled O tile)."""
        cfg = ctx.cfg
        self.o_smem = b.add(b.mad(b.add(warp_rows, g), self.os, o_staging(ctx)), b.shl(t, 2))
        # tile.tma_store: O staged as a TMA box of each 128-byte column slab wants it -- slab s
        # at s x block_m x 128 bytes, rows of 128 bytes, chunk c of row r at c ^ (r & 7) -- by
        # stmatrix.x4, n8 blocks jd, jd + 1 of 16 rows an instruction. Lane l gives row j = l & 7
        # of matrix i = l >> 3 (rows 8 (i & 1) + j, block jd + (i >> 1)): chunk (jd + h) ^ j,
        # h = i >> 1, which for even jd is ((jd ^ (j & 6)) + (h ^ (j & 1))) << 4. Kept: the
        # lane's row address with its (h ^ (j & 1)) << 4, and (j & 6) << 4 (two registers; the
        # four jd-dependent addresses are made in the epilogue). TMA kernels never split V
        self.o_slab = None
        if getattr(cfg, "tma_store", False):
            assert cfg.v_split == 1 and self.dtiles % 2 == 0, "tile.tma_store stages whole O rows"
            j, i = b.and_(lane, 7), b.shr(lane, 3)
            row = b.add(warp_rows, b.add(b.shl(b.and_(i, 1), 3), j))
            chunk = b.shl(b.xor(b.shr(i, 1), b.and_(j, 1)), 4)
            self.o_slab = (b.add(o_staging(ctx), b.add(b.shl(row, 7), chunk)),
                           b.shl(b.and_(j, 6), 4))
        # swizzled O tile: the lane's rows are g and g + 8 (row & 7 = g), so n8 tile jd (chunk
        # jd) sits at chunk jd ^ g: one register per jd % 8, the 128-byte group immediate
        self.o_lanes = [b.add(self.o_smem, b.shl(b.xor(g, j), 4)) for j in range(8)] \
            if cfg.o_geom.swizzled and self.o_slab is None else None

    def stage_slabs(self, invs: list[Reg]) -> None:
        """tile.tma_store: O / l in the dtype into the Q region as TMA boxes of 128-byte column
        slabs, n8 blocks jd and jd + 1 of 16 rows by one stmatrix.x4 (see place_o)."""
        b, bm = self.b, self.ctx.cfg.block_m
        row, j6 = self.o_slab
        lanes = [b.add(row, b.xor(j6, jp << 4)) for jp in (0, 2, 4, 6)]
        for mt, o in enumerate(self.o_tiles):
            for jd in range(0, len(o), 2):
                regs = [b.cvt_pack(self.out_pair, *(b.mul(acc[2 * r + e], invs[2 * mt + r])
                                                for e in (1, 0)))
                        for acc in (o[jd], o[jd + 1]) for r in range(2)]
                b.stmatrix(Addr(lanes[jd % 8 // 2], 16 * mt * 128 + jd // 8 * bm * 128), regs)

    def store_by_tma(self) -> None:
        """tile.tma_store: the staged O tile leaves by TMA stores, one box a 128-byte column
        slab (rows past seq_q are clipped by the map): each thread's writes fenced for the
        async proxy, the math's barrier, then thread 0 issues the boxes and waits until they
        have been read (the CTA's shared memory must outlive them) -- unless the context
        defers that wait (a persistent CTA's O region of its own: the boxes are read while the
        next tile runs, and the pipeline waits before O is staged there again and at exit)."""
        b, ctx = self.b, self.ctx
        bm, slab_cols = ctx.cfg.block_m, 128 // ctx.cfg.fmt.bytes
        b.fence_proxy_async()
        self.cta_sync()
        coords = [b.bitcast(x, S32) for x in (ctx.head, ctx.m_start, ctx.batch)]
        with b.if_then(b.setp("eq", ctx.tid, 0)):
            for s in range(ctx.cfg.dv // slab_cols):
                b.tma_store(Addr(o_staging(ctx), s * bm * 128), ctx.o_tmap,
                            [b.mov(s * slab_cols, S32), *coords])
            b.bulk_commit()
            if not getattr(ctx, "store_wait_deferred", False):
                b.bulk_wait_read(0)

    def epilogue(self) -> None:
        """O / l rounded into this warp's rows of the Q tile, then 128-bit row stores by all
        (tile.tma_store: TMA stores, store_by_tma)."""
        from ..mainloop.tiles import global_rows, store_tile, thread_slot
        b, ctx = self.b, self.ctx
        l_rows, lanes = self.row_sums()
        invs = finish_rows(b, ctx, self.sums_max(), l_rows, self.rows, lanes, self.writer())
        if self.o_slab is not None:
            self.stage_slabs(invs)
            self.store_by_tma()
            return
        for mt, o in enumerate(self.o_tiles):
            for jd, acc in enumerate(o):
                for r in range(2):
                    lo, hi = (b.mul(acc[2 * r + e], invs[2 * mt + r]) for e in range(2))
                    row_off = (16 * mt + 8 * r) * self.os
                    if self.o_lanes is None:
                        at = Addr(self.o_smem, row_off + jd * 16)
                    else:
                        at = Addr(self.o_lanes[jd % 8], row_off + jd // 8 * 128)
                    b.st("shared", B32, at, [b.cvt_pack(self.out_pair, hi, lo)])
        self.cta_sync()
        slot = thread_slot(b, ctx.cfg.o_geom, ctx.tid)
        go = global_rows(b, slot, ctx.o_base, ctx.o_row_stride)
        nvalid = b.sub(b.bitcast(ctx.seq_q, S32), b.bitcast(ctx.m_start, S32))
        store_tile(b, slot, go, ctx.m_start, nvalid, o_staging(ctx))
