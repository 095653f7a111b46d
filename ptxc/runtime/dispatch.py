"""Variant lookup over a build directory: which artifact serves (family, dtype, head_dim,
kv_dtype, causal, sliding_window, logits_soft_cap, …)? A key names some fields ("family=decode,
dtype=f16,head_dim=128"); fields it leaves out match anything. No match is a loud error that
lists every built variant — never a silent fallback — and so is a key that matches several.

Every spec field that changes what a kernel computes is part of its variant, under the spec's
own name: the fields are read from the spec field tables (the common fields and every family's
top-level fields), so a field added later is picked up. Only `name` and `targets` (which GPUs,
not what is computed) and the `[kernel.tile]` fields (how, not what) are left out. A field the
kernel's spec leaves unset reads `none` (`sliding_window=none` is a global-attention kernel);
fields its family does not have are absent from its key.

    art = ptxc.runtime.find_variant("out", family="decode", dtype="f16", head_dim=128, kv_layout="paged")
    art = ptxc.runtime.find_variant("out", "family=prefill,head_dim=256,sliding_window=none")

The generated C and Rust loaders carry the same table and field list (`ptxc_<prefix>_find_variant`,
`find_variant`) and answer every key with the same words as `match`."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from ..errors import InputError

NOT_SEMANTIC = ("name", "targets")   # the artifact's name and the GPUs it is built for
LEADING = ("family", "dtype", "head_dim")   # first in a key, for readability


@lru_cache(maxsize=1)
def variant_keys() -> tuple[str, ...]:
    """Every spec field that tells variants apart, in key order: from the field tables."""
    from ..kernels import FAMILIES
    from ..spec.loader import COMMON_FIELDS
    names = list(LEADING)
    for f in COMMON_FIELDS + tuple(f for fam in sorted(FAMILIES) for f in FAMILIES[fam].fields.fields):
        if f.name not in names and f.name not in NOT_SEMANTIC:
            names.append(f.name)
    return tuple(names)


def value_text(value) -> str:
    if value is None:
        return "none"
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def variant_of(meta: dict) -> tuple[tuple[str, str], ...]:
    spec = {"family": meta["family"], **meta["spec"]}
    return tuple((k, value_text(spec[k])) for k in variant_keys() if k in spec)


def key_text(variant) -> str:
    return ",".join(f"{k}={v}" for k, v in variant)


def parse_key(key: str | dict) -> tuple[tuple[str, str], ...]:
    if isinstance(key, dict):
        items = [(k, value_text(v)) for k, v in key.items()]
    else:
        items = []
        for part in filter(None, (p.strip() for p in key.split(","))):
            name, sep, value = part.partition("=")
            if not sep:
                raise InputError(f"variant key {key!r}: {part!r} is not field=value")
            items.append((name.strip(), value.strip()))
    unknown = [k for k, _ in items if k not in variant_keys()]
    if unknown:
        raise InputError(f"variant key: unknown field {unknown[0]!r}; fields are {', '.join(variant_keys())}")
    return tuple(items)


def match(variants: dict[str, tuple], key) -> str:
    """The one artifact name whose variant has every field of `key`; else InputError."""
    wanted = parse_key(key)
    hits = [name for name, v in sorted(variants.items()) if set(wanted) <= set(v)]
    built = "; ".join(f"{name}: {key_text(v)}" for name, v in sorted(variants.items())) or "none"
    if not hits:
        raise InputError(f"not built: {key_text(wanted)}; built variants are {built}")
    if len(hits) > 1:
        raise InputError(f"ambiguous variant {key_text(wanted)}: matches {', '.join(hits)}; "
                         f"name more fields ({built})")
    return hits[0]


def find_variant(out_dir: str | Path, key: str | dict | None = None, **fields):
    """The Artifact of a `ptxc build` output directory that serves `key` (or the keyword fields)."""
    from ..pipeline.checked import read_manifest_checked
    from .artifact import load
    out_dir = Path(out_dir)
    manifest = read_manifest_checked(out_dir)   # names checked before they become paths
    arts = {name: load(out_dir / name) for name in sorted(manifest["artifacts"])}
    name = match({n: variant_of(a.meta) for n, a in arts.items()}, key if key is not None else fields)
    return arts[name]
