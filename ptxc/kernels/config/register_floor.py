"""Shapes where ptxas's own occupancy heuristic spills: they get `.minnctapersm 1`.

Without a `.minnctapersm`, ptxas caps a kernel's registers at a level that keeps some number of
CTAs resident (72, 80, 96, 128 or 168 here) and spills what does not fit; with `.minnctapersm 1`
it takes what the kernel needs (e.g. varlen d208: 168 registers and 24 spilled bytes -> 238 and
none). Shared memory already bounds these kernels' occupancy, so the floor costs no residency
where the sweep found spills. The two-CTA prefill tile (`.minnctapersm 2`, 128 registers) is not
taken where it spills either. Shapes that spill even at 255 registers take a narrower default K/V
tile instead (NARROW_TILES); a tile the user names is theirs. One rule stands beside the tables:
varlen over an FP8 cache under soft-cap or ALiBi always takes the floor (needs_floor).

The tables are the output of `python bench/spill_sweep.py --floors` (every family x dtype x causal
x head_dim 16..256 step 8 and 512 x default target, and every option and the option
combinations models ship over every head_dim, assembled by ptxas 13.5): a key is
"family/dtype class/head_dim/causal/target[/options]", dtype class "f16" for f16 and bf16 (they
spill alike) and "f32", options the spec's register-relevant options (option_tags) joined by
"+". tests/pipeline/test_spill_sweep.py asserts 0 spills over the whole matrix with it.
"""

from __future__ import annotations

