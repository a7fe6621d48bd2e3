"""GLA: linear attention with a vector (per key channel) decay, ALGORITHMS.md §3."""
from fla.ops.gla.chunk import chunk_gla
from fla.ops.gla.fused_recurrent import fused_recurrent_gla
from fla.ops.gla.naive import naive_recurrent_gla

__all__ = ["chunk_gla", "fused_recurrent_gla", "naive_recurrent_gla"]
