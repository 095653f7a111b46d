"""The artifact set the loader end-to-end tests build, and the checks they share (C and Rust)."""

import json

import numpy as np
import pytest

from stubcuda import harness

from ptxc.errors import InputError
from ptxc.kernels import FAMILIES
from ptxc.pipeline.build import run_build
from ptxc.runtime import launch_geometry, load, prepare_buffers
from ptxc.runtime.dispatch import match, variant_of
from ptxc.reference import from_device, max_abs_error, tolerance
from ptxc.spec.model import KernelSpec

TARGETS = ("sm_80", "sm_90")
STUB_SMS = 6  # few SMs, so num_splits = "auto" picks several splits for a small batch

SPECS = '''
[defaults]
targets = ["sm_80", "sm_90"]
head_dim = 64
num_heads = 4
num_kv_heads = 2

[[kernel]]
name = "e2e_prefill"
family = "prefill"
dtype = "f16"
causal = true

[[kernel]]
name = "e2e_prefill_mask"
family = "prefill"
dtype = "bf16"
causal = false
custom_mask = "packed"
return_lse = true

[[kernel]]
name = "e2e_paged_split"
family = "decode"
dtype = "bf16"
kv_layout = "paged"
page_size = 16
num_splits = "auto"
return_lse = true

[[kernel]]
name = "e2e_ptr_decode"
family = "decode"
dtype = "bf16"
kv_layout = "pointer_array"

[[kernel]]
name = "e2e_paged_fused"
family = "decode"
dtype = "f16"
kv_layout = "paged"
page_size = 16
num_splits = "auto"
append_kv = true

[[kernel]]
name = "e2e_varlen"
family = "varlen"
dtype = "f16"
kv_layout = "paged"
page_size = 16
num_splits = "auto"
return_lse = true

[[kernel]]
name = "e2e_varlen_tree"
family = "varlen"
dtype = "bf16"
kv_layout = "paged"
page_size = 16
custom_mask = "tree"
return_lse = true

[[kernel]]
name = "e2e_mla"
family = "mla"
dtype = "bf16"
num_heads = 16
num_kv_heads = 1
kv_lora_rank = 128
qk_rope_head_dim = 16
head_dim = 144
softmax_scale = 0.125
page_size = 16
kv_dtype = "e4m3"
kv_scale = "device"

[[kernel]]
name = "e2e_mla_ds"
family = "mla"
dtype = "bf16"
num_heads = 16
num_kv_heads = 1
head_dim = 576
softmax_scale = 0.125
page_size = 16
kv_dtype = "e4m3_ds"
sparse_topk = 24
topk_length = true

[[kernel]]
name = "e2e_merge"
family = "merge_states"
dtype = "bf16"
return_lse = true
'''

# One entry per family case: artifact name and small odd shapes. A new family is one more
# kernel in SPECS and one more entry here.
CASES = {
    "e2e_prefill": {"batch": 1, "seq_q": 17, "seq_k": 33},
    "e2e_prefill_mask": {"batch": 2, "seq_q": 17, "seq_k": 33},
    "e2e_paged_split": {"batch": 2, "max_pages_per_seq": 3, "num_pages": 7},
    "e2e_paged_fused": {"batch": 2, "max_pages_per_seq": 3, "num_pages": 7},
    "e2e_ptr_decode": {"batch": 3, "max_seq_len": 37},
    "e2e_varlen": {"batch": 3, "max_pages_per_seq": 3, "num_pages": 9},
    "e2e_varlen_tree": {"batch": 11, "max_pages_per_seq": 3, "num_pages": 35},
    "e2e_mla": {"batch": 9, "max_pages_per_seq": 5, "num_pages": 50},
    "e2e_mla_ds": {"total_q": 5, "num_pages": 4},
    "e2e_merge": {"num_tokens": 13},
}


def build_set(tmp_path_factory, emit, what: str, fatbin: bool = False):
    """Build SPECS (with cubins), emit a loader with `emit(out)`, compile the stub libcuda."""
    missing = harness.toolchain_missing()
    if missing:
        pytest.skip(missing)
    root = tmp_path_factory.mktemp(f"loader_{what}")
    (root / "e2e.toml").write_text(SPECS)
    out = root / "out"
    with pytest.MonkeyPatch.context() as mp:  # the ptxas the tests themselves see (conftest drops PTXAS)
        mp.delenv("PTXAS", raising=False)
        run_build([root / "e2e.toml"], out, verify=True, progress=False, fatbin=fatbin)
    return out, emit(out), harness.build_stub(root / "stub")


def device_target(art, sm: int) -> str | None:
    """The target a loader picks on an sm_<sm> device: the newest one it can run (None: none)."""
    number = lambda t: int(t[3:].rstrip("a"))
    return max((t for t in art.meta["targets"] if number(t) <= sm), key=number, default=None)


