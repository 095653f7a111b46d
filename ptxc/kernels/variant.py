"""The attention variant seam: which keys a query row sees, how a visible score is transformed,
and how a row's softmax is finished — each answered in one place, for every family that uses it
(today: varlen; see /work/shared/notes/attention-variants.md and docs/kernels.md).

Coordinates are a sequence's own: a query at absolute position `pos` (0-based, bottom-right
aligned: the queries are the last q_len positions of a sequence of kv_len keys) sees the keys
[0, key_end(pos, kv_len)). A later sliding window adds a key_begin; soft-cap and ALiBi fill
`transform_scores`; attention sinks join in `finish` (today prefill.finish_rows).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir import KernelBuilder, Reg


@dataclass(frozen=True)
class AttentionVariant:
    causal: bool

    @classmethod
    def from_spec(cls, spec) -> "AttentionVariant":
        return cls(causal=bool(spec.opt("causal")))

    def key_end(self, b: KernelBuilder, pos: Reg, kv_len: Reg) -> Reg:
        """s32 end of the keys a query at position `pos` (s32) sees; may be <= 0 (sees none)."""
        if not self.causal:
            return kv_len
        return b.min(kv_len, b.add(pos, 1))

    def transform_scores(self, b: KernelBuilder, scores: list, key0: Reg) -> None:
        """Per-score modifiers (soft-cap, ALiBi) before the row max; none yet: emits nothing."""
        return None


__all__ = ["AttentionVariant"]
