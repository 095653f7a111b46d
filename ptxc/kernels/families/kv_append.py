"""Family "kv_append": scatter new K and V rows into a KV cache (contiguous or paged).

Token t of sequence b goes to cache row `positions[b] + t`; `positions` is read on the device,
so one captured launch serves every decoding step. A row outside the cache (negative, at or past
max_seq_len / max_pages_per_seq * page_size, or on a page id outside [0, num_pages)) is the
caller's bug and is skipped: the kernel never writes out of bounds. One CTA per (token, sequence);
its threads copy 128-bit chunks of every KV head of that token.

With `index = "slot_mapping"` (vLLM's reshape_and_cache_flash convention) the new rows are a flat
[num_tokens, Hk, d] batch and token t goes to slot slot_mapping[t] (int64: page * page_size +
offset) of a paged cache with no block table; a negative slot is padding and is skipped, as is a
slot at or past num_pages * page_size. One CTA per token. RoPE then rotates at positions[t]
(int64). Two tokens with the same slot race (one write wins), as in vLLM.

With an FP8 `kv_dtype` the append quantises (fp8 = satfinite(rne(x / scale)), scales per tensor
as runtime scalars or [1] device tensors, or per KV head as [num_kv_heads] tensors), and with `rope` it rotates the new
keys and queries first: both in kv_transform.py.
"""

from __future__ import annotations

from ...errors import InputError, SpecError
from ...ir import S64, Addr, KernelBuilder
from ...spec.fields import Field, FamilyFields, int_range, head_dim_range
from ...spec.model import KernelSpec
from ...targets import Target
from .. import common as C
from ..base import Family, Interface, Launch, LaunchParam, ParamSource, Program, TensorInfo
from ..kv import kv_fp8, kv_transform
from ..kv.kv_access import CACHES, MAX_PAGE_SIZE, KVAccess, check_page_size
from ..kv.kv_rows import NewRows, by_slot, grid
from ..kv.kv_transform_ref import destinations
from ..math import fp8

_hd_check, _hd_allowed = head_dim_range(16, 256)
_page_check, _page_allowed = int_range(1, MAX_PAGE_SIZE)
_rd_check, _rd_allowed = int_range(2, 256, multiple_of=2)
FIELDS = FamilyFields(fields=(
    Field("head_dim", "int", "elements per head", check=_hd_check, allowed=_hd_allowed),
    Field("kv_layout", "str", "KV cache layout", default="contiguous", choices=("contiguous", "paged")),
    Field("page_size", "int", "rows per page (paged only; default 16)", default=None,
          check=_page_check, allowed=_page_allowed),
    Field("kv_dtype", "str", "cache element type (default: dtype); FP8 caches are quantised on "
          "append", default=None, choices=("f32", "f16", "bf16") + fp8.KINDS),
    kv_fp8.KV_SCALE_FIELD,
    Field("rope", "str", "rotate new keys and queries at their positions (default: none)",
          default=None, choices=("neox", "gptj")),
    Field("rotary_dim", "int", "leading elements of each head that RoPE rotates (default head_dim)",
          default=None, check=_rd_check, allowed=_rd_allowed),
    Field("index", "str", "how new rows find their cache rows: per-sequence start positions "
          "(k_new [batch, num_new, ...]) or vLLM's per-token slot_mapping (k_new [num_tokens, ...]; "
          "paged only)", default="positions", choices=("positions", "slot_mapping")),
))
MAX_THREADS = 256


def validate(spec: KernelSpec) -> None:
    C.check_dtype_target(spec.dtype, spec.targets)
    check_page_size(spec)
    kv_fp8.validate(spec)   # kv_dtype / kv_scale: the same rules as decode and varlen
    o = dict(spec.options)
    if o.get("index") == "slot_mapping" and o.get("kv_layout") != "paged":
        raise SpecError(f'index = "slot_mapping" addresses pages (slot = page * page_size + offset); '
                        f'kv_layout is {o.get("kv_layout")!r}, expected "paged"', key="index")
    rd = o.get("rotary_dim")
    if rd is not None and o.get("rope") is None:
        raise SpecError(f"rotary_dim = {rd} needs rope = \"neox\" or \"gptj\"", key="rotary_dim")
    if rd is not None and rd > spec.head_dim:
        raise SpecError(f"got {rd}, expected an even number <= head_dim = {spec.head_dim}",
                        key="rotary_dim")


def transforms(spec: KernelSpec) -> bool:
    """Whether this append quantises or rotates (kv_transform.py) rather than copies."""
    opts = kv_transform.options(spec)
    return bool(opts["fp8"] or opts["rope"])


def _kv(spec: KernelSpec) -> KVAccess:
    paged = spec.opt("kv_layout") == "paged"
    return KVAccess(spec.opt("kv_layout"), C.FORMATS[spec.dtype], (spec.opt("page_size") or 16) if paged else 0,
                    by_slot=by_slot(spec))


