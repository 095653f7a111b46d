"""The kernel families by name, and spec loading validated against them: spec.loader parses
and normalises, each entry checked by its family's rules (fields, implied values, derive,
validate) from this registry, which the spec layer is handed rather than importing."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from ..spec import KernelSpec, loader
from .base import Family
from .families.decode import FAMILY as _DECODE
from .families.kv_append import FAMILY as _KV_APPEND
from .families.merge_states import FAMILY as _MERGE_STATES
from .families.mla import FAMILY as _MLA
from .families.mla_append import FAMILY as _MLA_APPEND
from .families.prefill import FAMILY as _PREFILL
from .families.varlen import FAMILY as _VARLEN

FAMILIES: dict[str, Family] = {f.name: f for f in (_DECODE, _PREFILL, _KV_APPEND, _VARLEN, _MLA, _MLA_APPEND,
                                                   _MERGE_STATES)}


def load_text(data: bytes | str, filename: str = "<string>") -> list[KernelSpec]:
    """The kernels of one spec file's text (SpecError naming file, kernel and key)."""
    return loader.load_text(data, filename, families=FAMILIES)


def load_file(path: str | Path) -> list[KernelSpec]:
    return loader.load_file(path, families=FAMILIES)


def load_paths(paths: Iterable[str | Path]) -> list[KernelSpec]:
    """Every spec file named (directories: their *.toml, sorted); names unique overall."""
    return loader.load_paths(paths, families=FAMILIES)


def spec_from_record(data: Any, where: str = "<metadata>") -> KernelSpec:
    """The KernelSpec a recorded normalised spec stands for, by the rules a spec file passes."""
    return loader.spec_from_record(data, where, families=FAMILIES)
