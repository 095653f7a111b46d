"""Family "mla": multi-head latent attention decode (DeepSeek-V3/R1, Kimi-K2) over a latent cache.

MLA caches one latent row per token, no head axis: kv_cache [.., kv_lora_rank + qk_rope_head_dim].
With the up-projections absorbed into the queries (q = [q_nope . W_UK, q_pe]), every query head
attends over the same rows: K is the whole row and V its first kv_lora_rank columns. That is
the varlen kernel with one KV head (all query heads packed into the rows of the tensor-core
tile), head_dim = kv_lora_rank + qk_rope_head_dim, head_dim_v = kv_lora_rank, over a latent
KV layout (kv_access.py: V's rows are K's) and the shared-tile pipeline (kv_pipeline.py: each
latent row is read from global memory once per CTA, its tile serving both products). This
module is the family's contract - keys, tensors, inputs, reference - and the varlen spec it
compiles as (`attention_view`); the kernel is varlen's, unchanged.

Queries follow varlen's semantics (cu_seqlens_q, seq_lens; the q_len queries of a sequence are
its last positions, causal among themselves), so one launch list serves single-token decode and
speculative verification. Sparse top-k (sparse_topk = N, DeepSeek-V3.2) instead gives each
query token its own N cache slots (kv_access's sparse layout, varlen_attend.emit_token_tiles).
docs/kernels.md "mla" has the details.
"""

from __future__ import annotations

import dataclasses

from ...errors import SpecError
from ...spec.fields import SCALE_ALLOWED, Field, FamilyFields, int_range
from ...spec.model import KernelSpec
from ...targets import TARGETS
from .. import common as C
from ..base import Family, Interface, Program
from ..kv import kv_fp8
from ..kv.kv_access import check_page_size
from . import varlen

_rank_check, _rank_allowed = int_range(128, 512, multiple_of=64)
_rope_check, _rope_allowed = int_range(16, 128, multiple_of=16)
_hd_check, _hd_allowed = int_range(144, 640, multiple_of=16)
_page_check, _page_allowed = int_range(1, 256)
_split_check, _split_allowed = int_range(1, 64)
_topk_check, _topk_allowed = int_range(0, 1 << 16)
DEFAULT_PAGE_SIZE = 64          # FlashMLA's
MAX_HEADS = 128                 # query heads on one rank (DeepSeek-V3: 128; TP 8: 16)

