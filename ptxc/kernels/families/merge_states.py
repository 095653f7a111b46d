"""Family "merge_states": merge two attention states over disjoint key sets into one.

A state is (o, lse): o the softmax-normalised output over some keys and lse = log Σ e^s their
natural-log sum (what every attention family writes with return_lse). Two states of the same
query rows, over keys A and B with A ∩ B = ∅, merge exactly into the state over A ∪ B:

    m = max(lse_a, lse_b),  w_x = e^(lse_x − m),  o = (w_a o_a + w_b o_b) / (w_a + w_b),
    lse = m + log(w_a + w_b)

— vLLM's `merge_attn_states` and FlashInfer's `merge_state`: cascade attention (a shared
prefix and each request's suffix), chunked-context prefill (MLA's context chunks and the new
tokens), any split an engine makes itself. An lse of −inf is a state that saw no key, and so is
+inf (FlashAttention-2/3 mark a fully masked row that way; vLLM's kernel reads it so too): its
weight is 0 and its o is never read (garbage, NaN included, stays out). Both empty: o = 0,
lse = −inf. One CTA per token; its threads take 16-byte chunks of every head.

Strides: o_a, o_b and o take a token and a head stride at run time (views into larger
tensors); the lse tensors take both too, element by element, so vLLM's [num_heads, num_tokens]
layout is the transposed view of [num_tokens, num_heads]. Outputs must not overlap inputs.
"""

from __future__ import annotations

from ...ir import F32, S64, Addr, KernelBuilder
from ...spec.fields import Field, FamilyFields, head_dim_range
from ...spec.model import KernelSpec
from ...targets import Target
from .. import common as C
from ..attention.softmax import log_sum_exp, normaliser, rescale_factor, safe_max
from ..base import Family, Interface, Launch, LaunchParam, ParamSource, Program, TensorInfo

_hd_check, _hd_allowed = head_dim_range(16, 512)
FIELDS = FamilyFields(fields=(
    Field("head_dim", "int", "elements per head of o (a value head: DeepSeek prefill's 128, "
          "MLA's 512)", check=_hd_check, allowed=_hd_allowed),
    Field("return_lse", "bool", "also write the merged lse [num_tokens, num_heads] (f32, natural "
          "log; a chain of merges needs it)", default=False),
))
MAX_THREADS = 256
STATES = ("a", "b")


def validate(spec: KernelSpec) -> None:
    C.check_dtype_target(spec.dtype, spec.targets)


