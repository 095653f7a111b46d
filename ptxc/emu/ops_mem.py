"""Memory instructions: ld, st (param/global/shared/generic, scalar and .v2/.v4), atom, red.

Alignment: a scalar access must be naturally aligned and a vector access aligned to the
whole vector (PTX requires both). Cache and ordering qualifiers are accepted and ignored:
the emulator's memory is sequentially consistent.
"""

from __future__ import annotations

import numpy as np

from ptxc.emu.decode import NORMAL, Mods, Op, expect_operands, register
from ptxc.emu.memory import GENERIC_SHARED_BASE, GENERIC_SHARED_END
from ptxc.emu.operands import TYPES, DecodeError, dst_plan, src_plan, uint_of
from ptxc.emu.ptx_ast import Addr, Sym, Vec

_IGNORED = {"ca", "cg", "cs", "lu", "cv", "wb", "wt", "nc", "volatile", "weak", "relaxed",
            "acquire", "release", "cta", "gpu", "sys", "L1::evict_normal", "L1::evict_unchanged",
            "L1::evict_first", "L1::evict_last", "L1::no_allocate", "L2::evict_normal",
            "L2::evict_first", "L2::evict_last", "L2::64B", "L2::128B", "L2::256B"}
_SPACES = ("global", "shared", "shared::cta", "param", "local", "const")


def take_space(m: Mods):
    space = m.flag(*_SPACES)
    if space == "local":
        raise DecodeError(".local memory is not supported")
    if space == "const":     # module .const variables live in global memory (read-only use)
        return "global"
    return "shared" if space == "shared::cta" else space


def address_plan(env, addr, space: str):
    """bind(ctx) -> fn(sel) giving int64/uint64 addresses (shared: shared-window addresses)."""
    if not isinstance(addr, Addr):
        raise DecodeError(f"expected an address operand [..], got {addr}")
    off = addr.offset
    if isinstance(addr.base, Sym) and env.global_address(addr.base.name) is not None:
        if space not in ("global", None):
            raise DecodeError(f"[{addr.base.name}] names a module .global/.const variable")
        glob, delta = env.global_address(addr.base.name), np.uint64(off & (2**64 - 1))
        return lambda ctx: (lambda v: (lambda sel: v))(glob(ctx) + delta)
    if isinstance(addr.base, Sym):
        base = env.symbol_address(addr.base.name)   # a shared variable
        if space != "shared":
            raise DecodeError(f"[{addr.base.name}] names a shared variable: use ld/st.shared")
        const = np.int64(base + off)
        return lambda ctx: (lambda sel: const)
    if addr.base is None:
        const = np.uint64(off & (2**64 - 1))
        return lambda ctx: (lambda sel: const)
    rt = env.reg_type(addr.base.name)
    if rt.kind == "p" or rt.bits not in (32, 64):
        raise DecodeError(f"address register {addr.base.name} must be 32- or 64-bit")
    if space != "shared" and rt.bits != 64:
        raise DecodeError(f"a .{space or 'generic'} address needs a 64-bit register")
    reader = src_plan(env, addr.base, TYPES[f"u{rt.bits}"])
    if space == "shared":
        return lambda ctx: (lambda r: (lambda sel: r(sel).astype(np.int64) + off))(reader(ctx))
    delta = np.uint64(off & (2**64 - 1))
    return lambda ctx: (lambda r: (lambda sel: r(sel) + delta))(reader(ctx))


def _elem_type(m: Mods):
    t = m.one_type()
    if t.kind == "p" or t.name in ("f16x2", "bf16x2"):
        raise DecodeError(f"unsupported type .{t.name} for a memory access")
    return t


def _vec_width(m: Mods) -> int:
    v = m.flag("v2", "v4")
    return {None: 1, "v2": 2, "v4": 4}[v]


def _operands_of(vec_or_reg, nvec: int):
    items = vec_or_reg.items if isinstance(vec_or_reg, Vec) else (vec_or_reg,)
    if len(items) != nvec:
        raise DecodeError(f"expects {nvec} register(s) in the vector operand, got {len(items)}")
    return items


def _count(ctx, sel) -> int:
    return ctx.n if isinstance(sel, slice) else len(sel)


