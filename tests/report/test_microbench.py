"""bench/microbench.py without a GPU: every kernel assembles and keeps every timed instruction
(ptxas neither folds a chain of constants nor merges identical chains), and the pointer chase
visits every line of its buffer once per cycle."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import microbench  # noqa: E402


def test_every_kernel_assembles_and_times_what_it_names(tmp_path):
    try:
        from ptxc.pipeline.ptxas import find_ptxas
        from ptxc.report.sass import find_nvdisasm
        find_ptxas(), find_nvdisasm()
    except Exception as e:       # noqa: BLE001 -- no toolchain here
        pytest.skip(f"ptxas / nvdisasm unavailable: {e}")
    assert microbench.main(["--dry", str(tmp_path)]) == 0
    assert len(list(tmp_path.glob("*.sm_90.cubin"))) == len(microbench.MICROS)
    names = {m.name for m in microbench.MICROS}
    assert {"hmma latency", "hmma interval", "ld.global DRAM latency", "ldsm (+ iadd) interval, 4 warps"} <= names


def test_the_chase_is_one_cycle_through_every_line():
    words, start, far = microbench.chase_buffer(1 << 16, 0x1000)
    lines = (1 << 16) // 128
    at, seen = start, set()
    for _ in range(lines):
        seen.add(at)
        at = int(words[(at - 0x1000) // 8])
    assert at == start and len(seen) == lines and far in seen and far != start
    assert all(a % 128 == 0x1000 % 128 for a in seen)


def test_the_table_puts_the_simulations_figure_beside_each_measurement():
    rows = [{"name": n, "unit": u, "kind": k, "warps": 1, "per_instruction": 1.0, "device": "NVIDIA H200"}
            for n, u, k in (("empty", "-", "latency"), ("fp32 latency", "fp32", "latency"),
                            ("hmma interval", "hmma", "interval"), ("ld.global L2 latency", "ldg_index", "latency"))]
    lines = microbench.table(rows).splitlines()[2:]
    assert [line.split("|")[4].strip() for line in lines] == ["4", "15.4", "260"]   # no row for "empty"


def test_shared_memory_kernels_stay_in_their_window_in_the_emulator(monkeypatch):
    """The ld.shared chase and the ldmatrix chains under the emulator's race checker (the clock
    reads made constants, 4 copies of each body): the chains read only zeros, so every address
    stays in the 8 KiB window. The H200 lease at 4078740 stopped with an illegal address where an
    address word lay among the ldmatrix rows and warps zeroed it unordered."""
    import numpy as np
    from ptxc.emu import launch
    monkeypatch.setattr(microbench, "REPEAT", 4)
    shared = [m for m in microbench.MICROS if m.unit in ("lds", "ldsm")]
    assert len(shared) >= 4
    for m in shared:
        src = microbench.ptx(m).replace("%clock64", "0")
        out = np.zeros(2 * m.warps, np.uint64)
        launch(src, "micro", (1,), (32 * m.warps,), [out, np.zeros(8, np.uint8)])
        sink = out[1::2]
        if m.unit == "lds":     # the chase's word holds its own address
            assert (sink == sink[0]).all() and sink[0] >= 4096, m.name
