"""sm_90a prefill on wgmma (config/wgmma.py, math/wgmma.py, bodies/prefill_wgmma.py): numerical checks in the emulator
against the fp64 reference (FA2 error rule) on odd shapes, the dispatch rule (which specs take
the wgmma kernel, which stay on mma.sync / SIMT), one-line tile errors, ptxas acceptance with 0
spills and SASS evidence (HGMMA, no LDSM, no local memory), and the loop figure per
HMMA-equivalent. These pin tile.kv_loads = "cp_async" (the per-thread loads and their
pipeline, wgmma_pipeline.py); the TMA-fed default is tests/families/test_prefill_tma.py. The default
subset keeps emulated shapes small; `-m slow` runs the sweep."""

import pytest

from ptxc.errors import SpecError
from ptxc.kernels import FAMILIES
from ptxc.kernels import load_text
from ptxc.targets import TARGETS
from families.prefill_cases import TENSOR_CORE_MATRIX, check, compiled, run, spec_text

emu = pytest.importorskip("ptxc.emu", reason="the emulator is needed for numerical checks")
PREFILL = FAMILIES["prefill"]
SM90A = ("sm_90a",)
CP_ASYNC = {"kv_loads": "cp_async"}
SMALL = {"block_m": 64, "block_n": 32, **CP_ASYNC}   # 4 warps (one warpgroup), several K/V tiles
SHAPES = [(1, 17), (17, 113), (113, 17)]


def wg_check(dtype, head_dim, heads, causal, shapes=SHAPES, tile=SMALL, **kw):
    text = spec_text(dtype, head_dim, heads, causal, tile=tile, targets=SM90A)
    _, ptx, _, config = compiled(text, "sm_90a")
    assert config["path"] == "wgmma.m64nNk16" and "wgmma.mma_async" in ptx and "ldmatrix" not in ptx
    check(text, shapes, target="sm_90a", **kw)


@pytest.mark.parametrize("dtype,head_dim,heads,causal", TENSOR_CORE_MATRIX)
def test_matrix(dtype, head_dim, heads, causal):
    wg_check(dtype, head_dim, heads, causal)


@pytest.mark.parametrize("head_dim,block_n", [(64, 128), (128, 128), (256, 64)])
def test_default_tiles_two_warpgroups(head_dim, block_n):
    """The default tiles (two warpgroups, two K/V stages), q_len > L and a tail tile."""
    text = spec_text("bf16", head_dim, "gqa4" if head_dim < 256 else "mqa", True, tile=CP_ASYNC,
                     targets=SM90A)
    c = compiled(text, "sm_90a")[3]
    assert (c["block_m"], c["block_n"], c["num_warps"], c["num_stages"]) == (128, block_n, 8, 2)
    check(text, [(150, 131)] if head_dim < 256 else [(130, 70)], batch=1, target="sm_90a")


@pytest.mark.parametrize("stages", [1, 3])
def test_pipeline_depths(stages):
    """The commit-group arithmetic of wgmma_pipeline.py at other depths (2 is the default)."""
    wg_check("bf16", 64, "mqa", True, [(40, 100)], tile={**SMALL, "num_stages": stages}, batch=1)


def test_bhsd_strides_and_growing_scores():
    from families.prefill_cases import growing_scores
    wg_check("f16", 64, "gqa4", True, [(17, 45)], layout="bhsd")
    wg_check("bf16", 64, "mqa", False, [(3, 97)], transform=growing_scores)


def test_zero_keys():
    import numpy as np
    outs = run(spec_text("bf16", 128, "gqa4", False, tile=SMALL, targets=SM90A), 9, 0,
               target="sm_90a")[0]
    assert np.all(outs["o"] == 0) and np.all(np.isneginf(outs["lse"]))


def test_no_lse_and_empty_rows():
    import numpy as np
    text = spec_text("f16", 64, "mha", True, lse=False, tile=SMALL, targets=SM90A)
    outs = run(text, 40, 7, target="sm_90a")[0]
    assert set(outs) == {"o"} and np.all(outs["o"][:, :33] == 0)   # rows 0..32 see no key


