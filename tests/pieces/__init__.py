"""The pieces below the families: the IR builder and its Hopper/TMA/tensor-core ops, FP8 arithmetic, the split-KV plan, the import layers."""
