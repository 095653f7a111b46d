"""Loop analysis of SASS (nvdisasm output): what one steady-state iteration of a kernel's main
loop issues, and how many global-load bytes it keeps in flight.

A loop is a backward branch (`BRA` to an address at or before it). Its iteration is one path
from the loop head to that back edge through the forward branches inside; the steady-state path
is the one doing the most work (tensor-core instructions and loads: HMMA, LDSM, LDGSTS, LDG,
LDS, STS) and, among those, the fewest instructions: that takes the prefetch of the next tile
(`if j + 1 < n`) and skips masking, tail handling and prefill's lazy softmax rescale, i.e. an
interior tile whose running max did not jump. A branch region that only refills an index table
(scalar global loads, no tile work: FlashInfer's K/V row offsets, once every 16 tiles) counts as
no work, so the steady path skips it too. That rule understates a loop whose every iteration
takes a branch region (the sparse decode's missing-key mask sat on one until it became a word
test), so each loop also reports `instructions_longest`, the longest path of any warp (every
region taken): the steady figure's bound from above. A kernel's main loop is the one whose
iteration has the most HMMA, then the most global-load bytes, then the most instructions.

Bytes in flight are simulated over the path run three times (the last pass is reported, so
loads issued for the next iteration count): a register load (LDG/LD) is outstanding from its
issue until an instruction names one of its destination registers (the scoreboard wait); an
asynchronous copy (LDGSTS) joins the open group, LDGDEPBAR commits it, and `DEPBAR.LE SB0, n`
retires the oldest groups until at most n remain. Per warp figures are lanes x bytes (predicated-off
lanes are not known statically and count as loading). Nothing here needs a GPU.
"""

from __future__ import annotations

import re
import threading

from .dependency import dependency_program
from .sass_instr import (BULK_ISSUE, CLASSES, DEPBAR_KEEP, GLOBAL_LOADS, HMMA_16816_FLOPS, REGISTER, Instr,
                         access_bytes, classify, empty_group, mma_flops, operand_stall_flops, parse_functions,
                         registers, shared_bytes)

_TARGET = re.compile(r"`\((\.L\w+)\)")
_LAST = threading.local()      # .entry: (instrs, its address -> position), per thread (report's pool)


def _addr_index(instrs: list[Instr]) -> dict[int, int]:
    """Address -> position in `instrs`, made once per function (every path search needs it)."""
    entry = getattr(_LAST, "entry", None)
    if entry is None or entry[0] is not instrs:
        entry = _LAST.entry = (instrs, {i.addr: n for n, i in enumerate(instrs)})
    return entry[1]

def _branch_target(i: Instr, labels: dict[str, int]) -> int | None:
    if i.base not in ("BRA", "JMP"):
        return None
    m = _TARGET.search(i.operands)
    return labels.get(m.group(1)) if m else None


_BRANCH_PRED = re.compile(r"^!?U?P[0-9]")


def _conditional(i: Instr) -> bool:
    """Guarded (`@P0 BRA`) or, for uniform branches, predicated in the operands (`BRA.U !UP0, ...`)."""
    return i.guard not in ("", "@PT") or bool(_BRANCH_PRED.match(i.operands))


def find_loops(instrs: list[Instr], labels: dict[str, int]) -> list[tuple[int, int]]:
    """(head index, back-edge index) of every backward branch (not the `BRA` to itself that
    pads the end of a function)."""
    index = _addr_index(instrs)
    loops = []
    for n, i in enumerate(instrs):
        t = _branch_target(i, labels)
        if t is not None and t < i.addr and t in index and i.guard != "@!PT":
            loops.append((index[t], n))
    return loops


# What a steady-state iteration must do: tensor-core math and the loads feeding it. Branches
# holding only arithmetic (masking, a lazy softmax rescale) or stores (tails) are off the path.
_WORK = {"tensor", "ldsm", "ldgsts", "ldg", "lds", "sts"}


def _is_work(i: Instr, bulk: bool = True) -> bool:
    """`bulk`: TMA issue counts. (An empty wgmma group's placeholder does not: the path that
    skips a P·V would otherwise tie with the one issuing it where P·V is a single wgmma, and win
    on length.)"""
    return (classify(i.opcode) in _WORK and not empty_group(i)) or (bulk and i.base in BULK_ISSUE)


