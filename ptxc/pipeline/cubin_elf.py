"""What a cubin says about itself, read from its ELF header and section names without ptxas: the
SM it was assembled for and its kernels. The metadata's cubin sha256 only ties the file to the
metadata, and both are editable; these tie the cubin to the target and entries the metadata
records (another target's or another kernel's cubin is refused, docs/reliability.md)."""

from __future__ import annotations

import struct

ELF_MAGIC = b"\x7fELF"
CUDA_OSABI = 0x41        # ELFOSABI_CUDA; e_flags carry the SM


def cubin_sm(data: bytes) -> int | None:
    """The SM (80, 90, 120, ...) a 64-bit CUDA ELF was assembled for; None if it is not one.
    ELF ABI version 8 (ptxas 12.8+) keeps it in e_flags bits 8..15, earlier versions in bits
    0..7 (sm_90 and sm_90a share one number: the suffix is not in the header)."""
    if len(data) < 0x34 or data[:4] != ELF_MAGIC or data[4] != 2 or data[7] != CUDA_OSABI:
        return None
    flags = struct.unpack_from("<I", data, 0x30)[0]
    return (flags >> 8) & 0xFF if data[8] >= 8 else flags & 0xFF


def has_kernel(data: bytes, entry: str) -> bool:
    """Whether the cubin holds kernel `entry`: its code section `.text.<entry>` is named in the
    section-name table (NUL-terminated)."""
    return b".text." + entry.encode() + b"\0" in data


__all__ = ["cubin_sm", "has_kernel"]
