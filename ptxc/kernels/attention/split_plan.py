"""Length-balanced split-KV work assignment, computed on the device (no host-side lengths).

A split kernel's grid has `num_splits` (S) split indices per row (decode: sequence; varlen:
packed query tile). Instead of cutting every row's KV range into S even shares (which leaves the
CTAs of short rows idle while the long ones dominate), every CTA derives one uniform chunk size,
in units of KV tiles, for the whole batch from the device's seq_lens:

    chunk = max(1, cdiv(longest, S), cdiv(own, S))                          (fixed num_splits)
    chunk = max(that, cdiv(total, cdiv(S * rows, SPLIT_HEADROOM)))          ("auto")

and then the family's AutoSplit: decode takes `that` again where this leaves the longest row
whole (spread), MLA cdiv(longest, max(1, longest // chunk)) (round_down),

where `longest` is the most units of any row, `total` the units of the whole batch and `own` the
CTA's own row (== longest's bound normally; it keeps the cover exact even if the two disagree).
Row r then uses cdiv(units_r, chunk) <= S splits, split z covering units [z*chunk, (z+1)*chunk);
the CTAs of unused split indices see an empty range and write an empty partial (lse = -inf),
which split_reduce's exact merge weighs 0 (without reading its o_part). Since chunk >=
cdiv(own, S), a CTA with z * cdiv(own, S) >= own knows it is unused from its own length alone and
exits before the batch pass (emit_idle_exit; decode does, varlen does not: there ptxas spilled):
the many spare split indices of short rows then cost a load and a store. "auto" sizes
S = SPLIT_HEADROOM x the resident CTA slots / (CTAs per split index) (split_interface), so the
`total` term aims the busy CTAs at about one per resident slot, and the headroom lets a long
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
    """How "auto" turns the batch's work into the chunk (module docstring), per family:
    `spread`: when the total term would leave the longest row whole (one split) although S
    allows more, every row spreads over S splits instead (chunk = cdiv(longest, S)) -- the
    batch alone fills about a wave there, and whole rows land at 1-2 waves with a full last
    one; `round_down`: the longest row takes floor(longest / chunk) even splits (at least
    one) instead of cdiv(longest, chunk) uneven ones, so the busy CTAs never exceed the aim."""
    spread: bool = False
    round_down: bool = False


# From H200 timings (docs/performance.md "Split-KV 'auto' rule"). decode: at batch 64 x 4096
# the total term left every sequence whole, 512 CTAs of one warp on 396 slots (1.29 waves):
# 0.344 ms; spread over the 4 splits, 2048 CTAs: 0.279 ms (81 % of HBM). Spreading at smaller
# batches (13 splits at batch 16) lost 3-21 %, the uneven splits the rule gives there won. MLA:
# a CTA holds an SM and a split's f32 partial of 512-wide rows costs ~5 % of the latent bytes:
# DeepSeek-V3 at batch 64 ran fastest unsplit (0.207 ms; 0.227 at the rule's 114 + 14 tiles),
# Kimi-K2 in two even halves (0.127 against 0.147). varlen: the rule as it was.
AUTO_SPLIT = {"decode": AutoSplit(spread=True), "mla": AutoSplit(round_down=True)}


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
    if auto is None:
        return chunk
    floor = chunk if not (auto.spread or auto.round_down) else b.mov(chunk)
    slots = b.max(_cdiv(b, b.mul(num_splits, rows), SPLIT_HEADROOM), 1)
    b.max(chunk, _cdiv(b, total, slots), out=chunk)
    if auto.spread:       # the longest row left whole: spread every row over the S splits
        return b.selp(floor, chunk, b.setp("ge", chunk, longest), U32)
    if auto.round_down:   # floor(longest / chunk) even splits of the longest row
        n = b.max(b.div(longest, chunk), 1)
        return b.max(_cdiv(b, longest, n), floor)
    return chunk


def emit_split_range(b: KernelBuilder, split: Reg, chunk: Reg, begin: Reg, end: Reg) -> tuple[Reg, Reg]:
    """Split `split`'s part [first, last) of [begin, end) for a chunk in the same units."""
    first = b.min(b.mad(split, chunk, begin), end)
    return first, b.min(b.add(first, chunk), end)


def emit_balanced_split(b: KernelBuilder, *, split: Reg, num_splits: Reg, lane: Reg, n_seqs: Reg,
                        seq_units: Callable[[Reg], tuple[Reg, Reg]], own: Reg, begin: Reg, end: Reg,
                        rows: Reg, auto: AutoSplit | None, keep_split0: bool,
                        write_empty: Callable[[], None] | None, unit: int = 1) -> tuple[Reg, Reg, Reg]:
    """The whole assignment for one split CTA, in order: the idle exit (skipped when
    `write_empty` is None: the caller already placed it), the batch pass, the chunk, and this
    split's [first, last) of [begin, end) (begin/end in units of `unit`: a chunk of c units
    covers c * unit of them), returned with that chunk in those units (split 0 alone covers
    the row when begin + chunk >= end). Decode, varlen and anything built on varlen's body
    call this."""
    if write_empty is not None:
        emit_idle_exit(b, split, own, num_splits, keep_split0, write_empty)
    total, longest = emit_batch_units(b, lane, n_seqs, seq_units)
    chunk = emit_chunk(b, total=total, longest=longest, own=own, num_splits=num_splits, rows=rows,
                       auto=auto)
    step = b.mul(chunk, unit) if unit != 1 else chunk
    return (*emit_split_range(b, split, step, begin, end), step)


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
        floor = chunk
        chunk = max(chunk, cd(sum(work), max(1, cd(S * rows, SPLIT_HEADROOM))))
        if auto.spread and chunk >= longest:
            chunk = floor
        elif auto.round_down:
            chunk = max(cd(longest, max(1, longest // chunk)), floor)
    ranges = [[(min(z * chunk, u), min(min(z * chunk, u) + chunk, u)) for z in range(S)] for u in units]
    return chunk, ranges
