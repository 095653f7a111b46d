"""Chunked local attention (`attention_chunk = C`, Llama 4's attention_chunk_size): a query at
position p sees the keys of its own chunk up to itself, C * floor(p / C) <= j <= p. One lower
bound in the variant seam (AttentionVariant.key_begin), so every path gets it: the emulator runs
the real PTX of prefill (SIMT, mma.sync, sm_90a wgmma by TMA with one issuer and with a producer
warpgroup, sm_100a tcgen05), decode (SIMT rows, the packed tensor-core tile) and varlen
(mma.sync, sm_90a TMA, sm_100a tcgen05) against the fp64 reference on odd shapes whose rows cross
chunk boundaries, chunks smaller than a tile, not multiples of it, and with a sliding window
beside them (the later bound wins). Pages wholly before a sequence's first chunk hold NaN: they
are never read. Refusals are one line naming the key; the report counts only visible keys."""

import numpy as np
import pytest

from conftest import build_kernel
from ptxc import reference as ref
from ptxc.errors import SpecError
from ptxc.kernels import FAMILIES, load_text
from ptxc.spec.model import KernelSpec
from families.prefill_cases import check, spec_text
from families.test_varlen_tma import check_poisoned, spec_body
from families.test_varlen_wgmma import LENGTHS

pytest.importorskip("ptxc.emu", reason="the emulator is needed for numerical checks")
SLOW = pytest.mark.slow
DECODE = FAMILIES["decode"]


def _prefill(dtype, head_dim, heads, extra, tile, target):
    text = spec_text(dtype, head_dim, heads, True, tile=tile, targets=(target,))
    return text.replace("targets = ", extra + "targets = ")


@pytest.mark.parametrize("dtype,heads,extra,tile,target,shapes", [
    # SIMT f32: a chunk below the 16-key tile
    ("f32", "mqa", "attention_chunk = 7\n", {"block_m": 16, "block_n": 16}, "sm_80",
     [(17, 113), (113, 17)]),
    # mma.sync: a tile-aligned chunk; a chunk no tile divides, under a longer window
    ("f16", "gqa4", "attention_chunk = 16\n", {"block_m": 32, "block_n": 16, "num_stages": 2},
     "sm_80", [(17, 113), (113, 113), (1, 17)]),
    ("bf16", "mha", "attention_chunk = 20\nsliding_window = 30\n",
     {"block_m": 32, "block_n": 16, "num_stages": 2}, "sm_80", [(113, 113)]),
    # sm_90a wgmma: TMA from one elected thread; the producer warpgroup (default tile)
    ("f16", "gqa4", "attention_chunk = 48\n",
     {"block_m": 64, "block_n": 32, "kv_loads": "tma", "warp_specialize": False}, "sm_90a",
     [(17, 113), (130, 131)]),
    pytest.param("bf16", "gqa4", "attention_chunk = 40\nsliding_window = 50\n", None, "sm_90a",
                 [(150, 131)], marks=SLOW),
    # sm_100a tcgen05 (M128, S / P / O in tensor memory)
    ("bf16", "gqa4", "attention_chunk = 40\n", None, "sm_100a", [(130, 200)]),
], ids=["simt-f32-c7", "mma-c16", "mma-c20-w30", "wgmma-tma-c48", "wgmma-ws-c40-w50",
        "tcgen05-c40"])
def test_prefill(dtype, heads, extra, tile, target, shapes):
    check(_prefill(dtype, 64 if dtype != "f32" else 24, heads, extra, tile, target), shapes,
          batch=1, target=target)


@pytest.mark.parametrize("layout,tile,case,target,extra", [
    ("page16", "block_m = 32\nblock_n = 16", dict(dtype="bf16", head_dim=40, gqa="gqa4",
                                                  causal=True, splits=3), "sm_80",
     "\nattention_chunk = 24"),
    ("page16", "", dict(dtype="f16", head_dim=64, gqa="gqa4", causal=True, splits=2), "sm_90a",
     "\nattention_chunk = 32\nsliding_window = 40"),
    ("page16", "", dict(dtype="bf16", head_dim=128, gqa="gqa4", causal=True, splits="auto"),
     "sm_100a", "\nattention_chunk = 48"),
], ids=["mma-split3-c24", "sm90a-tma-ws-c32-w40", "sm100a-tcgen05-c48"])
def test_varlen_ragged_batch_with_nan_before_the_chunk(tmp_path, layout, tile, case, target, extra):
    """Lengths 0 / 1 / 17 / 113 with chunks of q_len > 1, and queries on each side of a chunk
    start (a token at position C, at 2C - 1 and 2C, a chunk of C + 6 tokens across 2C); NaN at
    and past every L and in the pages wholly before each sequence's first query's chunk."""
    art = build_kernel(tmp_path, "varlen", spec_body(layout, **case) + extra, tile=tile,
                       targets=(target,))
    spec = KernelSpec.from_dict(art.meta["spec"])
    c = spec.opt("attention_chunk")
    lengths = LENGTHS + [(1, c + 1), (1, c), (2, 2 * c + 1), (c + 6, min(120, 2 * c + 10))]
    check_poisoned(art, spec, layout, lengths=lengths, target=target)


