"""The emulator's op table, built explicitly from the op modules named here (their decoders are
the functions `decode.register` marks), and `decode_program`, the one reader of the table.

Importing an op module writes nothing: the table is `DECODERS` below, complete before the first
program is decoded, and no module below imports the op modules back (no import circle).
"""

from __future__ import annotations

import functools

from ptxc.emu import (
    ops_async, ops_ctrl, ops_cvt, ops_float, ops_hopper, ops_int, ops_logic, ops_mbarrier, ops_mem,
    ops_tcgen05, ops_vote, ops_warp, ops_wgmma)
from ptxc.emu.decode import DecodeEnv, Program, decode_error, decoder_table, successors
from ptxc.emu.operands import DecodeError
from ptxc.emu.parser import parse_module
from ptxc.emu.uninit import analyse as analyse_init

DECODERS = decoder_table(ops_async, ops_ctrl, ops_cvt, ops_float, ops_hopper, ops_int, ops_logic,
                         ops_mbarrier, ops_mem, ops_tcgen05, ops_vote, ops_warp, ops_wgmma)


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
