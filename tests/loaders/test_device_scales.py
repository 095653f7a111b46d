"""kv_scale = "device": FP8 k_scale / v_scale as [1] f32 device tensors read by the kernels
(vLLM keeps layer._k_scale on the device), so one captured launch list serves a changed scale:
two steps with different scales record identical launches and each dequantises with its own
(decode on tensor cores with the fused append and "auto" splits, varlen, kv_append by slot)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import assert_pass, build_kernel
from ptxc.cli import main
from ptxc.kernels import FAMILIES
from ptxc.reference import max_abs_error
from ptxc.runtime.launch_test import check_artifact
from ptxc.spec.model import KernelSpec

BASE = 'dtype = "bf16"\nhead_dim = 64\nnum_heads = 8\nnum_kv_heads = 2\nkv_layout = "paged"\n' \
       'kv_dtype = "e4m3"\nkv_scale = "device"\n'
CASES = {
    "decode": (BASE + 'num_splits = "auto"\nappend_kv = true\n', {"batch": 3, "max_pages_per_seq": 3, "num_pages": 11}),
    "varlen": (BASE + "causal = true\nnum_splits = 2\n",
               {"batch": 3, "max_pages_per_seq": 3, "num_pages": 11, "total_q": 17}),
    "kv_append": (BASE + 'index = "slot_mapping"\nrope = "neox"\n', {"num_tokens": 9, "num_pages": 2, "max_position": 30}),
}


@pytest.mark.parametrize("family", CASES)
def test_scales_are_device_tensors(tmp_path, family):
    art = build_kernel(tmp_path, family, CASES[family][0], targets=("sm_80", "sm_89"))
    assert art.meta["scalars"] == {}
    for t in ("k_scale", "v_scale"):
        info = art.meta["tensors"][t]
        assert info["shape"] == [1] and info["dtype"] == "f32" and info.get("device_resident")
    assert_pass(check_artifact(art, backend="emu", shapes=CASES[family][1], seed=2))


@pytest.mark.parametrize("family", CASES)
def test_a_changed_scale_replays_the_same_launches(tmp_path, family):
    body, dims = CASES[family]
    art = build_kernel(tmp_path, family, body)
    spec = KernelSpec.from_dict(art.meta["spec"])
    fam = FAMILIES[family]
    records = []
    for i, (ks, vs) in enumerate(((0.37, 1.9), (0.011, 0.52))):
        # the same cache bytes (or new rows), dequantised (or quantised) under this step's scales
        inputs = fam.make_inputs(spec, dims, np.random.default_rng(4))
        inputs["k_scale"], inputs["v_scale"] = np.array([ks], np.float32), np.array([vs], np.float32)
        np.savez(tmp_path / f"in{i}.npz", **inputs)
        r = CliRunner().invoke(main, ["run", str(tmp_path / "out" / "k"), "--inputs", str(tmp_path / f"in{i}.npz"),
                                      "--output", str(tmp_path / f"o{i}.npz"), "--backend", "emu",
                                      "--record-launches", str(tmp_path / f"rec{i}.json")])
        assert r.exit_code == 0, r.output
        records.append(json.loads((tmp_path / f"rec{i}.json").read_text()))
        got, want = np.load(tmp_path / f"o{i}.npz"), fam.reference(spec, inputs)
        for name, expected in want.items():
            if name == "lse":
                continue
            if np.asarray(expected).dtype == np.uint8 or name.endswith("cache"):
                assert np.array_equal(got[name], expected), name
            else:
                assert max_abs_error(got[name].astype(np.float64), expected) < 2e-2, name
    assert records[0] == records[1]
