"""decode's tensor-core path on varlen's packed tile (decode_mma.on_packed_tile): on sm_90a the
wgmma tile -- by TMA with a producer warpgroup where varlen's rules give it, by per-thread
cp.async for pointer-array, odd-page and FP8 caches --, on sm_100a the tcgen05 tile, against
the fp64 reference with NaN in every cache row a kernel must not read (rows at or past L, pages
no sequence names); which specs move, and that the grid stays every target's."""

import numpy as np
import pytest

from conftest import build_kernel
from ptxc import reference as ref
from ptxc.kernels import FAMILIES, load_text
from ptxc.spec.model import KernelSpec
from ptxc.targets import TARGETS

DECODE = FAMILIES["decode"]
SM90A = ("sm_90", "sm_90a")


def _body(heads=32, kv_heads=8, d=128, dtype="f16", layout='kv_layout = "paged"\npage_size = 16',
          splits="\"auto\"", extra=""):
    return (f'dtype = "{dtype}"\nhead_dim = {d}\nnum_heads = {heads}\nnum_kv_heads = {kv_heads}\n'
            f'return_lse = true\n{layout}\nnum_splits = {splits}\n{extra}')


def poison(inputs: dict, spec, dims: dict) -> dict:
    """NaN in every cache row at or past its sequence's L and in every page the first
    cdiv(L, page_size) block-table entries of no sequence name."""
    lens = inputs["seq_lens"]
    for t in ("k_cache", "v_cache"):
        cache = inputs[t]
        if "block_table" not in inputs:
            for b, L in enumerate(lens):
                cache[b, L:] = np.nan
            continue
        ps = cache.shape[1]
        live = np.zeros(cache.shape[:2], bool)
        for b, L in enumerate(lens):
            for r in range(L):
                live[inputs["block_table"][b, r // ps], r % ps] = True
        cache[~live] = np.nan
    return inputs


def check(art, spec, dims, seed=0, target="sm_90a"):
    inputs = DECODE.make_inputs(spec, dims, np.random.default_rng(seed))
    if "k_cache" in inputs and spec.opt("kv_layout") != "pointer_array" and \
            np.issubdtype(inputs["k_cache"].dtype, np.floating):
        inputs = poison(inputs, spec, dims)
        assert np.isnan(inputs["v_cache"]).any()
    out = art.run(inputs, target=target)
    clean = {**inputs, **{t: np.nan_to_num(inputs[t], nan=0.0) for t in ("k_cache", "v_cache")
                          if np.issubdtype(inputs[t].dtype, np.floating)}}
    want, naive = DECODE.reference(spec, clean), DECODE.reference(spec, clean, dtype=spec.dtype)
    for t in ("o", "lse"):       # (the fused append's caches: tests/families/test_kv_append*)
        assert np.array_equal(np.isneginf(out[t]), np.isneginf(want[t])), t
        assert np.all(np.isfinite(out[t]) | np.isneginf(out[t])), f"{t}: NaN or +inf in the output"
        err, tol = ref.max_abs_error(out[t], want[t]), ref.tolerance(naive[t], want[t])
        assert err <= tol, f"{t}: max error {err:.3e} > tolerance {tol:.3e}"


PAGED = {"batch": 5, "max_pages_per_seq": 8, "num_pages": 48}      # L up to 128: 113-ish, 0, 1, 17
CONTIG = {"batch": 5, "max_seq_len": 113}


@pytest.mark.parametrize("body,dims,tile,ws", [
    (_body(), PAGED, "", True),                                             # llama3: TMA, producer
    (_body(dtype="bf16", splits=1), PAGED, "", True),
    (_body(heads=16, kv_heads=1, d=64, layout='kv_layout = "contiguous"', splits=3), CONTIG, "", False),
    (_body(heads=64, kv_heads=1, d=256, dtype="bf16", layout='kv_layout = "paged"\npage_size = 64'),
     {"batch": 5, "max_pages_per_seq": 2, "num_pages": 16}, "", False),     # g = 64: one tile
    (_body(layout='kv_layout = "pointer_array"', splits=2), CONTIG, "", False),   # cp.async
    (_body(layout='kv_layout = "paged"\npage_size = 24'),                         # cp.async pages
     {"batch": 5, "max_pages_per_seq": 6, "num_pages": 40}, "", False),
    (_body(extra='kv_dtype = "e4m3"\nkv_scale = "tensor"', splits=2), PAGED, "", False),  # staged FP8
    (_body(extra="sliding_window = 300\nlogits_soft_cap = 30.0\nattention_sinks = true"),
     {"batch": 5, "max_pages_per_seq": 24, "num_pages": 128}, "", True),   # L up to 384
    (_body(heads=32, kv_heads=32 // 8, extra="alibi = true", splits=1), PAGED, "", True),
    (_body(extra="append_kv = true"), PAGED, "", True),                     # the fused append first
    (_body(), PAGED, "warp_specialize = false", False),                      # one issuer
], ids=["llama3-page16-auto", "bf16-unsplit", "mqa-d64-contiguous-3splits", "g64-d256-page64",
        "pointer-array", "page24", "e4m3", "window-softcap-sinks", "alibi", "append", "one-issuer"])
def test_wgmma_decode_with_nan_garbage(tmp_path, body, dims, tile, ws):
    """L 0 / 1 / 17 / odd / the capacity, pages shuffled and crossed, splits with empty shares:
    the wgmma tile of 64 rows (the group's heads, the rest masked) matches fp64, NaN past L and
    in unread pages never reaching O or the LSE."""
    art = build_kernel(tmp_path, "decode", body, tile=tile, targets=SM90A)
    _, t = art.target("sm_90a")
    assert t["config"]["path"] == "wgmma.m64nNk16" and t["config"]["block_m"] == 64
    assert bool(t["config"].get("warp_specialize")) == ws
    _, t90 = art.target("sm_90")
    assert t90["config"]["path"] == "mma.m16n8k16"
    for a, b in zip(t["kernels"], t90["kernels"]):         # the grid is every target's
        assert a["grid"] == b["grid"]
    check(art, KernelSpec.from_dict(art.meta["spec"]), dims)


def _resolve(body: str, target: str = "sm_90a") -> dict:
    [spec] = load_text(f'[[kernel]]\nname = "k"\nfamily = "decode"\ntargets = ["{target}"]\n{body}\n')
    return DECODE.resolve_tile(spec, TARGETS[target])


def test_which_specs_move_to_wgmma():
    """g <= 64 with a head dim wgmma takes moves; g > 64, other head dims, the SIMT path and
    other targets keep theirs."""
    assert _resolve(_body())["path"] == "wgmma.m64nNk16"
    assert _resolve(_body(heads=128, kv_heads=1))["path"] == "mma.m16n8k16"        # g = 128
    assert _resolve(_body(d=96))["path"] == "mma.m16n8k16"                         # no wgmma d
    # a window of fewer than 4 key tiles (gpt-oss's 128 keys), unless a tile key asks
    assert _resolve(_body(extra="sliding_window = 128"))["path"] == "mma.m16n8k16"
    assert _resolve(_body(extra="sliding_window = 128\n[kernel.tile]\nwarp_specialize = true")
                    )["path"] == "wgmma.m64nNk16"
    assert _resolve(_body(extra="sliding_window = 256"))["path"] == "wgmma.m64nNk16"
    assert _resolve(_body(), "sm_90")["path"] == "mma.m16n8k16"
    assert _resolve(_body(heads=8, kv_heads=4)).get("path") != "wgmma.m64nNk16"   # g = 2: SIMT
    assert _resolve(_body(extra='math = "simt"')).get("path") != "wgmma.m64nNk16"


def test_hopper_tile_keys_say_where_they_apply():
    """tile.warp_specialize / kv_loads: the sm_90a wgmma tile's keys; one line naming the key
    where no target takes it, or on the SIMT path."""
    from ptxc.errors import SpecError
    for body, targets, key in ((_body(), '["sm_80", "sm_90"]', "tile.warp_specialize"),
                               (_body(heads=8, kv_heads=4), '["sm_90a"]', "tile.warp_specialize")):
        with pytest.raises(SpecError) as e:
            load_text(f'[[kernel]]\nname = "k"\nfamily = "decode"\ntargets = {targets}\n{body}\n'
                      f'[kernel.tile]\nwarp_specialize = true\n')
        assert e.value.key == key and "\n" not in str(e.value)
    one = load_text(f'[[kernel]]\nname = "k"\nfamily = "decode"\ntargets = ["sm_90a"]\n{_body()}\n'
                    f'[kernel.tile]\nkv_loads = "cp_async"\n')[0]
    conf = DECODE.resolve_tile(one, TARGETS["sm_90a"])
    assert conf["path"] == "wgmma.m64nNk16" and "kv_loads" not in conf and "warp_specialize" not in conf


@pytest.mark.parametrize("body,dims", [
    (_body(), PAGED),
    (_body(heads=16, kv_heads=1, d=64, layout='kv_layout = "contiguous"', splits=3), CONTIG),
    (_body(extra="sliding_window = 300\nlogits_soft_cap = 30.0\nattention_sinks = true\nappend_kv = true"),
     {"batch": 5, "max_pages_per_seq": 24, "num_pages": 128}),
], ids=["llama3-page16-auto", "mqa-d64-contiguous-3splits", "window-softcap-sinks-append"])
def test_tcgen05_decode_with_nan_garbage(tmp_path, body, dims):
    """sm_100a: the tcgen05 tile's load / MMA / softmax warps over one token's heads, the same
    poisoned batches; FP8 and pointer-array caches keep mma.sync there (no TMA), and so does
    d256 (its tile would run one CTA per SM: half the bytes in flight)."""
    art = build_kernel(tmp_path, "decode", body, targets=("sm_90", "sm_100a"))
    _, t = art.target("sm_100a")
    assert t["config"]["path"] == "tcgen05.mma.m64" and t["config"]["warp_specialize"]
    check(art, KernelSpec.from_dict(art.meta["spec"]), dims, target="sm_100a")
    for body in (_body(extra='kv_dtype = "e4m3"'), _body(layout='kv_layout = "pointer_array"'),
                 _body(d=256)):     # d256: all 512 tensor-memory columns, one CTA per SM
        assert _resolve(body, "sm_100a")["path"] == "mma.m16n8k16"
    asked = _body(d=256, extra="[kernel.tile]\nwarp_specialize = true")   # unless a tile key asks
    assert _resolve(asked, "sm_100a")["path"] == "tcgen05.mma.m64"


def test_a_tile_sm_90_accepts_sm_90a_accepts():
    """The packed tile holds 64 rows of Q where the mma.sync one holds 16: a tile the user sized
    for the latter (block_n x num_stages) is never refused on sm_90a for that (on_packed_tile
    keeps the mma.sync tile where the 64-row one would not fit)."""
    from ptxc.errors import SpecError

    def accepted(body, target):
        try:
            _resolve(body, target)
            return True
        except SpecError:
            return False
    for d in (64, 128, 192, 256):
        for bn in (16, 32, 64, 128):
            for stages in (1, 2, 3, 4):
                body = _body(d=d, extra=f"[kernel.tile]\nblock_n = {bn}\nnum_stages = {stages}")
                assert accepted(body, "sm_90") == accepted(body, "sm_90a"), (d, bn, stages)
