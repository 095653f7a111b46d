"""Q's rows rewritten before the loop, each times a power of two that its softmax factor undoes:
a bf16 kernel's Q tile into f16 in place, so its tensor-core products run on f16 inputs
(kv_fp8_stage.f16_math_applies: FP8 caches convert to f16 in one instruction a pair), or --
MLA's qk_products = "e4m3" -- rounded to e4m3 values, in place in the 16-bit tile
(rescale_q_rows with e4m3_on) or from global memory into the e4m3 tile of the FP8 score
products (quantize_q_rows). Used by MmaMath and WgmmaMath (their fragment layout: lane (g, t)
of a warp holds rows g + 8i)."""

from __future__ import annotations

from contextlib import nullcontext

from ...ir import B32, F16, F16X2, F32, S32, S64, U32, U64, Addr, Reg
from ..common import FORMATS
from ..mainloop.tiles import NARROW_SWIZZLE, SwizzledGeom, zero_regs
from . import fp8


def quad_max_bits(b, word_lists) -> Reg:
    """The largest |element| of 16-bit pairs (the words of each list `word_lists` yields, loaded
    as it is iterated), as the element's bits (sign cleared: bits order magnitudes, f16's and
    bf16's alike), over the lanes of the quad (two shuffles)."""
    top_hi, top_lo = b.mov(0, U32), b.mov(0, U32)
    for words in word_lists:
        for w in words:      # |hi| in the top half orders the high halves; |lo| << 16
            mag = b.and_(b.bitcast(w, U32), 0x7FFF7FFF)
            b.max(top_hi, mag, out=top_hi)
            b.max(top_lo, b.shl(mag, 16), out=top_lo)
    top = b.shr(b.max(top_hi, top_lo), 16)
    for lanes in (1, 2):
        top = b.max(top, b.shfl("bfly", top, lanes))
    return top


def half_values(b, w: Reg, fmt) -> list[Reg]:
    """A word's two 16-bit elements (bf16 or f16) as f32, the low half first (a u32 holding
    one element in its low half: that element first)."""
    if fmt is FORMATS["bf16"]:
        u = b.bitcast(w, U32)
        return [b.bitcast(b.shl(u, 16), F32), b.bitcast(b.and_(u, 0xFFFF0000), F32)]
    return [b.cvt(F32, h) for h in b.unpack(w, F16)]


def e4m3_exponent(b, top: Reg, fmt) -> Reg:
    """k = 7 - E (s32, clamped to +-126) of a row whose largest |element| has the 16-bit bits
    `top` (quad_max_bits): times 2^k that element lands in [2^7, 2^8), under e4m3's 448."""
    big = b.bitcast(b.shl(top, 16), F32) if fmt is FORMATS["bf16"] else \
        b.cvt(F32, b.unpack(top, F16)[0])
    field = b.bitcast(b.and_(b.shr(b.bitcast(big, U32), 23), 0xFF), S32)
    return b.min(b.max(b.sub(134, field), -126), 126)          # 7 - (field - 127)


def pow2(b, k: Reg, negate: bool = False) -> Reg:
    """2^k (2^-k) as an f32 from the s32 k in [-126, 126]: the exponent field alone."""
    field = b.sub(127, k) if negate else b.add(k, 127)
    return b.bitcast(b.shl(b.bitcast(field, U32), 23), F32)


