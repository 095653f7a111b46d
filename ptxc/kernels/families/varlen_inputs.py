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
# custom_mask = "tree" adds draft-tree verifications of these sizes (n tokens over L >= n keys)
TREE_CASES = ("tree", "tree", "tree")
TREE_SIZES = (2, 5, 16)


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
    if kind == "tree":
        n = min(int(rng.choice(TREE_SIZES)), S)
        return n, int(rng.integers(n, S + 1))
    return 3, S                                   # full_cache: L at the capacity


def mixed_batch(spec, dims: dict[str, int], rng, page_size: int) -> dict:
    from ...reference import round_to
    from ..attention.variant import head_dim_v
    B, H, Hk, d = dims["batch"], spec.num_heads, spec.num_kv_heads, spec.head_dim
    S = dims["max_pages_per_seq"] * page_size if page_size else dims["max_seq_len"]
    cases = CASES + TREE_CASES if spec.opt("custom_mask") == "tree" else CASES
    q_lens, lens = zip(*(_case(cases[i % len(cases)], S, rng) for i in range(B))) if B else ((), ())
    cu = np.concatenate([[0], np.cumsum(q_lens, dtype=np.int64)]).astype(np.int32)
    rows = (dims["num_pages"], page_size) if page_size else (B, S)
    rnd = lambda shape: round_to(rng.standard_normal(shape), spec.dtype).astype(np.float32)
    inputs = {"q": rnd((int(cu[-1]), H, d)), "cu_seqlens_q": cu,
              "seq_lens": np.array(lens, dtype=np.int32),
              "k_cache": rnd((*rows, Hk, d)), "v_cache": rnd((*rows, Hk, head_dim_v(spec)))}
    from ..attention.variant import variant_inputs
    inputs.update(variant_inputs(spec, rng))
    if spec.opt("custom_mask") == "tree":
        inputs.update(tree_inputs([int(n) for n in q_lens], rng))
    if spec.opt("custom_mask") == "packed":
        inputs.update(packed_inputs([int(n) for n in q_lens], [int(L) for L in lens], rng))
    if page_size:
        inputs["block_table"] = shuffled_block_table(lens, dims, page_size, rng)
    return inputs


def unread(spec, inputs: dict) -> dict:
    """The cache rows no query of the batch reads (attention/unread_rows.py); a sequence's
    first query sits at L - q_len."""
    from ..attention.unread_rows import unread_cache_rows
    q_lens = np.diff(np.asarray(inputs["cu_seqlens_q"], np.int64)).tolist()
    return unread_cache_rows(spec, inputs, lambda b, L: L - q_lens[b] if q_lens[b] > 0 else None)