FIELDS = FamilyFields(
    fields=(
        Field("kv_lora_rank", "int", "latent width = V's and O's head size (DeepSeek-V3, Kimi-K2: "
              "512)", default=512, check=_rank_check, allowed=_rank_allowed),
        Field("qk_rope_head_dim", "int", "RoPE columns after the latent part of each q/k row "
              "(DeepSeek-V3: 64)", default=64, check=_rope_check, allowed=_rope_allowed),
        Field("head_dim", "int", "q/k head size: kv_lora_rank + qk_rope_head_dim (derived; may "
              "be omitted)", default=None, check=_hd_check, allowed=_hd_allowed),
        Field("kv_layout", "str", "latent cache layout: paged [num_pages, page_size, head_dim] + "
              "block_table, or contiguous [batch, max_seq_len, head_dim]", default="paged",
              choices=("paged", "contiguous")),
        Field("page_size", "int", "rows per page of a paged cache (paged only; default 64, "
              "FlashMLA's)", default=None, check=_page_check, allowed=_page_allowed),
        Field("kv_dtype", "str", "latent cache element type: the dtype, e4m3 (per-tensor "
              "k_scale) or e4m3_ds (FlashMLA's 656-byte rows with per-group scales)",
              default=None, choices=("f16", "bf16", "e4m3", "e4m3_ds")),
        dataclasses.replace(kv_fp8.KV_SCALE_FIELD, doc="FP8 scale of the latent cache (K and V "
                            "alike): an f32 runtime scalar k_scale, or a [1] f32 device tensor "
                            "k_scale (default \"tensor\")", choices=("tensor", "device")),
        Field("sparse_topk", "int", "0: dense; N > 0: each query token attends only to the N "
              "cache slots in indices [total_q, N] (DeepSeek-V3.2; paged, no block table)",
              default=0, check=_topk_check, allowed=_topk_allowed),
        Field("topk_length", "bool", "sparse: also take topk_length [total_q] (i32), the count "
              "of each token's slots to read", default=False),
        Field("num_splits", "int_or_auto", 'KV splits per query tile: 1, N, or "auto" (from the '
              'CTA count vs. the resident CTA slots at launch)', default="auto",
              check=_split_check, allowed=f'{_split_allowed}, or "auto"'),
        Field("return_lse", "bool", "also write lse [total_q, num_heads] (f32, natural log)",
              default=True),
        Field("qk_products", "str", "the inputs of Q·Kᵀ's tensor-core products: the dtype (the "
              "default: the FP8 cache converted to 16 bits), or e4m3 (kv_dtype \"e4m3\") -- each "
              "query row rounded in the kernel to e4m3 after a power-of-two scale on every target, "
              "the scores on FP8 mma.sync on sm_89 / sm_120 (and on FP8 wgmma on sm_90a with "
              "tile.fp8_scores), on 16-bit products over the same values elsewhere; P·V stays "
              "16-bit", default="dtype", choices=("dtype", "e4m3")),
    ),
    tile=(
        Field("block_m", "int", "query head rows per CTA (token x head); above 256 latent columns "
              "four warps share 16 rows. Default: up to 64 as the heads fill it, where every "
              "target holds that tile in shared memory (32 for sparse), else 16",
              default=None, choices=(16, 32, 64)),
        Field("block_n", "int", "latent rows per tile", default=None, choices=(16, 32)),
        Field("num_stages", "int", "latent tiles in flight (2 keeps the mma.sync kernel on "
              "sm_90a and sm_100a: their tensor-core tiles read two while one lands)", default=None,
              choices=(2, 3, 4)),
        Field("kv_loads", "str", "how the sm_90a wgmma tile loads a dense latent cache: TMA "
              "boxes under mbarriers (where it applies: contiguous, or pages of >= 8 rows that are "
              "a power of two or a multiple of 64; the default for a cache of the dtype, given "
              "for e4m3), or per-thread cp.async (the e4m3 default; e4m3_ds and sparse caches "
              "always); sm_100a's tcgen05 tile the same, e4m3 by TMA too by default", default=None,
              choices=("cp_async", "tma")),
        Field("split_scores", "bool", "sm_90a wgmma tile: the two warpgroups each compute half of "
              "Q·Kᵀ's depth and exchange partial scores through 16 KiB of shared memory (one "
              "latent stage fewer), instead of each computing all of it", default=None),
        Field("seesaw", "bool", "sm_90a wgmma tile over TMA-loaded latent rows of the dtype: "
              "FlashMLA's seesaw schedule -- the warpgroups take alternate tiles' whole S and "
              "softmax and hand each other P and the row max through 10 KiB of shared memory, so "
              "one's softmax runs under the other's products (four latent stages; replaces "
              "split_scores). Default: on wherever it applies (8-18 % faster on the H200)",
              default=None),
        Field("fp8_scores", "bool", "sm_90a's bf16 wgmma tile with qk_products = \"e4m3\" and a "
              "dequantising warpgroup: S on FP8 wgmma at twice the 16-bit rate, each "
              "warpgroup's k32 steps dealt to three accumulators added in f32 (Hopper's FP8 "
              "tensor cores keep 13 fraction bits of each step's sum), 16-row tiles. Off by "
              "default: its lse error grows with softmax_scale (launch-test's inputs: 0.16-0.6x "
              "the tolerance at 0.0723-0.1352, up to 1.16x at 0.3) and it is untimed",
              default=False),
        Field("dequant_warpgroup", "bool", "sm_90a wgmma and sm_100a tcgen05 tiles over dense "
              "or sparse e4m3 / e4m3_ds rows the threads copy: a warpgroup of its own copies "
              "(sparse: gathers) and dequantises "
              "the rows into a ring of three converted tiles (FlashMLA's), so the computing warps "
              "run the loop of a cache of the dtype (the default; false: every warp converts its "
              "share at the top of each iteration)", default=None),
    ),
)