SPILLING_SHAPES = frozenset({
    "decode/f16/152/-/sm_120",
    "decode/f16/192/-/sm_90/cap+sink",
    "decode/f16/512/-/sm_80/fp8+device+split",
    "prefill/f16/88/causal/sm_80", "prefill/f16/128/noncausal/sm_120",
    "prefill/f16/128/noncausal/sm_80", "prefill/f32/80/causal/sm_90",
    "prefill/f32/88/causal/sm_90", "prefill/f32/112/causal/sm_90",
    "prefill/f32/120/causal/sm_90", "prefill/f32/128/causal/sm_120",
    "prefill/f32/128/causal/sm_90", "prefill/f32/160/causal/sm_120",
    "prefill/f32/160/causal/sm_80", "prefill/f32/160/causal/sm_89",
    "prefill/f32/176/noncausal/sm_90", "prefill/f32/184/noncausal/sm_90",
    "prefill/f32/208/noncausal/sm_89", "prefill/f32/216/noncausal/sm_89",
    "prefill/f16/32/causal/sm_80/alibi", "prefill/f16/32/causal/sm_90/alibi",
    "prefill/f16/120/causal/sm_80/alibi", "prefill/f16/192/causal/sm_80/alibi",
    "prefill/f16/88/causal/sm_80/cap",
    "prefill/f16/104/causal/sm_80/lse", "prefill/f16/112/causal/sm_80/lse",
    "prefill/f16/120/causal/sm_80/lse", "prefill/f16/128/causal/sm_80/lse",
    "prefill/f16/144/noncausal/sm_120/packed", "prefill/f16/160/noncausal/sm_89/packed",
    "prefill/f16/136/noncausal/sm_89/packed", "prefill/f16/512/noncausal/sm_120/packed",
    "prefill/f16/88/causal/sm_80/win+cap",
    "varlen/f16/16/noncausal/sm_80", "varlen/f16/16/noncausal/sm_89",
    "varlen/f16/24/noncausal/sm_80", "varlen/f16/24/noncausal/sm_89",
    "varlen/f16/24/noncausal/sm_90", "varlen/f16/40/causal/sm_80", "varlen/f16/40/causal/sm_89",
    "varlen/f16/48/causal/sm_89", "varlen/f16/112/causal/sm_89", "varlen/f16/144/causal/sm_89",
    "varlen/f16/208/noncausal/sm_80", "varlen/f16/208/noncausal/sm_89",
    "varlen/f16/16/causal/sm_120/alibi", "varlen/f16/16/causal/sm_80/alibi",
    # every variant at once (window + soft-cap + sinks + ALiBi: the sweep's "every" rows)
    "varlen/f16/64/causal/sm_80/win+cap+sink+alibi", "varlen/f16/104/causal/sm_120/win+cap+sink+alibi",
    "varlen/f16/72/causal/sm_90/win+cap+sink+alibi", "varlen/f16/184/causal/sm_90/win+cap+sink+alibi",
    "varlen/f16/72/causal/sm_90a/win+cap+sink+alibi", "varlen/f16/184/causal/sm_90a/win+cap+sink+alibi",
    "varlen/f16/88/causal/sm_80/alibi", "varlen/f16/88/causal/sm_89/alibi",
    "varlen/f16/104/causal/sm_120/alibi", "varlen/f16/104/causal/sm_89/alibi",
    "varlen/f16/32/causal/sm_89/cap", "varlen/f16/40/causal/sm_80/cap",
    "varlen/f16/40/causal/sm_89/cap", "varlen/f16/48/causal/sm_89/cap",
    "varlen/f16/144/causal/sm_89/cap",
    "varlen/f16/40/causal/sm_80/fp8", "varlen/f16/40/causal/sm_89/fp8",
    "varlen/f16/88/causal/sm_89/fp8", "varlen/f16/104/causal/sm_80/fp8",
    "varlen/f16/24/causal/sm_80/fp8+device+split", "varlen/f16/24/causal/sm_89/fp8+device+split",
    "varlen/f16/88/causal/sm_89/fp8+device+split",
    "varlen/f16/72/causal/sm_80/fp8+head", "varlen/f16/88/causal/sm_90/fp8+head",
    "varlen/f16/104/causal/sm_89/fp8+head", "varlen/f16/104/causal/sm_90/fp8+head",
    "varlen/f16/16/causal/sm_90/lse+split", "varlen/f16/72/causal/sm_89/lse+split",
    "varlen/f16/72/causal/sm_90/lse+split", "varlen/f16/80/causal/sm_80/lse+split",
    "varlen/f16/192/causal/sm_80/lse+split",
    "varlen/f16/40/causal/sm_80/sink", "varlen/f16/40/causal/sm_89/sink",
    "varlen/f16/48/causal/sm_89/sink",
    "varlen/f16/16/causal/sm_89/win", "varlen/f16/16/causal/sm_90/win",
    "varlen/f16/24/causal/sm_89/win", "varlen/f16/40/causal/sm_80/win",
    "varlen/f16/72/causal/sm_90/win", "varlen/f16/88/causal/sm_120/win",
    "varlen/f16/88/causal/sm_80/win", "varlen/f16/96/causal/sm_80/win",
    "varlen/f16/16/causal/sm_89/win+cap", "varlen/f16/16/causal/sm_90/win+cap",
    "varlen/f16/24/causal/sm_89/win+cap", "varlen/f16/72/causal/sm_80/win+cap",
    "varlen/f16/88/causal/sm_120/win+cap", "varlen/f16/88/causal/sm_80/win+cap",
    "varlen/f16/112/causal/sm_80/win+cap",
    "varlen/f16/16/causal/sm_89/win+sink", "varlen/f16/16/causal/sm_90/win+sink",
    "varlen/f16/24/causal/sm_89/win+sink", "varlen/f16/40/causal/sm_80/win+sink",
    "varlen/f16/72/causal/sm_90/win+sink", "varlen/f16/88/causal/sm_120/win+sink",
    "varlen/f16/88/causal/sm_80/win+sink", "varlen/f16/96/causal/sm_80/win+sink",
    # sm_100a's mma.sync tile (head dims tcgen05 does not take) with every variant
    "varlen/f16/32/causal/sm_100a/win+cap+sink+alibi",
    # attention_chunk: its per-row bounds at ptxas's tighter caps (sweep: 13 shapes)
    "prefill/f16/120/causal/sm_80/win+chunk+cap+sink+alibi+lse",
    "prefill/f16/128/causal/sm_80/win+chunk+cap+sink+alibi+lse",
    "prefill/f16/24/causal/sm_120/win+chunk+cap+sink+alibi+lse",
    "varlen/f16/16/causal/sm_80/chunk", "varlen/f16/16/causal/sm_89/chunk",
    "varlen/f16/16/causal/sm_90/chunk", "varlen/f16/24/causal/sm_80/chunk",
    "varlen/f16/24/causal/sm_89/chunk", "varlen/f16/80/causal/sm_89/chunk",
    "varlen/f16/88/causal/sm_89/chunk", "varlen/f16/96/causal/sm_90/chunk",
    "varlen/f16/184/causal/sm_90/win+chunk+cap+sink+alibi+lse+split",
    "varlen/f16/184/causal/sm_90a/win+chunk+cap+sink+alibi",
    # mla (keyed as its varlen view): the paged tile's page-id registers at 128 registers
    "mla/f16/160/causal/sm_80/dv128", "mla/f16/176/causal/sm_80/dv128", "mla/f16/192/causal/sm_80/dv128",
    "mla/f16/208/causal/sm_80/dv128", "mla/f16/224/causal/sm_80/dv128", "mla/f16/240/causal/sm_80/dv128",
    "mla/f16/256/causal/sm_80/dv128", "mla/f16/528/causal/sm_89/lse+split+dv448",
    "mla/f16/544/causal/sm_89/lse+split+dv448", "mla/f16/560/causal/sm_89/lse+split+dv448",
})

