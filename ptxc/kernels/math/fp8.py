"""FP8 (OCP E4M3 / E5M2) building blocks over the IR builder, exact on every target.

Quantise (f32 -> FP8 bytes): round to nearest even with OCP "satfinite": NaN -> 0x7F, +-inf and
overflow -> +-max finite (448 / 57344), subnormals kept, -0 -> 0x80.
    sm_89+   cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32, two values per instruction
    older    integer rounding of the f32 bits for results in the normal range (add half an ulp
             minus one plus the kept lsb, shift, re-bias: the carry walks into the exponent), and
             for subnormal results one `add.f32 |x|, 2^k` whose ulp is the FP8 subnormal step
             (the FPU's own nearest-even rounding); bit-identical to the hardware path.

Dequantise (FP8 bytes -> f32 / f16x2 / bf16x2), exact (every FP8 value is an f16 value):
    sm_89+   cvt.rn.f16x2.{e4m3x2,e5m2x2}
    older    e5m2 is the high byte of an f16: one prmt per pair. e4m3: the byte's 7 magnitude bits
             placed at f32 bits [26:20] read as an f32 are the value times 2^-120, subnormals
             included, so one exact multiply by 2^120 per element; S.1111.111 -> NaN.
e4m3 NaN becomes the canonical NaN of the result type on both paths (f16 0x7FFF).

Words: four FP8 bytes in one b32, element 0 in the low byte (the order of memory).
`load_kv_dequant` is the block an attention kernel calls after its address arithmetic.
"""

from __future__ import annotations

from ...ir import B16, B32, F16, F32, U32, Addr, KernelBuilder, Reg
from ...targets import Target

KINDS = ("e4m3", "e5m2")
MAX_FINITE = {"e4m3": 448.0, "e5m2": 57344.0}
NAN_CODE = 0x7F


def has_fp8_cvt(target: Target) -> bool:
    return target.sm >= 89


def has_fp8_mma(target: Target) -> bool:
    """Whether mma.m16n8k32 over e4m3 / e5m2 runs on FP8 tensor cores (QMMA.16832: twice
    HMMA.16816's work an instruction): sm_89 and sm_120 / sm_121. ptxas takes it from sm_89 on,
    but on sm_90 and sm_100 lowers it to conversions and two HMMA.16816 (nvdisasm of ptxas
    13's output), so FP8 products on mma.sync pay off only here."""
    return target.sm in (89, 120, 121)


def ptx_version(target: Target, mma: bool = False) -> str:
    """The PTX ISA version a module using these blocks needs: the FP8 cvt forms exist on sm_89
    only from PTX 8.1 (on sm_90 from 7.8), so sm_89 FP8 kernels need a CUDA 12.1+ driver;
    `mma` (mma.m16n8k32 over FP8): 8.4 on sm_89 (CUDA 12.4+)."""
    if target.sm != 89:
        return target.ptx_version
    return max(target.ptx_version, "8.4" if mma else "8.1", key=_version_key)


def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


# (mantissa shift in f32 bits, f32 bits of the smallest normal, magic addend whose ulp is the
#  subnormal step, its bits, exponent re-bias in code units, largest finite code)
_SW = {"e4m3": (20, 0x3C800000, 16384.0, 0x46800000, 120 << 3, 0x7E),
       "e5m2": (21, 0x38800000, 128.0, 0x43000000, 112 << 2, 0x7B)}


def _quantize_sw(b: KernelBuilder, x: Reg, kind: str) -> Reg:
    """One f32 -> its FP8 code in the low byte of a u32 (software path)."""
    shift, min_normal, magic, magic_bits, rebias, max_code = _SW[kind]
    u = b.bitcast(x, U32)
    a = b.and_(u, 0x7FFFFFFF)
    keep_lsb = b.and_(b.shr(a, shift), 1)
    rounded = b.add(a, b.add(keep_lsb, (1 << (shift - 1)) - 1))
    normal = b.sub(b.shr(rounded, shift), rebias)
    sub = b.sub(b.bitcast(b.add(b.bitcast(a, F32), magic), U32), magic_bits)
    code = b.min(b.selp(sub, normal, b.setp("lt", a, min_normal)), max_code)
    code = b.or_(code, b.and_(b.shr(u, 24), 0x80))
    return b.selp(NAN_CODE, code, b.setp("gt", a, 0x7F800000), type=U32)


def quantize(b: KernelBuilder, vals: list[Reg], kind: str, target: Target) -> list[Reg]:
    """f32 values (a multiple of 4) -> b32 words of FP8 bytes, element 0 in the low byte."""
    if len(vals) % 4:
        raise ValueError(f"quantize takes a multiple of 4 values, got {len(vals)}")
    words = []
    for i in range(0, len(vals), 4):
        v = vals[i:i + 4]
        if has_fp8_cvt(target):
            pairs = [b.cvt_to_fp8x2(v[1], v[0], kind), b.cvt_to_fp8x2(v[3], v[2], kind)]
            words.append(b.pack(B32, pairs))
        else:
            c = [_quantize_sw(b, x, kind) for x in v]
            words.append(b.prmt(b.prmt(c[0], c[1], 0x0040), b.prmt(c[2], c[3], 0x0040), 0x5410))
    return words


def _f16x2_sw(b: KernelBuilder, word: Reg, pair: int, kind: str) -> Reg | None:
    """e5m2 bytes 2*pair, 2*pair+1 -> f16x2 (their bytes become the f16 high bytes)."""
    lo, hi = 2 * pair, 2 * pair + 1
    return b.prmt(word, 0, (hi << 12) | 0x0400 | (lo << 4) | 0x4)


