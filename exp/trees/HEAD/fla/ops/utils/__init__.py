"""Chunk utilities shared by the recurrence families: local cumsum of gates, the
per-chunk triangular inverse of the UT/WY transform, and varlen index helpers."""
from fla.ops.utils.cumsum import (
    chunk_local_cumsum,
    chunk_local_cumsum_bwd,
    chunk_local_cumsum_fwd,
)
from fla.ops.utils.index import (
    prepare_chunk_indices,
    prepare_chunk_offsets,
    prepare_lens,
    prepare_token_chunk_positions,
)
from fla.ops.utils.solve_tril import solve_tril, solve_tril_fwd

__all__ = [
    "chunk_local_cumsum", "chunk_local_cumsum_fwd", "chunk_local_cumsum_bwd",
    "solve_tril", "solve_tril_fwd",
    "prepare_lens", "prepare_chunk_indices", "prepare_chunk_offsets",
    "prepare_token_chunk_positions",
]
