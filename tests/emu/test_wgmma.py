"""wgmma.mma_async (sm_90a): shared-memory images are laid out by the test from the PTX ISA's
description of the canonical layouts (core matrices, swizzle atoms, LBO/SBO, the address-bit
XOR of each swizzle mode), written per element independently of ptxc/emu/wgmma_layout.py;
results are compared with numpy. Every kernel is assembled by ptxas for sm_90a."""

import numpy as np
import pytest

from ptxc.emu.fp8 import accumulate
from ptxc.emu.wgmma_layout import encode_descriptor
from ptxc.errors import EmulationError

from ptxc.emu import launch

from .helpers import PTXAS, ptxas_errors, run

HEADER = ".version 8.0\n.target sm_90a\n.address_size 64\n"
RNG = np.random.default_rng(17)


def element_address(r, k, mn_major, swizzle, lbo, sbo):
    """Byte offset (from a 1024-aligned base) of element (r, k) of an R x 16 operand."""
    if not mn_major:
        if swizzle == 0:    # 8 x 16-byte core matrices: rows 16 B apart, K halves LBO apart
            a = (r // 8) * sbo + (k // 8) * lbo + (r % 8) * 16 + (k % 8) * 2
        else:               # atom: 8 rows of `swizzle` bytes, 8-row groups SBO apart
            a = (r // 8) * sbo + (r % 8) * swizzle + k * 2
    else:
        if swizzle == 0:    # core matrices hold 8 k-rows of 8 consecutive r
            a = (r // 8) * sbo + (k // 8) * lbo + (k % 8) * 16 + (r % 8) * 2
        else:               # atom: 8 k-rows of swizzle/2 consecutive r; atoms LBO apart in r
            per = swizzle // 2
            a = (r // per) * lbo + (k // 8) * sbo + (k % 8) * swizzle + (r % per) * 2
    if swizzle:             # 16-byte chunk index ^= (address / 128) mod (swizzle / 16)
        a ^= ((a >> 7) % (swizzle // 16)) << 4
    return a


def place(image, base, bits, mn_major, swizzle, lbo, sbo):
    rows = bits.shape[0]
    for r in range(rows):
        for k in range(16):
            a = base + element_address(r, k, mn_major, swizzle, lbo, sbo)
            image[a:a + 2] = np.frombuffer(np.uint16(bits[r, k]).tobytes(), np.uint8)


def strides(rows, mn_major, swizzle):
    """(LBO, SBO, bytes) of a packed layout with a 128-byte gap between row groups."""
    if not mn_major:
        if swizzle == 0:
            return 128, 384, (rows // 8) * 384
        return 16, 8 * swizzle + 8 * swizzle, (rows // 8) * 16 * swizzle
    if swizzle == 0:
        return (rows // 8) * 128 + 128, 128, 2 * ((rows // 8) * 128 + 128)
    atoms = -(-rows // (swizzle // 2))
    return 16 * swizzle, 8 * swizzle, atoms * 16 * swizzle


def halves(x, kind):
    if kind == "f16":
        h = x.astype(np.float16)
        return h.view(np.uint16), h.astype(np.float64)
    b = (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return b, (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def acc_position(n):
    """(row, col) of accumulator register i of thread tid (PTX ISA, wgmma D fragments)."""
    tid, i = np.meshgrid(np.arange(128), np.arange(n // 2), indexing="ij")
    warp, lane = tid // 32, tid % 32
    row = 16 * warp + lane // 4 + 8 * ((i % 4) // 2)
    col = 8 * (i // 4) + 2 * (lane % 4) + i % 2
    return row, col


def a_position():
    """(row, col) of 16-bit element e (register e // 2, low half first) of A in registers."""
    tid, e = np.meshgrid(np.arange(128), np.arange(8), indexing="ij")
    warp, lane = tid // 32, tid % 32
    return 16 * warp + lane // 4 + 8 * ((e // 2) % 2), 2 * (lane % 4) + e % 2 + 8 * (e // 4)


REFENCE = """	mov.u32 %r11, spare;
	shl.b32 %r12, %r4, 2;
	add.u32 %r11, %r11, %r12;
	st.shared.u32 [%r11], %r1;
	fence.proxy.async.shared::cta;"""


OTHER_COPIES = """	setp.lt.u32 %p3, %r1, 128;
	@%p3 bra COPIED;
	sub.u32 %r4, %r1, 128;"""
OTHER_LEAVES = """	setp.lt.u32 %p3, %r1, 128;
	@%p3 bra COMPUTE;
	sub.u32 %r4, %r1, 128;
{refence}
	ret;
COMPUTE:"""


RELEASE = """	mov.u32 %r13, mbar;
	setp.eq.u32 %p3, %r1, 0;
	@%p3 mbarrier.init.shared::cta.b64 [%r13], 128;
	@%p3 mbarrier.init.shared::cta.b64 [%r13+8], 128;
	bar.sync 0;"""
# the writers (threads 128-255) release the operands on mbar[0] ({fence} before or after the
# arrival) and leave -- with {refence}, once they have stored elsewhere, fenced again and
# arrived on mbar[1], which no one waits for; the readers acquire mbar[0]'s phase 0
RELEASED = """	setp.lt.u32 %p3, %r1, 128;
	@%p3 bra ACQUIRE;
{early}	mbarrier.arrive.shared::cta.b64 %rd15, [%r13];
{late}{refence}	ret;
ACQUIRE:
	mbarrier.try_wait.parity.shared::cta.b64 %p3, [%r13], 0;
	@!%p3 bra ACQUIRE;"""
FENCE = "	fence.proxy.async.shared::cta;\n"


def kernel(n, kind, a_regs, trans_a, trans_b, image_bytes, scale_a=1, between="",
           fence=True, block_guard="", proxy="after", other_writes=False, refence=False,
           sync="cta", narrow=None):
    """`proxy`: where fence.proxy.async orders the threads' st.shared (generic proxy) before
    the wgmma's operand reads (async proxy): "after" the barrier (each reader), "before" it
    (each writer), or "none". `other_writes`: a second warpgroup (threads 128-255) writes the
    operands and leaves after the barrier -- with `refence`, once it has stored elsewhere and
    fenced again (no barrier after that fence) -- and the first computes. `sync` "mbarrier"
    (with other_writes): they release the operands by an mbarrier arrival instead (RELEASED;
    `proxy` "before" or "late": their fence before or after the arrival)."""
    nd = n // 2
    dregs = ",".join(f"%d{i}" for i in range(nd))
    if a_regs:
        a_op, trans = "{%a0,%a1,%a2,%a3}", f"{trans_b}"
    else:
        a_op, trans = "%rd4", f"{trans_a}, {trans_b}"
    loads_c = "\n".join(f"\tld.global.f32 %d{i}, [%rd8+{4 * i}];" for i in range(nd))
    stores = "\n".join(f"\tst.global.f32 [%rd11+{4 * i}], %d{i};" for i in range(nd))
    loads_a = "\n".join(f"\tld.global.b32 %a{i}, [%rd14+{4 * i}];" for i in range(4))
    return HEADER + f"""
.visible .entry wg(.param .u64 img_p, .param .u32 nchunks_p, .param .u64 adesc_p,
                   .param .u64 bdesc_p, .param .u64 afrag_p, .param .u64 c_p, .param .u64 d_p,
                   .param .u32 scale_p)
{{
	.reg .b32 %r<16>;
	.reg .b32 %a<4>;
	.reg .f32 %d<{nd}>;
	.reg .f32 %f<2>;
	.reg .b64 %rd<20>;
	.reg .pred %p<4>;
	.shared .align 1024 .b8 smem[{image_bytes}];
	.shared .align 8 .b64 mbar[2];
	.shared .align 4 .b32 spare[128];
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, smem;
	ld.param.u64 %rd1, [img_p];
	ld.param.u32 %r3, [nchunks_p];
	mov.u32 %r4, %r1;
{RELEASE if sync == "mbarrier" else ""}
{OTHER_COPIES if other_writes else ""}
COPY:
	setp.ge.u32 %p1, %r4, %r3;
	@%p1 bra COPIED;
	mul.wide.u32 %rd2, %r4, 16;
	add.s64 %rd3, %rd1, %rd2;
	ld.global.v4.u32 {{%r5, %r6, %r7, %r8}}, [%rd3];
	shl.b32 %r9, %r4, 4;
	add.u32 %r10, %r2, %r9;
	st.shared.v4.u32 [%r10], {{%r5, %r6, %r7, %r8}};
	add.u32 %r4, %r4, 128;
	bra COPY;
COPIED:
{synced(sync, proxy, other_writes, refence)}
	cvt.u64.u32 %rd5, %r2;
	shr.u64 %rd5, %rd5, 4;
	and.b64 %rd5, %rd5, 16383;
	ld.param.u64 %rd4, [adesc_p];
	add.s64 %rd4, %rd4, %rd5;
	ld.param.u64 %rd9, [bdesc_p];
	add.s64 %rd9, %rd9, %rd5;
	ld.param.u64 %rd6, [c_p];
	mul.wide.u32 %rd7, %r1, {4 * nd};
	add.s64 %rd8, %rd6, %rd7;
{loads_c}
	ld.param.u64 %rd12, [afrag_p];
	mul.wide.u32 %rd13, %r1, 16;
	add.s64 %rd14, %rd12, %rd13;
{loads_a}
	ld.param.u32 %r11, [scale_p];
	setp.ne.u32 %p2, %r11, 0;
{block_guard}
{"	wgmma.fence.sync.aligned;" if fence else ""}
{mma(n, kind, dregs, a_op, scale_a, trans, narrow)}
	wgmma.commit_group.sync.aligned;
{between}
	wgmma.wait_group.sync.aligned 0;
	ld.param.u64 %rd10, [d_p];
	add.s64 %rd11, %rd10, %rd7;
{stores}
	ret;
}}
"""


def mma(n, kind, dregs, a_op, scale_a, trans, narrow):
    """The wgmma.mma_async line: k16 over `kind` with its transpose operands, or (`narrow`: the
    8-bit A and B types) k32 without them."""
    if narrow:
        return (f"\twgmma.mma_async.sync.aligned.m64n{n}k32.f32.{narrow[0]}.{narrow[1]} "
                f"{{{dregs}}}, {a_op}, %rd9, %p2, {scale_a}, 1;")
    return (f"\twgmma.mma_async.sync.aligned.m64n{n}k16.f32.{kind}.{kind} {{{dregs}}}, {a_op}, "
            f"%rd9, %p2, {scale_a}, 1, {trans};")


def synced(sync: str, proxy: str, other_writes: bool, refence: bool) -> str:
    """What follows the copies: a CTA barrier with the fence before or after it (and the
    writers' leaving), or the writers' mbarrier release and the readers' acquire."""
    if sync == "mbarrier":
        again = "\tsub.u32 %r4, %r1, 128;\n" + REFENCE + "\n\tmbarrier.arrive.shared::cta.b64 %rd16, [%r13+8];\n" if refence else ""
        return RELEASED.format(early=FENCE if proxy == "before" else "",
                               late=FENCE if proxy == "late" else "", refence=again)
    return "\n".join((FENCE.rstrip("\n") if proxy == "before" else "", "\tbar.sync 0;",
                      FENCE.rstrip("\n") if proxy == "after" else "",
                      OTHER_LEAVES.format(refence=REFENCE if refence else "") if other_writes else ""))


def build_case(n, kind, a_regs, trans_a, trans_b, swizzle_a, swizzle_b):
    a_bits, a_val = halves(RNG.standard_normal((64, 16)), kind)
    bt_bits, bt_val = halves(RNG.standard_normal((n, 16)), kind)     # B^T: n x k
    lbo_a, sbo_a, size_a = strides(64, trans_a, swizzle_a)
    lbo_b, sbo_b, size_b = strides(n, trans_b, swizzle_b)
    b_base = -(-size_a // 1024) * 1024
    total = -(-(b_base + size_b) // 1024) * 1024
    image = RNG.integers(0, 256, total, dtype=np.uint8)      # padding holds garbage
    if not a_regs:
        place(image, 0, a_bits, trans_a, swizzle_a, lbo_a, sbo_a)
    place(image, b_base, bt_bits, trans_b, swizzle_b, lbo_b, sbo_b)
    adesc = encode_descriptor(0, lbo_a, sbo_a, swizzle_a)
    bdesc = encode_descriptor(b_base, lbo_b, sbo_b, swizzle_b)
    ar, ac = a_position()
    lo, hi = a_bits[ar, ac][:, 0::2].astype(np.uint32), a_bits[ar, ac][:, 1::2].astype(np.uint32)
    afrag = (lo | (hi << 16)).astype(np.uint32)
    return image, adesc, bdesc, afrag, a_val, bt_val, total


def launch_case(n, kind, a_regs, trans_a, trans_b, swizzle_a, swizzle_b, scale_d=True,
                scale_a=1, **kernel_kw):
    image, adesc, bdesc, afrag, a_val, bt_val, total = build_case(
        n, kind, a_regs, trans_a, trans_b, swizzle_a, swizzle_b)
    c = RNG.standard_normal((64, n)).astype(np.float32)
    row, col = acc_position(n)
    cfrag = np.ascontiguousarray(c[row, col])
    dfrag = np.zeros_like(cfrag)
    ptx = kernel(n, kind, a_regs, trans_a, trans_b, total, scale_a, **kernel_kw)
    run(ptx, "wg", (1,), (256 if kernel_kw.get("other_writes") else 128,), [image, np.uint32(total // 16), np.uint64(adesc),
                                   np.uint64(bdesc), afrag, cfrag, dfrag, np.uint32(scale_d)])
    expect = scale_a * (a_val @ bt_val.T) + (c.astype(np.float64) if scale_d else 0)
    got = np.zeros((64, n), np.float32)
    got[row, col] = dfrag
    return got, expect.astype(np.float32)


@pytest.mark.parametrize("swizzle", [0, 32, 64, 128])
@pytest.mark.parametrize("trans_a, trans_b", [(0, 0), (1, 1), (0, 1)])
def test_descriptor_operands_every_swizzle(swizzle, trans_a, trans_b):
    got, expect = launch_case(16, "f16", False, trans_a, trans_b, swizzle, swizzle)
    np.testing.assert_array_equal(got, expect)


@pytest.mark.parametrize("swizzle_b, trans_b", [(0, 0), (32, 1), (64, 0), (128, 1)])
@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_register_a(swizzle_b, trans_b, kind):
    got, expect = launch_case(24, kind, True, 0, trans_b, 0, swizzle_b)
    np.testing.assert_array_equal(got, expect)


@pytest.mark.parametrize("n", [8, 72, 256])
def test_n_sizes_scale_d_and_negated_a(n):
    got, expect = launch_case(n, "bf16", False, 0, 1, 128, 64, scale_d=False, scale_a=-1)
    np.testing.assert_array_equal(got, expect)


def _error(match, **kw):
    with pytest.raises(EmulationError, match=match):
        launch_case(16, "f16", False, 0, 0, 64, 64, **kw)


def test_accumulator_read_before_wait_is_an_error():
    _error("belongs to a wgmma.mma_async still in flight", between="\tmov.f32 %f0, %d3;")


def test_accumulator_written_before_wait_is_an_error():
    _error("still in flight", between="\tmov.f32 %d1, 0f00000000;")


@pytest.mark.parametrize("proxy,refence", [("before", False), ("before", True), ("none", True)])
def test_a_later_fence_does_not_hide_the_one_a_barrier_published(proxy, refence):
    """Another warpgroup writes the operands, fences, and the CTA barrier publishes them; then
    (refence) it stores elsewhere and fences again with no barrier after, while this
    warpgroup's wgmma reads what it wrote first. Each writer's last fence alone would say the
    write was never published to the async proxy (the emulator kept only that one, and
    refused MLA's seesaw); its last fence before the CTA's last barrier says it was. Without
    any fence it is still a proxy race."""
    if proxy == "none":
        with pytest.raises(EmulationError, match="proxy race"):
            launch_case(16, "f16", False, 0, 0, 128, 128, proxy=proxy, other_writes=True, refence=refence)
        return
    got, expect = launch_case(16, "f16", False, 0, 0, 128, 128, proxy=proxy, other_writes=True,
                              refence=refence)
    np.testing.assert_array_equal(got, expect)


def test_missing_fence_is_an_error():
    _error("accessed since the last wgmma.fence", fence=False)


def test_operand_overwritten_before_wait_is_an_error():
    _error("wgmma.mma_async in flight reads", between="\tst.shared.u32 [%r2+16], %r1;")


def test_diverged_warpgroup_is_an_error():
    guard = "\tsetp.ge.u32 %p3, %r1, 96;\n\t@%p3 bra SKIP;"
    with pytest.raises(EmulationError, match="all 128 threads of the warpgroup"):
        launch_case(16, "f16", False, 0, 0, 0, 0, block_guard=guard,
                    between="SKIP:")


def test_non_zero_base_offset_is_refused():
    image, adesc, bdesc, afrag, *_ , total = build_case(8, "f16", False, 0, 0, 128, 128)
    ptx = kernel(8, "f16", False, 0, 0, total)
    z = np.zeros((128, 4), np.float32)
    with pytest.raises(EmulationError, match="non-zero base offset"):
        run(ptx, "wg", (1,), (128,), [image, np.uint32(total // 16),
                                       np.uint64(adesc | (3 << 49)), np.uint64(bdesc), afrag,
                                       z, z.copy(), np.uint32(1)])


@pytest.mark.parametrize("proxy,refence", [("before", False), ("before", True), ("late", False),
                                           ("none", False)])
def test_a_fence_before_an_mbarrier_release_orders_the_writes(proxy, refence):
    """Another warpgroup writes the operands, fences, arrives on an mbarrier and (refence)
    stores elsewhere, fences and arrives on a second one no one waits for -- a dequantising
    warpgroup moving on to its next tile; this warpgroup acquires the first phase and its
    wgmma reads them. The fence before the observed arrival orders them (the writers' last
    fence alone would not: it follows the pairing); a fence after the arrival, or none, is a
    proxy race."""
    kw = dict(proxy=proxy, other_writes=True, refence=refence, sync="mbarrier")
    if proxy in ("late", "none"):
        with pytest.raises(EmulationError, match="proxy race"):
            launch_case(16, "f16", False, 0, 0, 128, 128, **kw)
        return
    got, expect = launch_case(16, "f16", False, 0, 0, 128, 128, **kw)
    np.testing.assert_array_equal(got, expect)


@pytest.mark.parametrize("proxy", ["after", "before", "none"])
def test_generic_writes_need_a_proxy_fence_before_wgmma_reads_them(proxy):
    """Operands written with st.shared (the generic proxy) and read by wgmma (the async
    proxy): a fence.proxy.async by the writers before the barrier or by the readers after it
    orders them; without one the hardware may read stale data, and the emulator says so."""
    if proxy == "none":
        with pytest.raises(EmulationError, match=r"proxy race: the [AB] operand reads shared "
                           r"address 0x[0-9a-f]+ through the async proxy, which thread .* wrote "
                           r"through the generic proxy at line \d+ \(`st.shared"):
            launch_case(16, "f16", False, 0, 0, 128, 128, proxy=proxy)
        return
    got, expect = launch_case(16, "f16", False, 0, 0, 128, 128, proxy=proxy)
    np.testing.assert_array_equal(got, expect)


# ---- 8-bit operands (m64nNk32 .e4m3 / .e5m2: K-major only, 32 one-byte k a row) -------------

def fp8_values(codes, kind):
    """The values of FP8 codes, decoded from the OCP formats' fields (e4m3: bias 7, subnormals
    m/8 * 2^-6; e5m2: bias 15, m/4 * 2^-14); the test draws no NaN / inf codes."""
    c = codes.astype(np.int64)
    sign = np.where(c & 0x80, -1.0, 1.0)
    if kind == "e4m3":
        e, m = (c >> 3) & 15, c & 7
        mag = np.where(e > 0, (1 + m / 8) * np.exp2(e - 7.0), m / 8 * 2.0 ** -6)
    else:
        e, m = (c >> 2) & 31, c & 3
        mag = np.where(e > 0, (1 + m / 4) * np.exp2(e - 15.0), m / 4 * 2.0 ** -14)
    return sign * mag


def fp8_codes(shape, kind):
    codes = RNG.integers(0, 256, shape).astype(np.uint8)
    bad = (codes & 0x7F) == 0x7F if kind == "e4m3" else (codes & 0x7C) == 0x7C
    return np.where(bad, codes & 0xF0, codes).astype(np.uint8)


def byte_address(r, k, swizzle, lbo, sbo):
    """Byte offset of 8-bit element (r, k) of a K-major R x 32 operand (core matrices of 8 rows
    x 16 bytes: 16 k a row), from the PTX ISA's canonical K-major layouts."""
    if swizzle == 0:
        a = (r // 8) * sbo + (k // 16) * lbo + (r % 8) * 16 + k % 16
    else:
        a = (r // 8) * sbo + (r % 8) * swizzle + k
        a ^= ((a >> 7) % (swizzle // 16)) << 4
    return a


def launch_narrow(n, kinds, a_regs, swizzle_a, swizzle_b, scale_a=1):
    a_codes, bt_codes = fp8_codes((64, 32), kinds[0]), fp8_codes((n, 32), kinds[1])
    lbo_a, sbo_a, size_a = strides(64, 0, swizzle_a)
    lbo_b, sbo_b, size_b = strides(n, 0, swizzle_b)
    b_base = -(-size_a // 1024) * 1024
    total = -(-(b_base + size_b) // 1024) * 1024
    image = RNG.integers(0, 256, total, dtype=np.uint8)
    for base, codes, lbo, sbo, sw in ((0, a_codes, lbo_a, sbo_a, swizzle_a),
                                      (b_base, bt_codes, lbo_b, sbo_b, swizzle_b)):
        if base == 0 and a_regs:
            continue
        for r in range(codes.shape[0]):
            for k in range(32):
                image[base + byte_address(r, k, sw, lbo, sbo)] = codes[r, k]
    # A in registers: mma.m16n8k32's fragment -- register i holds rows g (i even) or g + 8,
    # columns 4t.. (i < 2) or 16 + 4t.., lowest byte first
    tid, i = np.meshgrid(np.arange(128), np.arange(4), indexing="ij")
    row0 = 16 * (tid // 32) + (tid % 32) // 4 + 8 * (i % 2)
    col0 = 4 * (tid % 4) + 16 * (i // 2)
    afrag = sum(a_codes[row0, col0 + j].astype(np.uint32) << np.uint32(8 * j) for j in range(4))
    c = RNG.standard_normal((64, n)).astype(np.float32)
    row, col = acc_position(n)
    cfrag, dfrag = np.ascontiguousarray(c[row, col]), np.zeros((128, n // 2), np.float32)
    ptx = kernel(n, None, a_regs, 0, 0, total, scale_a, narrow=kinds)
    run(ptx, "wg", (1,), (128,), [image, np.uint32(total // 16),
                                  np.uint64(encode_descriptor(0, lbo_a, sbo_a, swizzle_a)),
                                  np.uint64(encode_descriptor(b_base, lbo_b, sbo_b, swizzle_b)),
                                  afrag.astype(np.uint32), cfrag, dfrag, np.uint32(1)])
    # the FP8 tensor cores' sum of the exact products (tests/emu/test_fp8_accumulation.py)
    products = scale_a * fp8_values(a_codes, kinds[0])[:, None, :] * fp8_values(bt_codes, kinds[1])[None, :, :]
    expect = accumulate(products, c.astype(np.float64))
    got = np.zeros((64, n), np.float32)
    got[row, col] = dfrag
    return got, expect.astype(np.float32)


@pytest.mark.parametrize("swizzle", [0, 32, 64, 128])
def test_narrow_descriptor_operands_every_swizzle(swizzle):
    got, expect = launch_narrow(24, ("e4m3", "e4m3"), False, swizzle, swizzle)
    np.testing.assert_array_equal(got, expect)


@pytest.mark.parametrize("kinds", [("e4m3", "e5m2"), ("e5m2", "e4m3")])
def test_narrow_register_a_and_mixed_kinds(kinds):
    got, expect = launch_narrow(16, kinds, True, 0, 64, scale_a=-1)
    np.testing.assert_array_equal(got, expect)


@pytest.mark.parametrize("line, match", [
    ("wgmma.mma_async.sync.aligned.m64n8k32.f32.f16.f16 {%d0,%d1,%d2,%d3}, %rd4, %rd9, %p2, 1, 1;",
     "supported types"),
    ("wgmma.mma_async.sync.aligned.m64n8k16.f32.e4m3.e4m3 {%d0,%d1,%d2,%d3}, %rd4, %rd9, %p2, 1, 1;",
     "supported types"),
    ("wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%d0,%d1,%d2,%d3}, %rd4, %rd9, %p2, 1, 1, 0, 0;",
     "operand"),
])
def test_narrow_malformed_is_refused(line, match):
    """What ptxas refuses, the emulator refuses too (ptxas_errors says so first)."""
    good = kernel(8, "f16", False, 0, 0, 1024)
    ptx = good.replace([x for x in good.splitlines() if "mma_async" in x][0], "\t" + line)
    assert PTXAS is None or ptxas_errors(ptx) is not None
    with pytest.raises(EmulationError, match=match):
        launch(ptx, "wg", (1,), (128,), [np.zeros(1024, np.uint8), np.uint32(64), np.uint64(0),
                                      np.uint64(0), np.zeros(512, np.uint32),
                                      np.zeros(512, np.float32), np.zeros(512, np.float32),
                                      np.uint32(1)])
