"""Structured control flow for `KernelBuilder`: predicated blocks, if/else and counted loops
instead of hand-placed labels. Mixed into KernelBuilder (uses its label/place/emit/setp/add/mov).

Shapes emitted (what the emulator's lowest-pc-first reconvergence and ptxas both expect):

    if_then(p):       @!p bra END; <then>; END:
    if_then + else_:  @!p bra ELSE; <then>; bra END; ELSE: <else>; END:
    for_range:        i = start; @(i >= stop) bra END; HEAD: <body>; i += step; @(i < stop) bra HEAD; END:
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from ..errors import IRError
from .values import U32, Label, PtxType, Reg, Value


class ControlFlowOps:
    """Mixed into KernelBuilder."""

    def bra(self, target: Label, guard: Reg | None = None, negate: bool = False) -> None:
        saved, self._guard = self._guard, ((guard, negate) if guard is not None else self._guard)
        self.emit("bra", (), (), (target,))
        self._guard = saved

    def ret(self) -> None:
        self.emit("ret")

    @contextmanager
    def predicate(self, p: Reg, negate: bool = False) -> Iterator[None]:
        """Guard every instruction emitted in the block with @p (or @!p)."""
        if self._guard is not None:
            raise IRError("nested predicate blocks; combine the predicates with and_() first")
        self._guard = (p, negate)
        try:
            yield
        finally:
            self._guard = None

    @contextmanager
    def if_then(self, p: Reg, negate: bool = False) -> Iterator[None]:
        end = self.label("endif")
        self.bra(end, p, not negate)
        yield
        self.place(end)
        self._pending_else = end

    @contextmanager
    def else_(self) -> Iterator[None]:
        """The else branch of the if_then block that ended just before this call."""
        end = self._pending_else
        if end is None or not self.entry.body or self.entry.body[-1].srcs != (end,):
            raise IRError("else_() must directly follow an if_then() block")
        self.entry.body.pop()
        after = self.label("endelse")
        self.bra(after)
        self.place(end)
        yield
        self.place(after)
        self._pending_else = None

    @contextmanager
    def for_range(self, start: Value, stop: Value, step: Value = 1, type: PtxType = U32) -> Iterator[Reg]:
        """for (i = start; i < stop; i += step): a guarded do-while loop, one branch per trip."""
        i = self.mov(start, type)
        head, end = self.label("loop"), self.label("endloop")
        self.bra(end, self.setp("ge", i, stop))
        self.place(head)
        yield i
        self.add(i, step, out=i)
        self.bra(head, self.setp("lt", i, stop))
        self.place(end)
