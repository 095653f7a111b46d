"""PTX text -> frozen `Module` of entries, declarations and instructions.

The parser is syntactic only: it splits the text into statements, keeps each statement's line
number and source text (for error messages), and parses operands into small frozen dataclasses.
Deciding what an instruction means (and rejecting what the emulator does not support) is
`decode.py`'s job.
"""

from __future__ import annotations

import bisect
import functools
import re

from ptxc.emu.declarations import TYPE_BYTES, fail, parse_decl, parse_params, split_top
from ptxc.emu.ptx_ast import (
    Addr, Entry, GlobalVar, Imm, Instruction, Module, Operand, Pair, Reg, Sink, Sym, TensorAddr,
    Vec)

# ----------------------------------------------------------------------------- lexing helpers

_BLOCK_COMMENT = re.compile(r"/\*.*?\*/", re.S)
_LINE_COMMENT = re.compile(r"//[^\n]*")
_LABEL = re.compile(r"([A-Za-z_$][\w$]*)\s*:(?!:)")
_GUARD = re.compile(r"@(!?)(%?[A-Za-z_$][\w$]*)\s+")
_REG = re.compile(r"(!?)(%[\w$]+(?:\.[xyz])?)$")
_INT = re.compile(r"-?(0[xX][0-9a-fA-F]+|0[bB][01]+|0[0-7]*|[1-9]\d*)U?$")
_FLOAT = re.compile(r"-?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?$")


def _strip_comments(text: str) -> str:
    # Block comments may span lines: replace them by as many newlines to keep numbering.
    text = _BLOCK_COMMENT.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return _LINE_COMMENT.sub("", text)


def parse_int(tok: str) -> int:
    t = tok.rstrip("U")
    neg = t.startswith("-")
    t = t[1:] if neg else t
    if t[:2] in ("0x", "0X"):
        v = int(t[2:], 16)
    elif t[:2] in ("0b", "0B"):
        v = int(t[2:], 2)
    elif len(t) > 1 and t[0] == "0":
        v = int(t, 8)
    else:
        v = int(t)
    return -v if neg else v


def parse_operand(tok: str, line: int, text: str) -> Operand:
    tok = tok.strip()
    if not tok:
        raise fail(line, text, "empty operand")
    parts = split_top(tok, "|")
    if len(parts) == 2:
        return Pair(parse_operand(parts[0], line, text), parse_operand(parts[1], line, text))
    if tok == "_":
        return Sink()
    if tok[0] == "{":
        if tok[-1] != "}":
            raise fail(line, text, f"unterminated vector operand {tok!r}")
        return Vec(tuple(parse_operand(p, line, text) for p in split_top(tok[1:-1], ",")))
    if tok[0] == "[":
        if tok[-1] != "]":
            raise fail(line, text, f"unterminated address operand {tok!r}")
        inner = split_top(tok[1:-1], ",")
        if len(inner) == 2 and inner[1].strip().startswith("{"):     # [map, {c0, ...}]
            coords = parse_operand(inner[1], line, text)
            return TensorAddr(_parse_address(inner[0].strip(), line, text), coords.items)
        return _parse_address(tok[1:-1].strip(), line, text)
    m = _REG.match(tok)
    if m:
        return Reg(m.group(2), neg=bool(m.group(1)))
    low = tok.lower()
    if low.startswith(("0f", "-0f")) and len(tok.lstrip("-")) == 10:
        bits = int(tok.lstrip("-")[2:], 16)
        return Imm(bits ^ (0x80000000 if tok[0] == "-" else 0), "f32bits")
    if low.startswith(("0d", "-0d")) and len(tok.lstrip("-")) == 18:
        bits = int(tok.lstrip("-")[2:], 16)
        return Imm(bits ^ (1 << 63 if tok[0] == "-" else 0), "f64bits")
    if _INT.match(tok):
        return Imm(parse_int(tok), "int")
    if _FLOAT.match(tok):
        return Imm(float(tok), "float")
    if re.fullmatch(r"[A-Za-z_$][\w$]*", tok):
        return Sym(tok)
    raise fail(line, text, f"cannot parse operand {tok!r}")


def _parse_address(inner: str, line: int, text: str) -> Addr:
    m = re.fullmatch(r"(%?[A-Za-z_$][\w$]*(?:\.[xyz])?)?\s*(?:\+\s*(-?[\w]+))?", inner)
    if m and (m.group(1) or m.group(2)):
        base_tok, off_tok = m.group(1), m.group(2)
        base = None
        if base_tok:
            base = Reg(base_tok) if base_tok.startswith("%") else Sym(base_tok)
        try:
            off = parse_int(off_tok) if off_tok else 0
        except ValueError:
            raise fail(line, text, f"bad address offset {off_tok!r}") from None
        return Addr(base, off)
    if _INT.match(inner):
        return Addr(None, parse_int(inner))
    raise fail(line, text, f"cannot parse address [{inner}]")


