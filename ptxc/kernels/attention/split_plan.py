"""Length-balanced split-KV work assignment, computed on the device (no host-side lengths).

A split kernel's grid has `num_splits` (S) split indices per row (decode: sequence; varlen:
packed query tile). Instead of cutting every row's KV range into S even shares (which leaves the
CTAs of short rows idle while the long ones dominate), every CTA derives one uniform chunk size,
in units of KV tiles, for the whole batch from the device's seq_lens:

    chunk = max(1, cdiv(longest, S), cdiv(own, S))                          (fixed num_splits)
    chunk = max(that, cdiv(total, cdiv(S * rows * waves, SPLIT_HEADROOM)))  ("auto")
    then, with the family's AutoSplit.even, n = cdiv(longest, chunk) ("up") or
    max(1, longest // chunk) ("down"), and chunk = max(cdiv(longest, n), cdiv(own, S))

where `longest` is the most units of any row, `total` the units of the whole batch and `own` the
CTA's own row (== longest's bound normally; it keeps the cover exact even if the two disagree).
Row r then uses cdiv(units_r, chunk) <= S splits, split z covering units [z*chunk, (z+1)*chunk);
the CTAs of unused split indices see an empty range and write an empty partial (lse = -inf),
which split_reduce's exact merge weighs 0 (without reading its o_part). Since chunk >=
cdiv(own, S), a CTA with z * cdiv(own, S) >= own knows it is unused from its own length alone and
exits before the batch pass (emit_idle_exit; decode does, varlen does not: there ptxas spilled):
the many spare split indices of short rows then cost a load and a store. "auto" sizes
S = SPLIT_HEADROOM x the resident CTA slots / (CTAs per split index) (split_interface), so the
`total` term aims the busy CTAs at about `waves` per resident slot, and the headroom lets a long
row take up to SPLIT_HEADROOM x its even share of splits. Exactness rests on the `longest` and
`own` terms alone (S chunks cover every row), so even a wrapped u32 `total` only unbalances. Each CTA computes `longest` and `total` with a warp-parallel pass over the
batch (one lane per row, a shuffle reduction): every warp does it redundantly, so there is no
barrier and no shared memory. `plan` is the same arithmetic in Python (tests, docs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ...ir import U32, KernelBuilder, Reg

SPLIT_HEADROOM = 4    # "auto": split indices per resident CTA slot (see the module docstring)
MAX_AUTO_SPLITS = 64


@dataclass(frozen=True)
class AutoSplit:
    """How "auto" turns the batch's work into the chunk (module docstring): the `total` term aims
    at `waves` busy CTAs per resident slot, then with `even` the longest row's splits are evened
    out -- "up": its cdiv(longest, chunk) splits each take cdiv(longest, n) units; "down":
    floor(longest / chunk) of them (at least one), so the busy CTAs never exceed the aim."""
    waves: int = 1
    even: str = ""            # "", "up" or "down"


# Per family, from H200 timings (docs/performance.md "Split-KV 'auto' rule"): decode's CTAs are
# small (3+ per SM) and latency-bound, its partials tiny: four waves of busy CTAs, evened out
# (batch 64 x 4096: 0.344 -> 0.279 ms). MLA's CTA holds an SM and a split's f32 partial of
# 512-wide rows costs ~5 % of the latent bytes: at most one wave, whole splits of equal size
# (DeepSeek-V3 at batch 64: unsplit, 0.227 -> 0.207 ms). varlen: the rule as it was (its
# batch-64 serve at 85 % of HBM did not gain from either).
AUTO_SPLIT = {"decode": AutoSplit(waves=4, even="up"), "mla": AutoSplit(even="down")}


def auto_split(spec) -> AutoSplit | None:
    """The family's AutoSplit for a spec built with num_splits = "auto" (None otherwise)."""
    return AUTO_SPLIT.get(spec.family, AutoSplit()) if spec.opt("num_splits") == "auto" else None


def _cdiv(b: KernelBuilder, a: Reg, d: Reg | int) -> Reg:
    return b.div(b.add(a, b.sub(d, 1) if isinstance(d, Reg) else d - 1), d)


def emit_batch_units(b: KernelBuilder, lane: Reg, n_rows: Reg,
                     units_of: Callable[[Reg], tuple[Reg, Reg]]) -> tuple[Reg, Reg]:
    """(total, longest) over rows 0..n_rows-1 of `units_of(i)` = (work units, KV span units of
    one split row) as u32, summed / maxed by the whole warp: lane l takes rows l, l+32, ..."""
    total, longest = b.mov(0, U32), b.mov(0, U32)
    with b.for_range(lane, n_rows, 32) as i:
        work, span = units_of(i)
        b.add(total, work, out=total)
        b.max(longest, span, out=longest)
    # A tree into lane 0, then a broadcast: with a butterfly instead ptxas (13.0, sm_90) spills
    # in the varlen split kernel.
    for off in (16, 8, 4, 2, 1):
        b.add(total, b.shfl("down", total, off), out=total)
        b.max(longest, b.shfl("down", longest, off), out=longest)
    return b.shfl("idx", total, 0), b.shfl("idx", longest, 0)


