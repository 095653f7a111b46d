"""A KV layout's tiles as TMA boxes, issued by a set of threads (varlen's packed tile on sm_90a
and sm_100a, MLA's latent tile): the tensor maps (`tensor_map_params`), which thread issues
which box of a tile (`warp_boxes`), the page ids those threads load one K request ahead
(`IssuerPages`), and the V tail rows past the sequence's end zeroed in shared memory
(`zero_tail_rows`). The geometry (bodies/varlen_tma.py's docstring has the whole loop):

  contiguous k_cache / v_cache [batch, max_seq_len, Hk, d]: 4D tensor maps (innermost first
             d, Hk, max_seq_len, batch), box [64, 1, block_n, 1] per 128-byte slab.
  paged      [num_pages, page_size, Hk, d]: box [64, 1, min(page_size, block_n), 1] per slab and
             page, landing at the page's row offset in the slab; an id outside [0, num_pages)
             lies outside the map's page dimension, so the TMA fills the box with zeros and
             still counts its bytes.
  latent     MLA's cache (no head axis): one 3D map, box [64, rows, 1]; e4m3 rows unswizzled,
             fp8_box_bytes columns a box.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...ir import S32, U32, Addr, KernelBuilder, Reg
from ..base import LaunchParam, ParamSource
from ..mainloop.tiles import CHUNK, SWIZZLE
from .kv_access import KVAccess


def box_rows(kv: KVAccess, block_n: int) -> int:
    return block_n if kv.layout == "contiguous" else min(kv.page_size, block_n)


def tensor_map_params(b: KernelBuilder, cfg, kv: KVAccess, params: list) -> dict:
    """The caches' tensor-map parameters (appended to `params`): k_tmap and v_tmap, or a
    latent cache's kv_tmap (no head axis)."""
    from ...ir import TMAP
    rows = box_rows(kv, cfg.block_n)
    # innermost first: d, (head,) row, seq or page; FP8 latent rows land unswizzled in staging
    # buffers, a box of fp8_box_bytes columns
    staged = kv.latent and cfg.fp8
    swizzle = 0 if staged else SWIZZLE
    width = cfg.fp8_box_bytes if staged else SWIZZLE // cfg.fmt.bytes
    box = (width, rows, 1) if kv.latent else (width, 1, rows, 1)
    maps = {}
    for t in kv.caches:
        name = "kv_tmap" if kv.latent else f"{t[0]}_tmap"
        params.append(LaunchParam(name, TMAP, ParamSource("tensor_map", tensor=t, box=box, swizzle=swizzle)))
        maps[t] = b.param(name, TMAP)
    return maps


