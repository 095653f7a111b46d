"""Kernel specs: TOML files -> validated, normalised `KernelSpec` values."""

from .loader import COMMON_FIELDS, MAX_EXPANSION, load_file, load_paths, load_text
from .model import KernelSpec

__all__ = ["COMMON_FIELDS", "MAX_EXPANSION", "KernelSpec", "load_file", "load_paths", "load_text"]
