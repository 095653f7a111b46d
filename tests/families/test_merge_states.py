"""merge_states (vLLM's merge_attn_states, FlashInfer's merge_state): the emulator runs the real
PTX against the fp64 merge on every dtype and odd head sizes, with every kind of empty state
(lse -inf, +inf, both) whose o holds NaN it must not read; two states the attention reference
computed over disjoint key halves merge into the state over all keys; views with free token and
head strides and vLLM's [num_heads, num_tokens] lse layout; what the metadata promises a
launcher about those strides; one line for bad keys."""

import numpy as np
import pytest

from conftest import assert_pass, build_kernel
from ptxc import reference as ref
from ptxc.errors import SpecError
from ptxc.kernels import FAMILIES, load_text
from ptxc.runtime.launch_test import check_artifact

emu = pytest.importorskip("ptxc.emu", reason="the emulator is needed for numerical checks")
MERGE = FAMILIES["merge_states"]


def _body(dtype="bf16", heads=6, d=40, lse=True):
    return (f'dtype = "{dtype}"\nnum_heads = {heads}\nhead_dim = {d}\n'
            f"return_lse = {str(lse).lower()}\n")


@pytest.mark.parametrize("dtype,heads,d,lse,tokens", [
    ("f16", 6, 40, True, 37), ("bf16", 128, 128, True, 9), ("f32", 3, 24, False, 17),
    ("bf16", 16, 512, False, 5), ("f16", 1, 16, True, 1),
], ids=["f16-h6-d40", "bf16-h128-d128", "f32-h3-d24-nolse", "bf16-h16-d512", "f16-one-token"])
def test_against_the_fp64_merge_with_nan_in_empty_states(tmp_path, dtype, heads, d, lse, tokens):
    art = build_kernel(tmp_path, "merge_states", _body(dtype, heads, d, lse))
    assert_pass(check_artifact(art, backend="emu", shapes={"num_tokens": tokens}, seed=1))


def test_no_tokens_launch_nothing(tmp_path):
    art = build_kernel(tmp_path, "merge_states", _body("bf16", 4, 64))
    [spec] = load_text('[[kernel]]\nname = "m"\nfamily = "merge_states"\ntargets = ["sm_80"]\n'
                       + _body("bf16", 4, 64))
    out = art.run(MERGE.make_inputs(spec, {"num_tokens": 0}, np.random.default_rng(0)))
    assert out["o"].shape == (0, 4, 64) and out["lse"].shape == (0, 4)


def test_empty_states_exactly(tmp_path):
    """-inf and +inf are empty (weight 0, o never read); both empty: o = 0, lse = -inf; one
    empty: the other state, bit for bit in f32."""
    [spec] = load_text('[[kernel]]\nname = "m"\nfamily = "merge_states"\ntargets = ["sm_80"]\n'
                       + _body("f32", 2, 16))
    inputs = MERGE.make_inputs(spec, {"num_tokens": 4}, np.random.default_rng(0))
    inputs["lse_a"][:] = [[-np.inf, np.inf], [np.inf, -np.inf], [1.5, np.inf], [-np.inf, -np.inf]]
    inputs["lse_b"][:] = [[np.inf, -np.inf], [-np.inf, np.inf], [np.inf, 0.25], [-2.0, np.inf]]
    for x in "ab":
        inputs[f"o_{x}"][np.isinf(inputs[f"lse_{x}"])] = np.nan
    art = build_kernel(tmp_path, "merge_states", _body("f32", 2, 16))
    out = art.run(inputs)
    assert np.all(out["o"][:2] == 0) and np.all(np.isneginf(out["lse"][:2]))
    assert np.array_equal(out["o"][2, 0], inputs["o_a"][2, 0]) and out["lse"][2, 0] == np.float32(1.5)
    assert np.array_equal(out["o"][2, 1], inputs["o_b"][2, 1]) and out["lse"][2, 1] == np.float32(0.25)
    assert np.array_equal(out["o"][3, 0], inputs["o_b"][3, 0]) and out["lse"][3, 0] == np.float32(-2.0)
    assert np.all(out["o"][3, 1] == 0) and np.isneginf(out["lse"][3, 1])


