"""Kernel specs: TOML files -> validated, normalised `KernelSpec` values. Loading validates
each entry against its family's rules, which live in the kernels layer: `ptxc.kernels`'
load_text / load_file / load_paths / spec_from_record pass them down to `loader`."""

from .loader import COMMON_FIELDS, MAX_EXPANSION
from .model import KernelSpec

__all__ = ["COMMON_FIELDS", "MAX_EXPANSION", "KernelSpec"]
