"""kv_append with a transform on the way into the cache: RoPE on the new keys (and the new
queries) and/or FP8 quantisation. The plain copy path stays in kv_append.py, untouched.

One CTA per (token, sequence), as for the copy (per token with index = "slot_mapping", rotating
at positions[token]). Work items are 8-element chunks: first every
(KV head, chunk) of K and V, then (rope) every (query head, chunk) of q. A chunk is loaded (16
or 32 bytes), widened to f32, rotated, divided by its scale and quantised (FP8: one 8-byte store)
or rounded back to the dtype.

RoPE at position p = the token's cache row, with c = cos_sin_cache[p, i], s = cos_sin_cache[p,
rotary_dim/2 + i] (vLLM's layout), pair index i and partner element:
    neox  element j < rd/2: x_j c - x_{j+rd/2} s;   rd/2 <= j < rd: x_j c + x_{j-rd/2} s   (i = j mod rd/2)
    gptj  element 2i: x_{2i} c - x_{2i+1} s;        element 2i+1: x_{2i+1} c + x_{2i} s
    j >= rotary_dim: unchanged.
Each product and the sum are separately rounded f32 operations (`.rn`: no contraction into an
fma), so a numpy float32 model reproduces the kernel bit for bit (the FP8 bytes are checked
exactly). Chunks that fall wholly on one side of rd (and rd/2 for neox) use vector loads of
their cos/sin and partner chunk; other rotary_dims go element by element. A token whose row is outside the cache or at/past max_position is skipped entirely:
no cache write, and q_rot gets its queries unrotated. Queries go to a separate `q_rot` output,
not back into `q`: neox partners cross chunks, so rotating in place would race between threads.
"""

from __future__ import annotations

from ...ir import B16, B32, F32, S64, U32, U64, Addr, KernelBuilder, Reg
from ...ir.values import U16
from ...spec.model import KernelSpec
from ...targets import Target
from .. import common as C
from ..base import Launch, LaunchParam, ParamSource, Program
from ..math import fp8
from .kv_access import CACHES, KVAccess
from .kv_rows import NewRows, by_slot, grid

CHUNK = 8            # elements per work item
MAX_THREADS = 256


def options(spec: KernelSpec) -> dict:
    """The transform options with their defaults (the decode family's fused append passes a
    spec without them)."""
    o = dict(spec.options)
    kv_dtype = o.get("kv_dtype") or spec.dtype
    fp8_kind = kv_dtype if kv_dtype in fp8.KINDS else None
    return {"kv_dtype": kv_dtype, "fp8": fp8_kind,
            "kv_scale": (o.get("kv_scale") or "tensor") if fp8_kind else None,
            "rope": o.get("rope"), "rotary_dim": o.get("rotary_dim") or spec.head_dim}


