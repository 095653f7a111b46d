"""Tile configurations: the frozen configs, default tiles per target and head_dim, the checks on a
given tile, and the register remedies ptxas needs."""
