"""The whole-launch model's fitted constants (`Calibration`) per kernel path and GPU model, and
the measured error the report quotes with every estimate (ptxc.report.launch_model uses them;
bench/calibration/ holds the medians and the grids that chose them; tests/report/
test_calibration.py keeps the quoted error true)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Calibration:
    gpu: str                    # GpuModel key the constants were fitted on
    tensor_fraction: float      # mma.sync throughput / the GPU model's dense tensor peak
    hmma_cycles: float          # clocks one warp's HMMA costs on its own dependent chain
    ipc: float                  # one warp's issue rate for everything else (instructions/clock)
    dram_latency_ns: float      # Little's-law latency of a DRAM load
    bandwidth_fraction: float   # achievable share of the DRAM bandwidth
    launch_s: float             # a launch without a modelled loop, and per-launch overhead
    source: str
    # each CTA's time outside its main loop where nothing hides it: the prologue's first
    # loads' round trip, the pipeline's fill and drain, the epilogue's stores (0 in the
    # mma.sync fit, whose kernels run 2+ CTAs per SM and overlap them)
    cta_fixed_s: float = 0.0
    # the per-warp term: "ipc" (non-tensor instructions / `ipc` + HMMAs x `hmma_cycles`, and
    # Little's law at `dram_latency_ns`) or "in_order" (ptxc.report.issue_sim over the loop's
    # dependency program, its loads answering after `dram_latency_ns`)
    warp_term: str = "ipc"


# The mma.sync / SIMT kernels: each SM sub-partition's warps simulated in order (issue_sim),
# loads answering after 500 ns, the tensor pipe at 0.26 of the dense peak, chosen on the 45 H100
# medians of b26fd24 / c889eb4 / 3357c2c (bench/calibration/README.md: a grid over the tensor
# share, the latency and the bandwidth share; 44 of 45 within ±35 % for 0.26-0.28 and
# 450-550 ns). hmma_cycles and ipc are the "ipc" term's, used only for a loop without a
# dependency program.
H100_MMA_SYNC = Calibration(
    gpu="h100-sxm", tensor_fraction=0.26, hmma_cycles=20, ipc=0.30, dram_latency_ns=500,
    bandwidth_fraction=0.78, launch_s=5e-6, warp_term="in_order",
    source="bench/calibration: 45 medians, H100 SXM, commits b26fd24 / c889eb4 / 3357c2c")

# The wgmma + TMA kernels (sm_90a): the same terms with the tensor cores at 0.60 of the dense
# peak and 3 us a CTA outside the loop, chosen on the 28 H100 medians of 89432c6 / f7ee845 (a
# grid over the two, the other constants kept): 28 within ±35 % (0.75-1.26), flat for 2.5-5 us
MMA_SYNC_CALIBRATIONS = {H100_MMA_SYNC.gpu: H100_MMA_SYNC}
H100_WGMMA = Calibration(
    gpu="h100-sxm", tensor_fraction=0.60, hmma_cycles=20, ipc=0.30, dram_latency_ns=300,
    bandwidth_fraction=0.78, launch_s=5e-6, cta_fixed_s=3e-6,
    source="bench/calibration: 28 wgmma medians, H100 SXM, commits 89432c6 / f7ee845")
WGMMA_CALIBRATIONS = {H100_WGMMA.gpu: H100_WGMMA}
# What the report quotes with every estimate (tests/report/test_calibration.py keeps it true).
CALIBRATION_ERROR = ("in-sample over 45 H100 medians: 44 within ±35 %, all within ±45 %; "
                     "out-of-sample over 23 H200 medians (53a4762): 19 within ±35 %, model/measured "
                     "0.74–1.71, over 41 H100 medians of 89432c6: 39 within ±35 %, 0.74–1.37, "
                     "over 48 H200 medians of 2d6d5cd: 45 within ±35 %, 0.71–1.46, over 55 of the "
                     "155 H200 medians of 6c5a819–621d27f: 51 within ±35 %, 0.71–1.39, over 60 H200 "
                     "medians of 4078740: 56 within ±35 %, 0.69–1.69 (unsplit, MQA and FP8 "
                     "per-head tensor-core decodes modelled up to 1.71x slow, MQA d256 at 64 "
                     "splits 0.69–0.71x); mma.sync and SIMT kernels only")
WGMMA_CALIBRATION_ERROR = ("in-sample over 28 H100 wgmma medians (89432c6, f7ee845): all within "
                           "±35 %, 0.75–1.26; out-of-sample over 62 H200 wgmma medians (2d6d5cd, "
                           "53a4762): 61 within ±35 %, 0.65–1.22, over 100 of "
                           "the 155 H200 medians of 6c5a819–621d27f: 96 within ±35 %, 0.80–1.42 -- "
                           "every one that is not MLA (20), 0.88–1.15, 74 of 78 MLA decodes, every "
                           "point outside modelled slow (four terms were chosen after seeing these "
                           "points: the MLA decode's lockstep, the kernels' split chunk, the split "
                           "partials' bytes, varlen's causal queries; the wgmma operand stall, from "
                           "the SM's rates, moved the lockstep decodes up ~15 %), over 114 H200 "
                           "wgmma medians of 4078740: 109 within ±35 %, 0.61–1.44 (fast: gpt-oss's "
                           "serve step, the FP8 serve step and decode at batch 64; slow: two MLA "
                           "lockstep decodes); sm_90a wgmma kernels only")


# The copy families (kv_append, mla_append, merge_states: no attention loop) under the mma.sync
# constants -- the launch term and their bytes over the DRAM share -- against every timed copy
# (tests/report/test_calibration.py keeps it true).
COPY_CALIBRATION_ERROR = ("over 23 H100 and H200 medians of copies (the appends of b26fd24–"
                          "4078740, 5 of them among the mma.sync fit's points, and a merge of two "
                          "prefill chunks' states at 4078740, 0.10 ms): 22 within ±35 %, "
                          "0.73–1.16 (outside: the FP8 append with RoPE, 0.73x); most appends "
                          "are launch-bound (a few KiB moved)")


def calibration_for(gpu: str, config: dict) -> tuple[Calibration, str] | None:
    """The fitted constants for a kernel's path on a GPU model, with the error to quote, or
    None where nothing was fitted (tcgen05, or a GPU without a fit)."""
    path = str(config.get("path", ""))
    if path.startswith("tcgen05"):
        return None
    if path.startswith("wgmma"):
        cal = WGMMA_CALIBRATIONS.get(gpu)
        return (cal, WGMMA_CALIBRATION_ERROR) if cal else None
    cal = MMA_SYNC_CALIBRATIONS.get(gpu)
    return (cal, CALIBRATION_ERROR) if cal else None


__all__ = ["CALIBRATION_ERROR", "COPY_CALIBRATION_ERROR", "Calibration", "H100_MMA_SYNC", "H100_WGMMA", "MMA_SYNC_CALIBRATIONS",
           "WGMMA_CALIBRATIONS", "WGMMA_CALIBRATION_ERROR", "calibration_for"]
