"""Model variants (issue 11) in every attention family: sliding window, logits soft-cap,
attention sinks, ALiBi, a separate V head size, head_dim above 256.

Each option runs the real PTX in the emulator against the fp64 reference (FA2 tolerance rule)
on prefill, decode and varlen, f16 and bf16 (f32 where the family has it), GQA and MQA, odd
lengths, windows smaller than a tile, equal to one and larger than the sequence. Skipped work is
shown by emulated instruction counts, and NaN-filled pages outside a window keep the output
finite (they are never read). The long sweep is marked slow.
"""

import numpy as np
import pytest

from conftest import assert_pass, build_kernel
from ptxc.errors import SpecError
from ptxc.kernels import FAMILIES
from ptxc import reference as ref
from ptxc.runtime.launch_test import check_artifact
from ptxc.kernels import load_text
from ptxc.spec.model import KernelSpec

emu = pytest.importorskip("ptxc.emu", reason="the emulator is needed for numerical checks")
HEADS = {"mha": (2, 2), "gqa4": (8, 2), "mqa": (4, 1)}


def _body(dtype, head_dim, heads, extra, causal=True, lse=True):
    h, hk = HEADS[heads]
    return (f'dtype = "{dtype}"\nhead_dim = {head_dim}\nnum_heads = {h}\nnum_kv_heads = {hk}\n'
            f"return_lse = {str(lse).lower()}\n" + (f"causal = {str(causal).lower()}\n" if causal is not None else "")
            + extra)


def _check(tmp_path, family, body, shapes, tile="", seed=3):
    art = build_kernel(tmp_path, family, body, tile)
    for i, shape in enumerate(shapes):
        assert_pass(check_artifact(art, backend="emu", shapes=shape, seed=seed + i))


PREFILL_SHAPES = [{"batch": 1, "seq_q": 17, "seq_k": 113}, {"batch": 2, "seq_q": 1, "seq_k": 17},
                  {"batch": 1, "seq_q": 113, "seq_k": 113}]
SMALL = {"f32": "block_m = 16\nblock_n = 16", "f16": "block_m = 32\nblock_n = 16\nnum_stages = 2",
         "bf16": "block_m = 32\nblock_n = 16\nnum_stages = 2"}

# (dtype, heads, window, soft cap): windows below a 16-key tile, equal to one, spanning several,
# larger than every sequence; soft-caps small enough to bend the scores.
SLOW = pytest.mark.slow
PREFILL_CASES = [("f16", "gqa4", 5, None), pytest.param("bf16", "mqa", 16, None, marks=SLOW),
                 pytest.param("f32", "mha", 40, None, marks=SLOW), ("f16", "mha", 1000, None),
                 pytest.param("bf16", "gqa4", None, 2.0, marks=SLOW), ("f32", "mqa", 7, 1.5),
                 pytest.param("f16", "mqa", 33, 3.0, marks=SLOW)]


def _variant_keys(window, cap):
    return (f"sliding_window = {window}\n" if window else "") + \
        (f"logits_soft_cap = {cap}\n" if cap else "")


@pytest.mark.parametrize("dtype,heads,window,cap", PREFILL_CASES)
def test_prefill_variants(tmp_path, dtype, heads, window, cap):
    _check(tmp_path, "prefill", _body(dtype, 40 if dtype != "f32" else 24, heads,
                                      _variant_keys(window, cap), causal=window is not None or None),
           PREFILL_SHAPES, SMALL[dtype])


DECODE_CASES = [("f16", "gqa4", 5, None, 'kv_layout = "paged"\npage_size = 4\n'),
                ("bf16", "mqa", 16, 2.0, 'num_splits = 3\n'),
                pytest.param("f32", "mha", 40, None, 'kv_layout = "paged"\npage_size = 16\nnum_splits = 2\n',
                             marks=SLOW),
                ("f32", "gqa4", None, 1.5, ''), pytest.param("f16", "mqa", 1000, None, '', marks=SLOW)]


@pytest.mark.parametrize("dtype,heads,window,cap,layout", DECODE_CASES)
def test_decode_variants(tmp_path, dtype, heads, window, cap, layout):
    # seq_lens cycle through the full cache (37), 0, 1, 21 and 17
    _check(tmp_path, "decode", _body(dtype, 64, heads, _variant_keys(window, cap) + layout, causal=None),
           [{"batch": 5, "max_seq_len": 37} if "paged" not in layout else
            {"batch": 5, "max_pages_per_seq": 40 // int(layout.split("page_size = ")[1].split()[0]),
             "num_pages": 60}])