def parse_instruction(stmt: str, line: int) -> Instruction:
    text = stmt.strip()
    rest = text
    guard = None
    m = _GUARD.match(rest)
    if m:
        guard = Reg(m.group(2), neg=bool(m.group(1)))
        rest = rest[m.end():]
    head, *more = rest.split(None, 1)
    ops = more[0] if more else ""
    parts = head.split(".")
    # `::` qualifiers (shared::cta, L2::128B) stay attached to their modifier.
    opcode, mods = parts[0], tuple(p for p in parts[1:])
    if not re.fullmatch(r"[a-z][a-z0-9_]*", opcode) or any(not p for p in mods):
        raise fail(line, text, f"malformed opcode {head!r}")
    ops = ops.strip()
    operands = tuple(parse_operand(p, line, text) for p in split_top(ops, ",")) if ops else ()
    return Instruction(line, text, guard, opcode, mods, operands)


# ----------------------------------------------------------------------------- statements


def _statements(text: str, start: int, end: int, line_of):
    """Yield (kind, payload, line) for the body text[start:end]: 'label', 'stmt', 'scope'."""
    i = start
    while i < end:
        while i < end and text[i].isspace():
            i += 1
        if i >= end:
            return
        ch = text[i]
        if ch in "{}":
            yield "scope", ch, line_of(i)
            i += 1
            continue
        if text.startswith(_LINE_DIRECTIVES, i):      # debug directives end at the newline
            nl = text.find("\n", i, end)
            i = end if nl < 0 else nl + 1
            continue
        m = _LABEL.match(text, i)
        if m and m.end() <= end:
            yield "label", m.group(1), line_of(i)
            i = m.end()
            continue
        j = text.find(";", i, end)
        if j < 0:
            raise fail(line_of(i), text[i:end].splitlines()[0], "statement without ';'")
        yield "stmt", text[i:j], line_of(i)
        i = j + 1


_IGNORED_DIRECTIVES = (".pragma", ".loc", ".file")
_LINE_DIRECTIVES = (".loc", ".file")


_ENTRY_HEAD = re.compile(r"(?:\.(?:visible|weak|extern)\s+)*\.(entry|func)\s+([\w$]+)\s*\(", re.S)
_MODULE_DIRECTIVE = re.compile(r"\.(version|target|address_size)\s+([^\n;]+)")


def _matching(text: str, i: int, open_ch: str, close_ch: str) -> int:
    depth = 0
    for j in range(i, len(text)):
        if text[j] == open_ch:
            depth += 1
        elif text[j] == close_ch:
            depth -= 1
            if depth == 0:
                return j
    return -1


@functools.lru_cache(maxsize=64)
def parse_module(ptx: str) -> Module:
    """Parse PTX text into a frozen `Module` (cached by the exact text)."""
    text = _strip_comments(ptx)
    newlines = [i for i, c in enumerate(text) if c == "\n"]

    def line_of(pos: int) -> int:
        return bisect.bisect_left(newlines, pos) + 1

    info = {"version": "", "target": "", "address_size": "64"}
    module_shared, module_globals, entries = [], [], []
    i = 0
    while i < len(text):
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            break
        if text.startswith(_LINE_DIRECTIVES, i):
            nl = text.find("\n", i)
            i = len(text) if nl < 0 else nl + 1
            continue
        m = _MODULE_DIRECTIVE.match(text, i)
        if m:
            info[m.group(1)] = m.group(2).strip()
            i = m.end()
            continue
        m = _ENTRY_HEAD.match(text, i)
        if m:
            close = _matching(text, m.end() - 1, "(", ")")
            body_open = text.find("{", close)
            if close < 0 or body_open < 0:
                raise fail(line_of(i), text[i:i + 60], "unterminated entry header")
            body_close = _matching(text, body_open, "{", "}")
            if body_close < 0:
                raise fail(line_of(i), text[i:i + 60], "unterminated entry body")
            if m.group(1) == "entry":
                entries.append(_parse_entry(text, m, close, body_open, body_close, line_of,
                                            tuple(module_shared)))
            i = body_close + 1   # .func bodies are skipped: `call` is not supported
            continue
        if text.startswith(".section", i):            # DWARF debug sections: skipped
            body_open = text.find("{", i)
            body_close = _matching(text, body_open, "{", "}") if body_open >= 0 else -1
            if body_close < 0:
                raise fail(line_of(i), text[i:i + 60], "unterminated .section")
            i = body_close + 1
            continue
        j = text.find(";", i)
        if j < 0:
            raise fail(line_of(i), text[i:].splitlines()[0], "unexpected text")
        stmt = text[i:j].strip()
        var = _GLOBAL_VAR.match(stmt)
        if var:
            module_globals.append(_parse_global(var, stmt, line_of(i)))
        elif stmt.startswith((".extern", ".shared")):
            module_shared.append(parse_decl(stmt, line_of(i))[1])
        elif not stmt.startswith(_IGNORED_DIRECTIVES):
            raise fail(line_of(i), stmt, "unsupported module-scope statement")
        i = j + 1
    return Module(info["version"], info["target"], int(info["address_size"]), tuple(entries),
                  tuple(module_globals))


