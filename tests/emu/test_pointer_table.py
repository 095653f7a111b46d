"""PointerTable: a .u64 buffer of device pointers into arrays that are not parameters."""

import numpy as np
import pytest

from ptxc.emu import EmulationError, PointerTable, launch
from ptxc.errors import InputError

# out[tid] = *(float *)(table[tid / 2] + 4 * (tid % 2))
PTX = """
.version 7.1
.target sm_80
.address_size 64
.visible .entry gather(.param .u64 table, .param .u64 out)
{
	.reg .b32 %r<6>;
	.reg .b64 %rd<12>;
	.reg .f32 %f<2>;
	ld.param.u64 %rd1, [table];
	ld.param.u64 %rd2, [out];
	mov.u32 %r1, %tid.x;
	shr.u32 %r2, %r1, 1;
	and.b32 %r3, %r1, 1;
	mul.wide.u32 %rd3, %r2, 8;
	add.s64 %rd4, %rd1, %rd3;
	ld.global.u64 %rd5, [%rd4];
	mul.wide.u32 %rd6, %r3, 4;
	add.s64 %rd7, %rd5, %rd6;
	ld.global.f32 %f1, [%rd7];
	mul.wide.u32 %rd8, %r1, 4;
	add.s64 %rd9, %rd2, %rd8;
	st.global.f32 [%rd9], %f1;
	ret;
}
"""


def test_entries_point_into_target_arrays():
    a = np.arange(8, dtype=np.float32)
    b = np.arange(100, 104, dtype=np.float32)
    out = np.zeros(6, np.float32)
    launch(PTX, "gather", (1,), (6,), [PointerTable(((a, 0), (b, 8), (a, 16))), out])
    assert out.tolist() == [0, 1, 102, 103, 4, 5]


def test_reading_past_a_target_is_caught():
    a = np.arange(3, dtype=np.float32)
    with pytest.raises(EmulationError, match="out-of-bounds"):
        launch(PTX, "gather", (1,), (2,), [PointerTable(((a, 8),)), np.zeros(2, np.float32)])


def test_bad_entries_are_input_errors():
    with pytest.raises(InputError, match="byte offset"):
        PointerTable(((np.zeros(2, np.float32), 64),))
