"""ptxc.runtime: load an artifact and run its launch list on given arrays.

    art = ptxc.runtime.load("out/llama3_8b_decode")
    outputs = art.run({"q": q, "k_cache": k, "v_cache": v, "seq_lens": lens}, backend="emu")

Used by `ptxc run`, `ptxc launch-test` and the test suite; the cuda backend (ptxc.runtime.cuda)
is the same code path with device pointers instead of host arrays. Host arrays: f32/f16 as
numpy float32/float16 (bf16 as float32, rounded on the way in), i32 as int32, FP8 (e4m3, e5m2)
as uint8 arrays of the raw bytes. Runtime scalars (metadata `scalars`, e.g. k_scale) are given
among the inputs as 0-d float32 arrays, or as --set name=value.
"""
from __future__ import annotations

from .abi import *  # noqa: F401,F403  (the launch ABI: infer_dims, prepare_buffers, pack_args, ...)
from .abi import (AUTO_RULE_NAMES, DEFAULT_MAX_RUN_BYTES, DIM_MAX, EMU_NUM_SMS, GRID_MAX,  # noqa: F401
                  HOST_DTYPES, INT_RANGE, NP_PARAM, PARAM_RANGE, POISON, _dim_sets)
from .artifact import Artifact, _emu_launcher, load  # noqa: F401
from .dispatch import find_variant  # noqa: F401  (ptxc.runtime.find_variant)