_GLOBAL_VAR = re.compile(r"(?:\.(?:visible|weak|extern)\s+)*\.(global|const)\s+(?:\.align\s+(\d+)\s+)?"
                         r"\.(\w+)\s+([A-Za-z_$][\w$]*)\s*(?:\[\s*(\d*)\s*\])?\s*(?:=\s*(.*))?$",
                         re.S)


def _parse_global(m, stmt: str, line: int) -> GlobalVar:
    space, align, elem, name, count, init = m.groups()
    if elem not in TYPE_BYTES:
        raise fail(line, stmt, f"unsupported type .{elem} of a .{space} variable")
    items = ()
    if init is not None:
        flat = init.replace("{", " ").replace("}", " ")
        items = tuple(parse_operand(t, line, stmt) for t in flat.split(",") if t.strip())
        if not all(isinstance(x, Imm) for x in items):
            raise fail(line, stmt, "only numeric initialisers are supported")
    n = int(count) if count else (len(items) if count == "" else 1)
    if len(items) > n:
        raise fail(line, stmt, f"{len(items)} initialisers for {n} elements")
    return GlobalVar(name, space, int(align) if align else TYPE_BYTES[elem], elem, n, items,
                     line)


def _rename_operand(op, names: dict):
    if isinstance(op, (Reg, Sym)) and op.name in names:
        return Reg(names[op.name], neg=getattr(op, "neg", False))
    if isinstance(op, Vec):
        return Vec(tuple(_rename_operand(x, names) for x in op.items))
    if isinstance(op, Pair):
        return Pair(_rename_operand(op.first, names), _rename_operand(op.second, names))
    if isinstance(op, Addr) and op.base is not None and op.base.name in names:
        return Addr(Reg(names[op.base.name]), op.offset)
    return op


def _rename(ins: Instruction, names: dict) -> Instruction:
    """Scoped register names -> their unique names (bare names become registers)."""
    guard = ins.guard
    if guard is not None and guard.name in names:
        guard = Reg(names[guard.name], guard.neg)
    ops = tuple(_rename_operand(op, names) for op in ins.operands)
    return Instruction(ins.line, ins.text, guard, ins.opcode, ins.mods, ops)


def _parse_entry(text, m, close, body_open, body_close, line_of, module_shared) -> Entry:
    name, line = m.group(2), line_of(m.start())
    params = parse_params(text[m.end():close], line)
    perf = text[close + 1:body_open]
    reqntid = maxntid = None
    for d in re.finditer(r"\.(reqntid|maxntid)\s+([\d\s,]+)", perf):
        dims = tuple(int(x) for x in d.group(2).replace(",", " ").split())
        if d.group(1) == "reqntid":
            reqntid = dims
        else:
            maxntid = dims
    ctas = re.search(r"\.minnctapersm\s+(\d+)", perf)
    regs, shared, body, labels = [], list(module_shared), [], []
    # Nested { } scopes (inline asm) may declare registers, often without '%' and again in
    # every scope: each such declaration gets a unique name, used inside its scope only.
    scopes, renamed = [{}], 0
    for kind, payload, ln in _statements(text, body_open + 1, body_close, line_of):
        if kind == "scope":
            if payload == "{":
                scopes.append(dict(scopes[-1]))
            elif len(scopes) > 1:
                scopes.pop()
            continue
        if kind == "label":
            labels.append((payload, len(body)))
            continue
        stmt = payload.strip()
        if stmt.startswith((".reg", ".shared", ".extern")):
            k, val = parse_decl(stmt, ln)
            if k == "reg" and len(scopes) > 1:
                for reg_name, reg_type in val:
                    renamed += 1
                    scopes[-1][reg_name] = f"{reg_name}${{{renamed}}}"
                    regs.append((scopes[-1][reg_name], reg_type))
            elif k == "reg":
                regs.extend(val)
                scopes[0].update((n, n) for n, _ in val if not n.startswith("%"))
            else:
                shared.append(val)
        elif stmt.startswith(_IGNORED_DIRECTIVES):
            continue
        elif stmt.startswith("."):
            raise fail(ln, stmt, f"unsupported directive {stmt.split()[0]}")
        else:
            ins = parse_instruction(stmt, ln)
            body.append(_rename(ins, scopes[-1]) if scopes[-1] else ins)
    return Entry(name, line, params, tuple(regs), tuple(shared), tuple(body), tuple(labels),
                 reqntid, maxntid, int(ctas.group(1)) if ctas else None)
