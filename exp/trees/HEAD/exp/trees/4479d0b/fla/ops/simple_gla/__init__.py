"""Simple GLA: linear attention with a scalar per-head decay, ALGORITHMS.md §2."""
from fla.ops.simple_gla.chunk import chunk_simple_gla
from fla.ops.simple_gla.fused_recurrent import fused_recurrent_simple_gla
from fla.ops.simple_gla.naive import naive_recurrent_simple_gla

__all__ = ["chunk_simple_gla", "fused_recurrent_simple_gla", "naive_recurrent_simple_gla"]
