"""The emulator's op table: every ``ops_*`` module, imported here and nowhere else for its
decoders, and `decode_program`, the one reader of the table.

Each op module registers its decoders into `decode.DECODERS` with `decode.register` when it is
imported; this module is the one place that imports them all, so the table is complete before the
first program is decoded and no module below imports the op modules back (no import circle).
"""

from __future__ import annotations

import functools

from ptxc.emu import (
    ops_async, ops_ctrl, ops_cvt, ops_float, ops_hopper, ops_int, ops_logic, ops_mbarrier, ops_mem,
    ops_tcgen05, ops_warp, ops_wgmma)
from ptxc.emu.decode import DECODERS, DecodeEnv, Program, decode_error, successors
from ptxc.emu.operands import DecodeError
from ptxc.emu.parser import parse_module
from ptxc.emu.uninit import analyse as analyse_init


@functools.lru_cache(maxsize=64)
def decode_program(ptx: str, entry_name: str) -> Program:
    """Parse (cached) and decode one entry of a module (cached by text and entry)."""
    module = parse_module(ptx)
    entry = module.entry(entry_name)
    env = DecodeEnv(module, entry)
    ops = []
    for ins in entry.body:
        decoder = DECODERS.get(ins.opcode)
        if decoder is None:
            raise decode_error(entry, ins, "unknown or unsupported opcode")
        try:
            op = decoder(ins, env)
            if ins.guard is not None:
                gt = env.reg_type(ins.guard.name)
                if gt.kind != "p":
                    raise DecodeError(f"guard {ins.guard.name} is not a predicate")
        except DecodeError as exc:
            raise decode_error(entry, ins, str(exc)) from None
        ops.append(op)
    return Program(module, entry, env, tuple(ops), analyse_init(entry, successors(ops)))
