"""SM targets ptxc can generate for, with the per-SM limits used for validation and occupancy.

Limits come from the CUDA C++ Programming Guide, "Technical Specifications per Compute
Capability" (max warps / CTAs / shared memory per SM and per CTA with the opt-in attribute).
The PTX ISA version is the oldest that supports the target and everything ptxc emits
(`cvt.f32.bf16` needs 7.1), so the PTX loads on the widest range of drivers.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import SpecError

KIB = 1024
DEFAULT_SMEM_PER_CTA = 48 * KIB  # above this a launch needs cuFuncSetAttribute(MAX_DYNAMIC_SHARED...)
REGS_PER_SM = 64 * KIB
MAX_REGS_PER_THREAD = 255
MAX_THREADS_PER_CTA = 1024
REG_ALLOC_UNIT_PER_WARP = 256  # registers are allocated per warp in units of 256
SMEM_ALLOC_UNIT = 128


@dataclass(frozen=True)
class Target:
    name: str                # "sm_90a"
    sm: int                  # 90
    ptx_version: str         # ".version" of the emitted module
    max_warps_per_sm: int
    max_ctas_per_sm: int
    smem_per_sm: int         # bytes
    max_smem_per_cta: int    # bytes, with the opt-in attribute
    reserved_smem_per_cta: int  # bytes the driver reserves per resident CTA (sm_80+: 1 KiB)
    # tensor memory (sm_100 / sm_103): columns of 128 lanes per SM, which the resident CTAs'
    # tcgen05.alloc share -- a CTA whose columns are taken waits in its alloc
    tmem_columns_per_sm: int = 0

    @property
    def has_bf16(self) -> bool:
        return self.sm >= 80

    @property
    def has_mma_m16n8k16(self) -> bool:
        return self.sm >= 80

    @property
    def has_cp_async(self) -> bool:
        return self.sm >= 80

    def __str__(self) -> str:
        return self.name


def _t(name, sm, ptx, warps, ctas, smem_sm_kib, smem_cta_kib, reserved=KIB):
    return Target(name, sm, ptx, warps, ctas, smem_sm_kib * KIB, smem_cta_kib * KIB, reserved,
                  TMEM_COLUMNS_PER_SM if sm in (100, 103) else 0)


TMEM_COLUMNS_PER_SM = 512


TARGETS: dict[str, Target] = {t.name: t for t in (
    _t("sm_75", 75, "7.1", 32, 16, 64, 64, reserved=0),
    _t("sm_80", 80, "7.1", 64, 32, 164, 163),
    _t("sm_86", 86, "7.1", 48, 16, 100, 99),
    _t("sm_87", 87, "7.4", 48, 16, 164, 163),
    _t("sm_89", 89, "7.8", 48, 24, 100, 99),
    _t("sm_90", 90, "7.8", 64, 32, 228, 227),
    _t("sm_90a", 90, "8.0", 64, 32, 228, 227),
    _t("sm_100", 100, "8.6", 64, 32, 228, 227),
    _t("sm_100a", 100, "8.6", 64, 32, 228, 227),
    _t("sm_103", 103, "8.8", 64, 32, 228, 227),
    _t("sm_103a", 103, "8.8", 64, 32, 228, 227),
    _t("sm_120", 120, "8.7", 48, 32, 100, 99),
    _t("sm_120a", 120, "8.7", 48, 32, 100, 99),
    _t("sm_121", 121, "8.8", 48, 32, 100, 99),
)}

DEFAULT_TARGETS = ("sm_80", "sm_89", "sm_90", "sm_120")


def get_target(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise SpecError(f"unsupported target {name!r}; allowed: {', '.join(TARGETS)}") from None


def occupancy(target: Target, threads_per_cta: int, registers: int, smem_per_cta: int,
              tmem_columns: int = 0) -> dict:
    """Theoretical occupancy: CTAs and warps per SM that run at once, and which limit binds.

    Registers: each warp allocates ceil(regs * 32 / 256) * 256 registers from the SM's 64 K.
    Shared memory: each CTA takes its bytes (rounded up to 128) plus the driver's reservation.
    Tensor memory (a tcgen05 kernel's `tmem_columns`): the SM's 512 columns; a CTA resident
    past them waits in its tcgen05.alloc until another frees its columns, so it does not count.
    """
    warps = -(-threads_per_cta // 32)
    limits = {"warps": target.max_warps_per_sm // warps, "ctas": target.max_ctas_per_sm}
    if registers:
        regs_per_warp = -(-registers * 32 // REG_ALLOC_UNIT_PER_WARP) * REG_ALLOC_UNIT_PER_WARP
        limits["registers"] = (REGS_PER_SM // regs_per_warp) // warps
    if smem_per_cta:
        per_cta = -(-smem_per_cta // SMEM_ALLOC_UNIT) * SMEM_ALLOC_UNIT + target.reserved_smem_per_cta
        limits["shared_memory"] = target.smem_per_sm // per_cta
    if tmem_columns:
        limits["tensor_memory"] = target.tmem_columns_per_sm // tmem_columns
    ctas = min(limits.values())
    return {
        "ctas_per_sm": ctas,
        "warps_per_sm": ctas * warps,
        "occupancy": round(ctas * warps / target.max_warps_per_sm, 4),
        "limited_by": min(limits, key=lambda k: (limits[k], k)),
    }
