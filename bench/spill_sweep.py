"""Every family x dtype x causal x head_dim (multiples of 8 from 16 to 256, and 512) x default
target, every option (one at a time, over the head sizes engines use), and MLA over every latent
rank x RoPE width x option set, lowered and assembled by the real ptxas; prints (or records) the
spill bytes, and on the arch-specific targets ptxas's performance-loss notes (C75xx: wgmma
serialised, setmaxnreg ignored, ...).

    python bench/spill_sweep.py [--out FILE.json] [--update FILE.json] [--jobs 2] [--floors]

tests/pipeline/test_spill_sweep.py runs the same matrix: it re-assembles every combination whose PTX is
not in the committed record tests/golden/spill_sweep.json (keyed by the PTX's sha256, the target
and the ptxas version) and a fixed sample of the recorded ones, and asserts 0 spills and no
performance note everywhere.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ptxc.errors import SpecError  # noqa: E402
from ptxc.pipeline.compiler import lower  # noqa: E402
from ptxc.kernels import load_text  # noqa: E402
from ptxc.targets import DEFAULT_TARGETS  # noqa: E402

HEAD_DIMS = tuple(range(16, 257, 8)) + (512,)
# (family, dtypes, causal values, extra spec lines): GQA 4 takes the tensor-core decode path,
# the "h4" decode rows (GQA 1) the SIMT one
FAMILIES = (
    ("prefill", ("f16", "bf16", "f32"), (True, False), "num_heads = 8\nnum_kv_heads = 2\n"),
    ("decode", ("f16", "bf16", "f32"), (None,), "num_heads = 8\nnum_kv_heads = 2\n"),
    ("decode", ("f16", "bf16"), (None,), "num_heads = 4\nnum_kv_heads = 4\n"),
    ("varlen", ("f16", "bf16"), (True, False), 'num_heads = 8\nnum_kv_heads = 2\nkv_layout = "paged"\n'
                                              "page_size = 16\n"),
    ("kv_append", ("f16", "bf16", "f32"), (None,), 'num_kv_heads = 2\nkv_layout = "paged"\npage_size = 16\n'),
    ("merge_states", ("f16", "bf16", "f32"), (None,), "num_heads = 8\nreturn_lse = true\n"),
)

# The head sizes engines use (vLLM's test sizes and the ends of the range): the options run over
# these in the default test run, over every head_dim in the record and with -m slow.
ENGINE_HEAD_DIMS = (16, 40, 64, 72, 80, 96, 112, 120, 128, 192, 256, 512)
# Every option one at a time, and the combinations models ship (Gemma 2: window + soft-cap;
# gpt-oss: window + sinks), over every head_dim, f16 (bf16 allocates alike):
# (family, causal, option lines, tag).
_GQA = "num_heads = 8\nnum_kv_heads = 2\n"
_PAGED = 'kv_layout = "paged"\npage_size = 16\n'
_SM90A = 'targets = ["sm_90a"]\n'   # rows for the sm_90a wgmma body (not a default target)
_SM100A = 'targets = ["sm_100a"]\n'  # rows for the sm_100a tcgen05 body (head_dim 64 / 128)
_EVERY = "sliding_window = 128\nattention_sinks = true\nlogits_soft_cap = 30.0\nalibi = true\n"
_SPLIT = 'num_splits = "auto"\nreturn_lse = true\n'
_TREE = 'custom_mask = "tree"\n'
_CHUNK = "attention_chunk = 8192\n"
_EVERYC = _EVERY + "attention_chunk = 96\n"   # both lower bounds (window and chunk) and the rest
OPTIONS = (
    # attention_chunk (Llama 4): alone, and beside every other variant on each body -- mma.sync
    # (default targets), sm_90a's one issuer / producer warpgroup / ping-pong / persistent CTAs,
    # sm_100a's tcgen05 tiles, decode's packed tiles
    ("prefill", True, _CHUNK, "chunk"),
    ("prefill", True, _EVERYC + "return_lse = true\n", "everychunk"),
    ("prefill", True, _EVERYC + _SM90A + '[kernel.tile]\nkv_loads = "tma"\nwarp_specialize = false\n',
     "onechunk_90a"),
    ("prefill", True, _EVERYC + _SM90A + "[kernel.tile]\npingpong = true\n", "ppchunk_90a"),
    ("prefill", True, _EVERYC + _SM90A + "[kernel.tile]\npersistent = true\n", "perschunk_90a"),
    ("prefill", True, _EVERYC + "return_lse = true\n" + _SM100A, "tcchunk_100a"),
    ("prefill", True, _EVERYC + "return_lse = true\n" + _SM100A
     + "[kernel.tile]\nq_tiles = 2\ncorrection = true\n", "tcq2crchunk_100a"),
    ("varlen", True, _PAGED + _CHUNK, "chunk"),
    ("varlen", True, _PAGED + _EVERYC + _SPLIT, "everychunk"),
    ("varlen", True, _PAGED + _EVERYC + _SM90A + "[kernel.tile]\nwarp_specialize = true\n", "wschunk_90a"),
    ("varlen", True, _PAGED + _EVERYC + _SM90A + "[kernel.tile]\nwarp_specialize = false\n", "onechunk_90a"),
    ("varlen", True, _PAGED + _EVERYC + _SM100A + "[kernel.tile]\nwarp_specialize = true\n",
     "tcwschunk_100a"),
    ("decode", None, _PAGED + _CHUNK + _SPLIT, "chunk"),
    ("decode", None, _PAGED + _EVERYC + _SPLIT + _SM90A + '[kernel.tile]\nkv_loads = "tma"\n', "wgchunk_90a"),
    ("decode", None, _PAGED + _EVERYC + _SPLIT + _SM100A + '[kernel.tile]\nkv_loads = "tma"\n',
     "tcchunk_100a"),
    ("prefill", True, "sliding_window = 1024\n", "win"),
    ("prefill", True, "logits_soft_cap = 50.0\n", "cap"),
    ("prefill", True, "attention_sinks = true\n", "sink"),
    ("prefill", True, "alibi = true\n", "alibi"),
    ("prefill", True, "return_lse = true\n", "lse"),
    ("prefill", False, 'custom_mask = "packed"\n', "mask"),
    ("prefill", True, "[kernel.tile]\nwarp_rows = 32\n", "wr32"),
    ("prefill", True, "sliding_window = 4096\nlogits_soft_cap = 50.0\n", "gemma2"),
    ("prefill", True, "sliding_window = 128\nattention_sinks = true\n", "gptoss"),
    # V's head narrower than K's (DeepSeek prefill: 192 / 128), mma.sync and the sm_90a wgmma body
    ("prefill", True, "head_dim_v = 128\n", "dv128"),
    ("prefill", True, "head_dim_v = 64\n", "dv64"),
    ("prefill", True, "head_dim_v = 128\nreturn_lse = true\n" + _SM90A, "dv128_90a"),
    ("prefill", False, "head_dim_v = 64\n" + _SM90A, "dv64_90a"),
    ("prefill", True, "head_dim_v = 128\nsliding_window = 128\nattention_sinks = true\n" + _SM90A
     + "[kernel.tile]\nwarp_specialize = true\n", "dv128gptossws_90a"),
    ("varlen", True, _PAGED + "head_dim_v = 128\n", "dv128"),
    # the consumers' ping-pong (sm_90a warp-specialised prefill), plain and with variants
    ("prefill", True, _SM90A + "[kernel.tile]\npingpong = true\n", "pp_90a"),
    # three consumer warpgroups (block_m 192, d64 only), plain and with variants
    ("prefill", False, _SM90A + "[kernel.tile]\nblock_m = 192\n", "m192_90a"),
    ("prefill", True, "sliding_window = 128\nattention_sinks = true\nalibi = true\nreturn_lse = true\n" + _SM90A
     + "[kernel.tile]\nblock_m = 192\n", "m192var_90a"),
    ("prefill", True, "sliding_window = 128\nattention_sinks = true\nlogits_soft_cap = 30.0\n" + _SM90A
     + "[kernel.tile]\npingpong = true\n", "ppvar_90a"),
    ("varlen", True, _PAGED + "sliding_window = 1024\n", "win"),
    ("varlen", True, _PAGED + "logits_soft_cap = 50.0\n", "cap"),
    ("varlen", True, _PAGED + "attention_sinks = true\n", "sink"),
    ("varlen", True, _PAGED + "alibi = true\n", "alibi"),
    ("varlen", True, _PAGED + 'kv_dtype = "e4m3"\n', "fp8"),
    ("varlen", True, _PAGED + 'kv_dtype = "e4m3"\nkv_scale = "head"\n', "fp8h"),
    # FP8 caches under the score transforms (a runtime unit per row: k_scale), every body
    ("varlen", True, _PAGED + 'kv_dtype = "e4m3"\nlogits_soft_cap = 50.0\n', "fp8cap"),
    ("varlen", True, _PAGED + 'kv_dtype = "e4m3"\nalibi = true\n', "fp8alibi"),
    ("varlen", True, _PAGED + 'kv_dtype = "e4m3"\nsliding_window = 4096\nlogits_soft_cap = 50.0\n', "fp8gemma2"),
    ("varlen", True, _PAGED + 'kv_dtype = "e5m2"\nkv_scale = "head"\n' + _EVERY + _SPLIT, "fp8every"),
    ("varlen", True, _PAGED + 'kv_dtype = "e4m3"\n' + _EVERY + _SM90A, "fp8every_90a"),
    ("varlen", True, _PAGED + 'kv_dtype = "e4m3"\n' + _EVERY + _SM100A, "fp8every_100a"),
    ("varlen", True, _PAGED + 'num_splits = "auto"\nreturn_lse = true\n', "split"),
    ("varlen", True, _PAGED + 'custom_mask = "tree"\n', "tree"),
    ("varlen", False, _PAGED + 'custom_mask = "packed"\n', "mask"),
    ("varlen", True, _PAGED + "sliding_window = 4096\nlogits_soft_cap = 50.0\n", "gemma2"),
    ("varlen", True, _PAGED + "sliding_window = 128\nattention_sinks = true\n", "gptoss"),
    ("decode", None, _PAGED + "sliding_window = 1024\n", "win"),
    ("decode", None, _PAGED + "logits_soft_cap = 50.0\nattention_sinks = true\n", "capsink"),
    ("decode", None, _PAGED + "alibi = true\n", "alibi"),
    ("decode", None, _PAGED + 'kv_dtype = "e4m3"\n', "fp8"),
    ("decode", None, _PAGED + 'kv_dtype = "e4m3"\nlogits_soft_cap = 50.0\nalibi = true\n' + _SPLIT, "fp8capalibi"),
    ("decode", None, _PAGED + 'num_splits = "auto"\nappend_kv = true\n', "splitapp"),
    ("decode", None, _PAGED + "sliding_window = 128\nattention_sinks = true\n", "gptoss"),
    ("decode", None, _PAGED + 'kv_dtype = "e4m3"\nkv_scale = "head"\nnum_splits = "auto"\nappend_kv = true\n',
     "fp8hsplitapp"),
    ("decode", None, _PAGED + 'kv_dtype = "e4m3"\nkv_scale = "device"\nnum_splits = "auto"\n', "fp8dsplit"),
    ("decode", None, 'kv_layout = "paged"\npage_size = 528\nnum_splits = "auto"\n', "p528"),
    # decode on sm_90a: varlen's wgmma tile (decode_mma.on_packed_tile) -- TMA with the producer
    # warpgroup at d128, one issuer elsewhere, cp.async for pointer arrays and FP8 -- plain
    # with a split and the fused append, every variant (its 128-key window would keep mma.sync:
    # the tile key asks for the wgmma tile), FP8, pointer arrays
    ("decode", None, _PAGED + 'num_splits = "auto"\nappend_kv = true\n' + _SM90A, "wg_90a"),
    ("decode", None, _PAGED + _EVERY + _SPLIT + _SM90A + '[kernel.tile]\nkv_loads = "tma"\n', "wgvar_90a"),
    ("decode", None, _PAGED + _EVERY + _SM90A + "[kernel.tile]\nwarp_specialize = true\n", "wgwsvar_90a"),
    ("decode", None, _PAGED + 'kv_dtype = "e4m3"\nkv_scale = "head"\n' + _SPLIT + _SM90A, "wgfp8_90a"),
    ("decode", None, 'kv_layout = "pointer_array"\n' + _SPLIT + _SM90A, "wgptr_90a"),
    # and on sm_100a varlen's tcgen05 tile (load / MMA / softmax warps), plain and every variant
    ("decode", None, _PAGED + 'num_splits = "auto"\nappend_kv = true\n' + _SM100A, "tc_100a"),
    ("decode", None, _PAGED + _EVERY + _SPLIT + _SM100A + '[kernel.tile]\nkv_loads = "tma"\n', "tcvar_100a"),
    ("varlen", True, _PAGED + 'kv_dtype = "e4m3"\nkv_scale = "device"\nnum_splits = "auto"\n', "fp8dsplit"),
    # FP8 caches on the sm_90a wgmma body (head_dim 64 / 128 / 256; other head dims mma.sync)
    ("varlen", True, _PAGED + 'kv_dtype = "e4m3"\n' + _SM90A, "fp8_90a"),
    ("varlen", True, _PAGED + 'kv_dtype = "e4m3"\nkv_scale = "head"\n' + _SPLIT + _SM90A, "fp8hsplit_90a"),
    ("varlen", False, 'kv_layout = "contiguous"\nkv_dtype = "e5m2"\nkv_scale = "device"\n' + _SM90A,
     "fp8dev_90a"),
    # tree masks on the sm_90a wgmma body, alone and with the variants that spilled at d128
    ("varlen", True, _PAGED + _TREE + _SPLIT + _SM90A, "tree_90a"),
    ("varlen", True, _PAGED + _TREE + "sliding_window = 1024\nattention_sinks = true\n" + _SM90A,
     "treewinsink_90a"),
    ("varlen", True, 'kv_layout = "contiguous"\n' + _TREE + "logits_soft_cap = 30.0\nalibi = true\n" + _SM90A,
     "treecapalibi_90a"),
    ("varlen", True, _PAGED + _TREE + 'kv_dtype = "e4m3"\nkv_scale = "head"\n' + _SM90A, "treefp8_90a"),
    ("varlen", True, 'kv_layout = "paged"\npage_size = 528\n', "p528"),
    # the sm_100a tcgen05 bodies (prefill; varlen's packed tile at M = 64), plain and with every
    # variant; other head dims take mma.sync there
    ("prefill", True, "return_lse = true\n" + _SM100A, "tc_100a"),
    ("prefill", True, _EVERY + "return_lse = true\n" + _SM100A, "tcvar_100a"),
    ("prefill", False, _SM100A + "[kernel.tile]\nwarp_specialize = true\n", "tcws_100a"),
    ("prefill", True, _EVERY + _SM100A + "[kernel.tile]\nwarp_specialize = false\n", "tcone_100a"),
    ("prefill", True, "head_dim_v = 128\n" + _EVERY + _SM100A, "tcdv128_100a"),
    # two Q tiles per CTA (FA4's structure; head_dim 64 and 128, setmaxnreg), plain and with
    # every variant, and V narrower than K
    ("prefill", False, _SM100A + "[kernel.tile]\nq_tiles = 2\n", "tcq2_100a"),
    ("prefill", True, _EVERY + "return_lse = true\n" + _SM100A + "[kernel.tile]\nq_tiles = 2\n",
     "tcq2var_100a"),
    ("prefill", True, "head_dim_v = 64\n" + _SM100A + "[kernel.tile]\nq_tiles = 2\n", "tcq2dv64_100a"),
    # the correction warpgroup (every tcgen05 head dim), plain and with every variant
    ("prefill", False, _SM100A + "[kernel.tile]\ncorrection = true\n", "tccr_100a"),
    ("prefill", True, _EVERY + "return_lse = true\n" + _SM100A + "[kernel.tile]\ncorrection = true\n",
     "tccrvar_100a"),
    ("prefill", True, "head_dim_v = 128\n" + _SM100A + "[kernel.tile]\ncorrection = true\n",
     "tccrdv128_100a"),
    # both: two Q tiles and the correction warpgroup (768 threads, 80 registers at entry;
    # setmaxnreg 48 / 48 / 96), plain, with every variant, and V narrower than K
    ("prefill", False, _SM100A + "[kernel.tile]\nq_tiles = 2\ncorrection = true\n", "tcq2cr_100a"),
    ("prefill", True, _EVERY + "return_lse = true\n" + _SM100A +
     "[kernel.tile]\nq_tiles = 2\ncorrection = true\n", "tcq2crvar_100a"),
    ("prefill", True, "head_dim_v = 64\n" + _SM100A + "[kernel.tile]\nq_tiles = 2\ncorrection = true\n",
     "tcq2crdv64_100a"),
    # O by TMA stores (tile.tma_store), on both generations' TMA kernels, plain and with every
    # variant (the slab addresses are made in the epilogue)
    ("prefill", True, "return_lse = true\n" + _SM90A + "[kernel.tile]\ntma_store = true\n", "tmast_90a"),
    ("prefill", True, _EVERY + _SM90A + "[kernel.tile]\ntma_store = true\n", "tmastvar_90a"),
    ("prefill", True, "return_lse = true\n" + _SM100A + "[kernel.tile]\ntma_store = true\n", "tmast_100a"),
    ("prefill", True, _EVERY + _SM100A + "[kernel.tile]\ntma_store = true\n", "tmastvar_100a"),
    # persistent CTAs (tile.persistent: the producer's per-tile place in its 24 or 56
    # registers; O apart or over Q), plain, with every variant, with ping-pong and TMA stores
    ("prefill", True, "return_lse = true\n" + _SM90A + "[kernel.tile]\npersistent = true\n", "pers_90a"),
    ("prefill", True, _EVERY + _SM90A + "[kernel.tile]\npersistent = true\n", "persvar_90a"),
    ("prefill", True, _EVERY + _SM90A + "[kernel.tile]\npersistent = true\npingpong = true\n",
     "perspp_90a"),
    ("prefill", True, _EVERY + _SM90A + "[kernel.tile]\npersistent = true\ntma_store = true\n",
     "perstmast_90a"),
    ("prefill", True, "head_dim_v = 128\n" + _SM90A + "[kernel.tile]\npersistent = true\n",
     "persdv128_90a"),
    # exp2_poly: every exponential by the FMA polynomial (the most registers), both kernels
    ("prefill", True, _EVERY + _SM100A + "[kernel.tile]\nexp2_poly = 8\n", "tcpoly_100a"),
    ("prefill", True, _SM100A + "[kernel.tile]\nexp2_poly = 8\nwarp_specialize = false\n",
     "tcpolyone_100a"),
    ("varlen", True, _PAGED + "head_dim_v = 128\n" + _EVERY + _SM100A, "tcdv128_100a"),
    ("varlen", True, _PAGED + _SPLIT + _SM100A, "tcsplit_100a"),
    ("varlen", True, 'kv_layout = "contiguous"\n' + _EVERY + _SM100A, "tcvar_100a"),
    # varlen's load / MMA / softmax warps (the default from d128 at block_m 64) at every head dim
    # and at block_m 128, and the one-issuer tile where the default is the other
    ("varlen", True, _PAGED + _EVERY + _SM100A + "[kernel.tile]\nwarp_specialize = true\n", "tcws_100a"),
    ("varlen", False, _PAGED + _SPLIT + _SM100A +
     "[kernel.tile]\nblock_m = 128\nnum_warps = 8\nwarp_specialize = true\n", "tcws128_100a"),
    ("varlen", True, 'kv_layout = "contiguous"\n' + _EVERY + _SM100A +
     "[kernel.tile]\nwarp_specialize = false\n", "tcone_100a"),
    # varlen's sm_90a producer warpgroup (the default at d128 and 192 / 128) at every head dim: plain with a
    # split, every variant, a tree mask, V narrower than K, and two consumer warpgroups
    ("varlen", True, _PAGED + _SPLIT + _SM90A + "[kernel.tile]\nwarp_specialize = true\n", "ws_90a"),
    ("varlen", True, _PAGED + _EVERY + _SM90A + "[kernel.tile]\nwarp_specialize = true\n", "wsvar_90a"),
    ("varlen", True, _PAGED + _TREE + _SPLIT + _SM90A + "[kernel.tile]\nwarp_specialize = true\n",
     "wstree_90a"),
    ("varlen", True, _PAGED + "head_dim_v = 128\n" + _SM90A + "[kernel.tile]\nwarp_specialize = true\n",
     "wsdv128_90a"),
    # ... and V narrower than K by default (DeepSeek's 192 / 128: 64-key tiles, varlen_tile.WS_TILES;
    # the tree keeps 32) with every variant and with a tree mask
    ("varlen", True, _PAGED + "head_dim_v = 128\n" + _EVERY + _SM90A, "dv128var_90a"),
    ("varlen", True, _PAGED + "head_dim_v = 128\n" + _TREE + _SPLIT + _SM90A, "dv128tree_90a"),
    ("varlen", False, 'kv_layout = "contiguous"\n' + _SPLIT + _SM90A +
     "[kernel.tile]\nblock_m = 128\nnum_warps = 8\nwarp_specialize = true\n", "ws128_90a"),
    ("varlen", True, _PAGED + _EVERY + _SM90A +
     "[kernel.tile]\nblock_m = 128\nnum_warps = 8\nwarp_specialize = true\npingpong = true\n", "wspp_90a"),
    ("varlen", True, _PAGED + _EVERY + _SM90A + "[kernel.tile]\nwarp_specialize = false\n", "one_90a"),
    ("varlen", True, _PAGED + _EVERY, "every"),
    # the correction warps on varlen's tile (M = 64, and 128 with a split)
    ("varlen", True, _PAGED + _EVERY + _SM100A + "[kernel.tile]\ncorrection = true\n", "tccr_100a"),
    ("varlen", False, _PAGED + _SPLIT + _SM100A +
     "[kernel.tile]\nblock_m = 128\nnum_warps = 8\ncorrection = true\n", "tccr128_100a"),
    ("kv_append", None, _PAGED + 'kv_dtype = "e4m3"\nkv_scale = "head"\n', "fp8h"),
    ("kv_append", None, _PAGED + 'rope = "neox"\nnum_heads = 8\n', "rope"),
    ("kv_append", None, _PAGED + 'index = "slot_mapping"\n', "slots"),
    ("kv_append", None, _PAGED + 'index = "slot_mapping"\nkv_dtype = "e4m3"\nrope = "neox"\nnum_heads = 8\n',
     "slotsfp8rope"),
)


# MLA (no head_dim key of its own: kv_lora_rank + qk_rope_head_dim): every rank and RoPE width
# the spec allows with the record and -m slow, the DeepSeek/Kimi shape and the ends of the rank
# range by default; each option set over 128 heads.
MLA_RANKS = tuple(range(128, 513, 64))
MLA_ROPES = tuple(range(16, 129, 16))
MLA_OPTIONS = (
    ("", "base"),                                        # paged 64, num_splits "auto", lse
    ("num_splits = 1\nreturn_lse = false\n", "nosplit"),
    ('kv_layout = "contiguous"\n', "contig"),
    ('kv_dtype = "e4m3"\n', "fp8"),
    ('kv_dtype = "e4m3"\nkv_scale = "device"\nkv_layout = "contiguous"\nnum_splits = 1\n', "fp8dev"),
    ("page_size = 1\n", "p1"),
    ("sparse_topk = 2048\ntopk_length = true\n", "sparse"),
    ('sparse_topk = 2048\nkv_dtype = "e4m3"\nnum_splits = 1\n', "sparsefp8"),
    # qk_products: Q rounded to e4m3 values on every tile (FP8 products on sm_89 / sm_120, and
    # on sm_90a's dequantising-warpgroup tile with tile.fp8_scores: MLA_QK8_FP8S below)
    ('kv_dtype = "e4m3"\nqk_products = "e4m3"\n', "qk8"),
    ('sparse_topk = 2048\nkv_dtype = "e4m3"\nqk_products = "e4m3"\n', "qk8sparse"),
)


MLA_APPEND_OPTIONS = (("", "base"), ('kv_dtype = "e4m3"\nrope = "neox"\n', "fp8neox"),
                      ('kv_dtype = "e4m3"\nkv_scale = "device"\nrope = "gptj"\n', "fp8devgptj"))
# fp8_ds_mla rows (kv_dtype = "e4m3_ds") exist for bf16 at rank 512 only: every RoPE width
MLA_DS_OPTIONS = (
    ('kv_dtype = "e4m3_ds"\n', "ds"),
    ('kv_dtype = "e4m3_ds"\nnum_splits = 1\nreturn_lse = false\npage_size = 1\n', "dsnosplit"),
    ('kv_dtype = "e4m3_ds"\nsparse_topk = 2048\ntopk_length = true\n', "dssparse"),
)
WIDE_TARGETS = ("sm_80", "sm_90", "sm_90a", "sm_100")   # >= 128 KiB of shared memory per CTA (sm_90a: the wgmma latent tile)
MLA_WG_LOADS = (("page_size = 16\n", "p16"), ('[kernel.tile]\nkv_loads = "cp_async"\n', "cpasync"),
                ("[kernel.tile]\nsplit_scores = false\n", "unsplit"),
                ('[kernel.tile]\nkv_loads = "cp_async"\nsplit_scores = true\n', "cpasyncsplit"),
                ('kv_dtype = "e4m3"\n[kernel.tile]\nsplit_scores = false\n', "fp8unsplit"),
                ('kv_dtype = "e4m3"\n[kernel.tile]\nkv_loads = "tma"\n', "fp8tma"),
                ('kv_dtype = "e4m3"\n[kernel.tile]\ndequant_warpgroup = false\n', "fp8fused"),
                ('kv_dtype = "e4m3"\nkv_scale = "device"\nkv_layout = "contiguous"\n', "fp8devcontig"),
                ('kv_dtype = "e4m3"\nkv_layout = "contiguous"\n[kernel.tile]\nkv_loads = "tma"\n'
                 'split_scores = false\n', "fp8tmaunsplit"),
                ("[kernel.tile]\nseesaw = true\n", "seesaw"),
                ('page_size = 16\n[kernel.tile]\nseesaw = true\n', "seesawp16"),
                ('kv_layout = "contiguous"\n[kernel.tile]\nseesaw = true\n', "seesawcontig"),
                ("[kernel.tile]\nseesaw = true\nblock_n = 16\n", "seesawbn16"))
MLA_DS_UNSPLIT = (('kv_dtype = "e4m3_ds"\n[kernel.tile]\nsplit_scores = false\n', "dsunsplit"),
                  ('kv_dtype = "e4m3_ds"\nsparse_topk = 2048\n[kernel.tile]\nsplit_scores = false\n',
                   "dssparseunsplit"),
                  # every warp converting (the dequantising warpgroup is the default)
                  ('kv_dtype = "e4m3_ds"\n[kernel.tile]\ndequant_warpgroup = false\n', "dsfused"),
                  ('kv_dtype = "e4m3_ds"\nsparse_topk = 2048\n[kernel.tile]\ndequant_warpgroup = false\n',
                   "dssparsefused"))
# e4m3 score products (qk_products) on sm_90a: the dequantising warpgroup's tile (RoPE columns in
# whole 64-column slabs: 64, 128) contiguous and unsplit, and the other wgmma tiles over the
# rounded Q (TMA-staged rows, every warp converting)
MLA_QK8 = (('kv_dtype = "e4m3"\nkv_scale = "device"\nkv_layout = "contiguous"\nqk_products = "e4m3"\n',
            "qk8devcontig"),
           ('kv_dtype = "e4m3"\nqk_products = "e4m3"\npage_size = 16\nnum_heads = 64\n[kernel.tile]\n'
            'split_scores = false\n', "qk8unsplit"),
           ('kv_dtype = "e4m3"\nqk_products = "e4m3"\n[kernel.tile]\nkv_loads = "tma"\n', "qk8tma"),
           ('kv_dtype = "e4m3"\nqk_products = "e4m3"\n[kernel.tile]\ndequant_warpgroup = false\n', "qk8fused"))
# ... and S on FP8 wgmma (tile.fp8_scores: bf16 only, three chains at block_n 16): paged and
# contiguous, tensor and device scales, 128 and 64 heads
MLA_QK8_FP8S = (('kv_dtype = "e4m3"\nqk_products = "e4m3"\n[kernel.tile]\nfp8_scores = true\n', "qk8fp8s"),
                ('kv_dtype = "e4m3"\nkv_scale = "device"\nkv_layout = "contiguous"\nqk_products = "e4m3"\n'
                 'num_splits = 1\nreturn_lse = false\n[kernel.tile]\nfp8_scores = true\n', "qk8fp8sdevcontig"),
                ('kv_dtype = "e4m3"\nqk_products = "e4m3"\npage_size = 16\nnum_heads = 64\n[kernel.tile]\n'
                 'fp8_scores = true\n', "qk8fp8sh64"))
MLA_APPEND_DS_OPTIONS = (('kv_dtype = "e4m3_ds"\n', "ds"), ('kv_dtype = "e4m3_ds"\nrope = "gptj"\n', "dsgptj"))
# sm_100a alone: the tcgen05 latent tile (two value CTAs) over its layouts and tile keys, 64 and
# 128 heads -- dense caches of the dtype by TMA, FP8 rows by a dequantising warpgroup (the
# default) or every warp converting (TMA-staged e4m3; e4m3_ds by cp.async, which with 128 RoPE
# columns keeps the mma.sync tile: three stages do not fit), sparse top-k, pages no box fits
# and kv_loads = "cp_async" by the threads' cp.async
MLA_TC_OPTIONS = (("", "base"), ("num_splits = 1\nreturn_lse = false\n", "nosplit"),
                  ('kv_layout = "contiguous"\n', "contig"), ("page_size = 16\n", "p16"),
                  ("page_size = 8\nnum_heads = 64\n", "p8h64"),
                  ("[kernel.tile]\nblock_n = 16\n", "bn16"), ("[kernel.tile]\nnum_stages = 3\n", "st3"),
                  ('kv_dtype = "e4m3"\n', "fp8"),
                  ('kv_dtype = "e4m3"\nkv_scale = "device"\nkv_layout = "contiguous"\nnum_splits = 1\n', "fp8dev"),
                  ('kv_dtype = "e4m3"\nqk_products = "e4m3"\n', "qk8"),
                  ('kv_dtype = "e4m3"\npage_size = 16\n[kernel.tile]\nblock_n = 16\nnum_stages = 3\n', "fp8bn16"),
                  ('kv_dtype = "e4m3"\n[kernel.tile]\ndequant_warpgroup = false\n', "fp8fused"),
                  ('kv_dtype = "e4m3"\n[kernel.tile]\nkv_loads = "tma"\n', "fp8tma"))
MLA_TC_CP_ASYNC = (('kv_dtype = "e4m3_ds"\n', "ds"), ("sparse_topk = 2048\ntopk_length = true\n", "sparse"),
                   ('kv_dtype = "e4m3_ds"\nsparse_topk = 2048\n', "dssparse"),
                   ('kv_dtype = "e4m3"\nsparse_topk = 2048\nnum_splits = 1\n', "sparsefp8"),
                   ('kv_dtype = "e4m3_ds"\nnum_splits = 1\nreturn_lse = false\npage_size = 1\n', "dsnosplit"),
                   ("page_size = 12\n", "p12"), ('[kernel.tile]\nkv_loads = "cp_async"\n', "cpasync"),
                   ('kv_dtype = "e4m3_ds"\n[kernel.tile]\ndequant_warpgroup = false\n', "dsfused"))


def _mla_rows(full: bool):
    for dtype in ("bf16", "f16"):
        for option, tag in MLA_APPEND_OPTIONS:
            for rank in MLA_RANKS if full else (128, 512):
                for rope in MLA_ROPES if full else (16, 64, 128):
                    extra = f"kv_lora_rank = {rank}\nqk_rope_head_dim = {rope}\n" + option
                    yield (f"mla_append_{tag}_{dtype}_r{rank}_p{rope}", "mla_append", dtype, rank + rope,
                           extra, None)
        for option, tag in MLA_OPTIONS:
            for rank in MLA_RANKS if full else (128, 256, 512):
                for rope in MLA_ROPES if full else ((16, 64, 128) if rank == 512 else (64,)):
                    extra = (f"num_heads = 128\nsoftmax_scale = 0.1\nkv_lora_rank = {rank}\n"
                             f"qk_rope_head_dim = {rope}\n" + option)
                    yield f"mla_{tag}_{dtype}_r{rank}_p{rope}", "mla", dtype, rank + rope, extra, None
    # sparse top-k at TP 8's 16 heads (a tile holds one token's heads): above 256 + 0 columns
    # one warp's threads cannot copy a row a chunk each, so warps share the 16 rows
    for dtype in ("bf16", "f16"):
        for option, tag in (("sparse_topk = 2048\n", "sparse16"),
                            ('sparse_topk = 2048\nkv_dtype = "e4m3"\nnum_splits = 1\n', "sparsefp816")):
            for rank in MLA_RANKS if full else (192, 256, 512):
                for rope in MLA_ROPES if full else (16, 128):
                    extra = (f"num_heads = 16\nsoftmax_scale = 0.1\nkv_lora_rank = {rank}\n"
                             f"qk_rope_head_dim = {rope}\n" + option)
                    yield f"mla_{tag}_{dtype}_r{rank}_p{rope}", "mla", dtype, rank + rope, extra, None
    # 64 head rows per CTA (16 warps; varlen_config.latent_block_m) where every target holds the tile:
    # the same options over the large-shared-memory targets, ranks above 256 (four warps per 16 rows)
    for dtype in ("bf16", "f16"):
        for option, tag in MLA_OPTIONS + (MLA_DS_OPTIONS if dtype == "bf16" else ()):
            for rank in [r for r in MLA_RANKS if r > 256] if full else (320, 512):
                if "e4m3_ds" in option and rank != 512:
                    continue
                for rope in MLA_ROPES if full else (16, 64, 128):
                    extra = (f"num_heads = 128\nsoftmax_scale = 0.1\nkv_lora_rank = {rank}\n"
                             f"qk_rope_head_dim = {rope}\ntargets = {json.dumps(list(WIDE_TARGETS))}\n" + option)
                    yield f"mla_wide_{tag}_{dtype}_r{rank}_p{rope}", "mla", dtype, rank + rope, extra, None
    # sm_90a alone: the wgmma latent tile takes 64 head rows for sparse top-k and e4m3_ds too;
    # dense caches of the dtype by TMA (paged 64 and 16, contiguous) and by cp.async
    for dtype in ("bf16", "f16"):
        for option, tag in MLA_OPTIONS + MLA_WG_LOADS + (MLA_DS_OPTIONS + MLA_DS_UNSPLIT if dtype == "bf16" else ()):
            for rope in MLA_ROPES if full else (16, 64, 128):
                extra = (f"num_heads = 128\nsoftmax_scale = 0.1\nqk_rope_head_dim = {rope}\n"
                         f'targets = ["sm_90a"]\n' + option)
                yield f"mla_wg_{tag}_{dtype}_r512_p{rope}", "mla", dtype, 512 + rope, extra, None
        for option, tag in MLA_QK8 + (MLA_QK8_FP8S if dtype == "bf16" else ()):
            for rope in (64, 128):
                heads = "" if "num_heads" in option else "num_heads = 128\n"
                extra = (f"{heads}softmax_scale = 0.1\nqk_rope_head_dim = {rope}\n"
                         f'targets = ["sm_90a"]\n' + option)
                yield f"mla_wg_{tag}_{dtype}_r512_p{rope}", "mla", dtype, 512 + rope, extra, None
    for dtype in ("bf16", "f16"):
        for option, tag in MLA_TC_OPTIONS + tuple(o for o in MLA_TC_CP_ASYNC
                                                  if dtype == "bf16" or "e4m3_ds" not in o[0]):
            for rope in MLA_ROPES if full else (64, 128):
                heads = "" if "num_heads" in option else "num_heads = 128\n"
                extra = (f"{heads}softmax_scale = 0.1\nqk_rope_head_dim = {rope}\n"
                         f'targets = ["sm_100a"]\n' + option)
                yield f"mla_tc_{tag}_{dtype}_r512_p{rope}", "mla", dtype, 512 + rope, extra, None
    for rope in MLA_ROPES if full else (16, 64, 128):
        for option, tag in MLA_APPEND_DS_OPTIONS:
            yield (f"mla_append_{tag}_bf16_r512_p{rope}", "mla_append", "bf16", 512 + rope,
                   f"qk_rope_head_dim = {rope}\n" + option, None)
        for option, tag in MLA_DS_OPTIONS:
            yield (f"mla_{tag}_bf16_r512_p{rope}", "mla", "bf16", 512 + rope,
                   f"num_heads = 128\nsoftmax_scale = 0.1\nqk_rope_head_dim = {rope}\n" + option, None)


def _spec_text(name, family, dtype, d, extra, causal):
    """The kernel table; a [kernel.tile] table in `extra` goes last."""
    body, _, tile = extra.partition("[kernel.tile]\n")
    return (f'[[kernel]]\nname = "{name}"\nfamily = "{family}"\ndtype = "{dtype}"\n'
            f"head_dim = {d}\n{body}" + ("" if causal is None else f"causal = {str(causal).lower()}\n")
            + ("" if "targets = " in body else f"targets = {json.dumps(list(DEFAULT_TARGETS))}\n")
            + (f"[kernel.tile]\n{tile}" if tile else ""))


def _rows(full: bool = True):
    for family, dtypes, causals, extra in FAMILIES:
        head = f"h{extra.split()[2]}" if family == "decode" else ""
        for dtype in dtypes:
            for causal in causals:
                for d in HEAD_DIMS:
                    yield (f"{family}{head}_{dtype}_d{d}" + ("" if causal is None else f"_c{int(causal)}"),
                           family, dtype, d, extra, causal)
    for family, causal, option, tag in OPTIONS:
        extra = ("num_kv_heads = 2\n" if family == "kv_append" else _GQA) + option
        for d in HEAD_DIMS if full else ENGINE_HEAD_DIMS:
            yield f"{family}_{tag}_f16_d{d}", family, "f16", d, extra, causal
    yield from _mla_rows(full)


def combinations():
    """(name, spec, target): every combination the spec accepts."""
    for name, family, dtype, d, extra, causal in _rows():
        try:
            [spec] = load_text(_spec_text(name, family, dtype, d, extra, causal), f"{name}.toml")
        except SpecError:
            continue          # a head_dim this family/dtype/option does not allow
        for target in spec.targets:   # DEFAULT_TARGETS unless the row names its own
            yield name, spec, target


def _lower_row(row):
    name, family, dtype, d, extra, causal = row
    try:
        [spec] = load_text(_spec_text(name, family, dtype, d, extra, causal), f"{name}.toml")
    except SpecError:
        return []             # a head_dim this family/dtype/option does not allow
    out = []
    for target in spec.targets:
        ptx = lower(spec, target)[0]
        out.append((name, target, ptx, hashlib.sha256(ptx.encode()).hexdigest()))
    return out


def lowered(jobs=2, full=True):
    """[(name, target, ptx, sha256)] for the whole matrix (front end only: a minute on 2 cores);
    `full=False`: the options over ENGINE_HEAD_DIMS only."""
    rows = list(_rows(full))
    if jobs <= 1:
        return [it for row in rows for it in _lower_row(row)]
    import multiprocessing
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        return [it for part in pool.map(_lower_row, rows, chunksize=16) for it in part]


def assemble_all(items, tc, jobs=2):
    """{(name, target): {"sha": ..., "spill_bytes": ..., "registers": max}} by real ptxas, and on
    the arch-specific targets (wgmma, setmaxnreg, tcgen05) "performance_notes": ptxas's C75xx
    notes over the entries (wgmma serialised, setmaxnreg ignored, ...)."""
    from ptxc.pipeline.ptxas import assemble

    def one(item):
        name, target, ptx, sha = item
        _, res, _ = assemble(ptx, target, tc, name)
        spills = sum(r.spill_stores + r.spill_loads for r in res.values())
        out = {"sha": sha, "spill_bytes": spills, "registers": max(r.registers for r in res.values())}
        if target in NOTED_TARGETS:
            out["performance_notes"] = sum(r.performance_notes for r in res.values())
        return (name, target), out
    with ThreadPoolExecutor(jobs) as pool:
        return dict(pool.map(one, items))


NOTED_TARGETS = ("sm_90a", "sm_100a", "sm_103a")   # where wgmma / setmaxnreg / tcgen05 exist


def failed(v: dict) -> bool:
    """A combination that spills or that ptxas notes a performance loss for."""
    return bool(v["spill_bytes"] or v.get("performance_notes"))


def reusable(entry: dict | None, target: str, sha: str) -> bool:
    """A record entry that holds this PTX's result (on a NOTED_TARGETS target, with the
    performance-note check, which older records lack)."""
    return bool(entry) and entry.get("sha") == sha and (target not in NOTED_TARGETS
                                                         or "performance_notes" in entry)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--update", type=Path, metavar="RECORD",
                    help="reuse RECORD's results for PTX it holds (same sha256 and ptxas); assemble the rest")
    ap.add_argument("--floors", action="store_true",
                    help="print the spilling shapes as ptxc/kernels/config/register_floor.py keys (and which table)")
    args = ap.parse_args(argv)
    from ptxc.pipeline.ptxas import toolchain
    tc = toolchain()
    items = lowered(args.jobs)
    known = {}
    if args.update and args.update.exists():
        record = json.loads(args.update.read_text())
        if record.get("ptxas_version") == tc.version:
            known = record["entries"]
    reused = {(n, t): known[f"{n}/{t}"] for n, t, _, sha in items
              if reusable(known.get(f"{n}/{t}"), t, sha)}
    results = {**reused, **assemble_all([it for it in items if (it[0], it[1]) not in reused], tc, args.jobs)}
    bad = {k: v for k, v in results.items() if failed(v)}
    for (name, target), v in sorted(bad.items()):
        if v["spill_bytes"]:
            print(f"SPILL {name} {target}: {v['spill_bytes']} B ({v['registers']} registers)")
        if v.get("performance_notes"):
            print(f"PERFORMANCE {name} {target}: {v['performance_notes']} C75xx notes (ptxas -v names them)")
    print(f"{len(results)} combinations, {len(bad)} spill or carry a performance note (ptxas {tc.version})")
    if args.floors:
        bad = {k: v for k, v in bad.items() if v["spill_bytes"]}
        from ptxc.kernels.config.register_floor import shape_key
        from ptxc.targets import get_target
        specs = {(n, t): spec for n, spec, t in combinations()}
        for n, t in sorted(bad):
            spec = specs[(n, t)]
            if spec.family == "mla":   # keyed as the varlen spec it compiles as
                from ptxc.kernels.families.mla import attention_view
                spec = attention_view(spec)
            remedy = "NARROW_TILES" if results[(n, t)]["registers"] >= 254 else "SPILLING_SHAPES"
            print(f"{remedy}: {shape_key(spec.family, spec, get_target(t))}")
    if args.out:
        record = {"ptxas_version": tc.version,
                  "entries": {f"{n}/{t}": v for (n, t), v in sorted(results.items())}}
        args.out.write_text(json.dumps(record, indent=0, sort_keys=True) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
