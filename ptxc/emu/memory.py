"""Emulated global and shared memory with bounds, alignment and initialisation checks.

Global memory is one byte heap holding the launch's buffers at 256-byte aligned addresses
from GLOBAL_BASE, separated by unmapped guard gaps; an access must lie entirely inside one
buffer. Shared memory is one byte array per CTA; a parallel state array marks every byte as
never written (reading it is an error), written, or the destination of a cp.async that has not
been waited for (reading or overwriting it is an error).

Addresses of shared memory are shared-window addresses starting at SHARED_BASE; a generic
address of a shared byte is GENERIC_SHARED_BASE + its shared address (cvta.shared).
"""

from __future__ import annotations

import numpy as np

from ptxc.emu.operands import PARAM_BASE, SHARED_BASE, Fault  # noqa: F401  (PARAM_BASE re-exported)

GLOBAL_BASE = 0x1_0000_0000
GLOBAL_ALIGN = 256
GLOBAL_GUARD = 256
GENERIC_SHARED_BASE = 0x7F00_0000_0000
GENERIC_SHARED_END = GENERIC_SHARED_BASE + (1 << 32)

UNWRITTEN, WRITTEN, CP_ASYNC_PENDING = 0, 1, 2
BULK_PENDING = CP_ASYNC_PENDING | 4     # a cp.async.bulk destination (pending, and bit 2)
_UINTS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_ROW_DTYPE = {**_UINTS, 16: np.dtype((np.void, 16))}
_SHIFT = {1: 0, 2: 1, 4: 2, 8: 3, 16: 4}
_ALL_WRITTEN = np.uint64(0x0101010101010101 * WRITTEN)
_ANY_PENDING = np.uint64(0x0101010101010101 * CP_ASYNC_PENDING)


def _at(sel, k: int) -> int:
    """Batch thread index of the k-th executing thread."""
    return int(k) if isinstance(sel, slice) else int(sel[k])


def _first(mask) -> int:
    return int(np.flatnonzero(mask)[0])


class RowViews:
    """A byte array seen as 1-D arrays of 1/2/4/8/16-byte items. An aligned access of
    `total` bytes is then one item, and a gather is a 1-D fancy index (far faster in numpy
    than indexing rows of a 2-D array)."""

    def __init__(self, base: np.ndarray):
        self.base = base
        self.views = {n: base.view(dt) for n, dt in _ROW_DTYPE.items()}

    def gather(self, rows, total: int, esize: int, nvec: int):
        return self.views[total][rows].view(_UINTS[esize]).reshape(-1, nvec)

    def scatter(self, rows, total: int, values):
        self.views[total][rows] = np.ascontiguousarray(values).view(_ROW_DTYPE[total]).reshape(-1)

    def lanes(self, rows, total: int):
        """The items as (n, k) uint64 lanes (or (n, 1) narrower uints) for pattern checks."""
        got = self.views[total][rows]
        if total >= 8:
            return got.view(np.uint64).reshape(len(got), -1)
        return got.reshape(-1, 1)


