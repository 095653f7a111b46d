"""Kernel families: one module per family, registered here by name."""

from __future__ import annotations

from .base import Family
from .decode import FAMILY as _DECODE
from .kv_append import FAMILY as _KV_APPEND
from .mla import FAMILY as _MLA
from .mla_append import FAMILY as _MLA_APPEND
from .prefill import FAMILY as _PREFILL
from .varlen import FAMILY as _VARLEN

FAMILIES: dict[str, Family] = {f.name: f for f in (_DECODE, _PREFILL, _KV_APPEND, _VARLEN, _MLA, _MLA_APPEND)}

__all__ = ["FAMILIES", "Family"]