def table_refills(instrs: list[Instr], labels: dict[str, int], head: int, latch: int) -> set[int]:
    """Indices of the loop's table refills: regions a conditional forward branch skips whose
    global loads are all scalar (<= 4 bytes per lane: page ids, indices) and which feed no tile
    (no HMMA, LDSM, LDGSTS, LDS or TMA issue). FlashInfer's paged decode refills its shared-memory
    table of K/V row offsets there once every 16 tiles; such a region is not part of the steady
    state, however much it loads and stores. A warp's TMA issue block loads its page ids the same
    way but runs every iteration: the box issue in it makes it work."""
    index = _addr_index(instrs)
    out: set[int] = set()
    for n in range(head, latch):
        i = instrs[n]
        t = _branch_target(i, labels)
        if t is None or i.guard == "@!PT" or not _conditional(i) or not (n < index.get(t, -1) <= latch):
            continue
        region = range(n + 1, index[t])
        classes = {classify(instrs[k].opcode) for k in region}
        loads = [instrs[k] for k in region if classify(instrs[k].opcode) == "ldg"]
        if loads and all(access_bytes(ld.opcode) <= 4 for ld in loads) \
                and not classes & {"tensor", "ldsm", "ldgsts", "lds"} \
                and not any(instrs[k].base in BULK_ISSUE for k in region):
            out.update(region)
    return out


_ISETP_NE = re.compile(r"^(U?P\d)\s*,\s*U?PT\s*,\s*(U?R\d+)\s*,\s*(U?RZ|0x[0-9a-f]+|\d+)\s*,")


def warp_selectors(instrs: list[Instr], labels: dict[str, int], head: int, latch: int) -> dict[int, tuple[str, int]]:
    """Branches that pick a block by the value of one register: `ISETP.NE Px, Rw, c` then
    `@Px BRA` over the block, for two or more constants c of the same Rw -- the per-warp TMA issue
    blocks of varlen (warp w issues its own boxes), or any role split by warp index -- or for one
    constant when the block it guards issues TMA (prefill's single issuing thread). Returns
    branch index -> (register, c): the branch is taken iff the register differs from c."""
    found: dict[int, tuple[str, int]] = {}
    for n in range(head, latch + 1):
        i = instrs[n]
        if i.base != "BRA" or not i.guard.startswith("@P"):
            continue
        pred = i.guard[1:]
        for k in range(n - 1, max(head, n - 8) - 1, -1):   # the predicate's writer, same block
            d = instrs[k]
            m = _ISETP_NE.match(d.operands) if d.base in ("ISETP", "UISETP") else None
            if m and ".NE." in d.opcode + "." and m.group(1) == pred and not d.guard:
                c = m.group(3)
                found[n] = (m.group(2), 0 if c.endswith("RZ") else int(c, 0))
                break
            if pred in d.operands.split(",")[0] or d.base in ("BRA", "BSYNC"):
                break
    index = _addr_index(instrs)
    labels_of = {n: _TARGET.search(instrs[n].operands) for n in found}
    by_reg: dict[str, set[int]] = {}
    issuing: set[str] = set()   # registers whose block issues TMA: one issuer is a role too
    for n, (reg, c) in found.items():
        by_reg.setdefault(reg, set()).add(c)
        end = index.get(labels.get(labels_of[n].group(1), -1), n) if labels_of[n] else n
        if any(instrs[k].base in BULK_ISSUE for k in range(n + 1, end)):
            issuing.add(reg)
    return {n: rc for n, rc in found.items() if len(by_reg[rc[0]]) >= 2 or rc[0] in issuing}


def steady_path(instrs: list[Instr], labels: dict[str, int], head: int, latch: int,
                assume: dict[str, int] | None = None, bulk_work: bool = True, longest: bool = False,
                refills: set[int] | None = None, selectors: dict | None = None) -> list[int]:
    """Indices of the steady-state iteration: the most work (table refills count as none), then
    the fewest instructions. `assume` fixes registers of warp-selector branches (register ->
    value), so the path is one warp's: it takes that warp's block and skips the others'.
    `bulk_work=False` counts TMA issue as no work: the path of a warp that issues none.
    `longest=True`: the path with the most instructions instead, every branch region taken that
    lengthens it (masking, tails, rescales, refills) -- the bound from above of one iteration,
    of the code between head and back edge: a region ptxas placed after the back edge (reached
    by a forward branch, returning by a backward one) is on neither path."""
    index = _addr_index(instrs)
    if refills is None:      # (warp_paths passes both, made once per loop)
        refills = table_refills(instrs, labels, head, latch)
    if not assume:
        selectors = {}
    elif selectors is None:
        selectors = warp_selectors(instrs, labels, head, latch)
    # best[n] = (score, predecessor) of the best path from head reaching instruction n (lowest
    # score); prev[n] once n is final: the path is read back from the latch
    best: dict[int, tuple[tuple[int, int], int | None]] = {head: ((0, 0), None)}
    prev: dict[int, int | None] = {}
    for n in range(head, latch + 1):
        if n not in best:
            continue
        (work, size), prev[n] = best.pop(n)
        i = instrs[n]
        counts = _is_work(i, bulk_work)
        if longest:
            size -= 1
        else:
            work, size = work - (counts and n not in refills), size + 1
        if n == latch:
            path, k = [], n
            while k is not None:
                path.append(k)
                k = prev[k]
            return path[::-1]
        succ = []
        t = _branch_target(i, labels)
        taken = None
        if n in selectors and selectors[n][0] in assume:
            reg, c = selectors[n]
            taken = assume[reg] != c
        if t is not None and i.guard != "@!PT" and taken is not False:
            if t in index and n < index[t] <= latch:
                succ.append(index[t])
        unconditional = taken is True or \
            (not _conditional(i) and (t is not None or i.base in ("EXIT", "RET", "BRX", "JMP")))
        if not unconditional:
            succ.append(n + 1)
        for s in succ:
            if s not in best or (work, size) < best[s][0]:
                best[s] = ((work, size), n)
    return []


