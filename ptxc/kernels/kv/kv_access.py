"""Where KV row `r` of (sequence b, KV head h) lives, for each cache layout.

    contiguous     k_cache [batch, max_seq_len, Hk, d]         addr = k + b*s0 + r*s1 + h*s2
    pointer_array  k_ptrs [batch] -> [max_seq_len, Hk, d]      addr = k_ptrs[b] + r*s1 + h*s2
    paged          k_cache [num_pages, page_size, Hk, d],      page = block_table[b, r / page_size]
                   block_table [batch, max_pages_per_seq]      addr = k + page*s0 + (r % page_size)*s1 + h*s2

A `latent` cache (MLA) has one row per token and no head axis: `kv_cache [num_pages, page_size,
d]` (or [batch, max_seq_len, d]); K is the whole row and V its leading head_dim_v columns, so
both views share the pointer, the strides and the row addresses.

A `sparse` cache (MLA's sparse_topk = N, DeepSeek-V3.2) is paged with no block table either:
key j of query token t reads slot indices[t, j] (page = slot / page_size, offset = slot %
page_size); a slot of -1 or outside [0, num_pages * page_size) is a missing key, never read and
masked from the scores (`key_missing`). The "sequence" of such a layout is the query token.

A paged cache `by_slot` (kv_append's `index = "slot_mapping"`, vLLM's reshape_and_cache_flash)
takes no block table: the row is a slot, page = slot / page_size, offset = slot % page_size,
and a slot outside [0, num_pages * page_size) is refused as a page id outside the cache is.

Strides are in elements and are kernel parameters. Every layout bounds the rows it may touch
(`capacity`: max_seq_len, or max_pages_per_seq * page_size) and the paged layout also refuses
page ids outside [0, num_pages): a corrupt length or block table can never read out of bounds.
Used by both the decode and the kv_append families.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...ir import S32, S64, U32, U64, Addr, KernelBuilder, Reg
from .. import common as C
from ..base import ParamSource, TensorInfo

LAYOUTS = ("contiguous", "pointer_array", "paged")
# rows per page: any count (hybrid-model engines size attention pages to match a state size);
# powers of two address with shifts, others divide by the constant
MAX_PAGE_SIZE = 1024


def latent_cache(spec) -> bool:
    """Whether the spec's kernel reads or writes a latent cache (one kv_cache whose V is K's
    leading columns): the mla and mla_append families."""
    return spec.family in ("mla", "mla_append")


def sparse_keys(spec) -> int:
    """sparse_topk of a spec (mla): keys per query token read through `indices`; 0: dense."""
    return dict(spec.options).get("sparse_topk") or 0


def check_page_size(spec) -> None:
    """page_size belongs to paged caches only."""
    from ...errors import SpecError
    if spec.opt("page_size") is not None and spec.opt("kv_layout") != "paged":
        raise SpecError(f"page_size applies only to kv_layout = \"paged\" (kv_layout is "
                        f"{spec.opt('kv_layout')!r})", key="page_size")
CACHES = ("k_cache", "v_cache")
LATENT = "kv_cache"       # a latent cache's one tensor (MLA)


@dataclass
class KVAccess:
    """Emits a layout's parameters and its per-row address arithmetic into one kernel."""

    layout: str
    fmt: C.ElemFormat
    page_size: int = 0
    regs: dict = field(default_factory=dict)
    by_slot: bool = False     # paged rows addressed by slot (page * page_size + offset), no block table
    latent: bool = False      # one kv_cache, no head axis: V is the leading columns of K's rows
    sparse: int = 0           # N > 0: key j of token t is cache slot indices[t, j] (paged, no block table)

    @property
    def block_table(self) -> bool:
        return self.layout == "paged" and not self.by_slot and not self.sparse

    @property
    def caches(self) -> tuple[str, ...]:
        """The cache tensors the caller passes: k_cache and v_cache, or the one latent kv_cache."""
        return (LATENT,) if self.latent else CACHES

    def _axes(self) -> tuple[int, ...]:
        """The stride parameters of a cache: the head axis (2) only where there is one."""
        return (1, 2) if self.layout == "pointer_array" else (0, 1) if self.latent else (0, 1, 2)

    # ---- interface ---------------------------------------------------------------------
    def tensors(self, dtype: str, kv_heads: int, head_dim: int, role: str) -> list[TensorInfo]:
        heads = () if self.latent else (kv_heads,)
        if self.layout == "paged":
            shape = ("num_pages", self.page_size, *heads, head_dim)
            if self.by_slot:
                return [TensorInfo(t, dtype, shape, role) for t in self.caches]
            if self.sparse:
                return [TensorInfo(t, dtype, shape, role) for t in self.caches] + [
                    TensorInfo("indices", "i32", ("total_q", self.sparse), "input",
                               "cache slots (page * page_size + offset) each query token attends "
                               "to; -1 or a slot outside the cache is skipped")]
            return [TensorInfo(t, dtype, shape, role) for t in self.caches] + [
                TensorInfo("block_table", "i32", ("batch", "max_pages_per_seq"), "input",
                           "page ids per sequence; entries past a sequence's length are ignored")]
        caches = [TensorInfo(t, dtype, ("batch", "max_seq_len", *heads, head_dim), role)
                  for t in self.caches]
        if self.layout == "pointer_array":
            caches = [TensorInfo(t.name, t.dtype, t.shape, t.role, "reached through "
                                 f"{t.name[0]}_ptrs: one device pointer per sequence",
                                 passed_as=f"{t.name[0]}_ptrs") for t in caches]
            caches += [TensorInfo(f"{t[0]}_ptrs", "u64", ("batch",), "input",
                                  f"device address of each sequence's [max_seq_len, Hk, d] {t}",
                                  derived_from=t) for t in CACHES]
        return caches

    def dims(self) -> tuple[str, ...]:
        if self.by_slot or self.sparse:
            return ("num_pages",)
        return ("num_pages", "max_pages_per_seq") if self.layout == "paged" else ("max_seq_len",)

    def pointer_tensors(self) -> list[str]:
        if self.layout == "pointer_array":
            return ["k_ptrs", "v_ptrs"]
        return list(self.caches) + (["block_table"] if self.block_table else []) + \
            (["indices"] if self.sparse else [])

    # ---- parameters --------------------------------------------------------------------
    def emit_strides(self, param) -> None:
        """Declare stride parameters (after all pointers): `param(name, type, source)`."""
        for t in self.caches:
            for a in self._axes():
                self.regs[(t, a)] = param(f"{t}_stride{a}", S64, ParamSource("stride", t, a))
        if self.latent:   # K and V address the same rows
            self.regs.update({(t, a): self.regs[(LATENT, a)] for t in CACHES for a in self._axes()})
        if self.block_table:
            self.regs["bt_stride"] = param("block_table_stride0", S64,
                                           ParamSource("stride", "block_table", 0))

    def emit_dims(self, param) -> None:
        for d in self.dims():
            self.regs[d] = param(d, U32, ParamSource("dim", name=d))

    def capacity(self, b: KernelBuilder) -> Reg:
        """The most rows any sequence can have in this cache (sparse: keys per token)."""
        if self.sparse:
            return b.mov(self.sparse, U32)
        if self.layout == "paged":
            return b.mul(self.regs["max_pages_per_seq"], self.page_size)
        return self.regs["max_seq_len"]

    # ---- addressing --------------------------------------------------------------------
    def bases(self, b: KernelBuilder, ptrs: dict, batch: Reg, kv_head: Reg, lane_byte: Reg) -> dict:
        """Per (sequence, head) values reused for every row: byte-stride registers and bases."""
        out = {}
        for t in CACHES:
            if self.latent and CACHES[0] in out:   # V's rows are K's: the same base and strides
                out[t] = out[CACHES[0]]
                continue
            src = LATENT if self.latent else t
            stride = {a: C.byte_stride(b, self.regs[(t, a)], self.fmt) for a in self._axes()}
            if self.layout == "contiguous":
                base = C.element_offset(b, ptrs[src], batch, stride[0])
            elif self.layout == "pointer_array":
                slot = C.element_offset(b, ptrs[f"{t[0]}_ptrs"], batch, b.mov(8, S64))
                base = b.bitcast(b.ld("global", U64, Addr(slot), nc=True), S64)
            else:
                base = b.bitcast(ptrs[src], S64)
            head = base if self.latent else C.element_offset(b, b.bitcast(base, U64), kv_head, stride[2])
            out[t] = (b.add(head, lane_byte), stride)
        if self.block_table:
            out["block_row"] = C.element_offset(b, ptrs["block_table"], batch,
                                                b.mul(self.regs["bt_stride"], 4))
        elif self.sparse:   # the token's slots; "batch" is the query token
            out["block_row"] = self.index_row(b, ptrs, batch)
        return out

    def index_row(self, b: KernelBuilder, ptrs: dict, token: Reg) -> Reg:
        """u64 address of indices[token, 0] (sparse)."""
        return C.element_offset(b, ptrs["indices"], token, b.mov(4 * self.sparse, S64))

    def row_address(self, b: KernelBuilder, bases: dict, t: str, row: Reg, valid: Reg,
                    page_cache: dict) -> tuple[Reg, Reg]:
        """(address of this lane's first chunk of row `row`, validity); `page_cache` shares
        the block-table lookup between K and V of the same row."""
        base, stride = bases[t]
        if self.layout != "paged":
            return C.element_offset(b, base, row, stride[1]), valid
        key = (row.cls, row.index)
        if key not in page_cache:
            self.use_page(b, page_cache, row, valid, self.load_page(b, bases, row, valid))
        page, ok, offset = page_cache[key]
        addr = C.element_offset(b, C.element_offset(b, b.bitcast(base, U64), page_as_s64(b, page), stride[0]),
                                offset, stride[1])
        return addr, ok


    def load_page(self, b: KernelBuilder, bases: dict, row: Reg, valid: Reg,
                  out: Reg | None = None) -> Reg:
        """The block-table entry of `row` (s32; -1 where not `valid`), into `out` if given: a
        loop can load the next iteration's page ids while this one's K/V rows are in flight."""
        entry = C.element_offset(b, bases["block_row"], row if self.sparse else self.page_of(b, row),
                                 b.mov(4, S64))
        page = b.mov(-1, S32, out=out)
        with b.predicate(valid):
            b.ld("global", S32, Addr(entry), nc=True, out=[page])
        return page

    def use_page(self, b: KernelBuilder, page_cache: dict, row: Reg, valid: Reg, page: Reg) -> None:
        """Record `page` (from load_page) as row `row`'s page for row_address, with its range
        check: ids outside [0, num_pages) make the row invalid. Sparse: `page` is the row's
        slot, valid inside [0, num_pages * page_size)."""
        if self.sparse:
            page, ok, offset = self.slot_place(b, b.cvt(S64, page))
            page_cache[(row.cls, row.index)] = (page, b.and_(ok, valid), offset)
            return
        in_range = b.and_(b.setp("ge", page, 0), b.setp("lt", page, b.bitcast(self.regs["num_pages"], S32)))
        page_cache[(row.cls, row.index)] = (page, b.and_(in_range, valid), self.offset_in_page(b, row))

    # ---- page arithmetic: shifts and masks for powers of two, else a division by a constant
    @property
    def pow2_pages(self) -> bool:
        return self.page_size & (self.page_size - 1) == 0

    def page_of(self, b: KernelBuilder, row: Reg) -> Reg:
        """Which page of its sequence row `row` (u32, or s64 >= 0) is on."""
        if self.pow2_pages:
            return b.shr(row, self.page_size.bit_length() - 1)
        return b.div(row, self.page_size)

    def offset_in_page(self, b: KernelBuilder, row: Reg) -> Reg:
        """Row `row`'s row within its page."""
        if self.pow2_pages:
            return b.and_(row, self.page_size - 1)
        return b.rem(row, self.page_size)

    def use_slot(self, b: KernelBuilder, page_cache: dict, slot: Reg) -> Reg:
        """Record the page and offset of `slot` (s64; by_slot caches) for row_address, keyed by
        the slot register; returns its validity: 0 <= slot < num_pages * page_size (negative
        slots are padding)."""
        page, ok, offset = self.slot_place(b, slot)
        page_cache[(slot.cls, slot.index)] = (page, ok, offset)
        return ok

    def slot_place(self, b: KernelBuilder, slot: Reg) -> tuple[Reg, Reg, Reg]:
        """(page s32, 0 <= slot < num_pages * page_size, offset u32) of a slot (s64)."""
        ok = self.slot_in_cache(b, slot)
        # in range, the page fits s32 (num_pages is a u32 dim < 2^31 pages of >= 1 row)
        safe = b.selp(slot, 0, ok)
        return b.cvt(S32, self.page_of(b, safe)), ok, b.cvt(U32, self.offset_in_page(b, safe))

    def slot_in_cache(self, b: KernelBuilder, slot: Reg) -> Reg:
        """pred: 0 <= slot (s64) < num_pages * page_size -- the one range check of a slot (-1
        pads; anything outside the cache is never dereferenced)."""
        slots = self.slot_count(b)
        return b.and_(b.setp("ge", slot, 0), b.setp("lt", slot, slots))

    def slot_count(self, b: KernelBuilder) -> Reg:
        return b.mul(b.cvt(S64, self.regs["num_pages"]), self.page_size)

    def key_missing(self, b: KernelBuilder, index_row: Reg, key: Reg, n_keys: Reg) -> Reg:
        """pred (sparse): key `key` (s32) of the token whose slots start at `index_row` has no
        cache row: outside [0, n_keys), or its slot is -1 or outside the cache."""
        inside = b.and_(b.setp("ge", key, 0), b.setp("lt", key, n_keys))
        slot = b.mov(-1, S32)
        with b.predicate(inside):
            b.ld("global", S32, Addr(C.element_offset(b, index_row, b.bitcast(key, U32), b.mov(4, S64))),
                 nc=True, out=[slot])
        return b.not_(self.slot_in_cache(b, b.cvt(S64, slot)))


def page_as_s64(b: KernelBuilder, page: Reg) -> Reg:
    return b.cvt(S64, page)


__all__ = ["KVAccess", "LAYOUTS", "CACHES", "LATENT", "sparse_keys"]
