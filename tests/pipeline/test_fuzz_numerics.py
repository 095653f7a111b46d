"""bench/fuzz_numerics.py, the random-spec campaign against fp64, stays runnable: its drawn
specs are TOML the loader accepts or refuses in one line, a few seeded cases run end to end on
the emulator and pass, and a log's failures replay."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from ptxc.errors import SpecError
from ptxc.kernels import load_text

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import fuzz_numerics  # noqa: E402


def test_drawn_specs_load_or_are_refused_in_one_line():
    r = random.Random(7)
    loaded = 0
    for n in range(300):
        fields, tile, target = fuzz_numerics.draw_spec(r)
        text = fuzz_numerics.spec_text(f"k{n}", fields, tile, target)
        try:
            [spec] = load_text(text, "k.toml")
        except SpecError as e:
            assert "\n" not in str(e) and "k.toml" in str(e)
            continue
        assert spec.family == fields["family"] and list(spec.targets) == [target]
        loaded += 1
    assert loaded > 200          # the draw mostly makes kernels, not refusals


def test_seeded_cases_pass_and_a_log_replays(tmp_path, capsys):
    log = tmp_path / "fz.jsonl"
    assert fuzz_numerics.main(["--seed", "11", "--cases", "6", "--log", str(log)]) == 0
    cases = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(cases) == 6 and {c["outcome"] for c in cases} <= {"pass", "refused"}
    assert any(c["outcome"] == "pass" for c in cases)
    # a recorded failure replays with its own spec, seed and dims
    case = next(c for c in cases if c["outcome"] == "pass")
    log.write_text(json.dumps({**case, "outcome": "fail"}) + "\n")
    capsys.readouterr()
    assert fuzz_numerics.main(["--replay", str(log)]) == 0
    assert '"pass": 1' in capsys.readouterr().out


def test_a_refusal_of_a_tile_key_the_case_never_gave_is_a_defect():
    """A derived tile value refused as if the user had given it (16-head sparse MLA's
    "num_warps = 1", counted as 27 plain refusals in seed 15's campaign) is an error."""
    case = {"tile": {"block_n": 16}}
    assert fuzz_numerics._refusal(SpecError("x", key="tile.num_warps"), case) == "error"
    assert fuzz_numerics._refusal(SpecError("x", key="tile.block_n"), case) == "refused"
    assert fuzz_numerics._refusal(SpecError("x", key="num_heads"), case) == "refused"
    assert fuzz_numerics._refusal(ValueError("x"), case) == "refused"