@pytest.mark.parametrize("extra", ["sliding_window = 21\n", "logits_soft_cap = 2.0\n",
                                   "attention_sinks = true\n", "alibi = true\n"])
def test_variants_through_the_mma_seam(extra):
    """Variants reuse MmaMath's hooks (the S fragment layout is the mma.sync one)."""
    text = spec_text("f16", 64, "gqa4", True, tile=SMALL, targets=SM90A).replace(
        "[kernel.tile]", extra + "[kernel.tile]")
    assert compiled(text, "sm_90a")[3]["path"] == "wgmma.m64nNk16"
    check(text, [(17, 113)], batch=1, target="sm_90a")


# ---- dispatch and configuration ------------------------------------------------------------
@pytest.mark.parametrize("dtype,head_dim,target,path", [
    ("f16", 64, "sm_90a", "wgmma.m64nNk16"), ("bf16", 128, "sm_90a", "wgmma.m64nNk16"),
    ("f16", 128, "sm_90", "mma.m16n8k16"), ("f32", 64, "sm_90a", "simt"),
    ("f16", 96, "sm_90a", "mma.m16n8k16"), ("bf16", 256, "sm_90a", "wgmma.m64nNk16"),
    ("bf16", 512, "sm_90a", "mma.m16n8k16"),
])
def test_dispatch(dtype, head_dim, target, path):
    [spec] = load_text(spec_text(dtype, head_dim, targets=(target,)))
    assert PREFILL.resolve_tile(spec, TARGETS[target])["path"] == path


def test_other_head_dims_fall_back_to_mma_sync():
    text = spec_text("f16", 72, "mqa", True, tile={"block_m": 32, "block_n": 16}, targets=SM90A)
    assert "wgmma" not in compiled(text, "sm_90a")[1]
    check(text, [(23, 9)], target="sm_90a")


@pytest.mark.parametrize("head_dim,tile,key", [
    (128, {"block_m": 32}, "tile.block_m"), (128, {"block_m": 64, "num_warps": 8}, "tile.num_warps"),
    (128, {"block_n": 256, "num_stages": 4}, "tile.num_stages"),
    (256, {"block_m": 64, **CP_ASYNC}, "tile.block_m")])
def test_tile_errors_are_one_line(head_dim, tile, key):
    with pytest.raises(SpecError) as e:
        load_text(spec_text("f16", head_dim, tile=tile, targets=SM90A))
    assert e.value.key == key and "\n" not in str(e.value) and "sm_90a" in str(e.value)


def test_sm90_stays_byte_identical_to_the_mma_path():
    """Plain sm_90 builds the mma.sync kernel; sm_90a differs only where wgmma applies."""
    text = spec_text("f16", 64, "gqa4", True, targets=("sm_90",))
    ptx = compiled(text, "sm_90")[1]
    assert "mma.sync" in ptx and "wgmma" not in ptx and ".target sm_90\n" in ptx


# ---- ptxas and SASS ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def built(tmp_path_factory, toolchain):
    from conftest import SPECS
    from ptxc.pipeline.build import run_build
    tmp = tmp_path_factory.mktemp("wgmma")
    paths = []
    for name in ("llama3_8b_prefill", "mha_d64_prefill", "mqa_d256_prefill"):
        text = (SPECS / f"{name}.toml").read_text()
        p = tmp / f"{name}.toml"
        p.write_text("\n".join('targets = ["sm_90a"]' if line.startswith("targets") else line
                               for line in text.splitlines()) + '\n[kernel.tile]\nkv_loads = "cp_async"\n')
        paths.append(p)
    summary = run_build(paths, tmp / "out", progress=False, cache_dir=tmp / "cache")
    return tmp / "out", summary


