"""sm_90a persistent prefill (tile.persistent; tma_ws_pipeline.run_persistent_ws_pipeline over
prefill_tile.PersistentTiles): numerics in the emulator (race checker and deadlock detection on)
against fp64 with grids of a few CTAs taking many work tiles of unequal lengths (causal, q_len >
L, a partial last block, no keys), one or two consumer warpgroups, O staged apart and over Q,
ping-pong, TMA stores and the variants; outputs bit-identical to the non-persistent kernel; the
protocol's mistakes caught (a Q box before the consumers let Q go, a last phase never released,
Q never released); the key's rules and the metadata (the persistent_ctas grid and its rule)."""

import re

import numpy as np
import pytest

from ptxc.errors import EmulationError, SpecError
from ptxc.kernels import FAMILIES, load_text
from ptxc.pipeline.dim_rules import apply_dim_rule
from families.prefill_cases import check, compiled, run, run_edited, spec_text

emu = pytest.importorskip("ptxc.emu", reason="the emulator is needed for numerical checks")
SM90A = ("sm_90a",)
PERS = {"persistent": True}
SMALL = {"block_m": 64, "block_n": 32, **PERS}        # one consumer warpgroup, 2 stages
SLOW = pytest.mark.slow


def pers_text(dtype="bf16", head_dim=64, heads="gqa4", causal=True, tile=SMALL, extra="", lse=True):
    text = spec_text(dtype, head_dim, heads, causal, lse=lse, tile=tile, targets=SM90A)
    return text.replace("[kernel.tile]", extra + "[kernel.tile]")


@pytest.mark.parametrize("tile,causal,shapes,ctas", [
    # 5 and 4 query blocks a head over 2 CTAs: each takes long and short blocks of every head
    (SMALL, True, [(300, 300), (200, 17)], 2),
    (SMALL, False, [(130, 77), (1, 113)], 3),
    ({**SMALL, "num_stages": 3}, True, [(150, 131)], 2),
    # the default tile (two consumer warpgroups, 128 keys a tile, O apart), q_len > L
    pytest.param(PERS, True, [(300, 300), (257, 100)], 3, marks=SLOW),
])
def test_few_ctas_many_tiles(tile, causal, shapes, ctas):
    check(pers_text(causal=causal, tile=tile), shapes, batch=2, target="sm_90a", ctas=ctas)


@pytest.mark.parametrize("dtype,head_dim,heads,causal", [
    pytest.param(dt, d, h, c, marks=SLOW) for dt in ("f16", "bf16") for d in (64, 128, 192, 256)
    for h in ("mha", "gqa4", "mqa") for c in (False, True)])
def test_matrix(dtype, head_dim, heads, causal):
    """The default persistent tile of every dtype x head dim x GQA x causal, three CTAs over a
    partial block, q_len > L and a long sequence."""
    check(pers_text(dtype, head_dim, heads, causal, tile=PERS), [(150, 131), (300, 40)], batch=2,
          target="sm_90a", ctas=3)


def test_default_tile_stages_o_apart_and_the_phases_run_on_across_tiles():
    """The default tile (block_m 128, 128 keys, two stages): O gets its own region (the next Q
    lands during the epilogue); 3 query blocks of 1-3 key tiles per head over 2 CTAs, so the
    ring's stage and parity carry from tile to tile at every offset."""
    text = pers_text(head_dim=128, tile=PERS)
    config = compiled(text, "sm_90a")[3]
    assert (config["persistent"], config["o_staging"], config["threads"]) == (True, "apart", 384)
    check(text, [(300, 300)], batch=1, target="sm_90a", ctas=2)


@pytest.mark.parametrize("tma_store", [False, True])
def test_o_over_q_where_apart_does_not_fit(tma_store):
    """DeepSeek's 192 / 128 (128-key tiles): Q 48 KiB + two stages of 80 KiB + O in a region as
    large as Q's is over the 227 KiB, so O is staged over Q and Q released after the epilogue
    (with TMA stores: after thread 0 saw them read)."""
    text = pers_text(head_dim=192, heads="mqa", tile={**PERS, "tma_store": tma_store},
                     extra="head_dim_v = 128\n")
    config = compiled(text, "sm_90a")[3]
    assert (config["o_staging"], config["block_n"]) == ("over_q", 128)
    check(text, [(140, 140), (300, 40)], batch=1, target="sm_90a", ctas=2)


