"""Random mixed serving batches for the varlen family, and its fp64 reference.

The reference follows the contract literally, one sequence at a time: L = clamp(seq_lens[b], 0,
capacity), the q_len = cu[b+1] - cu[b] queries sit at positions L - q_len .. L - 1, and
query i sees key j iff j < L and (causal) j <= L - q_len + i; rows that see nothing give o = 0
and lse = -inf (ptxc/reference's `attention` with bottom-right alignment does exactly this).
"""

from __future__ import annotations

import numpy as np

# (kind, q_len rule, L rule) cycled over the batch; S is the cache capacity.
CASES = ("decode", "prefill", "chunk", "empty", "verify", "q_over_l", "no_keys", "full_cache")


def _case(kind: str, S: int, rng) -> tuple[int, int]:
    """(q_len, L) for one sequence of the given kind."""
    if kind == "decode":
        return 1, int(rng.integers(1, S + 1))
    if kind == "prefill":
        L = int(rng.integers(1, min(S, 37) + 1))
        return L, L
    if kind == "chunk":
        L = int(rng.integers(min(S, 3), S + 1))
        return int(rng.integers(1, max(2, min(L, 23)))), L
    if kind == "empty":
        return 0, int(rng.integers(0, S + 1))
    if kind == "verify":
        return 4, int(rng.integers(min(S, 4), S + 1))
    if kind == "q_over_l":
        L = int(rng.integers(0, min(S, 3) + 1))
        return L + 3, L
    if kind == "no_keys":
        return 2, 0
    return 3, S                                   # full_cache: L at the capacity


def mixed_batch(spec, dims: dict[str, int], rng, page_size: int) -> dict:
    from ..reference import round_to
    from .variant import head_dim_v
    B, H, Hk, d = dims["batch"], spec.num_heads, spec.num_kv_heads, spec.head_dim
    S = dims["max_pages_per_seq"] * page_size if page_size else dims["max_seq_len"]
    q_lens, lens = zip(*(_case(CASES[i % len(CASES)], S, rng) for i in range(B))) if B else ((), ())
    cu = np.concatenate([[0], np.cumsum(q_lens, dtype=np.int64)]).astype(np.int32)
    rows = (dims["num_pages"], page_size) if page_size else (B, S)
    rnd = lambda shape: round_to(rng.standard_normal(shape), spec.dtype).astype(np.float32)
    inputs = {"q": rnd((int(cu[-1]), H, d)), "cu_seqlens_q": cu,
              "seq_lens": np.array(lens, dtype=np.int32),
              "k_cache": rnd((*rows, Hk, d)), "v_cache": rnd((*rows, Hk, head_dim_v(spec)))}
    from .variant import variant_inputs
    inputs.update(variant_inputs(spec, rng))
    if page_size:
        from ..errors import InputError
        P, used = dims["max_pages_per_seq"], [-(-L // page_size) for L in lens]
        if dims["num_pages"] < sum(used):
            raise InputError(f"num_pages = {dims['num_pages']} < the {sum(used)} pages this batch uses")
        pages = iter(rng.permutation(dims["num_pages"])[:sum(used)].tolist())
        garbage = (-1, dims["num_pages"] + 7)
        inputs["block_table"] = np.array(
            [[next(pages) if p < used[b] else garbage[(b + p) % 2] for p in range(P)] for b in range(B)],
            dtype=np.int32).reshape(B, P)
    return inputs


def dense_sequence(inputs: dict, b: int, L: int, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Sequence b's first L K and V rows as [L, Hk, d]."""
    if not page_size:
        return inputs["k_cache"][b, :L], inputs["v_cache"][b, :L]
    pages = inputs["block_table"][b, :-(-L // page_size)]
    k, v = (np.concatenate([inputs[c][p] for p in pages], axis=0)[:L] if L else inputs[c][0, :0]
            for c in ("k_cache", "v_cache"))
    return k, v


def varlen_reference(spec, inputs: dict, dtype: str | None, page_size: int) -> dict:
    from .. import reference as ref
    from .variant import head_dim_v, variant_reference_args
    q, cu = np.asarray(inputs["q"], dtype=np.float64), np.asarray(inputs["cu_seqlens_q"])
    H, d = spec.num_heads, head_dim_v(spec)      # o's head size
    S = inputs["block_table"].shape[1] * page_size if page_size else inputs["k_cache"].shape[1]
    o = np.zeros((q.shape[0], H, d))
    lse = np.full((q.shape[0], H), -np.inf)
    for b, L in enumerate(np.asarray(inputs["seq_lens"])):
        lo, hi = int(cu[b]), int(cu[b + 1])
        L = int(min(max(int(L), 0), S))
        if hi <= lo:
            continue
        if L == 0:   # no keys: o = 0, lse = -inf (or the sink: e^sink alone is the denominator)
            if spec.opt("attention_sinks"):
                lse[lo:hi] = np.asarray(inputs["sinks"], dtype=np.float64)[None, :]
            continue
        k, v = dense_sequence(inputs, b, L, page_size)
        qs = np.swapaxes(q[lo:hi], 0, 1)[None]              # [1, H, q_len, d]
        kh, vh = (np.swapaxes(np.asarray(x, dtype=np.float64), 0, 1)[None] for x in (k, v))
        ob, lb = ref.attention(qs, kh, vh, spec.softmax_scale, causal=spec.opt("causal"), dtype=dtype,
                               **variant_reference_args(spec, inputs))
        o[lo:hi], lse[lo:hi] = np.swapaxes(ob[0], 0, 1), np.swapaxes(lb[0], 0, 1)
    return {"o": o, "lse": lse} if spec.opt("return_lse") else {"o": o}