def derive(values: dict) -> None:
    """The common values MLA fixes: head_dim = kv_lora_rank + qk_rope_head_dim, one (latent) KV
    head, and a softmax_scale that must be given (it depends on the unabsorbed q/k head size
    and YaRN's mscale, never 1/sqrt(head_dim)); a paged cache's page_size, recorded."""
    latent_head(values)
    if values.get("kv_layout") == "paged" and values.get("page_size") is None:
        values["page_size"] = DEFAULT_PAGE_SIZE     # recorded, so every consumer sees it
    if values.get("softmax_scale") is None:
        raise SpecError("missing required key (MLA's scale depends on the unabsorbed q/k head "
                        "size and YaRN's mscale, e.g. DeepSeek-V3: 192^-0.5 x mscale^2 = 0.1353; "
                        f"never 1/sqrt(576); allowed: {SCALE_ALLOWED})", key="softmax_scale")


def latent_head(values: dict) -> None:
    """head_dim = kv_lora_rank + qk_rope_head_dim and one KV head (given values must agree)."""
    d = values["kv_lora_rank"] + values["qk_rope_head_dim"]
    if values.get("head_dim") not in (None, d):
        raise SpecError(f"head_dim = {values['head_dim']}: MLA's q/k head size is kv_lora_rank "
                        f"+ qk_rope_head_dim = {d}; omit it or give {d}", key="head_dim")
    values["head_dim"] = d
    if values.get("num_kv_heads") not in (None, 1):
        raise SpecError(f"num_kv_heads = {values['num_kv_heads']}: MLA has one latent KV head "
                        f"shared by every query head; omit it or give 1", key="num_kv_heads")
    values["num_kv_heads"] = 1


def attention_view(spec: KernelSpec) -> KernelSpec:
    """The varlen spec this kernel compiles as: one KV head (every query head packed into the
    tile rows), head_dim_v = kv_lora_rank, causal within a sequence's queries, no variant;
    the family stays "mla", which selects the latent cache (kv_access.latent_cache)."""
    o = dict(spec.options)
    opts = {f.name: f.default for f in varlen.FIELDS.fields if f.name != "head_dim"}
    opts.update(causal=True, head_dim_v=o["kv_lora_rank"], kv_layout=o["kv_layout"],
                page_size=page_size(spec) if o["kv_layout"] == "paged" else None,
                num_splits=o["num_splits"], return_lse=o["return_lse"], kv_dtype=o["kv_dtype"],
                kv_scale=o["kv_scale"])
    if o.get("qk_products") == "e4m3":   # latent_tile reads it
        opts.update(qk_products="e4m3")
    if o["sparse_topk"]:   # kv_access.sparse_keys reads it; the token is the sequence
        opts.update(sparse_topk=o["sparse_topk"], topk_length=o["topk_length"])
    return dataclasses.replace(spec, options=tuple(sorted(opts.items())))


def page_size(spec: KernelSpec) -> int:
    return spec.opt("page_size") or DEFAULT_PAGE_SIZE


def check_cache_keys(spec: KernelSpec) -> None:
    """kv_dtype and kv_scale of a latent cache (mla and mla_append alike)."""
    kd = spec.opt("kv_dtype")
    if kd in ("f16", "bf16") and kd != spec.dtype:
        raise SpecError(f"got {kd!r} with dtype {spec.dtype!r}; allowed: {spec.dtype!r}, "
                        f"\"e4m3\" or \"e4m3_ds\"", key="kv_dtype")
    if kd == kv_fp8.GROUP_SCALED:
        check_group_scaled(spec)
    if spec.opt("kv_scale") is not None and kd != "e4m3":
        raise SpecError(f"kv_scale applies only to kv_dtype = \"e4m3\" (kv_dtype is "
                        f"{kd or spec.dtype!r})", key="kv_scale")


def check_group_scaled(spec: KernelSpec) -> None:
    """e4m3_ds is FlashMLA's / vLLM's fp8_ds_mla row exactly: rank 512 in four 128-column groups
    (so the four f32 scales are one 16-byte chunk and the RoPE part starts 16-byte aligned),
    bf16 RoPE values (so the dtype is bf16), on a paged cache."""
    why = 'kv_dtype = "e4m3_ds" (fp8_ds_mla rows: 512 e4m3, 4 f32 group scales, bf16 RoPE)'
    if spec.opt("kv_lora_rank") != 512:
        raise SpecError(f"kv_lora_rank = {spec.opt('kv_lora_rank')} with {why}; allowed: 512",
                        key="kv_lora_rank")
    if spec.dtype != "bf16":
        raise SpecError(f"dtype {spec.dtype!r} with {why}: the RoPE values are bf16; allowed: "
                        f"\"bf16\"", key="dtype")
    if "kv_layout" in dict(spec.options) and spec.opt("kv_layout") != "paged":
        raise SpecError(f"kv_layout = {spec.opt('kv_layout')!r} with {why}; allowed: \"paged\"",
                        key="kv_layout")


