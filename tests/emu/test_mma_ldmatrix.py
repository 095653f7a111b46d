"""mma.sync and ldmatrix: fragments are loaded by per-lane address formulas written in the
test kernels (from the PTX ISA fragment figures), results are compared with numpy."""

import numpy as np
import pytest

from .helpers import HEADER, run

RNG = np.random.default_rng(3)


def halves(x: np.ndarray, kind: str) -> np.ndarray:
    """float values -> (bits as uint16, exact float64 values) in f16 or bf16."""
    if kind == "f16":
        h = x.astype(np.float16)
        return h.view(np.uint16), h.astype(np.float64)
    b = (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)   # truncation is fine
    return b, (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


PROLOGUE = r"""
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, %ctaid.x;
	shr.u32 %r3, %r1, 5;                 // warp in CTA
	and.b32 %r4, %r1, 31;                // lane
	mad.lo.s32 %r5, %r2, 2, %r3;         // global warp id w (two warps per CTA)
	shr.u32 %r6, %r4, 2;                 // g = lane >> 2
	and.b32 %r7, %r4, 3;                 // t = lane % 4
	shl.b32 %r8, %r7, 1;                 // 2t
	ld.param.u64 %rd1, [a_p];
	ld.param.u64 %rd2, [bt_p];
	ld.param.u64 %rd3, [c_p];
	ld.param.u64 %rd4, [d_p];
	// C/D fragment: c0,c1 = C[g][2t..2t+1], c2,c3 = C[g+8][2t..2t+1]   (f32, 16x8 per warp)
	mad.lo.s32 %r11, %r6, 8, %r8;
	mad.lo.s32 %r11, %r5, 128, %r11;
	mul.wide.u32 %rd9, %r11, 4;
	add.s64 %rd10, %rd3, %rd9;
	add.s64 %rd11, %rd4, %rd9;
	ld.global.v2.f32 {%c0, %c1}, [%rd10];
	ld.global.v2.f32 {%c2, %c3}, [%rd10+256];
"""

MMA_K16 = HEADER + r"""
.visible .entry mma_k16(.param .u64 a_p, .param .u64 bt_p, .param .u64 c_p, .param .u64 d_p)
{
	.reg .b32 %r<16>;
	.reg .b32 %a<4>;
	.reg .b32 %b<2>;
	.reg .f32 %c<4>;
	.reg .f32 %d<4>;
	.reg .b64 %rd<16>;
""" + PROLOGUE + r"""
	// A fragment (16x16 row-major per warp): a0a1 = A[g][2t..], a2a3 = A[g+8][2t..],
	// a4a5 = A[g][2t+8..], a6a7 = A[g+8][2t+8..]
	mad.lo.s32 %r9, %r6, 16, %r8;
	mad.lo.s32 %r9, %r5, 256, %r9;
	mul.wide.u32 %rd5, %r9, 2;
	add.s64 %rd6, %rd1, %rd5;
	ld.global.u32 %a0, [%rd6];
	ld.global.u32 %a1, [%rd6+256];
	ld.global.u32 %a2, [%rd6+16];
	ld.global.u32 %a3, [%rd6+272];
	// B fragment from B^T stored [n][k] (8x16): b0b1 = B[2t..2t+1][g], b2b3 = B[2t+8..][g]
	mad.lo.s32 %r10, %r6, 16, %r8;
	mad.lo.s32 %r10, %r5, 128, %r10;
	mul.wide.u32 %rd7, %r10, 2;
	add.s64 %rd8, %rd2, %rd7;
	ld.global.u32 %b0, [%rd8];
	ld.global.u32 %b1, [%rd8+16];
	mma.sync.aligned.m16n8k16.row.col.f32.TYPE.TYPE.f32
		{%d0, %d1, %d2, %d3}, {%a0, %a1, %a2, %a3}, {%b0, %b1}, {%c0, %c1, %c2, %c3};
	st.global.v2.f32 [%rd11], {%d0, %d1};
	st.global.v2.f32 [%rd11+256], {%d2, %d3};
	ret;
}
"""

MMA_K8 = HEADER + r"""
.visible .entry mma_k8(.param .u64 a_p, .param .u64 bt_p, .param .u64 c_p, .param .u64 d_p)
{
	.reg .b32 %r<16>;
	.reg .b32 %a<2>;
	.reg .b32 %b0;
	.reg .f32 %c<4>;
	.reg .f32 %d<4>;
	.reg .b64 %rd<16>;
""" + PROLOGUE + r"""
	// A (16x8): a0a1 = A[g][2t..], a2a3 = A[g+8][2t..];  B^T (8x8): b0b1 = B[2t..][g]
	mad.lo.s32 %r9, %r6, 8, %r8;
	mad.lo.s32 %r9, %r5, 128, %r9;
	mul.wide.u32 %rd5, %r9, 2;
	add.s64 %rd6, %rd1, %rd5;
	ld.global.u32 %a0, [%rd6];
	ld.global.u32 %a1, [%rd6+128];
	mad.lo.s32 %r10, %r6, 8, %r8;
	mad.lo.s32 %r10, %r5, 64, %r10;
	mul.wide.u32 %rd7, %r10, 2;
	add.s64 %rd8, %rd2, %rd7;
	ld.global.u32 %b0, [%rd8];
	mma.sync.aligned.m16n8k8.row.col.f32.TYPE.TYPE.f32
		{%d0, %d1, %d2, %d3}, {%a0, %a1}, {%b0}, {%c0, %c1, %c2, %c3};
	st.global.v2.f32 [%rd11], {%d0, %d1};
	st.global.v2.f32 [%rd11+256], {%d2, %d3};
	ret;
}
"""


@pytest.mark.parametrize("kind", ["f16", "bf16"])
@pytest.mark.parametrize("k", [16, 8])
def test_mma_matches_numpy(kind, k):
    warps = 6
    a_bits, a = halves(RNG.standard_normal((warps, 16, k)), kind)
    bt_bits, bt = halves(RNG.standard_normal((warps, 8, k)), kind)
    c = RNG.standard_normal((warps, 16, 8)).astype(np.float32)
    d = np.zeros_like(c)
    ptx = (MMA_K16 if k == 16 else MMA_K8).replace("TYPE", kind)
    run(ptx, f"mma_k{k}", (3,), (64,), [a_bits, bt_bits, c, d])
    want = a @ bt.transpose(0, 2, 1) + c.astype(np.float64)
    np.testing.assert_allclose(d, want, rtol=1e-6, atol=1e-6)


LDMATRIX = HEADER + r"""
.visible .entry ldm(.param .u64 src_p, .param .u64 out_p)
{
	.reg .pred %p<2>;
	.reg .b32 %r<16>;
	.reg .b32 %m<4>;
	.reg .b64 %rd<8>;
	.shared .align 16 .b8 sm[1024];
	ld.param.u64 %rd1, [src_p];
	ld.param.u64 %rd2, [out_p];
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, sm;
	// copy 1024 bytes into shared: lane l copies bytes [32l, 32l+32)
	mul.wide.u32 %rd3, %r1, 32;
	add.s64 %rd4, %rd1, %rd3;
	ld.global.v4.u32 {%r3, %r4, %r5, %r6}, [%rd4];
	ld.global.v4.u32 {%r7, %r8, %r9, %r10}, [%rd4+16];
	shl.b32 %r11, %r1, 5;
	add.s32 %r11, %r2, %r11;
	st.shared.v4.u32 [%r11], {%r3, %r4, %r5, %r6};
	st.shared.v4.u32 [%r11+16], {%r7, %r8, %r9, %r10};
	bar.sync 0;
	// lane l = 8m + r supplies row r of matrix m, stored (non-contiguously) at
	// sm + (8m + (3r mod 8)) * 32
	shr.u32 %r3, %r1, 3;
	and.b32 %r4, %r1, 7;
	mul.lo.u32 %r5, %r4, 3;
	and.b32 %r5, %r5, 7;
	mad.lo.u32 %r6, %r3, 8, %r5;
	shl.b32 %r6, %r6, 5;
	add.s32 %r7, %r2, %r6;
	setp.ge.u32 %p1, %r1, LIVE;
	@%p1 mov.u32 %r7, 0xfffffff0;       // unused lanes pass garbage: must be ignored
	ldmatrix.sync.aligned.m8n8.NUMTRANS.shared.b16 DSTS, [%r7];
	mul.wide.u32 %rd5, %r1, 16;
	add.s64 %rd6, %rd2, %rd5;
	STORES
	ret;
}
"""


def ldmatrix_ptx(num: int, trans: bool) -> str:
    dsts = "{" + ", ".join(f"%m{i}" for i in range(num)) + "}"
    stores = "\n\t".join(f"st.global.u32 [%rd6+{4 * i}], %m{i};" for i in range(num))
    return (LDMATRIX.replace("NUMTRANS", f"x{num}" + (".trans" if trans else ""))
            .replace("DSTS", dsts).replace("STORES", stores).replace("LIVE", str(8 * num)))


def generic_ldmatrix_ptx() -> str:
    """x4.trans through a generic address (ldmatrix without .shared)."""
    ptx = ldmatrix_ptx(4, True).replace(".shared.b16", ".b16")
    ptx = ptx.replace("\t.reg .b64 %rd<8>;", "\t.reg .b64 %rd<10>;")
    return ptx.replace("[%r7];", "[%rd9];").replace(
        "\tldmatrix", "\tcvt.u64.u32 %rd8, %r7;\n\tcvta.shared.u64 %rd9, %rd8;\n\tldmatrix")


@pytest.mark.parametrize("num, trans, generic", [(1, False, False), (2, False, False),
                                                 (4, False, False), (1, True, False),
                                                 (2, True, False), (4, True, False),
                                                 (4, True, True)])
def test_ldmatrix_per_lane_layout(num, trans, generic):
    src = RNG.integers(0, 65536, 512).astype(np.uint16)
    out = np.zeros((32, 4), np.uint32)
    ptx = generic_ldmatrix_ptx() if generic else ldmatrix_ptx(num, trans)
    run(ptx, "ldm", (1,), (32,), [src, out])
    smem = src.reshape(32, 16)                           # 32 rows of 32 bytes
    mats = np.array([[smem[8 * m + (3 * r) % 8, :8] for r in range(8)] for m in range(4)])
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for m in range(num):
            M = mats[m].T if trans else mats[m]
            want = int(M[g, 2 * t]) | (int(M[g, 2 * t + 1]) << 16)
            assert int(out[lane, m]) == want, (lane, m)


LDM_MMA = HEADER + r"""
// The same products computed from ldmatrix fragments and from plain per-lane shared loads.
.visible .entry ldm_mma(.param .u64 src_p, .param .u64 out_p)
{
	.reg .b32 %r<24>;
	.reg .b16 %h<4>;
	.reg .b32 %a<4>;
	.reg .b32 %q<4>;
	.reg .b32 %b<2>;
	.reg .b32 %v<2>;
	.reg .b32 %w<2>;
	.reg .b32 %x<2>;
	.reg .f32 %f<20>;
	.reg .b64 %rd<8>;
	.shared .align 16 .b8 sm[1024];       // A 16x16 | B^T 8x16 | V 16x8, all f16 row-major
	ld.param.u64 %rd1, [src_p];
	ld.param.u64 %rd2, [out_p];
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, sm;
	mul.wide.u32 %rd3, %r1, 32;
	add.s64 %rd4, %rd1, %rd3;
	ld.global.v4.u32 {%r3, %r4, %r5, %r6}, [%rd4];
	ld.global.v4.u32 {%r7, %r8, %r9, %r10}, [%rd4+16];
	shl.b32 %r11, %r1, 5;
	add.s32 %r11, %r2, %r11;
	st.shared.v4.u32 [%r11], {%r3, %r4, %r5, %r6};
	st.shared.v4.u32 [%r11+16], {%r7, %r8, %r9, %r10};
	bar.sync 0;
	mov.f32 %f0, 0f00000000;
	// --- ldmatrix path. A: lane l -> &A[l % 16][(l / 16) * 8]
	and.b32 %r3, %r1, 15;
	shr.u32 %r4, %r1, 4;
	shl.b32 %r5, %r3, 5;
	shl.b32 %r6, %r4, 4;
	add.s32 %r7, %r5, %r6;
	add.s32 %r7, %r2, %r7;
	ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%a0, %a1, %a2, %a3}, [%r7];
	// B^T [n][k] at +512: lane l < 16 -> &Bt[l % 8][(l / 8) * 8]
	and.b32 %r3, %r1, 7;
	shr.u32 %r4, %r1, 3;
	and.b32 %r4, %r4, 1;
	shl.b32 %r5, %r3, 5;
	shl.b32 %r6, %r4, 4;
	add.s32 %r7, %r5, %r6;
	add.s32 %r7, %r7, 512;
	add.s32 %r7, %r2, %r7;
	ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%b0, %b1}, [%r7];
	// V [k][n] at +768: lane l < 16 -> &V[l][0], transposed
	and.b32 %r3, %r1, 15;
	shl.b32 %r5, %r3, 4;
	add.s32 %r7, %r5, 768;
	add.s32 %r7, %r2, %r7;
	ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%v0, %v1}, [%r7];
	mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32
		{%f1, %f2, %f3, %f4}, {%a0, %a1, %a2, %a3}, {%b0, %b1}, {%f0, %f0, %f0, %f0};
	mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32
		{%f5, %f6, %f7, %f8}, {%a0, %a1, %a2, %a3}, {%v0, %v1}, {%f0, %f0, %f0, %f0};
	// --- plain loads. g = l >> 2, t = l % 4
	shr.u32 %r12, %r1, 2;
	and.b32 %r13, %r1, 3;
	shl.b32 %r14, %r13, 2;                 // 2t elements = 4t bytes
	shl.b32 %r15, %r12, 5;                 // row g of a 32-byte-row matrix
	add.s32 %r16, %r15, %r14;
	add.s32 %r16, %r2, %r16;
	ld.shared.u32 %q0, [%r16];             // A[g][2t..]
	ld.shared.u32 %q1, [%r16+256];         // A[g+8][2t..]
	ld.shared.u32 %q2, [%r16+16];          // A[g][2t+8..]
	ld.shared.u32 %q3, [%r16+272];         // A[g+8][2t+8..]
	ld.shared.u32 %w0, [%r16+512];         // Bt[g][2t..]
	ld.shared.u32 %w1, [%r16+528];         // Bt[g][2t+8..]
	// V: b0 = V[2t][g], b1 = V[2t+1][g] (16-byte rows), b2/b3 = rows 2t+8, 2t+9
	shl.b32 %r17, %r13, 5;                 // row 2t = 32t bytes
	shl.b32 %r18, %r12, 1;                 // column g = 2g bytes
	add.s32 %r19, %r17, %r18;
	add.s32 %r19, %r19, 768;
	add.s32 %r19, %r2, %r19;
	ld.shared.b16 %h0, [%r19];
	ld.shared.b16 %h1, [%r19+16];
	ld.shared.b16 %h2, [%r19+128];
	ld.shared.b16 %h3, [%r19+144];
	mov.b32 %x0, {%h0, %h1};
	mov.b32 %x1, {%h2, %h3};
	mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32
		{%f9, %f10, %f11, %f12}, {%q0, %q1, %q2, %q3}, {%w0, %w1}, {%f0, %f0, %f0, %f0};
	mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32
		{%f13, %f14, %f15, %f16}, {%q0, %q1, %q2, %q3}, {%x0, %x1}, {%f0, %f0, %f0, %f0};
	mul.wide.u32 %rd5, %r1, 64;
	add.s64 %rd6, %rd2, %rd5;
	st.global.v4.f32 [%rd6], {%f1, %f2, %f3, %f4};
	st.global.v4.f32 [%rd6+16], {%f5, %f6, %f7, %f8};
	st.global.v4.f32 [%rd6+32], {%f9, %f10, %f11, %f12};
	st.global.v4.f32 [%rd6+48], {%f13, %f14, %f15, %f16};
	ret;
}
"""


def test_ldmatrix_fragments_feed_mma_like_plain_loads():
    a_bits, a = halves(RNG.standard_normal((16, 16)), "f16")
    bt_bits, bt = halves(RNG.standard_normal((8, 16)), "f16")
    v_bits, v = halves(RNG.standard_normal((16, 8)), "f16")
    src = np.concatenate([a_bits.reshape(-1), bt_bits.reshape(-1), v_bits.reshape(-1)])
    out = np.zeros((32, 4, 4), np.float32)
    run(LDM_MMA, "ldm_mma", (1,), (32,), [src, out])
    np.testing.assert_array_equal(out[:, 0].view(np.uint32), out[:, 2].view(np.uint32))
    np.testing.assert_array_equal(out[:, 1].view(np.uint32), out[:, 3].view(np.uint32))
    lane = np.arange(32)
    g, t = lane >> 2, lane & 3
    for frag, ref in ((out[:, 0], a @ bt.T), (out[:, 1], a @ v)):
        got = np.zeros((16, 8))
        for i in range(4):
            got[g + 8 * (i >> 1), 2 * t + (i & 1)] = frag[:, i]
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)


