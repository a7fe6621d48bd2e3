"""RWKV7 (Goose): the DPLR delta rule with q = r and gk = w, ALGORITHMS.md §4."""
from fla.ops.rwkv7.naive import naive_recurrent_rwkv7
from fla.ops.rwkv7.ops import chunk_rwkv7, fused_recurrent_rwkv7

__all__ = ["chunk_rwkv7", "fused_recurrent_rwkv7", "naive_recurrent_rwkv7"]
