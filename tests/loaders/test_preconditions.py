"""Preconditions in the metadata (alignment, strides) and their check in ptxc.runtime."""

import pytest

from conftest import build_kernel
from ptxc.errors import InputError
from ptxc.pipeline.metadata import schema_errors
from ptxc.runtime.preconditions import check_tensor


@pytest.fixture(scope="module")
def paged(tmp_path_factory):
    return build_kernel(tmp_path_factory.mktemp("pre"), "decode",
                        'dtype = "f16"\nhead_dim = 64\nnum_heads = 4\nnum_kv_heads = 2\nkv_layout = "paged"\n'
                        'page_size = 16\nnum_splits = 2\nreturn_lse = true')


def test_metadata_records_what_the_kernels_rely_on(paged):
    t = paged.meta["tensors"]
    assert schema_errors(paged.meta) == []
    # rows of 64 halves move as 16-byte vectors; strides of axes 0-2 are kernel parameters
    assert t["k_cache"]["preconditions"] == {"align_bytes": 16, "stride_multiple": 8, "strided_axes": [0, 1, 2]}
    assert t["q"]["preconditions"] == {"align_bytes": 16, "stride_multiple": 8, "strided_axes": [0, 1]}
    # int32 tables: natural alignment; block_table rows may be strided, seq_lens is packed
    assert t["block_table"]["preconditions"] == {"align_bytes": 4, "stride_multiple": 1, "strided_axes": [0]}
    assert t["seq_lens"]["preconditions"] == {"align_bytes": 4, "stride_multiple": 1, "strided_axes": []}
    # workspaces are reached without strides: fully packed
    assert t["lse_part"]["preconditions"]["strided_axes"] == []


def test_runtime_rejects_misaligned_pointer_and_bad_strides(paged):
    meta = paged.meta
    shape = [7, 16, 2, 64]
    check_tensor(meta, "k_cache", 0x1000, [16 * 2 * 64, 2 * 64, 64, 1], shape)        # packed: fine
    check_tensor(meta, "k_cache", 0x1000, [4096, 256, 128, 1], shape)                 # padded rows: fine
    with pytest.raises(InputError, match=r"^k: tensor k_cache: address 0x1004 is not 16-byte aligned"):
        check_tensor(meta, "k_cache", 0x1004, [2048, 128, 64, 1], shape)
    with pytest.raises(InputError, match=r"stride 65 along axis 2 is not a multiple of 8 elements"):
        check_tensor(meta, "k_cache", 0x1000, [8192, 136, 65, 1], shape)
    with pytest.raises(InputError, match=r"stride 2 along axis 3 must be 1 \(packed"):
        check_tensor(meta, "k_cache", 0x1000, [4096, 256, 128, 2], shape)


def test_emu_run_checks_preconditions(paged):
    import numpy as np
    from ptxc.kernels import FAMILIES
    from ptxc.spec.model import KernelSpec
    spec = KernelSpec.from_dict(paged.meta["spec"])
    family = FAMILIES[spec.family]
    inputs = family.make_inputs(spec, {**family.interface(spec).defaults, "batch": 1}, np.random.default_rng(0))
    out = paged.run(inputs)  # host arrays are packed and aligned: runs
    assert np.isfinite(out["o"]).all()
