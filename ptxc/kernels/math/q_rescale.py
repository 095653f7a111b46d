"""The Q tile of a bf16 kernel rewritten into f16 in place, each row times a power of two, so
its tensor-core products run on f16 inputs (kv_fp8_stage.f16_math_applies: FP8 caches convert
to f16 in one instruction a pair). Used by MmaMath and WgmmaMath (their fragment layout: lane
(g, t) of a warp holds rows g + 8i)."""

from __future__ import annotations

from contextlib import nullcontext

from ...ir import B32, F16X2, F32, S32, U32, Addr, Reg
from ..common import FORMATS
from ..mainloop.tiles import SwizzledGeom, zero_regs


def rescale_q_rows(math) -> list[Reg]:
    """The Q tile's bf16 rows -> f16 in place, row r times 2^k_r, so products run on f16
    inputs (kv_fp8_stage.f16_math_applies) whatever Q's range. Called once the Q tile has
    landed and a barrier made it visible; the loop's first barrier precedes every read.
    k_r = 15 - E_r (E_r the exponent of the row's largest |q|, clamped to +-126): the row's
    largest element lands in [2^15, 2^16), below f16's 65504 (a bf16 there is at most 65280,
    exact), and every element down to 2^-31 of it stays exact (its 8 significant bits sit
    above f16's smallest subnormal, 2^-24); smaller ones round, below bf16's own precision
    of the row's dot products. Row r's softmax factor becomes scale_log2 · 2^-k_r,
    exact, so S · factor equals the bf16 path's scores up to f32 rounding.
    Lane (g, t) of the warp owning rows R (warp_rows, or shared under v_split) takes rows
    g + 8i of them -- the rows its score fragments hold -- and chunks t, t + 4, ..: the
    row's max over the quad's lanes (two shuffles) leaves k_r in the lanes that need it.
    Warps sharing rows (v_split) each read the whole row, meet at a barrier, then convert
    their share of its chunks (chunk t + 4 (part + v_split j)). A chunk is transformed in
    place, so the order of a row's chunks in its layout does not matter: chunk q of a row
    is at 16 q (padded or XOR-swizzled rows), or, in 128-byte slabs (wgmma's tiles), at
    slab q // 8, 16 (q % 8). The caller makes the rewrite visible (a barrier; wgmma's
    tensor cores read through the async proxy: a fence.proxy.async as well).
    Returns each of the lane's rows' softmax factor (scale_log2 · 2^-k_r)."""
    b, ctx, cfg = math.b, math.ctx, math.ctx.cfg
    assert cfg.math_fmt is FORMATS["f16"] and cfg.fmt is FORMATS["bf16"], "bf16 rows to f16"
    chunks, ss, vs = cfg.head_dim // 8, math.ss, cfg.v_split
    slabs = cfg.q_geom.slab_bytes if isinstance(cfg.q_geom, SwizzledGeom) else None
    assert slabs is None or vs <= 2, "a lane's first chunk of a step stays inside its slab"
    t, g = math.t, b.shr(ctx.lane, 2)
    row_addrs = [b.mad(b.add(math.warp_row0(b, ctx), b.add(g, 8 * i)), ss, ctx.q_smem)
                 for i in range(2 * math.mt)]
    lane_chunk = b.shl(t, 4)

    def each_chunk(step: int, first: Reg):
        """(byte offset, predicate or None) of this lane's chunks first + step j, relative
        to chunk `first` (< step, and < 8 in slabs: first + step j then sits in first's
        column of slab step j // 8, for step 4 or 8)."""
        for j in range(-(-chunks // step)):
            q = j * step
            off = 16 * q if slabs is None else q // 8 * slabs + 16 * (q % 8)
            last = q + step - 1
            yield off, None if last < chunks else b.setp("lt", b.add(first, q), chunks)

    # pass 1: |largest bf16| of each row as bits, over the lane's chunks, then the quad
    highest = []
    for addr in row_addrs:
        top_hi, top_lo = b.mov(0, U32), b.mov(0, U32)
        at = b.add(addr, lane_chunk)
        for off, pred in each_chunk(4, t):
            if pred is None:
                words = b.ld("shared", B32, Addr(at, off), vec=4)
            else:        # past the row: zeros
                words = zero_regs(b, 4)
                with b.predicate(pred):
                    b.ld("shared", B32, Addr(at, off), vec=4, out=words)
            for w in words:      # |hi| in the top half orders the high halves; |lo| << 16
                mag = b.and_(b.bitcast(w, U32), 0x7FFF7FFF)
                b.max(top_hi, mag, out=top_hi)
                b.max(top_lo, b.shl(mag, 16), out=top_lo)
        top = b.shr(b.max(top_hi, top_lo), 16)
        for lanes in (1, 2):
            top = b.max(top, b.shfl("bfly", top, lanes))
        highest.append(top)
    # k = 15 - E = 142 - (exponent field), clamped: 2^k and 2^-k are normal f32
    ks = [b.bitcast(b.min(b.max(b.sub(142, b.bitcast(b.shr(top, 7), S32)), -126), 126), S32)
          for top in highest]
    up = [b.bitcast(b.shl(b.bitcast(b.add(k, 127), U32), 23), F32) for k in ks]
    down = [b.bitcast(b.shl(b.bitcast(b.sub(127, k), U32), 23), F32) for k in ks]
    row_scales = [b.mul(d, math.scale_log2) for d in down]
    if vs > 1:
        math.cta_sync()   # every warp sharing the rows has read them
    # pass 2: this warp's share of the chunks, times 2^k, rounded to f16 pairs in place
    part = b.shl(math.value_part(b, ctx), 2) if vs > 1 else None
    first = t if part is None else b.add(t, part)
    lane_off = lane_chunk if part is None else b.shl(first, 4)
    for addr, scale in zip(row_addrs, up):
        at = b.add(addr, lane_off)
        for off, pred in each_chunk(4 * vs, first):
            with b.if_then(pred) if pred is not None else nullcontext():
                words = b.ld("shared", B32, Addr(at, off), vec=4)
                halves = []
                for w in words:
                    u = b.bitcast(w, U32)
                    lo = b.mul(b.bitcast(b.shl(u, 16), F32), scale)
                    hi = b.mul(b.bitcast(b.and_(u, 0xFFFF0000), F32), scale)
                    halves.append(b.cvt_pack(F16X2, hi, lo))
                b.st("shared", B32, Addr(at, off), halves)
    return row_scales


__all__ = ["rescale_q_rows"]
