"""The GPU harness without a GPU: timing statistics, throughput and percent-of-peak, L2 flush
sizing, benchmark inputs, tile candidates, the tuned-table format; and that `ptxc bench`,
`ptxc tune` and bench/gpu_suite.sh stop with exit code 2 and one line when there is no device."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import ROOT, SPECS, unsplit_example

from ptxc.gpu.bench import bench_inputs, l2_flush_bytes, should_flush, throughput, timing_stats
from ptxc.cli import main
from ptxc.report.costs import Cost, kv_length, resolve_dims
from ptxc.errors import UserError
from ptxc.report.gpus import get_gpu
from ptxc.kernels import FAMILIES
from ptxc.kernels import load_paths
from ptxc.targets import TARGETS
from ptxc.gpu.tune import candidate_tiles, group_specs, pick_target, tune_key
from ptxc.tuned import lookup, read_table, table_path, write_table

MIB = 1 << 20


def _has_device() -> bool:
    from ptxc.runtime.cuda import available
    return available()


def test_timing_stats():
    st = timing_stats([3.0, 1.0, 100.0, 2.0, 4.0])
    assert st["median_ms"] == 3.0 and st["min_ms"] == 1.0 and st["max_ms"] == 100.0 and st["n"] == 5
    assert st["mean_ms"] == pytest.approx(22.0)
    assert st["p10_ms"] == pytest.approx(1.4) and st["p90_ms"] == pytest.approx(61.6)  # 4 + 0.6 * 96
    assert timing_stats([2.5])["stdev_ms"] == 0.0
    with pytest.raises(ValueError):
        timing_stats([])


def test_throughput_and_percent_of_peak():
    h100 = get_gpu("h100")
    # Decode-like: 1 GB moved and 2 GFLOP of f32 SIMT math in 1 ms -> 1000 GB/s, 2 TFLOP/s.
    t = throughput(Cost(flops=2 * 10**9, bytes=10**9, unit="simt", dims={}), "decode", 1.0, h100)
    assert t["gbs"] == pytest.approx(1000.0) and t["tflops"] == pytest.approx(2.0) and t["metric"] == "GB/s"
    assert t["pct_peak_bandwidth"] == pytest.approx(100 * 1000 / 3350)
    assert t["pct_peak_flops"] == pytest.approx(100 * 2 / 66.9)
    # Prefill on tensor cores: 494.7 TFLOP/s is half of the H100's 989.4.
    p = throughput(Cost(flops=int(494.7e9), bytes=10**6, unit="tensor", dims={}), "prefill", 1.0, h100)
    assert p["metric"] == "TFLOP/s" and p["pct_peak_flops"] == pytest.approx(50.0)
    unknown = throughput(Cost(flops=1, bytes=1, unit="simt", dims={}), "decode", 1.0, None)
    assert unknown["pct_peak_flops"] is None and unknown["pct_peak_bandwidth"] is None


def test_l2_flush_sizing_and_policy():
    assert l2_flush_bytes(50 * MIB) == 100 * MIB            # H100: twice its 50 MiB
    assert l2_flush_bytes(None) == 64 * MIB and l2_flush_bytes(1) == 64 * MIB
    assert l2_flush_bytes(40 * MIB + 1) == 81 * MIB         # rounded up to whole MiB
    assert should_flush("decode", None) and should_flush("kv_append", None)
    assert not should_flush("prefill", None) and should_flush("prefill", True)
    assert not should_flush("decode", False)


@pytest.fixture(scope="module")
def metas(tmp_path_factory):
    """Metadata of every example spec (built without ptxas: only the metadata is needed)."""
    from ptxc.pipeline.build import run_build
    out = tmp_path_factory.mktemp("harness") / "out"
    summary = run_build([SPECS], out, verify=False, progress=False, use_cache=False)
    return [json.loads((out / k["name"] / f"{k['name']}.json").read_text()) for k in summary["kernels"]]


def test_bench_inputs_match_every_interface(metas):
    from ptxc.runtime import infer_dims
    small = {"batch": 3, "max_seq_len": 40, "seq_q": 16, "seq_k": 24, "num_new": 2}
    for meta in metas:
        dims = resolve_dims(meta, small)
        inputs = bench_inputs(meta, dims)
        plain = {n: a for n, a in inputs.items() if not meta["tensors"].get(n, {}).get("derived_from")}
        assert set(meta["scalars"]) <= set(inputs)          # runtime scalars (FP8 scales) too
        # The runtime's own shape inference recovers exactly the dims the inputs were made for.
        assert infer_dims(meta, plain, {n: dims[n] for n in ("num_splits",) if n in dims}) == dims, meta["name"]
        if "seq_lens" in inputs:
            assert (inputs["seq_lens"] == kv_length(meta, dims)).all()
        if "block_table" in inputs:   # every sequence owns distinct, valid pages
            bt = inputs["block_table"]
            assert len(np.unique(bt)) == bt.size and bt.max() < dims["num_pages"]
        if "slot_mapping" in inputs:   # by slot: distinct slots inside the cache
            slots = inputs["slot_mapping"]
            assert len(np.unique(slots)) == slots.size and 0 <= slots.min() and slots.max() < kv_length(meta, dims)
        elif "positions" in inputs:
            assert (inputs["positions"] + dims.get("num_new", 1) == kv_length(meta, dims)).all()
        if "indices" in inputs:   # sparse MLA: N distinct slots per token, all of them used
            idx, n = inputs["indices"], meta["spec"]["sparse_topk"]
            assert idx.shape == (dims["total_q"], n) and 0 <= idx.min()
            slots = dims["num_pages"] * meta["tensors"]["kv_cache"]["shape"][1]
            assert idx.max() < slots and all(len(np.unique(row)) == min(n, slots) for row in idx) or \
                slots < n, meta["name"]   # a cache smaller than N repeats slots
            assert "topk_length" not in inputs or (inputs["topk_length"] == n).all()


def test_bench_inputs_of_a_large_tensor_repeat_one_random_block(metas):
    from ptxc.gpu.bench import RANDOM_BLOCK
    meta = next(m for m in metas if m["name"] == "llama3_8b_decode")
    dims = resolve_dims(meta, {"batch": 16, "max_seq_len": 4096})
    k = bench_inputs(meta, dims)["k_cache"].reshape(-1)
    assert k.size > RANDOM_BLOCK and np.isfinite(k).all()
    assert (k[RANDOM_BLOCK:2 * RANDOM_BLOCK] == k[:RANDOM_BLOCK]).all() and len(np.unique(k[:4096])) > 3000


def test_candidate_tiles_are_legal_and_distinct():
    for spec in load_paths([SPECS]):
        family = FAMILIES[spec.family]
        for target in spec.targets:
            cands = candidate_tiles(spec, target)
            assert cands, (spec.name, target)
            assert cands[0]["resolved"] == family.resolve_tile(spec, TARGETS[target])   # default first
            resolved = [json.dumps(c["resolved"], sort_keys=True) for c in cands]
            assert len(set(resolved)) == len(resolved)
            for c in cands:
                assert set(c["tile"]) <= {f.name for f in family.fields.tile}
                if c["resolved"].get("smem_bytes"):
                    assert c["resolved"]["smem_bytes"] <= TARGETS[target].max_smem_per_cta
                if c["resolved"].get("path") == "mma.m16n8k16":
                    # above head_dim_v 256, value_split warps share each 16 rows (docs/spec.md)
                    split = c["resolved"].get("value_split", 1)
                    assert c["resolved"]["block_m"] * split == 16 * c["resolved"]["num_warps"]


def test_decode_candidates_cover_the_tile_product():
    (spec,) = load_paths([SPECS / "llama3_8b.toml"])
    cands = candidate_tiles(spec, "sm_90")
    # GQA 4 f16: the tensor-core default first, then the SIMT product num_warps in (1, 2, 4, 8)
    # x kv_unroll in (1, 2, 4, 8), all legal for d128 f16, then the tensor-core product
    # block_n x num_stages that fits sm_90's shared memory (one CTA of 128 x 4 stages does not).
    assert cands[0]["resolved"]["path"] == "mma.m16n8k16"
    simt = [c for c in cands if "kv_unroll" in c["resolved"]]
    assert {(c["resolved"]["num_warps"], c["resolved"]["kv_unroll"]) for c in simt} == \
        {(w, u) for w in (1, 2, 4, 8) for u in (1, 2, 4, 8)} and len(simt) == 16
    mma = {(c["resolved"]["block_n"], c["resolved"]["num_stages"]) for c in cands if c not in simt}
    assert (64, 2) in mma and (16, 1) in mma and (128, 4) not in mma


def test_tune_keys_and_target_choice():
    specs = load_paths([SPECS])
    groups = group_specs(specs)
    assert sum(len(g) for g in groups.values()) == len(specs)
    for key, group in groups.items():
        assert all(tuple(tune_key(s).values()) == key for s in group)
    (llama,) = load_paths([SPECS / "llama3_8b.toml"])
    assert pick_target([llama], 90, None) == "sm_90" and pick_target([llama], 90, "sm_80") == "sm_80"
    with pytest.raises(UserError, match="pass --target sm_75"):
        pick_target([llama], 75, None)


def test_tuned_table_write_merge_read_lookup(tmp_path):
    e1 = {"family": "prefill", "head_dim": 128, "causal": True, "dtype": "f16", "median_ms": 1.5,
          "tile": {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2}, "candidates": 20}
    e2 = {"family": "decode", "head_dim": 128, "causal": False, "dtype": "bf16", "median_ms": 0.2,
          "tile": {"num_warps": 4, "kv_unroll": 2}, "candidates": 16}
    kw = dict(target="sm_90", sm=90, device_name="NVIDIA H100 80GB HBM3", gpu_model="h100-sxm",
              ptxas_version="13.5.37", date="2026-01-02")
    path = write_table(tmp_path, entries=[e1], **kw)
    assert path == table_path(tmp_path, "sm_90", "NVIDIA H100 80GB HBM3")
    assert path.name == "sm_90_nvidia-h100-80gb-hbm3.json"
    first = path.read_bytes()
    assert write_table(tmp_path, entries=[e1], **kw).read_bytes() == first   # deterministic
    write_table(tmp_path, entries=[e2, {**e1, "tile": {**e1["tile"], "block_n": 32}}], **kw)
    table = read_table(path)
    assert table["device"] == "NVIDIA H100 80GB HBM3" and table["date"] == "2026-01-02"
    assert [e["family"] for e in table["entries"]] == ["decode", "prefill"]   # merged, sorted
    assert lookup("sm_90", "prefill", 128, True, "f16", tuned_dir=tmp_path)["block_n"] == 32
    assert lookup("sm_90", "decode", 128, False, "bf16", device_name="NVIDIA H100 80GB HBM3",
                  tuned_dir=tmp_path) == {"num_warps": 4, "kv_unroll": 2}
    assert lookup("sm_90", "prefill", 64, True, "f16", tuned_dir=tmp_path) is None
    assert lookup("sm_80", "prefill", 128, True, "f16", tuned_dir=tmp_path) is None
    with pytest.raises(ValueError, match="lacks median_ms"):
        write_table(tmp_path, entries=[{k: v for k, v in e1.items() if k != "median_ms"}], **kw)


@pytest.mark.parametrize("args", [
    ["bench", str(SPECS / "llama3_8b.toml"), "--shape", "batch=2"],
    ["tune", str(SPECS / "llama3_8b.toml")],
])
def test_gpu_commands_without_device_exit_2_in_one_line(args):
    if _has_device():
        pytest.skip("a CUDA device is present")
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: this command needs a CUDA GPU: ")


def test_gpu_suite_without_device_exits_2(tmp_path):
    script = ROOT / "bench" / "gpu_suite.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    if _has_device():
        pytest.skip("a CUDA device is present")
    r = subprocess.run(["bash", str(script), str(tmp_path / "results")], capture_output=True, text=True,
                       env={**os.environ, "PYTHON": sys.executable}, timeout=120)
    assert r.returncode == 2 and "no usable CUDA device" in r.stderr
    assert not (tmp_path / "results").exists()


# ---- the device code paths, against a fake driver (no GPU): call order, flushes, samples ----

class FakeDriver:
    """Just enough of cuda.bindings.driver: records calls, returns increasing event times."""

    class CUresult:
        CUDA_SUCCESS = 0

    class CUdevice_attribute:
        CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE = "l2"
        CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = "sms"

    class CUfunction_attribute:
        CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = "smem"

    def __init__(self):
        self.calls, self.allocs, self.freed, self.clock, self.handle = [], {}, [], 0.0, 0

    def _new(self):
        self.handle += 1
        return self.handle << 32

    def cuGetErrorName(self, err):
        return 0, b"CUDA_ERROR_FAKE"

    def cuDeviceGetAttribute(self, attr, dev):
        return 0, {"l2": 50 * MIB, "sms": 132}[attr]

    def cuModuleLoadData(self, image):
        self.calls.append(("load", len(image)))
        return 0, "module"

    def cuModuleGetFunction(self, module, name):
        return 0, name.decode()

    def cuFuncSetAttribute(self, fn, attr, value):
        self.calls.append(("smem", value))
        return (0,)

    def cuMemAlloc(self, n):
        p = self._new()
        self.allocs[p] = n
        return 0, p

    def cuMemcpyHtoD(self, dst, src, n):
        return (0,)

    def cuMemcpyDtoH(self, dst, src, n):
        return (0,)

    def cuMemsetD8Async(self, p, value, n, stream):
        self.calls.append(("flush", n))
        return (0,)

    def cuEventCreate(self, flags):
        return 0, self._new()

    def cuEventRecord(self, event, stream):
        self.calls.append(("record",))
        return (0,)

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, smem, stream, args, extra):
        self.calls.append(("launch", fn, (gx, gy, gz), (bx, by, bz)))
        return (0,)

    def cuEventSynchronize(self, event):
        return (0,)

    def cuEventElapsedTime(self, start, stop):
        self.clock += 1.0
        return 0, self.clock

    def cuMemFree(self, p):
        self.freed.append(p)
        return (0,)

    def cuEventDestroy(self, e):
        return (0,)

    def cuModuleUnload(self, m):
        return (0,)


@pytest.fixture
def fake_gpu(monkeypatch):
    import ptxc.gpu.bench
    import ptxc.runtime.cuda
    from ptxc.runtime.cuda import CudaDevice
    drv = FakeDriver()
    monkeypatch.setattr(ptxc.runtime.cuda, "_driver", lambda: drv)
    monkeypatch.setattr(ptxc.gpu.bench, "require_device",
                        lambda: CudaDevice("dev", None, 90, "NVIDIA H100 80GB HBM3"))
    return drv


def test_bench_orchestration_on_fake_driver(fake_gpu, toolchain, tmp_path, capsys):
    from ptxc.gpu.bench import run_bench
    result = run_bench([unsplit_example(tmp_path, "llama3_8b.toml")], shapes={"batch": 2, "max_seq_len": 64},
                       warmup=2, repeat=5, compare=False)
    assert result["gpu_model"] == "h100-sxm" and result["l2_bytes"] == 50 * MIB and result["sm_count"] == 132
    (row,) = result["results"]
    assert row["impl"] == "ptxc" and row["target"] == "sm_90" and row["l2_flushed"]
    assert row["dims"] == {"batch": 2, "max_seq_len": 64}
    assert row["median_ms"] == 3.0 and row["n"] == 5          # 5 timed samples 1..5; warm-up not read
    assert row["gbs"] == pytest.approx(row["bytes"] / 3e-3 / 1e9)
    assert row["pct_peak_bandwidth"] == pytest.approx(100 * row["gbs"] / 3350)
    calls = fake_gpu.calls
    flushes = [i for i, c in enumerate(calls) if c[0] == "flush"]
    assert len(flushes) == 7 and all(calls[i][1] == 100 * MIB for i in flushes)
    assert all(calls[i + 1] == ("record",) for i in flushes)   # flush, then start the clock
    launches = [c for c in calls if c[0] == "launch"]
    assert len(launches) == 7 and launches[0][2] == (8, 2, 1) and launches[0][3] == (32, 1, 1)
    assert set(fake_gpu.freed) == set(fake_gpu.allocs)         # every buffer and the scratch freed
    from ptxc.report.tables import print_bench
    print_bench(result)
    assert "llama3_8b_decode" in capsys.readouterr().out


def test_tune_orchestration_on_fake_driver(fake_gpu, toolchain, tmp_path, capsys):
    from ptxc.gpu.tune import run_tune
    result = run_tune([unsplit_example(tmp_path, "llama3_8b.toml")], shapes={"batch": 2, "max_seq_len": 64},
                      out_dir=tmp_path, warmup=1, repeat=3, limit=3)
    assert result["target"] == "sm_90" and len(result["tried"]) == 3
    table = read_table(tmp_path / "sm_90_nvidia-h100-80gb-hbm3.json")
    (entry,) = table["entries"]
    assert (entry["family"], entry["head_dim"], entry["causal"], entry["dtype"]) == ("decode", 128, False, "f16")
    assert entry["candidates"] == 3 and entry["specs"] == ["llama3_8b_decode"]
    # Fake times only grow, so the first candidate (the spec's default tile) wins.
    assert entry["median_ms"] == entry["default_ms"]
    # GQA 4 f16 takes the tensor-core path: its tile keys only (not the derived num_warps)
    assert entry["tile"] == {"block_n": 64, "num_stages": 2}
    assert table["device"] == "NVIDIA H100 80GB HBM3" and table["gpu_model"] == "h100-sxm"
    assert entry["dims"] == {"batch": 2, "max_seq_len": 64}
    from ptxc.report.tables import print_tune
    print_tune(result)
    assert "block_n=64" in capsys.readouterr().out


def test_derived_pointer_arrays_get_device_addresses():
    from ptxc.runtime.cuda import fill_derived_pointers
    meta = {"tensors": {"k_cache": {}, "k_ptrs": {"derived_from": "k_cache"}}}
    buffers = {"k_cache": np.zeros((3, 5, 2, 8), dtype=np.float16), "k_ptrs": np.zeros(3, dtype=np.uint64)}
    fill_derived_pointers(meta, buffers, {"k_cache": 1 << 40, "k_ptrs": 1 << 41})
    assert buffers["k_ptrs"].tolist() == [(1 << 40) + b * 5 * 2 * 8 * 2 for b in range(3)]


@pytest.mark.parametrize("spec", ["pointer_array.toml", "vllm_paged.toml", "mqa_split.toml", "llama3_8b_prefill.toml"])
def test_bench_every_layout_on_fake_driver(fake_gpu, toolchain, spec):
    from ptxc.gpu.bench import run_bench
    shapes = {"batch": 2, "max_seq_len": 48, "seq_q": 32, "seq_k": 32, "num_new": 1}
    result = run_bench([SPECS / spec], shapes=shapes, warmup=1, repeat=2, compare=False)
    for row in result["results"]:
        assert row["target"] == "sm_90" and row["n"] == 2 and row["bytes"] > 0
        assert row["l2_flushed"] == (row["family"] != "prefill")
        assert row["metric"] == ("TFLOP/s" if row["family"] == "prefill" else "GB/s")
    assert {r["kernel"] for r in result["results"]} == {s.name for s in load_paths([SPECS / spec])}


class _ImageArtifact:
    """The three things CudaDevice.pick_image reads from an artifact."""
    name = "k"
    meta = {"targets": {"sm_120": {"cubin": "x"}, "sm_80": {"cubin": "x"}, "sm_90": {"cubin": "x"},
                        "sm_86": {"cubin": "x"}}}

    def cubin(self, target):
        return f"cubin:{target}".encode()

    def ptx(self, target):
        return f"ptx:{target}"


def test_cuda_device_runs_own_cubin_and_older_ptx_never_a_newer_target():
    from ptxc.errors import ToolchainError
    from ptxc.runtime.cuda import CudaDevice
    dev, art = CudaDevice("dev", None, 90, "H100"), _ImageArtifact()
    assert dev.runnable_targets(art) == ["sm_80", "sm_86", "sm_90"]       # numeric order, no sm_120
    assert dev.pick_image(art, None) == ("sm_90", b"cubin:sm_90")
    assert dev.pick_image(art, "sm_80") == ("sm_80", b"ptx:sm_80\0")      # a cubin is not portable
    with pytest.raises(ToolchainError, match="sm_120 cannot run on this sm_90"):
        dev.pick_image(art, "sm_120")
    ampere = CudaDevice("dev", None, 87, "Orin")                            # no exact cubin: newest PTX
    assert ampere.pick_image(art, None) == ("sm_86", b"ptx:sm_86\0")


def test_gpu_lease_plan_and_resume_without_a_gpu(tmp_path):
    """bench/gpu_lease.py --dry: the plan puts the arch-specific checks first and the priority
    kernels' timings next; every item leaves exactly one line; a child that fails on an item is
    replaced and the plan goes on from the next one."""
    from ptxc.pipeline.build import run_build
    out = tmp_path / "out"
    run_build([SPECS / "llama3_8b.toml"], out, verify=False, progress=False, targets=["sm_90", "sm_90a"])

    def lease(results, *more):
        run = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_lease.py"), str(out), "--out",
                              str(results), "--sm", "90", "--dry", "--deadline", "300",
                              "--shape", "batch=3,max_seq_len=200", "--shape", "seq_q=16384", *more],
                             capture_output=True, text=True, cwd=ROOT)
        assert run.returncode == 0, run.stderr
        plan = json.loads((results / "plan.json").read_text())
        return plan, [json.loads(t) for t in (results / "results.jsonl").read_text().splitlines()]
    plan, lines = lease(tmp_path / "r")
    kernels = sorted({p["kernel"] for p in plan})
    assert [(p["kind"], p["target"]) for p in plan[:len(kernels)]] == [("check", "sm_90a")] * len(kernels)
    from ptxc.report.costs import resolve_dims
    from ptxc.runtime.abi import check_buffer_budget
    meta = json.loads((out / "llama3_8b_decode" / "llama3_8b_decode.json").read_text())
    buffers = check_buffer_budget(meta, None, resolve_dims(meta, {}, num_sms=132, target="sm_90"))
    assert buffers > 2 * 16 * 4096 * 8 * 128 * 2            # K and V alone, f16
    assert plan[len(kernels)] == {"kind": "bench", "kernel": "llama3_8b_decode", "target": "sm_90a",
                                  "path": str(out / "llama3_8b_decode"), "compare": True, "shape": {},
                                  "buffer_bytes": buffers}   # the runtime's own count sizes the timeout
    assert all(p["buffer_bytes"] == 0 for p in plan if p["kind"] == "check")
    # an extra shape: one more timing of each priority kernel that has those dims
    assert [(p["kernel"], p["shape"]) for p in plan if p["shape"]] == [
        ("llama3_8b_decode", {"batch": 3, "max_seq_len": 200})]
    assert [x["index"] for x in lines] == list(range(len(plan))) and all(x["status"] == "ok" for x in lines)
    # --resume: a call cut by its deadline (the last line says so) goes on in the next one
    results = tmp_path / "r" / "results.jsonl"
    cut = [json.dumps(x) for x in lines[:3]] + [json.dumps({**lines[3], "status": "timeout", "error": "deadline"})]
    results.write_text("\n".join(cut) + "\n")
    resumed, again = lease(tmp_path / "r", "--resume")
    assert resumed == plan and [x["index"] for x in again] == list(range(len(plan)))
    assert again[:3] == lines[:3] and all(x["status"] == "ok" for x in again)
    # --only: just the named kernels, in that order, each timed at every --shape that fits it;
    # a name the sets lack is refused before anything runs
    only, _ = lease(tmp_path / "r3", "--only", "llama3_8b_decode")
    assert {p["kernel"] for p in only} == {"llama3_8b_decode"}
    assert [p["shape"] for p in only if p["kind"] == "bench"] == [{}, {}, {"batch": 3, "max_seq_len": 200}]
    refused = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_lease.py"), str(out), "--out",
                              str(tmp_path / "r4"), "--sm", "90", "--dry", "--only", "llama3_8b_decode,nope"],
                             capture_output=True, text=True, cwd=ROOT)
    assert refused.returncode != 0 and "--only names kernels the sets do not hold for sm_90: nope" in refused.stderr
    # a tampered artifact: each of its items is recorded as an error, a new child resumes after it
    victim = plan[1]["kernel"]
    ptx = out / victim / f"{victim}.sm_90a.ptx"
    ptx.write_text(ptx.read_text() + "// tampered\n")
    plan, lines = lease(tmp_path / "r2")
    assert [x["index"] for x in lines] == list(range(len(plan)))
    assert {x["status"] for x in lines if x["kernel"] == victim} == {"error"}
    assert all(x["status"] == "ok" for x in lines if x["kernel"] != victim)


def test_gpu_lease_patch_sets_an_existing_constant_and_refuses_others(monkeypatch):
    """gpu_lease --patch (an A/B of a compiler constant): the value lands in the module every
    process loads artifacts with; a malformed argument, a missing module and a name the module
    lacks are one-line refusals."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_lease
    from ptxc.kernels.attention import split_plan
    monkeypatch.setattr(split_plan, "SPLIT_HEADROOM", split_plan.SPLIT_HEADROOM)   # restored after
    gpu_lease.apply_patches(["ptxc.kernels.attention.split_plan:SPLIT_HEADROOM=2"])
    assert split_plan.SPLIT_HEADROOM == 2
    with pytest.raises(SystemExit, match="has no NO_SUCH"):
        gpu_lease.apply_patches(["ptxc.kernels.attention.split_plan:NO_SUCH=1"])
    for bad in ("SPLIT_HEADROOM=2", "ptxc.kernels.attention.split_plan:SPLIT_HEADROOM",
                "ptxc.kernels.attention.split_plan:SPLIT_HEADROOM=two"):
        with pytest.raises(SystemExit, match="expected MODULE:NAME=INT"):
            gpu_lease.apply_patches([bad])
    with pytest.raises(SystemExit, match="no module ptxc.no_such"):
        gpu_lease.apply_patches(["ptxc.no_such:X=1"])
