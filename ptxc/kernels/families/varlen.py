"""Family "varlen": ragged query batches over paged or contiguous KV caches (serving attention).

One launch list serves any mix of prefills, prefill chunks, decodes and speculative
verifications. Sequence b owns query tokens [cu_seqlens_q[b], cu_seqlens_q[b+1]) and
L = seq_lens[b] KV rows (this step's rows already appended); its query i sits at position
L - q_len + i. The query heads of one KV head are packed into the rows of the tensor-core tile
(row R = token R / g, head R % g of the group), so each K/V tile is read once per KV head. One
CTA per (packed query tile, KV head x split); a CTA finds its sequence by a binary search of
cu_seqlens_q, and the few tiles past a sequence's rows exit at once.
The body (varlen_attend.py) reuses prefill's tile math and K/V pipeline and decode's KV row
addressing; split-KV partials are merged by split_reduce.py. docs/kernels.md has the details.
"""

from __future__ import annotations

import dataclasses

from ...errors import SpecError
from ...spec.fields import Field, FamilyFields, int_range, head_dim_range
from ...spec.model import KernelSpec
from ...targets import TARGETS, Target
from .. import common as C
from ..attention.split_plan import MAX_AUTO_SPLITS
from ..attention.split_reduce import build_reduce, split_interface
from ..attention.variant import (
    MASK_BUFFERS, VARIANT_FIELDS, default_seq_len, head_dim_v, mask_bytes_param,
    validate_variant, variant_tensors)
from ..base import Family, Interface, Launch, LaunchParam, ParamSource, Program, TensorInfo
from ..kv import kv_fp8
from ..kv.kv_access import MAX_PAGE_SIZE, KVAccess, check_page_size, latent_cache, sparse_keys
from ..math import fp8
from .varlen_config import configure, kv_access, page_size

_hd_check, _hd_allowed = head_dim_range(8, 512)
_page_check, _page_allowed = int_range(1, MAX_PAGE_SIZE)
_split_check, _split_allowed = int_range(1, 64)
_POW2_TILE = (16, 32, 64, 128)
FIELDS = FamilyFields(
    fields=(
        Field("head_dim", "int", "elements per head", check=_hd_check, allowed=_hd_allowed),
        Field("causal", "bool", "causal mask: query at position p = L - q_len + i sees key j "
              "iff j <= p", default=True),
        Field("return_lse", "bool", "also write lse [total_q, num_heads] (f32, natural log)",
              default=False),
        Field("kv_layout", "str", "KV cache layout (docs/kernels.md)", default="paged",
              choices=("paged", "contiguous")),
        Field("page_size", "int", "rows per page of a paged cache (paged only; default 16)",
              default=None, check=_page_check, allowed=_page_allowed),
        Field("num_splits", "int_or_auto", 'KV splits per query tile: 1, N, or "auto" (chosen '
              'at launch from the CTA count vs. the resident CTA slots)', default=1,
              check=_split_check, allowed=f'{_split_allowed}, or "auto"'),
        Field("custom_mask", "str", 'a mask beyond causal: "tree" (speculative verify: runtime '
              'tree_mask bits + tree_indptr; a draft token sees the prefix and the draft keys '
              'its bits set; needs causal), "packed" (runtime custom_mask bits + mask_indptr: '
              'a q_len x L bit matrix per sequence; needs causal = false) or "none" '
              '(docs/spec.md)', default="none", choices=("none", "tree", "packed")),
        *kv_fp8.FIELDS,
        *VARIANT_FIELDS,
    ),
    tile=(
        Field("block_m", "int", "packed query rows (token x group head) per CTA, 16 per warp",
              default=None, choices=_POW2_TILE),
        Field("block_n", "int", "keys per K/V tile", default=None, choices=_POW2_TILE),
        Field("num_warps", "int", "warps per CTA (block_m / 16)", default=None, choices=(1, 2, 4, 8)),
        Field("num_stages", "int", "K/V tiles in flight in the cp.async pipeline", default=None,
              choices=(1, 2, 3, 4)),
        Field("kv_loads", "str", "how the sm_90a wgmma kernel loads K/V tiles: TMA boxes under "
              "mbarriers (tensor-map parameters; the default where it applies: contiguous "
              "caches and pages of >= 8 rows), or per-thread cp.async (docs/kernels.md "
              "\"Hopper: varlen on wgmma\")",
              default=None, choices=("cp_async", "tma")),
        Field("correction", "bool", "sm_100a warp-specialised tcgen05 kernel: four correction "
              "warps rescale O in tensor memory when a row's running max grew past the lazy "
              "slack (FlashAttention-4's correction warpgroup; docs/kernels.md \"tcgen05\")",
              default=None),
        Field("pingpong", "bool", "sm_90a warp-specialised tile with two consumer warpgroups "
              "(block_m 128): they take turns at issuing their wgmma on named barriers, one's "
              "softmax under the other's products (FlashAttention-3's ping-pong)", default=None),
        Field("warp_specialize", "bool", "TMA kernels: on sm_100a a load warp issues the TMA "
              "boxes and an MMA warp the tcgen05.mma under mbarriers, the block_m / 16 softmax "
              "warps only compute (FlashAttention-4's roles; docs/kernels.md \"Blackwell\"); on "
              "sm_90a a producer warpgroup issues the boxes under full/empty mbarriers and the "
              "consumer warpgroups only compute (FlashAttention-3's split; docs/kernels.md "
              "\"wgmma (sm_90a): the packed tile\")",
              default=None),
    ),
)


