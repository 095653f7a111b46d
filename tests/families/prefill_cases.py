"""Prefill test helpers shared by the prefill tests of every path: spec text, compilation
(cached), one emulator run with NaN-poisoned outputs and optional BHSD strides, the FA2-rule
check against fp64, the odd default shapes, a score pattern that forces the lazy rescale, and
the dtype x head_dim x heads x causal matrix the tensor-core paths share."""

import functools
import sys

import numpy as np
import pytest

from ptxc.kernels import FAMILIES, load_text
from ptxc.pipeline.compiler import lower
from ptxc.reference import from_device, max_abs_error, to_device, tolerance
from ptxc.runtime import EMU_NUM_SMS, POISON, apply_dim_rule, launch_geometry, pack_args
from ptxc.runtime.tensor_maps import emu_tensor_map

emu = pytest.importorskip("ptxc.emu", reason="the emulator is needed for numerical checks")
PREFILL = FAMILIES["prefill"]
HEADS = {"mha": (2, 2), "gqa4": (8, 2), "mqa": (4, 1), "gqa8": (8, 1)}   # (heads, kv heads)
SMALL_TILE = {"f32": {"block_m": 16, "block_n": 16},
              "f16": {"block_m": 32, "block_n": 16, "num_stages": 2},
              "bf16": {"block_m": 32, "block_n": 16, "num_stages": 2}}


def spec_text(dtype="f16", head_dim=64, heads="mha", causal=False, lse=True, tile=None,
              targets=("sm_80",)) -> str:
    h, hk = HEADS[heads]
    tile_text = "".join(f"{k} = {str(v).lower() if isinstance(v, bool) else repr(v)}\n"
                        for k, v in (tile or {}).items())
    return (f'[[kernel]]\nname = "p"\nfamily = "prefill"\ndtype = "{dtype}"\nhead_dim = {head_dim}\n'
            f"num_heads = {h}\nnum_kv_heads = {hk}\ncausal = {str(causal).lower()}\n"
            f"return_lse = {str(lse).lower()}\ntargets = {list(targets)!r}\n"
            + (f"[kernel.tile]\n{tile_text}" if tile else "")).replace("'", '"')


@functools.lru_cache(maxsize=None)
def compiled(text: str, target: str):
    [spec] = load_text(text)
    ptx, launches, config, _ = lower(spec, target)
    return spec, ptx, launches[0], config


def run_edited(text: str, target: str, edit, seq_q: int, seq_k: int, **kw):
    """`run` with the kernel's PTX rewritten by `edit` (a planted mistake the emulator must
    catch): `compiled` answers with the edited text until the run ends."""
    module = sys.modules[__name__]
    spec, ptx, launch, config = compiled(text, target)
    edited = edit(ptx)
    assert edited != ptx, "the edit changed nothing"
    saved = module.compiled
    module.compiled = lambda *_: (spec, edited, launch, config)
    try:
        return run(text, seq_q, seq_k, target=target, **kw)
    finally:
        module.compiled = saved


def run(text: str, seq_q: int, seq_k: int, *, batch: int = 2, target: str = "sm_80",
        layout: str = "bshd", seed: int = 0, transform=None, traffic: bool = False,
        ctas: int | None = None):
    """Run in the emulator; returns (outputs, launch stats, spec, inputs). `transform(spec,
    inputs)` may reshape the random inputs (kept representable in the dtype). `ctas`: a
    persistent kernel's grid (the persistent_ctas dim; default: its rule, as the runtime
    resolves it on the emulator)."""
    spec, ptx, kernel, _ = compiled(text, target)
    dims = {"batch": batch, "seq_q": seq_q, "seq_k": seq_k}
    if "persistent_ctas" in kernel["grid"]:
        rule = PREFILL.interface(spec).dim_rules["persistent_ctas"]
        dims["persistent_ctas"] = ctas or apply_dim_rule(rule, dims, EMU_NUM_SMS)
    inputs = PREFILL.make_inputs(spec, dims, np.random.default_rng(seed))
    if transform is not None:
        inputs = transform(spec, inputs)
    views, bases = {}, {}
    for t in PREFILL.interface(spec).tensors:
        if t.role == "input":
            arr = to_device(inputs[t.name], t.dtype)
        else:
            shape = [dims[s] if isinstance(s, str) else s for s in t.shape]
            arr = np.full(shape, POISON[t.dtype], dtype=type(POISON[t.dtype]))
        if layout == "bhsd" and t.name in "qkvo":   # head-major memory, passed through strides
            bases[t.name] = np.ascontiguousarray(arr.transpose(0, 2, 1, 3))
            views[t.name] = bases[t.name].transpose(0, 2, 1, 3)
        else:
            bases[t.name] = views[t.name] = arr
    tensor_maps = emu_tensor_map({"name": spec.name, "tensors": {
        t.name: {"dtype": t.dtype} for t in PREFILL.interface(spec).tensors}})
    args = pack_args(kernel, views, dims, pointer=lambda name, arr: bases[name],
                     tensor_map=tensor_maps)
    grid, block = launch_geometry(kernel, dims)
    stats = emu.launch(ptx, kernel["entry"], grid, block, args,
                       dynamic_smem_bytes=kernel["dynamic_smem_bytes"], traffic=traffic)
    outs = {t.name: from_device(views[t.name], t.dtype)
            for t in PREFILL.interface(spec).tensors if t.role == "output"}
    return outs, stats, spec, inputs


def check(text: str, shapes, **kw):
    for seq_q, seq_k in shapes:
        outs, _, spec, inputs = run(text, seq_q, seq_k, **kw)
        ref, naive = PREFILL.reference(spec, inputs), PREFILL.reference(spec, inputs, dtype=spec.dtype)
        assert sorted(outs) == sorted(ref)
        for name in ref:
            err, tol = max_abs_error(outs[name], ref[name]), tolerance(naive[name], ref[name])
            assert err <= tol, f"{name} at seq_q={seq_q}, seq_k={seq_k}: error {err:.3g} > {tol:.3g}"


SHAPES = [(1, 17), (17, 113), (113, 17)]


def growing_scores(spec, inputs):
    """Scores whose scale grows along the keys (k row j times 1 + j/4, q times 3): the running
    max keeps jumping by more than the lazy-rescale slack, and by less, from tile to tile."""
    from ptxc.reference import round_to
    j = np.arange(inputs["k"].shape[1])[None, :, None, None]
    return {**inputs, "q": round_to(inputs["q"] * 3, spec.dtype).astype(np.float32),
            "k": round_to(inputs["k"] * (1 + j / 4), spec.dtype).astype(np.float32)}


SLOW = pytest.mark.slow
# the matrix of the sm_90a kernels' tests (wgmma with cp.async, TMA): a default subset, the rest slow
TENSOR_CORE_MATRIX = [
    ("f16", 64, "gqa4", True), ("bf16", 128, "mqa", False), ("bf16", 64, "mha", False),
    ("f16", 128, "gqa4", True),
    *(pytest.param(dt, d, h, c, marks=SLOW) for dt in ("f16", "bf16") for d in (64, 128)
      for h in ("mha", "gqa4", "mqa") for c in (False, True)),
]
