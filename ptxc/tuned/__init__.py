"""Tuned tile tables written by `ptxc tune` on a GPU: one JSON file per (target, device).

File `ptxc/tuned/<target>_<device-slug>.json` (docs/performance.md, "Tuned tile tables"):

    {"format": "ptxc-tuned-table", "version": 1,
     "device": "NVIDIA H100 80GB HBM3", "gpu_model": "h100-sxm", "sm": 90, "target": "sm_90",
     "date": "2026-05-01", "ptxc_version": "0.1.0", "ptxas_version": "13.5.37",
     "entries": [{"family": "prefill", "head_dim": 128, "causal": true, "dtype": "f16",
                  "tile": {"block_m": 128, "block_n": 64, "num_stages": 2, "num_warps": 8},
                  "median_ms": 1.93, "default_ms": 2.41, "candidates": 21,
                  "dims": {...}, "specs": ["..."]}]}

An entry is keyed by (family, head_dim, causal, dtype) — what decides the best tile; `tile`
holds spec [kernel.tile] keys, so a heuristic (or a user) applies it by giving those keys.
Files are deterministic JSON (sorted keys, entries sorted by key) so re-tuning shows as a
small diff. Writing merges into an existing file for the same target and device: entries of
other keys are kept, entries of the tuned keys are replaced.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import os
import re
from pathlib import Path
from typing import Any

FORMAT, VERSION = "ptxc-tuned-table", 1
TUNED_DIR = Path(__file__).resolve().parent
KEY_FIELDS = ("family", "head_dim", "causal", "dtype")


def entry_key(entry: dict) -> tuple:
    return tuple(entry.get(k, False if k == "causal" else None) for k in KEY_FIELDS)


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def table_path(out_dir: Path, target: str, device_name: str) -> Path:
    return Path(out_dir) / f"{target}_{device_slug(device_name)}.json"


def write_table(out_dir: Path, *, target: str, sm: int, device_name: str, entries: list[dict],
                gpu_model: str | None = None, ptxas_version: str | None = None,
                date: str | None = None) -> Path:
    """Write (merge) `entries` into the table for (target, device); returns its path."""
    from .. import __version__
    from ..files import atomic_write
    path = table_path(out_dir, target, device_name)
    merged: dict[tuple, dict] = {}
    if path.exists():
        for e in read_table(path)["entries"]:
            merged[entry_key(e)] = e
    for e in entries:
        missing = [k for k in KEY_FIELDS if k not in e] + [k for k in ("tile", "median_ms") if k not in e]
        if missing:
            raise ValueError(f"tuned entry lacks {', '.join(missing)}: {e}")
        merged[entry_key(e)] = e
    table = {"format": FORMAT, "version": VERSION, "device": device_name, "gpu_model": gpu_model,
             "sm": sm, "target": target, "date": date or _dt.date.today().isoformat(),
             "ptxc_version": __version__, "ptxas_version": ptxas_version,
             "entries": [merged[k] for k in sorted(merged, key=lambda k: tuple(str(x) for x in k))]}
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    atomic_write(path, (json.dumps(table, indent=2, sort_keys=True) + "\n").encode())
    return path


def read_table(path: Path) -> dict[str, Any]:
    data = json.loads(Path(path).read_text())
    if data.get("format") != FORMAT or data.get("version") != VERSION:
        raise ValueError(f"{path}: not a {FORMAT} v{VERSION} file")
    return data


def lookup(target: str, family: str, head_dim: int, causal: bool, dtype: str,
           device_name: str | None = None, tuned_dir: Path = TUNED_DIR) -> dict | None:
    """The tuned tile for a key on `target` (from the table of `device_name` if given, else the
    newest table for the target), or None. For the tile heuristics to consult."""
    try:   # a table written, replaced or removed changes the directory's mtime
        stamp = os.stat(tuned_dir).st_mtime_ns
    except OSError:
        return None
    tiles = _tiles(str(tuned_dir), stamp, target, device_name)
    found = tiles.get((family, head_dim, bool(causal), dtype))
    return dict(found) if found is not None else None


@functools.lru_cache(maxsize=64)
def _tiles(tuned_dir: str, stamp: int, target: str, device_name: str | None) -> dict[tuple, dict]:
    """{entry key: tile} of `target`'s tables in `tuned_dir` as of mtime `stamp`, the newest
    table's entry where several hold a key (every configure asks: reading the tables once per
    directory state keeps the tile search from re-reading them hundreds of thousands of times)."""
    paths = [table_path(Path(tuned_dir), target, device_name)] if device_name else \
        sorted(Path(tuned_dir).glob(f"{target}_*.json"))
    tables = []
    for p in paths:
        try:
            tables.append(read_table(p))
        except (OSError, ValueError):
            continue
    out: dict[tuple, dict] = {}
    for table in sorted(tables, key=lambda t: t["date"], reverse=True):
        for e in table["entries"]:
            out.setdefault(entry_key(e), e["tile"])
    return out


__all__ = ["FORMAT", "KEY_FIELDS", "TUNED_DIR", "device_slug", "entry_key", "lookup", "read_table",
           "table_path", "write_table"]