def validate(spec: KernelSpec) -> None:
    if spec.dtype == "f32":
        raise SpecError("dtype f32: the varlen family runs on tensor cores only; use f16 or "
                        "bf16 (f32 serving batches: the decode or prefill family)", key="dtype")
    C.check_dtype_target(spec.dtype, spec.targets)
    old = [t for t in spec.targets if not TARGETS[t].has_mma_m16n8k16]
    if old:
        raise SpecError(f"varlen uses mma.m16n8k16 and cp.async (sm_80+), but targets include "
                        f"{old[0]}; drop it", key="targets")
    check_page_size(spec)
    kv_fp8.validate(spec)
    validate_variant(spec, causal_option=True)
    if spec.opt("custom_mask") == "tree" and not spec.opt("causal"):
        raise SpecError('custom_mask = "tree" needs causal = true (the prefix part of a draft '
                        'row is causal; its draft keys follow the tree bits)', key="custom_mask")
    if spec.opt("custom_mask") == "packed" and spec.opt("causal"):
        raise SpecError('custom_mask = "packed" needs causal = false (the bits are the whole '
                        'mask; set the causal part in them)', key="custom_mask")
    from ..bodies.packed_paths import check_tile_keys
    check_tile_keys(spec, [configure(spec, TARGETS[t]) for t in spec.targets])


def resolve_tile(spec: KernelSpec, target: Target) -> dict:
    from ..attention.varlen_tile import WgmmaTileConfig, packed_tile_config, tile_config
    from ..bodies.varlen_attend import longest_first
    cfg = configure(spec, target)
    conf = packed_tile_config(spec, cfg)
    if longest_first(spec) and not sparse_keys(spec):   # the launch model's order of the tiles
        conf["query_order"] = "longest_first"
    return tile_config(conf, cfg) if isinstance(cfg, WgmmaTileConfig) else conf


def query_tiles_expr(spec: KernelSpec) -> str:
    """Packed query tiles launched per (KV head, split): sequence b's tiles start at
    cu[b] * g // block_m + b, so every sequence gets at least cdiv(q_len * g, block_m) of them
    and the total is at most the useful tiles + batch (docs/kernels.md). Sparse top-k: each
    token's heads fill whole tiles (varlen_attend.emit_token_tiles)."""
    if sparse_keys(spec):
        return f"total_q * {spec.num_heads // configure(spec, None).block_m}"
    return f"total_q * {spec.group_size} // {configure(spec, None).block_m} + batch"


