"""Prefill on Hopper warpgroup MMA (target sm_90a, f16/bf16, head_dim and head_dim_v 64, 128, 192
or 256: DeepSeek's 192 / 128 included).

The same FlashAttention-2 forward as prefill.py, with both products on `wgmma.mma_async`:

  CTA        block_m / 64 warpgroups (4 warps each); warpgroup g owns query rows [64g, 64g + 64),
             warp w of the CTA rows [16w, 16w + 16) -- exactly the rows the mma.sync path gives
             warp w, so the per-row softmax, masks, variants and epilogue of `MmaMath` apply as
             they are (the wgmma m64nN accumulator is N/8 mma.m16n8 C fragments per warp).
  shared     Q (block_m rows), then `num_stages` K tiles and `num_stages` V tiles (block_n rows;
             V's of head_dim_v columns, K's of head_dim),
             each split along d into 128-byte column slabs (64 elements; d = 128 has two) of
             rows x 128 B with the 128-byte swizzle: 16-byte chunk c of row r sits at chunk
             c ^ (r % 8). Every slab starts 1024-byte aligned (one swizzle period).
  loads      per-thread cp.async 16-byte chunks at the swizzled addresses (the loader of
             tiles.py with a swizzled thread slot), K/V stages tracked by cp.async groups in the
             shared pipeline of kv_pipeline.py; a `fence.proxy.async` after each barrier makes
             the landed tiles visible to the tensor cores' (async-proxy) reads.
             That is tile.kv_loads = "cp_async"; the default, "tma", loads one TMA box per slab
             from q/k/v tensor-map parameters under mbarriers instead (tma_pipeline.py).
  S = Q·Kᵀ   d/16 `wgmma m64n{block_n}k16` with A = Q and B = K from K-major descriptors
             (SBO 1024 = 8 rows; a k16 step moves the start 32 B inside a slab, the next slab
             by rows x 128 B), one commit group, waited at once.
  O += P·V   P rounded to f16x2/bf16x2 is the register-A fragment of `wgmma m64n{dv}k16`
             (block_n/16 of them); B = V read MN-major (transpose bit) from the same swizzled
             rows: SBO 1024 = 8 keys, LBO = the slab distance (block_n x 128 B).
  row sums   one mma.sync m16n8k16 per k16 step against ones, issued before the P·V chain
             (its A registers may not be read while a wgmma holding them is in flight).

With tile.warp_specialize (TMA only; the default there) a producer warpgroup issues the loads
under full/empty mbarriers and the warpgroups above only compute, optionally taking turns at
their wgmma (tile.pingpong) or three of them at block_m 192 (tma_ws_pipeline.py; prefill_tma.py
builds both TMA bodies). Other head dims and f32 take the mma.sync / SIMT kernels on sm_90a as
on sm_90.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import SpecError
from ...ir import F32, S32, S64, U64, Imm, KernelBuilder, Reg
from ...spec.model import KernelSpec
from ...targets import Target
from .. import common as C
from ..attention.prefill_tile import Ctx, cta_coords, tile_range
from ..attention.variant import head_dim_v
from ..config.prefill import PrefillConfig
from ..mainloop.tiles import CHUNK, ThreadSlot, TileGeom, global_rows, load_tile, zero_regs
from ..mainloop.tma_pipeline import barrier_bytes
from ..mainloop.tma_ws_pipeline import (
    CONSUMER_BARRIER, PRODUCER_THREADS, consumer_regs, producer_regs)
from ..mainloop.wgmma_pipeline import run_wgmma_pipeline
from ..math.mma import RESCALE_SLACK, MmaMath

WGMMA_TARGETS = ("sm_90a",)
WGMMA_HEAD_DIMS = (64, 128, 192, 256)   # head_dim and head_dim_v: whole 128-byte slabs, n <= 256
WGMMA_SHAPES = "f16/bf16, head_dim and head_dim_v 64, 128, 192 or 256"   # for refusals
SWIZZLE = 128            # bytes per swizzled row of a slab (the 128-byte swizzle mode)
SWIZZLE_PERIOD = 1024    # 8 rows x 128 B: the pattern repeats, descriptors' SBO
ROWS_PER_WARPGROUP = 64


def uses_wgmma(spec: KernelSpec, target: Target) -> bool:
    """Whether prefill for `target` is this kernel (else the mma.sync / SIMT one)."""
    # packed custom masks keep the mma.sync kernel (their tile list, mask_tiles.py, is not on
    # the wgmma pipelines); a tree mask (varlen) is MmaMath's per-row predicate over the wgmma
    # accumulator, which is the mma.sync fragment layout per warp
    return (target.name in WGMMA_TARGETS and spec.dtype in ("f16", "bf16")
            and spec.head_dim in WGMMA_HEAD_DIMS and head_dim_v(spec) in WGMMA_HEAD_DIMS
            and spec.opt("custom_mask") in (None, "none", "tree"))


@dataclass(frozen=True)
class SwizzledGeom(TileGeom):
    """`rows` rows of `row_bytes` stored as row_bytes / 128 slabs of rows x 128 B (swizzled).
    `stride` is the distance between rows inside a slab, which is what the copy passes step."""

    @property
    def stride(self) -> int:
        return SWIZZLE

    @property
    def slab_bytes(self) -> int:
        return self.rows * SWIZZLE

    @property
    def bytes(self) -> int:
        return self.rows * self.row_bytes


@dataclass(frozen=True)
class WgmmaConfig(PrefillConfig):
    # "tma" (tma_pipeline.py; prefill's default, set by configure) or "cp_async" (per-thread
    # copies; the dataclass default, so other builders of a WgmmaConfig keep their layout)
    kv_loads: str = "cp_async"
    warp_specialize: bool = False   # tma only: + a producer warpgroup (tma_ws_pipeline.py)
    pingpong: bool = False          # warp_specialize with two consumer warpgroups taking turns

    @property
    def tma(self) -> bool:
        return self.kv_loads == "tma"

    @property
    def launch_threads(self) -> int:
        return self.threads + (PRODUCER_THREADS if self.warp_specialize else 0)

    @property
    def producer_regs(self) -> int:
        return producer_regs(self.block_m // ROWS_PER_WARPGROUP)

    @property
    def consumer_regs(self) -> int:
        return consumer_regs(self.block_m // ROWS_PER_WARPGROUP)

    @property
    def q_geom(self) -> TileGeom:
        return SwizzledGeom(self.block_m, self.head_dim * self.fmt.bytes, self.threads)

    @property
    def kv_geom(self) -> TileGeom:
        return SwizzledGeom(self.block_n, self.head_dim * self.fmt.bytes, self.threads)

    @property
    def v_geom(self) -> TileGeom:
        return SwizzledGeom(self.block_n, self.dv * self.fmt.bytes, self.threads)

    @property
    def q_region_bytes(self) -> int:
        """Q, and after the loop the padded O staging tile of the epilogue, 1024-aligned."""
        need = max(self.q_geom.bytes, self.o_geom.bytes)
        return -(-need // SWIZZLE_PERIOD) * SWIZZLE_PERIOD

    @property
    def smem_bytes(self) -> int:
        bars = barrier_bytes(self.num_stages, self.warp_specialize) if self.tma else 0
        return self.q_region_bytes + self.num_stages * (self.kv_geom.bytes + self.v_geom.bytes) + bars

    @property
    def registers_estimate(self) -> int:   # S and O accumulators, P, per thread
        return self.block_n // 2 + self.dv // 2 + self.block_n // 4 + 40


def configure(spec: KernelSpec, target: Target) -> WgmmaConfig:
    given = spec.tile_dict()
    d, dv = spec.head_dim, head_dim_v(spec)
    # 128 keys a tile where O has at most 128 columns (64 registers) and the stages fit
    # (DeepSeek's 192 / 128: 208 KiB); else 64 (d256: O alone is 128 registers)
    bm, bn, stages = 128, 128, 2
    if dv > 128 or _config(spec, target, bm, 128, stages, "tma", False).smem_bytes > target.max_smem_per_cta:
        bn = 64
    if "num_warps" in given and "block_m" not in given:
        bm = 16 * given["num_warps"]
    bm, bn, stages = given.get("block_m", bm), given.get("block_n", bn), given.get("num_stages", stages)
    loads = given.get("kv_loads", "tma")
    if bm % ROWS_PER_WARPGROUP or bm > 192:
        raise SpecError(f"block_m = {bm} on {target}: the wgmma prefill kernel gives each "
                        f"warpgroup 64 query rows, so block_m must be 64 or 128 (192: three "
                        f"consumer warpgroups of the warp-specialised kernel)", key="tile.block_m")
    if bm == 192 and max(d, dv) > 64:   # 160 registers per consumer thread (setmaxnreg)
        raise SpecError(f"block_m = 192 with head_dim {d}" + (f" / head_dim_v {dv}" if dv != d else "")
                        + f" on {target}: three consumer warpgroups get 160 registers per thread, "
                        f"which hold the accumulators of head dims up to 64 (ptxas spills at 128); "
                        f"use block_m = 128", key="tile.block_m")
    if bm == 192 and (loads != "tma" or given.get("warp_specialize") is False):
        raise SpecError(f"block_m = 192 on {target} takes three consumer warpgroups and a producer "
                        f"warpgroup: kv_loads = \"tma\" with warp_specialize (the default)",
                        key="tile.block_m")
    def copyable(m: int) -> bool:   # rows per pass (threads / 16-byte chunks): whole 8-row groups
        return all(2 * m % (w // 8) == 0 and 2 * m // (w // 8) % 8 == 0 for w in (d, dv))
    if loads == "cp_async" and not copyable(bm):
        fits = [m for m in (64, 128) if copyable(m)]
        width = f"head_dim {d}" + (f" / head_dim_v {dv}" if dv != d else "")
        if not fits:
            raise SpecError(f"kv_loads = \"cp_async\" with {width} on {target}: the swizzled tile "
                            f"copy moves whole 8-row groups per pass, which rows of this width "
                            f"do not allow with 128 or 256 threads; use kv_loads = \"tma\" (the "
                            f"default)", key="tile.kv_loads")
        raise SpecError(f"block_m = {bm} with {width} and kv_loads = \"cp_async\" on {target}: "
                        f"the swizzled tile copy moves whole 8-row groups per pass, which needs "
                        f"block_m = {fits[0]} ({2 * fits[0]} threads) for {width}", key="tile.block_m")
    if given.get("num_warps", bm // 16) != bm // 16:
        raise SpecError(f"num_warps = {given['num_warps']} with block_m = {bm} on {target}: the "
                        f"wgmma prefill kernel needs num_warps = block_m / 16 = {bm // 16}",
                        key="tile.num_warps")
    # a producer warpgroup by default where TMA feeds the tiles: 4-7 % faster on an H100 at d64,
    # d128 and 192 / 128 (docs/performance.md, "GPU results")
    ws = given.get("warp_specialize", loads == "tma")
    if ws and loads != "tma":
        raise SpecError(f"warp_specialize = true with kv_loads = \"{loads}\" on {target}: the "
                        f"producer warpgroup issues TMA loads; use kv_loads = \"tma\" or drop "
                        f"warp_specialize", key="tile.warp_specialize")
    pingpong = given.get("pingpong", False)
    if pingpong and not (ws and bm == 2 * ROWS_PER_WARPGROUP):
        raise SpecError(f"pingpong = true with block_m = {bm}, warp_specialize = "
                        f"{str(ws).lower()} on {target}: the consumers' ping-pong takes two "
                        f"consumer warpgroups of the warp-specialised TMA kernel (block_m = 128, "
                        f"kv_loads = \"tma\", warp_specialize = true)", key="tile.pingpong")
    cfg = _config(spec, target, bm, bn, stages, loads, ws, pingpong)
    if cfg.smem_bytes > target.max_smem_per_cta:
        raise SpecError(f"tile block_m={bm}, block_n={bn}, num_stages={stages} needs "
                        f"{cfg.smem_bytes} bytes of shared memory; {target} allows "
                        f"{target.max_smem_per_cta} per CTA: use fewer stages or a smaller tile",
                        key="tile.num_stages" if "num_stages" in given else "tile.block_n")
    return cfg


def _config(spec: KernelSpec, target: Target, bm: int, bn: int, stages: int, loads: str,
            ws: bool, pingpong: bool = False) -> WgmmaConfig:
    return WgmmaConfig(C.FORMATS[spec.dtype], spec.head_dim, True, bm, bn, bm // 16, stages,
                       loads != "tma", head_dim_v(spec), 1, kv_loads=loads, warp_specialize=ws,
                       pingpong=pingpong,
                       # .minnctapersm 1 pins the register count at entry (65536 / threads),
                       # without which ptxas drops setmaxnreg (C7508, "unable to determine
                       # register count at entry") -- and setmaxnreg's budgets assume it
                       min_ctas_per_sm=1 if ws else 0)


def resolve_tile(spec: KernelSpec, target: Target) -> dict:
    c = configure(spec, target)
    return {"block_m": c.block_m, "block_n": c.block_n, "num_warps": c.num_warps,
            "num_stages": c.num_stages, "path": "wgmma.m64nNk16", "cp_async": c.cp_async,
            "smem_swizzle": SWIZZLE, "smem_bytes": c.smem_bytes,
            **({"kv_loads": "tma"} if c.tma else {}),
            **({"warp_specialize": True, "threads": c.launch_threads, "min_ctas_per_sm": 1,
                "setmaxnreg": [c.producer_regs, c.consumer_regs]} if c.warp_specialize else {}),
            **({"pingpong": True} if c.pingpong else {})}


def swizzled_slot(b: KernelBuilder, geom: SwizzledGeom, tid: Reg) -> ThreadSlot:
    """Thread `tid` copies chunk c = tid % chunks of rows tid // chunks + i * rows_per_pass:
    slab c // 8, swizzled chunk (c % 8) ^ (row % 8). rows_per_pass is a multiple of 8, so the
    swizzle of every pass is the first one's and the pass offsets stay immediates."""
    if geom.rows_per_pass % 8 or geom.idle_threads:
        raise AssertionError(f"swizzled copy needs whole 8-row groups per pass: {geom}")
    per_slab = SWIZZLE // CHUNK
    r0 = b.div(tid, geom.chunks)
    c = b.rem(tid, geom.chunks)
    swz = b.xor(b.rem(c, per_slab), b.rem(r0, 8))
    soff = b.mad(r0, SWIZZLE, b.shl(swz, 4))
    if geom.chunks > per_slab:
        soff = b.mad(b.div(c, per_slab), geom.slab_bytes, soff)
    return ThreadSlot(geom, r0, b.mul(c, CHUNK), soff)


