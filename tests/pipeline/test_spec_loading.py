import math

from ptxc.kernels import load_text

BASE = 'family = "decode"\ndtype = "f16"\nnum_heads = 8\nhead_dim = 64\n'


def test_defaults_and_derived_values():
    [s] = load_text('[defaults]\ntargets = ["sm_90"]\n[[kernel]]\nname = "k"\n' + BASE)
    assert s.targets == ("sm_90",)
    assert s.num_kv_heads == 8 and s.group_size == 1
    assert math.isclose(s.softmax_scale, 1 / 8)
    assert s.opt("return_lse") is False


def test_expansion_suffixes_are_deterministic():
    text = '[[kernel]]\nname = "k"\n' + BASE.replace('"f16"', '["f16", "bf16"]').replace(
        "head_dim = 64", "head_dim = [64, 128]")
    names = [s.name for s in load_text(text)]
    assert names == ["k_dtypef16_head_dim64", "k_dtypef16_head_dim128",
                     "k_dtypebf16_head_dim64", "k_dtypebf16_head_dim128"]


def test_expansion_placeholders_and_tile_lists():
    text = ('[[kernel]]\nname = "k_{dtype}_w{tile_num_warps}"\n' + BASE.replace('"f16"', '["f16", "f32"]')
            + "[kernel.tile]\nnum_warps = [2, 4]\n")
    specs = load_text(text)
    assert [s.name for s in specs] == ["k_f16_w2", "k_f16_w4", "k_f32_w2", "k_f32_w4"]
    assert specs[1].tile_dict() == {"num_warps": 4}


def test_defaults_tile_merges_with_kernel_tile():
    text = ('[defaults]\ntile = { num_warps = 2 }\n[[kernel]]\nname = "k"\n' + BASE
            + "[kernel.tile]\nkv_unroll = 2\n")
    [s] = load_text(text)
    assert s.tile_dict() == {"num_warps": 2, "kv_unroll": 2}


def test_canonical_form_ignores_key_order():
    a = load_text('[[kernel]]\nname = "k"\n' + BASE)[0]
    b = load_text('[[kernel]]\nhead_dim = 64\nnum_heads = 8\ndtype = "f16"\nfamily = "decode"\nname = "k"\n')[0]
    assert a.to_dict() == b.to_dict()


def test_kv_append_needs_num_heads_only_with_rope():
    import pytest
    from ptxc.errors import SpecError
    base = '[[kernel]]\nname = "a"\nfamily = "kv_append"\ndtype = "f16"\nhead_dim = 64\n'
    (spec,) = load_text(base + "num_kv_heads = 4\n")
    assert (spec.num_heads, spec.num_kv_heads) == (4, 4)
    (spec,) = load_text(base + "num_heads = 8\n")          # accepted for symmetry
    assert (spec.num_heads, spec.num_kv_heads) == (8, 8)
    with pytest.raises(SpecError, match="num_kv_heads.*missing required key"):
        load_text(base)
    with pytest.raises(SpecError, match="num_heads.*missing required key"):
        load_text(base + 'num_kv_heads = 4\nrope = "neox"\n')
    (spec,) = load_text(base + 'num_heads = 32\nnum_kv_heads = 8\nrope = "neox"\n')
    assert (spec.num_heads, spec.num_kv_heads) == (32, 8)