def warp_paths(instrs: list[Instr], labels: dict[str, int], head: int, latch: int,
               longest: bool = False) -> dict[str, list[int]]:
    """Every warp's steady-state path where warp-selector branches split the loop by warp (one
    path per selector value, and one for a warp matching none), keyed "R136=1"-style; else, where
    one thread issues the TMA boxes under a predicate set before the loop, the issuing warp's path
    and the others' ("issuer", "others"); else the one steady path, keyed "". `longest`: each
    warp's longest path (`steady_path`) instead."""
    selectors = warp_selectors(instrs, labels, head, latch)
    known = {"longest": longest, "refills": table_refills(instrs, labels, head, latch), "selectors": selectors}
    regs = sorted({r for r, _ in selectors.values()})
    if len(regs) != 1:   # none, or several selector registers (not modelled)
        issuer = steady_path(instrs, labels, head, latch, **known)
        others = steady_path(instrs, labels, head, latch, bulk_work=False, **known)
        return {"issuer": issuer, "others": others} if others != issuer else {"": issuer}
    values = sorted({c for _, c in selectors.values()})
    out = {f"{regs[0]}={v}": steady_path(instrs, labels, head, latch, {regs[0]: v}, **known) for v in values}
    out[f"{regs[0]}=other"] = steady_path(instrs, labels, head, latch, {regs[0]: -1}, **known)
    return out


