"""The dims no tensor shape determines (metadata `dim_rules`): a fixed value, or an "auto" rule
evaluated the same way here and in the generated C and Rust loaders (docs/metadata.md)."""

from __future__ import annotations

from . import exprs


AUTO_RULE_NAMES = ("max", "ctas", "num_sms", "ctas_per_sm")   # what an "auto" rule may name


def apply_dim_rule(rule: dict, dims: dict[str, int], num_sms: int, ctas_per_sm: int = 1) -> int:
    """A dim the shapes do not determine: a fixed value, or an "auto" rule: the launch
    expression `rule` over max, ctas (the `ctas` expression at these dims, at least 1), num_sms
    and ctas_per_sm (rule_ctas_per_sm), clamped to [1, max]. The C and Rust loaders evaluate
    the same expression."""
    if "value" in rule:
        return int(rule["value"])
    auto = rule["auto"]
    env = {"max": int(auto["max"]), "ctas": max(1, exprs.evaluate(auto["ctas"], dims)),
           "num_sms": max(1, int(num_sms)), "ctas_per_sm": max(1, int(ctas_per_sm))}
    return int(min(auto["max"], max(1, exprs.evaluate(auto["rule"], env))))


def sm_number(target: str) -> int:
    """"sm_90a" -> 90."""
    return int("".join(c for c in target[3:] if c.isdigit()))


def rule_ctas_per_sm(meta: dict, rule: dict, target: str | None = None) -> int:
    """CTAs per SM of the launch an "auto" rule names (`occupancy_of`) on `target` (default:
    the oldest, the one Artifact.target picks), from the ptxas occupancy in the metadata;
    1 when the rule names none or the build was not verified (no occupancy recorded)."""
    entry = (rule.get("auto") or {}).get("occupancy_of")
    targets = meta.get("targets") or {}
    if entry is None or not targets:
        return 1
    if target is None or target not in targets:
        target = min(targets, key=lambda t: (sm_number(t), t))
    for k in targets[target]["kernels"]:
        if k["entry"] == entry and "occupancy" in k:
            return max(1, int(k["occupancy"]["ctas_per_sm"]))
    return 1
