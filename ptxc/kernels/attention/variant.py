"""The attention variant seam: which keys a query row sees, how a visible score is transformed,
and how a row's softmax is finished — each answered in one place, for every family that uses it
(prefill, decode, varlen; see /work/shared/notes/attention-variants.md and docs/kernels.md).

Coordinates are a sequence's own: a query at absolute position `pos` (0-based, bottom-right
aligned: the queries are the last q_len positions of a sequence of kv_len keys) sees the keys
[key_begin(pos), key_end(pos, kv_len)). Order of operations (docs/spec.md): score → soft-cap →
ALiBi → masks (causal, window, sequence end) → online softmax → P·V.

Scores reach `transform_scores` in the family's own units: `unit · s` where s = softmax_scale ·
q·k is the score of the spec (prefill/varlen keep raw q·k, unit = 1 / softmax_scale; decode
pre-scales q into log2 units, unit = log2 e), so a transform is written once for all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import SpecError
from ...ir import F32, S32, S64, U8, U32, U64, Addr, KernelBuilder, Reg
from ...spec.fields import Field, float_range, int_range
from .. import common as C
from ..base import ParamSource
from .softmax import log_sum_exp, normaliser, rescale_factor, safe_max

MAX_WINDOW = 1 << 30
_win_check, _win_allowed = int_range(1, MAX_WINDOW)
_hdv_check, _hdv_allowed = int_range(8, 512, multiple_of=8)


# the soft-cap c and 1 / c, times the softmax scale's log2(e) units, stay finite normal f32
_cap_check, _cap_allowed = float_range(1e-3, 1e6)


VARIANT_FIELDS = (
    Field("sliding_window", "int", "sliding-window attention: a query at position p sees key j "
          "iff p - j < sliding_window (the last W keys up to its own; needs causal)",
          default=None, check=_win_check, allowed=_win_allowed),
    Field("attention_chunk", "int", "chunked local attention (Llama 4's attention_chunk_size, "
          "FlashAttention-3's attention_chunk): a query at position p sees key j iff j >= C * "
          "floor(p / C) (its own chunk of C keys, up to its own position; needs causal)",
          default=None, check=_win_check, allowed=_win_allowed),
    Field("logits_soft_cap", "float", "soft-cap c: s <- c * tanh(s / c) after the softmax scale "
          "(Gemma 2: 50)", default=None, check=_cap_check, allowed=_cap_allowed),
    Field("head_dim_v", "int", "head size of V and O when it differs from Q/K's head_dim "
          "(DeepSeek-V3 prefill: 192 / 128); prefill and varlen, <= head_dim", default=None,
          check=_hdv_check, allowed=_hdv_allowed),
    Field("attention_sinks", "bool", "a runtime sinks [num_heads] f32 logit per query head joins "
          "every row's softmax denominator (gpt-oss)", default=False),
    Field("alibi", "bool", "a runtime alibi_slopes [num_heads] f32: s <- s - slope_h * |p - j| "
          "after the soft-cap", default=False),
)


def head_dim_v(spec) -> int:
    """V's and O's head size: head_dim_v, or head_dim when not given."""
    return spec_option(spec, "head_dim_v") or spec.head_dim


def validate_variant(spec, causal_option: bool = True, separate_v: bool = True) -> None:
    """Cross-key checks shared by the families: a window looks back from the query's own
    position, so prefill and varlen need causal = true (decode's query is the last position);
    head_dim_v must not exceed head_dim (O is staged in the Q tile), and only families with
    `separate_v` take it."""
    dv = spec_option(spec, "head_dim_v")
    if separate_v and (dv or spec.head_dim) > 256 and (dv or spec.head_dim) % 32:
        key = "head_dim_v" if dv else "head_dim"
        raise SpecError(f"{key} = {dv or spec.head_dim}: above 256 the value head is split over "
                        f"4 warps in multiples of 8, so it must be a multiple of 32", key=key)
    if dv is not None and dv != spec.head_dim:
        if not separate_v:
            raise SpecError(f"head_dim_v = {dv}: the {spec.family} family needs V's head size "
                            f"equal to head_dim ({spec.head_dim}); separate V head sizes are "
                            f"supported by prefill and varlen", key="head_dim_v")
        if dv > spec.head_dim:
            raise SpecError(f"head_dim_v = {dv} > head_dim = {spec.head_dim}: the value head "
                            f"may be at most the query/key head size", key="head_dim_v")
    window = spec_option(spec, "sliding_window")
    if window is not None and causal_option and not spec.opt("causal"):
        raise SpecError(f"sliding_window = {window} needs causal = true (the window is the last "
                        f"{window} keys up to the query's own position)", key="sliding_window")
    chunk = spec_option(spec, "attention_chunk")
    if chunk is not None and causal_option and not spec.opt("causal"):
        raise SpecError(f"attention_chunk = {chunk} needs causal = true (a query sees the keys of "
                        f"its own chunk of {chunk} up to its own position)", key="attention_chunk")


def spec_option(spec, key: str):
    return dict(spec.options).get(key)


def variant_reference_args(spec, inputs: dict | None = None) -> dict:
    """The keyword arguments of reference.attention for this spec's variant options
    (runtime tensors from `inputs`)."""
    inputs = inputs or {}
    return {"window": spec_option(spec, "sliding_window"),
            "chunk": spec_option(spec, "attention_chunk"),
            "soft_cap": spec_option(spec, "logits_soft_cap"),
            "sinks": inputs.get("sinks") if spec_option(spec, "attention_sinks") else None,
            "alibi_slopes": inputs.get("alibi_slopes") if spec_option(spec, "alibi") else None}


def variant_tensors(spec) -> list:
    """The runtime inputs of the spec's variant options (after the family's own tensors)."""
    from ..base import TensorInfo
    out = []
    if spec_option(spec, "attention_sinks"):
        out.append(TensorInfo("sinks", "f32", (spec.num_heads,), "input",
                              "one logit per query head, joins each row's softmax denominator"))
    if spec_option(spec, "alibi"):
        out.append(TensorInfo("alibi_slopes", "f32", (spec.num_heads,), "input",
                              "ALiBi slope per query head: s <- s - slope * |p - j|"))
    return out


def variant_inputs(spec, rng) -> dict:
    """Random sinks (natural-log logits around the scores' range) and ALiBi slopes (the
    BLOOM geometric series 2^(-8 (h + 1) / H), shuffled so heads differ in order)."""
    import numpy as np
    out = {}
    if spec_option(spec, "attention_sinks"):
        out["sinks"] = (rng.standard_normal(spec.num_heads) * 2.0).astype(np.float32)
    if spec_option(spec, "alibi"):
        h = rng.permutation(spec.num_heads)
        out["alibi_slopes"] = np.exp2(-8.0 * (h + 1) / spec.num_heads).astype(np.float32)
    return out


def variant_pointer_names(spec) -> list[str]:
    return [t.name for t in variant_tensors(spec)]


@dataclass(frozen=True)
class AttentionVariant:
    causal: bool
    window: int | None = None
    chunk: int | None = None  # attention_chunk: keys from the query's chunk start, C * floor(p / C)
    soft_cap: float | None = None
    sinks: bool = False
    alibi: bool = False
    mask: str | None = None   # custom_mask "tree" (draft keys by the tree's bits, not the
                              # diagonal) or "packed" (every key by the request's bits)

    @classmethod
    def from_spec(cls, spec) -> "AttentionVariant":
        return cls(causal=bool(spec_option(spec, "causal")), window=spec_option(spec, "sliding_window"),
                   chunk=spec_option(spec, "attention_chunk"), soft_cap=spec_option(spec, "logits_soft_cap"),
                   sinks=bool(spec_option(spec, "attention_sinks")), alibi=bool(spec_option(spec, "alibi")),
                   mask=None if spec_option(spec, "custom_mask") in (None, "none")
                   else spec_option(spec, "custom_mask"))

    @property
    def tree(self) -> bool:
        return self.mask == "tree"

    @property
    def bounded(self) -> bool:
        """Whether a query's keys start after key 0 (a sliding window or a chunk): the one
        lower bound `key_begin` gives, which every tile, row and page skip derives from."""
        return self.window is not None or self.chunk is not None

    @property
    def transforms(self) -> bool:
        return self.soft_cap is not None or self.alibi

    def key_end(self, b: KernelBuilder, pos: Reg, kv_len: Reg) -> Reg:
        """s32 end of the keys a query at position `pos` (s32) sees; may be <= 0 (sees none)."""
        if not self.causal or self.tree:   # a tree's draft rows may see later draft keys
            return kv_len
        return b.min(kv_len, b.add(pos, 1))

    def key_begin(self, b: KernelBuilder, pos: Reg) -> Reg | None:
        """s32 first key a query at position `pos` sees (may be < 0), or None: no lower bound.
        Non-decreasing in pos (the tile bounds below rely on it): window pos - W + 1, chunk
        C * floor(pos / C) (0 for pos < 0: such a row sees no key anyway), both: the later."""
        if not self.bounded:
            return None
        begin = None if self.window is None else b.sub(pos, self.window - 1)
        if self.chunk is not None:
            start = b.mul(b.div(b.bitcast(b.max(pos, 0), U32), self.chunk), self.chunk)
            start = b.bitcast(start, S32)
            begin = start if begin is None else b.max(begin, start)
        return begin

    def first_tile(self, b: KernelBuilder, first_pos: Reg, block: int) -> Reg | None:
        """u32 first KV tile of `block` keys that the query at `first_pos` (the tile's earliest
        position) can see: tiles before it are never read. None without a lower bound."""
        begin = self.key_begin(b, first_pos)
        if begin is None:
            return None
        return b.div(b.bitcast(b.max(begin, 0), U32), block)

    def first_unmasked_tile(self, b: KernelBuilder, last_pos: Reg, block: int) -> Reg | None:
        """u32 first tile wholly inside the window of the query at `last_pos` (the tile's
        latest position, whose window starts last): earlier visited tiles cross a window's left
        edge and run the mask. None without a lower bound."""
        begin = self.key_begin(b, last_pos)
        if begin is None:
            return None
        return b.div(b.add(b.bitcast(b.max(begin, 0), U32), block - 1), block)

    def transform_scores(self, b: KernelBuilder, scores: list, key0: Reg, unit: float = 1.0,
                         alibi_rows: list | None = None, cap: tuple[Reg, Reg] | None = None) -> None:
        """Per-score modifiers before the masks, in place on `unit`-scaled scores (see the
        module doc), in the documented order:
          soft-cap  x <- (c·unit) · tanh(x / (c·unit))
          ALiBi     x <- x - unit · slope · |p - j|
        For ALiBi, `scores` are rows of (score, k) pairs and `alibi_rows[r]` = (rel, neg_slope):
        rel (s32) = p - (the lane's key offset) - key0, so |p - j| = |rel - k|; neg_slope (f32)
        = -unit · slope of the row's head. `cap`: (c·unit, 1 / (c·unit)) as f32 registers where
        the unit is only known at run time (an FP8 cache's k_scale: MmaMath.fold_k_scale), made
        once before the loop, as the slopes are. Without an option: emits nothing."""
        if self.soft_cap is not None:
            c, inv = cap if cap is not None else (self.soft_cap * unit, 1.0 / (self.soft_cap * unit))
            for x in _flat([x for row in scores for x, _ in row] if self.alibi else scores):
                b.mul(b.tanh(b.mul(x, inv)), c, out=x)
        if self.alibi:
            for row, (rel, neg_slope) in zip(scores, alibi_rows):
                rel_f = b.cvt(F32, rel)
                for x, k in row:
                    dist = b.abs(b.sub(rel_f, float(k)) if k else rel_f)
                    b.fma(neg_slope, dist, x, out=x)
        return None


# custom_mask -> (bits tensor, byte-offset tensor, the bits tensor's size dim)
MASK_BUFFERS = {"tree": ("tree_mask", "tree_indptr", "tree_bytes"),
                "packed": ("custom_mask", "mask_indptr", "mask_bytes")}


def mask_bytes_param(spec, param) -> Reg | None:
    """The custom mask's bits-buffer size as a u32 kernel parameter (a dim the loaders take
    from the tensor's shape), after the family's other parameters; None without a mask."""
    mask = spec_option(spec, "custom_mask")
    if mask in (None, "none"):
        return None
    dim = MASK_BUFFERS[mask][2]
    return param(dim, U32, ParamSource("dim", name=dim))


class MaskPredicate:
    """The custom mask (custom_mask "tree" / "packed") as ONE predicate over logical (row, key),
    mixed into a family's tile context. bind_mask sets `mask_bits` (u64 first byte of the
    sequence's / batch entry's bits; the context's default None: no mask) and `mask_limit`; the
    context supplies `mask_rows(b)` (u32 rows n of the
    bit matrix), `mask_width(b)` (u32 bits per row), `mask_token(row)` (u32 bit-matrix row of a
    tile row) and `mask_shift(b)` (s32 key of column 0, or None for 0). A fragment layout calls
    mask_row once per row it holds, draft_key once per tile for its lane's first key, one
    mask_window per row per <= MASK_SPAN columns, then key_hidden per score. Bit (i, c) is bit
    (i*width + c) % 8 of byte (i*width + c) // 8 (little-endian); columns outside [0, width)
    are not the mask's (a tree's prefix keys: seen; keys past L: the key limit's)."""

    MASK_SPAN = 26   # columns one window serves: 26 bits at any bit offset fit 5 bytes
    mask_limit: Reg | None = None   # u32 bytes of the segment that may be read (bind_mask)

    def bind_mask(self, b: KernelBuilder, ptrs: dict, index: Reg, nbytes: Reg) -> None:
        """Point the predicate at segment `index` (sequence / batch entry): its bits start at
        byte *_indptr[index] of the `nbytes`-byte bits buffer. `ptxc run` checks the offsets
        on the host, but a launch on device memory (runtime.device, the C and Rust loaders)
        reads no device value first, so the kernel bounds every read itself: only bytes of the
        segment's ceil(rows * width / 8) that also lie inside the buffer are read. A corrupt
        offset reads as zero bits (keys hidden), never past the buffer."""
        bits, indptr, _ = MASK_BUFFERS[self.variant.mask]
        off = b.ld("global", S32, Addr(C.element_offset(b, ptrs[indptr], index, b.mov(4, S64))), nc=True)
        off = b.bitcast(b.max(off, 0), U32)
        self.mask_bits = b.add(ptrs[bits], b.cvt(U64, off))
        seg = b.shr(b.add(b.mul(self.mask_rows(b), self.mask_width(b)), 7), 3)
        self.mask_limit = b.min(seg, b.sub(b.max(nbytes, off), off))

    def mask_row(self, b: KernelBuilder, row: Reg):
        """Per-row state: (i * width (u32), the row holds a query (pred)), or None."""
        if self.mask_bits is None:
            return None
        return self.token_state(b, self.mask_token(row))

    def token_state(self, b: KernelBuilder, tok: Reg):
        """mask_row's state of bit-matrix row `tok` (u32)."""
        return b.mul(tok, self.mask_width(b)), b.setp("lt", tok, self.mask_rows(b))

    def draft_key(self, b: KernelBuilder, lane_key: Reg) -> Reg | None:
        """s32 mask column of key `lane_key` (s32), or None without a mask."""
        if self.mask_bits is None:
            return None
        shift = self.mask_shift(b)
        return lane_key if shift is None else b.sub(lane_key, shift)

    def mask_window(self, b: KernelBuilder, row_state, k: Reg, span: int) -> Reg:
        """u32 whose bit o is the row's bit of column k + o, 0 <= o < span <= MASK_SPAN (k s32,
        may be negative or past the row): the few bytes covering them, each read only when it
        lies inside the segment's readable bytes (mask_limit), shifted by the bit offset. Far
        fewer loads in flight than a byte per score (d128 spilled with those)."""
        base, row_ok = row_state
        s = b.add(b.bitcast(base, S32), k)
        first = b.shr(s, 3)                             # floor(s / 8): s may be negative
        lo = hi = None
        for m in range((7 + span - 1) // 8 + 1):
            at = b.bitcast(b.add(first, m) if m else first, U32)
            byte = b.mov(0, U32)
            with b.predicate(b.and_(row_ok, b.setp("lt", at, self.mask_limit))):
                b.ld("global", U8, Addr(b.add(self.mask_bits, b.cvt(U64, at))), nc=True, out=[byte])
            if m < 4:
                lo = byte if lo is None else b.or_(lo, b.shl(byte, 8 * m))
            else:
                hi = byte
        off = b.and_(b.bitcast(s, U32), 7)
        bits = b.shr(lo, off)
        if hi is not None:   # bit 32 of the bytes -> bit 32 - off (two shifts: never by 32)
            bits = b.or_(bits, b.shl(b.shl(hi, 1), b.sub(31, off)))
        return bits

    def key_hidden(self, b: KernelBuilder, bits: Reg, k: Reg, o: int) -> Reg:
        """THE predicate: pred, the mask hides column k + o (k s32) from the row whose
        mask_window(k) is `bits`."""
        col = b.bitcast(b.add(k, o) if o else k, U32)
        inside = b.setp("lt", col, self.mask_width(b))
        return b.and_(inside, b.setp("eq", b.and_(bits, 1 << o), 0))


def join_sink(b: KernelBuilder, m: Reg, total: Reg, sink: Reg) -> tuple[Reg, Reg, Reg]:
    """A row's softmax state (running max m and sum `total` of 2^(s - m), log2 units) with the
    sink logit (log2 units) joined to the denominator: returns (total', alpha, m') with
    total' = total · 2^(m - m') + 2^(sink - m') and alpha = 2^(m - m') the factor that O
    (accumulated against m) needs; m' = max(m, sink), 0 when both are -inf (no NaN)."""
    m_ref = safe_max(b, b.max(m, sink))
    alpha = rescale_factor(b, m, m_ref)
    return b.fma(total, alpha, b.ex2(b.sub(sink, m_ref))), alpha, m_ref


def load_head_f32(b: KernelBuilder, ptr: Reg, head: Reg) -> Reg:
    """ptr[head] of a [num_heads] f32 tensor (sinks, alibi_slopes)."""
    return b.ld("global", F32, Addr(b.add(ptr, b.mul_wide(head, 4))), nc=True)


def finish_rows(b: KernelBuilder, ctx, m: list[Reg], l: list[Reg], rows: list[Reg],
                lanes: tuple[int, ...], writer: Reg, lse_scale: float = C.LN2,
                seen: list | None = None) -> list[Reg]:
    """Reduce l over the row's lanes; return 1/l per row (0 for a row that saw no key) and, with
    return_lse, have the `writer` lanes store lse = (m + log2 l) * lse_scale for rows < seq_q
    (ln 2 gives the natural-log LSE; 1.0 keeps log2 units, as split-KV partials want). `seen`
    (a list) receives each row's predicate "lse is finite" (a key or a sink)."""
    invs = []
    for r, row in enumerate(rows):
        total = C.warp_sum(b, l[r], lanes)
        sink = ctx.sink_log2(b, row)
        m_ref = m[r]
        if sink is not None:   # the sink joins the denominator (attention_sinks)
            total, alpha, m_ref = join_sink(b, m[r], total, sink)
        inv, has_keys = normaliser(b, total, None if sink is None else alpha)
        invs.append(inv)
        if seen is not None:
            seen.append(has_keys)
        if ctx.lse is not None:
            lse = log_sum_exp(b, m_ref, total, has_keys, lse_scale)
            ok = b.and_(writer, b.setp("lt", row, ctx.seq_q))
            addr = ctx.lse_addr(b, row)
            with b.predicate(ok):
                b.st("global", F32, Addr(addr), [lse])
    return invs


def _flat(scores) -> list[Reg]:
    if isinstance(scores, Reg):
        return [scores]
    return [x for s in scores for x in _flat(s)]


__all__ = ["AttentionVariant", "MaskPredicate", "MASK_BUFFERS", "mask_bytes_param", "VARIANT_FIELDS",
           "validate_variant", "spec_option", "variant_reference_args", "variant_tensors", "variant_inputs", "join_sink", "head_dim_v",
           "finish_rows", "load_head_f32"]


WINDOW_REACH = 37   # keys beyond a sliding window / chunk in launch-test's default longest sequence


def default_seq_len(spec, base: int) -> int:
    """launch-test's default longest key sequence: `base` (small, odd), or with a sliding window
    W (or an attention chunk C) larger than it, W + 37 (C + 37) so that the longest row has
    keys outside its window (before its chunk) — the default shapes must reach every feature
    the spec enables; only that one row is long."""
    reach = [int(spec_option(spec, k)) + WINDOW_REACH for k in ("sliding_window", "attention_chunk")
             if spec_option(spec, k)]
    return max([base, *reach])