def prepare(art, shapes, sm: int, seed=0):
    """Inputs and the dims the loader must resolve on an sm_<sm> device ("auto" num_splits
    follows the occupancy of the target it runs, which differs per target)."""
    spec = KernelSpec.from_dict(art.meta["spec"])
    family = FAMILIES[spec.family]
    dims = {**family.interface(spec).defaults, **shapes}
    inputs = family.make_inputs(spec, dims, np.random.default_rng(seed))
    full = art.infer_dims(inputs, num_sms=STUB_SMS, target=device_target(art, sm))
    buffers = prepare_buffers(art.meta, inputs, full)
    return (spec, family, inputs, full, buffers)


def next_step(inputs: dict) -> dict:
    """A second engine step under the same capture maxima (the same shapes): the sequences of a
    ragged batch rotated (query rows, lengths and block-table rows move together, so total_q
    and every page's owner are kept), or, for decode, every other sequence absent (seq_len 0,
    append position -1); merge_states' tokens rotated."""
    step = {k: np.array(v, copy=True) for k, v in inputs.items()}
    if "lse_a" in step:   # merge_states: other states in the same buffers (tokens rotated)
        return {k: np.roll(v, 1, axis=0) for k, v in step.items()}
    if "cu_seqlens_q" in step:
        q_lens = np.roll(np.diff(step["cu_seqlens_q"]), 1)
        step["cu_seqlens_q"] = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        for name in ("seq_lens", "block_table"):
            if name in step:
                step[name] = np.roll(step[name], 1, axis=0)
    else:
        step["seq_lens"][1::2] = 0
        if "positions" in step:
            step["positions"][1::2] = -1
    return step


def another_step(art, prepared, sm: int):
    """prepare()'s tuple for next_step of its inputs, at the same dims."""
    spec, family, inputs, dims, _ = prepared
    step = next_step(inputs)
    full = art.infer_dims(step, num_sms=STUB_SMS, target=device_target(art, sm))
    assert full == dims, "a step under the same maxima has the same dims"
    return (spec, family, step, full, prepare_buffers(art.meta, step, full))


def input_blob(art, buffers) -> bytes:
    return b"".join(buffers[n].tobytes() for n, t in art.meta["tensors"].items() if t["role"] != "workspace")


def shape_dims(art, dims) -> dict:
    return {d: dims[d] for d in art.meta["dims"] if d not in art.meta["dim_rules"]}


def check_end_to_end(art, prepared, result, log, target: str, image_kind: str, image: bytes) -> None:
    """What a correct loader run looks like in the stub's log, and the replayed outputs."""
    spec, family, inputs, dims, buffers = prepared
    t = art.meta["targets"][target]
    assert result["load"] == (0, TARGETS.index(target), image_kind, "")
    assert result["run"] == (0, "")
    assert result["dims"] == dims
    # the device's image, loaded once; the smem opt-in set once per function that needs it
    assert log.modules == [(image_kind, image)]
    entries = {fid: entry for fid, (_, entry) in log.functions.items()}
    assert sorted(entries.values()) == sorted(k["entry"] for k in t["kernels"])
    want_attrs = sorted((k["entry"], k["dynamic_smem_bytes"]) for k in t["kernels"] if k["needs_smem_opt_in"])
    assert sorted((entries[f], v) for f, a, v in log.attributes) == want_attrs
    # this target's launch list with this target's geometry and shared memory
    assert [launch.entry for launch in log.launches] == [k["entry"] for k in t["kernels"]]
    for launch, k in zip(log.launches, t["kernels"]):
        grid, block = launch_geometry(k, dims)
        assert (launch.grid, launch.block, launch.smem) == (grid, block, k["dynamic_smem_bytes"])
    memory = harness.replay(log, art.meta, target, art.ptx(target), result["tensors"])
    ref = family.reference(spec, inputs)
    naive = family.reference(spec, inputs, dtype=spec.dtype)
    for tensor in sorted(ref):
        raw = harness.read_tensor(memory, *result["tensors"][tensor])
        got = from_device(raw.view(buffers[tensor].dtype).reshape(buffers[tensor].shape),
                          art.meta["tensors"][tensor]["dtype"])
        err, tol = max_abs_error(got, ref[tensor]), tolerance(naive[tensor], ref[tensor])
        assert err <= tol, f"{art.name} [{target}] {tensor}: max error {err:.3e} > {tol:.3e}"


# keys the C and Rust lookups must answer as ptxc.runtime.find_variant does (its exact words)
VARIANT_KEYS = ["famly=decode", "family=decode,heads=4", "family=decode,dtype", " family = decode , dtype = f16 ,,",
                "family=decode,head_dim=128", "family=decode", "family=decode, append_kv=true,dtype=f16", ""]


def python_variant(out, key: str) -> str:
    """The artifact ptxc.runtime's lookup picks for `key` over build `out`, or its error line."""
    names = json.loads((out / "manifest.json").read_text())["artifacts"]
    try:
        return match({n: variant_of(load(out / n).meta) for n in names}, key)
    except InputError as e:
        return str(e)
