"""The attention variant seam: which keys a query row sees, how a visible score is transformed,
and how a row's softmax is finished — each answered in one place, for every family that uses it
(prefill, decode, varlen; see /work/shared/notes/attention-variants.md and docs/kernels.md).

Coordinates are a sequence's own: a query at absolute position `pos` (0-based, bottom-right
aligned: the queries are the last q_len positions of a sequence of kv_len keys) sees the keys
[key_begin(pos), key_end(pos, kv_len)). Order of operations (docs/spec.md): score → soft-cap →
ALiBi → masks (causal, window, sequence end) → online softmax → P·V.

Scores reach `transform_scores` in the family's own units: `unit · s` where s = softmax_scale ·
q·k is the score of the spec (prefill/varlen keep raw q·k, unit = 1 / softmax_scale; decode
pre-scales q into log2 units, unit = log2 e), so a transform is written once for all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import SpecError
from ..ir import U32, KernelBuilder, Reg
from ..spec.fields import Field, int_range

MAX_WINDOW = 1 << 30
_win_check, _win_allowed = int_range(1, MAX_WINDOW)


def _positive(v: float) -> str | None:
    return None if v > 0 else "a number > 0"


VARIANT_FIELDS = (
    Field("sliding_window", "int", "sliding-window attention: a query at position p sees key j "
          "iff p - j < sliding_window (the last W keys up to its own; needs causal)",
          default=None, check=_win_check, allowed=_win_allowed),
    Field("logits_soft_cap", "float", "soft-cap c: s <- c * tanh(s / c) after the softmax scale "
          "(Gemma 2: 50)", default=None, check=_positive, allowed="a number > 0"),
)


def validate_variant(spec, causal_option: bool = True) -> None:
    """Cross-key checks shared by the families: a window looks back from the query's own
    position, so prefill and varlen need causal = true (decode's query is the last position)."""
    window = spec_option(spec, "sliding_window")
    if window is not None and causal_option and not spec.opt("causal"):
        raise SpecError(f"sliding_window = {window} needs causal = true (the window is the last "
                        f"{window} keys up to the query's own position)", key="sliding_window")


def spec_option(spec, key: str):
    return dict(spec.options).get(key)


def variant_reference_args(spec) -> dict:
    """The keyword arguments of runtime.reference.attention for this spec's variant options."""
    return {"window": spec_option(spec, "sliding_window"),
            "soft_cap": spec_option(spec, "logits_soft_cap")}


@dataclass(frozen=True)
class AttentionVariant:
    causal: bool
    window: int | None = None
    soft_cap: float | None = None

    @classmethod
    def from_spec(cls, spec) -> "AttentionVariant":
        return cls(causal=bool(spec_option(spec, "causal")), window=spec_option(spec, "sliding_window"),
                   soft_cap=spec_option(spec, "logits_soft_cap"))

    @property
    def transforms(self) -> bool:
        return self.soft_cap is not None

    def key_end(self, b: KernelBuilder, pos: Reg, kv_len: Reg) -> Reg:
        """s32 end of the keys a query at position `pos` (s32) sees; may be <= 0 (sees none)."""
        if not self.causal:
            return kv_len
        return b.min(kv_len, b.add(pos, 1))

    def key_begin(self, b: KernelBuilder, pos: Reg) -> Reg | None:
        """s32 first key a query at position `pos` sees (may be < 0), or None: no lower bound."""
        if self.window is None:
            return None
        return b.sub(pos, self.window - 1)

    def first_tile(self, b: KernelBuilder, first_pos: Reg, block: int) -> Reg | None:
        """u32 first KV tile of `block` keys that the query at `first_pos` (the tile's earliest
        position) can see: tiles before it are never read. None without a window."""
        begin = self.key_begin(b, first_pos)
        if begin is None:
            return None
        return b.div(b.bitcast(b.max(begin, 0), U32), block)

    def first_unmasked_tile(self, b: KernelBuilder, last_pos: Reg, block: int) -> Reg | None:
        """u32 first tile wholly inside the window of the query at `last_pos` (the tile's
        latest position, whose window starts last): earlier visited tiles cross a window's left
        edge and run the mask. None without a window."""
        begin = self.key_begin(b, last_pos)
        if begin is None:
            return None
        return b.div(b.add(b.bitcast(b.max(begin, 0), U32), block - 1), block)

    def transform_scores(self, b: KernelBuilder, scores: list, key0: Reg, unit: float = 1.0) -> None:
        """Per-score modifiers before the masks, in place on `unit`-scaled scores (see the
        module doc): soft-cap x <- (c·unit) · tanh(x / (c·unit)). Without one: emits nothing."""
        if self.soft_cap is None:
            return None
        cap = self.soft_cap * unit
        for x in _flat(scores):
            b.mul(b.tanh(b.mul(x, 1.0 / cap)), cap, out=x)
        return None


def _flat(scores) -> list[Reg]:
    if isinstance(scores, Reg):
        return [scores]
    return [x for s in scores for x in _flat(s)]


__all__ = ["AttentionVariant", "VARIANT_FIELDS", "validate_variant", "spec_option",
           "variant_reference_args"]
