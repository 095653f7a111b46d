"""varlen's sm_90a TMA tile warp-specialised (tile.warp_specialize; varlen_tma.emit_ws_tile on
tma_ws_pipeline.run_tma_ws_pipeline): a producer warpgroup whose first warp's lanes share each
tile's boxes and load the page ids, one or two consumer warpgroups that wait full[s] and release
empty[s] with no CTA barrier in their loop. Emulator numerics (race checker and deadlock
detection on) against fp64 on the ragged batches of test_varlen_tma.py, whose caches hold NaN at
and past every L and in every unused page; outputs bit-identical to the one-issuer tile (the
same math in the same order); the protocol's mistakes caught; the key's rules, the launch and
ptxas with 0 spills."""

import re

import numpy as np
import pytest

from conftest import build_kernel
from ptxc.errors import EmulationError, SpecError
from ptxc.kernels import FAMILIES, load_text
from ptxc.spec.model import KernelSpec
from ptxc.targets import TARGETS
from families.test_varlen_tma import SLOW_MATRIX, TMA, case_id, check_poisoned, spec_body

pytest.importorskip("ptxc.emu", reason="the emulator is needed for numerical checks")
VARLEN = FAMILIES["varlen"]
SM90A = ("sm_90a",)
SLOW = pytest.mark.slow
WS = "warp_specialize = true"
OFF = "warp_specialize = false"


def build(tmp_path, layout, tile="", extra="", ws=True, **case):
    art = build_kernel(tmp_path, "varlen", spec_body(layout, **case) + extra,
                       tile="\n".join(x for x in (TMA, WS if ws else OFF, tile) if x), targets=SM90A)
    target = art.meta["targets"]["sm_90a"]
    assert target["config"]["kv_loads"] == "tma"
    assert bool(target["config"].get("warp_specialize")) == ws
    return art, KernelSpec.from_dict(art.meta["spec"])


@pytest.mark.parametrize("layout,tile,case", [
    ("page16", "block_n = 32", dict(dtype="f16", head_dim=64, gqa="gqa4", causal=True, splits="auto")),
    ("contiguous", "block_n = 32", dict(dtype="bf16", head_dim=64, gqa="gqa8", causal=False,
                                        splits=3)),
    ("page64", "num_stages = 3", dict(dtype="f16", head_dim=64, gqa="gqa8", causal=True, splits=4)),
    *SLOW_MATRIX,
], ids=case_id)
def test_ragged_batch_with_nan_garbage(tmp_path, layout, tile, case):
    """Lengths 0 / 1 / 17 / 113, chunks and verifications, q_len > L, pages crossed, splits
    with empty shares, 2 and 3 stages; NaN past L and in unused pages never reaches O or the
    LSE: the producer's lanes load the right page ids, the consumers zero the V tail."""
    art, spec = build(tmp_path, layout, tile, **case)
    out, inputs = check_poisoned(art, spec, layout)
    cu = inputs["cu_seqlens_q"]
    assert np.all(out["o"][cu[6]:cu[7]] == 0)                 # L = 0
    assert np.all(np.isneginf(out["lse"][cu[6]:cu[7]]))


def test_bit_identical_to_the_one_issuer_tile(tmp_path):
    """The consumers run the one-issuer tile's math in its order: the same bits out."""
    from families.test_varlen_tma import poison
    from families.test_varlen_wgmma import LENGTHS, ragged_inputs
    case = dict(dtype="bf16", head_dim=128, gqa="gqa4", causal=True, splits=3)
    outs = []
    for ws in (True, False):
        art, spec = build(tmp_path / str(ws), "page16", ws=ws, **case)
        inputs = poison(ragged_inputs(spec, "page16", LENGTHS, 5), "page16", LENGTHS)
        outs.append(art.run(inputs, target="sm_90a"))
    for t in outs[0]:
        assert np.array_equal(outs[0][t], outs[1][t], equal_nan=True), t


def test_two_consumer_warpgroups_small_tile_page8(tmp_path):
    """block_m 128: two consumer warpgroups (384 threads, one CTA an SM, 24 / 240 registers),
    block_n 16 at head_dim 64 (the tail zeroing's one pass is partial: 128 chunks for 256
    consumer threads), 8-row pages (two boxes of one swizzle period per slab and tile)."""
    art, spec = build(tmp_path, "page8", "block_m = 128\nnum_warps = 8\nblock_n = 16",
                      dtype="bf16", head_dim=64, gqa="gqa4", causal=True, splits=2)
    target = art.meta["targets"]["sm_90a"]
    assert target["kernels"][0]["block"] == [384, 1, 1]
    assert target["config"]["setmaxnreg"] == [24, 240] and target["config"]["min_ctas_per_sm"] == 1
    check_poisoned(art, spec, "page8", seed=1)