def test_two_halves_merge_into_attention_over_all_keys(tmp_path):
    """Cascade attention: states over keys [0, 40) and [40, 113) of the same queries (the
    attention reference, natural-log lse) merge into attention over all 113 keys."""
    rng = np.random.default_rng(3)
    T, H, d, L = 7, 4, 64, 113
    q, k, v = rng.standard_normal((1, H, T, d)), rng.standard_normal((1, H, L, d)), rng.standard_normal((1, H, L, d))
    states = [ref.attention(q, k[:, :, s], v[:, :, s], 0.125) for s in (slice(0, 40), slice(40, L))]
    whole_o, whole_lse = ref.attention(q, k, v, 0.125)
    art = build_kernel(tmp_path, "merge_states", _body("f32", H, d))
    inputs = {}
    for x, (o, lse) in zip("ab", states):
        inputs[f"o_{x}"] = o[0].transpose(1, 0, 2).astype(np.float32)     # [T, H, d]
        inputs[f"lse_{x}"] = lse[0].T.astype(np.float32)                   # [T, H]
    out = art.run(inputs)
    assert np.abs(out["o"] - whole_o[0].transpose(1, 0, 2)).max() < 2e-6
    assert np.abs(out["lse"] - whole_lse[0].T).max() < 2e-6


def test_strided_views_and_vllm_lse_layout(tmp_path):
    """o tensors as views of wider rows (token and head strides past the packed ones), lse as
    the transposed view of vLLM's [num_heads, num_tokens] arrays: the kernel takes the strides
    from its parameters; the metadata lets lse take any element stride."""
    from ptxc.runtime import launch_geometry, pack_args
    from ptxc.pipeline.compiler import lower
    [spec] = load_text('[[kernel]]\nname = "m"\nfamily = "merge_states"\ntargets = ["sm_80"]\n'
                       + _body("bf16", 6, 40))
    ptx, launches, _, _ = lower(spec, "sm_80")
    kernel = launches[0]
    T = 11
    dims = {"num_tokens": T}
    inputs = MERGE.make_inputs(spec, dims, np.random.default_rng(2))
    want = MERGE.reference(spec, inputs)
    bases, views = {}, {}
    for name in ("o_a", "o_b", "o"):
        base = np.full((T, 8, 48), np.uint16(0x7fc0), np.uint16)             # bf16 NaN around
        if name != "o":
            base[:, :6, :40] = ref.to_device(inputs[name], "bf16")
        bases[name], views[name] = base, base[:, :6, :40]
    for name in ("lse_a", "lse_b", "lse"):
        base = np.ascontiguousarray(inputs[name].T) if name != "lse" else np.full((6, T), np.nan, np.float32)
        bases[name], views[name] = base, base.T                              # [H, T] memory
    args = pack_args(kernel, views, dims, pointer=lambda name, arr: bases[name])
    grid, block = launch_geometry(kernel, dims)
    emu.launch(ptx, kernel["entry"], grid, block, args)
    o = ref.from_device(views["o"], "bf16")
    naive = MERGE.reference(spec, inputs, dtype="bf16")
    assert ref.max_abs_error(o, want["o"]) <= ref.tolerance(naive["o"], want["o"])
    assert np.array_equal(np.isneginf(views["lse"]), np.isneginf(want["lse"]))
    assert np.nanmax(np.abs(views["lse"] - want["lse"])[np.isfinite(want["lse"])]) < 1e-5
    assert np.all(np.isnan(bases["o"][:, 6:]) | (bases["o"][:, 6:] == 0x7fc0))   # nothing past the view
    assert np.all(bases["o"][:, :, 40:] == 0x7fc0)


def test_metadata_lets_lse_take_element_strides(tmp_path):
    art = build_kernel(tmp_path, "merge_states", _body("f16", 8, 128))
    t = art.meta["tensors"]
    assert t["lse_a"]["preconditions"] == {"align_bytes": 4, "stride_multiple": 1, "strided_axes": [0, 1]}
    assert t["o_a"]["preconditions"] == {"align_bytes": 16, "stride_multiple": 8, "strided_axes": [0, 1]}
    assert t["lse"]["element_access"] and "element_access" not in t["o"]
    assert art.meta["graph"]["targets"]["sm_80"]["class"] == "ALWAYS"


@pytest.mark.parametrize("text,key", [
    ("num_heads = 4\nhead_dim = 44\n", "head_dim"),
    ("num_heads = 4\nhead_dim = 1024\n", "head_dim"),
    ("num_heads = 4\nhead_dim = 64\nreturn_lse = 1\n", "return_lse"),
    ("num_heads = 4\nhead_dim = 64\nsliding_window = 8\n", "sliding_window"),
])
def test_refusals_name_the_key(text, key):
    with pytest.raises(SpecError) as e:
        load_text(f'[[kernel]]\nname = "m"\nfamily = "merge_states"\ndtype = "f16"\n{text}')
    assert e.value.key == key and "\n" not in str(e.value)
