"""LaunchStats.traffic on small kernels with known answers: coalesced vs strided global loads,
bytes per buffer, conflict-free vs conflicted shared-memory patterns (ld/st.shared, ldmatrix,
cp.async)."""

import numpy as np
import pytest

from ptxc.emu import launch

from .helpers import HEADER, line_of, run

STRIDED_COPY = HEADER + r"""
// out[t] = src[t * STRIDE]: one 4-byte load per thread, STRIDE elements apart
.visible .entry strided(.param .u64 src_p, .param .u64 out_p)
{
	.reg .b32 %r<4>;
	.reg .b64 %rd<8>;
	.reg .f32 %f<2>;
	ld.param.u64 %rd1, [src_p];
	ld.param.u64 %rd2, [out_p];
	mov.u32 %r1, %tid.x;
	mul.lo.u32 %r2, %r1, STRIDE;
	mul.wide.u32 %rd3, %r2, 4;
	add.s64 %rd4, %rd1, %rd3;
	ld.global.f32 %f1, [%rd4];
	mul.wide.u32 %rd5, %r1, 4;
	add.s64 %rd6, %rd2, %rd5;
	st.global.f32 [%rd6], %f1;
	ret;
}
"""


@pytest.mark.parametrize("stride, sectors_per_request", [(1, 4), (2, 8), (8, 32), (0, 1)])
def test_coalesced_and_strided_global_loads(stride, sectors_per_request):
    ptx = STRIDED_COPY.replace("STRIDE", str(stride))
    src = np.arange(32 * max(stride, 1) * 2, dtype=np.float32)
    out = np.zeros(64, np.float32)
    stats = run(ptx, "strided", (1,), (64,), [src, out], traffic=True)
    tr = stats.traffic
    [load] = tr.line(line_of(ptx, "ld.global.f32"))
    assert (load.kind, load.requests, load.bytes) == ("load", 2, 64 * 4)
    assert load.sectors == 2 * sectors_per_request
    assert load.ideal_sectors == 2 * (4 if stride else 1)
    assert load.coalesced == (stride in (0, 1))
    [store] = tr.line(line_of(ptx, "st.global.f32"))
    assert (store.sectors, store.ideal_sectors) == (8, 8)
    assert tr.bytes_read == {"src_p": 256} and tr.bytes_written == {"out_p": 256}


def test_traffic_is_off_by_default():
    ptx = STRIDED_COPY.replace("STRIDE", "1")
    stats = run(ptx, "strided", (1,), (32,), [np.zeros(32, np.float32), np.zeros(32, np.float32)])
    assert stats.traffic is None


SMEM = HEADER + r"""
// Thread t stores 4 bytes at sm + t * STRIDE * 4, then (after a barrier) loads them back.
.visible .entry smem(.param .u64 out_p)
{
	.reg .b32 %r<8>;
	.reg .b64 %rd<4>;
	.shared .align 16 .b8 sm[16384];
	ld.param.u64 %rd1, [out_p];
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, sm;
	mul.lo.u32 %r3, %r1, STRIDE;
	shl.b32 %r3, %r3, 2;
	add.s32 %r4, %r2, %r3;
	st.shared.u32 [%r4], %r1;
	bar.sync 0;
	ld.shared.u32 %r5, [%r4];
	mul.wide.u32 %rd2, %r1, 4;
	add.s64 %rd3, %rd1, %rd2;
	st.global.u32 [%rd3], %r5;
	ret;
}
"""


@pytest.mark.parametrize("stride, ways", [(1, 1), (2, 2), (32, 32), (33, 1), (4, 4)])
def test_shared_bank_conflicts_by_stride(stride, ways):
    ptx = SMEM.replace("STRIDE", str(stride))
    out = np.zeros(64, np.uint32)
    tr = run(ptx, "smem", (1,), (64,), [out], traffic=True).traffic
    np.testing.assert_array_equal(out, np.arange(64))
    for text, kind in (("st.shared.u32", "st.shared"), ("ld.shared.u32", "ld.shared")):
        [acc] = tr.line(line_of(ptx, text))
        assert (acc.kind, acc.requests, acc.ideal_wavefronts) == (kind, 2, 2)
        assert acc.wavefronts == 2 * ways and acc.bank_conflicts == 2 * (ways - 1)


BROADCAST = SMEM.replace("mul.lo.u32 %r3, %r1, STRIDE;", "mov.u32 %r3, 0;") \
    .replace("st.shared.u32 [%r4], %r1;", "@%p1 st.shared.u32 [%r4], %r1;") \
    .replace("mov.u32 %r1, %tid.x;", "mov.u32 %r1, %tid.x;\n\tsetp.eq.u32 %p1, %r1, 0;") \
    .replace(".reg .b32 %r<8>;", ".reg .b32 %r<8>;\n\t.reg .pred %p<2>;")


