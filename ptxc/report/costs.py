"""Cost models: FLOPs and DRAM bytes of one launch list at given runtime dims, and the roofline.

The models count the useful work of the algorithm, not instructions (docs/performance.md).
e = bytes per element of the dtype; L = KV rows per sequence (max_seq_len, or
max_pages_per_seq * page_size when paged): the cost of a batch whose sequences are all full.

decode     FLOPs = 4 * batch * H * L * d      (q.k and p.v: 2 FLOPs per multiply-add)
           bytes = (K + V) * head_chunks + q + o (+ lse) + seq_lens (+ block_table | k/v_ptrs),
                   with K + V = 2 * batch * L * Hk * d * e_kv (e_kv = 1 for
                   an FP8 kv_dtype: the cache is read as bytes, half a 16-bit cache). Each CTA serves
                   `heads_per_cta` query heads of one KV head, so a K/V row is read once per
                   chunk of its GQA group: head_chunks = group_size / heads_per_cta (from the
                   resolved tile config). Split-KV partials are not counted: they are
                   overhead, not the attention's traffic (and a row split 0 covers whole
                   writes none), so a split kernel's GB/s never credits them.
prefill    FLOPs = 4 * batch * seq_q * seq_k * d * H, halved when causal (the FlashAttention
                   convention; exact for seq_q == seq_k up to the diagonal blocks)
           bytes = q + k + v + o (+ lse), each once (K/V reuse across query blocks from L2)
varlen     a uniform batch: every sequence has q = total_q / batch queries
           and L keys (the cache capacity), its queries the last q positions
           FLOPs = 4 * batch * H * d * keys, keys = q * L, or q * L - q * (q - 1) / 2 when
                   causal (query i sees L - q + i + 1 keys)
           bytes = q + o (+ lse) + K + V (e_kv bytes per element) once per sequence (GQA
                   packing reads a K/V tile once per KV head; the query tiles of a long
                   prefill re-read it from L2, as in prefill) + cu_seqlens_q + seq_lens (+ block_table) (+ split partials)
custom_mask (varlen): the estimate assumes dense bits -- every query sees all L keys (a tree:
           the whole prefix and all n draft keys; packed: every key), keys = q * L -- and adds
           the mask bytes read (tree: ceil(q*q/8), packed: ceil(q*L/8) per sequence, + indptr)
sliding_window = W / attention_chunk = C: a query at p sees keys from first_key(p) (p - W + 1,
           C * floor(p / C), the later); decode reads the rows its query sees (min(L, W) for a
           window), prefill and varlen count each query's keys exactly and varlen reads the
           rows from its first query's first key (min(L, q + W - 1) for a window)
kv_append  FLOPs = 0
           bytes = 2 * batch * num_new * Hk * d * e read (k_new, v_new) and the same written
                   into the cache, + positions (+ one block-table entry per row when paged);
                   by slot mapping batch * num_new is num_tokens, + 8 bytes of slot (and of
                   RoPE position) per token

`unit` says which peak bounds the math: "tensor" for the tensor-core paths (mma, wgmma,
tcgen05), "simt" otherwise (decode does f32 FMAs on the CUDA cores whatever its storage dtype).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import InputError, UserError
from ..pipeline.metadata import ELEMENT_BYTES

LSE_BYTES = 4   # lse is always f32
# Shapes the report uses when --shape does not say: typical serving sizes, not launch-test's
# small odd ones (these decide which side of the ridge a kernel lands on).
DEFAULT_DIMS = {
    "decode": {"batch": 16, "kv_len": 4096},
    "prefill": {"batch": 4, "seq_q": 4096, "seq_k": 4096},
    "kv_append": {"batch": 16, "num_new": 1, "kv_len": 4096, "num_tokens": 16},   # by slot: 16 tokens
    "varlen": {"batch": 16, "total_q": 64, "kv_len": 4096},
    "mla": {"batch": 64, "total_q": 64, "kv_len": 4096},       # batch-64 single-token decode
    "mla_append": {"num_tokens": 64, "num_pages": 4096, "max_position": 4096},
    "merge_states": {"num_tokens": 4096},    # a prefill chunk's rows
}
KNOWN_DIMS = {"batch", "max_seq_len", "seq_q", "seq_k", "num_pages", "max_pages_per_seq",
              "num_splits", "num_new", "total_q", "max_position", "num_tokens"}
REPORT_NUM_SMS = 108   # SM count assumed by "auto" dim rules in a static report (an A100's)


@dataclass(frozen=True)
class Cost:
    flops: int
    bytes: int
    unit: str        # "tensor" | "simt"
    dims: dict
    fp8_flops: int = 0   # of `flops`, those on 8-bit tensor-core inputs: twice the 16-bit rate

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOPs per DRAM byte."""
        return self.flops / self.bytes if self.bytes else float("inf")

    def to_dict(self) -> dict:
        out = {"flops": self.flops, "bytes": self.bytes, "intensity": round(self.intensity, 4),
               "unit": self.unit, "dims": dict(self.dims)}
        if self.fp8_flops:
            out["fp8_flops"] = self.fp8_flops
        return out

    @property
    def peak_equivalent_flops(self) -> float:
        """FLOPs at the unit's (16-bit) peak that take as long: FP8 products count half."""
        return self.flops - self.fp8_flops / 2


