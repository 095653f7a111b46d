"""Runtime pieces that need neither emulator nor GPU: dim inference and input errors, argument
packing against the metadata ABI, grid evaluation, and the cuda backend's failure mode here."""

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import unsplit_example
from ptxc.pipeline.build import run_build
from ptxc.cli import main
from ptxc.errors import InputError
from ptxc.runtime import infer_dims, launch_geometry, load, pack_args, prepare_buffers


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """The Mistral example with one split: these tests read a single-launch decode's ABI."""
    out = tmp_path_factory.mktemp("rt")
    run_build([unsplit_example(out, "mistral_7b.toml")], out / "out", verify=False, progress=False)
    return load(out / "out" / "mistral_7b_decode")


def inputs(batch=2, seq=7):
    return {"q": np.zeros((batch, 32, 128), np.float32),
            "k_cache": np.zeros((batch, seq, 8, 128), np.float32),
            "v_cache": np.zeros((batch, seq, 8, 128), np.float32),
            "seq_lens": np.array([3, 7][:batch], np.int32)}


def test_dims_are_inferred(mistral):
    assert infer_dims(mistral.meta, inputs(), {}) == {"batch": 2, "max_seq_len": 7}


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d.pop("q"), "missing input(s) q"),
    (lambda d: d.update(extra=np.zeros(1)), "unexpected input(s) extra"),
    (lambda d: d.update(q=np.zeros((2, 32, 64), np.float32)), "axis 2 must be 128"),
    (lambda d: d.update(q=np.zeros((3, 32, 128), np.float32)), "(batch) is 3, but batch = 2"),
    (lambda d: d.update(seq_lens=np.zeros(2, np.float32)), "seq_lens has dtype float32, expected i32"),
    (lambda d: d.update(k_cache=np.zeros((2, 7, 128), np.float32)), "expected [batch, max_seq_len, 8, 128]"),
])
def test_input_errors_are_precise(mistral, mutate, message):
    d = inputs()
    mutate(d)
    with pytest.raises(InputError) as e:
        infer_dims(mistral.meta, d, {})
    assert message in str(e.value) and "mistral_7b_decode" in str(e.value)


def test_pack_args_follows_the_abi(mistral):
    _, t = mistral.target("sm_80")
    [kernel] = t["kernels"]
    dims = infer_dims(mistral.meta, inputs(), {})
    buffers = prepare_buffers(mistral.meta, inputs(), dims)
    assert buffers["k_cache"].dtype == np.uint16            # bf16 travels as bits
    assert np.isnan(buffers["lse"]).all()                   # outputs start poisoned
    values = pack_args(kernel, buffers, dims, pointer=lambda name, arr: name)
    by_name = dict(zip((p["name"] for p in kernel["params"]), values))
    assert by_name["q"] == "q" and by_name["lse"] == "lse"
    assert by_name["k_cache_stride0"] == 7 * 8 * 128 and by_name["k_cache_stride1"] == 8 * 128
    assert by_name["k_cache_stride2"] == 128 and by_name["q_stride1"] == 128
    assert by_name["max_seq_len"] == np.uint32(7) and type(by_name["max_seq_len"]) is np.uint32
    assert [type(v) for v in values[6:16]] == [np.int64] * 10
    assert launch_geometry(kernel, dims) == ((8, 2, 1), (32, 1, 1))   # GQA 4: one-warp mma CTAs


def test_cuda_backend_without_driver_is_one_line_exit_2(mistral, tmp_path):
    np.savez(tmp_path / "in.npz", **inputs())
    r = CliRunner().invoke(main, ["run", str(mistral.path), "--inputs", str(tmp_path / "in.npz"),
                                  "--output", str(tmp_path / "o.npz"), "--backend", "cuda"])
    assert r.exit_code == 2, r.output
    assert r.output.startswith("error: ") and len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "o.npz").exists()


def test_run_rejects_bad_npz(mistral, tmp_path):
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    r = CliRunner().invoke(main, ["run", str(mistral.path), "--inputs", str(tmp_path / "bad.npz"),
                                  "--output", str(tmp_path / "o.npz"), "--backend", "emu"])
    assert r.exit_code == 2 and "cannot read as .npz" in r.output
    d = inputs()
    d.pop("v_cache")
    np.savez(tmp_path / "in.npz", **d)
    r = CliRunner().invoke(main, ["run", str(mistral.path), "--inputs", str(tmp_path / "in.npz"),
                                  "--output", str(tmp_path / "o.npz"), "--backend", "emu"])
    assert r.exit_code == 2 and "missing input(s) v_cache" in r.output