class MemAccess:
    """Routes an access to global or shared memory (generic addresses are split per thread)."""

    def __init__(self, ctx, space, line: int = 0):
        self.ctx, self.space, self.line = ctx, space, line

    def load(self, sel, addr, esize, nvec):
        ctx = self.ctx
        if ctx.traffic is not None and self.space:
            self._count(sel, addr, esize * nvec, self.space == "shared", False)
        if self.space == "global":
            return ctx.gmem.load(addr, esize, nvec, sel)
        if self.space == "shared":
            return ctx.smem.load(ctx.cta_of[sel], addr, esize, nvec, sel, self.line)
        return self._generic(sel, addr, esize, nvec, None)

    def store(self, sel, addr, esize, values):
        ctx = self.ctx
        if ctx.traffic is not None and self.space:
            self._count(sel, addr, esize * values.shape[1], self.space == "shared", True)
        if self.space == "global":
            ctx.gmem.store(addr, esize, values, sel)
        elif self.space == "shared":
            ctx.smem.store(ctx.cta_of[sel], addr, esize, values, sel, self.line)
        else:
            self._generic(sel, addr, esize, values.shape[1], values)

    def _count(self, sel, addr, nbytes, shared: bool, write: bool):
        idx = self.ctx.all_index if isinstance(sel, slice) else sel
        if shared:
            self.ctx.traffic.shared_access(self.line, "st.shared" if write else "ld.shared",
                                           idx, addr, nbytes)
        else:
            self.ctx.traffic.global_access(self.line, "store" if write else "load", idx, addr,
                                           nbytes, write)

    def _generic(self, sel, addr, esize, nvec, values):
        ctx = self.ctx
        idx = sel if not isinstance(sel, slice) else ctx.all_index
        addr = np.broadcast_to(np.asarray(addr, np.uint64), idx.shape)
        in_shared = ((addr >= np.uint64(GENERIC_SHARED_BASE))
                     & (addr < np.uint64(GENERIC_SHARED_END)))
        out = None if values is not None else np.zeros((idx.size, nvec), uint_of(esize * 8))
        for mask, is_sh in ((~in_shared, False), (in_shared, True)):
            if not mask.any():
                continue
            sub, a = idx[mask], addr[mask]
            if is_sh:
                a = (a - np.uint64(GENERIC_SHARED_BASE)).astype(np.int64)
            if ctx.traffic is not None:
                self._count(sub, a, esize * nvec, is_sh, values is not None)
            if is_sh:
                if values is None:
                    out[mask] = ctx.smem.load(ctx.cta_of[sub], a, esize, nvec, sub, self.line)
                else:
                    ctx.smem.store(ctx.cta_of[sub], a, esize, values[mask], sub, self.line)
            elif values is None:
                out[mask] = ctx.gmem.load(a, esize, nvec, sub)
            else:
                ctx.gmem.store(a, esize, values[mask], sub)
        return out


@register("ld")
def decode_ld(ins, env):
    m = Mods(ins)
    space = take_space(m)
    nvec = _vec_width(m)
    for q in list(m.left):
        if q in _IGNORED:
            m.left.remove(q)
    t = _elem_type(m)
    m.done()
    expect_operands(ins, 2)
    d, a = ins.operands
    dsts = _operands_of(d, nvec)
    dplans = [dst_plan(env, x, t) for x in dsts]
    if space == "param":
        return _decode_ld_param(ins, env, t, a, dplans)
    aplan = address_plan(env, a, space)
    esize, dt = t.nbytes, t.dtype

    def bind(ctx):
        writers = [p(ctx) for p in dplans]
        address = aplan(ctx)
        mem = MemAccess(ctx, space, ins.line)

        def run(sel):
            words = mem.load(sel, address(sel), esize, nvec)
            for i, w in enumerate(writers):
                w(sel, words[:, i].view(dt))
        return run
    return Op(NORMAL, ins, bind)


def _decode_ld_param(ins, env, t, a, dplans):
    if not isinstance(a, Addr) or not isinstance(a.base, Sym) or a.base.name not in env.params:
        raise DecodeError("ld.param needs [param_name{+offset}]")
    poff, ptype = env.params[a.base.name]
    start = poff + a.offset
    nbytes = t.nbytes * len(dplans)
    if a.offset < 0 or a.offset + nbytes > env.param_sizes[a.base.name] or start % t.nbytes:
        raise DecodeError(f"ld.param of {nbytes} bytes at {a.base.name}+{a.offset} is outside "
                          f"the parameter ({env.param_sizes[a.base.name]} bytes) or misaligned")

    def bind(ctx):
        values = [np.frombuffer(ctx.param_bytes, t.dtype, 1, start + i * t.nbytes)[0]
                  for i in range(len(dplans))]
        writers = [p(ctx) for p in dplans]

        def run(sel):
            for w, v in zip(writers, values):
                w(sel, v)
        return run
    return Op(NORMAL, ins, bind)


