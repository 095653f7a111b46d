"""Random MLA decode batches and the fp64 reference (the family's contract, read literally).

A batch cycles through the serving cases of a decode step: q_len 0, 1, 2 and 4 (speculative
verification), L = 0, 1, 63, 64, 65 (a page's edges at FlashMLA's 64), at the capacity, random,
and q_len > L (rows that see nothing). Paged caches get shuffled pages and garbage ids (-1,
num_pages + 7) past each sequence's last page; every cache row no sequence owns - unused pages,
rows past L - holds NaN (FP8: the e4m3 NaN byte), which a kernel must never read.

Sparse top-k batches (sparse_batch) give each token its own slots: in-cache slots, -1,
duplicates, slots past the cache (just past and far past, and negative), and with topk_length
counts of 0, 1, N, past N and negative; every cache row no token's counted slots name holds NaN.
"""

from __future__ import annotations

import numpy as np

# (q_len, L): an int, "cap" (the capacity) or "any" (uniform in [1, capacity])
CASES = ((1, "any"), (0, "any"), (2, 63), (4, 64), (1, 65), (2, 0), (1, 1), (4, "cap"), (4, 2))
E4M3_NAN = 0x7F


def _length(rule, S: int, rng) -> int:
    if rule == "cap":
        return S
    if rule == "any":
        return int(rng.integers(1, S + 1)) if S else 0
    return min(rule, S)


