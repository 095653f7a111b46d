"""Registers per entry function of a cubin, read from its ELF (no GPU, no CUDA driver): the
EIATTR_REGCOUNT attribute ptxas writes into `.nv.info` for each kernel (cuobjdump -res-usage's
REG column). Static shared memory is not read here: the peers' kernels use only dynamic shared
memory, and on sm_90 the 1 KiB `.nv.shared.<kernel>` block is the per-CTA reservation that
ptxc.targets.occupancy already counts."""

from __future__ import annotations

import struct

_EIATTR_REGCOUNT = 0x2F
_EIFMT_NVAL, _EIFMT_BVAL, _EIFMT_HVAL, _EIFMT_SVAL = 1, 2, 3, 4


def _sections(elf: bytes) -> tuple[dict[str, tuple[int, int, int, int]], list[tuple]]:
    """(name -> (type, offset, size, link), raw headers) of a 64-bit little-endian ELF."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2:
        raise ValueError("not a 64-bit ELF cubin")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    raw = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names = raw[shstrndx][4]

    def name(off: int) -> str:
        return elf[names + off: elf.index(b"\0", names + off)].decode()
    return {name(s[0]): (s[1], s[4], s[5], s[6]) for s in raw}, raw


def registers(elf: bytes) -> dict[str, int]:
    """Entry function name -> registers per thread."""
    secs, raw = _sections(elf)
    _, symoff, symsize, strndx = secs[".symtab"]
    stroff = raw[strndx][4]
    symbols = []
    for k in range(symsize // 24):
        st_name, = struct.unpack_from("<I", elf, symoff + 24 * k)
        symbols.append(elf[stroff + st_name: elf.index(b"\0", stroff + st_name)].decode())
    out: dict[str, int] = {}
    _, off, size, _ = secs.get(".nv.info", (0, 0, 0, 0))
    pos = off
    while pos + 4 <= off + size:
        fmt, attr, value = struct.unpack_from("<BBH", elf, pos)
        if fmt == _EIFMT_SVAL:
            if attr == _EIATTR_REGCOUNT:
                sym, count = struct.unpack_from("<II", elf, pos + 4)
                out[symbols[sym]] = count
            pos += 4 + value
        else:
            pos += 4
    return out
