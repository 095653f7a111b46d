"""ld/st widths and extensions, vectors, shared variables, dynamic shared memory, generic
addresses, and atomics."""

import numpy as np

from .helpers import HEADER, run


SUBWORD = HEADER + r"""
.visible .entry subword(.param .u64 in_p, .param .u64 out_p)
{
	.reg .b32 %r<6>;
	.reg .b64 %rd<6>;
	ld.param.u64 %rd1, [in_p];
	ld.param.u64 %rd2, [out_p];
	mov.u32 %r1, %tid.x;
	cvt.u64.u32 %rd3, %r1;
	add.s64 %rd4, %rd1, %rd3;
	ld.global.u8 %r2, [%rd4];               // zero-extended into a 32-bit register
	ld.global.s8 %r3, [%rd4];               // sign-extended
	add.u32 %r4, %r2, 0x100;
	st.global.u8 [%rd4+4], %r4;             // keeps the low byte
	mul.wide.u32 %rd5, %r1, 8;
	add.s64 %rd5, %rd2, %rd5;
	st.global.v2.u32 [%rd5], {%r2, %r3};
	ret;
}
"""


def test_sub_word_loads_extend_and_stores_truncate():
    a = np.array([0x7F, 0x80, 0xFF, 0x01, 0, 0, 0, 0], np.uint8)
    out = np.zeros((4, 2), np.uint32)
    run(SUBWORD, "subword", (1,), (4,), [a, out])
    assert out[:, 0].tolist() == [0x7F, 0x80, 0xFF, 0x01]
    assert out[:, 1].view(np.int32).tolist() == [127, -128, -1, 1]
    assert a[4:].tolist() == [0x7F, 0x80, 0xFF, 0x01]


VECTORS = HEADER + r"""
.visible .entry vectors(.param .u64 in_p, .param .u64 out_p)
{
	.reg .b32 %r<8>;
	.reg .b16 %h<4>;
	.reg .f64 %fd<4>;
	.reg .b64 %rd<8>;
	ld.param.u64 %rd1, [in_p];
	ld.param.u64 %rd2, [out_p];
	cvta.to.global.u64 %rd1, %rd1;
	cvta.to.global.u64 %rd2, %rd2;
	mov.u32 %r1, %tid.x;
	mul.wide.u32 %rd3, %r1, 32;
	add.s64 %rd4, %rd1, %rd3;
	add.s64 %rd5, %rd2, %rd3;
	ld.global.nc.v2.f64 {%fd1, %fd2}, [%rd4];
	ld.global.ca.v4.b16 {%h0, %h1, %h2, %h3}, [%rd4+16];
	ld.global.cg.v2.u32 {%r2, %r3}, [%rd4+24];
	st.global.cs.v2.f64 [%rd5], {%fd2, %fd1};
	st.global.v4.b16 [%rd5+16], {%h3, %h2, %h1, %h0};
	st.global.wb.v2.u32 [%rd5+24], {%r3, %r2};
	ld.u32 %r4, [%rd4+28];                  // generic addresses of global memory
	st.u32 [%rd5+1024], %r4;
	ret;
}
"""


def test_vector_loads_and_stores():
    src = np.arange(64 * 8, dtype=np.uint32).view(np.uint8)
    out = np.zeros_like(src)
    run(VECTORS, "vectors", (1,), (16,), [src, out])
    s = src.reshape(64, 32)[:16]
    o = out.reshape(64, 32)[:16]
    np.testing.assert_array_equal(o[:, :8], s[:, 8:16])
    np.testing.assert_array_equal(o[:, 8:16], s[:, :8])
    np.testing.assert_array_equal(o[:, 16:24].view(np.uint16), s[:, 16:24].view(np.uint16)[:, ::-1])
    np.testing.assert_array_equal(o[:, 24:32].view(np.uint32), s[:, 24:32].view(np.uint32)[:, ::-1])
    np.testing.assert_array_equal(out.reshape(64, 32)[32:48, :4].view(np.uint32)[:, 0],
                                  s[:, 28:32].view(np.uint32)[:, 0])


