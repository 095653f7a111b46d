"""Variant lookup over a build directory: which artifact serves (family, dtype, kv dtype,
head_dim, heads, kv heads, causal, window, …)? A key names some fields ("family=decode,
dtype=f16,head_dim=128"); fields it leaves out match anything. No match is a loud error that
lists every built variant — never a silent fallback — and so is a key that matches several.

    art = ptxc.runtime.find_variant("out", family="decode", dtype="f16", head_dim=128, kv_layout="paged")

The generated C and Rust loaders carry the same table (`ptxc_find_variant`, `find_variant`)."""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError, UserError

# The spec fields that tell variants apart, in key order (absent ones are left out of a key).
VARIANT_KEYS = ("family", "dtype", "kv_dtype", "head_dim", "num_heads", "num_kv_heads", "causal",
                "window", "kv_layout", "page_size", "num_splits", "append_kv", "return_lse")


def value_text(value) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def variant_of(meta: dict) -> tuple[tuple[str, str], ...]:
    spec = {"family": meta["family"], **meta["spec"]}
    return tuple((k, value_text(spec[k])) for k in VARIANT_KEYS if k in spec and spec[k] is not None)


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
    unknown = [k for k, _ in items if k not in VARIANT_KEYS]
    if unknown:
        raise InputError(f"variant key: unknown field {unknown[0]!r}; fields are {', '.join(VARIANT_KEYS)}")
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
    from . import load
    out_dir = Path(out_dir)
    manifest = read_manifest_checked(out_dir)   # names checked before they become paths
    arts = {name: load(out_dir / name) for name in sorted(manifest["artifacts"])}
    name = match({n: variant_of(a.meta) for n, a in arts.items()}, key if key is not None else fields)
    return arts[name]
