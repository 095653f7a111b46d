"""Tier 1: exact golden PTX for a tiny kernel. Regenerate deliberately with
`PTXC_UPDATE_GOLDEN=1 pytest tests/pipeline/test_golden.py` and review the diff."""

import os
from pathlib import Path

from ptxc.pipeline.compiler import lower
from ptxc.kernels import load_file

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def test_decode_tiny_golden_ptx():
    [spec] = load_file(GOLDEN / "decode_tiny.toml")
    ptx, launches, config, _ = lower(spec, "sm_80")
    path = GOLDEN / "decode_tiny.sm_80.ptx"
    if os.environ.get("PTXC_UPDATE_GOLDEN"):
        path.write_text(ptx)
    assert ptx == path.read_text(), "generated PTX changed; review and regenerate the golden file"
    assert launches[0]["grid"] == ["1", "batch", "1"] and launches[0]["block"] == [32, 1, 1]


def test_golden_ptx_assembles(toolchain):
    from ptxc.pipeline.ptxas import assemble
    _, res, _ = assemble((GOLDEN / "decode_tiny.sm_80.ptx").read_text(), "sm_80", toolchain, "tiny")
    assert res["ptxc_decode_tiny"].spill_stores == 0
