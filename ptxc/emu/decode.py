"""Instruction decoding: each PTX instruction becomes an `Op` once, before any thread runs.

An Op holds a `bind(ctx)` that returns the per-batch closure ``run(sel)`` doing the work for
the selected threads, so the execution loop never parses strings. Decoders live in the
``ops_*`` modules, marked by opcode with `register` (`op_table.py` builds the table from them and decodes
programs); an unknown opcode, an unsupported modifier or a malformed operand list is reported
there, with the kernel and PTX line, before the launch starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ptxc.emu.operands import TYPES, DecodeError, SHARED_BASE, imm_scalar, ptype
from ptxc.emu.ptx_ast import Entry, Instruction, Module
from ptxc.emu.uninit import InitPlan
from ptxc.errors import EmulationError

NORMAL, BRANCH, EXIT, BARRIER, PARK = range(5)   # PARK: a wait that may yield (mbarrier)

def register(*opcodes: str):
    """Mark `fn` as the decoder of `opcodes`. Nothing is written anywhere: op_table.py builds
    its table from the marked functions of the op modules it names (`decoder_table`)."""
    def deco(fn):
        fn.opcodes = opcodes
        return fn
    return deco


def decoder_table(*modules) -> dict:
    """{opcode: decoder} over the functions of `modules` marked by `register`; two different
    decoders for one opcode are a bug."""
    table: dict = {}
    for mod in modules:
        for fn in vars(mod).values():
            for name in getattr(fn, "opcodes", ()):
                if table.setdefault(name, fn) is not fn:
                    raise AssertionError(f"two decoders for {name}: {table[name].__qualname__}, {fn.__qualname__}")
    return table


@dataclass(frozen=True)
class Op:
    kind: int
    ins: Instruction
    bind: Callable = None        # NORMAL, PARK: bind(ctx) -> run(sel)
    target: int = -1             # BRANCH: pc of the label
    uniform: bool = False        # BRANCH: bra.uni (the guard must be warp-uniform)
    bar_id: int = 0              # BARRIER
    bar_count: int | None = None  # BARRIER: thread count operand, None = whole CTA
    aligned: bool = True         # BARRIER: every live lane of a warp must arrive together
    arrive: bool = False         # BARRIER: bar.arrive (counts toward the barrier, does not wait)
    park_reg: str = ""            # PARK: the predicate that is false for threads that yield


class Mods:
    """The modifiers of one instruction, consumed by its decoder; leftovers are errors."""

    def __init__(self, ins: Instruction):
        self.ins = ins
        self.left = list(ins.mods)

    def flag(self, *names: str):
        """Remove and return the one of `names` that is present (None if none)."""
        found = [m for m in self.left if m in names]
        if len(found) > 1:
            raise DecodeError(f"conflicting modifiers {', '.join('.' + f for f in found)}")
        if found:
            self.left.remove(found[0])
            return found[0]
        return None

    def need(self, *names: str) -> str:
        got = self.flag(*names)
        if got is None:
            raise DecodeError(f"needs one of {', '.join('.' + n for n in names)}")
        return got

    def types(self) -> list:
        """Remove and return the type modifiers, in order."""
        found = [m for m in self.left if m in TYPES]
        for m in found:
            self.left.remove(m)
        return [ptype(m) for m in found]

    def one_type(self):
        ts = self.types()
        if len(ts) != 1:
            raise DecodeError(f"expects exactly one type modifier, got {len(ts)}")
        return ts[0]

    def done(self):
        if self.left:
            raise DecodeError("unsupported modifier" + ("s " if len(self.left) > 1 else " ")
                              + ", ".join("." + m for m in self.left))


def expect_operands(ins: Instruction, *counts: int):
    if len(ins.operands) not in counts:
        want = " or ".join(str(c) for c in counts)
        raise DecodeError(f"expects {want} operands, got {len(ins.operands)}")


class DecodeEnv:
    """What decoders may ask about the kernel: registers, labels, shared layout, params."""

    def __init__(self, module: Module, entry: Entry):
        self.module, self.entry = module, entry
        self.regs = {}
        for name, t in entry.regs:
            if t not in TYPES:
                raise EmulationError(f"kernel '{entry.name}': unsupported register type .{t} "
                                     f"for {name}")
            self.regs[name] = TYPES[t]
        self.labels = dict(entry.labels)
        self.shared_offsets, offset, dyn_align = {}, 0, 16
        for var in entry.shared:
            if var.nbytes is None:
                dyn_align = max(dyn_align, var.align)
                continue
            offset = -(-offset // var.align) * var.align
            self.shared_offsets[var.name] = offset
            offset += var.nbytes
        self.dynamic_offset = -(-offset // dyn_align) * dyn_align
        for var in entry.shared:
            if var.nbytes is None:
                self.shared_offsets[var.name] = self.dynamic_offset
        self.static_shared_bytes = offset
        self.params, self.param_sizes, poff = {}, {}, 0
        for p in entry.params:
            t = TYPES.get(p.ptype)
            if t is None or t.kind == "p":
                raise EmulationError(f"kernel '{entry.name}': unsupported parameter type "
                                     f".{p.ptype} for {p.name} (line {p.line})")
            size = p.nbytes if p.nbytes is not None else t.nbytes
            align = max(p.align, t.nbytes)
            poff = -(-poff // align) * align
            self.params[p.name] = (poff, t)
            self.param_sizes[p.name] = size
            poff += size
        self.param_bytes = poff
        self._layout_globals(module)

    def _layout_globals(self, module: Module):
        """Module-scope .global/.const variables live in one buffer ("module globals") placed
        after the launch's buffers; its address is known when a batch is bound."""
        self.global_offsets, image, off = {}, bytearray(), 0
        for var in module.globals:
            t = TYPES[var.elem]
            off = -(-off // var.align) * var.align
            image.extend(bytes(off - len(image)))
            self.global_offsets[var.name] = off
            data = bytearray(t.nbytes * var.count)
            for k, item in enumerate(var.init):
                data[k * t.nbytes:(k + 1) * t.nbytes] = imm_scalar(item, t).tobytes()
            image.extend(data)
            off += len(data)
        self.globals_image = bytes(image)

    def global_address(self, name: str):
        """bind(ctx) -> the uint64 address of a module-scope variable, or None."""
        if name not in self.global_offsets:
            return None
        off = self.global_offsets[name]
        return lambda ctx: np.uint64(ctx.gmem.globals_base + off)

    def reg_type(self, name: str):
        try:
            return self.regs[name]
        except KeyError:
            raise DecodeError(f"{name} is neither a declared register nor a supported "
                              f"special register") from None

    def symbol_address(self, name: str) -> int:
        if name in self.shared_offsets:
            return SHARED_BASE + self.shared_offsets[name]
        raise DecodeError(f"{name} is not a shared variable of this kernel")

    def label_pc(self, name: str) -> int:
        try:
            return self.labels[name]
        except KeyError:
            raise DecodeError(f"branch target {name} is not a label of this kernel") from None


@dataclass(frozen=True)
class Program:
    module: Module
    entry: Entry
    env: DecodeEnv
    ops: tuple
    init: InitPlan              # uninitialised-register checks (ptxc/emu/uninit.py)


def successors(ops) -> list:
    """Per pc, the pcs that may run next (len(ops) stands for falling off the end)."""
    succ = []
    for pc, op in enumerate(ops):
        if op.kind == BRANCH:
            succ.append([op.target] + ([pc + 1] if op.ins.guard is not None else []))
        elif op.kind == EXIT and op.ins.guard is None:
            succ.append([])
        else:
            succ.append([pc + 1])
    return succ


def decode_error(entry: Entry, ins: Instruction, msg: str) -> EmulationError:
    err = EmulationError(f"kernel '{entry.name}': line {ins.line}: `{ins.text}`: "
                         f"cannot emulate '{ins.opcode}': {msg}")
    err.kernel, err.line, err.text = entry.name, ins.line, ins.text
    return err
