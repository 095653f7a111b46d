"""Warp and block collectives for `KernelBuilder`: shuffles, ballots and the CTA's barriers
(bar.sync, named barriers, bar.warp.sync, bar.arrive), each refused under a predicate where
every thread must reach it. Mixed into KernelBuilder (uses its reg/emit/_operand/_type_of)."""

from __future__ import annotations

from ..errors import IRError
from .values import PRED, S32, U32, Imm, Reg, Value


class CollectiveOps:
    """Mixed into KernelBuilder."""

    def shfl(self, mode: str, a: Value, b: Value, c: int = 31, mask: int = 0xFFFFFFFF) -> Reg:
        """shfl.sync.<mode>.b32; for f32 values the result keeps the input's type."""
        if mode not in ("up", "down", "bfly", "idx"):
            raise IRError(f"shfl: mode {mode!r} not one of up, down, bfly, idx")
        t = self._type_of(a, what="shfl")
        if t.bits != 32:
            raise IRError(f"shfl: operand {a} is {t}; shfl moves 32-bit values")
        d = self.reg(t)
        self.emit("shfl", ("sync", mode, "b32"), (d,),
                  (self._operand(a, t, "shfl"), self._operand(b, U32, "shfl"), Imm(c, U32),
                   Imm(-1 if mask == 0xFFFFFFFF else mask, S32)))
        return d

    def ballot(self, p: Reg, mask: int = 0xFFFFFFFF) -> Reg:
        """vote.sync.ballot.b32: bit i of the u32 result is lane i's `p` (lanes of `mask`, which
        must all execute it)."""
        if not isinstance(p, Reg) or p.type != PRED:
            raise IRError(f"ballot: {p} is not a predicate register")
        d = self.reg(U32)
        self.emit("vote", ("sync", "ballot", "b32"), (d,),
                  (p, Imm(-1 if mask == 0xFFFFFFFF else mask, S32)))
        return d

    def bar_sync(self, barrier: int = 0, threads: int | None = None) -> None:
        """bar.sync barrier (every thread of the CTA), or bar.sync barrier, threads: a named
        barrier that completes when `threads` (a multiple of 32) have arrived."""
        if self._guard is not None:
            raise IRError("bar.sync under a predicate: every thread must reach the barrier")
        if not 0 <= barrier <= 15:
            raise IRError(f"bar.sync: barrier {barrier} is not in 0..15")
        if threads is None:
            self.emit("bar", ("sync",), (), (Imm(barrier, U32),))
            return
        if threads <= 0 or threads % 32:
            raise IRError(f"bar.sync: thread count {threads} is not a positive multiple of 32")
        self.emit("bar", ("sync",), (), (Imm(barrier, U32), Imm(threads, U32)))

    def warp_sync(self) -> None:
        """bar.warp.sync over the whole warp: every lane waits for the others, and their memory
        accesses before it are ordered before every lane's after it (where a lane hands the
        warp's work on, e.g. one lane's mbarrier arrive after every lane's stores)."""
        if self._guard is not None:
            raise IRError("bar.warp.sync under a predicate: every lane of the warp must reach it")
        self.emit("bar", ("warp", "sync"), (), (Imm(-1, S32),))

    def bar_arrive(self, barrier: int, threads: int) -> None:
        """bar.arrive barrier, threads: count toward named barrier `barrier`'s phase of
        `threads` and go on without waiting (a producer's signal; the waiters bar.sync)."""
        if self._guard is not None:
            raise IRError("bar.arrive under a predicate: every thread of a warp must arrive")
        if not 1 <= barrier <= 15:
            raise IRError(f"bar.arrive: barrier {barrier} is not in 1..15 (0 is the CTA's)")
        if threads <= 0 or threads % 32:
            raise IRError(f"bar.arrive: thread count {threads} is not a positive multiple of 32")
        self.emit("bar", ("arrive",), (), (Imm(barrier, U32), Imm(threads, U32)))


__all__ = ["CollectiveOps"]
