"""Tier 3 for the decode family: the emulator runs the real PTX and the result must be within
the FA2 tolerance rule of the fp64 reference, over every dtype x GQA ratio x head_dim with
ragged seq_lens (0, 1, odd lengths, the full cache)."""

import numpy as np
import pytest

from ptxc import reference as ref
from conftest import assert_pass, build_kernel
from ptxc.kernels import FAMILIES
from ptxc.runtime.launch_test import check_artifact
from ptxc.runtime import infer_dims, launch_geometry, pack_args, prepare_buffers
from ptxc.kernels import load_text


MATRIX = [(dtype, heads, kv, d) for dtype in ("f32", "f16", "bf16")
          for heads, kv in ((4, 4), (8, 2), (8, 1)) for d in (64, 128, 256)]


@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim", MATRIX)
def test_decode_matches_reference(tmp_path, dtype, heads, kv_heads, head_dim):
    art = build_kernel(tmp_path, "decode", f'dtype = "{dtype}"\nhead_dim = {head_dim}\nnum_heads = {heads}\n'
                              f"num_kv_heads = {kv_heads}\nreturn_lse = true")
    # seq_lens cycle through 37 (full), 0, 1, 21 (odd middle), 17
    assert_pass(check_artifact(art, backend="emu", shapes={"batch": 5, "max_seq_len": 37}, seed=1))


@pytest.mark.parametrize("tile", ["num_warps = 1\nkv_unroll = 1", "num_warps = 2\nkv_unroll = 8",
                                  "num_warps = 8\nkv_unroll = 2"])
def test_tile_variants(tmp_path, tile):
    art = build_kernel(tmp_path, "decode", 'dtype = "f16"\nhead_dim = 128\nnum_heads = 8\nnum_kv_heads = 2', tile)
    assert_pass(check_artifact(art, backend="emu", shapes={"batch": 4, "max_seq_len": 113}, seed=2))


@pytest.mark.parametrize("head_dim", [16, 40, 200])
def test_head_dims_that_leave_lanes_idle(tmp_path, head_dim):
    art = build_kernel(tmp_path, "decode", f'dtype = "bf16"\nhead_dim = {head_dim}\nnum_heads = 6\nnum_kv_heads = 3')
    assert_pass(check_artifact(art, backend="emu", shapes={"batch": 3, "max_seq_len": 29}, seed=3))


def test_large_gqa_group_is_split_over_ctas(tmp_path):
    """The SIMT path (math = "simt"; "auto" takes tensor cores here) splits a group of 32
    query heads into chunks of 4 per CTA."""
    art = build_kernel(tmp_path, "decode", 'dtype = "f16"\nhead_dim = 128\nnum_heads = 32\nnum_kv_heads = 1\n'
                                           'return_lse = true\nmath = "simt"')
    _, t = art.target("sm_80")
    assert t["config"]["heads_per_cta"] == 4 and t["kernels"][0]["grid"][0] == "8"
    assert_pass(check_artifact(art, backend="emu", shapes={"batch": 2, "max_seq_len": 19}, seed=4))


def test_head_first_cache_via_strides(tmp_path):
    """k/v stored [batch, kv_heads, seq, d]: only the strides change, no copy."""
    art = build_kernel(tmp_path, "decode", 'dtype = "f32"\nhead_dim = 64\nnum_heads = 4\nnum_kv_heads = 2')
    spec = FAMILIES["decode"]
    from ptxc.spec.model import KernelSpec
    ks = KernelSpec.from_dict(art.meta["spec"])
    rng = np.random.default_rng(5)
    inputs = spec.make_inputs(ks, {"batch": 3, "max_seq_len": 23}, rng)
    dims = infer_dims(art.meta, inputs, {})
    buffers = prepare_buffers(art.meta, inputs, dims)
    for name in ("k_cache", "v_cache"):  # physical head-first copy, logical [b, s, h, d] view
        physical = np.ascontiguousarray(buffers[name].transpose(0, 2, 1, 3))
        buffers[name] = physical.transpose(0, 2, 1, 3)
    [kernel] = art.target("sm_80")[1]["kernels"]
    args = pack_args(kernel, buffers, dims,
                     pointer=lambda n, a: a if a.flags.c_contiguous else a.base)
    from ptxc import emu
    grid, block = launch_geometry(kernel, dims)
    emu.launch(art.ptx("sm_80"), kernel["entry"], grid, block, args)
    want = spec.reference(ks, inputs)["o"]
    assert ref.max_abs_error(buffers["o"], want) <= ref.tolerance(spec.reference(ks, inputs, dtype="f32")["o"], want)


def test_seq_lens_beyond_cache_are_clamped(tmp_path):
    art = build_kernel(tmp_path, "decode", 'dtype = "f32"\nhead_dim = 32\nnum_heads = 2')
    from ptxc.spec.model import KernelSpec
    ks = KernelSpec.from_dict(art.meta["spec"])
    inputs = FAMILIES["decode"].make_inputs(ks, {"batch": 2, "max_seq_len": 9}, np.random.default_rng(6))
    inputs["seq_lens"] = np.array([1000, -5], dtype=np.int32)
    out = art.run(inputs, target="sm_80")
    o, _ = ref.decode(inputs["q"], inputs["k_cache"], inputs["v_cache"], [9, 0], ks.softmax_scale)
    assert ref.max_abs_error(out["o"], o) < 1e-5
    assert np.all(out["o"][1] == 0)


def test_kv_rows_are_loaded_once_per_head_group():
    """The loop's K/V loads do not grow with the GQA group: 2 x kv_unroll 128-bit copies
    (cp.async into the thread's pipeline slots on sm_80)."""
    from ptxc.pipeline.compiler import lower
    counts = {}
    for heads in (8, 16):
        [spec] = load_text(f'[[kernel]]\nname = "k"\nfamily = "decode"\ndtype = "f16"\nhead_dim = 128\n'
                           f'num_heads = {heads}\nnum_kv_heads = 4\n[kernel.tile]\nkv_unroll = 4\n')
        ptx = lower(spec, "sm_80")[0]
        import re
        start = re.search(r"^\$L__loop_\d+:$", ptx, re.M).end()
        loop = ptx[start:re.search(r"^\$L__endloop_\d+:$", ptx, re.M).start()]
        counts[heads] = loop.count("cp.async.cg.shared.global")
        assert "ld.global" not in loop.replace("ld.global.nc.s32", "")   # only page ids (none here)
    assert counts[8] == counts[16] == 8


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("heads,kv_heads", [(32, 8), (32, 32), (16, 1), (12, 4)])
def test_decode_long_sweep(tmp_path, dtype, heads, kv_heads):
    for d in (64, 128, 256):
        art = build_kernel(tmp_path / f"d{d}", "decode", f'dtype = "{dtype}"\nhead_dim = {d}\nnum_heads = {heads}\n'
                                            f"num_kv_heads = {kv_heads}\nreturn_lse = true")
        assert_pass(check_artifact(art, backend="emu", shapes={"batch": 5, "max_seq_len": 1000}, seed=7))
