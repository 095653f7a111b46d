import pytest

from ptxc.errors import InputError
from ptxc.pipeline.exprs import evaluate, names
from ptxc.targets import TARGETS, occupancy


@pytest.mark.parametrize("text,env,want", [
    ("8", {}, 8), ("batch", {"batch": 3}, 3), ("cdiv(seq_q, 64)", {"seq_q": 113}, 2),
    ("num * 2 + 1", {"num": 4}, 9), ("(a + b) // 2", {"a": 3, "b": 4}, 3),
    ("max(min(a, 5), 2)", {"a": 9}, 5), ("a - b*2", {"a": 10, "b": 3}, 4),
])
def test_evaluate(text, env, want):
    assert evaluate(text, env) == want


def test_names_and_errors():
    assert names("cdiv(seq_q, 64) * batch") == {"seq_q", "batch"}
    with pytest.raises(InputError, match="needs 'batch'"):
        evaluate("batch", {})
    with pytest.raises(InputError, match="unknown function"):
        evaluate("foo(1)", {})
    with pytest.raises(InputError, match="bad launch expression"):
        evaluate("1 +", {})


def test_occupancy_hand_computed_sm80():
    # 128 threads x 64 regs: 2048 regs/warp -> 32 warps by registers -> 8 CTAs;
    # 48 KiB + 1 KiB reserved per CTA from 164 KiB -> 3 CTAs: shared memory binds, 12 of 64 warps.
    occ = occupancy(TARGETS["sm_80"], 128, 64, 48 * 1024)
    assert occ == {"ctas_per_sm": 3, "warps_per_sm": 12, "occupancy": 0.1875,
                   "limited_by": "shared_memory"}


def test_occupancy_register_bound_and_warp_bound():
    # 256 threads x 128 regs on sm_90: 4096 regs/warp -> 16 warps -> 2 CTAs of 8 warps.
    assert occupancy(TARGETS["sm_90"], 256, 128, 0)["ctas_per_sm"] == 2
    # 1024 threads x 32 regs on sm_89: 48 warps max -> 1 CTA of 32 warps.
    occ = occupancy(TARGETS["sm_89"], 1024, 32, 0)
    assert occ["ctas_per_sm"] == 1 and occ["limited_by"] == "warps"
