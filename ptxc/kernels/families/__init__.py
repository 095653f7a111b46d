"""Kernel families: each module is one family as a composition (its spec fields, tensors,
validation, path table and build), with its random batches and fp64 reference."""