def shuffled_block_table(lens, dims: dict[str, int], page_size: int, rng) -> np.ndarray:
    """[batch, max_pages_per_seq] i32: each sequence's pages drawn from a shuffle of the cache,
    then garbage ids (-1, num_pages + 7) past its last page, which must never be read."""
    from ...errors import InputError
    B, P, used = len(lens), dims["max_pages_per_seq"], [-(-L // page_size) for L in lens]
    if dims["num_pages"] < sum(used):
        raise InputError(f"num_pages = {dims['num_pages']} < the {sum(used)} pages this batch uses")
    pages = iter(rng.permutation(dims["num_pages"])[:sum(used)].tolist())
    garbage = (-1, dims["num_pages"] + 7)
    return np.array([[next(pages) if p < used[b] else garbage[(b + p) % 2] for p in range(P)]
                     for b in range(B)], dtype=np.int32).reshape(B, P)


TREE_SHAPES = ("chain", "star", "binary", "random")


def draft_tree(n: int, shape: str, rng) -> np.ndarray:
    """The n x n ancestor matrix (bool, row i = the draft tokens query i sees: its ancestors
    and itself) of a draft tree of the given shape; parents come before children."""
    parent = [-1] * n
    for k in range(1, n):
        parent[k] = {"chain": k - 1, "star": 0, "binary": (k - 1) // 2}.get(shape) \
            if shape != "random" else int(rng.integers(0, k))
    bits = np.zeros((n, n), dtype=bool)
    for i in range(n):
        k = i
        while k >= 0:
            bits[i, k] = True
            k = parent[k]
    return bits


def pack_bits(matrices: list[np.ndarray], rng=None, gap: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(mask bytes, indptr [len + 1]) of bit matrices laid out row-major, little-endian bit
    order (FlashInfer's segment_packbits); with `rng`, up to `gap` unused bytes after each."""
    chunks, indptr = [], [0]
    for m in matrices:
        seg = np.packbits(np.asarray(m, dtype=bool).ravel(), bitorder="little")
        if rng is not None and gap:
            seg = np.concatenate([seg, rng.integers(0, 256, int(rng.integers(0, gap + 1)), dtype=np.uint8)])
        chunks.append(seg.astype(np.uint8))
        indptr.append(indptr[-1] + seg.size)
    data = np.concatenate(chunks) if chunks else np.zeros(0, np.uint8)
    return (data if data.size else np.zeros(1, np.uint8)), np.array(indptr, dtype=np.int32)


def tree_inputs(q_lens: list[int], rng, shapes=None) -> dict:
    """tree_mask / tree_indptr for a batch: sequence b draws a tree of q_lens[b] tokens, its
    shape cycling through TREE_SHAPES (or `shapes[b]`); segments get a few spare bytes."""
    trees = [draft_tree(n, (shapes or TREE_SHAPES)[b % len(shapes or TREE_SHAPES)], rng)
             for b, n in enumerate(q_lens)]
    data, indptr = pack_bits(trees, rng, gap=2)
    return {"tree_mask": data, "tree_indptr": indptr}


PACKED_KINDS = ("random", "zero_rows", "zero_tiles", "ones", "sparse")


def random_mask(n: int, L: int, kind: str, rng) -> np.ndarray:
    """A bool [n, L] request mask: random bits, some rows all zero, keys [16, 48) and [64, 128)
    hidden from every row (whole KV tiles without a visible key), all ones, or 1-in-8 bits."""
    if kind == "ones":
        return np.ones((n, L), dtype=bool)
    bits = rng.random((n, L)) < (0.125 if kind == "sparse" else 0.5)
    if kind == "zero_rows":
        bits[rng.random(n) < 0.4] = False
    if kind == "zero_tiles":
        bits[:, 16:48] = False
        bits[:, 64:128] = False
    return bits


def packed_inputs(q_lens: list[int], lens: list[int], rng, kinds=None) -> dict:
    """custom_mask / mask_indptr for a batch: sequence b's q_len x L bits of kind
    PACKED_KINDS[b % 5] (or `kinds[b]`); segments get a few spare bytes."""
    kinds = kinds or PACKED_KINDS
    data, indptr = pack_bits([random_mask(n, L, kinds[b % len(kinds)], rng)
                              for b, (n, L) in enumerate(zip(q_lens, lens))], rng, gap=2)
    return {"custom_mask": data, "mask_indptr": indptr}


def packed_visible(inputs: dict, b: int, n: int, L: int) -> np.ndarray:
    """bool [n, L]: query i of sequence b sees key j iff bit i*L + j of its segment is set."""
    data, off = np.asarray(inputs["custom_mask"]), int(np.asarray(inputs["mask_indptr"])[b])
    nbits = n * L
    seg = np.unpackbits(data[off:off + (nbits + 7) // 8], bitorder="little")[:nbits]
    return seg.astype(bool).reshape(n, L)


def tree_visible(inputs: dict, b: int, n: int, L: int) -> np.ndarray:
    """bool [n, L]: query i of sequence b sees key j (prefix keys, and the draft keys its tree
    bits set), read from the bytes exactly as the kernel reads them."""
    data, off = np.asarray(inputs["tree_mask"]), int(np.asarray(inputs["tree_indptr"])[b])
    vis = np.zeros((n, L), dtype=bool)
    for i in range(n):
        for j in range(L):
            k = j - (L - n)
            if k < 0:
                vis[i, j] = True
            else:
                idx = i * n + k
                vis[i, j] = bool((int(data[off + idx // 8]) >> (idx % 8)) & 1)
    return vis


def dense_sequence(inputs: dict, b: int, L: int, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Sequence b's first L K and V rows as [L, Hk, d]."""
    if not page_size:
        return inputs["k_cache"][b, :L], inputs["v_cache"][b, :L]
    pages = inputs["block_table"][b, :-(-L // page_size)]
    k, v = (np.concatenate([inputs[c][p] for p in pages], axis=0)[:L] if L else inputs[c][0, :0]
            for c in ("k_cache", "v_cache"))
    return k, v


def varlen_reference(spec, inputs: dict, dtype: str | None, page_size: int) -> dict:
    from ... import reference as ref
    from ..attention.variant import head_dim_v, variant_reference_args
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
        tree = spec.opt("custom_mask") == "tree"
        mask = tree_visible(inputs, b, hi - lo, L) if tree else \
            packed_visible(inputs, b, hi - lo, L) if spec.opt("custom_mask") == "packed" else None
        ob, lb = ref.attention(qs, kh, vh, spec.softmax_scale, causal=spec.opt("causal") and not tree,
                               dtype=dtype, mask=mask, **variant_reference_args(spec, inputs))
        o[lo:hi], lse[lo:hi] = np.swapaxes(ob[0], 0, 1), np.swapaxes(lb[0], 0, 1)
    return {"o": o, "lse": lse} if spec.opt("return_lse") else {"o": o}
