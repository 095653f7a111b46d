"""decode on tensor cores (GQA group >= 4, decode_mma.py): which specs take the path, that the
PTX really uses mma and (both paths) the pipelined cp.async K/V loads, numerics on odd shapes (seq 0, 1, 17,
113, pages crossing, empty splits) for g = 4, 8, 12 and MQA (g = 32, two warps), and the
emulator's traffic counters: every K/V byte is read once per KV head, not once per query head."""

import numpy as np
import pytest

from conftest import assert_pass, build_kernel
from ptxc.errors import SpecError
from ptxc.kernels import FAMILIES
from ptxc.kernels.families.decode_mma import uses_mma
from ptxc.pipeline.compiler import lower
from ptxc.runtime import infer_dims, launch_geometry, pack_args, prepare_buffers
from ptxc.runtime.launch_test import check_artifact
from ptxc.kernels import load_text
from ptxc.spec.model import KernelSpec


def _spec(body: str, targets='["sm_80"]'):
    [spec] = load_text(f'[[kernel]]\nname = "k"\nfamily = "decode"\ntargets = {targets}\n{body}\n')
    return spec


@pytest.mark.parametrize("body,mma", [
    ('dtype = "f16"\nhead_dim = 128\nnum_heads = 32\nnum_kv_heads = 8', True),
    ('dtype = "bf16"\nhead_dim = 64\nnum_heads = 32\nnum_kv_heads = 1', True),
    ('dtype = "f16"\nhead_dim = 128\nnum_heads = 8\nnum_kv_heads = 4', False),          # g = 2
    ('dtype = "f32"\nhead_dim = 64\nnum_heads = 8\nnum_kv_heads = 1', False),
    ('dtype = "f16"\nhead_dim = 128\nnum_heads = 32\nnum_kv_heads = 8\nkv_dtype = "e4m3"', True),   # staged FP8
    ('dtype = "f16"\nhead_dim = 40\nnum_heads = 32\nnum_kv_heads = 8\nkv_dtype = "e4m3"', False),   # d % 16
    ('dtype = "bf16"\nhead_dim = 256\nnum_heads = 32\nnum_kv_heads = 8\nkv_dtype = "e4m3"', False),  # FP8 d > 128
    ('dtype = "f16"\nhead_dim = 128\nnum_heads = 32\nnum_kv_heads = 8\nmath = "simt"', False),
    ('dtype = "f16"\nhead_dim = 128\nnum_heads = 32\nnum_kv_heads = 8\n[kernel.tile]\nkv_unroll = 2', False),
])
def test_path_choice_shows_in_the_ptx(body, mma):
    spec = _spec(body)
    assert uses_mma(spec) == mma
    ptx = lower(spec, "sm_80")[0]
    assert ("mma.sync.aligned.m16n8k16" in ptx) == mma
    # both paths stage K/V through cp.async on sm_80, except FP8 caches on the SIMT path
    # (dequantised in registers); on tensor cores their bytes are staged by cp.async too
    assert ("cp.async" in ptx) == ("e4m3" not in body or mma)


def test_sm75_target_keeps_simt_and_math_mma_says_why():
    body = 'dtype = "f16"\nhead_dim = 64\nnum_heads = 8\nnum_kv_heads = 1'
    assert not uses_mma(_spec(body, '["sm_75", "sm_80"]'))
    with pytest.raises(SpecError, match="sm_75"):
        _spec(body + '\nmath = "mma"', '["sm_75", "sm_80"]')
    with pytest.raises(SpecError, match="tile.block_n"):
        _spec(body + '\nmath = "simt"\n[kernel.tile]\nblock_n = 32')
    with pytest.raises(SpecError, match="tile.kv_unroll"):
        _spec(body + '\nmath = "mma"\n[kernel.tile]\nkv_unroll = 2')


CASES = [  # (heads, kv_heads, dtype, head_dim, layout extras, splits)
    (8, 2, "f16", 40, 'kv_layout = "contiguous"', 1),
    (16, 2, "bf16", 64, 'kv_layout = "paged"\npage_size = 8', 1),
    (12, 1, "f16", 72, 'kv_layout = "pointer_array"', 1),
    (32, 1, "bf16", 32, 'kv_layout = "paged"\npage_size = 128', 1),     # MQA: 2 warps, tile in a page
    (8, 1, "f16", 64, 'kv_layout = "paged"\npage_size = 16', 8),        # empty splits
]


@pytest.mark.parametrize("heads,kv_heads,dtype,d,layout,splits", CASES)
def test_tensor_core_decode_matches_reference(tmp_path, heads, kv_heads, dtype, d, layout, splits):
    body = (f'dtype = "{dtype}"\nhead_dim = {d}\nnum_heads = {heads}\nnum_kv_heads = {kv_heads}\n'
            f'return_lse = true\n{layout}\nnum_splits = {splits}')
    art = build_kernel(tmp_path, "decode", body, tile="block_n = 16" if d <= 40 else "")
    _, t = art.target("sm_80")
    assert t["config"]["path"] == "mma.m16n8k16"
    # seq_lens cycle through the full cache (113 / 14 pages of 8 / ...), 0, 1, an odd middle, 17
    shapes = {"batch": 5, "max_seq_len": 113} if "paged" not in layout else \
        {"batch": 5, "max_pages_per_seq": -(-113 // int(layout.split("= ")[-1])), "num_pages": 80}
    assert_pass(check_artifact(art, backend="emu", shapes=shapes, seed=11))


def test_each_kv_row_is_read_once_per_kv_head(tmp_path):
    """Traffic counters: the cache bytes read equal the rows seen x KV heads x row bytes (K and
    V once each), for a group of 8 query heads per KV head; tile padding past a sequence's end
    is zero-filled, not read."""
    from ptxc import emu
    art = build_kernel(tmp_path, "decode", 'dtype = "f16"\nhead_dim = 64\nnum_heads = 16\n'
                                           'num_kv_heads = 2\nkv_layout = "paged"\npage_size = 16')
    spec = KernelSpec.from_dict(art.meta["spec"])
    inputs = FAMILIES["decode"].make_inputs(spec, {"batch": 5, "max_pages_per_seq": 7, "num_pages": 40},
                                            np.random.default_rng(3))
    dims = infer_dims(art.meta, inputs, {})
    buffers = prepare_buffers(art.meta, inputs, dims)
    [kernel] = art.target("sm_80")[1]["kernels"]
    grid, block = launch_geometry(kernel, dims)
    stats = emu.launch(art.ptx("sm_80"), kernel["entry"], grid, block, pack_args(kernel, buffers, dims, pointer=lambda n, a: a),
                       dynamic_smem_bytes=kernel["dynamic_smem_bytes"], traffic=True)
    row_bytes = 2 * 64
    want = int(inputs["seq_lens"].sum()) * 2 * row_bytes          # 2 KV heads
    assert stats.traffic.bytes_read["k_cache"] == want
    assert stats.traffic.bytes_read["v_cache"] == want
    want_o = FAMILIES["decode"].reference(spec, inputs)["o"]
    got = buffers["o"].astype(np.float32)
    assert np.abs(got - want_o).max() < 2e-3
