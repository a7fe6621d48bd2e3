"""The causal gated scores of one chunk, formed inside a pass over the chunks.

    Aqk_ij = (q_i · k_j) · exp(γ_i − γ_j)   for j ≤ i (both valid tokens), else 0

with γ the chunk-local cumulative log decay (ALGORITHMS.md §2). Simple GLA's state passes
(``chunk_fwd_inter`` forward, ``chunk_delta_h_bwd`` backward) call this where they need
the scores instead of reading them from an intra-chunk kernel's output: the chunk's Q and
K rows are in L1/L2 from the pass's own loads, and the 64 x 64 result lives only while it
is used. (The forward pass accumulates Q Kᵀ beside Q S over the same tiles and applies
only :func:`gate_causal_scores`: in its code, offline for sm_90 on Triton 3.6, that spills
less than a second loop; in the backward pass the second loop spills less.)
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def chunk_causal_scores(q, k, p_row, m_t, b_g, K: tl.constexpr, BK: tl.constexpr,
                        BT: tl.constexpr, USE_G: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """[BT, BT] fp32 scores of one chunk. ``p_row`` [BT]: offset of each token's channel 0
    in ``q`` and ``k`` (same layout); ``m_t`` [BT]: valid tokens; ``b_g`` [BT] fp32: γ
    (ignored unless ``USE_G``). The K channels are summed in BK-wide tiles."""
    b_qk = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        p = p_row[:, None] + o_k[None, :]
        m = m_t[:, None] & (o_k < K)[None, :]
        b_qk = tl.dot(tl.load(q + p, mask=m, other=0.), tl.trans(tl.load(k + p, mask=m, other=0.)),
                      b_qk, input_precision=DOT_PRECISION)
    return gate_causal_scores(b_qk, m_t, b_g, BT, USE_G)


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
