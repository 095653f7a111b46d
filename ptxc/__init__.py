"""ptxc: an ahead-of-time attention-kernel compiler (TOML spec -> kernel IR -> PTX -> cubin)."""

__version__ = "0.1.0"