@pytest.mark.parametrize("layout,tile,case", [
    ("page16", "block_n = 32", dict(dtype="bf16", head_dim=64, gqa="gqa8", causal=True, splits=2)),
    pytest.param("contiguous", "", dict(dtype="f16", head_dim=128, gqa="gqa8", causal=False,
                                        splits=1), marks=SLOW),
], ids=["d64-page16", "d128-contiguous"])
def test_pingpong(tmp_path, layout, tile, case):
    """tile.pingpong on two consumer warpgroups (block_m 128): the turns on named barriers 2 and
    3 order only when each warpgroup issues its wgmma, so the outputs are the plain two-warpgroup
    tile's bit for bit; NaN past L never reaches O."""
    m128 = "block_m = 128\nnum_warps = 8\n" + tile
    outs = []
    for pp in (True, False):
        art, spec = build(tmp_path / str(pp), layout, m128 + ("\npingpong = true" if pp else ""), **case)
        assert bool(art.meta["targets"]["sm_90a"]["config"].get("pingpong")) == pp
        if pp:
            assert "bar.sync 2, 256;" in art.ptx("sm_90a") and "bar.arrive 3, 256;" in art.ptx("sm_90a")
        outs.append(check_poisoned(art, spec, layout, seed=6)[0])
    for t in outs[0]:
        assert np.array_equal(outs[0][t], outs[1][t], equal_nan=True), t


@pytest.mark.parametrize("layout,d,dv,case", [
    ("page64", 192, 128, dict(dtype="bf16", gqa="gqa4", causal=True, splits="auto")),
    pytest.param("contiguous", 256, 128, dict(dtype="f16", gqa="gqa4", causal=True, splits=1),
                 marks=SLOW),
], ids=["deepseek-page64", "d256v128-contiguous"])
def test_v_narrower_than_k(tmp_path, layout, d, dv, case):
    """DeepSeek's MLA prefill (192 / 128): V's boxes over its first slabs on the lanes that
    issue K's, its tail zeroed over its own width by the consumers."""
    art, spec = build(tmp_path, layout, "", f"\nhead_dim_v = {dv}", head_dim=d, **case)
    check_poisoned(art, spec, layout, seed=4)


@pytest.mark.parametrize("extra", ["sliding_window = 21", "logits_soft_cap = 2.0",
                                   pytest.param("attention_sinks = true", marks=SLOW),
                                   pytest.param("alibi = true", marks=SLOW)])
def test_variants(tmp_path, extra):
    """The variant seam on the consumers; a window's pages wholly before the first token's
    window are never read (the producer's lanes give them id -1; NaN there)."""
    art, spec = build(tmp_path, "page16", "block_n = 32", "\n" + extra, dtype="f16",
                      head_dim=64, gqa="gqa4", causal=True, splits=2)
    check_poisoned(art, spec, "page16", seed=2)


def test_mixed_batch(tmp_path):
    """make_inputs' serving mix through the launch-test harness, garbage block-table ids (-1,
    num_pages + 7) past each sequence."""
    from conftest import assert_pass
    from ptxc.runtime.launch_test import check_artifact
    art, _ = build(tmp_path, "page16", dtype="f16", head_dim=64, gqa="gqa4", causal=True,
                   splits="auto")
    assert_pass(check_artifact(art, backend="emu", shapes={"batch": 8}, seed=3))


# the consumers' V tail (emit_ws_tile): their stores, fenced for the async proxy, then
# their named barrier before the last P·V
TAIL = re.compile(r"\n\tfence\.proxy\.async[^\n]*\n(\tbar\.sync 1, 128;)")
RELEASE = re.compile(r"\tmbarrier\.arrive\.shared::cta\.b64 %rd\d+, \[%r\d+\];\n")
# the producer's wait on empty[] (a register address; the consumers' Q wait is at +16)
EMPTY_WAIT = re.compile(r"\$L__mbar_wait_\d+:\n\tmbarrier\.try_wait\.parity\.shared::cta\.b64 "
                        r"%p\d+, \[%r\d+\], %r\d+;\n\t@!%p\d+ bra \$L__mbar_wait_\d+;\n")