# Shapes that spill even at 255 registers: the default K/V tile narrows to this many keys
# (fewer score registers; the same bytes move).
NARROW_TILES = {
    "varlen/f16/120/noncausal/sm_120/packed": 32, "varlen/f16/128/noncausal/sm_120/packed": 32,
    "varlen/f16/128/noncausal/sm_120/lse+packed": 32, "prefill/f16/128/noncausal/sm_120/lse+packed": 32,
    "varlen/f16/120/causal/sm_120/tree": 32, "varlen/f16/128/causal/sm_80/tree": 32,
    "varlen/f16/248/causal/sm_80/tree": 16,
}

# spec option -> tag in a shape key, for the options that change a kernel's register allocation
_TAGS = (
    ("sliding_window", lambda v: v is not None, "win"),
    ("attention_chunk", lambda v: v is not None, "chunk"),
    ("logits_soft_cap", lambda v: v is not None, "cap"),
    ("attention_sinks", bool, "sink"),
    ("alibi", bool, "alibi"),
    ("return_lse", bool, "lse"),
    ("kv_dtype", lambda v: v in ("e4m3", "e5m2"), "fp8"),
    ("kv_scale", lambda v: v in ("head", "device"), None),        # the mode is the tag
    ("num_splits", lambda v: v not in (None, 1), "split"),
    ("custom_mask", lambda v: v in ("tree", "packed"), None),    # the mode is the tag
    ("append_kv", bool, "append"),
    ("rope", lambda v: v is not None, "rope"),
)


def option_tags(spec) -> tuple[str, ...]:
    options = dict(spec.options)
    tags = [tag or options[key] for key, present, tag in _TAGS
            if key in options and present(options[key])]
    if "head_dim_v" in options and options["head_dim_v"] not in (None, spec.head_dim):
        tags.append(f"dv{options['head_dim_v']}")
    if spec.tile_dict().get("warp_rows") == 32:
        tags.append("wr32")
    return tuple(tags)


def shape_key(family: str, spec, target) -> str:
    causal = "-" if family in ("decode", "kv_append", "merge_states") else (
        "causal" if spec.opt("causal") else "noncausal")
    dtype = "f32" if spec.dtype == "f32" else "f16"
    tags = option_tags(spec)
    return f"{family}/{dtype}/{spec.head_dim}/{causal}/{target.name}" + (
        "/" + "+".join(tags) if tags else "")


def needs_floor(family: str, spec, target) -> bool:
    """True where ptxas's default register cap spills this shape (see the module doc), and for
    every varlen kernel over an FP8 cache under a score transform: the soft-cap's cap and its
    inverse or the ALiBi slopes over k_scale are live across the loop (MmaMath.fold_k_scale),
    and at ptxas's 96 / 128 / 168 caps the sweep found 8-44 bytes spilled at 16 head sizes of
    its rows, a different 16 with each change of the loop -- a rule, not a table."""
    if target is None:
        return False
    tags = option_tags(spec)
    if family == "varlen" and "fp8" in tags and {"cap", "alibi"} & set(tags):
        return True
    return shape_key(family, spec, target) in SPILLING_SHAPES


def narrow_block_n(family: str, spec, target, block_n: int) -> int:
    """The default block_n, narrowed where even 255 registers spill (NARROW_TILES)."""
    if target is None:
        return block_n
    return min(block_n, NARROW_TILES.get(shape_key(family, spec, target), block_n))
