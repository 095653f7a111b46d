"""Declarations in PTX text: registers, shared variables and kernel parameters (scalars and
by-value structs). Used by parser.py."""

from __future__ import annotations

import re

from ptxc.emu.ptx_ast import Param, SharedVar
from ptxc.errors import EmulationError

_IDENT = r"[A-Za-z_$%][\w$]*"
_RANGE_DECL = re.compile(r"(%?[\w$]+)<(\d+)>$")
SIZED_VAR = re.compile(r"([\w$]+)\s*\[\s*(\d*)\s*\]$")


def fail(line: int, text: str, msg: str) -> EmulationError:
    return EmulationError(f"PTX parse error at line {line}: {msg}: `{text.strip()}`")


def split_top(s: str, sep: str) -> list:
    """Split on `sep` outside of [] and {}."""
    out, depth, cur = [], 0, []
    for ch in s:
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        if ch == sep and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return [p.strip() for p in out]


def parse_decl(stmt: str, line: int):
    """Parse `.reg`, `.shared` (incl. `.extern`) declarations. Returns ('reg', [...]) etc."""
    toks = stmt.replace(",", " , ").split()
    if toks[0] == ".reg":
        ptype = toks[1].lstrip(".")
        names = [n.strip() for n in " ".join(toks[2:]).split(",")]
        regs = []
        for n in names:
            m = _RANGE_DECL.match(n)
            if m:
                regs.extend((f"{m.group(1)}{k}", ptype) for k in range(int(m.group(2))))
            elif re.fullmatch(_IDENT, n):
                regs.append((n, ptype))
            else:
                raise fail(line, stmt, f"bad register declaration {n!r}")
        return "reg", regs
    extern = toks[0] == ".extern"
    if extern:
        toks = toks[1:]
    if toks and toks[0] == ".shared":
        align, elem, name_tok = 1, None, None
        k = 1
        while k < len(toks):
            t = toks[k]
            if t == ".align":
                align = int(toks[k + 1])
                k += 2
                continue
            if t.startswith("."):
                elem = t[1:]
            else:
                name_tok = " ".join(toks[k:])
                break
            k += 1
        esize = TYPE_BYTES.get(elem)
        m = SIZED_VAR.match(name_tok or "") if name_tok else None
        if esize is None:
            raise fail(line, stmt, f"unsupported shared variable type .{elem}")
        if m:
            name, count = m.group(1), m.group(2)
            if extern:
                nbytes = None
            elif not count:
                raise fail(line, stmt, "shared array without a size (use .extern for dynamic)")
            else:
                nbytes = int(count) * esize
        elif name_tok and re.fullmatch(r"[\w$]+", name_tok) and not extern:
            name, nbytes = name_tok, esize
        else:
            raise fail(line, stmt, "cannot parse shared variable declaration")
        return "shared", SharedVar(name, max(align, esize), nbytes, line)
    raise fail(line, stmt, f"unsupported declaration {toks[0]}")


TYPE_BYTES = {f"{k}{n}": n // 8 for k in "bus" for n in (8, 16, 32, 64)}
TYPE_BYTES.update(f16=2, bf16=2, f32=4, f64=8, f16x2=4, bf16x2=4)


def parse_params(text: str, line: int) -> tuple:
    params = []
    for p in split_top(text, ","):
        if not p:
            continue
        # drop pointer attributes: `.ptr`, a state space, `.align N` (also `.ptr.global.align N`)
        toks, raw = [], p.split()
        k = 0
        while k < len(raw):
            t = raw[k]
            if t == ".align" or (t.startswith(".ptr") and t.endswith(".align")):
                k += 2
                continue
            if not t.startswith(".ptr") and t not in (".global", ".shared", ".const", ".local"):
                toks.append(t)
            k += 1
        array = SIZED_VAR.match(" ".join(toks[2:])) if len(toks) >= 3 else None
        if array and toks[0] == ".param" and toks[1] == ".b8" and array.group(2):
            align = re.search(r"\.align\s+(\d+)", p)
            params.append(Param(array.group(1), "b8", line, int(array.group(2)),
                                int(align.group(1)) if align else 1))
            continue
        if len(toks) != 3 or toks[0] != ".param" or not toks[1].startswith(".") or "[" in toks[2]:
            raise fail(line, p, "unsupported kernel parameter (scalar .param types and "
                        "`.param .align N .b8 name[size]` structs are supported)")
        params.append(Param(toks[2], toks[1][1:], line))
    return tuple(params)
