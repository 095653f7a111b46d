"""Paged caches of any page size from 1 to 1024 rows in every family: sizes that are not powers
of two (3, 5, 24, 192, 528 -- hybrid-model engines size attention pages to match a state) divide
where powers of two shift. Each kernel in the emulator against fp64 with sequences crossing
pages; on sm_90a varlen takes TMA boxes for pages that are whole 64-row tiles (192) and keeps
cp.async otherwise (24); the 528-row example spec builds with 0 spills and passes launch-test."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from conftest import SPECS, assert_pass, build_kernel
from ptxc.cli import main
from ptxc.errors import SpecError
from ptxc.runtime.launch_test import check_artifact
from ptxc.kernels import load_text

GQA = 'dtype = "f16"\nhead_dim = 64\nnum_kv_heads = 2\nkv_layout = "paged"\n'

CASES = [  # (family, page_size, extra spec lines, targets, shapes)
    ("decode", 24, 'num_splits = "auto"\nreturn_lse = true\n', ("sm_80",),
     {"batch": 3, "max_pages_per_seq": 3, "num_pages": 11}),
    ("decode", 3, "num_heads = 2\n", ("sm_80",), {"batch": 3, "max_pages_per_seq": 9, "num_pages": 30}),
    ("decode", 5, 'kv_dtype = "e4m3"\nappend_kv = true\n', ("sm_89",),
     {"batch": 3, "max_pages_per_seq": 6, "num_pages": 20}),
    ("varlen", 24, "causal = true\n", ("sm_80", "sm_90a"),
     {"batch": 3, "max_pages_per_seq": 3, "num_pages": 11, "total_q": 19}),
    ("varlen", 192, "causal = true\nsliding_window = 100\n", ("sm_90a",),
     {"batch": 2, "max_pages_per_seq": 2, "num_pages": 5, "total_q": 21}),
    ("varlen", 7, 'causal = true\nkv_dtype = "e4m3"\nnum_splits = 3\n', ("sm_80",),
     {"batch": 3, "max_pages_per_seq": 5, "num_pages": 17, "total_q": 13}),
    ("kv_append", 5, "", ("sm_80",), {"batch": 4, "num_new": 3, "max_pages_per_seq": 3, "num_pages": 14}),
    ("kv_append", 24, 'index = "slot_mapping"\nkv_dtype = "e5m2"\nrope = "gptj"\n', ("sm_89",),
     {"num_tokens": 17, "num_pages": 3, "max_position": 40}),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-p{c[1]}-{'-'.join(c[3])}")
def test_non_power_of_two_pages_match_the_reference(tmp_path, case):
    family, ps, extra, targets, shapes = case
    heads = "" if "num_heads" in extra else "num_heads = 8\n"
    art = build_kernel(tmp_path, family, GQA + heads + f"page_size = {ps}\n" + extra, targets=targets)
    assert_pass(check_artifact(art, backend="emu", shapes=shapes, seed=11))


def test_varlen_tma_takes_whole_tile_pages_only(tmp_path):
    """A TMA box of min(page_size, block_n) rows must sit in one page: 192 = 3 x 64 takes TMA,
    24 keeps the cp.async body (no error)."""
    maps = {}
    for ps in (192, 24, 64):
        art = build_kernel(tmp_path / str(ps), "varlen", GQA + f"num_heads = 8\npage_size = {ps}\ncausal = true\n",
                           targets=("sm_90a",))
        maps[ps] = [p for k in art.meta["targets"]["sm_90a"]["kernels"] for p in k["params"]
                    if p["source"]["kind"] == "tensor_map"]
    assert len(maps[192]) == 2 and len(maps[64]) == 2 and maps[24] == []


@pytest.mark.parametrize("ps", [0, 1025])
def test_page_size_out_of_range_is_one_line(ps):
    with pytest.raises(SpecError) as e:
        load_text(f'[[kernel]]\nname = "k"\nfamily = "decode"\nnum_heads = 8\n{GQA}page_size = {ps}\n', "k.toml")
    assert e.value.key == "page_size" and "1 to 1024" in str(e.value)


def test_example_spec_with_528_row_pages_builds_and_passes_launch_test(tmp_path):
    spec = SPECS / "hybrid_pages.toml"
    r = CliRunner().invoke(main, ["build", str(spec), "--out", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    for meta in (tmp_path / "out").glob("*/*.json"):
        data = json.loads(meta.read_text())
        for t in data["targets"].values():
            assert all(k["resources"]["spill_stores"] + k["resources"]["spill_loads"] == 0
                       for k in t["kernels"]), meta.name
    r = CliRunner().invoke(main, ["launch-test", str(spec), "--backend", "emu", "--target", "sm_80"])
    assert r.exit_code == 0, r.output
    assert r.output.count("pages crossed (1056 rows, page_size 528)") == 2
    assert "NOT" not in r.output
