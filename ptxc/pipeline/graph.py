"""The CUDA-graph contract of an artifact (metadata `graph`), derived from its launch lists and
interface only, so ptxc.pipeline.checked re-derives it like the preconditions.

Per target: which dims the grids depend on (block, dynamic shared memory and parameter bytes
are constants of the launch list), and the graph class in vLLM's terms. For the artifact: the
capture dims (every dim a shape or grid names: the caller fixes them at their maxima and pads a
smaller step, docs/loaders.md), the inputs whose values change per step (read on the device,
never parameters), and the workspaces (fully rewritten by the launch list before being read:
never zeroed by the caller)."""

from __future__ import annotations

from typing import Any

from . import exprs

# vLLM AttentionCGSupport: a family whose per-step values are all device tensors and whose
# absent work exits at once under padded maxima (tests/loaders/test_record_launches.py) replays for any
# batch (varlen, and mla - varlen's kernel: mixed prefill/decode), single-token decode for uniform decode batches; prefill
# grids are the step's own sequence lengths (no padding rule), so it is captured per shape only.
FAMILY_CLASS = {"varlen": "ALWAYS", "mla": "ALWAYS", "decode": "UNIFORM_SINGLE_TOKEN_DECODE",
                "kv_append": "UNIFORM_BATCH", "mla_append": "ALWAYS", "prefill": "NEVER",
                "merge_states": "ALWAYS"}   # rows past a step's tokens merge the padding, in bounds
# kv_append by slot_mapping: any mix of tokens, padded to the captured num_tokens with slot -1
SLOT_MAPPED_CLASS = "ALWAYS"


def _names(text) -> set[str]:
    return set(exprs.names(text)) if isinstance(text, str) else set()


def never_reason(family: str, target: dict) -> str:
    """Why a launch list's graph class is NEVER: the reason every loader's capture entry gives
    when it refuses (the class itself is graph_contract's)."""
    return f"a {family} grid is the step's own sequence lengths"


def graph_contract(family: str, tensors: dict, dims: list, dim_rules: dict, targets: dict) -> dict[str, Any]:
    rule_deps = {name: _names(rule["auto"]["ctas"]) for name, rule in (dim_rules or {}).items()
                 if "auto" in rule}
    per_target = {}
    for target, t in targets.items():
        grid_dims: set[str] = set()
        for k in t["kernels"]:
            for g in k["grid"]:
                grid_dims |= _names(g)
        for name in list(grid_dims):
            grid_dims |= rule_deps.get(name, set())
        per_target[target] = {
            "grid_depends_on": sorted(grid_dims & set(dims)),
            # tensor maps (sm_90a / sm_100a TMA) do not change the class: a map bakes in its
            # tensor's address, as a pointer parameter does, and its shape, whose dims are
            # capture dims (fixed at the maxima); the caches they map stay put between steps
            "class": SLOT_MAPPED_CLASS if "slot_mapping" in tensors else FAMILY_CLASS.get(family, "NEVER"),
        }
    capture = set()
    for info in tensors.values():
        for s in info["shape"]:
            capture |= _names(s)
    for t in per_target.values():
        capture |= set(t["grid_depends_on"])
    return {
        "capture_dims": sorted((capture & set(dims)) - set(rule_deps)),
        "per_step_inputs": sorted(n for n, i in tensors.items()
                                  if i["role"] == "input" and i["dtype"] in ("i32", "i64", "u64")),
        "workspaces_rewritten": sorted(n for n, i in tensors.items() if i["role"] == "workspace"),
        "targets": per_target,
    }


__all__ = ["graph_contract", "never_reason", "FAMILY_CLASS"]
