"""Simple GLA: linear attention with a scalar per-head decay, ALGORITHMS.md §2."""
from fla.ops.simple_gla.naive import naive_recurrent_simple_gla

__all__ = ["naive_recurrent_simple_gla"]
