"""The attention seams every body shares: the variant (key range, mask predicate, score
transforms, sinks, finishing a row), packed custom masks, the per-tile contexts (prefill's Ctx,
the GQA-packed tile), split-KV planning and its reduce."""