def _unit(config: dict) -> str:
    return "tensor" if str(config.get("path", "")).startswith(("mma", "wgmma", "tcgen05")) else "simt"


def page_size(meta: dict) -> int:
    """Rows per page of a paged cache (the constant in the cache's shape: k_cache, or MLA's
    latent kv_cache), 0 when not paged."""
    t = meta["tensors"]
    shape = (t.get("k_cache") or t.get("kv_cache") or {}).get("shape", [])
    return shape[1] if len(shape) >= 3 and shape[0] == "num_pages" else 0


def kv_length(meta: dict, dims: dict) -> int:
    ps = page_size(meta)
    if ps and "max_pages_per_seq" not in dims:   # kv_append by slot: the whole cache
        return dims["num_pages"] * ps
    return dims["max_pages_per_seq"] * ps if ps else dims["max_seq_len"]


def first_key(p: int, window: int | None, chunk: int | None = None) -> int:
    """The first key a query at position p >= 0 sees: the kernels' AttentionVariant.key_begin
    (a sliding window p - W + 1, an attention chunk C * floor(p / C), the later of both)."""
    return max(0, p - window + 1 if window else 0, p // chunk * chunk if chunk else 0)


def keys_seen(q: int, L: int, causal: bool, window: int | None, chunk: int | None = None) -> int:
    """Keys summed over q queries that sit at the last q positions of L keys (p = L - q + i):
    all L without causal; with causal, p + 1 (none for p < 0); with a sliding window W or an
    attention chunk C, those from first_key(p)."""
    if not causal:
        return q * L
    total = 0
    first = L - q                                      # position of query 0
    for p in range(max(first, 0), L):                  # queries before position 0 see nothing
        total += p + 1 - first_key(p, window, chunk)
    return total


def visible_rows(L: int, window: int | None, chunk: int | None = None) -> int:
    """K/V rows the query at position L - 1 (decode's) sees."""
    return L - first_key(L - 1, window, chunk) if L > 0 else 0


def _layout_bytes(meta: dict, dims: dict, rows_per_seq: int) -> int:
    """Indirection the kernel reads: block-table entries (paged) or per-sequence pointers."""
    t = meta["tensors"]
    if "block_table" in t:
        return dims["batch"] * -(-rows_per_seq // page_size(meta)) * 4
    return sum(dims["batch"] * 8 for n in ("k_ptrs", "v_ptrs") if n in t)


def decode_cost(meta: dict, config: dict, dims: dict) -> Cost:
    spec = meta["spec"]
    b, L = dims["batch"], kv_length(meta, dims)
    L = visible_rows(L, spec.get("sliding_window"), spec.get("attention_chunk"))   # only those are read
    H, Hk, d = spec["num_heads"], spec["num_kv_heads"], spec["head_dim"]
    e = ELEMENT_BYTES[spec["dtype"]]
    group = H // Hk
    head_chunks = group // max(1, config.get("heads_per_cta", group))
    kv = 2 * b * L * Hk * d * ELEMENT_BYTES[spec.get("kv_dtype") or spec["dtype"]] * head_chunks
    qo = 2 * b * H * d * e
    lse = b * H * LSE_BYTES if spec.get("return_lse") else 0
    return Cost(4 * b * H * L * d, kv + qo + lse + b * 4 + _layout_bytes(meta, dims, L),
                _unit(config), dict(dims))


def prefill_cost(meta: dict, config: dict, dims: dict) -> Cost:
    spec = meta["spec"]
    b, sq, sk = dims["batch"], dims["seq_q"], dims["seq_k"]
    H, Hk, d = spec["num_heads"], spec["num_kv_heads"], spec["head_dim"]
    e = ELEMENT_BYTES[spec["dtype"]]
    flops = 4 * b * sq * sk * d * H
    if spec.get("sliding_window") or spec.get("attention_chunk"):   # exact count of the keys seen
        flops = 4 * b * H * d * keys_seen(sq, sk, True, spec.get("sliding_window"),
                                          spec.get("attention_chunk"))
    elif spec.get("causal"):
        flops //= 2
    qo = 2 * b * sq * H * d * e
    kv = 2 * b * sk * Hk * d * e
    lse = b * H * sq * LSE_BYTES if spec.get("return_lse") else 0
    # a packed mask: dense bits assumed (every key visible, the non-causal count) + its bytes
    mask = b * -(-sq * sk // 8) + (b + 1) * 4 if spec.get("custom_mask", "none") != "none" else 0
    return Cost(flops, qo + kv + lse + mask, _unit(config), dict(dims))


def kv_append_cost(meta: dict, config: dict, dims: dict) -> Cost:
    spec = meta["spec"]
    if "slot_mapping" in meta["tensors"]:   # by slot: one flat batch, one i64 slot (+ position) per token
        b, n = 1, dims["num_tokens"]
        index = n * 8 * (2 if "q_rot" in meta["tensors"] else 1)
    else:                                   # positions, + a block-table entry per row or pointers
        b, n = dims["batch"], dims["num_new"]
        index = b * 4 + (b * n * 4 if "block_table" in meta["tensors"] else _layout_bytes(meta, dims, n))
    elems = 2 * b * n * spec["num_kv_heads"] * spec["head_dim"]
    kv_dtype = spec.get("kv_dtype") or spec["dtype"]        # FP8 caches: one byte per element
    rope = 0
    if "q_rot" in meta["tensors"]:   # q read and written, one cos/sin row per token
        rope = 2 * b * n * spec["num_heads"] * spec["head_dim"] * ELEMENT_BYTES[spec["dtype"]] + \
            b * n * meta["tensors"]["cos_sin_cache"]["shape"][1] * 4
    return Cost(0, elems * (ELEMENT_BYTES[spec["dtype"]] + ELEMENT_BYTES[kv_dtype]) + index + rope,
                "simt", dict(dims))


def varlen_cost(meta: dict, config: dict, dims: dict) -> Cost:
    spec = meta["spec"]
    b, L = dims["batch"], kv_length(meta, dims)
    q = dims["total_q"] // max(1, b)
    H, Hk, d = spec["num_heads"], spec["num_kv_heads"], spec["head_dim"]
    e = ELEMENT_BYTES[spec["dtype"]]
    window, chunk = spec.get("sliding_window"), spec.get("attention_chunk")
    mask = spec.get("custom_mask", "none")
    # custom masks: dense bits assumed (every key visible; the cost is an upper bound)
    keys = keys_seen(q, L, bool(spec.get("causal")) and mask == "none", window, chunk)
    rows = L - first_key(max(L - q, 0), window, chunk)   # K/V rows any query of a sequence sees
    mask_bytes = 0 if mask == "none" else \
        b * (-(-q * (q if mask == "tree" else L) // 8)) + (b + 1) * 4
    tq = b * q
    qo = 2 * tq * H * d * e
    kv = 2 * b * rows * Hk * d * ELEMENT_BYTES[spec.get("kv_dtype") or spec["dtype"]]
    lse = tq * H * LSE_BYTES if spec.get("return_lse") else 0
    index = (b + 1) * 4 + b * 4 + _layout_bytes(meta, dims, rows) + mask_bytes
    return Cost(4 * b * H * d * keys, qo + kv + lse + index, _unit(config), dict(dims))


def latent_row_bytes(meta: dict) -> int:
    """Bytes of one latent cache row, from the kv_cache tensor (e4m3_ds rows carry their
    scales and bf16 RoPE: 656 bytes where e4m3 takes 576)."""
    t = meta["tensors"]["kv_cache"]
    return int(t["shape"][-1]) * ELEMENT_BYTES[t["dtype"]]


def mla_cost(meta: dict, config: dict, dims: dict) -> Cost:
    """Latent attention: every query head of a token over the same latent rows. Q.K^T over the
    whole row (head_dim) and P.V over its first kv_lora_rank columns; each latent row counted
    once per sequence from DRAM (the other head tiles' reads of it are L2 hits)."""
    spec = meta["spec"]
    if spec.get("sparse_topk"):
        return sparse_mla_cost(meta, config, dims)
    b, L = dims["batch"], kv_length(meta, dims)
    q = dims["total_q"] // max(1, b)
    H, d, dv = spec["num_heads"], spec["head_dim"], spec["kv_lora_rank"]
    e = ELEMENT_BYTES[spec["dtype"]]
    tq = b * q
    latent = b * L * latent_row_bytes(meta)
    qo = tq * H * (d + dv) * e
    lse = tq * H * LSE_BYTES if spec.get("return_lse") else 0
    index = (b + 1) * 4 + b * 4 + _layout_bytes(meta, dims, L)
    keys = keys_seen(q, L, True, None)
    # S on FP8 wgmma where the target's tile runs it (the config says so; elsewhere Q's e4m3
    # values meet 16-bit products at the 16-bit rate)
    narrow = 2 * b * H * d * keys if config.get("qk_products") == "e4m3" else 0
    return Cost(2 * b * H * (d + dv) * keys, latent + qo + lse + index, _unit(config), dict(dims),
                fp8_flops=narrow)


def sparse_mla_cost(meta: dict, config: dict, dims: dict) -> Cost:
    """Sparse top-k: each token reads its own N latent rows (and N slots); no reuse across
    tokens is assumed (an indexer's picks of neighbouring tokens overlap, which only helps)."""
    spec = meta["spec"]
    tq, N = dims["total_q"], spec["sparse_topk"]
    H, d, dv = spec["num_heads"], spec["head_dim"], spec["kv_lora_rank"]
    e = ELEMENT_BYTES[spec["dtype"]]
    latent = tq * N * latent_row_bytes(meta)
    qo = tq * H * (d + dv) * e
    lse = tq * H * LSE_BYTES if spec.get("return_lse") else 0
    index = tq * N * 4 + (tq * 4 if spec.get("topk_length") else 0)
    narrow = 2 * tq * H * d * N if config.get("qk_products") == "e4m3" else 0   # as mla_cost
    return Cost(2 * tq * H * (d + dv) * N, latent + qo + lse + index, _unit(config), dict(dims),
                fp8_flops=narrow)


def mla_append_cost(meta: dict, config: dict, dims: dict) -> Cost:
    """Each token's latent row read (kv_c, k_pe) and written once, its slot (and position and a
    cos/sin row with RoPE) read."""
    spec = meta["spec"]
    n, d = dims["num_tokens"], spec["head_dim"]
    row = d * ELEMENT_BYTES[spec["dtype"]] + latent_row_bytes(meta)
    rope = n * (8 + spec["qk_rope_head_dim"] * 4) if spec.get("rope") else 0
    return Cost(0, n * (row + 8) + rope, "simt", dict(dims))


def merge_states_cost(meta: dict, config: dict, dims: dict) -> Cost:
    """Both states' o and lse read, the merged o (and lse) written: 5 FLOPs an element."""
    spec = meta["spec"]
    rows = dims["num_tokens"] * spec["num_heads"]
    o = rows * spec["head_dim"] * ELEMENT_BYTES[spec["dtype"]]
    lse = rows * LSE_BYTES * (3 if spec.get("return_lse") else 2)
    return Cost(5 * rows * spec["head_dim"], 3 * o + lse, "simt", dict(dims))


COST_MODELS: dict[str, Callable[[dict, dict, dict], Cost]] = {
    "merge_states": merge_states_cost,
    "mla": mla_cost,
    "mla_append": mla_append_cost,
    "decode": decode_cost,
    "prefill": prefill_cost,
    "kv_append": kv_append_cost,
    "varlen": varlen_cost,
}


def resolve_dims(meta: dict, shapes: dict[str, int], num_sms: int = REPORT_NUM_SMS,
                 target: str | None = None) -> dict[str, int]:
    """The artifact's runtime dims: --shape values first, then the family's report defaults
    (kv_len becomes max_seq_len, or max_pages_per_seq = kv_len / page_size with every
    sequence owning its pages: num_pages = batch * max_pages_per_seq), then the artifact's dim rules (num_splits).
    Names of other families' dims are ignored (one --shape for a mixed directory); names no
    family has are refused."""
    family, dims = meta["family"], list(meta["dims"])
    bad = sorted(set(shapes) - KNOWN_DIMS - set(dims))
    if bad:
        raise InputError(f"--shape {', '.join(bad)}: not a runtime dimension (dims of "
                         f"{meta['name']}: {', '.join(dims)})")
    base = DEFAULT_DIMS.get(family, {})
    out = {d: shapes[d] for d in dims if d in shapes}
    for d in dims:
        if d not in out and d in base:
            out[d] = base[d]
    kv = shapes.get("max_seq_len", base.get("kv_len"))
    if "max_seq_len" in dims and "max_seq_len" not in out and kv is not None:
        out["max_seq_len"] = kv
    if "max_pages_per_seq" in dims and "max_pages_per_seq" not in out and kv is not None and page_size(meta):
        out["max_pages_per_seq"] = -(-kv // page_size(meta))
    if "num_pages" in dims and "num_pages" not in out and "max_pages_per_seq" in out and "batch" in out:
        out["num_pages"] = out["batch"] * out["max_pages_per_seq"]
    slot_cache = "num_tokens" in out or meta["spec"].get("sparse_topk")
    if "num_pages" in dims and "num_pages" not in out and slot_cache and kv and page_size(meta):
        # kv_append by slot, sparse MLA: the cache of `batch` sequences of kv_len rows
        out["num_pages"] = shapes.get("batch", base.get("batch", 1)) * -(-kv // page_size(meta))
    if "max_position" in dims and "max_position" not in out:   # RoPE table: one row per cache row
        out["max_position"] = kv_length(meta, out)
    for name, rule in (meta.get("dim_rules") or {}).items():
        if name in dims and name not in out:
            from ..runtime import apply_dim_rule, rule_ctas_per_sm
            out[name] = apply_dim_rule(rule, out, num_sms, rule_ctas_per_sm(meta, rule, target))
    if "mask_bytes" in dims and "mask_bytes" not in out and "seq_q" in out:   # prefill
        out["mask_bytes"] = max(1, out["batch"] * -(-out["seq_q"] * out["seq_k"] // 8))
    for name in ("tree_bytes", "mask_bytes"):   # custom masks: dense segments of the batch
        if name in dims and name not in out and "batch" in out and "total_q" in out:
            q = -(-out["total_q"] // max(1, out["batch"]))   # the longest sequence of an even spread
            width = q if name == "tree_bytes" else kv_length(meta, out)
            out[name] = max(1, out["batch"] * -(-q * width // 8))
    missing = [d for d in dims if d not in out]
    if missing:
        raise InputError(f"{meta['name']}: give --shape {missing[0]}=N (no default for {family})")
    return {d: out[d] for d in dims}


def launch_cost(meta: dict, target: str, dims: dict[str, int]) -> Cost:
    """Cost of one run of `target`'s whole launch list at `dims`."""
    family = meta["family"]
    model = COST_MODELS.get(family)
    if model is None:
        raise UserError(f"no cost model for family {family!r} (known: {', '.join(COST_MODELS)}); "
                        f"add one to ptxc/report/costs.py")
    return model(meta, meta["targets"][target].get("config", {}), dims)


def roofline(cost: Cost, gpu) -> dict:
    """Lower bound on the time of `cost` on `gpu`: the slower of doing the math at peak and
    moving the bytes at full bandwidth, and which of the two binds."""
    compute_s = cost.peak_equivalent_flops / gpu.peak_flops(cost.unit)
    memory_s = cost.bytes / gpu.bandwidth
    seconds = max(compute_s, memory_s)
    return {"gpu": gpu.key, "seconds": seconds, "compute_seconds": compute_s,
            "memory_seconds": memory_s, "bound": "compute" if compute_s >= memory_s else "memory",
            "attainable_tflops": cost.flops / seconds / 1e12 if seconds else 0.0,
            "ridge_intensity": gpu.peak_flops(cost.unit) / gpu.bandwidth}


__all__ = [
    "COST_MODELS",
    "DEFAULT_DIMS",
    "ELEMENT_BYTES",
    "Cost",
    "decode_cost",
    "kv_append_cost",
    "keys_seen",
    "kv_length",
    "launch_cost",
    "page_size",
    "prefill_cost",
    "resolve_dims",
    "varlen_cost",
    "roofline",
]
