"""RWKV6 (Finch): GLA with a bonus for the current token, ALGORITHMS.md §3."""
from fla.ops.rwkv6.chunk import chunk_rwkv6, fused_recurrent_rwkv6
from fla.ops.rwkv6.naive import naive_recurrent_rwkv6

__all__ = ["chunk_rwkv6", "fused_recurrent_rwkv6", "naive_recurrent_rwkv6"]
