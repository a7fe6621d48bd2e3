"""Mamba2 (SSD): simple GLA with q = C, k = B, v = dt·x, g = dt·A, ALGORITHMS.md §2."""
from fla.ops.mamba2.naive import naive_ssd, ssd_as_simple_gla

__all__ = ["naive_ssd", "ssd_as_simple_gla"]
