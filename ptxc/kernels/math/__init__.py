"""Fragment math per instruction set (SIMT, mma.sync, wgmma, tcgen05): scores, the mapping of
logical (row, key) to registers, softmax over fragments, P·V and the epilogue; FP8 arithmetic."""
