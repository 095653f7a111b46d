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


WINDOWED = '''
[defaults]
targets = ["sm_80"]
family = "prefill"
dtype = "bf16"
head_dim = 64
num_heads = 4
causal = true

[[kernel]]
name = "p_global"

[[kernel]]
name = "p_local"
sliding_window = 1024
logits_soft_cap = 50.0
'''


def test_semantic_fields_are_part_of_every_key(tmp_path):
    """A Gemma-style sliding-window kernel and a global kernel of the same shape are told apart,
    under the spec's own field names, in Python and in the C and Rust dispatch tables."""
    from click.testing import CliRunner
    from ptxc.cli import main
    (tmp_path / "w.toml").write_text(WINDOWED)
    out = tmp_path / "out"
    run_build([tmp_path / "w.toml"], out, verify=False, progress=False)
    assert find_variant(out, family="prefill", sliding_window=1024).name == "p_local"
    assert find_variant(out, family="prefill", sliding_window=None).name == "p_global"
    assert find_variant(out, "head_dim=64,logits_soft_cap=none").name == "p_global"
    with pytest.raises(InputError, match=r"^ambiguous variant head_dim=64"):
        find_variant(out, head_dim=64)
    with pytest.raises(InputError, match=r"unknown field 'window'.*sliding_window"):
        find_variant(out, window=1024)
    assert CliRunner().invoke(main, ["emit-c-header", str(out), "-o", str(tmp_path / "k.h")]).exit_code == 0
    assert CliRunner().invoke(main, ["emit-rust", str(out), "-o", str(tmp_path / "k.rs")]).exit_code == 0
    for f in ("k.h", "k.rs"):
        text = (tmp_path / f).read_text()
        assert "sliding_window=1024" in text and "sliding_window=none" in text, f
        assert "logits_soft_cap=50.0" in text and "causal=true" in text, f


def test_variant_keys_come_from_the_field_tables():
    """Every non-tile spec field of every family is a key field (a new field is picked up)."""
    from ptxc.kernels import FAMILIES
    from ptxc.runtime.dispatch import variant_keys
    from ptxc.spec.loader import COMMON_FIELDS
    want = {f.name for f in COMMON_FIELDS} - {"name", "targets"}
    for fam in FAMILIES.values():
        want |= {f.name for f in fam.fields.fields}
        assert not {f.name for f in fam.fields.tile} & set(variant_keys()) - want
    assert want == set(variant_keys())
    for name in ("sliding_window", "logits_soft_cap", "attention_sinks", "alibi", "head_dim_v",
                 "kv_dtype", "kv_scale", "causal", "return_lse", "softmax_scale"):
        assert name in variant_keys()