# ---- mma.m16n8k32 over 8-bit operands (sm_89+, PTX ISA 8.4) --------------------------------

MMA_K32 = ".version 8.4\n.target sm_89\n.address_size 64\n" + r"""
.visible .entry mma_k32(.param .u64 a_p, .param .u64 bt_p, .param .u64 c_p, .param .u64 d_p)
{
	.reg .b32 %r<16>;
	.reg .b32 %a<4>;
	.reg .b32 %b<2>;
	.reg .f32 %c<4>;
	.reg .f32 %d<4>;
	.reg .b64 %rd<16>;
""" + PROLOGUE + r"""
	// A (16x32 bytes row-major per warp): a0 = A[g][4t..4t+3], a1 = A[g+8][4t..],
	// a2 = A[g][16+4t..], a3 = A[g+8][16+4t..] (lowest k in the lowest byte)
	shl.b32 %r12, %r7, 2;
	mad.lo.s32 %r9, %r6, 32, %r12;
	mad.lo.s32 %r9, %r5, 512, %r9;
	cvt.u64.u32 %rd5, %r9;
	add.s64 %rd6, %rd1, %rd5;
	ld.global.u32 %a0, [%rd6];
	ld.global.u32 %a1, [%rd6+256];
	ld.global.u32 %a2, [%rd6+16];
	ld.global.u32 %a3, [%rd6+272];
	// B from B^T stored [n][k] (8x32 bytes): b0 = B[4t..4t+3][g], b1 = B[16+4t..][g]
	mad.lo.s32 %r10, %r6, 32, %r12;
	mad.lo.s32 %r10, %r5, 256, %r10;
	cvt.u64.u32 %rd7, %r10;
	add.s64 %rd8, %rd2, %rd7;
	ld.global.u32 %b0, [%rd8];
	ld.global.u32 %b1, [%rd8+16];
	mma.sync.aligned.m16n8k32.row.col.f32.AKIND.BKIND.f32
		{%d0, %d1, %d2, %d3}, {%a0, %a1, %a2, %a3}, {%b0, %b1}, {%c0, %c1, %c2, %c3};
	st.global.v2.f32 [%rd11], {%d0, %d1};
	st.global.v2.f32 [%rd11+256], {%d2, %d3};
	ret;
}
"""