def mla_batch(spec, view, dims: dict[str, int], rng, page_size: int, cases=CASES) -> dict:
    from ...reference import round_to
    B, H, d = dims["batch"], spec.num_heads, view.head_dim
    S = dims["max_pages_per_seq"] * page_size if page_size else dims["max_seq_len"]
    picked = [cases[i % len(cases)] for i in range(B)]
    q_lens = [q for q, _ in picked]
    lens = [_length(rule, S, rng) for _, rule in picked]
    cu = np.concatenate([[0], np.cumsum(q_lens, dtype=np.int64)]).astype(np.int32)
    rnd = lambda shape: round_to(rng.standard_normal(shape), spec.dtype).astype(np.float32)
    rows = (dims["num_pages"], page_size) if page_size else (B, S)
    cache = rnd((*rows, d))
    owned = np.zeros(rows, dtype=bool)
    inputs = {"q": rnd((int(cu[-1]), H, d)), "cu_seqlens_q": cu,
              "seq_lens": np.array(lens, dtype=np.int32)}
    if page_size:
        from .varlen_inputs import shuffled_block_table
        table = shuffled_block_table(lens, dims, page_size, rng)
        for b, L in enumerate(lens):
            for r in range(L):
                owned[table[b, r // page_size], r % page_size] = True
        inputs["block_table"] = table
    else:
        for b, L in enumerate(lens):
            owned[b, :L] = True
    return with_cache(view, inputs, cache, owned)


def with_cache(view, inputs: dict, cache: np.ndarray, owned: np.ndarray) -> dict:
    """inputs + the latent cache (FP8: the bytes a quantising append wrote, over the latent's
    one scale, and k_scale; e4m3_ds: the rows the append writes, group scales inside); every
    row not `owned` is NaN (e4m3: the NaN byte; e4m3_ds: NaN bytes, scales and RoPE)."""
    from ...reference import fp8_quantize
    from ..kv import kv_fp8
    kind, rows = kv_fp8.kind(view), kv_fp8.group_scaled(view)
    if rows:
        cache = ds_encode(rows, cache[..., :rows.rank], cache[..., rows.rank:])
        cache[~owned] = ds_pack(rows, np.full(rows.rank, E4M3_NAN, np.uint8),
                                np.full(rows.groups, np.nan, np.float32), np.full(rows.rope, np.nan))
    elif kind:
        scale = np.float32(0.37)
        cache = fp8_quantize(cache / scale, kind)
        cache[~owned] = E4M3_NAN
        inputs["k_scale"] = scale if kv_fp8.scale_mode(view) == "tensor" else np.array([scale])
    else:
        cache[~owned] = np.nan
    inputs["kv_cache"] = cache
    return inputs


def latent_kv(view, inputs: dict) -> tuple[np.ndarray, np.ndarray]:
    """fp64 (K, V) views of the latent cache with a unit head axis: K = the dequantised row,
    V = its first kv_lora_rank columns."""
    from ...reference import fp8_decode
    from ..kv import kv_fp8
    from ..attention.variant import head_dim_v
    kv = np.asarray(inputs["kv_cache"])
    kind, rows = kv_fp8.kind(view), kv_fp8.group_scaled(view)
    if rows:
        kv = ds_decode(rows, kv)
    else:
        kv = fp8_decode(kv, kind) * float(np.asarray(inputs["k_scale"]).reshape(-1)[0]) if kind \
            else kv.astype(np.float64)
    return kv[..., None, :], kv[..., None, :head_dim_v(view)]


# ---- e4m3_ds rows (kv_fp8.GroupScaledRows: FlashMLA's / vLLM's fp8_ds_mla) --------------------
FLT_MIN = np.float32(np.finfo(np.float32).tiny)


def ds_pack(rows, codes: np.ndarray, scales: np.ndarray, rope: np.ndarray) -> np.ndarray:
    """Row bytes from e4m3 codes [.., rank], f32 group scales [.., groups] and RoPE values
    [.., rope] (rounded to bf16 as cvt.rn.bf16x2.f32 does: NaN -> the canonical 0x7FFF),
    little-endian as the device stores them."""
    from ...reference import f32_to_bf16_bits
    lead = codes.shape[:-1]
    rope = np.asarray(rope, np.float32)
    pe_bits = np.where(np.isnan(rope), np.uint16(0x7FFF), f32_to_bf16_bits(rope)).astype("<u2")
    out = np.zeros(lead + (rows.row_bytes,), np.uint8)
    out[..., :rows.rank] = codes
    out[..., rows.scales_at:rows.rope_at] = np.ascontiguousarray(
        np.asarray(scales, "<f4")).view(np.uint8).reshape(lead + (4 * rows.groups,))
    out[..., rows.rope_at:] = np.ascontiguousarray(pe_bits).view(np.uint8).reshape(lead + (2 * rows.rope,))
    return out


def ds_encode(rows, latent: np.ndarray, rope: np.ndarray) -> np.ndarray:
    """What the quantising append writes (vLLM's concat_and_cache_ds_mla, replayed in f32):
    per 128-column group scale = max(amax / 448, FLT_MIN) (NaN ignored by the max, as fmaxf
    does), codes = satfinite RNE e4m3 of x / scale; RoPE in bf16."""
    from ...reference import fp8_quantize
    x = np.asarray(latent, np.float32)
    groups = x.reshape(x.shape[:-1] + (rows.groups, rows.group))
    with np.errstate(invalid="ignore"):
        amax = np.nanmax(np.abs(groups), axis=-1, initial=np.float32(0)).astype(np.float32)
        scale = np.maximum(amax / np.float32(448.0), FLT_MIN).astype(np.float32)
        codes = fp8_quantize((groups / scale[..., None]).astype(np.float32), "e4m3")
    return ds_pack(rows, codes.reshape(x.shape), scale, rope)


def ds_fields(rows, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes [.., rank], f32 scales [.., groups], RoPE bf16 bits [.., rope]) of row bytes."""
    raw = np.asarray(raw, np.uint8)
    lead = raw.shape[:-1]
    scales = np.ascontiguousarray(raw[..., rows.scales_at:rows.rope_at]).view("<f4").reshape(lead + (rows.groups,))
    rope = np.ascontiguousarray(raw[..., rows.rope_at:]).view("<u2").reshape(lead + (rows.rope,))
    return raw[..., :rows.rank], scales.astype(np.float32), rope


def ds_decode(rows, raw: np.ndarray) -> np.ndarray:
    """fp64 K rows as the kernel dequantises them: f32(e4m3 x group scale) rounded to bf16 once
    (kv_fp8_stage.FP8Staging), then the bf16 RoPE values."""
    from ...reference import bf16_bits_to_f32, fp8_decode, round_to
    codes, scales, rope = ds_fields(rows, raw)
    with np.errstate(invalid="ignore", over="ignore"):
        lat = fp8_decode(codes, "e4m3").astype(np.float32) * np.repeat(scales, rows.group, axis=-1)
    return np.concatenate([round_to(lat.astype(np.float32), "bf16"),
                           bf16_bits_to_f32(rope).astype(np.float64)], axis=-1)


def mla_reference(view, inputs: dict, dtype: str | None, page_size: int) -> dict:
    from ...reference import quantize_rows_e4m3
    from ..attention.variant import spec_option
    from ..kv.kv_access import sparse_keys
    from .varlen_inputs import varlen_reference
    k, v = latent_kv(view, inputs)
    if spec_option(view, "qk_products") == "e4m3":   # the scores' products see e4m3 queries
        inputs = {**inputs, "q": quantize_rows_e4m3(inputs["q"])}
    if sparse_keys(view):
        return sparse_reference(view, inputs, k, v, dtype)
    return varlen_reference(view, {**inputs, "k_cache": k, "v_cache": v}, dtype, page_size)


def token_slots(view, inputs: dict, t: int) -> np.ndarray:
    """The cache slots token t reads, in order: its first topk_length entries (clamped to
    [0, N]), without -1 and slots outside the cache; duplicates count as often as they appear."""
    from ..kv.kv_access import sparse_keys
    idx = np.asarray(inputs["indices"], dtype=np.int64)[t]
    n = sparse_keys(view)
    if "topk_length" in inputs:
        n = min(max(int(np.asarray(inputs["topk_length"])[t]), 0), n)
    slots = idx[:n]
    cap = np.asarray(inputs["kv_cache"]).shape[0] * np.asarray(inputs["kv_cache"]).shape[1]
    return slots[(slots >= 0) & (slots < cap)]


def sparse_reference(view, inputs: dict, k: np.ndarray, v: np.ndarray, dtype: str | None) -> dict:
    """Each token attends to its own slots (no causal rule: the indexer chose them)."""
    from ... import reference as ref
    from ..attention.variant import head_dim_v
    q = np.asarray(inputs["q"], dtype=np.float64)
    kf, vf = k.reshape(-1, 1, k.shape[-1]), v.reshape(-1, 1, v.shape[-1])
    o = np.zeros((q.shape[0], view.num_heads, head_dim_v(view)))
    lse = np.full((q.shape[0], view.num_heads), -np.inf)
    for t in range(q.shape[0]):
        slots = token_slots(view, inputs, t)
        if not slots.size:
            continue
        qs = np.swapaxes(q[t:t + 1], 0, 1)[None]                       # [1, H, 1, d]
        kh, vh = (np.swapaxes(x[slots], 0, 1)[None] for x in (kf, vf))  # [1, 1, n, d]
        ob, lb = ref.attention(qs, kh, vh, view.softmax_scale, causal=False, dtype=dtype)
        o[t], lse[t] = ob[0, :, 0], lb[0, :, 0]
    return {"o": o, "lse": lse} if view.opt("return_lse") else {"o": o}


def sparse_batch(spec, view, dims: dict[str, int], rng, page_size: int) -> dict:
    """total_q tokens, each with N slots drawn from the cache plus -1, duplicates and slots
    outside it; topk_length (if the spec takes it) cycles 0, 1, N, N + 5, -3 and random."""
    from ...reference import round_to
    from ..kv.kv_access import sparse_keys
    T, H, d, N = dims["total_q"], spec.num_heads, view.head_dim, sparse_keys(view)
    cap = dims["num_pages"] * page_size
    rnd = lambda shape: round_to(rng.standard_normal(shape), spec.dtype).astype(np.float32)
    idx = rng.integers(0, max(cap, 1), (T, N)).astype(np.int64) if cap else np.full((T, N), -1)
    for t in range(T):
        for j in range(N):
            pick = (t * 7 + j * 3) % 11
            if pick == 0:
                idx[t, j] = -1
            elif pick == 1 and j:
                idx[t, j] = idx[t, j - 1]                              # duplicate
            elif pick == 2:
                idx[t, j] = (cap, cap + 3, 1 << 30, -5)[(t + j) % 4]   # outside the cache
    inputs = {"q": rnd((T, H, d)), "indices": idx.astype(np.int32)}
    if view.opt("topk_length"):
        inputs["topk_length"] = np.array([(0, 1, N, N + 5, -3, int(rng.integers(0, N + 1)))[t % 6]
                                          for t in range(T)], dtype=np.int32)
    cache = rnd((dims["num_pages"], page_size, d))
    owned = np.zeros(cap, dtype=bool)
    for t in range(T):
        owned[token_slots(view, {**inputs, "kv_cache": cache}, t)] = True
    return with_cache(view, inputs, cache, owned.reshape(dims["num_pages"], page_size))


# ---- mla_append -------------------------------------------------------------------------------
def append_inputs(spec, dims: dict[str, int], rng, page_size: int) -> dict:
    """A step's new latent rows at distinct slots of a cache of random bytes/values, with
    padding (-1), a slot one past the cache and one far past; e4m3 adds a zero row (amax 0),
    +inf, NaN and values that saturate; RoPE adds positions in range, at max_position and
    negative (those tokens are skipped)."""
    from ...reference import round_to
    from ..kv import kv_fp8
    rank, rope_d = spec.opt("kv_lora_rank"), spec.opt("qk_rope_head_dim")
    T, total = dims["num_tokens"], dims["num_pages"] * page_size
    rnd = lambda shape: round_to(rng.standard_normal(shape), spec.dtype).astype(np.float32)
    inputs = {"kv_c": rnd((T, rank)), "k_pe": rnd((T, rope_d))}
    slots = np.full(T, -1, np.int64)
    taken = rng.permutation(total)[:T]
    slots[:taken.size] = taken
    for i, bad in zip(range(2, T, 4), (-1, total, 1 << 40)):
        slots[i] = bad
    inputs["slot_mapping"] = slots
    rows = (dims["num_pages"], page_size, kv_fp8.row_elems(spec))
    if kv_fp8.kind(spec):
        inputs["kv_cache"] = rng.integers(0, 256, rows, dtype=np.uint8)
        scale = np.float32(3.1 / 448 * 8)
        if kv_fp8.scale_mode(spec) in ("tensor", "device"):
            inputs["k_scale"] = scale if kv_fp8.scale_mode(spec) == "tensor" else np.array([scale])
        else:   # e4m3_ds groups: NaN among finite values, tiny values (the FLT_MIN scale floor)
            inputs["kv_c"][0, 130] = np.nan
            inputs["kv_c"][0, 384:392] = ref_round(np.float32(3e-39) * np.arange(1, 9), spec.dtype)
            inputs["kv_c"][0, 392:512] = 0.0
            if T > 4:
                inputs["kv_c"][4, 256:384] = ref_round(inputs["kv_c"][4, 256:384] * 1e-30, spec.dtype)
        if T > 1:
            inputs["kv_c"][1] = 0.0                                # amax 0: zero bytes
        inputs["kv_c"][0, :4] = [np.inf, np.nan, 1e4, -1e4]        # -> 448, NaN, +-448
        inputs["k_pe"][0, :2] = [-np.inf, np.nan]
    else:
        inputs["kv_cache"] = rnd(rows)
    if spec.opt("rope"):
        from ..kv.kv_transform_ref import rope_cos_sin_cache
        top = dims["max_position"]
        pos = rng.integers(0, top, T).astype(np.int64)
        pos[1:T:5] = top
        pos[3:T:5] = -3
        inputs["positions"] = pos
        inputs["cos_sin_cache"] = rope_cos_sin_cache(top, rope_d)
    return inputs


def ref_round(x, dtype: str) -> np.ndarray:
    from ...reference import round_to
    return round_to(x, dtype).astype(np.float32)


def append_destinations(spec, inputs: dict, page_size: int):
    """(token, page, offset) of every latent row the append writes: its slot inside the cache
    and, with RoPE, its position inside the cos/sin cache (padding and the rest are skipped)."""
    total = np.asarray(inputs["kv_cache"]).shape[0] * page_size
    cs, pos = inputs.get("cos_sin_cache"), inputs.get("positions")
    for t, slot in enumerate(np.asarray(inputs["slot_mapping"]).tolist()):
        if 0 <= slot < total and (not spec.opt("rope") or 0 <= int(pos[t]) < cs.shape[0]):
            yield t, slot // page_size, slot % page_size


def append_reference(spec, inputs: dict, page_size: int) -> dict:
    """The cache after the append, replaying the kernel's arithmetic in numpy float32 (RoPE's
    products and sums each rounded, x / k_scale as an f32 division, then satfinite RNE e4m3 or
    RNE to the dtype; e4m3_ds: ds_encode): exact, so the tests compare bytes. Untouched rows
    keep their input."""
    from ...reference import fp8_quantize, round_to
    from ..kv import kv_fp8
    from ..kv.kv_transform_ref import rotate
    kind, style = kv_fp8.kind(spec), spec.opt("rope")
    rd = spec.opt("qk_rope_head_dim")
    out = np.array(inputs["kv_cache"], dtype=np.uint8 if kind else np.float64)
    cs = inputs.get("cos_sin_cache")
    for t, page, offset in append_destinations(spec, inputs, page_size):
        pe = np.asarray(inputs["k_pe"][t], np.float32)
        if style:
            p = int(inputs["positions"][t])
            pe = rotate(pe, cs[p, :rd // 2], cs[p, rd // 2:rd], style, rd)
        row = np.concatenate([np.asarray(inputs["kv_c"][t], np.float32), pe])
        rows = kv_fp8.group_scaled(spec)
        if rows:
            out[page, offset] = ds_encode(rows, row[:rows.rank], pe)
        elif kind:
            scale = np.float32(np.asarray(inputs["k_scale"]).reshape(-1)[0])
            out[page, offset] = fp8_quantize(row / scale, kind)
        else:
            out[page, offset] = round_to(row.astype(np.float64), spec.dtype)
    return {"kv_cache": out}


__all__ = ["CASES", "mla_batch", "mla_reference", "latent_kv", "append_inputs", "append_destinations",
           "append_reference"]