SHARED = HEADER + r"""
.extern .shared .align 16 .b8 dyn[];
// static shared variables then the dynamic region; generic addresses via cvta.shared
.visible .entry shared_vars(.param .u64 out_p)
{
	.reg .b32 %r<12>;
	.reg .b64 %rd<12>;
	.shared .align 4 .b8 small[12];
	.shared .align 16 .b8 big[64];
	ld.param.u64 %rd1, [out_p];
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, small;
	mov.u32 %r3, big;
	mov.u32 %r4, dyn;
	shl.b32 %r5, %r1, 2;
	add.s32 %r6, %r4, %r5;
	st.shared.u32 [%r6], %r1;               // dyn[tid] = tid
	add.u32 %r11, %r1, 1;
	bar.sync 0;                             // thread tid + 1 wrote dyn[tid + 1] just now
	st.shared.u32 [%r6+4], %r11;            // dyn[tid + 1] = tid + 1 (same value)
	bar.sync 0;
	mov.u64 %rd2, dyn;
	cvta.shared.u64 %rd3, %rd2;             // generic address of dyn
	mul.wide.u32 %rd4, %r1, 4;
	add.s64 %rd5, %rd3, %rd4;
	ld.u32 %r7, [%rd5+4];                   // generic load: dyn[tid + 1]
	add.u32 %r7, %r7, 1000;
	bar.sync 0;                             // thread tid - 1 has read dyn[tid]
	st.u32 [%rd5], %r7;                     // generic store
	cvta.to.shared.u64 %rd6, %rd5;
	cvt.u32.u64 %r8, %rd6;
	sub.u32 %r9, %r8, %r6;                  // 0 when cvta.to.shared undoes cvta.shared
	mul.wide.u32 %rd7, %r1, 32;
	add.s64 %rd8, %rd1, %rd7;
	st.global.v4.u32 [%rd8], {%r2, %r3, %r4, %r9};
	bar.sync 0;                             // thread 1 wrote dyn[1]
	ld.shared.u32 %r10, [dyn+4];
	st.global.v2.u32 [%rd8+16], {%r7, %r10};
	ret;
}
"""


def test_shared_layout_dynamic_region_and_generic_addressing():
    out = np.zeros((32, 8), np.uint32)
    run(SHARED, "shared_vars", (1,), (32,), [out], dynamic_smem_bytes=33 * 4)
    base = 0x400
    assert (out[:, 0] == base).all()                 # small at the start of the window
    assert (out[:, 1] == base + 16).all()            # big aligned to 16 after 12 bytes
    assert (out[:, 2] == base + 80).all()            # dynamic region after the static ones
    assert (out[:, 3] == 0).all()
    np.testing.assert_array_equal(out[:, 4], np.arange(1, 33) + 1000)


ATOMS = HEADER + r"""
.visible .entry atoms(.param .u64 cnt_p, .param .u64 old_p, .param .u64 fsum_p)
{
	.reg .pred %p<2>;
	.reg .b32 %r<12>;
	.reg .f32 %f<4>;
	.reg .b64 %rd<8>;
	.shared .align 4 .b8 acc[8];
	ld.param.u64 %rd1, [cnt_p];
	ld.param.u64 %rd2, [old_p];
	ld.param.u64 %rd3, [fsum_p];
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, acc;
	mov.u32 %r3, 0;
	setp.eq.u32 %p1, %r1, 0;
	@%p1 st.shared.v2.u32 [%r2], {%r3, %r3};
	bar.sync 0;
	atom.global.add.u32 %r4, [%rd1], 1;          // every thread: distinct old values
	atom.global.max.s32 %r5, [%rd1+4], %r1;
	atom.global.min.u32 %r6, [%rd1+8], %r1;
	atom.global.exch.b32 %r7, [%rd1+12], %r1;
	atom.global.cas.b32 %r8, [%rd1+16], %r1, 1000;   // only the thread whose id matches wins
	shl.b32 %r10, 1, %r1;
	red.global.or.b32 [%rd1+20], %r10;
	atom.global.and.b32 %r11, [%rd1+24], %r10;
	atom.global.xor.b32 %r11, [%rd1+28], %r10;
	cvt.rn.f32.u32 %f1, %r1;
	atom.shared.add.f32 %f2, [%r2], %f1;
	red.shared.add.u32 [%r2+4], %r1;
	red.global.add.f32 [%rd3], %f1;
	bar.sync 0;
	mul.wide.u32 %rd4, %r1, 4;
	add.s64 %rd5, %rd2, %rd4;
	st.global.u32 [%rd5], %r4;
	@%p1 ld.shared.f32 %f3, [%r2];
	@%p1 st.global.f32 [%rd3+4], %f3;
	@%p1 ld.shared.u32 %r9, [%r2+4];
	@%p1 st.global.u32 [%rd3+8], %r9;
	ret;
}
"""


def test_atomics_serialise_conflicting_threads():
    cnt = np.array([5, 0, 0xFFFFFFFF, 7, 3, 0, 0xFFFFFFFF, 0xF], np.uint32)
    old = np.zeros(64, np.uint32)
    fsum = np.zeros(3, np.float32)
    run(ATOMS, "atoms", (1,), (64,), [cnt, old, fsum])
    assert sorted(old.tolist()) == list(range(5, 69))
    assert cnt[:5].tolist() == [69, 63, 0, cnt[3], 1000]
    assert cnt[5:].tolist() == [0xFFFFFFFF, 0, 0xFFFFFFF0]     # or / and-not-any / xor of 1<<t
    assert 0 <= cnt[3] < 64
    assert fsum[0] == sum(range(64)) and fsum[1] == sum(range(64))
    assert fsum.view(np.uint32)[2] == sum(range(64))