def _e4m3_f32_sw(b: KernelBuilder, word: Reg, byte: int, nan: Reg) -> Reg:
    top = b.prmt(word, 0, (byte << 12) | 0x444)               # the byte in bits [31:24]
    mag = b.and_(b.shr(top, 4), 0x07F00000)
    val = b.mul(b.bitcast(b.or_(b.and_(top, 0x80000000), mag), F32), 2.0 ** 120)
    return b.selp(nan, val, b.setp("eq", mag, 0x07F00000))


def _halves_to_f32(b: KernelBuilder, pair: Reg) -> list[Reg]:
    lo, hi = b.unpack(pair, F16)
    return [b.cvt(F32, lo), b.cvt(F32, hi)]


def dequantize(b: KernelBuilder, words: list[Reg], kind: str, target: Target, to: str = "f32") -> list[Reg]:
    """b32 words of FP8 bytes -> f32 values (4 per word), or packed f16x2 / bf16x2 (2 per word)."""
    if to not in ("f32", "f16x2", "bf16x2"):
        raise ValueError(f"dequantize to {to!r}; allowed: f32, f16x2, bf16x2")
    hw = has_fp8_cvt(target)
    if kind == "e5m2" or hw:
        pairs = []
        for w in words:
            if hw:
                pairs += [b.cvt_from_fp8x2(h, kind) for h in b.unpack(w, B16)]
            else:
                pairs += [_f16x2_sw(b, w, p, kind) for p in (0, 1)]
        if to == "f16x2":
            return pairs
        vals = [v for p in pairs for v in _halves_to_f32(b, p)]
    else:
        nan = b.bitcast(b.mov(0x7FFFFFFF, U32), F32)
        vals = [_e4m3_f32_sw(b, w, i, nan) for w in words for i in range(4)]
        if to == "f16x2":
            from ..common import FORMATS, from_f32
            return from_f32(b, FORMATS["f16"], vals, target)
    if to == "bf16x2":   # exact: the top half of each f32
        return [b.prmt(b.bitcast(vals[i], U32), b.bitcast(vals[i + 1], U32), 0x7632)
                for i in range(0, len(vals), 2)]
    return vals


# e4m3 into f16 tiles without a hardware cvt (sm_75 .. sm_86): the byte's bits placed as an f16
# -- sign at bit 15, the 7 magnitude bits at [13:7] -- read as the value times 2^-8, e4m3's
# subnormals included (M·2^-9 lands as the f16 subnormal M·2^-17), so a pair is a prmt and a
# few integer operations where the exact path takes two f32 multiplies, two NaN selects and a
# pack; the caller folds 2^8 into its scales (f16_pair_factor).
F16_PLACED = 2.0 ** -8


def f16_pair_factor(kind: str, target: Target) -> float:
    """What f16_pairs' values are times the FP8 values: 2^-8 where e4m3 is placed by bits
    (no hardware cvt), else 1."""
    return F16_PLACED if kind == "e4m3" and not has_fp8_cvt(target) else 1.0


def f16_pairs(b: KernelBuilder, words: list[Reg], kind: str, target: Target) -> list[Reg]:
    """b32 words of FP8 bytes -> f16x2 pairs (2 per word) of the values times
    f16_pair_factor(kind, target), exactly; e4m3 NaN (S.1111.111) -> an f16 NaN (exponent 31:
    the placed magnitude's 0x3F80 with bit 14 or-ed in, 0x7F80)."""
    if f16_pair_factor(kind, target) == 1.0:
        return dequantize(b, words, kind, target, to="f16x2")
    pairs = []
    for w in words:
        for p in (0, 1):
            high = b.bitcast(_f16x2_sw(b, w, p, kind), U32)   # each byte in its half's high byte
            placed = b.or_(b.and_(b.shr(high, 1), 0x3F803F80), b.and_(high, 0x80008000))
            # NaN's placed magnitude 0x3F80 plus 0x80 carries into bit 14 (no other magnitude,
            # at most 0x3F00, does; no carry leaves the half): or-ed in, its exponent is 31
            nan = b.and_(b.add(placed, 0x00800080), 0x40004000)
            pairs.append(b.bitcast(b.or_(placed, nan), B32))
    return pairs


def load_words(b: KernelBuilder, addr: Addr, elems: int, pred: Reg | None = None) -> list[Reg]:
    """`elems` (16, 8 or 4) FP8 bytes at a 16/8/4-byte aligned address as b32 words, one
    ld.global.nc; with `pred`, lanes where it is false read zeros. A kernel that keeps several
    loads in flight issues these first and calls `dequantize` when it uses the values."""
    vec = {16: 4, 8: 2, 4: 1}[elems]
    if pred is None:
        words = b.ld("global", B32, addr, vec=vec, nc=True)
    else:
        words = [b.mov(0, B32) for _ in range(vec)]
        with b.predicate(pred):
            b.ld("global", B32, addr, vec=vec, nc=True, out=words)
    return words if isinstance(words, list) else [words]


def load_kv_dequant(b: KernelBuilder, addr: Addr, kind: str, target: Target, *, elems: int = 16,
                    scale: Reg | None = None, pred: Reg | None = None) -> list[Reg]:
    """Load `elems` (16, 8 or 4) FP8 values at a 16/8/4-byte aligned address with one
    ld.global.nc and return them as f32, times `scale` when given (the "tensor" scale register
    or this head's "head" scale). With `pred`, lanes where it is false read zeros."""
    vals = dequantize(b, load_words(b, addr, elems, pred), kind, target)
    return [b.mul(v, scale) for v in vals] if scale is not None else vals


__all__ = ["KINDS", "MAX_FINITE", "has_fp8_cvt", "has_fp8_mma", "ptx_version", "quantize", "dequantize", "F16_PLACED",
           "f16_pair_factor", "f16_pairs", "load_words", "load_kv_dequant"]
