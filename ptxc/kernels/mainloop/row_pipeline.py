"""Decode's SIMT main loop: the CTA's KV rows in steps of `rows_per_iter` (every warp's row slots
× kv_unroll), each lane's K/V chunks by register loads, or -- with kv_stages >= 2 (plain caches
on cp.async targets) -- global -> the thread's own shared-memory slots by cp.async, kv_stages - 1
iterations ahead, so loads stay in flight while the current rows are multiplied. What a row
slot does with its rows is the math's (`attend`); where a row lives is the loader's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ...ir import U32, Addr, KernelBuilder, Reg
from .. import common as C


@dataclass(frozen=True)
class KeyRows:
    """The decode scheduler's answer: rows [begin, end) of one sequence, rows_per_iter per
    iteration; `rows_at(it)` are this lane's rows of the iteration starting at row `it`."""

    begin: Reg
    end: Reg
    rows_per_iter: int
    rows_at: Callable


def run_row_pipeline(b: KernelBuilder, cfg, rows: KeyRows, *, fetch, advance, read, math,
                     tid: Reg) -> None:
    """`fetch(rows, put)` addresses the rows' chunks (put(t, u, j, addr, pred) each) and
    returns (validity, the page ids of the rows an iteration further); `advance(fresh)` makes
    those current; `read(addr, pred)` is a register load of one chunk; `math.attend(tiles,
    rows, valid)` takes tiles[t][u][j] of "k_cache" / "v_cache"."""
    stages = cfg.kv_stages
    if stages < 2:
        with b.for_range(rows.begin, rows.end, rows.rows_per_iter) as it:
            mine = rows.rows_at(it)
            tiles = {"k_cache": [[None] * cfg.chunks_per_lane for _ in mine],
                     "v_cache": [[None] * cfg.chunks_per_lane for _ in mine]}

            def put(t, u, j, addr, pred):
                tiles[t][u][j] = read(addr, pred)
            valid, fresh = fetch(mine, put)
            math.attend(tiles, mine, valid)
            advance(fresh)
        return

    threads = cfg.num_warps * 32
    slots = 2 * cfg.kv_unroll * cfg.chunks_per_lane
    smem = b.address_of(b.shared("kv_stage_smem", stages * slots * threads * C.VEC_BYTES))
    own = b.mad(tid, C.VEC_BYTES, smem)      # a thread's slots: 16 B apart per thread, no conflicts

    def slot_off(t, u, j):
        return (((t == "v_cache") * cfg.kv_unroll + u) * cfg.chunks_per_lane + j) * threads * C.VEC_BYTES

    stage_bytes = slots * threads * C.VEC_BYTES

    def issue(at, stage_off):
        dst = b.add(own, stage_off) if not isinstance(stage_off, int) else own

        def put(t, u, j, addr, pred):
            off = slot_off(t, u, j) + (stage_off if isinstance(stage_off, int) else 0)
            size = C.VEC_BYTES if pred is None else b.selp(C.VEC_BYTES, 0, pred, type=U32)
            b.cp_async(Addr(dst, off), addr, C.VEC_BYTES, size)
        _, fresh = fetch(at, put)
        b.cp_async_commit()
        advance(fresh)

    for s in range(stages - 1):
        issue(rows.rows_at(b.add(rows.begin, s * rows.rows_per_iter)), s * stage_bytes)
    read_off = b.mov(0, U32)
    write_off = b.mov((stages - 1) * stage_bytes, U32)
    with b.for_range(rows.begin, rows.end, rows.rows_per_iter) as it:
        issue(rows.rows_at(b.add(it, (stages - 1) * rows.rows_per_iter)), write_off)
        b.cp_async_wait(stages - 1)          # this thread's copies of the current rows landed
        mine = rows.rows_at(it)
        src = b.add(own, read_off)
        tiles = {t: [[b.ld("shared", cfg.fmt.load_type, Addr(src, slot_off(t, u, j)), vec=4)
                      for j in range(cfg.chunks_per_lane)] for u in range(cfg.kv_unroll)]
                 for t in ("k_cache", "v_cache")}
        math.attend(tiles, mine, [b.setp("lt", r, rows.end) for r in mine])
        for reg in (read_off, write_off):   # stage offsets rotate in registers (no rem in the loop)
            nxt = b.add(reg, stage_bytes)
            b.mov(b.selp(0, nxt, b.setp("eq", nxt, stages * stage_bytes)), out=reg)
    b.cp_async_wait(0)
