"""`ptxc launch-test` and `ptxc run` end to end on the emulator backend."""

import json

import numpy as np
from click.testing import CliRunner

from conftest import SPECS
from ptxc.cli import main
from ptxc.runtime.reference import decode, max_abs_error


def test_launch_test_spec_json(tmp_path):
    r = CliRunner().invoke(main, ["launch-test", str(SPECS / "mistral_7b.toml"), "--backend", "emu",
                                  "--target", "sm_80", "--shape", "batch=3,max_seq_len=41", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["backend"] == "emu" and "2 * max|naive" in data["rule"]
    assert {x["tensor"] for x in data["results"]} == {"o", "lse"}
    assert all(x["pass"] and x["shape"] == "batch=3,max_seq_len=41" for x in data["results"])


def test_launch_test_auto_says_emu_and_prints_table(tmp_path):
    r = CliRunner().invoke(main, ["launch-test", str(SPECS / "gpt2_f32.toml"), "--target", "sm_75",
                                  "--shape", "max_seq_len=9"])
    assert r.exit_code == 0, r.output
    assert "backend: emu (no CUDA device found)" in r.output
    assert "1 passed, 0 failed" in r.output


def test_launch_test_bad_shape_is_exit_2(tmp_path):
    r = CliRunner().invoke(main, ["launch-test", str(SPECS / "gpt2_f32.toml"), "--backend", "emu",
                                  "--shape", "seq_q=3"])
    assert r.exit_code == 2 and "seq_q: not a dimension" in r.output
    r = CliRunner().invoke(main, ["launch-test", str(SPECS / "gpt2_f32.toml"), "--shape", "batch"])
    assert r.exit_code == 2 and "expected name=integer" in r.output


def test_run_npz_round_trip_with_nan_propagating(tmp_path):
    out = tmp_path / "out"
    CliRunner().invoke(main, ["build", str(SPECS / "gpt2_f32.toml"), "--out", str(out), "--no-verify"])
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 12, 64)).astype(np.float32)
    k = rng.standard_normal((2, 7, 12, 64)).astype(np.float32)
    v = rng.standard_normal((2, 7, 12, 64)).astype(np.float32)
    v[1, 0, 3, 5] = np.nan  # NaN in an input is allowed and propagates
    lens = np.array([7, 4], np.int32)
    np.savez(tmp_path / "in.npz", q=q, k_cache=k, v_cache=v, seq_lens=lens)
    r = CliRunner().invoke(main, ["run", str(out / "gpt2_decode_f32"), "--inputs", str(tmp_path / "in.npz"),
                                  "--output", str(tmp_path / "o.npz"), "--backend", "emu", "--target", "sm_80"])
    assert r.exit_code == 0, r.output
    got = np.load(tmp_path / "o.npz")["o"]
    want, _ = decode(q, k, v, lens, 1 / 8)
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(got[1, 3, 5])
    finite = ~np.isnan(want)
    assert max_abs_error(got[finite], want[finite]) < 1e-5
