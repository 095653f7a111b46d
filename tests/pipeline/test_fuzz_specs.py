"""Property-based: adversarial spec files never produce a traceback — either valid kernels or a
SpecError naming the file (exit code 2 through the CLI). `-m slow` runs many more examples."""

import json
import string

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ptxc.cli import main
from ptxc.errors import SpecError
from ptxc.kernels import load_text

REAL_KEYS = ["name", "family", "dtype", "head_dim", "num_heads", "num_kv_heads", "softmax_scale",
             "targets", "return_lse", "tile", "num_warps", "kv_unroll", "defaults", "kernel"]
scalars = st.one_of(
    st.integers(min_value=-2**63, max_value=2**63 - 1), st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.sampled_from(["decode", "f16", "bf16", "f32", "sm_80", "sm_90", "../x",
                                           "k_{head_dim}", "{", "\u00e9\u4e2d", "a/b", "CON", ""]))
keys = st.one_of(st.sampled_from(REAL_KEYS), st.text(string.ascii_letters + "_-", min_size=1, max_size=8),
                 st.text(min_size=1, max_size=6))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                       st.dictionaries(keys, inner, max_size=4)),
                      max_leaves=12)


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return {"nan": "nan", "inf": "inf", "-inf": "-inf"}.get(repr(v), repr(v))
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=True)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return "{" + ", ".join(f"{toml_key(k)} = {toml_value(x)}" for k, x in v.items()) + "}"


def toml_key(k: str) -> str:
    return k if k and all(c in string.ascii_letters + string.digits + "_-" for c in k) else json.dumps(k)


kernel_entry = st.fixed_dictionaries(
    {"name": st.one_of(st.just("k"), scalars), "family": st.one_of(st.just("decode"), scalars),
     "dtype": st.one_of(st.sampled_from(["f16", "bf16", "f32"]), scalars),
     "num_heads": st.one_of(st.sampled_from([8, 32]), scalars),
     "head_dim": st.one_of(st.sampled_from([64, 128]), scalars, st.lists(scalars, max_size=70))},
    optional={"num_kv_heads": values, "softmax_scale": values, "targets": values, "tile": values,
              "return_lse": values, "extra": values})


@st.composite
def documents(draw):
    kind = draw(st.sampled_from(["entries", "raw", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "raw":
        return draw(st.text(max_size=200)).encode("utf-8", "surrogatepass")
    lines = []
    if draw(st.booleans()):
        lines.append("[defaults]")
        lines += [f"{toml_key(k)} = {toml_value(v)}" for k, v in draw(st.dictionaries(keys, values, max_size=3)).items()]
    for entry in draw(st.lists(kernel_entry, min_size=0, max_size=3)):
        lines.append("[[kernel]]")
        lines += [f"{toml_key(k)} = {toml_value(v)}" for k, v in entry.items()]
    return "\n".join(lines).encode()


def check(doc: bytes) -> None:
    try:
        specs = load_text(doc, "fuzz.toml")
    except SpecError as e:
        assert str(e).startswith("fuzz.toml"), str(e)
        return
    for s in specs:  # whatever validates must be buildable IR
        assert s.num_heads % s.num_kv_heads == 0


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(documents())
def test_loader_never_crashes(doc):
    check(doc)


@pytest.mark.slow
@settings(max_examples=20000, deadline=None, suppress_health_check=list(HealthCheck))
@given(documents())
def test_loader_never_crashes_long(doc):
    check(doc)


@pytest.mark.parametrize("doc", [
    b"", b"\xff\xfe", b"a = " + b"[" * 50000 + b"]" * 50000,
    b"[[kernel]]\n" + b"tile = " + b"{a = " * 200 + b"1" + b"}" * 200,
    b'[[kernel]]\nname = "k"\nfamily = "decode"\ndtype = "f16"\nnum_heads = 99999999999999999\nhead_dim = 64\n',
])
def test_cli_adversarial_files_exit_2(tmp_path, doc):
    spec = tmp_path / "adv.toml"
    spec.write_bytes(doc)
    r = CliRunner().invoke(main, ["build", str(spec), "--no-verify", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2, r.output
    assert r.output.startswith("error: ") and "adv.toml" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "o").exists()
