"""KV caches: where a row lives per layout (contiguous, pointer array, paged, latent, sparse),
paged tiles, FP8 cache formats, and kv_append's rows and transforms."""
