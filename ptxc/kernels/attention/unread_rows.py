"""The cache rows no query of a launch reads -- the contract's side of "NaN in memory a kernel
must not read". A serving cache holds whatever earlier sequences, a fresh allocation or a
quantiser left there (an FP8 byte 0x7F is a NaN), so every row past a sequence's L, every page
its block table does not name for its keys, and every page wholly before the first key its
first query may see (a sliding window or an attention chunk: an engine may free such pages,
as vLLM's sliding-window manager does) must never reach O or the LSE: a tile that loads such a
row masks its score by selection and zeroes its value row, or does not load it. Rows below L
on a page the window only partly covers, and a contiguous cache's rows below L, are the
sequence's own rows, which the engine wrote (finite): a tile may read and mask them.

A family's `unread(spec, inputs)` (`Family.unread`; decode and varlen through
`unread_cache_rows`) gives, per cache tensor, a boolean mask of the rows (over the cache's
leading row axes) no query reads; launch-test (runtime/launch_test.py) fills them with
NaN (FP8 bytes: 0x7F, NaN in e4m3 and e5m2) before the kernel runs, and the fp64 reference
keeps the clean inputs -- so every emulator and GPU check of these families is also a check
that the garbage stays out. Custom masks (trees, packed bits) only hide more keys, so the rows
here stay unread under them too.
"""

from __future__ import annotations

import numpy as np

# The byte a poisoned FP8 cache row holds: S.1111.111 (e4m3) / S.11111.11 (e5m2), NaN in both
FP8_NAN = 0x7F


def key_ranges(lens, first_positions, window: int | None, chunk: int | None) -> list[tuple[int, int]]:
    """[lo, hi) of the keys each sequence's queries may see: hi = L, lo from the first query's
    position p0 (the earliest query sees the earliest keys): a window W admits keys j > p - W,
    a chunk C keys j >= C * floor(p / C). A sequence without queries reads nothing."""
    out = []
    for L, p0 in zip(lens, first_positions):
        if p0 is None or L <= 0:
            out.append((0, 0))
            continue
        lo = 0
        if window is not None:
            lo = max(lo, p0 - window + 1)
        if chunk is not None and p0 > 0:
            lo = max(lo, p0 // chunk * chunk)
        out.append((min(lo, L), L))
    return out


def row_mask(ranges: list[tuple[int, int]], rows_shape: tuple[int, int],
             block_table: np.ndarray | None) -> np.ndarray:
    """True for the cache rows ([batch, S] contiguous, or [num_pages, page_size] paged through
    `block_table`) no sequence reads: outside [0, hi) contiguous (the rows below lo are the
    sequence's own), outside the pages that hold [lo, hi) paged."""
    unread = np.ones(rows_shape, dtype=bool)
    for b, (lo, hi) in enumerate(ranges):
        if hi <= lo:
            continue
        if block_table is None:
            unread[b, :hi] = False
            continue
        ps = rows_shape[1]
        j = np.arange(lo // ps * ps, hi)
        unread[np.asarray(block_table)[b, j // ps], j % ps] = False
    return unread


def unread_cache_rows(spec, inputs: dict, first_position) -> dict[str, np.ndarray]:
    """{k_cache, v_cache: the rows no query reads} of a family whose sequence b has L =
    seq_lens[b] keys (clamped to the cache's capacity) and whose first query sits at
    `first_position(b, L)` (None: no queries), under the spec's window and chunk."""
    rows = inputs["k_cache"].shape[:2]
    table = inputs.get("block_table")
    capacity = rows[1] if table is None else np.asarray(table).shape[1] * rows[1]
    lens = np.clip(np.asarray(inputs["seq_lens"], np.int64), 0, capacity).tolist()
    ranges = key_ranges(lens, [first_position(b, L) for b, L in enumerate(lens)],
                        spec.opt("sliding_window"), spec.opt("attention_chunk"))
    mask = row_mask(ranges, rows, table)
    return {"k_cache": mask, "v_cache": mask}


def poison(inputs: dict, masks: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Fill the masked rows of `inputs`' tensors in place with NaN (FP8 bytes: FP8_NAN), after
    making them writable copies of their own; returns what they held, for `restore` (in place:
    a GPU-sized cache is not copied whole, only its unread rows are kept)."""
    saved = {}
    for name, mask in masks.items():
        arr = np.asarray(inputs[name])
        if not arr.flags.writeable or arr is not inputs[name]:
            arr = inputs[name] = np.array(arr, copy=True)
        saved[name] = arr[mask].copy()
        arr[mask] = np.nan if np.issubdtype(arr.dtype, np.floating) else FP8_NAN
    return saved


def restore(inputs: dict, masks: dict[str, np.ndarray], saved: dict[str, np.ndarray]) -> None:
    """Put back what `poison` took out."""
    for name, mask in masks.items():
        inputs[name][mask] = saved[name]


__all__ = ["FP8_NAN", "key_ranges", "poison", "restore", "row_mask", "unread_cache_rows"]