def test_a_broadcast_read_is_conflict_free():
    out = np.zeros(32, np.uint32)
    tr = run(BROADCAST, "smem", (1,), (32,), [out], traffic=True).traffic
    [acc] = tr.line(line_of(BROADCAST, "ld.shared.u32"))
    assert (acc.wavefronts, acc.bank_conflicts) == (1, 0)


LDMATRIX = HEADER + r"""
// Each lane i < 32 writes 16-byte row i at sm + i * PITCH (PITCH bytes apart), then the warp
// loads the four 8x8 matrices with ldmatrix.x4.
.visible .entry ldm(.param .u64 out_p)
{
	.reg .b32 %r<12>;
	.reg .b64 %rd<4>;
	.shared .align 16 .b8 sm[8192];
	ld.param.u64 %rd1, [out_p];
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, sm;
	mul.lo.u32 %r3, %r1, PITCH;
	add.s32 %r4, %r2, %r3;
	st.shared.v4.u32 [%r4], {%r1, %r1, %r1, %r1};
	bar.sync 0;
	ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r5, %r6, %r7, %r8}, [%r4];
	mul.wide.u32 %rd2, %r1, 4;
	add.s64 %rd3, %rd1, %rd2;
	st.global.u32 [%rd3], %r5;
	ret;
}
"""


@pytest.mark.parametrize("pitch, wavefronts", [(16, 4), (128, 32), (144, 4)])
def test_ldmatrix_rows_padded_to_avoid_conflicts(pitch, wavefronts):
    ptx = LDMATRIX.replace("PITCH", str(pitch))
    tr = run(ptx, "ldm", (1,), (32,), [np.zeros(32, np.uint32)], traffic=True).traffic
    [acc] = tr.line(line_of(ptx, "ldmatrix.sync"))
    assert (acc.kind, acc.requests, acc.ideal_wavefronts) == ("ldmatrix", 1, 4)
    assert acc.wavefronts == wavefronts
    [st] = tr.line(line_of(ptx, "st.shared.v4"))      # 16-byte stores: 4 phases of 8 lanes
    assert st.ideal_wavefronts == 4 and st.wavefronts == wavefronts


CP_ASYNC = HEADER + r"""
.visible .entry cpa(.param .u64 src_p)
{
	.reg .b32 %r<8>;
	.reg .b64 %rd<4>;
	.shared .align 16 .b8 sm[8192];
	ld.param.u64 %rd1, [src_p];
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, sm;
	mul.lo.u32 %r3, %r1, PITCH;
	add.s32 %r4, %r2, %r3;
	mul.wide.u32 %rd2, %r1, 16;
	add.s64 %rd3, %rd1, %rd2;
	cp.async.cg.shared.global [%r4], [%rd3], 16;
	cp.async.wait_all;
	ret;
}
"""


def test_cp_async_counts_global_sectors_and_shared_wavefronts():
    for pitch, wavefronts in ((16, 4), (256, 32)):
        ptx = CP_ASYNC.replace("PITCH", str(pitch))
        src = np.zeros(32 * 4, np.uint32)
        tr = run(ptx, "cpa", (1,), (32,), [src], traffic=True).traffic
        [g] = [a for a in tr.global_accesses if a.kind == "cp.async"]
        assert (g.requests, g.sectors, g.ideal_sectors, g.bytes) == (1, 16, 16, 512)
        [s] = tr.shared_accesses
        assert (s.kind, s.wavefronts, s.ideal_wavefronts) == ("cp.async", wavefronts, 4)
        assert tr.bytes_read == {"src_p": 512}


def test_ptxc_decode_reads_each_kv_row_once_per_kv_head_fully_coalesced():
    from .test_bench import load_bench
    ptx, entry, grid, block, args, smem = load_bench().real_decode_launch(2, 33)
    tr = launch(ptx, entry, grid, block, args, dynamic_smem_bytes=smem, traffic=True).traffic
    # GQA 32/8: every K/V row of the 8 KV heads is read exactly once, not once per query head
    assert tr.bytes_read["k_cache"] == 2 * 8 * 33 * 128 * 2
    assert tr.bytes_read["v_cache"] == tr.bytes_read["k_cache"]
    reads = [a for a in tr.global_accesses if a.kind != "store"]      # loads and cp.async
    assert all(a.coalesced for a in reads), \
        [(a.line, a.sectors, a.ideal_sectors) for a in reads if not a.coalesced]
    # GQA 4 takes the tensor-core path, whose epilogue stores o straight from the mma
    # accumulators: 16 contiguous bytes per head row and instruction, so at most twice the ideal
    # sectors (o is 4 rows x 256 B per CTA against 33 x 512 B of K/V)
    stores = [a for a in tr.global_accesses if a.kind == "store"]
    assert stores and sum(a.sectors for a in stores) <= 2 * sum(a.ideal_sectors for a in stores)