def idle_split(b: KernelBuilder, split: Reg, own: Reg, num_splits: Reg, keep_split0: bool) -> Reg:
    """Predicate: split `split` of a row of (at most) `own` units gets nothing from any chunk
    the batch can pick (chunk >= cdiv(own, S)); never split 0 with `keep_split0`."""
    idle = b.setp("ge", b.mul(split, b.max(_cdiv(b, own, num_splits), 1)), own)
    return b.and_(idle, b.setp("ne", split, 0)) if keep_split0 else idle


def emit_idle_exit(b: KernelBuilder, split: Reg, own: Reg, num_splits: Reg, keep_split0: bool,
                   write_empty: Callable[[], None]) -> None:
    """Leave at once, before the batch pass, when the uniform chunk (>= cdiv(own, S)) cannot
    give split `split` any of its row's `own` units; `write_empty()` first stores the empty
    partials (lse = -inf: split_reduce then never reads their o_part). `keep_split0`: split 0
    stays (it carries the attention sink)."""
    with b.if_then(idle_split(b, split, own, num_splits, keep_split0)):
        write_empty()
        b.ret()


def emit_chunk(b: KernelBuilder, *, total: Reg, longest: Reg, own: Reg, num_splits: Reg,
               rows: Reg, auto: AutoSplit | None) -> Reg:
    """The uniform chunk (in units) of the module docstring."""
    chunk = b.max(b.max(_cdiv(b, longest, num_splits), _cdiv(b, own, num_splits)), 1)
    if auto is not None:
        split_rows = b.mul(num_splits, rows)
        if auto.waves != 1:
            split_rows = b.mul(split_rows, auto.waves)
        slots = b.max(_cdiv(b, split_rows, SPLIT_HEADROOM), 1)
        b.max(chunk, _cdiv(b, total, slots), out=chunk)
        if auto.even:   # n <= S splits of the longest row, each cdiv(longest, n) units
            n = b.max(_cdiv(b, longest, chunk) if auto.even == "up" else b.div(longest, chunk), 1)
            chunk = b.max(b.max(_cdiv(b, longest, n), _cdiv(b, own, num_splits)), 1)
    return chunk


def emit_split_range(b: KernelBuilder, split: Reg, chunk: Reg, begin: Reg, end: Reg) -> tuple[Reg, Reg]:
    """Split `split`'s part [first, last) of [begin, end) for a chunk in the same units."""
    first = b.min(b.mad(split, chunk, begin), end)
    return first, b.min(b.add(first, chunk), end)


def emit_balanced_split(b: KernelBuilder, *, split: Reg, num_splits: Reg, lane: Reg, n_seqs: Reg,
                        seq_units: Callable[[Reg], tuple[Reg, Reg]], own: Reg, begin: Reg, end: Reg,
                        rows: Reg, auto: AutoSplit | None, keep_split0: bool,
                        write_empty: Callable[[], None] | None, unit: int = 1) -> tuple[Reg, Reg]:
    """The whole assignment for one split CTA, in order: the idle exit (skipped when
    `write_empty` is None: the caller already placed it), the batch pass, the chunk, and this
    split's [first, last) of [begin, end) (begin/end in units of `unit`: a chunk of c units
    covers c * unit of them). Decode, varlen and anything built on varlen's body call this."""
    if write_empty is not None:
        emit_idle_exit(b, split, own, num_splits, keep_split0, write_empty)
    total, longest = emit_batch_units(b, lane, n_seqs, seq_units)
    chunk = emit_chunk(b, total=total, longest=longest, own=own, num_splits=num_splits, rows=rows,
                       auto=auto)
    return emit_split_range(b, split, b.mul(chunk, unit) if unit != 1 else chunk, begin, end)


def plan(units: list[int], num_splits: int, auto: AutoSplit | None, work: list[int] | None = None,
         rows: int | None = None) -> tuple[int, list[list[tuple[int, int]]]]:
    """(chunk, per row the [first, last) unit ranges of its splits 0..S-1), as the kernels
    compute them: `units` per split row (its KV span), `work` per batch entry (default: units),
    `rows` the split rows of the grid (default: len(units)), `auto` the family's AutoSplit
    (None: a fixed num_splits)."""
    cd = lambda a, d: -(-a // d)
    S, work = num_splits, units if work is None else work
    rows = len(units) if rows is None else rows
    longest = max(units, default=0)
    chunk = max(1, cd(longest, S))
    if auto is not None:
        chunk = max(chunk, cd(sum(work), max(1, cd(S * rows * auto.waves, SPLIT_HEADROOM))))
        if auto.even:
            n = max(1, cd(longest, chunk) if auto.even == "up" else longest // chunk)
            chunk = max(cd(longest, n), 1)
    ranges = [[(min(z * chunk, u), min(min(z * chunk, u) + chunk, u)) for z in range(S)] for u in units]
    return chunk, ranges