def rescale_q_rows(math, e4m3_on=None) -> list[Reg]:
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
    Returns each of the lane's rows' softmax factor (scale_log2 · 2^-k_r).

    `e4m3_on` (a Target; MLA's qk_products = "e4m3" on tiles whose products stay 16-bit): the
    rows (bf16 or f16) become e4m3 values instead, in the products' 16-bit format (exact:
    every e4m3 value is an f16 and a bf16 value), with quantize_q_rows' rule -- k_r = 7 - E_r,
    cvt.rn.satfinite to e4m3 (in software before sm_89) -- so the scores are the FP8 tile's
    up to the order of f32 additions."""
    b, ctx, cfg = math.b, math.ctx, math.ctx.cfg
    assert e4m3_on is not None or (cfg.math_fmt is FORMATS["f16"] and cfg.fmt is FORMATS["bf16"]), \
        "bf16 rows to f16"
    chunks, ss, vs = cfg.head_dim // 8, math.ss, cfg.row_sharers
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
    def lane_words(addr: Reg):
        at = b.add(addr, lane_chunk)
        for off, pred in each_chunk(4, t):
            if pred is None:
                yield b.ld("shared", B32, Addr(at, off), vec=4)
            else:        # past the row: zeros
                words = zero_regs(b, 4)
                with b.predicate(pred):
                    b.ld("shared", B32, Addr(at, off), vec=4, out=words)
                yield words

    highest = [quad_max_bits(b, lane_words(addr)) for addr in row_addrs]
    if e4m3_on is not None:    # k = 7 - E, quantize_q_rows' rule
        ks = [e4m3_exponent(b, top, cfg.fmt) for top in highest]
    else:   # k = 15 - E = 142 - (exponent field), clamped: 2^k and 2^-k are normal f32
        ks = [b.bitcast(b.min(b.max(b.sub(142, b.bitcast(b.shr(top, 7), S32)), -126), 126), S32)
              for top in highest]
    up = [pow2(b, k) for k in ks]
    down = [pow2(b, k, negate=True) for k in ks]
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
                if e4m3_on is not None:     # 8 values times 2^k, rounded to e4m3, back to 16 bits
                    vals = [b.mul(x, scale) for w in words for x in half_values(b, w, cfg.fmt)]
                    b.st("shared", B32, Addr(at, off), fp8.dequantize(
                        b, fp8.quantize(b, vals, "e4m3", e4m3_on), "e4m3", e4m3_on,
                        to=f"{cfg.math_fmt.name}x2"))
                    continue
                halves = []
                for w in words:
                    u = b.bitcast(w, U32)
                    lo = b.mul(b.bitcast(b.shl(u, 16), F32), scale)
                    hi = b.mul(b.bitcast(b.and_(u, 0xFFFF0000), F32), scale)
                    halves.append(b.cvt_pack(F16X2, hi, lo))
                b.st("shared", B32, Addr(at, off), halves)
    return row_scales




def quantize_q_rows(math, q_row, valid_rows: Reg, target) -> list[Reg]:
    """Q's 16-bit rows from global memory into the e4m3 Q tile the scores' FP8 wgmma reads
    (MLA's qk_products = "e4m3"), row r times 2^k_r, k_r = 7 - E_r (E_r the exponent of the
    row's largest |q|, clamped to +-126): the row's largest element lands in [2^7, 2^8), under
    e4m3's 448, and each element rounds to e4m3 (cvt.rn.satfinite: 3 mantissa bits; below 2^-6
    subnormal, below 2^-10 zero -- 2^-17 of the row's largest). The scale is a power of two, so
    the reference repeats it exactly and row r's softmax factor is scale_log2 · 2^-k_r.
    `q_row(row, valid)` is the packed tile's row address (PackedTile.q_row at column 0), rows
    at or past `valid_rows` (s32) read as zeros. Lane (g, t) of a warp takes rows g + 8i of the
    warp's 16 (the rows its score fragments hold), reads chunks t, t + 4, .. of each (16 bytes:
    8 elements) for the row's max over the quad, then converts its warpgroup's share p of them
    (chunks t + 4p + 8j under the value split) into 8-byte pieces of the Q tile: 64-byte
    slabs of 64 rows, chunk q of row r at slab q / 8, 16-byte chunk ((q % 8) / 2) ^ ((r / 2) % 4),
    half q % 2. The caller makes the tile visible (fence.proxy.async, a barrier)."""
    b, ctx, cfg = math.b, math.ctx, math.ctx.cfg
    chunks, vs = cfg.head_dim // 8, cfg.v_split
    assert chunks % (4 * vs) == 0 and vs <= 2, (chunks, vs)
    t, g = math.t, b.shr(ctx.lane, 2)
    rows = [b.add(math.warp_row0(b, ctx), b.add(g, 8 * i)) for i in range(2 * math.mt)]
    lane_col = b.cvt(S64, b.shl(t, 4))
    starts = []
    for r in rows:
        ok = b.setp("lt", b.bitcast(r, S32), valid_rows)
        addr, _ = q_row(b.add(ctx.m_start, r), ok)
        starts.append((b.add(addr, b.bitcast(lane_col, U64)), ok))

    def load(addr: Reg, off: int, ok: Reg) -> list[Reg]:
        words = zero_regs(b, 4)
        with b.predicate(ok):
            b.ld("global", B32, Addr(addr, off), vec=4, out=words, nc=True)
        return words

    def values(w: Reg) -> list[Reg]:          # a word's two elements as f32, low first
        return half_values(b, w, cfg.fmt)

    # pass 1: the row's largest |element| (bits order magnitudes), over the quad
    ups, scales = [], []
    for addr, ok in starts:
        top = quad_max_bits(b, (load(addr, 64 * j, ok) for j in range(chunks // 4)))
        k = e4m3_exponent(b, top, cfg.fmt)
        ups.append(pow2(b, k))
        scales.append(b.mul(pow2(b, k, negate=True), math.scale_log2))
    # pass 2: this warpgroup's chunks t + 4p + 8j, scaled, rounded to e4m3, stored
    part = b.shl(math.value_part(b, ctx), 2) if vs > 1 else b.mov(0, U32)
    q8 = b.add(t, part)                                   # q % 8 of every chunk this lane takes
    for (addr, ok), r, up in zip(starts, rows, ups):
        addr = b.add(addr, b.cvt(U64, b.shl(part, 4)))
        piece = b.add(b.shl(b.xor(b.shr(q8, 1), b.and_(b.shr(r, 1), 3)), 4), b.shl(b.and_(q8, 1), 3))
        dst = b.add(ctx.q_smem, b.mad(r, NARROW_SWIZZLE, piece))
        for j in range(chunks // (4 * vs)):
            vals = [b.mul(x, up) for w in load(addr, 16 * 4 * vs * j, ok) for x in values(w)]
            b.st("shared", B32, Addr(dst, j * cfg.block_m * NARROW_SWIZZLE), fp8.quantize(b, vals, "e4m3", target))
    return scales


__all__ = ["e4m3_exponent", "pow2", "quad_max_bits", "quantize_q_rows", "rescale_q_rows"]
