"""Declarative spec fields: type, default, allowed values, and a one-line description.

Each kernel family declares its fields as a tuple of `Field`s; the loader, `ptxc list` and
docs/spec.md are all driven by these tables, so an allowed value is written down exactly once.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

REQUIRED = object()  # sentinel default: the key must be given
NAME_RE = re.compile(r"[a-z][a-z0-9_]*\Z")
MAX_NAME_LEN = 96


@dataclass(frozen=True)
class Field:
    name: str
    kind: str                        # "int" | "float" | "bool" | "str" | "str_list" | "int_or_auto"
    doc: str
    default: Any = REQUIRED          # a value, REQUIRED, or None (= chosen by the family)
    choices: tuple | None = None     # allowed values (for str/int kinds)
    check: Callable[[Any], str | None] | None = None   # returns what is allowed, if value is bad
    allowed: str = ""                # human text for `ptxc list` when `check` is used
    expandable: bool = True          # may be given as a list to expand into several kernels

    def describe_allowed(self) -> str:
        if self.choices is not None:
            return " | ".join(_show(c) for c in self.choices)
        return self.allowed or self.kind

    def validate(self, value: Any) -> tuple[Any, str | None]:
        """Coerce `value` (from TOML) to this field's type; return (value, error text)."""
        ok = {
            "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
            "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
            "bool": lambda v: isinstance(v, bool),
            "str": lambda v: isinstance(v, str),
            "str_list": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
            "int_or_auto": lambda v: v == "auto" or (isinstance(v, int) and not isinstance(v, bool)),
        }[self.kind](value)
        if not ok:
            want = {"int": "an integer", "float": "a number", "bool": "true or false",
                    "str": "a string", "str_list": "a list of strings",
                    "int_or_auto": 'an integer or "auto"'}[self.kind]
            return value, f"got {_show(value)} ({_toml_type(value)}), expected {want}"
        if self.kind == "float":
            value = float(value)
            if not math.isfinite(value):
                return value, f"got {_show(value)}, expected a finite number"
        if self.choices is not None and value not in self.choices:
            return value, f"got {_show(value)}, allowed: {self.describe_allowed()}"
        if self.check is not None and value != "auto" and (why := self.check(value)):
            return value, f"got {_show(value)}, expected {why}"
        return value, None


def int_range(lo: int, hi: int, multiple_of: int = 1, power_of_two: bool = False):
    """A check for integers in [lo, hi] (optionally multiples of k or powers of two)."""
    what = f"an integer from {lo} to {hi}"
    if multiple_of > 1:
        what = f"a multiple of {multiple_of} from {lo} to {hi}"
    if power_of_two:
        what = f"a power of two from {lo} to {hi}"

    def check(v: int) -> str | None:
        bad = not (lo <= v <= hi) or v % multiple_of or (power_of_two and v & (v - 1))
        return what if bad else None
    return check, what


def head_dim_range(lo: int, hi: int):
    """int_range(lo, hi, multiple_of=8) for a family's head_dim; a refused size in MLA's range
    (a latent head, kv_lora_rank + qk_rope_head_dim) says which family takes it."""
    check, what = int_range(lo, hi, multiple_of=8)

    def head_check(v: int) -> str | None:
        why = check(v)
        if why and hi < v <= 640:
            why += ('; a latent head of kv_lora_rank + qk_rope_head_dim (DeepSeek-V3, Kimi-K2: '
                    '576 = 512 + 64) is family = "mla"')
        return why
    return head_check, what


def float_range(lo: float, hi: float):
    """A check for numbers in [lo, hi]. The kernels bake such a value into f32 immediates (and
    its reciprocal, times log2(e)): the bounds keep both finite normal f32 numbers, where an
    unbounded positive number could overflow to inf (a NaN in every score) or flush to 0."""
    what = f"a number from {lo:g} to {hi:g}"
    return (lambda v: what if not (lo <= v <= hi) else None), what


# softmax_scale: the loader's field, and the range MLA's required scale names when missing
SCALE_CHECK, SCALE_ALLOWED = float_range(1e-6, 1e6)


def check_name(v: str) -> str | None:
    if NAME_RE.match(v) and len(v) <= MAX_NAME_LEN:
        return None
    return f"a name matching [a-z][a-z0-9_]* of at most {MAX_NAME_LEN} characters"


def _toml_type(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "float", str: "string", list: "array",
            dict: "table"}.get(type(v), type(v).__name__)


def _show(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class FamilyFields:
    """The fields one family accepts: top-level keys and keys of its [kernel.tile] table."""

    fields: tuple[Field, ...]
    tile: tuple[Field, ...] = field(default=())

    def by_name(self) -> dict[str, Field]:
        return {f.name: f for f in self.fields}

    def tile_by_name(self) -> dict[str, Field]:
        return {f.name: f for f in self.tile}
