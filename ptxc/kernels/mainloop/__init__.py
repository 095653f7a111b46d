"""Main loops: the K/V tile loops per load method (cp.async ring, wgmma overlap, TMA one issuer,
TMA warp-specialised, tcgen05 warp roles) and the shared-memory row tiles they stage."""
