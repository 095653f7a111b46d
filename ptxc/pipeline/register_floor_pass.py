"""The register-floor pass: a legality fix from ptxas's own report, after assembly.

Without a `.minnctapersm` directive ptxas caps an entry's registers at a level that keeps some
number of CTAs resident and spills what does not fit (kernels/config/register_floor.py). The
sweep measures that heuristic on the targets it covers and the kernel configs give the shapes it
found spilling `.minnctapersm 1`; elsewhere -- other targets (sm_86, sm_87, sm_100, sm_103, the
"a" variants, sm_121), tiles a user names -- it is unmeasured, and random specs found it
spilling 4-236 bytes there. So when ptxas reports spills for an entry that sets no
`.minnctapersm` of its own, the build assembles the PTX again with `.minnctapersm 1` on those
entries (ptxas may then take what they need, up to 255 registers a thread) and keeps that cubin
when it spills less. The metadata records the entries (`register_floor`); a reader re-derives
the PTX by lowering the spec and applying the same directive to exactly those entries, so the
recorded decision is checked against the PTX, and `verify --rebuild` (ptxas at hand) re-takes
it. Deterministic: the same PTX and ptxas give the same report and the same decision.
"""

from __future__ import annotations

import re

DIRECTIVE = ".minnctapersm 1"
_ENTRY = re.compile(r"^\.visible \.entry (\w+)\(", re.M)


def spill_bytes(resources: dict[str, dict], entries=None) -> int:
    """Spill stores + loads over `entries` (all of them when None)."""
    return sum(r.get("spill_stores", 0) + r.get("spill_loads", 0) for e, r in resources.items()
               if entries is None or e in entries)


def floorable(ptx: str, resources: dict[str, dict]) -> list[str]:
    """The spilling entries that set no `.minnctapersm` of their own (sorted)."""
    own = _own_floor(ptx)
    return sorted(e for e in resources if spill_bytes(resources, (e,)) and e not in own)


def _own_floor(ptx: str) -> set[str]:
    """The entries whose directives (before the body's `{`) hold a `.minnctapersm`."""
    out, current = set(), None
    for line in ptx.split("\n"):
        m = _ENTRY.match(line)
        if m:
            current = m.group(1)
        elif current is not None and line == "{":
            current = None
        elif current is not None and line.startswith(".minnctapersm"):
            out.add(current)
    return out


def apply_floor(ptx: str, entries) -> str:
    """`ptx` with `.minnctapersm 1` among the directives of each entry in `entries` (inserted
    before its body's `{`, where the printer puts it: templates/module.ptx.j2). An entry that
    does not exist or already sets its own is a ValueError (a recorded floor that does not fit
    the PTX)."""
    want = set(entries)
    own = _own_floor(ptx)
    if want & own:
        raise ValueError(f"entry {sorted(want & own)[0]} sets its own .minnctapersm")
    lines = ptx.split("\n")
    out, current, done = [], None, set()
    for line in lines:
        m = _ENTRY.match(line)
        if m:
            current = m.group(1)
        elif current is not None and line == "{":
            if current in want:
                out.append(DIRECTIVE)
                done.add(current)
            current = None
        out.append(line)
    if done != want:
        raise ValueError(f"no entry {sorted(want - done)[0]} in the PTX")
    return "\n".join(out)


__all__ = ["DIRECTIVE", "apply_floor", "floorable", "spill_bytes"]