def geometry(spec: KernelSpec) -> tuple[int, int, int]:
    chunks = spec.head_dim // CHUNK
    kv_items = spec.num_kv_heads * chunks
    q_items = spec.num_heads * chunks if options(spec)["rope"] else 0
    threads = min(MAX_THREADS, -(-max(kv_items, q_items) // 32) * 32)
    return chunks, kv_items, threads


class Rope:
    """Per-token RoPE state: the cos/sin row of this token's position (f32, contiguous)."""

    def __init__(self, b: KernelBuilder, style: str, rotary_dim: int, cs_row: Reg):
        self.b, self.style, self.rd, self.half = b, style, rotary_dim, rotary_dim // 2
        self.row, self.four = cs_row, b.mov(4, S64)
        # Whole chunks fall on one side of every boundary (rd, and rd/2 for neox): rotate a
        # chunk with vector loads of its cos/sin (and partner chunk) instead of per element.
        self.by_chunk = (rotary_dim % 16 == 0) if style == "neox" else (rotary_dim % 8 == 0)

    def _cs(self, index: Reg, ok: Reg) -> tuple[Reg, Reg]:
        b = self.b
        cos, sin = b.mov(1.0, F32), b.mov(0.0, F32)
        with b.predicate(ok):
            b.ld("global", F32, Addr(C.element_offset(b, self.row, index, self.four)), nc=True, out=[cos])
            b.ld("global", F32, Addr(C.element_offset(b, self.row, b.add(index, self.half), self.four)),
                 nc=True, out=[sin])
        return cos, sin

    def _cs_vec(self, index: Reg, count: int, ok: Reg) -> tuple[list[Reg], list[Reg]]:
        """cos/sin of `count` (4 or 8) consecutive frequencies from `index` (16-byte aligned)."""
        b, f32 = self.b, C.FORMATS["f32"]
        out = []
        for base in (index, b.add(index, self.half)):
            addr = C.element_offset(b, self.row, base, self.four)
            out.append([v for off in range(0, 4 * count, C.VEC_BYTES)
                        for v in C.load_vec(b, f32, Addr(b.bitcast(addr, U64), off), ok)])
        return out[0], out[1]

    def rotate(self, vals: list[Reg], first: Reg, row_addr: Reg, fmt: C.ElemFormat,
               valid: Reg) -> list[Reg]:
        """Rotate the 8 f32 values of elements first..first+7 of a head row at `row_addr`
        (unchanged where `valid` is false)."""
        if self.by_chunk:
            return self._rotate_chunk(vals, first, row_addr, fmt, valid)
        b = self.b
        out = []
        for e, x in enumerate(vals):
            j = b.add(first, e)
            ok = b.and_(b.setp("lt", j, self.rd), valid)
            if self.style == "gptj":
                cos, sin = self._cs(b.shr(j, 1), ok)
                partner, negate = vals[e ^ 1], e % 2 == 0
                prod = b.mul_rn(partner, sin)
                term = b.neg(prod) if negate else prod
            else:
                low = b.setp("lt", j, self.half)
                index = b.selp(j, b.sub(j, self.half), low)
                cos, sin = self._cs(index, ok)
                partner = self._load_elem(b.selp(b.add(j, self.half), index, low), row_addr, fmt, ok)
                prod = b.mul_rn(partner, sin)
                term = b.selp(b.neg(prod), prod, low)
            out.append(b.selp(b.add_rn(b.mul_rn(x, cos), term), x, ok))
        return out

    def _rotate_chunk(self, vals, first, row_addr, fmt, valid) -> list[Reg]:
        """The same arithmetic as `rotate`, with the chunk's cos/sin and partners as vectors."""
        b = self.b
        ok = b.and_(b.setp("lt", first, self.rd), valid)
        if self.style == "gptj":
            cos, sin = self._cs_vec(b.shr(first, 1), 4, ok)
            terms = []
            for e in range(CHUNK):
                prod = b.mul_rn(vals[e ^ 1], sin[e // 2])
                terms.append(b.neg(prod) if e % 2 == 0 else prod)
            cos = [cos[e // 2] for e in range(CHUNK)]
        else:
            low = b.setp("lt", first, self.half)
            index = b.selp(first, b.sub(first, self.half), low)
            cos, sin = self._cs_vec(index, CHUNK, ok)
            partner_first = b.selp(b.add(first, self.half), index, low)
            addr = C.element_offset(b, row_addr, partner_first, b.mov(fmt.bytes, S64))
            regs = [r for off in range(0, CHUNK * fmt.bytes, C.VEC_BYTES)
                    for r in C.load_vec(b, fmt, Addr(b.bitcast(addr, U64), off), ok)]
            partners = C.to_f32(b, fmt, regs)
            terms = []
            for e in range(CHUNK):
                prod = b.mul_rn(partners[e], sin[e])
                terms.append(b.selp(b.neg(prod), prod, low))
        return [b.selp(b.add_rn(b.mul_rn(x, c), t), x, ok) for x, c, t in zip(vals, cos, terms)]

    def _load_elem(self, index: Reg, row_addr: Reg, fmt: C.ElemFormat, ok: Reg) -> Reg:
        b = self.b
        addr = C.element_offset(b, row_addr, index, b.mov(fmt.bytes, S64))
        if fmt.name == "f32":
            x = b.mov(0.0, F32)
            with b.predicate(ok):
                b.ld("global", F32, Addr(addr), nc=True, out=[x])
            return x
        h = b.mov(0, B16)
        with b.predicate(ok):
            b.ld("global", B16, Addr(addr), nc=True, out=[h])
        if fmt.name == "bf16":   # bf16 is the top half of an f32
            return b.bitcast(b.shl(b.cvt(U32, b.bitcast(h, U16)), 16), F32)
        return b.cvt(F32, b.bitcast(h, C.fmt_half(fmt)))


def load8(b: KernelBuilder, fmt: C.ElemFormat, addr: Reg) -> list[Reg]:
    regs = []
    for off in range(0, CHUNK * fmt.bytes, C.VEC_BYTES):
        regs += b.ld("global", fmt.load_type, Addr(addr, off), vec=4, nc=True)
    return C.to_f32(b, fmt, regs)


def store8(b: KernelBuilder, fmt: C.ElemFormat, addr: Reg, vals: list[Reg], target: Target) -> None:
    packed = C.from_f32(b, fmt, vals, target)
    for i, off in enumerate(range(0, CHUNK * fmt.bytes, C.VEC_BYTES)):
        C.store_vec(b, fmt, Addr(addr, off), packed[4 * i:4 * i + 4])


def layout_and_rope_params(b: KernelBuilder, kv: KVAccess, param, rope: bool) -> tuple:
    """The cache's stride and dim parameters with RoPE's between and after them - the
    parameter order of both transforming appends (kv_append's, mla_append): (the cos/sin row
    stride in bytes, max_position), None without RoPE."""
    kv.emit_strides(param)
    cs_stride = b.mul(param("cos_sin_cache_stride0", S64, ParamSource("stride", "cos_sin_cache", 0)), 4) \
        if rope else None
    kv.emit_dims(param)
    max_position = param("max_position", U32, ParamSource("dim", name="max_position")) if rope else None
    return cs_stride, max_position


def build(spec: KernelSpec, target: Target) -> Program:
    opts = options(spec)
    fmt = C.FORMATS[spec.dtype]
    kv_fmt = C.ElemFormat(opts["kv_dtype"], 1) if opts["fp8"] else fmt
    paged = dict(spec.options).get("kv_layout") == "paged"
    kv = KVAccess("paged" if paged else "contiguous", kv_fmt,
                  (dict(spec.options).get("page_size") or 16) if paged else 0, by_slot=by_slot(spec))
    chunks, kv_items, threads = geometry(spec)
    b = KernelBuilder(f"ptxc_{spec.name}")
    params: list[LaunchParam] = []

    param = C.param_loader(b, params)

    rope = opts["rope"]
    sources = ("k_new", "v_new") + (("q", "q_rot") if rope else ())
    extra = (["cos_sin_cache"] if rope else []) + (["k_scale", "v_scale"] if opts["kv_scale"] in ("head", "device") else [])
    index = ("slot_mapping", *(("positions",) if rope else ())) if kv.by_slot else ("positions",)
    ptrs = {t: b.to_global(param(t, U64, ParamSource("pointer", tensor=t)))
            for t in (*sources, *index, *kv.pointer_tensors(), *extra)}
    strides = {(t, a): C.byte_stride(b, param(f"{t}_stride{a}", S64, ParamSource("stride", t, a)), fmt)
               for t in sources for a in ((0, 1) if kv.by_slot else (0, 1, 2))}
    cs_stride, max_position = layout_and_rope_params(b, kv, param, bool(rope))
    scales = {}
    if opts["kv_scale"] == "tensor":
        scales = {t: param(f"{t[0]}_scale", F32, ParamSource("scalar", name=f"{t[0]}_scale")) for t in CACHES}

    tid, token = b.special("%tid.x"), b.special("%ctaid.x")
    rows = NewRows(b, kv, ptrs, token)
    valid, row = rows.valid, rows.row
    rot = None
    if rope:
        if kv.by_slot:   # the position is its own input; the slot only says where the row goes
            pos = b.ld("global", S64, Addr(C.element_offset(b, ptrs["positions"], token, b.mov(8, S64))))
            valid = b.and_(valid, b.and_(b.setp("ge", pos, 0), b.setp("lt", pos, b.cvt(S64, max_position))))
            position = b.cvt(U32, b.selp(pos, 0, valid))
        else:
            valid = b.and_(valid, b.setp("lt", row, max_position))
            position = b.selp(row, 0, valid)
        cs_row = C.element_offset(b, ptrs["cos_sin_cache"], position, cs_stride)
        rot = Rope(b, rope, opts["rotary_dim"], b.bitcast(cs_row, U64))

    def source_row(name: str, head: Reg) -> Reg:
        return b.bitcast(rows.source(name, head, strides), U64)

    with b.if_then(valid):
        for rnd in range(-(-kv_items // threads)):
            item = b.add(tid, rnd * threads)
            with b.if_then(b.setp("lt", item, kv_items)):
                kv_head, chunk = b.div(item, chunks), b.rem(item, chunks)
                first = b.mul(chunk, CHUNK)
                bases = kv.bases(b, ptrs, rows.batch, kv_head, b.cvt(S64, b.mul(chunk, CHUNK * kv_fmt.bytes)))
                page_cache = rows.page_cache()
                for t, src_name in zip(CACHES, ("k_new", "v_new")):
                    head_row = source_row(src_name, kv_head)
                    vals = load8(b, fmt, b.bitcast(b.add(b.bitcast(head_row, S64),
                                                          b.cvt(S64, b.mul(first, fmt.bytes))), U64))
                    if rot is not None and t == "k_cache":
                        vals = rot.rotate(vals, first, head_row, fmt, valid)
                    dst, ok = kv.row_address(b, bases, t, row, valid, page_cache)
                    with b.if_then(ok):
                        if opts["fp8"]:
                            scale = scales.get(t) or b.ld("global", F32, Addr(
                                ptrs[f"{t[0]}_scale"] if opts["kv_scale"] == "device" else
                                C.element_offset(b, ptrs[f"{t[0]}_scale"], kv_head, b.mov(4, S64))), nc=True)
                            words = fp8.quantize(b, [b.div(v, scale) for v in vals], opts["fp8"], target)
                            b.st("global", B32, Addr(dst), words)
                        else:
                            store8(b, fmt, dst, vals, target)
    if rope:   # every token's queries: rotated, or copied unchanged when the token is skipped
        q_items = spec.num_heads * chunks
        for rnd in range(-(-q_items // threads)):
            item = b.add(tid, rnd * threads)
            with b.if_then(b.setp("lt", item, q_items)):
                head, chunk = b.div(item, chunks), b.rem(item, chunks)
                offset = b.cvt(S64, b.mul(b.mul(chunk, CHUNK), fmt.bytes))
                q_row, out_row = source_row("q", head), source_row("q_rot", head)
                vals = load8(b, fmt, b.bitcast(b.add(b.bitcast(q_row, S64), offset), U64))
                vals = rot.rotate(vals, b.mul(chunk, CHUNK), q_row, fmt, valid)
                store8(b, fmt, b.bitcast(b.add(b.bitcast(out_row, S64), offset), U64), vals, target)
    b.ret()
    launch = Launch(entry=b.entry.name, params=tuple(params), grid=grid(spec), block=(threads, 1, 1))
    return Program([b.entry], [launch], {"threads": threads, "chunk_elems": CHUNK},
                   ptx_version=fp8.ptx_version(target) if opts["fp8"] else None)