class GlobalMemory:
    """The launch's buffers in one heap; addresses are plain uint64 values."""

    def __init__(self, buffers: list):
        """buffers: list of (label, nbytes). Assigns addresses in order."""
        starts, addr = [], GLOBAL_BASE
        for _, nbytes in buffers:
            starts.append(addr)
            addr += -(-(nbytes + GLOBAL_GUARD) // GLOBAL_ALIGN) * GLOBAL_ALIGN
        self.labels = [label for label, _ in buffers]
        self.globals_base = 0        # address of the module-scope variables' buffer, if any
        self.starts = np.array(starts, np.uint64)
        self.ends = np.array([s + n for s, (_, n) in zip(starts, buffers)], np.uint64)
        self.heap = np.zeros(max(addr - GLOBAL_BASE, 16), np.uint8)
        self.views = {n: self.heap.view(t) for n, t in _UINTS.items()}
        self.rows = RowViews(self.heap)

    def region(self, i: int):
        start = int(self.starts[i]) - GLOBAL_BASE
        return self.heap[start:start + int(self.ends[i] - self.starts[i])]

    def _describe(self, addr: int, nbytes: int) -> str:
        if not self.labels:
            return "no buffers are mapped"
        best, dist = 0, None
        for i, (s, e) in enumerate(zip(self.starts.tolist(), self.ends.tolist())):
            d = s - addr if addr < s else max(addr + nbytes - e, 0)
            if dist is None or d < dist:
                best, dist = i, d
        s, e = int(self.starts[best]), int(self.ends[best])
        if addr < s:
            where = f"starts {s - addr} bytes before the start"
        elif addr >= e:
            where = f"starts {addr - e} bytes past the end"
        else:
            where = f"overruns the end by {addr + nbytes - e} bytes"
        return f"nearest buffer {self.labels[best]} [0x{s:x}, 0x{e:x}), access is {where}"

    def offsets(self, addr, nbytes: int, align: int, what: str, sel):
        """Validate accesses of `nbytes` at uint64 `addr`; return heap byte offsets."""
        addr = np.atleast_1d(np.asarray(addr, np.uint64))
        if int(np.bitwise_or.reduce(addr)) & (align - 1):
            bad_align = (addr & np.uint64(align - 1)) != 0
            k = _first(bad_align)
            a = int(addr[k])
            raise Fault(f"misaligned global {what} of {nbytes} bytes at address 0x{a:x} "
                        f"(needs {align}-byte alignment)", _at(sel, k), a)
        if addr.size == 0 or self._inside_one_buffer(addr, nbytes):
            return (addr - np.uint64(GLOBAL_BASE)).astype(np.int64)
        i = np.searchsorted(self.starts, addr, side="right").astype(np.int64) - 1
        ok = (i >= 0) & (addr + np.uint64(nbytes) <= self.ends[np.maximum(i, 0)])
        if not ok.all():
            k = _first(~ok)
            a = int(addr[k])
            raise Fault(f"out-of-bounds global {what} of {nbytes} bytes at address 0x{a:x}: "
                        f"{self._describe(a, nbytes)}", _at(sel, k), a)
        return (addr - np.uint64(GLOBAL_BASE)).astype(np.int64)

    def _inside_one_buffer(self, addr, nbytes: int) -> bool:
        """Fast path: every address lies in the buffer that holds the lowest one."""
        lo, hi = int(addr.min()), int(addr.max())
        i = int(np.searchsorted(self.starts, np.uint64(lo), side="right")) - 1
        return i >= 0 and lo >= int(self.starts[i]) and hi + nbytes <= int(self.ends[i])

    def load(self, addr, esize: int, nvec: int, sel):
        """(n, nvec) words of esize bytes; the access must be aligned to its whole size."""
        total = esize * nvec
        off = self.offsets(addr, total, total, "load", sel)
        return self.rows.gather(off >> _SHIFT[total], total, esize, nvec)

    def store(self, addr, esize: int, values, sel):
        """values: (n, nvec) unsigned words of esize bytes."""
        total = esize * values.shape[1]
        off = self.offsets(addr, total, total, "store", sel)
        self.rows.scatter(off >> _SHIFT[total], total, values)


STORE_READER = ("a TMA store (cp.async.bulk.tensor to global) in flight reads, before the "
                "cp.async.bulk.wait_group.read that retires it")


class SharedMemory:
    """Shared memory of every CTA of a batch, with a per-byte initialisation state."""

    def __init__(self, nctas: int, size: int):
        self.size = size
        self.stride = max(-(-size // 16) * 16, 16)
        self.data = np.zeros(nctas * self.stride, np.uint8)
        self.state = np.zeros(nctas * self.stride, np.uint8)
        self.rows, self.state_rows = RowViews(self.data), RowViews(self.state)
        self.race = None            # a RaceTracker when racecheck is on
        self.all_index = None       # batch thread indices, for accesses by every thread
        # wgmma operands in flight: per 16-byte chunk, how many in-flight operations read it
        self.async_readers, self.async_live = None, 0
        self.async_reader = ("a wgmma.mma_async in flight reads, before the wgmma.wait_group "
                             "that retires it")
        self.tc_reads = None        # tmem.SharedReads in kernels with tcgen05 (their ordering)
        # TMA stores in flight (ops_tma_store.py): per 16-byte chunk, how many read it until
        # the wait_group.read that retires them
        self.store_readers, self.store_live = None, 0
        # per 16-byte chunk, the swizzle width a TMA copy wrote it with (-1: written otherwise);
        # created by the first TMA copy, so that an MMA descriptor with another swizzle fails
        self.tma_swizzle = None

    def offsets(self, cta, addr, nbytes: int, align: int, what: str, sel):
        """Validate shared accesses (addr: shared-window addresses); return flat byte offsets."""
        addr = np.atleast_1d(np.asarray(addr).astype(np.int64))
        rel = addr - SHARED_BASE
        bad = (rel < 0) | (rel > self.size - nbytes)
        if bad.any():
            k = _first(bad)
            a = int(addr[k])
            raise Fault(f"out-of-bounds shared {what} of {nbytes} bytes at shared address "
                        f"0x{a:x} (this CTA's shared memory is [0x{SHARED_BASE:x}, "
                        f"0x{SHARED_BASE + self.size:x}))", _at(sel, k), a)
        if int(np.bitwise_or.reduce(rel)) & (align - 1):
            k = _first((rel & (align - 1)) != 0)
            a = int(addr[k])
            raise Fault(f"misaligned shared {what} of {nbytes} bytes at shared address 0x{a:x} "
                        f"(needs {align}-byte alignment)", _at(sel, k), a)
        return np.asarray(cta, np.int64) * self.stride + rel

    def check_readable(self, rows, total: int, sel, addr_of):
        """rows: item indices of `total`-byte accesses; raise on unwritten or pending bytes."""
        st = self.state_rows.lanes(rows, total)
        ok = st == (_ALL_WRITTEN if total >= 8 else
                    _UINTS[total](int(_ALL_WRITTEN) & ((1 << 8 * total) - 1)))
        if ok.all():
            return
        k = _first(~ok.all(axis=1))
        a = addr_of(k)
        if ((st[k].astype(np.uint64) & _ANY_PENDING) != 0).any():
            if ((st[k].astype(np.uint64) & (_ANY_PENDING << np.uint64(1))) != 0).any():
                raise Fault(f"read of cp.async.bulk destination before a wait on its "
                            f"mbarrier observed the phase complete (shared address 0x{a:x})",
                            _at(sel, k), a)
            raise Fault(f"read of cp.async destination before cp.async.wait_group "
                        f"(shared address 0x{a:x})", _at(sel, k), a)
        raise Fault(f"read of never-written shared memory at shared address 0x{a:x}",
                    _at(sel, k), a)

    def check_not_pending(self, rows, total: int, sel, addr_of):
        if self.async_live:
            self._check_no_reader(self.async_readers, self.async_reader, rows, total, sel, addr_of)
        if self.store_live:
            self._check_no_reader(self.store_readers, STORE_READER, rows, total, sel, addr_of)
        if self.tc_reads is not None:
            self.tc_reads.check(rows, total, sel, addr_of)
        st = self.state_rows.lanes(rows, total).astype(np.uint64)
        pending = ((st & _ANY_PENDING) != 0).any(axis=1)
        if pending.any():
            k = _first(pending)
            a = addr_of(k)
            raise Fault(f"write to cp.async destination before cp.async.wait_group "
                        f"(shared address 0x{a:x})", _at(sel, k), a)

    @staticmethod
    def _check_no_reader(readers, who: str, rows, total: int, sel, addr_of):
        """No chunk of the write may be one that `readers` (per 16-byte chunk) counts in flight."""
        chunks = (np.asarray(rows, np.int64) * total) >> 4     # aligned: one chunk each
        hit = readers[chunks] > 0
        if hit.any():
            k = _first(hit)
            a = addr_of(k)
            raise Fault(f"write to shared memory that {who} (shared address "
                        f"0x{a:x})", _at(sel, k), a)

    def load(self, cta, addr, esize: int, nvec: int, sel, line: int = 0):
        total = esize * nvec
        off = self.offsets(cta, addr, total, total, "load", sel)
        rows = off >> _SHIFT[total]
        addr_of = lambda k: int(np.atleast_1d(addr)[k])  # noqa: E731
        self.check_readable(rows, total, sel, addr_of)
        if self.race is not None:
            idx = self.all_index if isinstance(sel, slice) else sel
            self.race.read(rows, total, idx, line, addr_of)
        return self.rows.gather(rows, total, esize, nvec)

    def store(self, cta, addr, esize: int, values, sel, line: int = 0):
        total = esize * values.shape[1]
        off = self.offsets(cta, addr, total, total, "store", sel)
        rows = off >> _SHIFT[total]
        addr_of = lambda k: int(np.atleast_1d(addr)[k])  # noqa: E731
        self.check_not_pending(rows, total, sel, addr_of)
        if self.race is not None:
            idx = self.all_index if isinstance(sel, slice) else sel
            self.race.check(rows, total, idx, line, "write", addr_of)
            self.race.record(rows, total, idx, line)
        self.rows.scatter(rows, total, values)
        self.mark_written(rows, total)

    def forget_layout(self, flat):
        """Bytes at flat offsets were written by other than TMA: no swizzle is known."""
        if self.tma_swizzle is not None:
            self.tma_swizzle[np.asarray(flat, np.int64) >> 4] = -1

    def note_tma_layout(self, flat, swizzle: int):
        """A TMA copy wrote the 16-byte chunks at flat offsets with a `swizzle`-byte swizzle."""
        if self.tma_swizzle is None:
            self.tma_swizzle = np.full(self.data.size // 16 + 1, -1, np.int16)
        self.tma_swizzle[np.asarray(flat, np.int64) >> 4] = swizzle

    def mark_written(self, rows, total: int):
        if self.tma_swizzle is not None:
            self.tma_swizzle[(np.asarray(rows, np.int64) * total) >> 4] = -1
        if total == 16:
            lanes = self.state_rows.views[8]
            lanes[rows * 2] = _ALL_WRITTEN
            lanes[rows * 2 + 1] = _ALL_WRITTEN
        else:
            self.state_rows.views[total][rows] = _UINTS[total](
                int(_ALL_WRITTEN) & ((1 << 8 * total) - 1))