@pytest.mark.parametrize("what,caught", [
    ("stores", "NaN"),
    ("fence", "shared-memory proxy race"),
    ("barrier", "race"),
    ("release", "mbarrier deadlock"),
    # the next lap's box lands on a stage whose last box the consumers have not waited for
    ("empty wait", "write to cp.async destination before"),
])
def test_protocol_mistakes_are_caught(tmp_path, monkeypatch, what, caught):
    """Each step of the protocol, left out, is caught: the V tail's stores (NaN reaches O),
    its fence (generic stores read by wgmma's async proxy), its barrier (one consumer warp's
    stores, another's wgmma reads); a consumer warp's release (the producer waits for ever);
    the producer's wait on empty[] (a box overwrites a stage still in use)."""
    import ptxc.kernels.bodies.varlen_tma as vt
    if what == "stores":
        monkeypatch.setenv("PTXC_CACHE_DIR", str(tmp_path / "cache"))   # not a cached good build
        monkeypatch.setattr(vt, "zero_tail_rows", lambda *a, **k: None)
    # two stages: a 113-key sequence laps the ring (d64's default 4 would not)
    art, spec = build(tmp_path, "page16", "block_n = 32\nnum_stages = 2", dtype="bf16", head_dim=64,
                      gqa="gqa4", causal=True, splits=1)
    ptx = art.ptx("sm_90a")
    edits = {"fence": lambda p: TAIL.sub(r"\n\1", p),
             "barrier": lambda p: TAIL.sub("\n\tfence.proxy.async.shared::cta;", p),
             "release": lambda p: RELEASE.sub("", p, count=1),
             "empty wait": lambda p: EMPTY_WAIT.sub("", p, count=1)}
    if what in edits:
        edited = edits[what](ptx)
        assert edited != ptx, "the edit changed nothing"
        monkeypatch.setattr(art, "ptx", lambda *_: edited)
    with pytest.raises((AssertionError, EmulationError), match=caught):
        check_poisoned(art, spec, "page16", target="sm_90a")


# ---- the key, the metadata, ptxas --------------------------------------------------------------
def _config(text: str, targets=SM90A, tile: str = WS) -> dict:
    [spec] = load_text(f'[[kernel]]\nname = "k"\nfamily = "varlen"\ntargets = {list(targets)!r}\n'
                       .replace("'", '"') + text + (f"\n[kernel.tile]\n{tile}\n" if tile else ""))
    return {t: VARLEN.resolve_tile(spec, TARGETS[t]) for t in targets}


def test_config_and_the_register_budgets():
    """One consumer warpgroup at two CTAs an SM (.minnctapersm 2: 128 registers on entry, the
    producer keeps 56, the consumers get 200) where two fit in shared memory; the empty[]
    barriers are the only extra shared memory; other targets unchanged. The default where it
    keeps the one-issuer tile's bytes in flight per SM: d128 (same CTAs and stages) and
    192 / 128 (two CTAs of two 64-key stages against three CTAs of two 32-key ones: S's
    m64n32k16 wgmmas were paced by their shared-memory operands, varlen_tile.WS_TILES); the
    family's 32 keys and the one-issuer stages where block_n or num_stages is given; opt-in at
    d64 and d256, where it takes the stages that keep them (4: two CTAs against four; one
    against two)."""
    text = spec_body("page16", head_dim=128)
    ws, one = _config(text, ("sm_90", "sm_90a"))["sm_90a"], _config(text, tile=OFF)["sm_90a"]
    assert ws["warp_specialize"] and ws["threads"] == 256 and ws["min_ctas_per_sm"] == 2
    assert ws["setmaxnreg"] == [56, 200]
    assert ws["smem_bytes"] == one["smem_bytes"] + 2 * 8 and ws["num_stages"] == 2
    assert "warp_specialize" not in one and "setmaxnreg" not in one
    assert _config(text, ("sm_90", "sm_90a"))["sm_90"] == _config(text, ("sm_90",), tile="")["sm_90"]
    assert _config(text, tile="") == _config(text)                     # the default at d128
    deepseek = spec_body("page64", head_dim=192) + "\nhead_dim_v = 128"
    ws, one = _config(deepseek, tile="")["sm_90a"], _config(deepseek, tile=OFF)["sm_90a"]
    assert ws["warp_specialize"] and ws["min_ctas_per_sm"] == 2 and ws["setmaxnreg"] == [56, 200]
    assert (ws["block_n"], ws["num_stages"]) == (64, 2) and (one["block_n"], one["num_stages"]) == (32, 2)
    assert ws["smem_bytes"] <= 227 * 1024 // 2                          # two CTAs an SM
    for given in ("num_stages = 3", "block_n = 32"):                    # the family's tile
        tile = _config(deepseek, tile=f"{WS}\n{given}")["sm_90a"]
        assert (tile["block_n"], tile["num_stages"]) == (32, 3 if "stages" in given else 2), given
    for d, ctas in ((64, 2), (256, 1)):
        body_text = spec_body("page64" if d == 64 else "contiguous", head_dim=d)
        assert "warp_specialize" not in _config(body_text, tile="")["sm_90a"], d
        opt_in = _config(body_text)["sm_90a"]
        assert (opt_in["num_stages"], opt_in["min_ctas_per_sm"]) == (4, ctas), d
    wide = _config(spec_body("contiguous", head_dim=256))["sm_90a"]
    assert wide["min_ctas_per_sm"] == 1 and wide["setmaxnreg"] == [56, 256]