def _geometry(spec: KernelSpec) -> tuple[int, int, int]:
    chunks = spec.head_dim // C.FORMATS[spec.dtype].per_vec
    items = spec.num_kv_heads * chunks
    threads = min(MAX_THREADS, -(-items // 32) * 32)
    return chunks, items, threads


def resolve_tile(spec: KernelSpec, target: Target) -> dict:
    if transforms(spec):
        return {"threads": kv_transform.geometry(spec)[2], "chunk_elems": kv_transform.CHUNK}
    _, items, threads = _geometry(spec)
    return {"threads": threads, "chunks_per_thread": -(-items // threads)}


def interface(spec: KernelSpec) -> Interface:
    Hk, d = spec.num_kv_heads, spec.head_dim
    kv = _kv(spec)
    rows = ("num_tokens",) if kv.by_slot else ("batch", "num_new")
    tensors = [TensorInfo(t, spec.dtype, (*rows, Hk, d), "input") for t in ("k_new", "v_new")]
    if kv.by_slot:
        tensors.append(TensorInfo("slot_mapping", "i64", ("num_tokens",), "input", "cache slot of each "
                                  "token: page * page_size + offset; negative (padding) and slots past "
                                  "the cache are skipped", device_resident_scalars=True))
    else:
        tensors.append(TensorInfo("positions", "i32", ("batch",), "input", "cache row of each sequence's "
                                  "first new token; out-of-range rows are skipped", device_resident_scalars=True))
    opts = kv_transform.options(spec)
    tensors += kv.tensors(opts["kv_dtype"], Hk, d, "inout")
    defaults = {"num_tokens": 11, "num_pages": 3} if kv.by_slot else {"batch": 6, "num_new": 3}
    if not kv.by_slot:
        defaults.update({"max_seq_len": 41} if kv.layout == "contiguous" else
                        {"max_pages_per_seq": 3, "num_pages": 6 * 3 + 2})
    dims, scalars = [*rows, *kv.dims()], {}
    if opts["kv_scale"] == "tensor":
        scalars = {f"{t}_scale": {"dtype": "f32", "doc": f"dequantised {t.upper()} = fp8 x {t}_scale "
                                  "(the append stores x / scale)"} for t in "kv"}
    else:   # "device" and "head": f32 tensors (none without FP8)
        tensors += kv_fp8.scale_tensors(spec, opts["kv_scale"], "dequantised = fp8 x scale")
    if opts["rope"]:
        if kv.by_slot:
            tensors.append(TensorInfo("positions", "i64", ("num_tokens",), "input", "RoPE position of "
                                      "each token; a token outside [0, max_position) is skipped",
                                      device_resident_scalars=True))
        tensors += [TensorInfo("q", spec.dtype, (*rows, spec.num_heads, d), "input",
                               "this step's queries, un-rotated"),
                    TensorInfo("q_rot", spec.dtype, (*rows, spec.num_heads, d), "output",
                               "q rotated at each token's position (unrotated for skipped tokens)"),
                    TensorInfo("cos_sin_cache", "f32", ("max_position", opts["rotary_dim"]), "input",
                               "row p: cos of the rotary_dim/2 frequencies at position p, then their sin")]
        dims.append("max_position")
        defaults["max_position"] = 45
    return Interface(tuple(tensors), tuple(dims), defaults, scalars=scalars)


def build(spec: KernelSpec, target: Target) -> Program:
    if transforms(spec):
        return kv_transform.build(spec, target)
    kv = _kv(spec)
    fmt = kv.fmt
    chunks, items, threads = _geometry(spec)
    b = KernelBuilder(f"ptxc_{spec.name}")
    params: list[LaunchParam] = []

    param = C.param_loader(b, params)

    index = "slot_mapping" if kv.by_slot else "positions"
    ptrs = {t: b.to_global(param(t, C.U64, ParamSource("pointer", tensor=t)))
            for t in ("k_new", "v_new", index, *kv.pointer_tensors())}
    new_strides = {(t, a): C.byte_stride(b, param(f"{t}_stride{a}", S64, ParamSource("stride", t, a)), fmt)
                   for t in ("k_new", "v_new") for a in ((0, 1) if kv.by_slot else (0, 1, 2))}
    kv.emit_strides(param)
    kv.emit_dims(param)

    tid, token = b.special("%tid.x"), b.special("%ctaid.x")
    rows = NewRows(b, kv, ptrs, token)
    for rnd in range(-(-items // threads)):
        item = b.add(tid, rnd * threads)
        with b.if_then(b.setp("lt", item, items)):
            kv_head, chunk = b.div(item, chunks), b.rem(item, chunks)
            lane_byte = b.cvt(S64, b.mul(chunk, C.VEC_BYTES))
            bases = kv.bases(b, ptrs, rows.batch, kv_head, lane_byte)
            page_cache = rows.page_cache()
            for t, src_name in zip(CACHES, ("k_new", "v_new")):
                src = b.add(rows.source(src_name, kv_head, new_strides), lane_byte)
                dst, ok = kv.row_address(b, bases, t, rows.row, rows.valid, page_cache)
                with b.predicate(ok):
                    vals = b.ld("global", fmt.load_type, Addr(src), vec=4, nc=True)
                    b.st("global", fmt.load_type, Addr(dst), vals)
    b.ret()
    launch = Launch(entry=b.entry.name, params=tuple(params), grid=grid(spec), block=(threads, 1, 1))
    return Program([b.entry], [launch], resolve_tile(spec, target))


def make_inputs(spec: KernelSpec, dims: dict[str, int], rng) -> dict:
    """Random rows and caches; positions cycle through in-range, end-of-cache (partly past the
    end), negative (partly before the start) and wholly out-of-range starts. By slot: distinct
    slots over the whole cache (crossing pages), with padding (-1), a slot one past the cache and
    a huge one among them."""
    import numpy as np

    from ...reference import round_to
    Hk, d = spec.num_kv_heads, spec.head_dim
    paged = spec.opt("kv_layout") == "paged"
    ps = spec.opt("page_size") or 16
    if by_slot(spec):
        T = dims["num_tokens"]
        rows, new = (dims["num_pages"], ps), (T,)
    else:
        B, N = dims["batch"], dims["num_new"]
        cap = dims["max_pages_per_seq"] * ps if paged else dims["max_seq_len"]
        rows, new = ((dims["num_pages"], ps) if paged else (B, cap)), (B, N)
    k_new, v_new, k_cache, v_cache = (round_to(rng.standard_normal(s), spec.dtype).astype(np.float32)
                                      for s in ((*new, Hk, d), (*new, Hk, d), (*rows, Hk, d), (*rows, Hk, d)))
    if kv_transform.options(spec)["fp8"]:   # FP8 caches hold raw bytes
        k_cache, v_cache = (rng.integers(0, 256, (*rows, Hk, d), dtype=np.uint8) for _ in range(2))
    inputs = {"k_new": k_new, "v_new": v_new, "k_cache": k_cache, "v_cache": v_cache}
    if by_slot(spec):
        slots_total = dims["num_pages"] * ps
        slots = np.full(T, -1, np.int64)     # more tokens than slots: the rest are padding
        taken = rng.permutation(slots_total)[:T]
        slots[:taken.size] = taken
        for i, bad in zip(range(2, T, 4), (-1, slots_total, 1 << 40, -(1 << 40))):
            slots[i] = bad            # padding, one past the cache, far past, far before
        inputs["slot_mapping"] = slots
    else:
        starts = [0, cap // 3, cap - 1, -1, cap + 2, max(0, cap - N)]
        inputs["positions"] = np.array([starts[i % len(starts)] for i in range(B)], dtype=np.int32)
    if paged and not by_slot(spec):
        need = B * dims["max_pages_per_seq"]
        if dims["num_pages"] < need:
            raise InputError(f"num_pages = {dims['num_pages']} < batch * max_pages_per_seq = {need}")
        table = rng.permutation(dims["num_pages"])[:need].astype(np.int32).reshape(B, -1)
        if table.size:
            table[-1, -1] = dims["num_pages"] + 7   # a corrupt entry: rows on that page are skipped
        inputs["block_table"] = table
    if transforms(spec):
        from ..kv.kv_transform_ref import add_inputs
        add_inputs(spec, dims, inputs, rng)
    return inputs


def reference(spec: KernelSpec, inputs: dict, dtype: str | None = None) -> dict:
    """The caches after the scatter (exact: this family only moves bits)."""
    import numpy as np
    if transforms(spec):
        from ..kv.kv_transform_ref import reference as transform_reference
        return transform_reference(spec, inputs, dtype)
    k, v = inputs["k_cache"].astype(np.float64), inputs["v_cache"].astype(np.float64)
    for src, _, dst in destinations(spec, inputs):
        k[dst], v[dst] = inputs["k_new"][src], inputs["v_new"][src]
    return {"k_cache": k, "v_cache": v}


def unread(spec: KernelSpec, inputs: dict) -> dict:
    """The cache rows the append neither reads nor writes: every row but its destinations,
    which launch-test fills with NaN and which must come back as they went in."""
    import numpy as np
    from ..kv.kv_transform_ref import destinations
    mask = np.ones(inputs["k_cache"].shape[:2], dtype=bool)
    for _, _, dst in destinations(spec, inputs):
        mask[dst] = False
    return {"k_cache": mask, "v_cache": mask}


FAMILY = Family(name="kv_append", doc=__doc__.split("\n")[0], fields=FIELDS, validate=validate,
                interface=interface, build=build, resolve_tile=resolve_tile,
                make_inputs=make_inputs, reference=reference, unread=unread)