VARLEN_CASES = [("f16", "gqa4", 5, None, "page_size = 16\n"),
                ("bf16", "mqa", 16, None, "page_size = 4\nnum_splits = 3\n"),
                pytest.param("f16", "mha", 40, 3.0, 'kv_layout = "contiguous"\n', marks=SLOW),
                pytest.param("bf16", "gqa4", None, 2.0, "", marks=SLOW)]


@pytest.mark.parametrize("dtype,heads,window,cap,layout", VARLEN_CASES)
def test_varlen_variants(tmp_path, dtype, heads, window, cap, layout):
    _check(tmp_path, "varlen", _body(dtype, 40, heads, _variant_keys(window, cap) + layout),
           [{"batch": 9}], "block_m = 32\nblock_n = 16")


def _prefill_stats(extra, seq_k):
    from ptxc.pipeline.compiler import lower
    from ptxc.runtime import POISON, launch_geometry, pack_args
    [spec] = load_text('[[kernel]]\nname = "p"\nfamily = "prefill"\ndtype = "f16"\nhead_dim = 64\n'
                       'num_heads = 1\nnum_kv_heads = 1\ncausal = true\ntargets = ["sm_80"]\n' + extra +
                       '[kernel.tile]\nblock_m = 64\nblock_n = 64\nnum_stages = 2\n')
    ptx, launches, _, _ = lower(spec, "sm_80")
    kernel = launches[0]
    dims = {"batch": 1, "seq_q": 64, "seq_k": seq_k}
    fam = FAMILIES["prefill"]
    inputs = fam.make_inputs(spec, dims, np.random.default_rng(0))
    views = {}
    for t in fam.interface(spec).tensors:
        if t.role == "input":
            views[t.name] = ref.to_device(inputs[t.name], t.dtype)
        else:
            shape = [dims[s] if isinstance(s, str) else s for s in t.shape]
            views[t.name] = np.full(shape, POISON[t.dtype], dtype=type(POISON[t.dtype]))
    args = pack_args(kernel, views, dims, pointer=lambda name, arr: arr)
    grid, block = launch_geometry(kernel, dims)
    stats = emu.launch(ptx, kernel["entry"], grid, block, args, dynamic_smem_bytes=kernel["dynamic_smem_bytes"])
    return stats, spec, inputs, ref.from_device(views["o"], spec.dtype)


def test_window_skips_tiles_outside_it():
    """Window 128 over 2000 keys, the last 64 queries (positions 1936..1999): the CTA visits
    only the 64-key tiles 28..31 that the window touches, instead of all 32. Counted in executed
    instructions, it costs about what a causal run over 4 tiles (256 keys) costs — plus the mask
    code of the two tiles crossing the window's left edge — and a ninth of the full causal run."""
    full = _prefill_stats("", 2000)[0].thread_instructions
    four_tiles = _prefill_stats("", 256)[0].thread_instructions
    win, spec, inputs, o = _prefill_stats("sliding_window = 128\n", 2000)
    assert win.thread_instructions < 1.35 * four_tiles, (win.thread_instructions, four_tiles)
    assert win.thread_instructions < 0.22 * full, (win.thread_instructions, full)
    want = FAMILIES["prefill"].reference(spec, inputs)["o"]
    naive = FAMILIES["prefill"].reference(spec, inputs, dtype="f16")["o"]
    assert ref.max_abs_error(o, want) <= ref.tolerance(naive, want)


def _nan_pages_outside_window(spec, inputs, window, page):
    """Fill every page that lies wholly before each sequence's window with NaN."""
    k, v = inputs["k_cache"].copy(), inputs["v_cache"].copy()
    for b, L in enumerate(inputs["seq_lens"]):
        first_needed = max(int(L) - window, 0) // page     # decode: the query is at L - 1
        for p in inputs["block_table"][b, :first_needed]:
            k[p], v[p] = np.nan, np.nan
    return {**inputs, "k_cache": k, "v_cache": v}


