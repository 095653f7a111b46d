"""The validated, normalised kernel spec: a frozen value the rest of ptxc consumes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KernelSpec:
    """One kernel after defaults, expansion and validation.

    `options` holds the family-specific fields, `tile` only the tile fields the user gave
    (the family chooses the rest per target); both are sorted (key, value) tuples so the spec
    is hashable and its canonical form is independent of TOML key order.
    """

    name: str
    family: str
    dtype: str
    head_dim: int
    num_heads: int
    num_kv_heads: int
    softmax_scale: float
    targets: tuple[str, ...]
    options: tuple[tuple[str, Any], ...] = ()
    tile: tuple[tuple[str, Any], ...] = ()
    source: str = ""  # "file.toml" and entry index, for error messages only (not hashed)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be divisible by num_kv_heads")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 = MHA, num_heads = MQA)."""
        return self.num_heads // self.num_kv_heads

    def opt(self, key: str) -> Any:
        return dict(self.options)[key]

    def tile_dict(self) -> dict[str, Any]:
        return dict(self.tile)

    def to_dict(self) -> dict[str, Any]:
        """The normalised spec as plain JSON data (hashed into cache keys, stored in metadata)."""
        return {
            "name": self.name, "family": self.family, "dtype": self.dtype,
            "head_dim": self.head_dim, "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads, "softmax_scale": self.softmax_scale,
            "targets": list(self.targets), **dict(self.options), "tile": dict(self.tile),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "KernelSpec":
        """Inverse of to_dict (e.g. the `spec` recorded in artifact metadata)."""
        common = ("name", "family", "dtype", "head_dim", "num_heads", "num_kv_heads", "softmax_scale")
        options = tuple(sorted((k, v) for k, v in data.items() if k not in common + ("targets", "tile")))
        return cls(**{k: data[k] for k in common}, targets=tuple(data["targets"]), options=options,
                   tile=tuple(sorted(data.get("tile", {}).items())))

    def for_target_key(self, target: str, all_targets: bool = False) -> dict[str, Any]:
        """What determines the PTX of one target: the spec with only that target listed, or,
        where the family sizes a target-independent tile by all of them (`all_targets`), the
        whole spec and the target."""
        data = self.to_dict()
        if all_targets:
            data["build_target"] = target
        else:
            data["targets"] = [target]
        return data