def zero_tail_rows(b: KernelBuilder, cfg, tid: Reg, v_tile: Reg, nvalid: Reg,
                   threads: int | None = None) -> None:
    """Zero rows [nvalid, block_n) of the swizzled V tile at `v_tile` (every slab) by `threads`
    threads (default the CTA's; tid their index): chunk c of the tile is row (c / 8) % block_n
    of slab c / (8 block_n), at byte 16 c (the swizzle only permutes chunks inside a row, so
    whole rows need no swizzle)."""
    bn, threads = cfg.block_n, threads or cfg.threads
    chunks = cfg.v_geom.bytes // CHUNK
    zero = b.mov(0, U32)
    row0, mine = b.shr(tid, 3), b.add(v_tile, b.shl(tid, 4))
    for i in range(-(-chunks // threads)):
        row = b.and_(b.add(row0, i * threads // 8), bn - 1)
        dead = b.setp("ge", b.bitcast(row, S32), nvalid)
        if (i + 1) * threads > chunks:        # a partial last pass (small tiles, 256 threads)
            dead = b.and_(dead, b.setp("lt", tid, chunks - i * threads))
        with b.predicate(dead):
            b.st("shared", U32, Addr(mine, i * threads * CHUNK), [zero] * 4)


@dataclass(frozen=True)
class Box:
    """One box a warp issues per tile: `slab` (128-byte column slab), its first key row in the
    tile (`row`, int 0 when a tile is one page) and shared-memory offset (`offset`); `active`
    predicates a last pass that not every warp has a box in (None: every warp has)."""

    active: Reg | None
    slab: Reg
    col: Reg          # the slab's first column: its coordinate in the tensor map
    row: Reg | int
    offset: Reg


def warp_boxes(b: KernelBuilder, warp: Reg, slabs: int, slab_cols: int, pages: int, rows: int,
               bn: int, num_warps: int, slab_row_bytes: int = SWIZZLE) -> list[Box]:
    """The boxes lane 0 of `warp` issues for each tile, computed once from the warp id: box
    k = p * slabs + s (page p of the tile, slab s) is issued by warp (k + 1) % num_warps in
    pass k // num_warps -- spread so that no warp carries the whole issue block (ptxas wraps
    every box in an ELECT issue loop), and the elected thread's warp 0, which also arrives
    with the expect_tx, takes the last box of a pass, not a second one. A slab is bn rows of
    `slab_row_bytes` in shared memory."""
    n = slabs * pages
    mine = b.rem(b.add(warp, num_warps - 1), num_warps)         # (warp - 1) mod num_warps
    out = []
    for i in range(-(-n // num_warps)):
        k = mine if i == 0 else b.add(mine, i * num_warps)
        active = None if (i + 1) * num_warps <= n else b.setp("lt", k, n)
        if pages == 1:
            slab, row, offset = k, 0, b.mul(k, bn * slab_row_bytes)
        else:
            page = b.div(k, slabs)
            slab = b.sub(k, b.mul(page, slabs))
            row = b.mul(page, rows)
            offset = b.add(b.mul(slab, bn * slab_row_bytes), b.mul(row, slab_row_bytes))
        out.append(Box(active, slab, b.bitcast(b.mul(slab, slab_cols), S32), row, offset))
    return out


class IssuerPages:
    """The page ids of the threads that issue the boxes (lane 0 of each warp, for the pages its
    boxes cover: slot i is box i's page, or one slot for all when a tile is one page), loaded
    one K request ahead so that no block-table load sits between a refill's barrier and its
    boxes: `cur[i]` holds the id in the next K tile to request, `last[i]` in the last K
    requested, `prev[i]` in the one before. tma_pipeline requests V(t) right after K(t + 1)
    when that tile exists (ids in `prev`), else alone (in `last`); the latent loop requests
    tiles alone. A row at or past L, or a page wholly before a sliding window's first key
    (pages an engine may have freed; the cp.async body zero-fills those rows too), gets id -1
    (no block-table entry is read for it)."""

    def __init__(self, b: KernelBuilder, kv: KVAccess, block_row: Reg, first: Reg, bn: int,
                 rows: int, L: Reg, n_tiles: Reg, key_lo: Reg | None, boxes: list[Box]):
        self.b, self.kv, self.block_row, self.first, self.bn, self.rows = b, kv, block_row, first, bn, rows
        self.L, self.n_tiles, self.key_lo = L, n_tiles, key_lo
        self.slots = boxes[:1] if rows == bn else boxes     # a one-page tile: one id serves all
        self.cur, self.last, self.prev = ([b.mov(-1, S32) for _ in self.slots] for _ in range(3))

    def slot(self, i: int) -> int:
        """The id slot of box i."""
        return min(i, len(self.slots) - 1)

    def load(self, j: Reg) -> None:
        """cur[i] <- the id of slot i's page in tile j."""
        b = self.b
        row0 = b.mul(b.add(self.first, j), self.bn)
        for i, box in enumerate(self.slots):
            row = row0 if box.row == 0 else b.add(row0, box.row)
            valid = b.setp("lt", b.bitcast(row, S32), self.L)
            if box.active is not None and len(self.slots) > 1:
                valid = b.and_(valid, box.active)
            if self.key_lo is not None:     # a page wholly before the window: never read
                valid = b.and_(valid, b.setp("gt", b.bitcast(b.add(row, self.rows), S32), self.key_lo))
            self.kv.load_page(b, {"block_row": self.block_row}, row, valid, out=self.cur[i])

    def k_ids(self) -> list[Reg]:
        """K(j)'s ids (loaded at the previous K request), shifted into `last`."""
        for i in range(len(self.slots)):
            self.b.mov(self.last[i], out=self.prev[i])
            self.b.mov(self.cur[i], out=self.last[i])
        return list(self.last)

    def v_ids(self, j: Reg) -> list[Reg]:
        b = self.b
        after_k = b.setp("lt", b.add(j, 1), self.n_tiles)     # K(j + 1) was requested first
        return [b.selp(p, q, after_k, S32) for p, q in zip(self.prev, self.last)]


__all__ = ["Box", "IssuerPages", "box_rows", "tensor_map_params", "warp_boxes", "zero_tail_rows"]
