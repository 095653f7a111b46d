"""The launch-expression language used for grid sizes and workspace shapes in metadata.

    expr   := term (('+' | '-') term)*
    term   := factor (('*' | '//') factor)*
    factor := INT | NAME | '(' expr ')' | FUNC '(' expr (',' expr)* ')'
    FUNC   := cdiv | min | max          (cdiv(a, b) = ceil(a / b))

Names are runtime dimensions (batch, seq_q, ...). Integers only; `//` floors. The same grammar
is small enough to re-implement in a C or C++ loader in a few lines.

Expressions come from metadata files, which ptxc does not trust: the parser is bounded (at most
MAX_CHARS characters, MAX_DEPTH nested parentheses/calls, MAX_DIGITS-digit literals), division
or cdiv by zero and values beyond ±2^62 are errors, and every error is one InputError line.
"""

from __future__ import annotations

import re
from functools import lru_cache

from ..errors import InputError

_TOKEN = re.compile(r"\s*(?:(\d+)|([A-Za-z_][A-Za-z0-9_]*)|(//|[-+*(),]))")
FUNCS = {"cdiv": lambda a, b: -(-a // b), "min": min, "max": max}
ARITY = {"cdiv": (2, 2), "min": (1, 8), "max": (1, 8)}
MAX_CHARS = 256
MAX_DEPTH = 16
MAX_DIGITS = 12
VALUE_LIMIT = 1 << 62


@lru_cache(maxsize=512)
def parse(text: str) -> tuple:
    """Parse to a nested tuple AST: ("int", n) | ("name", s) | (op, a, b) | ("call", f, args)."""
    tokens, pos = [], 0
    text = str(text)
    if len(text) > MAX_CHARS:
        raise InputError(f"bad launch expression {text[:40]!r}...: longer than {MAX_CHARS} characters")
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            if text[pos:].strip() == "":
                break
            raise InputError(f"bad launch expression {text!r} at character {pos}")
        if m.group(1) and len(m.group(1)) > MAX_DIGITS:
            raise InputError(f"bad launch expression {text!r}: literal longer than {MAX_DIGITS} digits")
        tokens.append(m.group(1) or m.group(2) or m.group(3))
        pos = m.end()
    ast, rest = _expr(tokens, text, 0)
    if rest:
        raise InputError(f"bad launch expression {text!r}: unexpected {rest[0]!r}")
    return ast


def _expr(toks, text, depth):
    if depth > MAX_DEPTH:
        raise InputError(f"bad launch expression {text[:40]!r}...: nested deeper than {MAX_DEPTH}")
    left, toks = _term(toks, text, depth)
    while toks and toks[0] in ("+", "-"):
        op, (right, toks) = toks[0], _term(toks[1:], text, depth)
        left = (op, left, right)
    return left, toks


def _term(toks, text, depth):
    left, toks = _factor(toks, text, depth)
    while toks and toks[0] in ("*", "//"):
        op, (right, toks) = toks[0], _factor(toks[1:], text, depth)
        left = (op, left, right)
    return left, toks


def _factor(toks, text, depth):
    if not toks:
        raise InputError(f"bad launch expression {text!r}: ends early")
    tok, rest = toks[0], toks[1:]
    if tok.isdigit():
        return ("int", int(tok)), rest
    if tok == "(":
        inner, rest = _expr(rest, text, depth + 1)
        if not rest or rest[0] != ")":
            raise InputError(f"bad launch expression {text!r}: missing ')'")
        return inner, rest[1:]
    if re.match(r"[A-Za-z_]", tok):
        if rest and rest[0] == "(":
            if tok not in FUNCS:
                raise InputError(f"bad launch expression {text!r}: unknown function {tok!r}")
            args, rest = [], rest[1:]
            while True:
                arg, rest = _expr(rest, text, depth + 1)
                args.append(arg)
                if rest and rest[0] == ",":
                    rest = rest[1:]
                    continue
                if rest and rest[0] == ")":
                    lo, hi = ARITY[tok]
                    if not lo <= len(args) <= hi:
                        raise InputError(f"bad launch expression {text!r}: {tok} takes "
                                         f"{lo if lo == hi else f'{lo} to {hi}'} arguments, got {len(args)}")
                    return ("call", tok, tuple(args)), rest[1:]
                raise InputError(f"bad launch expression {text!r}: missing ')' after {tok}(")
        return ("name", tok), rest
    raise InputError(f"bad launch expression {text!r}: unexpected {tok!r}")


def evaluate(text: str | int, env: dict[str, int]) -> int:
    if isinstance(text, int):
        return text
    return _eval(parse(text), env, text)


def names(text: str | int) -> set[str]:
    if isinstance(text, int):
        return set()
    out: set[str] = set()

    def walk(node):
        if node[0] == "name":
            out.add(node[1])
        elif node[0] == "call":
            for a in node[2]:
                walk(a)
        elif node[0] != "int":
            walk(node[1])
            walk(node[2])
    walk(parse(text))
    return out


def _eval(node, env, text):
    kind = node[0]
    if kind == "int":
        return node[1]
    if kind == "name":
        if node[1] not in env:
            raise InputError(f"launch expression {text!r} needs {node[1]!r}, which is not known "
                             f"(known: {', '.join(sorted(env)) or 'none'})")
        return _bounded(int(env[node[1]]), text)
    if kind == "call":
        args = [_eval(a, env, text) for a in node[2]]
        if node[1] == "cdiv" and args[1] == 0:
            raise InputError(f"launch expression {text!r} divides by zero")
        return _bounded(FUNCS[node[1]](*args), text)
    a, b = _eval(node[1], env, text), _eval(node[2], env, text)
    if kind == "//" and b == 0:
        raise InputError(f"launch expression {text!r} divides by zero")
    return _bounded({"+": a + b, "-": a - b, "*": a * b, "//": a // b if b else 0}[kind], text)


def _bounded(value: int, text) -> int:
    if not -VALUE_LIMIT <= value <= VALUE_LIMIT:
        raise InputError(f"launch expression {text!r} overflows (|value| > 2^62)")
    return value
