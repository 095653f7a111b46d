"""The launch model of a persistent prefill (launch_model.persistent_cta, the kernel's snake in
prefill_tile.PersistentTiles): bench/persistent_order.py's comparison -- the snake deals the
default grid's tiles as evenly as the hardware's first-free-slot dispatch, striding by P does
not -- and the dealing itself."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ptxc.report.launch_model import persistent_cta

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import persistent_order  # noqa: E402


def test_the_snake_deals_each_round_to_every_cta_once_mirroring_odd_rounds():
    P = 5
    rounds = [[persistent_cta(t, P) for t in range(k * P, (k + 1) * P)] for k in range(4)]
    assert rounds == [[0, 1, 2, 3, 4], [4, 3, 2, 1, 0]] * 2


def test_snake_matches_the_default_grid_and_striding_does_not(toolchain, capsys):
    from ptxc.report.sass import SassUnavailable, find_nvdisasm
    try:
        find_nvdisasm()
    except SassUnavailable as e:
        pytest.skip(f"nvdisasm unavailable: {e}")
    persistent_order.main(["--shape", "batch=4,seq_q=4096,seq_k=4096"])
    row = capsys.readouterr().out.strip().splitlines()[-1]
    grid, snake, stride = (float(c.split()[0]) for c in row.strip("|").split("|")[1:])
    assert abs(snake - grid) <= 0.01 * grid < stride - grid
