"""Every class of bad spec gives exit code 2, one line naming file, kernel, key, value and what
is allowed, and writes nothing."""

import pytest
from click.testing import CliRunner

from ptxc.cli import main
from ptxc.errors import SpecError
from ptxc.kernels import load_text

BASE = '[[kernel]]\nname = "k"\nfamily = "decode"\ndtype = "f16"\nnum_heads = 8\nhead_dim = 64\n'

PREFILL = BASE.replace('"decode"', '"prefill"')
VARLEN = BASE.replace('"decode"', '"varlen"')
CASES = {
    "unknown key": (BASE + "head_dims = 64\n",
                    ["kernel #0 'k'", "key 'head_dims'", "did you mean 'head_dim'?"]),
    "wrong type": (BASE.replace("head_dim = 64", 'head_dim = "64"'),
                   ["key 'head_dim'", "got '64' (string)", "expected an integer"]),
    "bool for int": (BASE.replace("num_heads = 8", "num_heads = true"),
                     ["key 'num_heads'", "got true (boolean)"]),
    "out of range": (BASE.replace("head_dim = 64", "head_dim = 100"),
                     ["key 'head_dim'", "got 100", "a multiple of 8 from 16 to 512"]),
    "negative": (BASE.replace("num_heads = 8", "num_heads = -8"),
                 ["key 'num_heads'", "got -8", "from 1 to 1024"]),
    "gqa divisibility": (BASE + "num_kv_heads = 3\n",
                         ["key 'num_kv_heads'", "num_heads = 8 is not divisible by num_kv_heads = 3"]),
    "unsupported target": (BASE + 'targets = ["sm_70"]\n',
                           ["key 'targets'", "'sm_70' is not one", "sm_75"]),
    "misspelt target": (BASE + 'targets = ["sm80"]\n', ["did you mean 'sm_80'?"]),
    "bad dtype": (BASE.replace('"f16"', '"fp16"'), ["key 'dtype'", "got 'fp16'", "'f32' | 'f16' | 'bf16'"]),
    "unknown family": (BASE.replace('"decode"', '"decod"'), ["key 'family'", "did you mean 'decode'?"]),
    "missing key": (BASE.replace("num_heads = 8\n", ""), ["key 'num_heads'", "missing required key"]),
    "bf16 on sm_75": (BASE.replace('"f16"', '"bf16"') + 'targets = ["sm_75"]\n',
                      ["key 'targets'", "bf16 needs sm_80"]),
    "unknown tile key": (BASE + "[kernel.tile]\nnum_warp = 4\n", ["key 'tile.num_warp'", "did you mean 'num_warps'?"]),
    "bad tile value": (BASE + "[kernel.tile]\nnum_warps = 3\n", ["key 'tile.num_warps'", "got 3", "1 | 2 | 4 | 8"]),
    "path-like name": (BASE.replace('"k"', '"../x"'), ["key 'name'", "got '../x'", "[a-z][a-z0-9_]*"]),
    "duplicate after expansion": (BASE.replace('"k"', '"k_{dtype}"').replace("head_dim = 64", "head_dim = [64, 128]"),
                                  ["duplicate kernel name after expansion"]),
    "expansion cap": (BASE.replace("num_heads = 8", "num_heads = [1,2,3,4,5,6,7,8]")
                      .replace("head_dim = 64", "head_dim = [16,24,32,40,48,56,64,72]")
                      + "softmax_scale = [1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31,32,33,34,35,36,37,38,39,40,41,42,43,44,45,46,47,48,49,50,51,52,53,54,55,56,57,58,59,60,61,62,63,64,65]\n",
                      ["expand to 4160 kernels", "at most 4096"]),
    "empty list": (BASE.replace("head_dim = 64", "head_dim = []"), ["key 'head_dim'", "empty list"]),
    "malformed toml": ('[[kernel]]\nname = "k\n', ["malformed TOML", "line 2"]),
    "unknown top-level table": ("[kernels]\nx = 1\n", ["key 'kernels'", "did you mean 'kernel'?"]),
    "no kernels": ("[defaults]\ndtype = 'f16'\n", ["no [[kernel]] entries"]),
    "kernel not a table array": ("kernel = 3\n", ["key 'kernel'", "array of tables"]),
    "infinite scale": (BASE + "softmax_scale = inf\n", ["key 'softmax_scale'", "finite"]),
    "bad placeholder": (BASE.replace('"k"', '"k_{nope}"'), ["key 'name'", "bad placeholder"]),
    # a path key whose target is listed: the shapes keep the path off, not the targets
    "path key, target listed": (
        PREFILL.replace("head_dim = 64", "head_dim = 96") + 'targets = ["sm_100a"]\n[kernel.tile]\nexp2_poly = 3\n',
        ["key 'tile.exp2_poly'", "sm_100a is listed, but this kernel's dtype, head sizes or cache keep it off that path: change them or drop the key"]),
    "path key, target missing": (
        PREFILL + 'targets = ["sm_90a"]\n[kernel.tile]\nexp2_poly = 3\n',
        ["key 'tile.exp2_poly'", "add sm_100a or sm_103a or drop the key"]),
    "varlen path key, target listed": (
        VARLEN.replace("head_dim = 64", "head_dim = 40") + 'targets = ["sm_103a"]\n[kernel.tile]\nwarp_specialize = true\n',
        ["key 'tile.warp_specialize'", "sm_103a is listed, but"]),
    "varlen ping-pong, no sm_90a": (
        VARLEN + 'num_kv_heads = 2\ntargets = ["sm_100a"]\n[kernel.tile]\npingpong = true\nblock_m = 128\n',
        ["key 'tile.pingpong'", "add sm_90a or drop the key"]),
    "sparse block_m": (
        '[[kernel]]\nname = "k"\nfamily = "mla"\ndtype = "bf16"\nnum_heads = 16\nkv_lora_rank = 512\n'
        'qk_rope_head_dim = 64\nsoftmax_scale = 0.07\nsparse_topk = 64\n[kernel.tile]\nblock_m = 64\n',
        ["key 'tile.block_m'", "allowed: 16 (a divisor of num_heads)"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_spec_message(case):
    text, expected = CASES[case]
    with pytest.raises(SpecError) as err:
        load_text(text, "bad.toml")
    msg = str(err.value)
    assert msg.startswith("bad.toml: "), msg
    for part in expected:
        assert part in msg, f"{part!r} not in {msg!r}"


@pytest.mark.parametrize("case", ["unknown key", "out of range", "malformed toml", "bf16 on sm_75"])
def test_cli_exit_code_2_no_traceback_nothing_written(tmp_path, case):
    spec = tmp_path / "bad.toml"
    spec.write_text(CASES[case][0])
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["build", str(spec), "--out", str(out), "--no-verify"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.output.startswith("error: ") and str(spec) in result.output
    assert not out.exists()


def test_binary_garbage_and_missing_file(tmp_path):
    garbage = tmp_path / "g.toml"
    garbage.write_bytes(b"\x00\xff\xfe\x80")
    r = CliRunner().invoke(main, ["build", str(garbage), "--no-verify", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "not UTF-8" in r.output
    r = CliRunner().invoke(main, ["build", str(tmp_path / "nope.toml"), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "no such file" in r.output


def test_duplicate_names_across_files(tmp_path):
    (tmp_path / "a.toml").write_text(BASE)
    (tmp_path / "b.toml").write_text(BASE)
    r = CliRunner().invoke(main, ["build", str(tmp_path), "--no-verify", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "duplicate kernel name" in r.output and "a.toml" in r.output
