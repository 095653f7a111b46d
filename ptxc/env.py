"""Every environment variable ptxc reads, parsed in one place.

A bad value is the user's input like any other: a UserError (exit 2) naming the variable, the
value and what is allowed, never a ValueError traceback from deep inside a command."""

from __future__ import annotations

import os

from .errors import UserError


def env_int(name: str, default: int, *, minimum: int = 1) -> int:
    """`$name` as an integer >= `minimum` (decimal, `_` separators allowed); `default` when unset
    or empty."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip(), 10)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise UserError(f"environment variable {name}={raw!r} is not allowed; "
                        f"expected an integer >= {minimum} (unset it for the default {default})")
    return value


def env_path(name: str) -> str | None:
    """`$name` as a path, None when unset or empty; a value with a NUL byte (which no path
    can hold) is refused by name."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    if "\0" in raw:
        raise UserError(f"environment variable {name}={raw!r} is not allowed; expected a path")
    return raw


def env_flag(name: str) -> bool:
    """`$name` as a switch: unset, empty or 0/false/no/off mean off, 1/true/yes/on mean on;
    anything else is refused by name."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return False
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise UserError(f"environment variable {name}={raw!r} is not allowed; "
                    f"expected one of 1/true/yes/on or 0/false/no/off")
