"""Kernel families: one module per family, registered here by name."""

from __future__ import annotations

from .base import Family
from .decode import FAMILY as _DECODE

FAMILIES: dict[str, Family] = {f.name: f for f in (_DECODE,)}

__all__ = ["FAMILIES", "Family"]