@register("st")
def decode_st(ins, env):
    m = Mods(ins)
    space = take_space(m)
    if space == "param":
        raise DecodeError("st.param is not supported in kernels")
    nvec = _vec_width(m)
    for q in list(m.left):
        if q in _IGNORED:
            m.left.remove(q)
    t = _elem_type(m)
    m.done()
    expect_operands(ins, 2)
    a, v = ins.operands
    splans = [src_plan(env, x, t) for x in _operands_of(v, nvec)]
    aplan = address_plan(env, a, space)
    esize, u = t.nbytes, uint_of(t.nbytes * 8)

    def bind(ctx):
        readers = [p(ctx) for p in splans]
        address = aplan(ctx)
        mem = MemAccess(ctx, space, ins.line)

        def run(sel):
            n = _count(ctx, sel)
            cols = [np.broadcast_to(np.asarray(r(sel)).view(u), (n,)) for r in readers]
            mem.store(sel, address(sel), esize, np.stack(cols, axis=1))
        return run
    return Op(NORMAL, ins, bind)


_ATOM_OPS = {
    "add": lambda old, b, c: old + b,
    "min": lambda old, b, c: np.minimum(old, b),
    "max": lambda old, b, c: np.maximum(old, b),
    "exch": lambda old, b, c: np.broadcast_to(b, old.shape),
    "cas": lambda old, b, c: np.where(old == b, c, old),
    "and": lambda old, b, c: old & b,
    "or": lambda old, b, c: old | b,
    "xor": lambda old, b, c: old ^ b,
}


@register("atom", "red")
def decode_atom(ins, env):
    m = Mods(ins)
    space = take_space(m) or "global"
    if space not in ("global", "shared"):
        raise DecodeError(f"{ins.opcode}.{space} is not supported")
    for q in list(m.left):
        if q in _IGNORED:
            m.left.remove(q)
    op = m.need(*_ATOM_OPS)
    t = _elem_type(m)
    m.done()
    if t.bits < 32 or (op == "add" and t.kind == "b") or (t.kind == "f" and op != "add"):
        raise DecodeError(f"{ins.opcode}.{op}.{t.name} is not supported")
    is_atom = ins.opcode == "atom"
    expect_operands(ins, (3 if op != "cas" else 4) if is_atom else 2)
    ops = list(ins.operands)
    dplan = dst_plan(env, ops.pop(0), t) if is_atom else None
    aplan = address_plan(env, ops.pop(0), space)
    splans = [src_plan(env, x, t) for x in ops]
    fn, esize = _ATOM_OPS[op], t.nbytes

    def bind(ctx):
        write = dplan(ctx) if dplan else None
        address = aplan(ctx)
        readers = [p(ctx) for p in splans]

        def run(sel):
            idx = sel if not isinstance(sel, slice) else ctx.all_index
            vals = [np.broadcast_to(np.asarray(r(sel), t.dtype), idx.shape) for r in readers]
            old = _atomic(ctx, space, idx, address(sel), esize, t, fn, vals, ins.line)
            if write:
                write(sel, old)
        return run
    return Op(NORMAL, ins, bind)


def _atomic(ctx, space, idx, addr, esize, t, fn, vals, line):
    """Apply read-modify-writes in thread order, one 'round' per repeat of an address."""
    addr = np.broadcast_to(addr, idx.shape)
    if space == "global":
        off = ctx.gmem.offsets(addr, esize, esize, "atomic", idx)
        words = ctx.gmem.views[esize].view(t.dtype)
        if ctx.traffic is not None:      # a read-modify-write: counted as read and written
            ctx.traffic.global_access(line, "atomic", idx, addr, esize, False)
            buf = np.searchsorted(ctx.gmem.starts, addr, side="right").astype(np.int64) - 1
            np.add.at(ctx.traffic.written, buf, esize)
    else:
        off = ctx.smem.offsets(ctx.cta_of[idx], addr, esize, esize, "atomic", idx)
        ctx.smem.check_readable(off // esize, esize, idx, lambda k: int(addr[k]))
        words = ctx.smem.rows.views[esize].view(t.dtype)
    word = off // esize
    order = np.argsort(word, kind="stable")
    sw = word[order]
    starts = np.r_[0, np.flatnonzero(sw[1:] != sw[:-1]) + 1]
    rank = np.arange(sw.size) - np.repeat(starts, np.diff(np.r_[starts, sw.size]))
    old = np.empty(idx.shape, t.dtype)
    b = vals[0] if vals else None
    c = vals[1] if len(vals) > 1 else None
    for r in range(int(rank.max()) + 1 if rank.size else 0):
        pos = order[rank == r]
        cur = words[word[pos]]
        old[pos] = cur
        words[word[pos]] = fn(cur, b[pos], None if c is None else c[pos]).astype(t.dtype)
    return old
