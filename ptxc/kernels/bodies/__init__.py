"""Kernel bodies: the per-path compositions of scheduler, mainloop, fragment math, variant and
epilogue (the places that call a mainloop with a math)."""
