"""Kernel families: one module per family, registered by name in registry.py, with spec
loading bound to them."""

from __future__ import annotations

from .base import Family
from .registry import FAMILIES, load_file, load_paths, load_text, spec_from_record

__all__ = ["FAMILIES", "Family", "load_file", "load_paths", "load_text", "spec_from_record"]