def test_key_rules():
    """warp_specialize needs a kernel fed by TMA on some target: one line naming the key."""
    for text, targets in ((spec_body("page16"), ("sm_80", "sm_90")),
                          (spec_body("page4", head_dim=128), SM90A),            # cp.async pages
                          (spec_body("page16", head_dim=128) + '\nkv_dtype = "e4m3"\nkv_scale = "tensor"', SM90A)):
        with pytest.raises(SpecError) as e:
            _config(text, targets)
        assert e.value.key == "tile.warp_specialize" and "\n" not in str(e.value)
        assert "sm_90a" in str(e.value)
    with pytest.raises(SpecError, match="correction = true"):
        _config(spec_body("page16", head_dim=128), SM90A, "correction = true")
    for tile in ("pingpong = true", "block_m = 128\nnum_warps = 8\nwarp_specialize = false\npingpong = true"):
        with pytest.raises(SpecError) as e:       # one consumer warpgroup; no producer
            _config(spec_body("page16", head_dim=128), SM90A, tile)
        assert e.value.key == "tile.pingpong" and "\n" not in str(e.value)


def test_ptxas_sm90a_zero_spills(tmp_path, toolchain):
    """head_dim 64 / 128 / 256 (and 192 / 128) x paged / contiguous, split-KV and not, one and
    two consumer warpgroups: 0 spills, no ptxas performance note (a serialised wgmma: the
    roles are split by a warp-uniform index); the consumers' loop has no UTMALDG and no CTA
    barrier, the tensor work of the one-issuer loop."""
    from conftest import built_sass
    from families.test_varlen_tma import assemble_without_spills
    kernels = []
    for i, (d, extra, lay, splits, tile) in enumerate((
            (64, "", "page16", "auto", ""), (128, "", "page16", "auto", ""),
            (128, "", "contiguous", 1, "block_m = 128\nnum_warps = 8"),
            (256, "", "contiguous", 1, ""), (192, "\nhead_dim_v = 128", "page64", "auto", ""))):
        kernels.append(f'[[kernel]]\nname = "v{i}"\nfamily = "varlen"\ntargets = ["sm_90a"]\n'
                       f'{spec_body(lay, dtype=("f16", "bf16")[i % 2], head_dim=d, causal=True, splits=splits)}'
                       f'{extra}\n[kernel.tile]\n{WS}\n{tile}\n')
    assemble_without_spills(tmp_path, kernels)
    meta, prof = built_sass(tmp_path / "out", "v1", "sm_90a", "ptxc_v1_split")
    loop = prof["loops"]["loops"][prof["loops"]["main"]]
    assert prof["mix"]["LDL"] == prof["mix"]["STL"] == 0
    assert (loop["classes"]["tensor"], loop["mma_equivalents"]) == (8 + 4 + 4, 64 + 64 + 4)
    # one path for every consumer warp (no issue block on some), no LDGSTS
    assert "warp_instructions" not in loop and loop["classes"]["ldgsts"] == 0
    assert loop["instructions"] < 286      # the one-issuer tile's warps: 286-313
    # 192 / 128 on 64-key tiles: S's twelve SS wgmmas at N = 64, whose shared-memory operands
    # no longer pace them (the family's 32 keys: 1.5x their math, report.sass_instr)
    meta, prof = built_sass(tmp_path / "out", "v4", "sm_90a", "ptxc_v4_split")
    loop = prof["loops"]["loops"][prof["loops"]["main"]]
    assert meta["targets"]["sm_90a"]["config"]["block_n"] == 64
    assert loop["operand_stall_flops"] == 0
    # S and P.V of 64 keys, and the row sums' four HMMA.16816
    assert loop["mma_equivalents"] == (12 * 64 + 4 * 128) * 2 * 64 * 16 // 4 // 4096 + 4
