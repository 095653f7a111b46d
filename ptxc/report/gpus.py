"""GPU models ptxc reports against: SM count and arch, peak throughput, memory bandwidth.

Peaks are the vendor's dense (no 2:4 sparsity) figures at boost clock:
  tensor_tflops  f16/bf16 inputs on tensor cores with f32 accumulate (what mma.m16n8k16.f32 does)
  f32_tflops     f32 FMA on the CUDA cores (SIMT), counting an FMA as 2 FLOPs
  bandwidth_gbs  DRAM bandwidth, GB/s (10^9 bytes per second)
Datasheets print tensor figures "with sparsity"; the dense figure is half of that.

Figures checked (2026) against public copies and quotations of the vendor documents:
A100, H100, H200 (tensor, f32, bandwidth), L40S (tensor 362.05, f32 91.6, 864 GB/s), RTX 4090
(165.2 with f32 accumulate, 82.6 f32, 1008 GB/s). NOT confirmed against the vendor document
itself, only secondary copies: every B200 figure (no Blackwell datacenter GPU has been lent, so
its rows are bounds that no timing has checked); RTX 5090 tensor with f32 accumulate (209.5; GeForce parts run
f32 accumulate at half the f16-accumulate rate of 419) and its f32 peak (104.8 in the RTX
Blackwell whitepaper, 105 in reviews); the SM count of the L40S (142, from its 142 RT cores =
one per SM); L2 sizes (used only to size the L2 flush, which reads the real size from the
device when there is one).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from ..errors import UserError

MB = 1024 * 1024


@dataclass(frozen=True)
class GpuModel:
    key: str                 # stable identifier for --gpu and JSON: "h100-sxm"
    name: str                # human name: "H100 SXM"
    sm: int                  # compute capability as an integer (90 = sm_90)
    sm_count: int
    tensor_tflops: float     # dense f16/bf16 tensor core, f32 accumulate
    f32_tflops: float        # SIMT f32 (FMA = 2 FLOPs)
    bandwidth_gbs: float     # DRAM, 1e9 bytes/s
    l2_bytes: int
    source: str              # where the numbers come from
    device_pattern: str      # regex over cuDeviceGetName(), for the bench harness
    clock_mhz: float = 0.0   # the boost clock the peaks are computed at (loop model: issue rate)
    # Loaded DRAM latency the loop model uses for Little's law (bytes in flight / latency): an
    # assumption (~0.7 us under load on HBM parts, issue 13), not a vendor figure.
    dram_latency_ns: float = 700.0

    def peak_flops(self, unit: str) -> float:
        """FLOP/s of the unit a kernel uses: "tensor" (mma) or "simt" (f32 FMA)."""
        return (self.tensor_tflops if unit == "tensor" else self.f32_tflops) * 1e12

    @property
    def bandwidth(self) -> float:
        return self.bandwidth_gbs * 1e9

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("device_pattern")
        return d


GPUS: dict[str, GpuModel] = {g.key: g for g in (
    GpuModel("a100-sxm", "A100 SXM 80GB", 80, 108, 312.0, 19.5, 2039.0, 40 * MB,
             "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM column); NVIDIA Ampere GA100 "
             "whitepaper for SM count", r"A100[- ]SXM4?-80GB",
             clock_mhz=1410),
    GpuModel("h100-sxm", "H100 SXM", 90, 132, 989.4, 66.9, 3350.0, 50 * MB,
             "NVIDIA H100 Tensor Core GPU datasheet (SXM column: 1979 sparse / 2 = 989.4, "
             "67 f32, 3.35 TB/s); NVIDIA H100 (Hopper) architecture whitepaper", r"H100 (80GB HBM3|SXM)",
             clock_mhz=1830),
    GpuModel("h200", "H200 SXM", 90, 132, 989.4, 66.9, 4800.0, 50 * MB,
             "NVIDIA H200 Tensor Core GPU datasheet (SXM column: same compute as H100 SXM, "
             "4.8 TB/s HBM3e)", r"H200", clock_mhz=1830),
    # Blackwell's datacenter part: 8192 dense f16 FLOP per SM per clock (Hopper's 4096 doubled);
    # the tensor peak implies the 1856 MHz clock, as H100's implies 1830
    GpuModel("b200", "B200", 100, 148, 2250.0, 80.0, 8000.0, 126 * MB,
             "NVIDIA Blackwell datasheet, HGX B200 (1000 W) column as quoted by secondary sources "
             "(FP16/BF16 tensor 4.5 PF sparse / 2 = 2250, FP32 80, HBM3e up to 8 TB/s; the HGX "
             "B200 page's 62 TB/s over 8 GPUs is 7.7); 148 SMs and the L2 size from device "
             "reports, not the vendor document", r"(?<!G)B200", clock_mhz=1856),
    GpuModel("l40s", "L40S", 89, 142, 362.05, 91.6, 864.0, 48 * MB,
             "NVIDIA L40S datasheet (FP16/BF16 tensor 362.05 dense / 733 sparse, FP32 91.6, "
             "864 GB/s)", r"L40S", clock_mhz=2520),
    GpuModel("rtx-4090", "GeForce RTX 4090", 89, 128, 165.2, 82.6, 1008.0, 72 * MB,
             "NVIDIA Ada Lovelace GPU architecture whitepaper, appendix (RTX 4090: FP16 tensor "
             "with FP32 accumulate 165.2 dense, FP32 82.6, 1008 GB/s)", r"RTX 4090(?! D)",
             clock_mhz=2520),
    GpuModel("rtx-5090", "GeForce RTX 5090", 120, 170, 209.5, 104.8, 1792.0, 96 * MB,
             "NVIDIA RTX Blackwell GPU architecture whitepaper (RTX 5090 table; tensor figure "
             "with FP32 accumulate not confirmed against the whitepaper itself)", r"RTX 5090",
             clock_mhz=2407),
)}


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def get_gpu(name: str) -> GpuModel:
    """A model by key ("h100-sxm"), name ("H100 SXM") or a unique short form ("h100", "4090")."""
    q = _norm(name)
    exact = [g for g in GPUS.values() if q in (_norm(g.key), _norm(g.name))]
    if exact:
        return exact[0]
    partial = [g for g in GPUS.values() if q and (q in _norm(g.key) or q in _norm(g.name))]
    if len(partial) == 1:
        return partial[0]
    raise UserError(f"unknown GPU model {name!r}; known: {', '.join(GPUS)}")


def sm_of_target(target: str) -> int:
    """sm_90a -> 90: the arch a target's cubin runs on (suffix letters are feature sets)."""
    return int("".join(c for c in target[3:] if c.isdigit()))


def models_for_target(target: str) -> list[GpuModel]:
    return [g for g in GPUS.values() if g.sm == sm_of_target(target)]


def match_device(device_name: str) -> GpuModel | None:
    """The table row for a CUDA device name, or None (PCIe/NVL variants have other peaks)."""
    for g in GPUS.values():
        if re.search(g.device_pattern, device_name):
            return g
    return None


__all__ = ["GPUS", "GpuModel", "get_gpu", "match_device", "models_for_target", "sm_of_target"]