@pytest.mark.parametrize("kinds", [("e4m3", "e4m3"), ("e5m2", "e5m2"), ("e4m3", "e5m2")])
def test_mma_k32_fp8_matches_numpy(kinds):
    """Each lane's bytes placed by the ISA's m16n8k32 fragment figures; the values decoded from
    the formats' fields (test_wgmma.fp8_values), summed as the FP8 tensor cores sum
    (fp8.accumulate), rounded once to f32."""
    from ptxc.emu.fp8 import accumulate
    from .test_wgmma import fp8_codes, fp8_values
    warps = 6
    a = fp8_codes((warps, 16, 32), kinds[0])
    bt = fp8_codes((warps, 8, 32), kinds[1])
    c = RNG.standard_normal((warps, 16, 8)).astype(np.float32)
    d = np.zeros_like(c)
    ptx = MMA_K32.replace("AKIND", kinds[0]).replace("BKIND", kinds[1])
    run(ptx, "mma_k32", (3,), (64,), [a, bt, c, d])
    want = accumulate(fp8_values(a, kinds[0])[:, :, None, :] * fp8_values(bt, kinds[1])[:, None, :, :],
                      c.astype(np.float64))
    np.testing.assert_array_equal(d, want.astype(np.float32))


@pytest.mark.parametrize("old, new", [(".f32.AKIND.BKIND.f32", ".f32.e4m3.e4m3.f16"),
                                      ("m16n8k32", "m16n8k16")])
def test_mma_k32_malformed_is_refused(old, new):
    """What ptxas refuses (ptxas_errors says so first), the emulator refuses too."""
    from ptxc.emu import launch
    from ptxc.errors import EmulationError
    from .helpers import PTXAS, ptxas_errors
    ptx = MMA_K32.replace(old, new).replace("AKIND", "e4m3").replace("BKIND", "e4m3")
    assert PTXAS is None or ptxas_errors(ptx) is not None
    z = np.zeros(6 * 512, np.uint8)
    with pytest.raises(EmulationError, match="m16n8k32"):
        launch(ptx, "mma_k32", (3,), (64,), [z, z, np.zeros(768, np.float32), np.zeros(768, np.float32)])
