"""Which new rows a kv_append CTA writes, and where to: kv_append's `index` option, for the
copy (kv_append.py) and the transforming append (kv_transform.py) alike.

    positions     one CTA per (token, sequence): rows k_new[b, t], cache row positions[b] + t
                  through the cache layout (contiguous, or paged by block table)
    slot_mapping  one CTA per token: rows k_new[t], cache slot slot_mapping[t] (int64, page *
                  page_size + offset) of a paged cache without block table (vLLM's
                  reshape_and_cache_flash); negative slots are padding
"""

from __future__ import annotations

from ...ir import S32, S64, U32, U64, Addr, KernelBuilder
from ...spec.model import KernelSpec
from .. import common as C
from .kv_access import KVAccess


def by_slot(spec: KernelSpec) -> bool:
    """index = "slot_mapping" (the decode family's fused append passes a spec without it)."""
    return dict(spec.options).get("index") == "slot_mapping"


def grid(spec: KernelSpec) -> tuple[str, str, str]:
    return ("num_tokens", "1", "1") if by_slot(spec) else ("num_new", "batch", "1")


class NewRows:
    """This CTA's new token: where its rows come from (k_new, v_new, q, q_rot) and which cache
    row they go to, for both indexings (module doc)."""

    def __init__(self, b: KernelBuilder, kv: KVAccess, ptrs: dict, token):
        self.b, self.kv, self.ptrs, self.token = b, kv, ptrs, token
        if kv.by_slot:
            self.batch = None
            self.row = b.ld("global", S64, Addr(C.element_offset(b, ptrs["slot_mapping"], token, b.mov(8, S64))))
            self._slot_page: dict = {}
            self.valid = kv.use_slot(b, self._slot_page, self.row)
        else:
            self.batch = b.special("%ctaid.y")
            start = b.ld("global", S32, Addr(C.element_offset(b, ptrs["positions"], self.batch, b.mov(4, S64))))
            row_s = b.add(start, b.bitcast(token, S32))
            self.valid = b.and_(b.setp("ge", row_s, 0), b.setp("lt", row_s, b.bitcast(kv.capacity(b), S32)))
            self.row = b.bitcast(row_s, U32)
            self._slot_page = None

    def page_cache(self) -> dict:
        """A fresh page cache for row_address (by slot: the slot's page, computed once)."""
        return dict(self._slot_page) if self._slot_page is not None else {}

    def source(self, name: str, head, strides: dict):
        """Byte address (s64) of head `head` of this token's row of tensor `name`."""
        b = self.b
        if self.batch is None:
            src = C.element_offset(b, self.ptrs[name], self.token, strides[(name, 0)])
            return C.element_offset(b, b.bitcast(src, U64), head, strides[(name, 1)])
        src = C.element_offset(b, self.ptrs[name], self.batch, strides[(name, 0)])
        src = C.element_offset(b, b.bitcast(src, U64), self.token, strides[(name, 1)])
        return C.element_offset(b, b.bitcast(src, U64), head, strides[(name, 2)])
