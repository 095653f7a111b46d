"""Per-batch storage that bound ops see: registers, shared memory (with its race tracker),
cp.async bookkeeping, special registers and the optional traffic counter."""

from __future__ import annotations

import numpy as np

from ptxc.emu.memory import SharedMemory
from ptxc.emu.operands import RegStorage
from ptxc.emu.ops_async import AsyncCopies
from ptxc.emu.ops_hopper import RegisterPool
from ptxc.emu.ops_mbarrier import Mbarriers
from ptxc.emu.racecheck import RaceTracker


class BatchContext:
    """Per-batch storage seen by bound ops (registers, memories, special registers)."""

    def __init__(self, program, grid, block, cta_start, nctas, gmem, param_bytes, smem_bytes,
                 racecheck: bool = True, traffic=None):
        self.grid, self.block = grid, block
        nthreads = block[0] * block[1] * block[2]
        self.tpad = -(-nthreads // 32) * 32
        self.nthreads, self.cta_start, self.nctas = nthreads, cta_start, nctas
        n = self.n = nctas * self.tpad
        self.all_index = np.arange(n, dtype=np.int64)
        self.cta_of = self.all_index // self.tpad
        self.lin = self.all_index % self.tpad
        self.lane = self.lin & 31
        self.scratch_flag = np.zeros(n, np.bool_)
        self.regs = {name: RegStorage(t, n) for name, t in program.env.regs.items()}
        self.gmem, self.param_bytes = gmem, param_bytes
        self.min_ctas_per_sm = program.entry.minnctapersm or 1   # setmaxnreg's entry count
        self.smem = SharedMemory(nctas, smem_bytes)
        self.smem.all_index = self.all_index
        self.traffic = traffic          # a TrafficCounter, or None when not counting
        self.race = None
        if racecheck:
            lines = {ins.line: ins.text for ins in program.entry.body}
            self.race = self.smem.race = RaceTracker(self, self.smem.data.size, lines)
        self.cp_async = AsyncCopies(n)
        self.mbar = Mbarriers()           # mbarrier objects (ops_mbarrier.py)
        self.wgmma = None               # a WgmmaState in kernels with wgmma (ops_wgmma.py)
        self.tmem = None                # a TensorMemory in kernels with tcgen05 (tmem.py)
        self.bulk_stores = None         # ops_tma_store.BulkStores once a TMA store is issued
        self._special = {}
        self._register_pool = None      # setmaxnreg's per-CTA pools (ops_hopper.RegisterPool)

    def register_pool(self):
        if self._register_pool is None:
            self._register_pool = RegisterPool(self)
        return self._register_pool

    def coords(self, thread: int):
        """(ctaid, tid) tuples of a batch thread index."""
        gx, gy, _ = self.grid
        bx, by, _ = self.block
        c = self.cta_start + thread // self.tpad
        lin = thread % self.tpad
        return ((c % gx, (c // gx) % gy, c // (gx * gy)),
                (lin % bx, (lin // bx) % by, lin // (bx * by)))

    def special(self, name: str):
        arr = self._special.get(name)
        if arr is None:
            arr = self._special[name] = self._compute_special(name).astype(np.uint32)
        return arr

    def _compute_special(self, name: str):
        gx, gy, gz = self.grid
        bx, by, bz = self.block
        c = self.cta_start + self.cta_of
        lin, lane = self.lin, self.lane
        table = {
            "%tid.x": lambda: lin % bx, "%tid.y": lambda: (lin // bx) % by,
            "%tid.z": lambda: lin // (bx * by),
            "%ctaid.x": lambda: c % gx, "%ctaid.y": lambda: (c // gx) % gy,
            "%ctaid.z": lambda: c // (gx * gy),
            "%laneid": lambda: lane, "%warpid": lambda: lin // 32,
            "%nwarpid": lambda: np.full(self.n, self.tpad // 32),
            "%lanemask_eq": lambda: np.int64(1) << lane,
            "%lanemask_lt": lambda: (np.int64(1) << lane) - 1,
            "%lanemask_le": lambda: (np.int64(2) << lane) - 1,
            "%lanemask_gt": lambda: 0xFFFFFFFF ^ ((np.int64(2) << lane) - 1),
            "%lanemask_ge": lambda: 0xFFFFFFFF ^ ((np.int64(1) << lane) - 1),
        }
        for axis, v in zip("xyz", self.block):
            table[f"%ntid.{axis}"] = lambda v=v: np.full(self.n, v)
        for axis, v in zip("xyz", self.grid):
            table[f"%nctaid.{axis}"] = lambda v=v: np.full(self.n, v)
        return np.broadcast_to(table[name](), (self.n,))