def test_ptxas_accepts_sm90a_without_spills(built):
    import json
    from ptxc.report.costs import launch_cost
    out, summary = built
    assert summary["verified"] and not summary["problems"]
    for k in summary["kernels"]:
        assert list(k["targets"]) == ["sm_90a"]
        assert all(t["spill_bytes"] == 0 for t in k["targets"].values())
        meta = json.loads((out / k["name"] / f"{k['name']}.json").read_text())
        [kern] = meta["targets"]["sm_90a"]["kernels"]
        assert kern["dynamic_smem_bytes"] == meta["targets"]["sm_90a"]["config"]["smem_bytes"]
        assert kern["block"] == [256, 1, 1] and kern["needs_smem_opt_in"]
        # the roofline counts the wgmma kernel at the tensor-core peak
        cost = launch_cost(meta, "sm_90a", {"batch": 1, "seq_q": 128, "seq_k": 128})
        assert cost.unit == "tensor"


def test_sass_uses_hgmma_and_the_loop_figure(built):
    import json
    from ptxc.report.sass import SassUnavailable, sass_profile
    out, _ = built
    # per warp and iteration: S = d/16 HGMMA.64x{block_n}x16, P·V = block_n/16 HGMMA.64x{d}x16
    # (an HGMMA.64xNx16 is N/8 HMMA-equivalents per warp) and block_n/16 row-sum HMMA.16816
    # (tensor instructions, HMMA-equivalents, row-sum HMMA, bound on instructions per HMMA-eq)
    expect = {"llama3_8b_prefill": (8 + 8 + 8, 8 * 16 + 8 * 16 + 8, 8, 3.0),
              "mha_d64_bf16_prefill": (4 + 8 + 8, 4 * 16 + 8 * 8 + 8, 8, 3.0),
              "mqa_d256_prefill": (16 + 4 + 4, 16 * 8 + 4 * 32 + 4, 4, 3.0)}
    for name, (tensor, eq, hmma, bound) in expect.items():
        meta = json.loads((out / name / f"{name}.json").read_text())
        cubin = (out / name / meta["targets"]["sm_90a"]["cubin"]).read_bytes()
        try:
            [prof] = sass_profile(cubin).values()
        except SassUnavailable as e:
            pytest.skip(f"SASS unavailable: {e}")
        mix, result = prof["mix"], prof["loops"]
        loop = result["loops"][result["main"]]
        # the only HMMA in the kernel are the loop's block_n/16 row sums
        assert mix["HMMA"] == hmma and mix["LDSM"] == mix["LDL"] == mix["STL"] == 0
        # the loop's S and P·V chains (tensor - hmma), the P·V after the loop (block_n/16, as
        # many as the row sums) and the one HGMMA ptxas emits for iteration 0's empty group
        assert mix["HGMMA"] == (tensor - hmma) + hmma + 1
        assert (loop["classes"]["tensor"], loop["mma_equivalents"]) == (tensor, eq)
        assert loop["instructions_per_mma_equivalent"] <= bound


def test_sass_softmax_runs_under_the_previous_pv(built):
    """In the main loop, most of the 64 exponentials per thread (block_n 128) sit between the
    wait for S(j) (WARPGROUP.DEPBAR.LE gsb0, 0x1) and the wait for P·V(j-1) (0x0), i.e. under
    the in-flight P·V (ptxas 13.5: 40; none when the wait shared their basic block)."""
    import json
    import subprocess
    from ptxc.report.loops import find_loops, parse_functions
    from ptxc.report.sass import SassUnavailable, find_nvdisasm
    out, _ = built
    name = "llama3_8b_prefill"
    meta = json.loads((out / name / f"{name}.json").read_text())
    try:
        tool = find_nvdisasm()
    except SassUnavailable as e:
        pytest.skip(f"SASS unavailable: {e}")
    cubin = out / name / meta["targets"]["sm_90a"]["cubin"]
    text = subprocess.run([tool, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    [(instrs, labels)] = parse_functions(text).values()
    head, latch = max(find_loops(instrs, labels), key=lambda hl: hl[1] - hl[0])
    body = instrs[head:latch + 1]
    waits = [n for n, i in enumerate(body) if i.opcode == "WARPGROUP.DEPBAR.LE"]
    assert [body[n].operands for n in waits] == ["gsb0, 0x1", "gsb0, 0x0"]
    between = sum(i.opcode == "MUFU.EX2" for i in body[waits[0]:waits[1]])
    assert between >= 32
