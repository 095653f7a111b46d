"""0 spills for every head_dim and option the spec allows, by the real ptxas: every family x
dtype x causal x head_dim (16..256 step 8, and 512) x default target, and every option over the
engines' head sizes (every head_dim with -m slow and in the record; bench/spill_sweep.py).

Lowering the matrix to PTX is front-end time (~3400 kernels by default, 25 s on 2 cores); ptxas
time is what the record saves. tests/golden/spill_sweep.json records, per combination, the sha256 of its PTX and what
ptxas 13.5 reported for it. The default run re-assembles every combination whose PTX is not the
recorded one (a code-generation change is always re-checked for real) and a fixed sample of the
recorded ones (the record stays honest), and asserts 0 spill bytes everywhere and no ptxas
performance-loss note (C75xx: a wgmma serialised -- every one then waits for the last -- or a
setmaxnreg ignored) on the arch-specific targets; `-m slow`
re-assembles all. Update the record with `python bench/spill_sweep.py --update tests/golden/spill_sweep.json
--out tests/golden/spill_sweep.json` (it exits 1 while anything spills; --floors names the
register_floor.py keys)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import spill_sweep  # noqa: E402

RECORD = Path(__file__).resolve().parents[1] / "golden" / "spill_sweep.json"
SAMPLE = 24


@pytest.fixture(scope="module")
def matrix(toolchain):
    """The default run: the whole base matrix, the options over the engines' head sizes."""
    record = json.loads(RECORD.read_text())
    return spill_sweep.lowered(full=False), record, toolchain


def _check(items, toolchain):
    results = spill_sweep.assemble_all(items, toolchain)
    spilled = {f"{n}/{t}": v for (n, t), v in results.items() if v["spill_bytes"]}
    assert not spilled, f"spills (see ptxc/kernels/config/register_floor.py): {spilled}"
    noted = [f"{n}/{t}" for (n, t), v in results.items() if v.get("performance_notes")]
    assert not noted, f"ptxas notes a performance loss (C75xx) for {noted}"


def test_record_holds_only_spill_free_results(matrix):
    """... and results of the arch-specific targets that say ptxas noted no performance loss."""
    items, record, _ = matrix
    assert len(items) > 3000
    assert len(record["entries"]) > 6000 and {f"{n}/{t}" for n, t, *_ in items} <= set(record["entries"])
    assert all(not spill_sweep.failed(v) for v in record["entries"].values())
    assert all("performance_notes" in v for k, v in record["entries"].items()
               if k.split("/")[1] in spill_sweep.NOTED_TARGETS)


def test_changed_and_sampled_combinations_assemble_without_spills(matrix):
    items, record, toolchain = matrix
    same_ptxas = record["ptxas_version"] == toolchain.version
    entries = record["entries"]
    changed = [it for it in items if not same_ptxas
               or not spill_sweep.reusable(entries.get(f"{it[0]}/{it[1]}"), it[1], it[3])]
    rest = [it for it in items if it not in changed]
    sample = random.Random(20261125).sample(rest, min(SAMPLE, len(rest)))
    _check(changed + sample, toolchain)


@pytest.mark.slow
def test_every_combination_assembles_without_spills(toolchain):
    _check(spill_sweep.lowered(), toolchain)
