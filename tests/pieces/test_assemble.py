"""The one attention kernel assembler (ptxc/kernels/bodies/assemble.py): every attention body of
every example spec (prefill, varlen, mla, and decode on tensor cores or SIMT rows), on sm_80,
sm_90a and sm_100a and each of their load methods, runs exactly one main loop of `MAINLOOPS` through
`assemble`, the one the path says, and every main loop in the table is one some example takes."""

import dataclasses
import pathlib
from collections import Counter

import pytest

from ptxc.errors import PtxcError
from ptxc.kernels import FAMILIES, load_paths
from ptxc.kernels.bodies import assemble as A
from ptxc.kernels.families.decode_mma import uses_mma
from ptxc.pipeline.compiler import lower

ROOT = pathlib.Path(__file__).resolve().parents[2]
TARGETS = ("sm_80", "sm_90a", "sm_100a")   # sm_90 / sm_120 take sm_80's paths (and their loops)
LOADS = ({}, {"kv_loads": "cp_async"}, {"warp_specialize": False}, {"warp_specialize": True})
MLA_SCHEDULES = ({"seesaw": True},)      # sm_90a's latent tile (opt-in)
ATTENTION = {"prefill", "varlen", "mla", "decode"}


def _combinations():
    specs = load_paths(sorted(str(p) for p in (ROOT / "specs").glob("*.toml")))
    for spec in specs:
        if spec.family not in ATTENTION:
            continue
        for target in TARGETS:
            for extra in LOADS + MLA_SCHEDULES:
                if extra in MLA_SCHEDULES:
                    if spec.family != "mla" or target != "sm_90a":
                        continue
                elif extra and (spec.family not in ("prefill", "varlen") or
                                target not in ("sm_90a", "sm_100a")):
                    continue
                tile = dict(spec.tile)
                tile.update(extra)
                yield dataclasses.replace(spec, targets=(target,), tile=tuple(sorted(tile.items()))), target


@pytest.fixture(scope="module")
def loops_taken():
    """{(spec name, target, tile): Counter of main loops run} over every combination lowered."""
    seen, taken = {}, Counter()
    original = dict(A.MAINLOOPS)

    def recording(name):
        def run(*args, **kw):
            taken[name] += 1
            return original[name](*args, **kw)
        return run

    with pytest.MonkeyPatch.context() as mp:
        for name in original:
            mp.setitem(A.MAINLOOPS, name, recording(name))
        for spec, target in _combinations():
            taken.clear()
            try:
                FAMILIES[spec.family].validate(spec)
                lower(spec, target)
            except PtxcError:
                continue          # a load method the spec refuses on this target
            seen[(spec, target)] = Counter(taken)
    return seen


def test_every_attention_body_runs_one_main_loop_through_the_assembler(loops_taken):
    assert len(loops_taken) > 100
    for (spec, target), taken in loops_taken.items():
        what = f"{spec.name} on {target} with tile {dict(spec.tile)}"
        # one attention entry (a split-KV reduce has no loop of keys)
        assert sum(taken.values()) == 1, f"{what}: main loops {dict(taken)}"
        if spec.family == "decode":   # tensor cores: the packed tile; else the SIMT rows
            assert ("rows" in taken) != uses_mma(spec), what


def test_every_main_loop_is_taken_by_an_example(loops_taken):
    taken = set()
    for counts in loops_taken.values():
        taken |= set(counts)
    assert taken == set(A.MAINLOOPS)