def _geometry(spec: KernelSpec) -> tuple[int, int, int]:
    """(16-byte chunks per head, chunks per token, threads per CTA)."""
    chunks = spec.head_dim // C.FORMATS[spec.dtype].per_vec
    items = spec.num_heads * chunks
    return chunks, items, min(MAX_THREADS, -(-items // 32) * 32)


def resolve_tile(spec: KernelSpec, target: Target) -> dict:
    _, items, threads = _geometry(spec)
    return {"threads": threads, "chunks_per_thread": -(-items // threads)}


def interface(spec: KernelSpec) -> Interface:
    H, d, lse_rows = spec.num_heads, spec.head_dim, ("num_tokens", spec.num_heads)
    tensors = []
    for x in STATES:
        tensors += [TensorInfo(f"o_{x}", spec.dtype, ("num_tokens", H, d), "input",
                               f"state {x}'s normalised output"),
                    TensorInfo(f"lse_{x}", "f32", lse_rows, "input", f"state {x}'s natural-log sum of "
                               "e^score; -inf or +inf: it saw no key (its o is not read)",
                               element_access=True)]
    tensors.append(TensorInfo("o", spec.dtype, ("num_tokens", H, d), "output", "the merged output"))
    if spec.opt("return_lse"):
        tensors.append(TensorInfo("lse", "f32", lse_rows, "output", "the merged lse (-inf: neither "
                                  "state saw a key)", element_access=True))
    return Interface(tuple(tensors), ("num_tokens",), {"num_tokens": 37})


def build(spec: KernelSpec, target: Target) -> Program:
    fmt = C.FORMATS[spec.dtype]
    chunks, items, threads = _geometry(spec)
    has_lse = bool(spec.opt("return_lse"))
    b = KernelBuilder(f"ptxc_{spec.name}")
    params: list[LaunchParam] = []
    param = C.param_loader(b, params)

    outs = ("o",) + (("lse",) if has_lse else ())
    names = [f"{t}_{x}" for x in STATES for t in ("o", "lse")] + list(outs)
    ptrs = {t: b.to_global(param(t, C.U64, ParamSource("pointer", tensor=t))) for t in names}
    strides = {(t, a): C.byte_stride(b, param(f"{t}_stride{a}", S64, ParamSource("stride", t, a)),
                                     fmt if t.startswith("o") else C.FORMATS["f32"])
               for t in names for a in (0, 1)}

    tid, token = b.special("%tid.x"), b.special("%ctaid.x")

    def row(t, head):   # the address of (token, head) of tensor t
        at = C.element_offset(b, b.bitcast(C.element_offset(b, ptrs[t], token, strides[(t, 0)]), C.U64),
                              head, strides[(t, 1)])
        return b.bitcast(at, C.U64)

    for rnd in range(-(-items // threads)):
        item = b.add(tid, rnd * threads)
        with b.if_then(b.setp("lt", item, items)):
            head, chunk = b.div(item, chunks), b.rem(item, chunks)
            lane_byte = b.cvt(S64, b.mul(chunk, C.VEC_BYTES))
            # an lse of +-inf is an empty state: -inf, so its weight is 0 (log2 units from here)
            lse = {}
            for x in STATES:
                v = b.ld("global", F32, Addr(row(f"lse_{x}", head)), nc=True)
                lse[x] = b.selp(C.NEG_INF, b.mul(v, C.LOG2E), b.setp("eq", b.abs(v), C.POS_INF))
            m = b.max(lse["a"], lse["b"])
            m_use = safe_max(b, m)
            total = b.mov(0.0, F32)
            acc = [b.mov(0.0, F32) for _ in range(fmt.per_vec)]
            for x in STATES:
                w = rescale_factor(b, lse[x], m_use)
                b.add(total, w, out=total)
                vals = C.to_f32(b, fmt, C.load_vec(b, fmt, Addr(b.add(row(f"o_{x}", head), b.bitcast(lane_byte, C.U64))),
                                                   b.setp("gt", w, 0.0)))   # an empty state's o: not read
                for a, v in zip(acc, vals):
                    b.fma(v, w, a, out=a)
            inv, seen = normaliser(b, total)
            out = [b.mul(a, inv) for a in acc]
            C.store_vec(b, fmt, Addr(b.add(row("o", head), b.bitcast(lane_byte, C.U64))),
                        C.from_f32(b, fmt, out, target))
            if has_lse:
                merged = log_sum_exp(b, m, total, seen)
                with b.if_then(b.setp("eq", chunk, 0)):
                    b.st("global", F32, Addr(row("lse", head)), [merged])
    b.ret()
    launch = Launch(entry=b.entry.name, params=tuple(params), grid=("num_tokens", "1", "1"),
                    block=(threads, 1, 1))
    return Program([b.entry], [launch], resolve_tile(spec, target))


def make_inputs(spec: KernelSpec, dims: dict[str, int], rng) -> dict:
    """Random states: outputs of norm ~1, lse around the scores' range with one token of every
    kind of empty state (a −inf, a +inf, both empty, one side far below the other: e^-200), and
    NaN in the o of every empty state (a kernel must not read it)."""
    import numpy as np

    from ...reference import round_to
    T, H, d = dims["num_tokens"], spec.num_heads, spec.head_dim
    inputs = {}
    for x in STATES:
        inputs[f"o_{x}"] = round_to(rng.standard_normal((T, H, d)), spec.dtype).astype(np.float32)
        inputs[f"lse_{x}"] = (rng.standard_normal((T, H)) * 3.0).astype(np.float32)
    kinds = [("a", -np.inf), ("b", -np.inf), ("a", np.inf), ("b", np.inf), ("ab", -np.inf),
             ("ab", np.inf), ("b", -200.0)]
    for t, (which, value) in zip(range(1, T, 3), kinds):
        h = slice(None) if t % 2 else slice(0, max(1, H // 2))
        for x in which:
            inputs[f"lse_{x}"][t, h] = value
    for x in STATES:
        inputs[f"o_{x}"][np.isinf(inputs[f"lse_{x}"])] = np.nan
    return inputs


def reference(spec: KernelSpec, inputs: dict, dtype: str | None = None) -> dict:
    """The merged state in float64 (with `dtype`: o_a, o_b, the weights' products and the sum
    rounded to it — the naive same-dtype merge)."""
    import numpy as np

    from ...reference import round_to
    rnd = (lambda v: round_to(v, dtype)) if dtype else (lambda v: v)
    lse = {x: np.asarray(inputs[f"lse_{x}"], np.float64) for x in STATES}
    lse = {x: np.where(np.isinf(v), -np.inf, v) for x, v in lse.items()}
    m = np.maximum(lse["a"], lse["b"])
    m_use = np.where(np.isfinite(m), m, 0.0)
    w = {x: np.exp(lse[x] - m_use) for x in STATES}
    total = w["a"] + w["b"]
    acc = 0.0
    for x in STATES:
        o = np.asarray(inputs[f"o_{x}"], np.float64)
        acc = acc + rnd(np.where(w[x][..., None] > 0, o, 0.0) * w[x][..., None])
    with np.errstate(divide="ignore", invalid="ignore"):
        out = {"o": rnd(np.where(total[..., None] > 0, acc / np.where(total > 0, total, 1.0)[..., None], 0.0))}
        if spec.opt("return_lse"):
            out["lse"] = np.where(total > 0, m_use + np.log(np.where(total > 0, total, 1.0)), -np.inf)
    return out


FAMILY = Family(name="merge_states", doc=__doc__.split("\n")[0], fields=FIELDS, validate=validate,
                interface=interface, build=build, resolve_tile=resolve_tile,
                make_inputs=make_inputs, reference=reference)
