"""Family "decode": one query token per sequence attends over its KV cache (contiguous layout).

Work split (see docs/kernels.md): one CTA per (sequence, KV head, chunk of `heads_per_cta` query
heads of that KV head's GQA group), so each K/V row is loaded once for the whole chunk. Inside a
warp, `lanes_per_row` lanes share one KV row (each lane one or more 128-bit chunks of it) and the
warp's other lane groups ("row slots") take the next rows; each lane issues `kv_unroll` K and V
loads per iteration before using them. Each row slot keeps its own online-softmax state; the
states are merged across row slots with shuffles, then across warps through shared memory,
where all threads of the CTA cooperate to write O (and LSE) with 128-bit stores.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import SpecError
from ..ir import F32, S32, S64, U32, Addr, KernelBuilder, Reg
from ..spec.fields import Field, FamilyFields, int_range
from ..spec.model import KernelSpec
from ..targets import DEFAULT_SMEM_PER_CTA, Target
from . import common as C
from .base import Family, Interface, Launch, LaunchParam, ParamSource, Program, TensorInfo

_hd_check, _hd_allowed = int_range(16, 256, multiple_of=8)
FIELDS = FamilyFields(
    fields=(
        Field("head_dim", "int", "elements per head", check=_hd_check, allowed=_hd_allowed),
        Field("return_lse", "bool", "also write lse [batch, num_heads] (f32, natural log)",
              default=False),
    ),
    tile=(
        Field("num_warps", "int", "warps per CTA (default 4)", default=None, choices=(1, 2, 4, 8)),
        Field("kv_unroll", "int", "KV rows each lane loads per iteration (default: 4, or 2 when "
              "a CTA handles many query heads)", default=None, choices=(1, 2, 4, 8)),
    ),
)
MAX_HEAD_REGS = 32  # f32 registers per lane for the query chunk (same again for the accumulator): ~128 regs total


@dataclass(frozen=True)
class DecodeConfig:
    fmt: C.ElemFormat
    head_dim: int
    chunks: int            # 128-bit chunks per row
    lanes_per_row: int
    chunks_per_lane: int
    num_warps: int
    kv_unroll: int
    heads_per_cta: int
    group_size: int

    @property
    def rows_per_warp(self) -> int:
        return 32 // self.lanes_per_row

    @property
    def head_chunks(self) -> int:
        return self.group_size // self.heads_per_cta

    @property
    def ml_smem_bytes(self) -> int:
        """(m, l) per warp and head, padded so the accumulator region stays 16-byte aligned."""
        return -(-self.num_warps * self.heads_per_cta * 8 // 16) * 16

    @property
    def merge_smem_bytes(self) -> int:
        return self.ml_smem_bytes + self.num_warps * self.heads_per_cta * self.head_dim * 4


def validate(spec: KernelSpec) -> None:
    C.check_dtype_target(spec.dtype, spec.targets)


def configure(spec: KernelSpec, target: Target) -> DecodeConfig:
    fmt = C.FORMATS[spec.dtype]
    chunks = spec.head_dim // fmt.per_vec
    lpr = min(32, C.next_pow2(chunks))
    cpl = -(-chunks // lpr)
    per_head = cpl * fmt.per_vec
    tile = spec.tile_dict()
    nw = tile.get("num_warps") or 4
    cap = max(1, MAX_HEAD_REGS // per_head)
    hp = max(h for h in range(1, spec.group_size + 1) if spec.group_size % h == 0 and h <= cap
             and nw * h * (4 + spec.head_dim) * 4 <= DEFAULT_SMEM_PER_CTA)
    unroll = tile.get("kv_unroll") or (4 if hp * per_head <= 32 else 2)
    cfg = DecodeConfig(fmt, spec.head_dim, chunks, lpr, cpl, nw, unroll, hp, spec.group_size)
    if cfg.merge_smem_bytes > DEFAULT_SMEM_PER_CTA:
        raise SpecError(f"num_warps = {nw} needs {cfg.merge_smem_bytes} bytes of shared memory for "
                        f"the cross-warp merge; at most {DEFAULT_SMEM_PER_CTA}: use fewer warps",
                        key="tile.num_warps")
    return cfg


def resolve_tile(spec: KernelSpec, target: Target) -> dict:
    c = configure(spec, target)
    return {"num_warps": c.num_warps, "kv_unroll": c.kv_unroll, "heads_per_cta": c.heads_per_cta,
            "lanes_per_row": c.lanes_per_row}


def interface(spec: KernelSpec) -> Interface:
    d, H, Hk = spec.head_dim, spec.num_heads, spec.num_kv_heads
    tensors = [
        TensorInfo("q", spec.dtype, ("batch", H, d), "input"),
        TensorInfo("k_cache", spec.dtype, ("batch", "max_seq_len", Hk, d), "input"),
        TensorInfo("v_cache", spec.dtype, ("batch", "max_seq_len", Hk, d), "input"),
        TensorInfo("seq_lens", "i32", ("batch",), "input", "KV rows used per sequence (0 allowed; "
                   "clamped to max_seq_len)", device_resident_scalars=True),
        TensorInfo("o", spec.dtype, ("batch", H, d), "output"),
    ]
    if spec.opt("return_lse"):
        tensors.append(TensorInfo("lse", "f32", ("batch", H), "output",
                                  "log-sum-exp of the scaled scores; -inf for an empty sequence"))
    return Interface(tuple(tensors), ("batch", "max_seq_len"), {"batch": 3, "max_seq_len": 203})


_STRIDED = (("q", (0, 1)), ("k_cache", (0, 1, 2)), ("v_cache", (0, 1, 2)), ("o", (0, 1)))


def build(spec: KernelSpec, target: Target) -> Program:
    cfg = configure(spec, target)
    b = KernelBuilder(f"ptxc_{spec.name}")
    params: list[LaunchParam] = []

    def param(name, type, source):
        params.append(LaunchParam(name, type, source))
        return b.load_param(b.param(name, type))

    ptrs = {t.name: b.to_global(param(t.name, C.U64, ParamSource("pointer", tensor=t.name)))
            for t in interface(spec).tensors}
    strides = {(t, a): C.byte_stride(b, param(f"{t}_stride{a}", S64, ParamSource("stride", t, a)), cfg.fmt)
               for t, axes in _STRIDED for a in axes}
    max_len = param("max_seq_len", U32, ParamSource("dim", name="max_seq_len"))
    _emit_body(b, spec, cfg, ptrs, strides, max_len)
    b.ret()
    launch = Launch(entry=b.entry.name, params=tuple(params),
                    grid=(str(spec.num_kv_heads * cfg.head_chunks), "batch", "1"),
                    block=(cfg.num_warps * 32, 1, 1))
    return Program([b.entry], [launch], resolve_tile(spec, target))


def _emit_body(b: KernelBuilder, spec: KernelSpec, cfg: DecodeConfig, ptrs, strides, max_len) -> None:
    fmt, lpr, hp = cfg.fmt, cfg.lanes_per_row, cfg.heads_per_cta
    tid = b.special("%tid.x")
    lane, warp = b.and_(tid, 31), b.shr(tid, 5)
    slot, sub = b.shr(lane, lpr.bit_length() - 1), b.and_(lane, lpr - 1)
    batch, cx = b.special("%ctaid.y"), b.special("%ctaid.x")
    kv_head = b.div(cx, cfg.head_chunks) if cfg.head_chunks > 1 else cx
    head0 = b.mad(kv_head, cfg.group_size, b.mul(b.rem(cx, cfg.head_chunks), hp)) \
        if cfg.head_chunks > 1 else b.mul(kv_head, cfg.group_size)

    seq_len = b.ld("global", C.U32, Addr(C.element_offset(b, ptrs["seq_lens"], batch, b.mov(4, S64))))
    seq_len = b.min(b.bitcast(b.max(b.bitcast(seq_len, S32), 0), U32), max_len)

    # Per-lane chunk j covers elements [(sub + j*lpr) * per_vec, +per_vec); the last may be idle.
    lane_byte = b.cvt(S64, b.mul(sub, C.VEC_BYTES))
    last_chunk_ok = None
    if cfg.chunks % lpr:
        last_chunk_ok = b.setp("lt", sub, cfg.chunks - (cfg.chunks_per_lane - 1) * lpr)

    def chunk_pred(j: int, row_ok: Reg | None) -> Reg | None:
        ok = last_chunk_ok if j == cfg.chunks_per_lane - 1 else None
        if ok is None or row_ok is None:
            return ok or row_ok
        return b.and_(ok, row_ok)

    def row_base(t: str, head: Reg) -> Reg:
        """Address of this lane's first chunk in (batch, head) of tensor t; the head axis is 1
        for q/o ([batch, heads, d]) and 2 for the caches ([batch, seq, heads, d])."""
        head_axis = 1 if t in ("q", "o") else 2
        base = C.element_offset(b, ptrs[t], batch, strides[(t, 0)])
        return b.add(C.element_offset(b, b.bitcast(base, C.U64), head, strides[(t, head_axis)]),
                     lane_byte)

    # Query chunk per head, scaled so that scores come out in log2 units.
    qscale = spec.softmax_scale * C.LOG2E
    q_regs = []
    for i in range(hp):
        qb = row_base("q", b.add(head0, i))
        q_regs.append([[b.mul(x, qscale) for x in C.to_f32(b, fmt, C.load_vec(
            b, fmt, Addr(qb, j * lpr * C.VEC_BYTES), chunk_pred(j, None)))]
            for j in range(cfg.chunks_per_lane)])

    m = [b.mov(C.NEG_INF, F32) for _ in range(hp)]
    l = [b.mov(0.0, F32) for _ in range(hp)]
    acc = [[[b.mov(0.0, F32) for _ in range(fmt.per_vec)] for _ in range(cfg.chunks_per_lane)]
           for _ in range(hp)]
    kv_base = {t: row_base(t, kv_head) for t in ("k_cache", "v_cache")}
    rows_per_iter = cfg.num_warps * cfg.rows_per_warp * cfg.kv_unroll
    first_row = b.mad(warp, cfg.rows_per_warp * cfg.kv_unroll, slot)

    with b.for_range(0, seq_len, rows_per_iter) as it:
        rows = [b.add(it, b.add(first_row, u * cfg.rows_per_warp)) for u in range(cfg.kv_unroll)]
        valid = [b.setp("lt", r, seq_len) for r in rows]
        tiles = {}
        for t in ("k_cache", "v_cache"):  # issue every load before any use: loads in flight
            tiles[t] = [[C.load_vec(b, fmt, Addr(C.element_offset(b, kv_base[t], r, strides[(t, 1)]),
                                                 j * lpr * C.VEC_BYTES), chunk_pred(j, ok))
                         for j in range(cfg.chunks_per_lane)] for r, ok in zip(rows, valid)]
        scores = []  # [u][i]
        for u in range(cfg.kv_unroll):
            k = [C.to_f32(b, fmt, regs) for regs in tiles["k_cache"][u]]
            row_scores = []
            for i in range(hp):
                s = b.mov(0.0, F32)
                for j in range(cfg.chunks_per_lane):
                    for e in range(fmt.per_vec):
                        s = b.fma(q_regs[i][j][e], k[j][e], s)
                s = C.warp_sum(b, s, [lpr >> n for n in range(1, lpr.bit_length())])
                row_scores.append(b.selp(s, C.NEG_INF, valid[u]))
            scores.append(row_scores)
        v = [[C.to_f32(b, fmt, regs) for regs in tiles["v_cache"][u]] for u in range(cfg.kv_unroll)]
        for i in range(hp):
            m_new = m[i]
            for u in range(cfg.kv_unroll):
                m_new = b.max(m_new, scores[u][i])
            m_use = C.safe_max(b, m_new)
            alpha = C.rescale_factor(b, m[i], m_use)
            p = [b.ex2(b.sub(scores[u][i], m_use)) for u in range(cfg.kv_unroll)]
            psum = p[0]
            for x in p[1:]:
                psum = b.add(psum, x)
            b.mad(l[i], alpha, psum, out=l[i])
            for j in range(cfg.chunks_per_lane):
                for e in range(fmt.per_vec):
                    a = b.mul(acc[i][j][e], alpha, out=acc[i][j][e])
                    for u in range(cfg.kv_unroll):
                        b.fma(p[u], v[u][j][e], a, out=a)
            b.mov(m_new, out=m[i])

    # Merge row slots within the warp (lanes that differ in the slot bits).
    off = lpr
    while off < 32:
        for i in range(hp):
            flat = [x for ch in acc[i] for x in ch]
            C.merge_softmax_states(b, m[i], l[i], flat, b.shfl("bfly", m[i], off),
                                   b.shfl("bfly", l[i], off), [b.shfl("bfly", x, off) for x in flat])
        off *= 2
    _merge_warps_and_store(b, spec, cfg, m, l, acc, warp, slot, sub, tid, batch, head0, ptrs, strides)


def _merge_warps_and_store(b, spec, cfg, m, l, acc, warp, slot, sub, tid, batch, head0, ptrs, strides):
    fmt, d, hp, nw = cfg.fmt, cfg.head_dim, cfg.heads_per_cta, cfg.num_warps
    smem = b.address_of(b.shared("merge_smem", cfg.merge_smem_bytes))
    ml_base = b.mad(warp, hp * 8, smem)                      # [warp][head] -> (m, l)
    acc_base = b.mad(warp, hp * d * 4, b.add(smem, cfg.ml_smem_bytes))   # [warp][head][d]
    with b.if_then(b.setp("eq", slot, 0)):
        with b.if_then(b.setp("eq", sub, 0)):
            for i in range(hp):
                b.st("shared", F32, Addr(ml_base, i * 8), [m[i], l[i]])
        lane_off = b.mad(sub, fmt.per_vec * 4, acc_base)
        for j in range(cfg.chunks_per_lane):
            ok = b.setp("lt", sub, cfg.chunks - j * cfg.lanes_per_row) \
                if (j + 1) * cfg.lanes_per_row > cfg.chunks else None
            for i in range(hp):
                base = (i * d + j * cfg.lanes_per_row * fmt.per_vec) * 4
                vals = acc[i][j]
                if ok is None:
                    _store_f32_row(b, lane_off, base, vals)
                else:
                    with b.if_then(ok):
                        _store_f32_row(b, lane_off, base, vals)
    b.bar_sync(0)

    # Every thread takes 128-bit output chunks: (head i, chunk c) for i < hp, c < chunks.
    total, nthreads = hp * cfg.chunks, nw * 32
    acc_all = b.add(smem, cfg.ml_smem_bytes)
    for rnd in range(-(-total // nthreads)):
        item = b.add(tid, rnd * nthreads)
        with b.if_then(b.setp("lt", item, total)):
            i, c = b.div(item, cfg.chunks), b.rem(item, cfg.chunks)
            ms = [b.ld("shared", F32, Addr(b.mad(i, 8, smem), w * hp * 8)) for w in range(nw)]
            ls = [b.ld("shared", F32, Addr(b.mad(i, 8, smem), w * hp * 8 + 4)) for w in range(nw)]
            m_tot = ms[0]
            for x in ms[1:]:
                m_tot = b.max(m_tot, x)
            m_use = C.safe_max(b, m_tot)
            weights = [C.rescale_factor(b, x, m_use) for x in ms]
            l_tot = b.mul(ls[0], weights[0])
            for x, w in zip(ls[1:], weights[1:]):
                l_tot = b.fma(x, w, l_tot)
            has_keys = b.setp("gt", l_tot, 0.0)
            inv = b.selp(b.rcp(l_tot), 0.0, has_keys)
            elem = b.mad(i, d, b.mul(c, fmt.per_vec))
            src = b.mad(elem, 4, acc_all)
            out = [b.mov(0.0, F32) for _ in range(fmt.per_vec)]
            for w in range(nw):
                part = [x for q in range(fmt.per_vec // 4) for x in
                        b.ld("shared", F32, Addr(src, w * hp * d * 4 + q * 16), vec=4)]
                for e in range(fmt.per_vec):
                    b.fma(part[e], weights[w], out[e], out=out[e])
            out = [b.mul(x, inv) for x in out]
            head = b.add(head0, i)
            base = C.element_offset(b, ptrs["o"], batch, strides[("o", 0)])
            row = C.element_offset(b, b.bitcast(base, C.U64), head, strides[("o", 1)])
            dst = b.add(row, b.cvt(S64, b.mul(c, C.VEC_BYTES)))
            C.store_vec(b, fmt, Addr(dst), C.from_f32(b, fmt, out))
            if spec.opt("return_lse"):
                with b.if_then(b.setp("eq", c, 0)):
                    lse = b.mul(b.add(m_tot, b.lg2(l_tot)), C.LN2)
                    lse = b.selp(lse, C.NEG_INF, has_keys)
                    idx = b.mad(batch, spec.num_heads, head)
                    b.st("global", F32, Addr(C.element_offset(b, ptrs["lse"], idx, b.mov(4, S64))), [lse])


def _store_f32_row(b, lane_off, base, vals):
    for q in range(0, len(vals), 4):
        b.st("shared", F32, Addr(lane_off, base + q * 4), vals[q:q + 4])


def make_inputs(spec: KernelSpec, dims: dict[str, int], rng) -> dict:
    """Random q/k/v and ragged seq_lens cycling through full, 0, 1, an odd middle, 17."""
    import numpy as np

    from ..reference import round_to
    B, S = dims["batch"], dims["max_seq_len"]
    H, Hk, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    host = np.float32
    q, k, v = (round_to(rng.standard_normal(shape), spec.dtype).astype(host)
               for shape in ((B, H, d), (B, S, Hk, d), (B, S, Hk, d)))
    pattern = [S, 0, 1, max(1, (S * 5 // 9) | 1), 17]
    lens = np.array([min(pattern[i % len(pattern)], S) for i in range(B)], dtype=np.int32)
    return {"q": q, "k_cache": k, "v_cache": v, "seq_lens": lens}


def reference(spec: KernelSpec, inputs: dict, dtype: str | None = None) -> dict:
    from .. import reference as ref
    o, lse = ref.decode(inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["seq_lens"],
                        spec.softmax_scale, dtype=dtype)
    return {"o": o, "lse": lse} if spec.opt("return_lse") else {"o": o}


FAMILY = Family(name="decode", doc=__doc__.split("\n")[0], fields=FIELDS, validate=validate,
                interface=interface, build=build, resolve_tile=resolve_tile,
                make_inputs=make_inputs, reference=reference)
