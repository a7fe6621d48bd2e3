"""The intra-chunk attention and the output of the chunked vector-gate forward (GLA and
RWKV6's state part, ALGORITHMS.md §3), one program per (chunk, head).

With γ the chunk-local cumulative log gate ``[B, T, H, K]``, γq the query side's (γ for
GLA; the exclusive γ − w for RWKV6, whose query reads the state before its token) and
S = h[chunk] the state entering the chunk (``chunk_delta_h`` with a vector gate)::

    A_ij = Σ_k q_ik k_jk exp(γq_ik − γ_jk)      j ≤ i (``EXCLUSIVE``: j < i)
    O    = scale · [ (Q ⊙ exp(γq)) S + A V ]

Numerics: exp(γq_i − γ_j) must never be formed as exp(γq_i) · exp(−γ_j) (γ reaches
−5 · 64 = −320 in a chunk: exp(320) overflows even fp32). The chunk is cut into four
16-row strips. For query strip I and the keys before it, the reference row r = 16I − 1
(the last key row before the strip) splits the exponent into two parts that are both
≤ 0, for GLA and for the exclusive RWKV6 query alike::

    A_ij = Σ_k [q_ik exp(γq_ik − γ_rk)] · [k_jk exp(γ_rk − γ_jk)]        (j ≤ r < i)

so one 16 x 64 dot per K tile covers all earlier keys; each factor is at least the
product, so nothing representable underflows. The 16 x 16 diagonal block is formed pair
by pair (one key column at a time) with the masked difference exp(γq_i − γ_j).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
# tl.reduce with _sum_combine is tl.sum without the per-call cost in the interpreter.
from triton.language.standard import _sum_combine

from fla.ops.utils.index import locate_chunk
from fla.ops.utils.tiles import tile_width
from fla.utils.triton_facts import dot_precision
from fla.utils.tuning import Config, tuned

__all__ = ["chunk_gk_fwd_o", "chunk_gk_fwd_o_kernel"]

CHUNK_SIZE = 64  # four 16-row strips


def _default(args) -> Config:
    # [16, 64] fp32 scores, a [16, BV] output and the [64, BK] key operands per step.
    return Config(BK=tile_width(args["K"], 64), BV=tile_width(args["V"], 64), num_warps=4,
                  num_stages=2)


def _space(args) -> list[Config]:
    return list(dict.fromkeys(
        Config(BK=tile_width(args["K"], bk), BV=tile_width(args["V"], bv), num_warps=w,
               num_stages=s)
        for bk in (32, 64) for bv in (32, 64) for w in (4, 8) for s in (1, 2)))


@triton.jit
def gk_diagonal_pair(b_gx, m_x, p_y, p_gy, j, m_y, o_c, EXCLUSIVE: tl.constexpr,
                     Q_SIDE: tl.constexpr):
    """One pair column of a 16 x 16 diagonal block: with y = row j of the block (key j
    when ``Q_SIDE``, query j otherwise) and x the block's 16 rows (gates ``b_gx`` [16, BK]),
    returns the [16, BK] terms y ⊙ exp(±(γx − γy)) masked to the causal pairs of valid rows
    (``m_x`` [16]; ``m_y`` [BK] masks y's channels and is all False past the chunk's
    end), whose exponent (query gate minus key gate) is ≤ 0 and masked before exp."""
    b_y = tl.load(p_y, mask=m_y, other=0.).to(tl.float32)
    b_gy = tl.load(p_gy, mask=m_y, other=0.).to(tl.float32)
    if Q_SIDE:  # x are queries i, y the key j: keep i ≥ j (i > j)
        if EXCLUSIVE:
            keep = o_c > j
        else:
            keep = o_c >= j
        diff = b_gx - b_gy[None, :]
    else:       # x are keys j, y the query i = j: keep i ≥ row (i > row)
        if EXCLUSIVE:
            keep = o_c < j
        else:
            keep = o_c <= j
        diff = b_gy[None, :] - b_gx
    keep2 = (keep & m_x)[:, None] & m_y[None, :]
    return tl.where(keep2, b_y[None, :] * tl.exp(tl.where(keep2, diff, 0.)), 0.)


@tuned(key=["K", "V", "q", "EXCLUSIVE"], default=_default, space=_space)
@triton.jit(do_not_specialize=["T", "H"])
def chunk_gk_fwd_o_kernel(
    q, k, v, g, gq, h, o, A, cu_seqlens, chunk_indices, scale, T,
    H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    EXCLUSIVE: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid ``(NT, B·H)``. q, k, g, gq ``[B, T, H, K]``; v, o ``[B, T, H, V]``;
    h ``[B, NT, H, K, V]``; A ``[B, T, H, 64]`` (row t: token t's scores in its chunk)."""
    BT: tl.constexpr = 64
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    if IS_VARLEN:
        i_tg = i_t.to(tl.int64)
    else:
        i_tg = i_b.to(tl.int64) * tl.cdiv(T, BT) + i_t
    i_t, bos, T = locate_chunk(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    row0 = bos + i_t * BT
    L = tl.minimum(T - i_t * BT, BT)  # valid rows of this chunk
    o_t = tl.arange(0, BT)
    o_c = tl.arange(0, 16)
    m_t = o_t < L
    dt = v.dtype.element_ty
    qk_base = (row0 * H + i_h) * K
    v_base = (row0 * H + i_h) * V
    h_base = h + (i_tg * H + i_h) * (K * V)

    for i_r in tl.static_range(4):
        rows = i_r * 16 + o_c
        m_r = rows < L
        if i_r * 16 < L:
            b_A = tl.zeros([16, BT], dtype=tl.float32)     # keys before the strip
            b_Ad = tl.zeros([16, 16], dtype=tl.float32)    # the diagonal block
            for i_k in range(tl.cdiv(K, BK)):
                o_k = i_k * BK + tl.arange(0, BK)
                m_k = o_k < K
                m_rk = m_r[:, None] & m_k[None, :]
                p_rk = qk_base + rows[:, None] * (H * K) + o_k[None, :]
                b_q = tl.load(q + p_rk, mask=m_rk, other=0.).to(tl.float32)
                b_gq = tl.load(gq + p_rk, mask=m_rk, other=0.).to(tl.float32)
                if i_r > 0:
                    b_gr = tl.load(g + qk_base + (i_r * 16 - 1) * H * K + o_k, mask=m_k,
                                   other=0.).to(tl.float32)
                    b_qr = tl.where(m_rk, b_q * tl.exp(tl.where(m_rk, b_gq - b_gr[None, :], 0.)),
                                    0.)
                    m_before = (o_t < i_r * 16)[:, None] & m_k[None, :]
                    p_tk = qk_base + o_t[:, None] * (H * K) + o_k[None, :]
                    b_k = tl.load(k + p_tk, mask=m_before, other=0.).to(tl.float32)
                    b_g = tl.load(g + p_tk, mask=m_before, other=0.).to(tl.float32)
                    b_kr = tl.where(m_before,
                                    b_k * tl.exp(tl.where(m_before, b_gr[None, :] - b_g, 0.)), 0.)
                    b_A = tl.dot(b_qr.to(dt), tl.trans(b_kr.to(dt)), b_A,
                                 input_precision=DOT_PRECISION)
                for j in range(16):
                    p_j = qk_base + (i_r * 16 + j) * H * K + o_k
                    m_j = m_k & (i_r * 16 + j + 0 * o_k < L)  # a vector compare: bool in the interpreter too
                    b_pair = gk_diagonal_pair(b_gq, m_r, k + p_j, g + p_j, j, m_j, o_c,
                                              EXCLUSIVE, True)
                    b_Ad += tl.where(o_c[None, :] == j,
                                     tl.reduce(b_q * b_pair, 1, _sum_combine)[:, None], 0.)
            # A's rows: the strip's keys before it from b_A, its diagonal block from b_Ad
            # (disjoint columns, so the two stores cannot race).
            p_A = A + (row0 * H + i_h) * BT + rows[:, None] * (H * BT)
            m_off = (o_t < i_r * 16) | (o_t >= i_r * 16 + 16)
            tl.store(p_A + o_t[None, :], b_A.to(A.dtype.element_ty),
                     mask=m_r[:, None] & m_off[None, :])
            tl.store(p_A + i_r * 16 + o_c[None, :], b_Ad.to(A.dtype.element_ty),
                     mask=m_r[:, None])

    # The output at full 64-row tiles (16-row dots waste most of a tensor core): A is
    # read back from memory, so every thread's stores above must land first.
    tl.debug_barrier()
    p_a = A + (row0 * H + i_h) * BT + o_t[:, None] * (H * BT) + o_t[None, :]
    b_Aall = tl.load(p_a, mask=m_t[:, None] & m_t[None, :], other=0.).to(dt)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        b_o = tl.zeros([BT, BV], dtype=tl.float32)
        for i_k in range(tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_tk = m_t[:, None] & (o_k < K)[None, :]
            p_tk = qk_base + o_t[:, None] * (H * K) + o_k[None, :]
            b_q = tl.load(q + p_tk, mask=m_tk, other=0.).to(tl.float32)
            # γq is chunk-local and ≤ 0: exp(γq) ≤ 1.
            b_gq = tl.load(gq + p_tk, mask=m_tk, other=0.).to(tl.float32)
            b_h = tl.load(h_base + o_k[:, None] * V + o_v[None, :],
                          mask=(o_k < K)[:, None] & m_v[None, :], other=0.)
            b_o = tl.dot((b_q * tl.exp(b_gq)).to(dt), b_h.to(dt), b_o,
                         input_precision=DOT_PRECISION)
        p_tv = v_base + o_t[:, None] * (H * V) + o_v[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_v = tl.load(v + p_tv, mask=m_tv, other=0.).to(dt)
        b_o = tl.dot(b_Aall, b_v, b_o, input_precision=DOT_PRECISION)
        tl.store(o + p_tv, (b_o * scale).to(o.dtype.element_ty), mask=m_tv)


def chunk_gk_fwd_o(q, k, v, g, gq, h, scale: float, cu_seqlens=None, chunk_indices=None,
                   exclusive: bool = False, out_dtype=None):
    """The intra-chunk scores and the output (inputs validated, time-major, contiguous).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]`` (one dtype), K, V ≤ 256.
        g: ``[B, T, H, K]`` float32 chunk-local cumulative gate γ (``chunk_local_cumsum``);
            gq: the query side's (g itself for GLA; γ − w for RWKV6).
        h: ``[B, NT, H, K, V]`` the state entering each chunk (``[1, NT_total, ...]`` under
            varlen), from ``chunk_gated_delta_rule_fwd_h`` with the vector gate.
        scale: the output scale.
        cu_seqlens, chunk_indices: packed sequences (B == 1) and their 64-token chunk table.
        exclusive: RWKV6's strictly causal scores (the diagonal is the caller's bonus).
        out_dtype: o's dtype (default v's).

    Returns:
        ``(o [B, T, H, V], A [B, T, H, 64])``: A in k's dtype, row t token t's scores
        against its chunk's tokens (zeros above the diagonal and past a partial chunk).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    NT = triton.cdiv(T, CHUNK_SIZE) if cu_seqlens is None else chunk_indices.shape[0]
    o = torch.empty(B, T, H, V, dtype=out_dtype or v.dtype, device=v.device)
    A = torch.empty(B, T, H, CHUNK_SIZE, dtype=k.dtype, device=k.device)
    chunk_gk_fwd_o_kernel[(NT, B * H)](
        q=q, k=k, v=v, g=g, gq=gq, h=h, o=o, A=A, cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices, scale=scale, T=T, H=H, K=K, V=V, EXCLUSIVE=exclusive,
        IS_VARLEN=cu_seqlens is not None, DOT_PRECISION=dot_precision(k.dtype))
    return o, A
