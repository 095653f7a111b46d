"""`ptxc build --shard i/N`: spreading generation over CI jobs.

A kernel's shard is decided by a hash of its name, so adding or removing kernels never moves
the others between shards, and every job computes the same split without talking to the rest.
(`ptxc merge`, in emit/distribute.py, puts the shards' output directories back together.)
"""

from __future__ import annotations

from ..errors import UserError
from ..files import sha256


def parse_shard(text: str) -> tuple[int, int]:
    """'i/N' with 1 <= i <= N."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise UserError(f"--shard {text!r}: expected i/N, e.g. 2/8") from None
    if not (n >= 1 and 1 <= i <= n):
        raise UserError(f"--shard {text!r}: need 1 <= i <= N")
    return i, n


def in_shard(name: str, shard: tuple[int, int]) -> bool:
    i, n = shard
    return int(sha256(name.encode())[:12], 16) % n == i - 1
