"""A strict, vectorised PTX emulator: how ptxc checks kernels without a GPU.

Public API
----------
``launch(ptx, entry, grid, block, args, dynamic_smem_bytes=0, *, batch_threads=32768,
step_limit=50_000_000, racecheck=True, traffic=False) -> LaunchStats``
    Emulate launching ``.entry entry`` of the PTX module text ``ptx``.

    * ``grid`` / ``block``: tuples of 1-3 positive ints (missing dimensions are 1).
    * ``args``: one per ``.param``, in order. A numpy array is a device buffer: its bytes (C
      order) are copied into emulated global memory at a 256-byte aligned address, that address
      is passed in the ``.u64`` parameter, and after a successful launch the bytes are copied
      back into the same array in place (a read-only array is allowed if the kernel does not
      write it). Any other parameter needs a numpy scalar of exactly the parameter's type
      (``.u32`` -> ``np.uint32``, ``.s32`` -> ``np.int32``, ``.u64`` -> ``np.uint64``,
      ``.s64`` -> ``np.int64``, ``.f32`` -> ``np.float32``, ``.f64`` -> ``np.float64``; a
      ``.bN`` parameter takes any N-bit numpy scalar). Plain Python ints/floats are refused.
      A wrong count or type raises ``ptxc.errors.InputError`` naming the parameter.
    * A ``PointerTable(((array, byte_offset), ...))`` in a ``.u64`` parameter is a device
      buffer of pointers into arrays that are not parameters themselves (pointer-array KV
      caches): the arrays are placed in global memory and entry k holds the address of array k
      plus its offset.
    * A by-value struct parameter (``.param .align N .b8 name[size]``) takes ``bytes``, a numpy
      structured scalar, or ``StructArg(data, {field name or byte offset: array})``: each
      array is placed in global memory and its address written into the struct.
    * A ``TensorMap(array, box, swizzle)`` (tensormap.py) for a ``.param .align 64 .b8
      map[128]`` parameter stands for a driver CUtensorMap: the array is placed in global
      memory and ``cp.async.bulk.tensor`` reads boxes of it.
    * ``dynamic_smem_bytes``: size of the ``.extern .shared`` array(s).
    * ``racecheck``: report shared-memory races (racecheck.py). ``traffic``: count memory
      traffic into ``LaunchStats.traffic`` (traffic.py).
    * Returns a ``LaunchStats`` (thread_instructions, steps, wall_time_s,
      thread_instructions_per_s). CTAs run in batches of about ``batch_threads`` threads (all
      threads of a CTA are always in one batch); ``step_limit`` bounds instruction issues per
      batch so that an infinite loop fails instead of hanging.

``parse_module(ptx) -> Module``
    The parsed module (frozen dataclasses), cached by the exact text; decoded entries are
    cached too, so repeated launches of the same PTX do not re-parse or re-decode.

``EmulationError`` (``ptxc.errors.EmulationError``)
    Raised for undefined behaviour and for anything the emulator does not support. The message
    names the kernel, the PTX line number and text, and -- for errors while running -- the
    block (ctaid) and thread (tid) of the first offending thread and the address involved.
    The same facts are attributes: ``kernel``, ``line``, ``text``, ``ctaid``, ``tid``,
    ``address``. Unsupported opcodes/modifiers are reported before any thread runs.

What is checked
---------------
Global accesses outside the argument buffers (guard gaps separate them), shared accesses
outside the CTA's shared memory, misaligned accesses (vectors: the whole vector size), reads
of never-written shared memory, reads/writes of a cp.async destination before the wait that
completes it, shared-memory races (RAW/WAW with no barrier or warp sync in between),
integer division by zero, barrier divergence (inside a warp at an .aligned barrier, or across
barrier instructions) and deadlock, warp collectives (shfl.sync, mma.sync, ldmatrix, bra.uni)
executed by an incomplete or non-uniform warp, shfl reads of lanes that are not executing it,
never-written registers used as an address, a stored value or a branch condition, and the
Hopper rules: wgmma warpgroup convergence, registers and shared operands of an in-flight wgmma,
wgmma.fence, mbarrier initialisation/arrival counts/deadlock, cp.async.bulk data before its
phase is observed.

See docs/emulator.md for the execution model and numerical choices.
"""

from ptxc.emu.launch import LaunchStats, PointerTable, StructArg, launch
from ptxc.emu.traffic import GlobalAccess, SharedAccess, Traffic
from ptxc.emu.parser import parse_module
from ptxc.emu.tensormap import TensorMap
from ptxc.emu.ptx_ast import Module
from ptxc.errors import EmulationError

__all__ = ["launch", "LaunchStats", "PointerTable", "StructArg", "TensorMap", "Traffic", "GlobalAccess",
           "SharedAccess", "parse_module", "Module", "EmulationError"]
