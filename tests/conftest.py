from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"


# The longest test files of the default run, longest first (seconds on 2 cores at 0084bea, from
# `pytest --junitxml`): `make test` deals whole files to two xdist workers in collection order
# (--no-loadscope-reorder: xdist's own order, by test count, dealt the 89-second spill-sweep file
# last and one worker ran a minute past the other).
LONGEST_FIRST = ("test_build.py", "test_prefill_tcgen05.py", "test_mla_wgmma.py", "test_report.py",
                 "test_mla_tcgen05.py", "test_spill_sweep.py", "test_calibration.py",
                 "test_reliability.py", "test_cheader.py", "test_mla_qk_e4m3.py", "test_gpu_harness.py",
                 "test_prefill_tma_store.py", "test_varlen_fp8.py", "test_varlen_tcgen05.py",
                 "test_prefill_persistent.py", "test_decode_fp8.py", "test_prefill.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: files keep their order


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Every test gets its own cache directory unless it sets one itself."""
    monkeypatch.setenv("PTXC_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    monkeypatch.delenv("PTXAS", raising=False)


@pytest.fixture(scope="session")
def toolchain():
    """ptxas is a hard requirement of the test suite (`make test` installs it)."""
    from ptxc.pipeline.ptxas import toolchain as tc
    return tc()


@pytest.fixture(scope="session")
def example_build(tmp_path_factory, toolchain):
    """(out, summary): every example spec built and verified once per test run, from a fresh
    compile cache; read-only. Under pytest-xdist the workers share it -- the first to ask builds
    under a lock file in the run's common temporary directory, the others wait and read it
    (three whole example builds were about a tenth of the default suite)."""
    import fcntl
    import json
    import os
    from ptxc.pipeline.build import run_build
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    out, done = root / "examples-out", root / "examples-summary.json"
    with open(root / "examples.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            with pytest.MonkeyPatch.context() as mp:   # the tests' ptxas (conftest denies $PTXAS)
                mp.delenv("PTXAS", raising=False)
                summary = run_build([SPECS], out, progress=False, cache_dir=root / "examples-cache")
            done.write_text(json.dumps(summary))
    return out, json.loads(done.read_text())


def build_without_spills(tmp_path: Path, kernels: list[str], target: str) -> Path:
    """Build the [[kernel]] texts `kernels` (verified by ptxas) into tmp_path/out and assert 0
    spill bytes on `target` for each; returns the output directory."""
    from ptxc.pipeline.build import run_build
    (tmp_path / "k.toml").write_text("\n".join(kernels))
    summary = run_build([tmp_path / "k.toml"], tmp_path / "out", progress=False)
    assert summary["verified"] and not summary["problems"]
    for k in summary["kernels"]:
        assert k["targets"][target]["spill_bytes"] == 0, k["name"]
    return tmp_path / "out"


def write_spec(tmp_path: Path, text: str, name: str = "spec.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def unsplit_example(tmp_path: Path, file: str) -> Path:
    """A copy of example spec `file` whose "auto" split counts are 1: for tests that read a
    single-launch decode (the examples split since the H200 measured unsplit decode at 49 %)."""
    text = (SPECS / file).read_text()
    assert 'num_splits = "auto"' in text, file
    return write_spec(tmp_path, text.replace('num_splits = "auto"', "num_splits = 1"), file)


def build_kernel(tmp_path: Path, family: str, body: str, tile: str = "", targets=("sm_80",)):
    """Build one [[kernel]] named "k" (PTX only) into tmp_path/out and load it."""
    from ptxc.pipeline.build import run_build
    from ptxc.runtime import load
    tmp_path.mkdir(parents=True, exist_ok=True)
    text = (f'[[kernel]]\nname = "k"\nfamily = "{family}"\ntargets = {list(targets)!r}\n{body}\n'
            .replace("'", '"'))
    if tile:
        text += f"[kernel.tile]\n{tile}\n"
    (tmp_path / "k.toml").write_text(text)
    run_build([tmp_path / "k.toml"], tmp_path / "out", verify=False, progress=False)
    return load(tmp_path / "out" / "k")


def built_sass(out: Path, name: str, target: str, entry: str) -> tuple[dict, dict]:
    """(metadata, SASS profile of `entry`) of kernel `name` built into `out` (run_build); skips
    the test where nvdisasm is missing."""
    import json
    from ptxc.report.sass import SassUnavailable, sass_profile
    meta = json.loads((out / name / f"{name}.json").read_text())
    cubin = (out / name / meta["targets"][target]["cubin"]).read_bytes()
    try:
        return meta, sass_profile(cubin)[entry]
    except SassUnavailable as e:
        pytest.skip(f"SASS unavailable: {e}")


def assert_pass(rows) -> None:
    """Every launch-test row is within the FA2 tolerance rule."""
    assert rows
    for r in rows:
        assert r.ok, f"{r.kernel} {r.tensor} {r.shape}: max error {r.max_error:.3e} > tolerance {r.tol:.3e}"


def shared_traffic(art, target: str, inputs: dict):
    """The emulator's traffic counters of the artifact's one launch on `inputs` (FP8 scales
    passed as the runtime scalars they are): `.shared_accesses`, `.bank_conflicts`."""
    from ptxc import emu
    from ptxc.runtime import infer_dims, launch_geometry, pack_args, prepare_buffers
    dims = {**infer_dims(art.meta, inputs, {}),
            **{k: inputs[k] for k in ("k_scale", "v_scale") if k in inputs and k not in art.meta["tensors"]}}
    buffers = prepare_buffers(art.meta, inputs, dims)
    [kernel] = art.target(target)[1]["kernels"]
    grid, block = launch_geometry(kernel, dims)
    return emu.launch(art.ptx(target), kernel["entry"], grid, block,
                      pack_args(kernel, buffers, dims, pointer=lambda n, a: a),
                      dynamic_smem_bytes=kernel["dynamic_smem_bytes"], traffic=True).traffic


def fp8_cache_body(dtype, kind, scale, layout, *, heads=(6, 2), head_dim=40, extra="") -> str:
    """Spec keys of an attention kernel over an FP8 KV cache (decode and varlen tests)."""
    text = (f'dtype = "{dtype}"\nhead_dim = {head_dim}\nnum_heads = {heads[0]}\n'
            f'num_kv_heads = {heads[1]}\nkv_dtype = "{kind}"\nkv_scale = "{scale}"\n'
            f'kv_layout = "{layout}"\n')
    return text + ('page_size = 8\n' if layout == "paged" else "") + extra


# Q rows far outside f16's range (and zero) for the f16-products tests, cycled over the heads;
# with k_scale = WIDE_Q_K_SCALE their scores stay where an f32 softmax resolves them
WIDE_Q_FACTORS = (2.0 ** 36, 2.0 ** -30, 2.0 ** 20, 0.0, 1.0, 2.0 ** 24, 2.0 ** 28, 2.0 ** -10)
WIDE_Q_K_SCALE = 2.0 ** -20


def assert_wide_queries_match(art, family: str, target: str, dims: dict, seed: int) -> None:
    """A bf16 kernel over an FP8 cache on f16 products (config.mma_inputs, Q rescaled per row:
    kv_fp8_stage.f16_math_applies) against the fp64 reference with WIDE_Q_FACTORS' rows side by
    side in every tile: every output within the FA2 rule of the naive bf16 computation."""
    import numpy as np

    from ptxc.kernels import FAMILIES
    from ptxc.reference import max_abs_error, tolerance
    from ptxc.spec.model import KernelSpec
    assert art.meta["targets"][target]["config"]["mma_inputs"] == "f16"
    spec = KernelSpec.from_dict(art.meta["spec"])
    fam = FAMILIES[family]
    inputs = fam.make_inputs(spec, dims, np.random.default_rng(seed))
    heads = inputs["q"].shape[-2]
    factors = np.resize(np.array(WIDE_Q_FACTORS), heads)      # powers of two: still bf16 values
    inputs["q"] = (inputs["q"] * factors[:, None]).astype(np.float32)
    scale = inputs["k_scale"]
    inputs["k_scale"] = (np.asarray(scale) * 0 + WIDE_Q_K_SCALE).astype(np.float32)
    ref, naive = fam.reference(spec, inputs), fam.reference(spec, inputs, dtype=spec.dtype)
    out = art.run(inputs, target=target, backend="emu")
    for name in ref:
        err = max_abs_error(out[name], ref[name])
        assert np.isfinite(err) and err <= tolerance(naive[name], ref[name]), (target, name, err)


def cache_shapes(layout: str, batch: int, num_pages: int) -> dict:
    """launch-test shapes for a batch over a paged (5 pages per sequence) or contiguous cache."""
    return ({"batch": batch, "max_pages_per_seq": 5, "num_pages": num_pages}
            if layout == "paged" else {"batch": batch, "max_seq_len": 37})


_RUSTC_PROBE: list = []


def rustc_problem() -> str | None:
    """Why rustc cannot compile here (None when it can): not on PATH, or on PATH but not
    running - a rustup proxy with no default toolchain, a broken install - or unable to build a
    trivial file. Probed once, as for gcc and nvcc, so those tests skip with the reason instead
    of failing."""
    if not _RUSTC_PROBE:
        _RUSTC_PROBE.append(_probe_rustc())
    return _RUSTC_PROBE[0]


def _probe_rustc() -> str | None:
    import shutil
    import subprocess
    import tempfile
    exe = shutil.which("rustc")
    if exe is None:
        return "needs rustc (not on PATH)"
    try:
        v = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
        if v.returncode != 0:
            why = (v.stderr or v.stdout).strip().splitlines()
            return f"needs a working rustc ({exe} --version exits {v.returncode}: {why[0] if why else ''})"
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "t.rs").write_text("pub fn f() -> u32 { 1 }\n")
            c = subprocess.run([exe, "--crate-type", "lib", "--emit=metadata", "-o", str(Path(d) / "t.rmeta"),
                                str(Path(d) / "t.rs")], capture_output=True, text=True, timeout=120)
            if c.returncode != 0:
                why = c.stderr.strip().splitlines()
                return f"needs a working rustc (cannot compile a trivial file: {why[0] if why else c.returncode})"
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"needs a working rustc ({exe}: {e})"
    return None


def require_rustc() -> None:
    why = rustc_problem()
    if why:
        pytest.skip(why)


@pytest.fixture
def bytes_read(monkeypatch):
    """A Counter of the bytes the emulator's loads (and cp.async / TMA reads) take from each labelled
    global buffer during the test: `bytes_read["k_cache"]`; a TMA box's reads apart, under
    `bytes_read["k_cache (TMA)"]` (a map over a pointer argument's array reads that buffer; a
    map's array of its own is labelled by the parameter, e.g. "kv_tmap+16")."""
    from collections import Counter

    import numpy as np

    from ptxc.emu import memory
    read = Counter()
    offsets = memory.GlobalMemory.offsets

    def counting(self, addr, nbytes, align, what, sel):
        out = offsets(self, addr, nbytes, align, what, sel)
        if what in ("load", "cp.async read", "cp.async.bulk read", "cp.async.bulk.tensor read"):
            buf = np.searchsorted(self.starts, np.atleast_1d(np.asarray(addr, np.uint64)), side="right") - 1
            for i, n in zip(*np.unique(buf, return_counts=True)):
                label = self.labels[i]   # "parameter 'q'"; a tensor map's own array: "kv_tmap+16"
                name = label.split("'")[1] if "'" in label else label
                read[name + (" (TMA)" if what == "cp.async.bulk.tensor read" else "")] += int(n) * nbytes
        return out
    monkeypatch.setattr(memory.GlobalMemory, "offsets", counting)
    return read
