"""The causal gated scores of one chunk, formed inside a pass over the chunks.

    Aqk_ij = (q_i · k_j) · exp(γ_i − γ_j)   for j ≤ i (both valid tokens), else 0

with γ the chunk-local cumulative log decay (ALGORITHMS.md §2). Simple GLA's forward
state pass (``chunk_fwd_inter`` with ``FORM_AQK``) accumulates Q Kᵀ beside Q S over the
same Q and K tiles and turns it into the scores here, instead of reading them from an
intra-chunk kernel's output. (Forming them again in the backward's reverse pass was
measured on H100 and dropped: 1.09 ms against 0.55 reading the stored scores at
1x8192x96x128, from the spills of a second 64 x 64 accumulator; the forward stores them
when a backward will follow.)
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gate_causal_scores(b_qk, m_t, b_g, BT: tl.constexpr, USE_G: tl.constexpr):
    """Q Kᵀ [BT, BT] (fp32) to the chunk's scores: times exp(γ_i − γ_j) on and below the
    diagonal between valid tokens ``m_t``, zero elsewhere."""
    o_t = tl.arange(0, BT)
    m_causal = (m_t[:, None] & m_t[None, :]) & (o_t[:, None] >= o_t[None, :])
    if USE_G:
        # exp(γ_i − γ_j) ≤ 1 on and below the diagonal; the exponent is zeroed above it
        # before exp, so steep decays never overflow there.
        b_qk *= tl.exp(tl.where(m_causal, b_g[:, None] - b_g[None, :], 0.))
    return tl.where(m_causal, b_qk, 0.)
