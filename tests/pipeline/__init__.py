"""The compiler pipeline: spec loading and errors, build, cache, artifacts, verify, hardening against tampered inputs, faults, ptxas (0 spills) and golden PTX."""
