"""Each kernel family end to end: the real PTX of every path in the emulator against fp64 references on odd shapes, its spec rules, and ptxas figures."""