@pytest.mark.parametrize("splits", [1, pytest.param(2, marks=SLOW)])
def test_decode_window_never_reads_pages_before_it(tmp_path, splits):
    art = build_kernel(tmp_path, "decode", _body("f16", 64, "gqa4", 'sliding_window = 9\nkv_layout = "paged"\n'
                                                 f'page_size = 4\nnum_splits = {splits}\n', causal=None))
    spec = KernelSpec.from_dict(art.meta["spec"])
    dims = {"batch": 5, "max_pages_per_seq": 10, "num_pages": 55}
    inputs = FAMILIES["decode"].make_inputs(spec, dims, np.random.default_rng(4))
    poisoned = _nan_pages_outside_window(spec, inputs, 9, 4)
    out = art.run(poisoned, target="sm_80", sets={"num_splits": splits} if splits > 1 else None)
    want = FAMILIES["decode"].reference(spec, inputs)
    assert np.all(np.isfinite(out["o"]))
    assert ref.max_abs_error(out["o"], want["o"]) < 3e-3


def test_varlen_window_never_reads_pages_before_it(tmp_path):
    art = build_kernel(tmp_path, "varlen", _body("bf16", 32, "gqa4", "sliding_window = 6\npage_size = 4\n"),
                       tile="block_m = 16\nblock_n = 16")
    spec = KernelSpec.from_dict(art.meta["spec"])
    dims = {"batch": 8, "max_pages_per_seq": 10, "num_pages": 83}
    inputs = FAMILIES["varlen"].make_inputs(spec, dims, np.random.default_rng(6))
    k, v = inputs["k_cache"].copy(), inputs["v_cache"].copy()
    cu = inputs["cu_seqlens_q"]
    for b, L in enumerate(inputs["seq_lens"]):
        q_len = int(cu[b + 1] - cu[b])
        first_key = max(int(L) - q_len - 6 + 1, 0)      # the first query's window
        first_key -= first_key % 16                     # the K/V tile it starts in is read
        for p in inputs["block_table"][b, :first_key // 4]:
            if 0 <= p < dims["num_pages"]:
                k[p], v[p] = np.nan, np.nan
    out = art.run({**inputs, "k_cache": k, "v_cache": v}, target="sm_80")
    want = FAMILIES["varlen"].reference(spec, inputs)
    naive = FAMILIES["varlen"].reference(spec, inputs, dtype="bf16")
    assert np.all(np.isfinite(out["o"]))
    assert ref.max_abs_error(out["o"], want["o"]) <= ref.tolerance(naive["o"], want["o"])


@pytest.mark.parametrize("family,text,key", [
    ("prefill", "causal = false\nsliding_window = 8", "sliding_window"),
    ("varlen", "causal = false\nsliding_window = 8", "sliding_window"),
    ("prefill", "causal = true\nsliding_window = 0", "sliding_window"),
    ("decode", "logits_soft_cap = 0.0", "logits_soft_cap"),
    ("varlen", "logits_soft_cap = -3", "logits_soft_cap"),
    # values whose c, 1 / c or scale x log2(e) have no finite normal f32: once a NaN in every
    # score (1e308: c became inf, x / c 0) or a traceback from the printer (1e39, 1e-45)
    ("decode", "logits_soft_cap = 1e308", "logits_soft_cap"),
    ("prefill", "logits_soft_cap = 1e39", "logits_soft_cap"),
    ("varlen", "logits_soft_cap = 1e-45", "logits_soft_cap"),
    ("decode", "softmax_scale = 1e-50", "softmax_scale"),
    ("prefill", "softmax_scale = 0.0", "softmax_scale"),
])
def test_variant_spec_errors(family, text, key):
    body = (f'[[kernel]]\nname = "k"\nfamily = "{family}"\ndtype = "f16"\nhead_dim = 64\n'
            f'num_heads = 4\nnum_kv_heads = 1\ntargets = ["sm_80"]\n{text}\n')
    with pytest.raises(SpecError) as e:
        for spec in load_text(body):
            FAMILIES[family].validate(spec)
    assert e.value.key == key and "\n" not in str(e.value)


def test_soft_cap_reference_bends_scores():
    """The fp64 reference applies c·tanh(s/c) before the masks: with a tiny cap every visible
    score is within ±c, so the softmax is nearly uniform over the visible keys."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, 3, 8)) * 10 for _ in range(3))
    o, _ = ref.attention(q, k, v, 1.0, causal=True, soft_cap=1e-6)
    want = np.cumsum(v[0, 0], axis=0) / np.arange(1, 4)[:, None]
    assert np.allclose(o[0, 0], want, atol=1e-5)


# Sinks and ALiBi (runtime [num_heads] tensors), alone and with the other options.
SINK_ALIBI = {
    "prefill": [("f16", "gqa4", "attention_sinks = true\n", True),
                ("bf16", "mqa", "alibi = true\n", False),
                ("f32", "mha", "attention_sinks = true\nalibi = true\nsliding_window = 9\nlogits_soft_cap = 2.0\n", True)],
    "decode": [("f16", "gqa4", "attention_sinks = true\nnum_splits = 3\n", None),
               ("bf16", "mqa", "alibi = true\nkv_layout = \"paged\"\npage_size = 8\n", None),
               ("f32", "mha", "attention_sinks = true\nalibi = true\nsliding_window = 9\nlogits_soft_cap = 2.0\n", None)],
    "varlen": [("f16", "gqa4", "attention_sinks = true\nnum_splits = 3\n", True),
               ("bf16", "mqa", "alibi = true\n", False),
               ("bf16", "mha", "attention_sinks = true\nalibi = true\nsliding_window = 9\nlogits_soft_cap = 2.0\n", True)],
}
SINK_SHAPES = {"prefill": PREFILL_SHAPES[:2], "decode": [{"batch": 5, "max_seq_len": 37}],
               "varlen": [{"batch": 9}]}
SINK_TILES = {"prefill": None, "decode": "", "varlen": "block_m = 32\nblock_n = 16"}


@pytest.mark.parametrize("family,case", [(f, c) if "window" in c[2] else pytest.param(f, c, marks=SLOW)
                                         for f, cases in SINK_ALIBI.items() for c in cases],
                         ids=lambda x: x if isinstance(x, str) else "-".join(str(v).split("\n")[0] for v in x))
def test_sinks_and_alibi(tmp_path, family, case):
    dtype, heads, extra, causal = case
    if "paged" in extra:
        shapes = [{"batch": 5, "max_pages_per_seq": 5, "num_pages": 30}]
    else:
        shapes = SINK_SHAPES[family]
    tile = SINK_TILES[family] if family != "prefill" else SMALL[dtype]
    _check(tmp_path, family, _body(dtype, 40 if family != "decode" else 64, heads, extra, causal=causal),
           shapes, tile)


def test_sink_alone_when_no_key_is_seen():
    """A row that sees no key: o = 0 and lse = the sink (the reference; the kernels are held
    to it by the empty rows of the mixed batches above)."""
    q, k, v = np.ones((1, 2, 3, 4)), np.ones((1, 2, 5, 4)), np.ones((1, 2, 5, 4))
    o, lse = ref.attention(q, k, v, 1.0, kv_len=[0], sinks=[0.5, -2.0])
    assert np.all(o == 0) and np.allclose(lse[0], [[0.5] * 3, [-2.0] * 3])


# head_dim_v: V and O narrower than Q/K (DeepSeek-V3 prefill: 192 / 128).
@pytest.mark.parametrize("family,dtype,heads,d,dv,extra", [
    ("prefill", "f16", "gqa4", 40, 24, "causal = true\n"),
    pytest.param("prefill", "bf16", "mha", 64, 40, "causal = false\nattention_sinks = true\n", marks=SLOW),
    ("prefill", "f32", "mqa", 24, 16, "causal = true\nsliding_window = 7\n"),
    pytest.param("varlen", "f16", "gqa4", 48, 32, "num_splits = 3\n", marks=SLOW),
    ("varlen", "bf16", "mqa", 40, 16, 'kv_layout = "contiguous"\n'),
])
def test_head_dim_v(tmp_path, family, dtype, heads, d, dv, extra):
    tile = SMALL[dtype] if family == "prefill" else "block_m = 32\nblock_n = 16"
    shapes = PREFILL_SHAPES[:2] if family == "prefill" else [{"batch": 9}]
    _check(tmp_path, family, _body(dtype, d, heads, f"head_dim_v = {dv}\n" + extra, causal=None),
           shapes, tile)


@pytest.mark.parametrize("family,text", [
    ("decode", "head_dim_v = 32"),
    ("prefill", "head_dim_v = 128"),
    ("varlen", "head_dim_v = 12"),
])
def test_head_dim_v_errors(family, text):
    body = (f'[[kernel]]\nname = "k"\nfamily = "{family}"\ndtype = "f16"\nhead_dim = 64\n'
            f'num_heads = 4\nnum_kv_heads = 1\ntargets = ["sm_80"]\n{text}\n')
    with pytest.raises(SpecError) as e:
        for spec in load_text(body):
            FAMILIES[family].validate(spec)
    assert e.value.key == "head_dim_v" and "\n" not in str(e.value)


# head_dim above 256: the value dimension is split over 4 warps per 16 query rows (each warp
# keeps a 16 x dv/4 f32 accumulator) in prefill and varlen; decode needs no split.
@pytest.mark.parametrize("family,dtype,heads,d,extra,tile", [
    ("prefill", "bf16", "gqa4", 512, "causal = true\n", "block_m = 16\nblock_n = 16"),
    pytest.param("prefill", "f16", "mqa", 384, "head_dim_v = 320\nsliding_window = 9\ncausal = true\n", "",
                 marks=SLOW),
    ("varlen", "bf16", "gqa4", 512, "num_splits = 2\nattention_sinks = true\n", "block_n = 16"),
    ("decode", "bf16", "gqa4", 512, 'kv_layout = "paged"\nlogits_soft_cap = 5.0\n', ""),
])
def test_head_dim_above_256(tmp_path, family, dtype, heads, d, extra, tile):
    shapes = {"prefill": [{"batch": 1, "seq_q": 17, "seq_k": 40}], "varlen": [{"batch": 5}],
              "decode": [{"batch": 3, "max_pages_per_seq": 3, "num_pages": 12}]}[family]
    _check(tmp_path, family, _body(dtype, d, heads, extra, causal=None), shapes, tile)


# The option combinations real models use, at their head sizes and GQA ratios (fewer heads),
# with sequences long enough for the 128-token window to skip tiles and pages.
MODELS = {
    "gpt-oss-prefill": ("prefill", 'dtype = "bf16"\nhead_dim = 64\nnum_heads = 16\nnum_kv_heads = 2\n'
                        "causal = true\nsliding_window = 128\nattention_sinks = true\nreturn_lse = true\n",
                        {"batch": 1, "seq_q": 37, "seq_k": 300}),
    "gpt-oss-decode": ("decode", 'dtype = "bf16"\nhead_dim = 64\nnum_heads = 16\nnum_kv_heads = 2\n'
                       'sliding_window = 128\nattention_sinks = true\nkv_layout = "paged"\nreturn_lse = true\n',
                       {"batch": 5, "max_pages_per_seq": 20, "num_pages": 110}),
    "gpt-oss-serve": ("varlen", 'dtype = "bf16"\nhead_dim = 64\nnum_heads = 16\nnum_kv_heads = 2\n'
                      "sliding_window = 128\nattention_sinks = true\nreturn_lse = true\n",
                      {"batch": 8, "max_pages_per_seq": 20, "num_pages": 170}),
    "gemma2-local-prefill": ("prefill", 'dtype = "bf16"\nhead_dim = 256\nnum_heads = 4\nnum_kv_heads = 2\n'
                             "causal = true\nsliding_window = 4096\nlogits_soft_cap = 50.0\n",
                             {"batch": 1, "seq_q": 33, "seq_k": 90}),
    "mistral-serve": ("varlen", 'dtype = "bf16"\nhead_dim = 128\nnum_heads = 8\nnum_kv_heads = 2\n'
                      "sliding_window = 4096\nnum_splits = 2\n", {"batch": 8}),
    "deepseek-v3-prefill": ("prefill", 'dtype = "bf16"\nhead_dim = 192\nhead_dim_v = 128\nnum_heads = 4\n'
                            "num_kv_heads = 4\ncausal = true\nreturn_lse = true\n",
                            {"batch": 1, "seq_q": 33, "seq_k": 70}),
    "bloom-alibi-prefill": ("prefill", 'dtype = "f16"\nhead_dim = 128\nnum_heads = 4\nnum_kv_heads = 4\n'
                            "causal = true\nalibi = true\n", {"batch": 1, "seq_q": 40, "seq_k": 70}),
    "gemma-d512-decode": ("decode", 'dtype = "bf16"\nhead_dim = 512\nnum_heads = 4\nnum_kv_heads = 2\n'
                          'kv_layout = "paged"\nnum_splits = 2\n', {"batch": 5, "max_pages_per_seq": 3, "num_pages": 20}),
}


@pytest.mark.parametrize("model", list(MODELS))
def test_model_combinations(tmp_path, model):
    family, body, shape = MODELS[model]
    _check(tmp_path, family, body, [shape])