def interface(spec: KernelSpec) -> Interface:
    d, dv, H, Hk = spec.head_dim, head_dim_v(spec), spec.num_heads, spec.num_kv_heads
    kv = kv_access(spec)
    caches = [dataclasses.replace(t, shape=t.shape[:-1] + (dv,)) if t.name == "v_cache" else t
              for t in kv.tensors(kv_fp8.kv_dtype(spec), Hk, kv_fp8.row_elems(spec), "input")]   # V rows: head_dim_v
    tensors = [
        TensorInfo("q", spec.dtype, ("total_q", H, d), "input", "query tokens of all sequences, packed"),
        *key_count_tensors(spec, kv),
        *caches,
        TensorInfo("o", spec.dtype, ("total_q", H, dv), "output"),
    ]
    if spec.opt("return_lse"):
        tensors.append(TensorInfo("lse", "f32", ("total_q", H), "output",
                                  "log-sum-exp of the scaled scores; -inf for a row that sees no key"))
    tensors += variant_tensors(spec) + mask_tensors(spec)
    dims = ([] if kv.sparse else ["batch"]) + ["total_q", *kv.dims()] + \
        ([MASK_BUFFERS[spec.opt("custom_mask")][2]] if spec.opt("custom_mask") in MASK_BUFFERS else [])
    rules: dict = {}
    splits = spec.opt("num_splits")
    if splits != 1:
        ctas = f"{Hk} * ({query_tiles_expr(spec)})"
        most = {}   # sparse: no more splits than a token has KV tiles
        if kv.sparse:
            most["max_splits"] = min(MAX_AUTO_SPLITS, -(-kv.sparse // configure(spec, None).block_n))
        work, rules["num_splits"] = split_interface("total_q", H, dv, splits, ctas,
                                                    f"ptxc_{spec.name}_split", **most)
        tensors += work
        dims.append("num_splits")
    scale_tensors, scalars = kv_fp8.interface_extras(spec)
    tensors += scale_tensors
    ps = page_size(spec)
    S = default_seq_len(spec, 150)
    if spec.opt("kv_layout") == "paged":
        S = max(S, ps + ps // 2 + 1)     # long enough that launch-test's sequences cross a page
    defaults = {"batch": 8, "max_seq_len": S} if spec.opt("kv_layout") == "contiguous" else \
        {"batch": 8, "max_pages_per_seq": -(-S // ps), "num_pages": 8 * -(-S // ps) + 3}
    if kv.sparse:    # a few tokens over a cache larger than one token's slots
        defaults = {"total_q": 9, "num_pages": -(-(kv.sparse + S) // ps) + 2}
    return Interface(tuple(tensors), tuple(dims), defaults, rules, scalars=scalars)


def key_count_tensors(spec: KernelSpec, kv: KVAccess) -> list[TensorInfo]:
    """How a query finds its keys: its sequence (cu_seqlens_q) and that sequence's length
    (seq_lens); sparse top-k: its own slots in `indices` (kv_access), optionally fewer of them."""
    if kv.sparse:
        return [TensorInfo("topk_length", "i32", ("total_q",), "input", "slots each query token "
                           "reads: its first topk_length entries of indices (clamped to "
                           f"[0, {kv.sparse}])", device_resident_scalars=True)] \
            if dict(spec.options).get("topk_length") else []
    return [TensorInfo("cu_seqlens_q", "i32", ("batch + 1",), "input", "prefix sums of the query "
                       "lengths: 0, ..., total_q", device_resident_scalars=True, prefix_sums="total_q"),
            TensorInfo("seq_lens", "i32", ("batch",), "input", "KV rows per sequence after this "
                       "step's rows were appended (clamped to the cache's capacity)",
                       device_resident_scalars=True)]


def mask_tensors(spec: KernelSpec) -> list[TensorInfo]:
    """custom_mask = "tree": the packed bits of every sequence's n x n draft tree and the byte
    offset of each sequence's bits (docs/spec.md \"Custom masks\")."""
    if spec.opt("custom_mask") == "packed":
        return [TensorInfo("custom_mask", "u8", ("mask_bytes",), "input", "mask bits: sequence "
                           "b's bit (i, j) (query i sees key j) is bit (i*L + j) % 8 of byte "
                           "mask_indptr[b] + (i*L + j) // 8, L = seq_lens[b]"),
                TensorInfo("mask_indptr", "i32", ("batch + 1",), "input", "byte offset of each "
                           "sequence's mask bits: 0, non-decreasing, segments >= "
                           "ceil(q_len*L / 8)", device_resident_scalars=True)]
    if spec.opt("custom_mask") != "tree":
        return []
    return [TensorInfo("tree_mask", "u8", ("tree_bytes",), "input", "draft-tree bits: sequence "
                       "b's bit (i, k) is bit (i*n + k) % 8 of byte tree_indptr[b] + (i*n + k) // 8"),
            TensorInfo("tree_indptr", "i32", ("batch + 1",), "input", "byte offset of each "
                       "sequence's tree bits: 0, non-decreasing, segments >= ceil(n*n / 8)",
                       device_resident_scalars=True)]


def build(spec: KernelSpec, target: Target) -> Program:
    from ...ir import S64, U32, KernelBuilder
    from ..bodies.varlen_attend import emit_token_tiles, emit_varlen
    cfg = configure(spec, target)
    kv = kv_access(spec)
    split = spec.opt("num_splits") != 1
    b = KernelBuilder(f"ptxc_{spec.name}" + ("_split" if split else ""))
    params: list[LaunchParam] = []

    param = C.param_loader(b, params)

    # split: the partials, and o where split 0 finishes whole tiles (VarlenMath.epilogue; its
    # pointer and strides are loaded there)
    finals = cfg.finishes_whole_tiles and split
    outs = ["o_part", "lse_part"] + (["o"] if finals else []) if split else \
        ["o"] + (["lse"] if spec.opt("return_lse") else [])
    names = ["q", *(t.name for t in key_count_tensors(spec, kv)), *kv.pointer_tensors(), *outs,
             *(t.name for t in variant_tensors(spec) + mask_tensors(spec))]
    ptrs = {t: param(t, C.U64, ParamSource("pointer", tensor=t), b.to_global, late=split and t == "o")
            for t in names}
    strides = {(t, a): param(f"{t}_stride{a}", S64, ParamSource("stride", t, a),
                             lambda r: C.byte_stride(b, r, cfg.fmt), late=split and t == "o")
               for t in ("q", "o") if t in ptrs for a in (0, 1)}
    kv.emit_strides(param)
    kv.emit_dims(param)
    batch = None if kv.sparse else param("batch", U32, ParamSource("dim", name="batch"))
    total_q = param("total_q", U32, ParamSource("dim", name="total_q"))
    split_count = param("num_splits", U32, ParamSource("dim", name="num_splits")) if split else None
    quant = kv_fp8.emit_params(spec, target, b, param)
    mask_bytes = mask_bytes_param(spec, param)
    tmaps = None
    if getattr(cfg, "tma", False):   # tile.kv_loads = "tma": k/v tensor maps after the other params
        from ..kv.kv_boxes import tensor_map_params
        tmaps = tensor_map_params(b, cfg, kv, params)
    if kv.sparse:
        emit_token_tiles(b, spec, cfg, kv, ptrs, strides, total_q, split_count, quant)
    else:
        emit_varlen(b, spec, cfg, kv, ptrs, strides, batch, total_q, split_count, quant, tmaps, mask_bytes)
    b.ret()
    grid_y = f"{spec.num_kv_heads} * num_splits" if split else str(spec.num_kv_heads)
    launches = [Launch(entry=b.entry.name, params=tuple(params),
                       grid=(query_tiles_expr(spec), grid_y, str(getattr(cfg, "value_ctas", 1))),
                       block=(cfg.launch_threads, 1, 1), dynamic_smem_bytes=cfg.smem_bytes,
                       min_ctas_per_sm=cfg.min_ctas_per_sm,
                       tmem_columns=getattr(cfg, "tmem_columns", 0))]
    entries = [b.entry]
    if split:
        entry, launch = build_reduce(spec, f"ptxc_{spec.name}_reduce", spec.opt("return_lse"),
                                     rows_dim="total_q")
        entries.append(entry)
        launches.append(launch)
    return Program(entries, launches, resolve_tile(spec, target),
                   ptx_version=fp8.ptx_version(target, mma=getattr(cfg, "qk_staged", False))
                   if quant is not None else None)


def make_inputs(spec: KernelSpec, dims: dict[str, int], rng) -> dict:
    """A random mixed batch cycling through the serving cases: decode (q_len 1), whole prefill
    (q_len = L), prefill chunk (q_len < L), no queries, a 4-token verification, q_len > L (rows
    that see nothing), L = 0, L at the cache capacity; paged caches get shuffled pages and
    garbage ids (-1, num_pages + 7) past each sequence's last page, which must never be read."""
    from .varlen_inputs import mixed_batch
    inputs = mixed_batch(spec, dims, rng, page_size(spec) if spec.opt("kv_layout") == "paged" else 0)
    kv_fp8.add_inputs(spec, inputs, rng)    # FP8 caches: bytes of the values over their scales
    return inputs


def unread(spec: KernelSpec, inputs: dict) -> dict:
    from .varlen_inputs import unread
    return unread(spec, inputs)


def reference(spec: KernelSpec, inputs: dict, dtype: str | None = None) -> dict:
    from .varlen_inputs import varlen_reference
    k, v = kv_fp8.dequantized(spec, inputs, inputs["k_cache"], inputs["v_cache"])
    return varlen_reference(spec, {**inputs, "k_cache": k, "v_cache": v}, dtype,
                            page_size(spec) if spec.opt("kv_layout") == "paged" else 0)


FAMILY = Family(name="varlen", doc=__doc__.split("\n")[0], fields=FIELDS, validate=validate,
                interface=interface, build=build, resolve_tile=resolve_tile,
                make_inputs=make_inputs, reference=reference, unread=unread,
                row_sum_dtype=lambda spec: None if spec.dtype == "f32" else spec.dtype,
                ptx_reads_all_targets=latent_cache)     # latent_block_m fits every target

__all__ = ["FAMILY", "configure"]