def bytes_in_flight(path: list[Instr], lanes: int = 32) -> tuple[float, int]:
    """(mean, peak) global-load bytes outstanding per warp over the steady-state path."""
    loads: list[tuple[set[int], int]] = []
    groups: list[int] = []
    open_group = 0
    samples: list[int] = []
    for rep in range(3):
        for i in path:
            if i.guard == "@!PT":
                continue
            used = registers(i.operands)
            loads = [ld for ld in loads if not (ld[0] & used)]
            if i.base in GLOBAL_LOADS:
                nbytes = access_bytes(i.opcode)
                first = REGISTER.match(i.operands.split(",")[0].strip())
                if first:
                    r = int(first.group(1))
                    loads.append((set(range(r, r + max(1, nbytes // 4))), nbytes * lanes))
            elif i.base == "LDGSTS":
                open_group += access_bytes(i.opcode) * lanes
            elif i.base == "LDGDEPBAR":
                groups.append(open_group)
                open_group = 0
            elif i.base == "DEPBAR" and (m := DEPBAR_KEEP.search(i.operands)):
                keep = int(m.group(1), 0)
                groups = groups[max(0, len(groups) - keep):] if keep else []   # n or fewer stay
            if rep == 2:
                samples.append(sum(b for _, b in loads) + sum(groups) + open_group)
    return (sum(samples) / len(samples) if samples else 0.0), max(samples, default=0)


def profile_loop(instrs: list[Instr], labels: dict[str, int], head: int, latch: int) -> dict:
    """What one steady-state iteration of the loop [head, latch] issues, per warp. Where warps
    take different paths (warp-selector branches), the figures are the worst warp's (the most
    instructions), and `warp_instructions` lists every warp's count."""
    paths = warp_paths(instrs, labels, head, latch)
    worst = max(paths, key=lambda k: (len(paths[k]), k))
    path = [instrs[n] for n in paths[worst]]
    classes = dict.fromkeys(CLASSES, 0)
    widths_of: dict[str, dict[str, int]] = {"ldg": {}, "stg": {}, "ldgsts": {}, "lds": {}, "sts": {}}
    loaded = shared = 0
    flops = stall = 0
    for i in path:
        c = classify(i.opcode)
        classes[c] += 1
        if c in widths_of:
            w = str(access_bytes(i.opcode))
            widths_of[c][w] = widths_of[c].get(w, 0) + 1
        if c in ("ldg", "ldgsts"):
            loaded += access_bytes(i.opcode) * 32
        shared += shared_bytes(i)
        flops += mma_flops(i) if c == "tensor" else 0
        stall += operand_stall_flops(i) if c == "tensor" else 0
    mean, peak = bytes_in_flight(path)
    total = len(path)
    # the bound from above: the longest path of any warp (a tile taking every branch region:
    # the causal diagonal's mask, a tail, a lazy rescale, a table refill)
    longest = max(len(p) for p in warp_paths(instrs, labels, head, latch, longest=True).values())
    return {
        "head": f"{instrs[head].addr:#06x}", "back_edge": f"{instrs[latch].addr:#06x}",
        "body": latch - head + 1, "instructions": total, "instructions_longest": max(longest, total),
        "classes": classes,
        **{f"{c}_bytes": dict(sorted(w.items(), key=lambda kv: -int(kv[0]))) for c, w in widths_of.items()},
        "mma_flops": flops, "operand_stall_flops": stall, "fp32_lane_ops": classes["fp32"] * 32,
        "instructions_per_mma": round(total / classes["tensor"], 2) if classes["tensor"] else None,
        "mma_equivalents": round(flops / HMMA_16816_FLOPS, 2),
        "instructions_per_mma_equivalent": round(total * HMMA_16816_FLOPS / flops, 2) if flops else None,
        "global_bytes_loaded": loaded, "shared_bytes": shared,
        "inflight_bytes_mean": round(mean, 1), "inflight_bytes_peak": peak,
        **({"warp_instructions": {k: len(v) for k, v in paths.items()}, "worst_warp": worst}
           if len(paths) > 1 else {}),
        "program": dependency_program(path),
    }


def analyze_disassembly(text: str) -> dict[str, dict]:
    """Per function: every loop's iteration profile (by address) and the index of the main one."""
    out = {}
    for fn, (instrs, labels) in parse_functions(text).items():
        profiled = [((h, t), profile_loop(instrs, labels, h, t)) for h, t in find_loops(instrs, labels)]
        profiled = [(span, p) for span, p in profiled if p["instructions"]]
        spans, loops = [span for span, _ in profiled], [p for _, p in profiled]
        # a loop around another tensor-core loop (a persistent CTA's loop over its work tiles)
        # is not the main loop: the innermost one with tensor work is
        inner = [n for n, (h, t) in enumerate(spans) if not any(
            h <= h2 and t2 <= t and (h2, t2) != (h, t) and loops[m]["classes"]["tensor"]
            for m, (h2, t2) in enumerate(spans))]
        main = max(inner, default=None, key=lambda n: (
            loops[n]["classes"]["tensor"], loops[n]["global_bytes_loaded"], loops[n]["instructions"]))
        out[fn] = {"loops": loops, "main": main}
    return out


__all__ = ["CLASSES", "HMMA_16816_FLOPS", "Instr", "access_bytes", "analyze_disassembly",
           "bytes_in_flight", "classify", "dependency_program", "find_loops", "mma_flops", "parse_functions",
           "profile_loop", "shared_bytes", "steady_path", "table_refills", "warp_paths", "warp_selectors"]


def issue_loops(text: str) -> dict[str, dict[str, dict]]:
    """{function: {"mma" | "load": figures}}: the loops of a warp-specialised kernel's issuing
    warps -- the largest loop that issues tensor-core MMAs (class umma) and the largest that
    issues TMA boxes (UTMALDG), each without softmax work in it (no MUFU) -- with their
    instructions per iteration, the MMAs or boxes in it and the instructions per one (an
    unrolled loop covers several tiles: per issue is the figure that compares)."""
    out: dict[str, dict[str, dict]] = {}
    for fn, (instrs, labels) in parse_functions(text).items():
        best: dict[str, dict] = {}
        for a, b in find_loops(instrs, labels):
            body = instrs[a:b + 1]
            classes = [classify(i.opcode) for i in body]
            if "mufu" in classes:
                continue
            issued = {"mma": classes.count("umma"),
                      "load": sum(i.opcode.split(".")[0] == "UTMALDG" for i in body)}
            for role, n in issued.items():
                if n and len(body) > best.get(role, {}).get("instructions", 0):
                    best[role] = {"instructions": len(body), "issues": n,
                                  "per_issue": round(len(body) / n, 2)}
        if best:
            out[fn] = best
    return out
