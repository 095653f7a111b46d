"""Variant lookup over a build directory (ptxc.runtime.find_variant): a hit, and loud errors for
a variant that was not built, an ambiguous key and an unknown field."""

import pytest

from ptxc.errors import InputError
from ptxc.pipeline.build import run_build
from ptxc.runtime import find_variant

SPECS = '''
[defaults]
targets = ["sm_80"]
head_dim = 64
num_heads = 4
num_kv_heads = 2

[[kernel]]
name = "d_f16"
family = "decode"
dtype = "f16"

[[kernel]]
name = "d_bf16_paged"
family = "decode"
dtype = "bf16"
kv_layout = "paged"
page_size = 16

[[kernel]]
name = "p_causal"
family = "prefill"
dtype = "f16"
causal = true
'''


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    root = tmp_path_factory.mktemp("dispatch")
    (root / "s.toml").write_text(SPECS)
    run_build([root / "s.toml"], root / "out", verify=False, progress=False)
    return root / "out"


def test_lookup_by_fields_or_key_text(out):
    assert find_variant(out, family="decode", dtype="bf16").name == "d_bf16_paged"
    assert find_variant(out, "family=prefill,causal=true,head_dim=64").name == "p_causal"
    assert find_variant(out, {"family": "decode", "kv_layout": "contiguous"}).name == "d_f16"


def test_missing_variant_is_loud_and_lists_what_was_built(out):
    with pytest.raises(InputError) as e:
        find_variant(out, family="decode", dtype="f16", head_dim=128)
    msg = str(e.value)
    assert msg.startswith("not built: family=decode,dtype=f16,head_dim=128; built variants are d_bf16_paged: ")
    assert "d_f16: family=decode,dtype=f16,head_dim=64" in msg and "p_causal: family=prefill" in msg


def test_ambiguous_and_unknown_keys(out):
    with pytest.raises(InputError, match=r"^ambiguous variant family=decode: matches d_bf16_paged, d_f16"):
        find_variant(out, family="decode")
    with pytest.raises(InputError, match=r"unknown field 'heads'"):
        find_variant(out, "family=decode,heads=4")


@pytest.mark.parametrize("sm,want", [
    (75, None), (80, ("sm_80", "cubin")), (86, ("sm_80", "ptx")), (89, ("sm_89", "ptx")),
    (90, ("sm_90a", "cubin")), (100, ("sm_90", "ptx")), (120, ("sm_90", "ptx"))])
def test_image_choice_rule(sm, want):
    """Newest target not newer than the device; arch-specific targets only on exactly their SM;
    the cubin only for exactly the device's SM, else the PTX (JIT)."""
    from ptxc.runtime import pick_target
    targets = {"sm_90": {"cubin": "x"}, "sm_80": {"cubin": "x"}, "sm_90a": {"cubin": "x"}, "sm_89": {}}
    assert pick_target(targets, sm) == want


def test_targets_order_numerically():
    from ptxc.emit.view import target_order
    assert sorted(["sm_120", "sm_90a", "sm_100", "sm_80", "sm_90", "sm_89"], key=target_order) == \
        ["sm_80", "sm_89", "sm_90", "sm_90a", "sm_100", "sm_120"]