def validate(spec: KernelSpec) -> None:
    if spec.dtype == "f32":
        raise SpecError("dtype f32: MLA runs on tensor cores; use bf16 (DeepSeek, Kimi) or f16",
                        key="dtype")
    if spec.num_heads > MAX_HEADS:
        raise SpecError(f"num_heads = {spec.num_heads}: at most {MAX_HEADS} query heads per "
                        f"launch (the heads of one rank; DeepSeek-V3 has 128)", key="num_heads")
    check_cache_keys(spec)
    check_sparse(spec)
    check_page_size(spec)
    C.check_dtype_target(spec.dtype, spec.targets)
    old = [t for t in spec.targets if not TARGETS[t].has_mma_m16n8k16]
    if old:
        raise SpecError(f"mla uses mma.m16n8k16 and cp.async (sm_80+), but targets include "
                        f"{old[0]}; drop it", key="targets")
    view = attention_view(spec)
    configs = [varlen.configure(view, TARGETS[t]) for t in spec.targets]
    if spec.tile_dict().get("kv_loads") == "tma" and not any(getattr(c, "tma", False) for c in configs):
        raise SpecError(f"kv_loads = \"tma\" with targets {', '.join(spec.targets)}: TMA loads "
                        f"only the sm_90a wgmma and sm_100a tcgen05 tiles (64 head rows) of a dense "
                        f"latent cache of the dtype or of e4m3 (not e4m3_ds, not sparse), contiguous "
                        f"or in pages of >= 8 rows that are a power of two or a multiple of 64; "
                        f"allowed: \"cp_async\" or drop the key", key="tile.kv_loads")
    if spec.tile_dict().get("seesaw"):
        check_seesaw(spec, configs)
    if spec.opt("qk_products") == "e4m3":
        check_qk_products(spec)
    if spec.tile_dict().get("fp8_scores"):
        check_fp8_scores(spec, configs)
    if spec.tile_dict().get("dequant_warpgroup") and \
            not any(getattr(c, "dequant_warpgroup", False) for c in configs):
        raise SpecError(f"dequant_warpgroup = true with targets {', '.join(spec.targets)}: the "
                        f"dequantising warpgroup feeds the sm_90a wgmma and sm_100a tcgen05 tiles "
                        f"(64 head rows) from e4m3 or e4m3_ds rows the threads copy (kv_loads "
                        f"\"cp_async\"), dense or sparse; on sm_90a e4m3_ds with "
                        f"qk_rope_head_dim 64, and not sparse with qk_products \"e4m3\"; "
                        f"allowed: false", key="tile.dequant_warpgroup")


def check_qk_products(spec: KernelSpec) -> None:
    """qk_products = "e4m3" rounds each query row to e4m3 values on every target (the spec's
    numerics); the scores run on FP8 products where the cache's bytes are e4m3 with one scale
    and sm_90a's dequantising warpgroup copies them (latent_tile.LatentWgmmaConfig.qk_e4m3),
    on 16-bit products over the same values elsewhere. Over a cache of the dtype or e4m3_ds
    rows no tile has FP8 products to give, so it is refused there."""
    if spec.opt("kv_dtype") != "e4m3":
        raise SpecError(f"qk_products = \"e4m3\" with kv_dtype = \"{spec.opt('kv_dtype') or spec.dtype}\": "
                        f"the scores' FP8 products read the cache's e4m3 bytes (one scale); "
                        f"allowed: kv_dtype = \"e4m3\" or qk_products = \"dtype\"", key="qk_products")


def check_fp8_scores(spec: KernelSpec, configs: list) -> None:
    """tile.fp8_scores puts sm_90a's S on FP8 wgmma in promoted chains: the bf16 dequantising
    tile with qk_products = "e4m3", split scores and 16-row tiles (latent_tile.fp8_score_chains:
    where the chains fit in registers)."""
    if not any(getattr(c, "qk_e4m3", False) for c in configs):
        raise SpecError(f"fp8_scores = true with targets {', '.join(spec.targets)}: the scores run "
                        f"on FP8 wgmma on sm_90a's bf16 latent tile whose dequantising warpgroup "
                        f"copies e4m3 rows, with qk_products = \"e4m3\", split scores and block_n 16 "
                        f"(the chains' registers); allowed: false", key="tile.fp8_scores")


