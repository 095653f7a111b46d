"""TOML spec files -> validated `KernelSpec`s.

Order of work per file: decode + parse TOML, check the top-level tables, merge [defaults] into
each [[kernel]], expand list-valued fields into the cartesian product, then validate every
expanded kernel field by field against its family's `Field` table. Every error names the file,
the kernel (name and index), the key path, the value given and what is allowed.
"""

from __future__ import annotations

import difflib
import itertools
import math
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..errors import SpecError
from ..targets import DEFAULT_TARGETS, TARGETS
from .fields import REQUIRED, SCALE_ALLOWED, SCALE_CHECK, Field, check_name, int_range
from .model import KernelSpec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MAX_EXPANSION = 4096  # kernels one [[kernel]] entry may expand to
MAX_SPEC_BYTES = 16 << 20   # a spec file larger than this is not a spec (and /dev/zero never ends)
TOP_LEVEL_KEYS = ("defaults", "kernel")

_heads_check, _heads_allowed = int_range(1, 1024)


def _check_targets(v: list[str]) -> str | None:
    if not v:
        return "a non-empty list of targets"
    bad = [t for t in v if t not in TARGETS]
    if bad:
        near = difflib.get_close_matches(bad[0], TARGETS, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        return f"targets from {', '.join(TARGETS)}; {bad[0]!r} is not one{hint}"
    if len(set(v)) != len(v):
        return "a list without repeated targets"
    return None


COMMON_FIELDS: tuple[Field, ...] = (
    Field("name", "str", "kernel name, unique within a build; may contain {field} placeholders",
          check=check_name, allowed="[a-z][a-z0-9_]*", expandable=False),
    Field("family", "str", "kernel family", expandable=False),  # choices filled from registry
    Field("dtype", "str", "element type of Q, K, V, O (accumulation is always f32)",
          choices=("f32", "f16", "bf16")),
    Field("num_heads", "int", "query heads", check=_heads_check, allowed=_heads_allowed),
    Field("num_kv_heads", "int", "key/value heads (GQA/MQA); must divide num_heads",
          default=None, check=_heads_check, allowed=_heads_allowed),
    Field("softmax_scale", "float", "scale applied to Q.K^T; default 1/sqrt(head_dim)",
          default=None, check=SCALE_CHECK, allowed=SCALE_ALLOWED),
    Field("targets", "str_list", "SM targets to build for", default=list(DEFAULT_TARGETS),
          check=_check_targets, allowed=f"list of {', '.join(TARGETS)}", expandable=False),
)


def load_paths(paths: Iterable[str | Path], *, families: Mapping[str, Any]) -> list[KernelSpec]:
    """Load every spec file (directories: their *.toml, sorted); names must be unique overall.
    `families`: family name -> its rules (fields, implied, derive, validate) -- the kernels
    layer's registry, passed down (ptxc.kernels.load_paths binds it), so that this layer never
    imports the kernels."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = _toml_files(p)
            if not found:
                raise SpecError("directory holds no *.toml spec files", file=str(p))
            files.extend(found)
        elif p.exists():
            files.append(p)   # load_file refuses anything but a regular file
        else:
            raise SpecError("no such file or directory", file=str(p))
    specs: list[KernelSpec] = []
    seen: dict[str, str] = {}
    for f in files:
        for spec in load_file(f, families=families):
            if spec.name in seen:
                raise SpecError(f"duplicate kernel name (first defined at {seen[spec.name]})",
                                file=str(f), kernel=repr(spec.name), key="name")
            seen[spec.name] = spec.source
            specs.append(spec)
    return specs


# A spec directory is a project's, not a file system: `ptxc build /` (or a home directory) is
# refused after this many entries instead of walking everything below it.
MAX_SPEC_DIR_ENTRIES = 100_000


def _toml_files(root: Path) -> list[Path]:
    """Every *.toml under `root`, sorted; a subdirectory that cannot be read is an error (a
    silently skipped directory would silently drop kernels), and so is a tree of more than
    MAX_SPEC_DIR_ENTRIES entries."""
    import os

    def fail(e: OSError):
        raise SpecError(f"cannot read directory: {e.strerror}", file=str(e.filename))
    found, seen = [], 0
    for dirpath, dirnames, filenames in os.walk(root, onerror=fail):
        seen += len(dirnames) + len(filenames)
        if seen > MAX_SPEC_DIR_ENTRIES:
            raise SpecError(f"more than {MAX_SPEC_DIR_ENTRIES} entries under this directory: name the "
                            f"spec files or the directory that holds them", file=str(root))
        dirnames.sort()
        found += [Path(dirpath, f) for f in filenames if f.endswith(".toml")]
    return sorted(found)


def load_file(path: str | Path, *, families: Mapping[str, Any]) -> list[KernelSpec]:
    from ..files import read_regular_file
    path = Path(path)
    try:
        data = read_regular_file(path, MAX_SPEC_BYTES)
    except OSError as e:
        why = e.strerror or str(e)
        if path.is_symlink() and path.resolve().is_file():   # a symlink to a spec is fine
            return load_file(path.resolve(), families=families)
        raise SpecError(f"cannot read: {why} (spec files must be regular files of at most "
                        f"{MAX_SPEC_BYTES >> 20} MiB)", file=str(path)) from None
    return load_text(data, str(path), families=families)


def load_text(data: bytes | str, filename: str = "<string>", *,
              families: Mapping[str, Any]) -> list[KernelSpec]:
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise SpecError(f"not UTF-8 text (byte {e.start} is {data[e.start]:#04x})",
                            file=filename) from None
    try:
        doc = tomllib.loads(data)
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"malformed TOML: {e}", file=filename) from None
    except RecursionError:
        raise SpecError("malformed TOML: arrays or tables nested too deeply", file=filename) from None
    _check_keys(doc, TOP_LEVEL_KEYS, filename, None, "")
    defaults = doc.get("defaults", {})
    if not isinstance(defaults, dict):
        raise SpecError("expected a table [defaults]", file=filename, key="defaults")
    entries = doc.get("kernel")
    if entries is None:
        raise SpecError("no [[kernel]] entries", file=filename)
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise SpecError("expected an array of tables [[kernel]]", file=filename, key="kernel")
    if not entries:
        raise SpecError("no [[kernel]] entries (kernel = [] declares none)", file=filename, key="kernel")
    specs: list[KernelSpec] = []
    names: dict[str, int] = {}
    for index, entry in enumerate(entries):
        label = f"#{index}" + (f" {entry['name']!r}" if isinstance(entry.get("name"), str) else "")
        try:
            for spec in _expand_entry(_merge_defaults(defaults, entry), f"{filename}[{index}]", index,
                                      families):
                if spec.name in names:
                    raise SpecError(f"duplicate kernel name after expansion (also made by "
                                    f"kernel #{names[spec.name]})", key="name",
                                    kernel=f"#{index} {spec.name!r}")
                names[spec.name] = index
                specs.append(spec)
        except SpecError as e:
            raise e.with_context(file=filename, kernel=label) from None
    return specs


def _merge_defaults(defaults: dict, entry: dict) -> dict:
    merged = {**defaults, **entry}
    if isinstance(defaults.get("tile"), dict) and isinstance(entry.get("tile"), dict):
        merged["tile"] = {**defaults["tile"], **entry["tile"]}
    return merged


def _check_keys(table: dict, allowed: Iterable[str], file, kernel, prefix: str) -> None:
    allowed = list(allowed)
    for key in table:
        if key not in allowed:
            near = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise SpecError(f"unknown key{hint} (allowed: {', '.join(allowed)})",
                            file=file, kernel=kernel, key=prefix + str(key))


def _family_of(entry: dict, FAMILIES: Mapping[str, Any]):
    family = entry.get("family")
    if family is None:
        raise SpecError(f"missing required key (allowed: {', '.join(FAMILIES)})", key="family")
    if not isinstance(family, str) or family not in FAMILIES:
        near = difflib.get_close_matches(str(family), FAMILIES, n=1) if isinstance(family, str) else []
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise SpecError(f"got {family!r}, allowed: {' | '.join(FAMILIES)}{hint}", key="family")
    return FAMILIES[family]


def _expand_entry(entry: dict, source: str, index: int, families: Mapping[str, Any]) -> list[KernelSpec]:
    family = _family_of(entry, families)
    fields = {f.name: f for f in COMMON_FIELDS + family.fields.fields}
    tile_fields = family.fields.tile_by_name()
    _check_keys(entry, list(fields) + ["tile"], None, None, "")
    tile = entry.get("tile", {})
    if not isinstance(tile, dict):
        raise SpecError(f"got {tile!r}, expected a table [kernel.tile]", key="tile")
    _check_keys(tile, tile_fields, None, None, "tile.")

    # Lists in expandable scalar fields become axes of a cartesian product, in table order.
    axes: list[tuple[str, list]] = []
    for key, f in list(fields.items()) + [("tile." + k, f) for k, f in tile_fields.items()]:
        value = tile.get(key[5:]) if key.startswith("tile.") else entry.get(key)
        if isinstance(value, list) and f.kind != "str_list":
            if not f.expandable:
                raise SpecError(f"got a list, but {key} cannot be expanded", key=key)
            if not value:
                raise SpecError("got an empty list; a list expands to one kernel per value", key=key)
            axes.append((key, value))
    count = math.prod(len(v) for _, v in axes)
    if count > MAX_EXPANSION:
        raise SpecError(f"list fields expand to {count} kernels; at most {MAX_EXPANSION} per "
                        f"[[kernel]] entry", key=", ".join(k for k, _ in axes))
    name = entry.get("name")
    if name is None:
        raise SpecError("missing required key", key="name")
    if not isinstance(name, str):
        raise SpecError(f"got {name!r}, expected a string", key="name")

    specs = []
    for combo in itertools.product(*(v for _, v in axes)):
        chosen = dict(zip((k for k, _ in axes), combo))
        flat = {k: v for k, v in entry.items() if k != "tile"}
        flat_tile = dict(tile)
        for key, value in chosen.items():
            if key.startswith("tile."):
                flat_tile[key[5:]] = value
            else:
                flat[key] = value
        flat["name"] = _expanded_name(name, chosen, flat, flat_tile)
        try:
            specs.append(_build_spec(family, fields, tile_fields, flat, flat_tile, source))
        except SpecError as e:  # name the expanded kernel, not just the entry
            raise SpecError(e.detail, key=e.key, kernel=f"#{index} {flat['name']!r}") from None
    return specs


def _check_placeholders(template: str) -> None:
    """Placeholders are plain field names: no attribute/index access, conversion or format spec
    (`{dtype.foo}` or `{dtype:>2000000000}` would crash or allocate gigabytes)."""
    import string
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as e:
        raise SpecError(f"bad placeholder in {template[:80]!r}: {e}", key="name") from None
    for _, field, spec, conv in parts:
        if field is not None and (not field.isidentifier() or spec or conv):
            shown = "{" + field + (f"!{conv}" if conv else "") + (f":{spec}" if spec else "") + "}"
            raise SpecError(f"bad placeholder {shown[:60]!r}; placeholders are plain field names "
                            f"such as {{dtype}} or {{tile_block_n}}", key="name")


def _expanded_name(template: str, chosen: dict, flat: dict, tile: dict) -> str:
    if "{" in template or "}" in template:
        _check_placeholders(template)
        values = {**{k: _slug(v) for k, v in flat.items()},
                  **{"tile_" + k: _slug(v) for k, v in tile.items()}}
        try:
            return template.format(**values)
        except (KeyError, IndexError, ValueError) as e:
            raise SpecError(f"bad placeholder {e} in {template!r}; placeholders name spec fields "
                            f"(tile fields as tile_<field>)", key="name") from None
    suffix = "".join(f"_{k.replace('tile.', '')}{_slug(v)}" for k, v in chosen.items())
    return template + suffix


def _slug(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value).replace(".", "p").replace("-", "m").lower()


def _build_spec(family, fields: dict[str, Field], tile_fields: dict[str, Field], flat: dict,
                tile: dict, source: str) -> KernelSpec:
    values: dict[str, Any] = {}
    flat = {**family.implied, **flat}
    if flat.get("family") == "kv_append" and "num_heads" not in flat and not flat.get("rope"):
        # Only RoPE on the queries (q -> q_rot) needs the query head count; without it
        # num_kv_heads alone shapes the kernel, and num_heads is accepted for symmetry.
        if "num_kv_heads" not in flat:
            raise SpecError("missing required key (kv_append needs num_kv_heads, or num_heads "
                            "for symmetry with decode specs; allowed: 1 ... 1024)", key="num_kv_heads")
        flat = {**flat, "num_heads": flat["num_kv_heads"]}
    for key, f in fields.items():
        if key not in flat:
            if f.default is REQUIRED:
                raise SpecError(f"missing required key ({f.doc}; allowed: {f.describe_allowed()})",
                                key=key)
            values[key] = f.default
            continue
        if key == "family":
            values[key] = flat[key]
            continue
        values[key], why = f.validate(flat[key])
        if why:
            raise SpecError(why, key=key)
    checked_tile = {}
    for key, value in sorted(tile.items()):
        checked_tile[key], why = tile_fields[key].validate(value)
        if why:
            raise SpecError(why, key="tile." + key)

    if family.derive is not None:
        family.derive(values)
    if values["num_kv_heads"] is None:
        values["num_kv_heads"] = values["num_heads"]
    if values["num_heads"] % values["num_kv_heads"]:
        raise SpecError(f"num_heads = {values['num_heads']} is not divisible by num_kv_heads = "
                        f"{values['num_kv_heads']}; allowed: a divisor of num_heads",
                        key="num_kv_heads")
    if values["softmax_scale"] is None:
        values["softmax_scale"] = 1.0 / math.sqrt(values["head_dim"])
    common = {f.name for f in COMMON_FIELDS} | {"head_dim"}
    options = tuple(sorted((k, v) for k, v in values.items() if k not in common))
    spec = KernelSpec(
        name=values["name"], family=values["family"], dtype=values["dtype"],
        head_dim=values["head_dim"], num_heads=values["num_heads"],
        num_kv_heads=values["num_kv_heads"], softmax_scale=values["softmax_scale"],
        targets=tuple(values["targets"]), options=options, tile=tuple(checked_tile.items()),
        source=source)
    family.validate(spec)
    return spec


def spec_from_record(data: Any, where: str = "<metadata>", *, families: Mapping[str, Any]) -> KernelSpec:
    """The KernelSpec a recorded normalised spec (metadata's `spec`) stands for, validated by
    exactly the rules a spec file passes; SpecError unless it is valid and already normalised
    (re-normalising it gives back the same record)."""
    if not isinstance(data, dict):
        raise SpecError("recorded spec is not a table", file=where)
    entry = {k: v for k, v in data.items() if v is not None}   # None = "the default" in records
    lists = [k for k, v in entry.items() if isinstance(v, list) and k != "targets"]
    tile = entry.get("tile")
    if lists or (isinstance(tile, dict) and any(isinstance(v, list) for v in tile.values())) \
            or "{" in str(entry.get("name", "")):
        raise SpecError("recorded spec is not normalised (lists or placeholders)", file=where)
    specs = _expand_entry(entry, where, 0, families)
    if len(specs) != 1 or specs[0].to_dict() != data:
        raise SpecError("recorded spec is not in normalised form (defaults or values differ "
                        "from what the spec rules give)", file=where)
    return specs[0]