class WgmmaMath(MmaMath):
    """MmaMath with S = Q·Kᵀ and O += P·V on wgmma (see the module docstring)."""

    def __init__(self, b: KernelBuilder, ctx: Ctx):
        super().__init__(b, ctx)
        cfg = ctx.cfg
        self.bm = cfg.block_m
        # lane 0's warp index: the same value, but one ptxas can prove warp-uniform, so the Q
        # descriptors live in uniform registers (no R2UR per wgmma; Triton does the same)
        warpgroup = b.shr(b.shfl("idx", ctx.warp, 0), 2)
        q_rows = b.mad(warpgroup, ROWS_PER_WARPGROUP * SWIZZLE, ctx.q_smem)
        self.q_desc = b.matrix_descriptor(q_rows, CHUNK, SWIZZLE_PERIOD, SWIZZLE)
        self.s_acc = zero_regs(b, self.bn // 2, F32)   # written before use: scale_d = 0 at k 0
        # P of the last softmax, kept for the P·V of the next iteration (A fragments per k16)
        self.p_frags = [[b.mov(0, self.pair) for _ in range(4)] for _ in range(self.bn // 16)]
        self.alpha = [b.mov(1.0, F32) for _ in range(2)]

    def cta_sync(self) -> None:
        """The epilogue's barrier: the consumer warpgroups' named barrier when a producer
        warpgroup (which never reaches it) shares the CTA."""
        if getattr(self.ctx.cfg, "warp_specialize", False):
            self.b.bar_sync(CONSUMER_BARRIER, self.ctx.cfg.threads)
        else:
            self.b.bar_sync(0)

    def _k_step(self, desc: Reg, kk: int, rows: int) -> Reg:
        return k_step(self.b, desc, kk, rows)

    def issue_scores(self, k_tile: Reg) -> list[list[Reg]]:
        """Issue S = Q·Kᵀ as one commit group (not waited); returns S as n8 accumulator tiles."""
        b = self.b
        k_desc = b.matrix_descriptor(k_tile, CHUNK, SWIZZLE_PERIOD, SWIZZLE)
        b.wgmma_fence()
        for kk in range(self.d // 16):
            b.wgmma(self.s_acc, self._k_step(self.q_desc, kk, self.bm),
                    self._k_step(k_desc, kk, self.bn), self.in_type, scale_d=kk > 0)
        b.wgmma_commit()
        return [self.s_acc[4 * j:4 * j + 4] for j in range(self.bn // 8)]

    def skip_pv(self) -> None:
        """No P·V this tile: an empty group, so that scores_ready's wait_group 1 retires S."""
        self.b.wgmma_commit()

    def scores_ready(self, s: list[list[Reg]]) -> list[list[Reg]]:
        """S issued by issue_scores, complete (the P·V issued after it may still run)."""
        self.b.wgmma_wait(1)
        return s

    def pv_done(self) -> None:
        self.b.wgmma_wait(0)

    def issue_pv(self, v_tile: Reg) -> None:
        """Issue O += P·V with the packed P of the previous softmax as one commit group."""
        b = self.b
        v_desc = b.matrix_descriptor(v_tile, self.bn * SWIZZLE, SWIZZLE_PERIOD, SWIZZLE)
        acc = [r for tile in self.o for r in tile]
        b.wgmma_fence()
        for kk, a in enumerate(self.p_frags):   # keys 16kk..16kk+15: 2 swizzle periods further
            desc = v_desc if kk == 0 else b.add(v_desc, Imm(kk * 2 * SWIZZLE_PERIOD >> 4, U64))
            b.wgmma(acc, a, desc, self.in_type, scale_d=True, trans_b=1)
        b.wgmma_commit()

    def softmax_early(self, s: list[list[Reg]]) -> tuple[list[list[Reg]], Reg]:
        """MmaMath.softmax up to the probabilities, touching neither O nor P (a P·V that reads
        them may still be in flight): row max, the warp-uniform lazy-rescale vote, the
        exponentials, then (in a branch) the new m, alpha and the row sums' rescale. Returns
        (probs, rescale)."""
        b = self.b
        rows = [[acc[2 * r + e] for acc in s for e in range(2)] for r in range(2)]
        cands = []
        for r in range(2):
            mx = rows[r][0]
            for x in rows[r][1:]:
                mx = b.max(mx, x)
            for off in (1, 2):
                mx = b.max(mx, b.shfl("bfly", mx, off))
            cands.append(b.max(self.m[r], b.mul(mx, self.scale_log2)))
        grow = b.max(b.sub(cands[0], self.m[0]), b.sub(cands[1], self.m[1]))
        for off in (4, 8, 16):
            grow = b.max(grow, b.shfl("bfly", grow, off))
        rescale = b.setp("gt", grow, RESCALE_SLACK)
        # the exponentials first, against the max this tile will use (branch-free), so that
        # they sit in the basic block before the rescale branch and the wait that follows it
        m_use = [b.selp(cands[r], self.m[r], rescale) for r in range(2)]
        probs = []
        for r in range(2):
            neg = b.neg(C.safe_max(b, m_use[r]))
            probs.append([b.ex2(b.fma(x, self.scale_log2, neg)) for x in rows[r]])
        with b.if_then(rescale):
            for r in range(2):
                b.mov(C.rescale_factor(b, self.m[r], C.safe_max(b, cands[r])), out=self.alpha[r])
                for e in range(2):
                    b.mul(self.l_acc[2 * r + e], self.alpha[r], out=self.l_acc[2 * r + e])
                b.mov(cands[r], out=self.m[r])
        return probs, rescale

    def softmax_late(self, probs: list[list[Reg]], rescale: Reg) -> None:
        """After the previous P·V retired: O *= alpha (when rescaling), P packed into the
        registers the next P·V reads, the row sums by mma.sync against ones."""
        b = self.b
        with b.if_then(rescale):
            for r in range(2):
                for acc in self.o:
                    for e in range(2):
                        b.mul(acc[2 * r + e], self.alpha[r], out=acc[2 * r + e])
        self.pack_probs(probs)
        self.add_row_sums()

    def pack_probs(self, probs: list[list[Reg]]) -> None:
        """P rounded to f16x2/bf16x2 pairs in the A-fragment registers of the next P·V."""
        for jn in range(self.bn // 8):   # n8 tile jn is half of k-step jn // 2
            frag = self.p_frags[jn // 2]
            for r in range(2):
                self.b.cvt_pack(self.pair, probs[r][2 * jn + 1], probs[r][2 * jn],
                                out=frag[2 * (jn % 2) + r])

    def add_row_sums(self) -> None:
        """The packed P's row sums, by mma.sync against a fragment of ones."""
        for a in self.p_frags:
            self.b.mma_m16n8k16(a, (self.ones, self.ones), self.l_acc, self.in_type,
                                out=self.l_acc)


def k_step(b: KernelBuilder, desc: Reg, kk: int, rows: int) -> Reg:
    """Descriptor (wgmma's or tcgen05's: the start field is the same) of k16 step kk of a
    K-major operand of `rows` rows in 128-byte swizzled slabs: +32 B per step inside a slab,
    + rows x 128 B per slab (the start field counts 16-byte units)."""
    off = (kk % 4) * 32 + (kk // 4) * rows * SWIZZLE
    return desc if off == 0 else b.add(desc, Imm(off >> 4, U64))


def tensor_map_params(b: KernelBuilder, spec: KernelSpec, cfg: WgmmaConfig, params: list) -> dict:
    """The q/k/v tensor-map parameters of the TMA loads (appended to `params`): one box is a
    64-element (128-byte) column slab of block_m (Q) or block_n (K, V) rows of one head."""
    from ...ir import TMAP
    from ..base import LaunchParam, ParamSource
    maps = {}
    for t, rows in (("q", cfg.block_m), ("k", cfg.block_n), ("v", cfg.block_n)):
        box = (SWIZZLE // cfg.fmt.bytes, 1, rows, 1)    # innermost first: d, head, seq, batch
        src = ParamSource("tensor_map", tensor=t, box=box, swizzle=SWIZZLE)
        params.append(LaunchParam(f"{t}_tmap", TMAP, src))
        maps[t] = b.param(f"{t}_tmap", TMAP)
    return maps


@dataclass(frozen=True)
class Setup:
    """What both wgmma prefill bodies (cp.async here, TMA in prefill_tma.py) start from."""

    tid: Reg
    lane: Reg
    warp: Reg
    head: Reg
    batch: Reg
    kv_head: Reg
    m_start: Reg
    head_base: object     # (tensor, head) -> u64 address of (batch, head)
    key_offset: Reg
    n_tiles: Reg
    n_full: Reg
    first_tile: Reg | None
    lo_full: Reg | None
    variant: object
    sq: Reg
    sk: Reg
    smem: Reg
    k_smem: Reg
    v_smem: Reg

    def ctx(self, spec: KernelSpec, cfg: WgmmaConfig, ptrs, strides, seq_q, seq_k) -> Ctx:
        """The tile math's context (emits the o row address where it is called)."""
        return Ctx(spec, cfg, self.tid, self.lane, self.warp, self.batch, self.head, self.m_start, seq_q, seq_k,
                   self.key_offset, self.smem, self.head_base("o", self.head), strides[("o", 1)],
                   ptrs.get("lse"), self.variant, ptrs.get("sinks"), ptrs.get("alibi_slopes"))


def setup(b: KernelBuilder, spec: KernelSpec, cfg: WgmmaConfig, ptrs, strides, seq_q, seq_k) -> Setup:
    """The CTA's place, its tile range and the shared-memory regions (Q, then the K and V stages)."""
    tid, lane, warp, head, batch, kv_head, m_start, head_base = cta_coords(b, spec, cfg.block_m, ptrs, strides)
    key_offset, n_tiles, n_full, first_tile, lo_full, variant = tile_range(
        b, spec, cfg.block_m, cfg.block_n, m_start, seq_q, seq_k)
    sq, sk = b.bitcast(seq_q, S32), b.bitcast(seq_k, S32)
    smem = b.address_of(b.shared("prefill_smem", 0, align=SWIZZLE_PERIOD))
    k_smem = b.add(smem, cfg.q_region_bytes)
    v_smem = b.add(k_smem, cfg.num_stages * cfg.kv_geom.bytes)   # then V's stages (then barriers)
    return Setup(tid, lane, warp, head, batch, kv_head, m_start, head_base, key_offset, n_tiles, n_full,
                 first_tile, lo_full, variant, sq, sk, smem, k_smem, v_smem)


def emit_body(b: KernelBuilder, spec: KernelSpec, cfg: WgmmaConfig, ptrs, strides, seq_q, seq_k):
    """prefill.py's body with the swizzled tiles and WgmmaMath (same tile range and masks), K/V
    tiles by per-thread cp.async (tile.kv_loads = "tma" runs prefill_tma.emit_tma_prefill)."""
    bn, stages = cfg.block_n, cfg.num_stages
    s = setup(b, spec, cfg, ptrs, strides, seq_q, seq_k)
    n_tiles, n_full, first_tile, lo_full, variant = s.n_tiles, s.n_full, s.first_tile, s.lo_full, s.variant
    sq, sk, smem, k_smem, v_smem = s.sq, s.sk, s.smem, s.k_smem, s.v_smem
    kv_bytes = cfg.kv_geom.bytes
    q_slot, kv_slot = swizzled_slot(b, cfg.q_geom, s.tid), swizzled_slot(b, cfg.kv_geom, s.tid)
    slots = {"k": kv_slot,
             "v": kv_slot if cfg.dv == cfg.head_dim else swizzled_slot(b, cfg.v_geom, s.tid)}
    gq = global_rows(b, q_slot, s.head_base("q", s.head), strides[("q", 1)])
    gkv = {t: global_rows(b, slots[t], s.head_base(t, s.kv_head), strides[(t, 1)]) for t in "kv"}
    math = WgmmaMath(b, s.ctx(spec, cfg, ptrs, strides, seq_q, seq_k))

    next_addr = {t: b.mov(b.bitcast(gkv[t].thr_base, S64)) for t in "kv"}
    tile_step = {t: b.mul(gkv[t].row_stride, bn) for t in "kv"}
    if first_tile is not None:
        for t in "kv":
            b.mad(b.cvt(S64, first_tile), tile_step[t], next_addr[t], out=next_addr[t])

    def load_kv(t: str, tile: Reg, stage_off):
        with b.if_then(b.setp("lt", tile, n_tiles)):
            row0 = b.mul(tile if first_tile is None else b.add(tile, first_tile), bn)
            base = b.add(k_smem if t == "k" else v_smem, stage_off)
            load_tile(b, slots[t], gkv[t], row0, b.sub(sk, b.bitcast(row0, S32)), base, True,
                      first_addr=next_addr[t])
        b.add(next_addr[t], tile_step[t], out=next_addr[t])
        b.cp_async_commit()

    def key0_of(j: Reg) -> Reg:
        return b.mul(j if first_tile is None else b.add(j, first_tile), bn)

    load_tile(b, q_slot, gq, s.m_start, b.sub(sq, b.bitcast(s.m_start, S32)), smem, True)
    run_wgmma_pipeline(b, stages=stages, kv_bytes=kv_bytes, v_bytes=cfg.v_geom.bytes, k_smem=k_smem,
                       v_smem=v_smem, n_tiles=n_tiles, n_full=n_full, key0_of=key0_of, load_kv=load_kv,
                       math=math, lo_full=lo_full,
                       transform=math.transform if variant.transforms else None)
    math.epilogue()