def _decode_poisoned(spec, dims, chunk, seed=0):
    """Decode inputs with NaN in every cache row no sequence may read: at or past L, and in
    the pages wholly before the query's chunk (C * floor((L - 1) / C))."""
    inputs = DECODE.make_inputs(spec, dims, np.random.default_rng(seed))
    lens = inputs["seq_lens"]
    assert max(lens) > chunk, "some sequence must have keys before its chunk"
    for t in ("k_cache", "v_cache"):
        cache = inputs[t]
        ps = cache.shape[1]
        live = np.zeros(cache.shape[:2], bool)
        for b, L in enumerate(lens):
            lo = (max(L - 1, 0) // chunk * chunk) // ps * ps
            for r in range(lo, L):
                live[inputs["block_table"][b, r // ps], r % ps] = True
        cache[~live] = np.nan
    return inputs


@pytest.mark.parametrize("body,dims,target,chunk", [
    # SIMT rows (group 4), 4-row pages, 3 splits over the chunk's rows
    ('dtype = "f16"\nhead_dim = 64\nnum_heads = 8\nnum_kv_heads = 2\nreturn_lse = true\n'
     'kv_layout = "paged"\npage_size = 4\nnum_splits = 3\n', {"batch": 5, "max_pages_per_seq": 10,
                                                              "num_pages": 60}, "sm_80", 12),
    # the packed tensor-core tile (group 4 x 8 heads), split auto
    ('dtype = "bf16"\nhead_dim = 128\nnum_heads = 32\nnum_kv_heads = 8\nreturn_lse = true\n'
     'kv_layout = "paged"\npage_size = 16\nnum_splits = "auto"\n',
     {"batch": 5, "max_pages_per_seq": 24, "num_pages": 128}, "sm_80", 100),
], ids=["simt-page4-split3-c12", "mma-page16-auto-c100"])
def test_decode_never_reads_pages_before_the_chunk(tmp_path, body, dims, target, chunk):
    art = build_kernel(tmp_path, "decode", body + f"attention_chunk = {chunk}\n", targets=(target,))
    spec = KernelSpec.from_dict(art.meta["spec"])
    inputs = _decode_poisoned(spec, dims, chunk)
    out = art.run(inputs, target=target)
    clean = {**inputs, **{t: np.nan_to_num(inputs[t], nan=0.0) for t in ("k_cache", "v_cache")}}
    want, naive = DECODE.reference(spec, clean), DECODE.reference(spec, clean, dtype=spec.dtype)
    for t in ("o", "lse"):
        assert np.array_equal(np.isneginf(out[t]), np.isneginf(want[t])), t
        assert np.all(np.isfinite(out[t]) | np.isneginf(out[t])), f"{t}: NaN or +inf in the output"
        err, tol = ref.max_abs_error(out[t], want[t]), ref.tolerance(naive[t], want[t])
        assert err <= tol, f"{t}: max error {err:.3e} > tolerance {tol:.3e}"


def test_reference_sees_only_the_chunk():
    """The fp64 reference's mask: query 9 of a chunk-4 sequence (position 9) sees keys 8, 9."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, n, 8)) for n in (10, 10, 10))
    o, _ = ref.attention(q, k, v, 0.5, causal=True, chunk=4)
    only, _ = ref.attention(q[:, :, 8:], k[:, :, 8:], v[:, :, 8:], 0.5, causal=True)
    assert np.allclose(o[0, 0, 8:], only[0, 0])
    assert np.allclose(o[0, 0, 3], ref.attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], 0.5,
                                                 causal=True)[0][0, 0, 3])


@pytest.mark.parametrize("family,text", [
    ("prefill", "causal = false\nattention_chunk = 64\n"),
    ("varlen", "causal = false\nattention_chunk = 64\npage_size = 16\n"),
    ("prefill", "causal = true\nattention_chunk = 0\n"),
    ("decode", "attention_chunk = 1073741825\n"),
])
def test_refusals_name_the_key(family, text):
    spec = (f'[[kernel]]\nname = "k"\nfamily = "{family}"\ndtype = "f16"\nhead_dim = 64\n'
            f'num_heads = 4\nnum_kv_heads = 2\ntargets = ["sm_80"]\n{text}')
    with pytest.raises(SpecError) as e:
        load_text(spec)
    assert e.value.key == "attention_chunk" and "\n" not in str(e.value)


def test_report_counts_only_the_chunk():
    """costs.keys_seen: 8 queries at the end of 16 keys with chunk 4 see 1 + 2 + 3 + 4 keys twice
    (positions 8..15); decode reads the rows of the last query's chunk."""
    from ptxc.report.costs import keys_seen, visible_rows
    assert keys_seen(8, 16, True, None, chunk=4) == 2 * (1 + 2 + 3 + 4)
    assert keys_seen(8, 16, True, 3, chunk=4) == 2 * (1 + 2 + 3 + 3)
    assert keys_seen(8, 16, True, None) == sum(range(9, 17))
    assert visible_rows(4097, None, 4096) == 1 and visible_rows(4096, None, 4096) == 4096
    assert visible_rows(100, 30, 64) == 30 and visible_rows(100, 50, 64) == 36
