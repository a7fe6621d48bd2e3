"""GLA: linear attention with a vector (per key channel) decay, ALGORITHMS.md §3."""
from fla.ops.gla.naive import naive_recurrent_gla

__all__ = ["naive_recurrent_gla"]