def test_d256_takes_32_key_tiles():
    """At head dims over 192 the persistent kernel's consumers hold its tile loop's state beside
    d256's accumulators only with 32-key tiles (64 spilled 256 bytes): the default there, O
    staged apart."""
    text = pers_text(head_dim=256, heads="mqa", tile=PERS)
    config = compiled(text, "sm_90a")[3]
    assert (config["block_n"], config["o_staging"]) == (32, "apart")
    check(text, [(150, 131)], batch=1, target="sm_90a", ctas=2)


def test_bit_identical_to_the_non_persistent_kernel():
    """Only which CTA takes a tile, and where O is staged, changed: each tile's math is the same
    instructions in the same order, so the outputs are equal bit for bit."""
    outs = []
    for pers in (False, True):
        text = pers_text(tile={**SMALL, "persistent": pers})
        outs.append(run(text, 150, 113, batch=2, target="sm_90a", seed=3, ctas=3)[0])
    for name in outs[0]:
        assert np.array_equal(outs[0][name], outs[1][name], equal_nan=True), name


def test_bhsd_strides_and_growing_scores():
    """Head-major tensors (through the tensor maps' strides) and scores whose running max keeps
    jumping, over CTAs that take several tiles each."""
    from families.prefill_cases import growing_scores
    check(pers_text(), [(150, 97)], batch=2, target="sm_90a", ctas=3, layout="bhsd")
    check(pers_text(heads="mqa", causal=False), [(70, 113)], batch=2, target="sm_90a", ctas=2,
          transform=growing_scores)


def test_zero_keys_and_rows_that_see_none():
    """A work tile with no key tile (the producer loads only Q, the consumers store zeros and
    -inf) between tiles that have some, and causal rows past the keys."""
    outs = run(pers_text(causal=False), 70, 0, batch=2, target="sm_90a", ctas=3)[0]
    assert np.all(outs["o"] == 0) and np.all(np.isneginf(outs["lse"]))
    check(pers_text(), [(100, 7)], batch=2, target="sm_90a", ctas=3)


@pytest.mark.parametrize("tile,extra", [
    ({**PERS, "pingpong": True}, ""),
    ({**SMALL, "tma_store": True}, "sliding_window = 21\nalibi = true\n"),
    (SMALL, "logits_soft_cap = 2.0\nattention_sinks = true\n"),
    pytest.param({**PERS, "pingpong": True, "tma_store": True},
                 "sliding_window = 100\nlogits_soft_cap = 5.0\n", marks=SLOW),
])
def test_pingpong_tma_stores_and_variants(tile, extra):
    check(pers_text(tile=tile, extra=extra), [(150, 131)], batch=1, target="sm_90a", ctas=2)


# ---- the protocol: what would race or hang on a GPU ----------------------------------------
def _arrivals(ptx: str) -> list[str]:
    return re.findall(r"\tmbarrier\.arrive\.shared::cta\.b64 %rd\d+, \[%r\d+(?:\+\d+)?\];\n", ptx)


def _drop_q_wait(ptx: str) -> str:
    """The producer's wait on q_empty (the barrier after empty[], at +40 with two stages)."""
    return re.sub(r"\$L__mbar_wait_\d+:\n\tmbarrier\.try_wait\.parity\.shared::cta\.b64 %p\d+, "
                  r"\[%r\d+\+40\], %r\d+;\n\t@!%p\d+ bra \$L__mbar_wait_\d+;\n", "", ptx, count=1)


