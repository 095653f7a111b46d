"""Memory-traffic counters of a launch (``launch(..., traffic=True)`` -> ``LaunchStats.traffic``).

What they model (per *warp request*: one instruction executed by the active lanes of a warp):

* **Global memory**: bytes read and written per buffer; for each ld/st/atom/red/cp.async line,
  the requests, the 32-byte sectors they touch (distinct ``addr // 32`` over the active lanes
  -- an aligned access never straddles a sector) and the ideal sector count
  ``ceil(distinct bytes / 32)``. ``sectors == ideal_sectors`` means fully coalesced.
* **Shared memory**: 32 banks of 4 bytes. A request is served in phases of 128 bytes (4-byte
  accesses: the whole warp; 8-byte: half-warps; 16-byte: quarter-warps; ldmatrix: one 8x16-byte
  matrix per phase); a phase takes as many wavefronts as the largest number of *distinct* 4-byte
  words it touches in any one bank (lanes reading the same word share it: broadcast).
  ``bank_conflicts = wavefronts - ideal_wavefronts`` (ideal: one per phase with active lanes).
  Accesses narrower than 4 bytes count the words they touch, over the whole warp.

This is the textbook model that Nsight Compute's "sectors/request" and "bank conflicts" follow;
it is exact for the patterns kernels use (aligned vectors, ldmatrix rows, cp.async 16-byte
chunks). Counting costs a few numpy sorts per memory instruction, so it is off by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_SENTINEL = np.iinfo(np.int64).max


@dataclass(frozen=True)
class GlobalAccess:
    """Global traffic of one PTX line (``kind``: load, store, atomic, cp.async)."""
    line: int
    text: str
    kind: str
    requests: int
    sectors: int
    ideal_sectors: int
    bytes: int

    @property
    def sectors_per_request(self) -> float:
        return self.sectors / self.requests if self.requests else 0.0

    @property
    def coalesced(self) -> bool:
        return self.sectors == self.ideal_sectors


@dataclass(frozen=True)
class SharedAccess:
    """Shared-memory traffic of one PTX line (``kind``: ld.shared, st.shared, ldmatrix,
    cp.async)."""
    line: int
    text: str
    kind: str
    requests: int
    wavefronts: int
    ideal_wavefronts: int

    @property
    def bank_conflicts(self) -> int:
        return self.wavefronts - self.ideal_wavefronts


@dataclass(frozen=True)
class Traffic:
    bytes_read: dict            # buffer (parameter name) -> global bytes read
    bytes_written: dict         # buffer -> global bytes written
    global_accesses: tuple      # of GlobalAccess, by line
    shared_accesses: tuple      # of SharedAccess, by line

    @property
    def sectors(self) -> int:
        return sum(a.sectors for a in self.global_accesses)

    @property
    def ideal_sectors(self) -> int:
        return sum(a.ideal_sectors for a in self.global_accesses)

    @property
    def bank_conflicts(self) -> int:
        return sum(a.bank_conflicts for a in self.shared_accesses)

    def line(self, line: int):
        """The GlobalAccess and/or SharedAccess records of one PTX line."""
        return [a for a in self.global_accesses + self.shared_accesses if a.line == line]


def _warp_rows(idx, values):
    """Scatter per-thread `values` into (warps, 32) rows by lane; missing lanes: sentinel."""
    warps, inv = np.unique(idx >> 5, return_inverse=True)
    rows = np.full((warps.size, 32), _SENTINEL, np.int64)
    rows[inv, idx & 31] = values
    return rows


def _distinct_per_row(rows):
    """Sorted rows with repeated values replaced by the sentinel."""
    s = np.sort(rows, axis=1)
    dup = np.zeros_like(s, dtype=np.bool_)
    dup[:, 1:] = s[:, 1:] == s[:, :-1]
    s[dup] = _SENTINEL
    return s


class TrafficCounter:
    """Accumulates counts over all batches of a launch."""

    def __init__(self, gmem, names: list, lines: dict):
        self.gmem, self.names, self.lines = gmem, names, lines
        self.read = np.zeros(len(names), np.int64)
        self.written = np.zeros(len(names), np.int64)
        self.glob = {}          # (line, kind) -> [requests, sectors, ideal, bytes]
        self.shared = {}        # (line, kind) -> [requests, wavefronts, ideal]

    # ------------------------------------------------------------------ global
    def global_access(self, line: int, kind: str, idx, addr, nbytes, write: bool):
        """Threads `idx` (batch indices) access `nbytes` (scalar or per thread) at `addr`."""
        addr = np.broadcast_to(np.asarray(addr, np.uint64), idx.shape)
        nb = np.broadcast_to(np.asarray(nbytes, np.int64), idx.shape)
        buf = np.searchsorted(self.gmem.starts, addr, side="right").astype(np.int64) - 1
        np.add.at(self.written if write else self.read, buf, nb)
        a = addr.astype(np.int64)
        sectors = _distinct_per_row(_warp_rows(idx, a >> 5))
        nsec = int(np.count_nonzero(sectors != _SENTINEL))
        # ideal: distinct bytes (distinct start addresses times the access size) per request
        starts = _distinct_per_row(_warp_rows(idx, a))
        size = int(nb.max()) if nb.size else 0
        ideal = int(np.sum(-(-np.count_nonzero(starts != _SENTINEL, axis=1) * size // 32)))
        rec = self.glob.setdefault((line, kind), [0, 0, 0, 0])
        rec[0] += starts.shape[0]
        rec[1] += nsec
        rec[2] += ideal
        rec[3] += int(nb.sum())

    def bulk_read(self, line: int, kind: str, addr, nbytes: int):
        """One bulk copy (TMA) reads `nbytes` at each of `addr`: one request, every 32-byte
        sector it touches once (the copy engine reads whole sectors, so ideal = actual)."""
        addr = np.asarray(addr, np.uint64)
        buf = np.searchsorted(self.gmem.starts, addr, side="right").astype(np.int64) - 1
        np.add.at(self.read, buf, nbytes)
        a = addr.astype(np.int64)
        nsec = int(np.unique(np.concatenate([a >> 5, (a + nbytes - 1) >> 5])).size)
        rec = self.glob.setdefault((line, kind), [0, 0, 0, 0])
        rec[0] += 1
        rec[1] += nsec
        rec[2] += nsec
        rec[3] += int(addr.size) * nbytes

    # ------------------------------------------------------------------ shared
    def shared_access(self, line: int, kind: str, idx, addr, width: int):
        """Threads `idx` access `width` bytes each at shared addresses `addr` (aligned)."""
        addr = np.broadcast_to(np.asarray(addr, np.int64), idx.shape)
        words_per = max(width // 4, 1)
        rows = _warp_rows(idx, addr >> 2)                         # (warps, 32) first words
        if words_per > 1:
            lanes_per_phase = 32 // words_per
            k = np.arange(words_per)
            w = np.where(rows[:, :, None] == _SENTINEL, _SENTINEL, rows[:, :, None] + k)
            groups = w.reshape(-1, lanes_per_phase * words_per)    # one row per phase
        else:
            groups = rows
        self._wavefronts(line, kind, groups, rows.shape[0])

    def ldmatrix(self, line: int, addr_rows):
        """addr_rows: (warps, 8 * nmat) shared addresses of 16-byte matrix rows."""
        nw, nrow = addr_rows.shape
        w = (addr_rows.astype(np.int64) >> 2)[:, :, None] + np.arange(4)
        self._wavefronts(line, "ldmatrix", w.reshape(nw * (nrow // 8), 32), nw)

    def _wavefronts(self, line, kind, groups, requests):
        d = _distinct_per_row(groups)
        live = d != _SENTINEL
        g = np.broadcast_to(np.arange(d.shape[0])[:, None], d.shape)[live]
        bank = (d[live] & 31)
        counts = np.bincount(g * 32 + bank, minlength=d.shape[0] * 32).reshape(-1, 32)
        per_phase = counts.max(axis=1)
        rec = self.shared.setdefault((line, kind), [0, 0, 0])
        rec[0] += requests
        rec[1] += int(per_phase.sum())
        rec[2] += int(np.count_nonzero(per_phase))

    # ------------------------------------------------------------------ result
    def result(self) -> Traffic:
        text = self.lines.get
        return Traffic(
            {n: int(v) for n, v in zip(self.names, self.read) if v},
            {n: int(v) for n, v in zip(self.names, self.written) if v},
            tuple(GlobalAccess(ln, text(ln, ""), kind, *v)
                  for (ln, kind), v in sorted(self.glob.items())),
            tuple(SharedAccess(ln, text(ln, ""), kind, *v)
                  for (ln, kind), v in sorted(self.shared.items())))
