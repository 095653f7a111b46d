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


def test_occupancy_counts_tensor_memory():
    """sm_100a: a CTA allocating 256 of an SM's 512 tensor-memory columns -- varlen's 4-warp
    tile at d64 -- runs two at a time, though registers (88) and shared memory (41 KiB) would
    keep five resident: the others wait in tcgen05.alloc. Other targets have none to count."""
    occ = occupancy(TARGETS["sm_100a"], 128, 88, 41024, tmem_columns=256)
    assert occ == {"ctas_per_sm": 2, "warps_per_sm": 8, "occupancy": 0.125,
                   "limited_by": "tensor_memory"}
    assert occupancy(TARGETS["sm_100a"], 128, 88, 41024)["ctas_per_sm"] == 5
    assert occupancy(TARGETS["sm_100a"], 320, 121, 166000, tmem_columns=512)["ctas_per_sm"] == 1
    assert TARGETS["sm_90a"].tmem_columns_per_sm == 0 and TARGETS["sm_103a"].tmem_columns_per_sm == 512