@pytest.mark.parametrize("edit,message", [
    # the next tile's Q box issued while the consumers still read this tile's Q
    (_drop_q_wait, r"race \(write after read\)"),
    # the last P·V's phase never released: the ring's phases fall behind, the producer waits
    (lambda p: p.replace(_arrivals(p)[1], ""), "mbarrier deadlock"),
    # Q never released: the second tile's Q box never comes
    (lambda p: p.replace(_arrivals(p)[2], ""), "mbarrier deadlock"),
])
def test_protocol_mistakes_are_caught(edit, message):
    text = pers_text(head_dim=64, heads="mha", causal=True)
    assert _arrivals(compiled(text, "sm_90a")[1])[2].endswith("+40];\n")    # q_empty's
    with pytest.raises(EmulationError, match=message):
        run_edited(text, "sm_90a", edit, 150, 131, batch=1, ctas=2)


# ---- the key and the launch --------------------------------------------------------------------
def test_key_rules():
    with pytest.raises(SpecError, match=r"persistent = true .*warp-specialised TMA kernel"):
        load_text(pers_text(tile={**PERS, "warp_specialize": False}), "t.toml")
    for tile, d in (({**PERS, "block_m": 192}, 64), ({**PERS, "block_n": 64}, 256)):   # spills
        with pytest.raises(SpecError, match=r"persistent = true with block_m = \d+, block_n = \d+"):
            load_text(pers_text(head_dim=d, tile=tile), "t.toml")
    with pytest.raises(SpecError, match="persistent"):
        load_text(spec_text("bf16", 64, "gqa4", True, tile=PERS, targets=("sm_80",)), "t.toml")


def test_grid_and_dim_rule():
    """The grid is the persistent_ctas dim, an "auto" rule the loaders evaluate with the
    device's SM count: one CTA per resident slot, never more than the work tiles; another
    target of the same spec keeps its own grid and ignores the dim."""
    text = spec_text("bf16", 128, "gqa4", True, tile=PERS, targets=("sm_80", "sm_90a"))
    [spec] = load_text(text, "t.toml")
    iface = FAMILIES["prefill"].interface(spec)
    rule = iface.dim_rules["persistent_ctas"]
    assert "persistent_ctas" in iface.dims and rule["auto"]["occupancy_of"] == f"ptxc_{spec.name}"
    heads = spec.num_heads
    assert apply_dim_rule(rule, {"batch": 4, "seq_q": 4096}, 132, 1) == 132
    assert apply_dim_rule(rule, {"batch": 1, "seq_q": 200}, 132, 1) == 2 * heads
    assert compiled(text, "sm_90a")[2]["grid"] == ["persistent_ctas", "1", "1"]
    assert compiled(text, "sm_80")[2]["grid"][0].startswith("cdiv(seq_q, ")


# ---- O's TMA stores read while the next tile runs ------------------------------------------
def _drop_store_wait(n: int):
    def edit(ptx: str) -> str:
        lines = ptx.split("\n")
        waits = [i for i, line in enumerate(lines) if "cp.async.bulk.wait_group.read 0;" in line]
        del lines[waits[n]]
        return "\n".join(lines)
    return edit


def test_tma_stores_are_waited_for_before_o_is_staged_again_and_at_exit():
    """With O in its own region, thread 0 issues a tile's O boxes and goes on (FlashAttention-3's
    epilogue overlap): the boxes are read while the next tile's loop runs, and thread 0 waits
    for them before the consumers' barrier that precedes the next epilogue, and after the last
    tile. Either wait left out is caught: a stmatrix over boxes in flight, or a CTA exiting
    with them."""
    text = pers_text(tile={**SMALL, "tma_store": True})
    lines = [line.strip() for line in compiled(text, "sm_90a")[1].split("\n")]
    commit = lines.index("cp.async.bulk.commit_group;")
    waits = [i for i, line in enumerate(lines) if line == "cp.async.bulk.wait_group.read 0;"]
    assert len(waits) == 2 and waits[0] < commit < waits[1]       # before the epilogue; at exit
    assert lines[commit + 1] != "cp.async.bulk.wait_group.read 0;"
    check(text, [(300, 131)], batch=1, target="sm_90a", ctas=2)
    for n, message in ((0, "write to shared memory that a TMA store .* in flight reads"),
                       (1, "still reads shared memory when its CTA exits")):
        with pytest.raises(EmulationError, match=message):
            run_edited(text, "sm_90a", _drop_store_wait(n), 150, 131, batch=1, ctas=2)
