"""Loading a chunk's 64 x 64 matrices (Ai, Aqk, the WY factor) with vector loads.

A masked load whose mask changes along the contiguous dimension cannot be vectorised:
on Triton 3.6 / sm_90, ``mask=m_t[:, None] & m_t[None, :]`` on a bf16 [64, 64] tile
(with T not a specialised argument) compiles to 32 two-byte loads a thread, issued
synchronously, where a row mask alone gives 16-byte copies that the software pipeliner
can issue a chunk ahead. The column mask is applied in registers instead: every column
of a valid token's row exists in memory (the last dimension is the chunk size), so the
loads stay in bounds, and whatever a caller left in the masked-off entries still never
reaches the result.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_chunk_rows(ptr, m_rows, m_keep):
    """``ptr [R, C]`` pointers to rows of a chunk's matrix: the rows where ``m_rows [R]``
    holds, loaded whole (other rows read as 0), then every entry outside ``m_keep
    [R, C]`` set to 0 in registers."""
    b_x = tl.load(ptr, mask=m_rows[:, None], other=0.)
    return tl.where(m_keep, b_x, tl.zeros_like(b_x))