def check_seesaw(spec: KernelSpec, configs: list) -> None:
    """tile.seesaw runs on the sm_90a wgmma tile whose latent rows of the dtype come by TMA,
    at four stages (each warpgroup's tiles alternate between two of them)."""
    tile = spec.tile_dict()
    if tile.get("split_scores"):
        raise SpecError("split_scores = true with seesaw = true: the seesaw's warpgroups each "
                        "compute their own tiles' whole S; allowed: drop one of them",
                        key="tile.split_scores")
    if tile.get("num_stages", 4) != 4:
        raise SpecError(f"num_stages = {tile['num_stages']} with seesaw = true: each warpgroup's "
                        f"tiles alternate between two of four latent stages; allowed: 4 or drop "
                        f"the key", key="tile.num_stages")
    wgmma = [c for c in configs if getattr(c, "seesaw", False)]
    if not wgmma or any(not c.tma or c.fp8 for c in wgmma):
        raise SpecError(f"seesaw = true with targets {', '.join(spec.targets)}: the seesaw runs on "
                        f"the sm_90a wgmma tile (64 head rows) over TMA-loaded latent rows of the "
                        f"dtype (a dense cache, not e4m3 / e4m3_ds, not sparse, kv_loads \"tma\"); "
                        f"allowed: false", key="tile.seesaw")


def check_sparse(spec: KernelSpec) -> None:
    """Sparse top-k reads slots of a paged cache, and each tile holds one token's heads."""
    n = spec.opt("sparse_topk")
    if spec.opt("topk_length") and not n:
        raise SpecError("topk_length applies only to sparse_topk > 0 (sparse_topk is 0)",
                        key="topk_length")
    if not n:
        return
    if spec.opt("kv_layout") != "paged":
        raise SpecError(f"sparse_topk = {n} reads cache slots (page * page_size + offset) of a "
                        f"paged cache; kv_layout is {spec.opt('kv_layout')!r}; allowed: \"paged\"",
                        key="sparse_topk")
    if spec.num_heads % 16:   # tiles of 16 rows (or 32, 64: varlen.configure's gcd) per token
        raise SpecError(f"num_heads = {spec.num_heads}: sparse MLA tiles hold one token's heads, "
                        f"16 rows per warp; allowed: a multiple of 16", key="num_heads")
    bm = spec.tile_dict().get("block_m")
    if bm and spec.num_heads % bm:
        fits = [m for m in (16, 32, 64) if spec.num_heads % m == 0]
        raise SpecError(f"block_m = {bm} with num_heads = {spec.num_heads}: a sparse tile holds "
                        f"one token's heads; allowed: {' or '.join(map(str, fits))} (a divisor "
                        f"of num_heads)", key="tile.block_m")


def interface(spec: KernelSpec) -> Interface:
    return varlen.interface(attention_view(spec))


def build(spec: KernelSpec, target) -> Program:
    return varlen.build(attention_view(spec), target)


def resolve_tile(spec: KernelSpec, target) -> dict:
    return varlen.resolve_tile(attention_view(spec), target)


def make_inputs(spec: KernelSpec, dims: dict[str, int], rng) -> dict:
    from .mla_inputs import mla_batch, sparse_batch
    if spec.opt("sparse_topk"):
        return sparse_batch(spec, attention_view(spec), dims, rng, page_size(spec))
    return mla_batch(spec, attention_view(spec), dims, rng,
                     page_size(spec) if spec.opt("kv_layout") == "paged" else 0)


def reference(spec: KernelSpec, inputs: dict, dtype: str | None = None) -> dict:
    from .mla_inputs import mla_reference
    return mla_reference(attention_view(spec), inputs, dtype,
                         page_size(spec) if spec.opt("kv_layout") == "paged" else 0)


FAMILY = Family(name="mla", doc=__doc__.split("\n")[0], fields=FIELDS, validate=validate,
                interface=interface, build=build, resolve_tile=resolve_tile,
                make_inputs=make_inputs, reference=reference, derive=derive,
                row_sum_dtype=lambda spec: spec.dtype,
                ptx_reads_all_targets=lambda spec: True)   # the latent tile fits every target

__all__ = ["FAMILY", "attention_view", "check_cache_keys", "check_group_scaled", "derive", "latent_head"]
