"""The benchmark kernel runs, assembles, and computes an online softmax-weighted average."""

import importlib.util
import sys
from pathlib import Path

import numpy as np

from .helpers import assert_assembles

BENCH = Path(__file__).resolve().parents[2] / "bench" / "emu_bench.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("emu_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["emu_bench"] = mod          # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_bench_kernel_matches_numpy():
    bench = load_bench()
    assert_assembles(bench.DECODE_LIKE_PTX)
    iters = 300
    args = bench.decode_like_args(iters)
    k, v, out, _, scale = args
    result = bench.bench(bench.DECODE_LIKE_PTX, "decode_like", (8, 4), (128,), args)
    assert result.stats.thread_instructions > 0 and result.cpu_time_s > 0
    q = np.array([0x3F3B4A5C, 0x3ED66CF4, 0xBE5652BD, 0x3F7F8A09], np.uint32).view(np.float32)
    rows = np.arange(iters) % 64
    logits = np.einsum("ild,d->i", k[rows].astype(np.float64), q.astype(np.float64)) * scale
    w = np.exp2(logits - logits.max())
    expect = np.einsum("i,ild->ld", w, v[rows].astype(np.float64)) / w.sum()   # per lane
    lane = np.arange(32 * 128) % 32
    np.testing.assert_allclose(out, expect[lane], rtol=2e-4, atol=1e-5)


def test_bench_main_prints_throughput(capsys):
    load_bench().main(["--iters", "20"])
    text = capsys.readouterr().out
    assert "thread-instructions/s" in text and "wall time" in text
