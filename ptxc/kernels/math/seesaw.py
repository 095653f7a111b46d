"""The hand-over between MLA's two warpgroups under FlashMLA's seesaw schedule (tile.seesaw;
mainloop/seesaw_pipeline.py runs it).

Both warpgroups hold the same 64 head rows (thread t of one holds the rows thread t of the other
does: wgmma's accumulator layout depends only on the thread's index in its warpgroup) and each
owns half of O's columns. Tile j's S and softmax belong to warpgroup j mod 2; the other takes
the result: P(j), rounded to the dtype, in the A-fragment registers the owner's P·V reads, and
the row max m(j) the owner reached. So each thread publishes its own registers and reads its
twin's -- no layout change, v4 stores and loads at 16 bytes a thread (conflict-free):

  slot of warpgroup g    block_n / 16 fragment blocks of 128 x 16 bytes (P), then 128 x 8 bytes
                         (m of the thread's two rows)

Warpgroup g publishes on named barrier SEESAW_BARRIERS[g] (bar.arrive, 128 of its threads) and
the other reads after bar.sync on it (its 128): 256 a phase. One slot a warpgroup is enough:
the other reads P(j) and m(j) before it publishes P(j+1), which the owner waits for before it
writes P(j+2).

Taking P(j) and m(j) is the owner's softmax step replayed without the exponentials: the same
warp-uniform vote (rescale_vote over the same rows: m moves only when the owner's warp voted),
alpha = 2^(m - m(j)), l and O scaled by it, m <- m(j), then l += the row sums of the received P
by mma.sync against ones -- the owner's order of operations on the same values, so both
warpgroups hold the same l, bit for bit, and normalise their halves of O alike.
"""

from __future__ import annotations

from ...ir import B32, F32, U32, Addr, KernelBuilder, Reg
from ..attention.softmax import rescale_vote

SEESAW_BARRIERS = (2, 3)          # warpgroup g publishes P and m on SEESAW_BARRIERS[g]
TAIL_BARRIERS = (4, 5)            # warpgroup g's own 128 threads (the zeroed V tail)
WARPGROUP = 128                   # threads
FRAGMENT_BLOCK = WARPGROUP * 16   # one k16 A fragment (4 registers) of every thread of a warpgroup
MAX_BLOCK = WARPGROUP * 8         # the row max of both rows of every thread


def seesaw_slot_bytes(block_n: int) -> int:
    """A warpgroup's published P (block_n / 16 fragments) and row max."""
    return block_n // 16 * FRAGMENT_BLOCK + MAX_BLOCK


def by_warpgroup(b: KernelBuilder, second: Reg, first_does, second_does) -> None:
    """Warpgroup 0 runs `first_does()`, warpgroup 1 `second_does()` (each warp-uniformly: a
    named barrier's id is an immediate, so each side is its own instruction)."""
    with b.if_then(second):
        second_does()
    with b.else_():
        first_does()


def warpgroup_barrier(b: KernelBuilder, second: Reg) -> None:
    """bar.sync over the calling warpgroup's 128 threads (TAIL_BARRIERS): memory order among
    them (the zeroed V tail before any of its warps' wgmma reads it)."""
    by_warpgroup(b, second, lambda: b.bar_sync(TAIL_BARRIERS[0], WARPGROUP),
                 lambda: b.bar_sync(TAIL_BARRIERS[1], WARPGROUP))


class SeesawExchange:
    """The slots and barriers of one warpgroup's side (`second`: the predicate of warpgroup 1,
    `t` the thread's index in its warpgroup, `base` the two slots' address) over `math`, a
    WgmmaMath whose m, l_acc and O it updates."""

    def __init__(self, b: KernelBuilder, math, base: Reg, t: Reg, second: Reg):
        self.b, self.math, self.second = b, math, second
        slot = seesaw_slot_bytes(math.bn)
        mine = b.add(base, b.selp(slot, 0, second, U32))
        other = b.add(base, b.selp(0, slot, second, U32))
        self.frags = math.bn // 16
        self.p_mine, self.p_other = (b.add(s, b.shl(t, 4)) for s in (mine, other))
        maxes = self.frags * FRAGMENT_BLOCK
        self.m_mine, self.m_other = (b.add(s, b.add(b.shl(t, 3), maxes)) for s in (mine, other))

    def _by_warpgroup(self, first, second) -> None:
        by_warpgroup(self.b, self.second, first, second)

    def publish(self) -> None:
        """Store this warpgroup's packed P and m, then arrive: the other may take them."""
        b, math = self.b, self.math
        for k, frag in enumerate(math.p_frags):
            b.st("shared", B32, Addr(self.p_mine, k * FRAGMENT_BLOCK), frag)
        b.st("shared", F32, Addr(self.m_mine), math.m[:2])
        self._by_warpgroup(lambda: b.bar_arrive(SEESAW_BARRIERS[0], 2 * WARPGROUP),
                           lambda: b.bar_arrive(SEESAW_BARRIERS[1], 2 * WARPGROUP))

    def receive(self) -> tuple[list[list[Reg]], list[Reg]]:
        """Wait for the other warpgroup's P and m; returns them (A fragments, the two rows' m)."""
        b, math = self.b, self.math
        self._by_warpgroup(lambda: b.bar_sync(SEESAW_BARRIERS[1], 2 * WARPGROUP),
                           lambda: b.bar_sync(SEESAW_BARRIERS[0], 2 * WARPGROUP))
        frags = [b.ld("shared", B32, Addr(self.p_other, k * FRAGMENT_BLOCK), vec=4)
                 for k in range(self.frags)]
        return frags, b.ld("shared", F32, Addr(self.m_other), vec=2)

    def absorb(self, frags: list[list[Reg]], m_new: list[Reg]) -> None:
        """The other warpgroup's softmax step on this warpgroup's state (module docstring): O
        must not be in flight (its P·V retired)."""
        math = self.math
        rescale = rescale_vote(self.b, m_new, math.m[:2], (4, 8, 16))
        math.move_max(rescale, m_new)
        math.rescale_o(rescale)
        math.add_row_sums(frags)


__all__ = ["SEESAW_BARRIERS", "SeesawExchange", "TAIL_BARRIERS", "WARPGROUP", "by_warpgroup",
           "seesaw_slot_bytes", "warpgroup_barrier"]
