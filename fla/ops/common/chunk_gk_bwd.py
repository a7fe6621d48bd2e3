"""Backward of the chunked vector-gate forward (GLA and RWKV6's state part, ALGORITHMS.md
§3): dQ, dK and the gradient of the cumulative gate, one program per (K tile, chunk, head).

Forward per chunk (``chunk_gk_fwd``; γ chunk-local, γq the query side's, S = h[chunk],
S' the state leaving the chunk)::

    O  = scale · [ (Q ⊙ e^{γq}) S + A V ],   A_ij = Σ_k q_ik k_jk e^{γq_ik − γ_jk}
    S' = diag(e^{γ_C}) S + (K ⊙ e^{γ_C − γ})ᵀ V

With dS' = dh[chunk] (``chunk_delta_h_bwd``) and dA = scale · dO Vᵀ (causal)::

    dQ = scale · (dO Sᵀ) ⊙ e^{γq}  +  Σ_j dA_ij k_j e^{γq_i − γ_j}
    dK = (V dS'ᵀ) ⊙ e^{γ_C − γ}     +  Σ_i dA_ij q_i e^{γq_i − γ_j}
    dγ_t = q_t ⊙ dq_t − k_t ⊙ dk_t  (+ Σ_v dS' ⊙ S' at the chunk's last token t = C)

(γ enters as +γq on the query side and −γ on the key side; γ_C also decays S, and
Σ_v dS' ⊙ S' = e^{γ_C} Σ_v dS' ⊙ S + Σ_j k_j ⊙ dk_inter_j.) The caller turns dγ into the
gradient of the per-token gate with a reverse chunk-local cumsum (and, for RWKV6's
γq = γ − w, subtracts q ⊙ dq).

The intra-chunk sums use the strips of ``chunk_gk_fwd``: for query strip I the reference
row r = 16I − 1 before it, for key strip J the reference r' = 16J + 15 (its last row),
so that both factors of every exponent are ≤ 0; 16 x 16 diagonal blocks pair by pair.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.standard import _sum_combine

from fla.ops.common.chunk_gk_fwd import gk_diagonal_pair
from fla.ops.utils.index import locate_chunk
from fla.ops.utils.tiles import tile_width
from fla.utils.triton_facts import dot_precision
from fla.utils.tuning import Config, tuned

__all__ = ["chunk_gk_bwd_dqkg", "chunk_gk_bwd_dqkg_kernel"]

CHUNK_SIZE = 64


def _default(args) -> Config:
    return Config(BK=tile_width(args["K"], 64), BV=tile_width(args["V"], 64), num_warps=4,
                  num_stages=2)


def _space(args) -> list[Config]:
    # BK fixes the grid (the launcher reads it back): every candidate keeps the default BK.
    bk = tile_width(args["K"], 64)
    return list(dict.fromkeys(
        Config(BK=bk, BV=tile_width(args["V"], bv), num_warps=w, num_stages=s)
        for bv in (32, 64) for w in (4, 8) for s in (1, 2)))


@tuned(key=["K", "V", "q", "EXCLUSIVE"], default=_default, space=_space)
@triton.jit(do_not_specialize=["T", "H"])
def chunk_gk_bwd_dqkg_kernel(
    q, k, v, g, gq, h, do, dh, dq, dk, dg, cu_seqlens, chunk_indices, scale, T,
    H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    EXCLUSIVE: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid ``(NK, NT, B·H)``. dq, dk, dg ``[B, T, H, K]`` float32 (dg = dγ, per token)."""
    BT: tl.constexpr = 64
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
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
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    dt = v.dtype.element_ty
    qk_base = (row0 * H + i_h) * K
    v_base = (row0 * H + i_h) * V
    h_base = (i_tg * H + i_h) * (K * V)
    p_all = qk_base + o_t[:, None] * (H * K) + o_k[None, :]
    m_all = m_t[:, None] & m_k[None, :]
    b_gl = tl.load(g + qk_base + (L - 1) * H * K + o_k, mask=m_k, other=0.).to(tl.float32)
    b_kdk = tl.zeros([BK], dtype=tl.float32)    # Σ_j k_j ⊙ dk_inter_j
    b_hdh = tl.zeros([BK], dtype=tl.float32)    # Σ_v S ⊙ dS'

    for i_r in tl.static_range(4):
        rows = i_r * 16 + o_c
        m_r = rows < L
        if i_r * 16 < L:
            m_rk = m_r[:, None] & m_k[None, :]
            p_rk = qk_base + rows[:, None] * (H * K) + o_k[None, :]
            b_dAr = tl.zeros([16, BT], dtype=tl.float32)   # dA[strip rows, keys before]
            b_dAc = tl.zeros([BT, 16], dtype=tl.float32)   # dA[queries after, strip keys]
            b_dAd = tl.zeros([16, 16], dtype=tl.float32)   # dA[strip, strip]
            b_dqi = tl.zeros([16, BK], dtype=tl.float32)
            b_dki = tl.zeros([16, BK], dtype=tl.float32)
            for i_v in range(tl.cdiv(V, BV)):
                o_v = i_v * BV + tl.arange(0, BV)
                m_v = o_v < V
                p_rv = v_base + rows[:, None] * (H * V) + o_v[None, :]
                p_tv = v_base + o_t[:, None] * (H * V) + o_v[None, :]
                m_rv = m_r[:, None] & m_v[None, :]
                b_do_r = tl.load(do + p_rv, mask=m_rv, other=0.).to(dt)
                b_v_r = tl.load(v + p_rv, mask=m_rv, other=0.).to(dt)
                if i_r > 0:
                    b_v_t = tl.load(v + p_tv, mask=(o_t < i_r * 16)[:, None] & m_v[None, :],
                                    other=0.).to(dt)
                    b_dAr = tl.dot(b_do_r, tl.trans(b_v_t), b_dAr, input_precision=DOT_PRECISION)
                if i_r < 3:
                    m_after = (o_t >= i_r * 16 + 16) & m_t
                    b_do_t = tl.load(do + p_tv, mask=m_after[:, None] & m_v[None, :],
                                     other=0.).to(dt)
                    b_dAc = tl.dot(b_do_t, tl.trans(b_v_r), b_dAc, input_precision=DOT_PRECISION)
                b_dAd = tl.dot(b_do_r, tl.trans(b_v_r), b_dAd, input_precision=DOT_PRECISION)
                p_s = h_base + o_k[:, None] * V + o_v[None, :]
                m_s = m_k[:, None] & m_v[None, :]
                b_h = tl.load(h + p_s, mask=m_s, other=0.)
                b_dh = tl.load(dh + p_s, mask=m_s, other=0.)
                b_dqi = tl.dot(b_do_r, tl.trans(b_h.to(dt)), b_dqi, input_precision=DOT_PRECISION)
                b_dki = tl.dot(b_v_r, tl.trans(b_dh.to(dt)), b_dki, input_precision=DOT_PRECISION)
                if i_r == 0:
                    b_hdh += tl.reduce(b_h.to(tl.float32) * b_dh.to(tl.float32), 1, _sum_combine)

            b_q = tl.load(q + p_rk, mask=m_rk, other=0.).to(tl.float32)
            b_k = tl.load(k + p_rk, mask=m_rk, other=0.).to(tl.float32)
            b_gq = tl.load(gq + p_rk, mask=m_rk, other=0.).to(tl.float32)
            b_g = tl.load(g + p_rk, mask=m_rk, other=0.).to(tl.float32)
            # Through the state: exponents γq ≤ 0 and γ_C − γ ≤ 0.
            b_dq = scale * b_dqi * tl.exp(b_gq)
            b_dk = tl.where(m_rk, b_dki * tl.exp(tl.where(m_rk, b_gl[None, :] - b_g, 0.)), 0.)
            b_kdk += tl.reduce(b_k * b_dk, 0, _sum_combine)

            if i_r > 0:
                # Queries of the strip against the keys before it, through row r = 16I − 1.
                b_gr = tl.load(g + qk_base + (i_r * 16 - 1) * H * K + o_k, mask=m_k,
                               other=0.).to(tl.float32)
                m_before = (o_t < i_r * 16)[:, None] & m_k[None, :]
                b_kt = tl.load(k + p_all, mask=m_before, other=0.).to(tl.float32)
                b_gt = tl.load(g + p_all, mask=m_before, other=0.).to(tl.float32)
                b_kr = tl.where(m_before, b_kt * tl.exp(tl.where(m_before, b_gr[None, :] - b_gt, 0.)),
                                0.)
                b_x = tl.dot((b_dAr * scale).to(dt), b_kr.to(dt), input_precision=DOT_PRECISION)
                b_dq += tl.where(m_rk, b_x * tl.exp(tl.where(m_rk, b_gq - b_gr[None, :], 0.)), 0.)
            if i_r < 3:
                # Keys of the strip against the queries after it, through r' = 16J + 15
                # (clamped to the last valid row: the queries past it are all masked).
                r_last = tl.minimum(i_r * 16 + 15, L - 1)
                b_gr = tl.load(g + qk_base + r_last * H * K + o_k, mask=m_k,
                               other=0.).to(tl.float32)
                m_after = ((o_t >= i_r * 16 + 16) & m_t)[:, None] & m_k[None, :]
                b_qt = tl.load(q + p_all, mask=m_after, other=0.).to(tl.float32)
                b_gqt = tl.load(gq + p_all, mask=m_after, other=0.).to(tl.float32)
                b_qr = tl.where(m_after, b_qt * tl.exp(tl.where(m_after, b_gqt - b_gr[None, :], 0.)),
                                0.)
                b_x = tl.dot(tl.trans((b_dAc * scale).to(dt)), b_qr.to(dt),
                             input_precision=DOT_PRECISION)
                b_dk += tl.where(m_rk, b_x * tl.exp(tl.where(m_rk, b_gr[None, :] - b_g, 0.)), 0.)

            # The diagonal block, one pair column / row at a time.
            b_dAd = b_dAd * scale
            for j in range(16):
                p_j = qk_base + (i_r * 16 + j) * H * K + o_k
                m_j = m_k & (i_r * 16 + j + 0 * o_k < L)  # a vector compare: bool in the interpreter too
                # dq_i += dA_ij k_j e^{γq_i − γ_j}
                b_col = tl.reduce(tl.where(o_c[None, :] == j, b_dAd, 0.), 1, _sum_combine)
                b_pair = gk_diagonal_pair(b_gq, m_r, k + p_j, g + p_j, j, m_j, o_c,
                                          EXCLUSIVE, True)
                b_dq += b_pair * b_col[:, None]
                # dk_j += dA_ij q_i e^{γq_i − γ_j} with i the loop's row
                b_row = tl.reduce(tl.where(o_c[:, None] == j, b_dAd, 0.), 0, _sum_combine)
                b_pair = gk_diagonal_pair(b_g, m_r, q + p_j, gq + p_j, j, m_j, o_c,
                                          EXCLUSIVE, False)
                b_dk += b_pair * b_row[:, None]

            b_dg = b_q * b_dq - b_k * b_dk
            if (L - 1) // 16 == i_r:
                # γ_C also decays the state: Σ_v dS' ⊙ S' at the last token.
                b_term = tl.exp(b_gl) * b_hdh + b_kdk
                b_dg += tl.where((rows == L - 1)[:, None], b_term[None, :], 0.)
            tl.store(dq + p_rk, b_dq, mask=m_rk)
            tl.store(dk + p_rk, b_dk, mask=m_rk)
            tl.store(dg + p_rk, b_dg, mask=m_rk)


def chunk_gk_bwd_dqkg(q, k, v, g, gq, h, do, dh, scale: float, cu_seqlens=None,
                      chunk_indices=None, exclusive: bool = False):
    """dQ, dK and dγ of the vector-gate chunk forward (inputs time-major, contiguous).

    Args:
        q, k: ``[B, T, H, K]``; v, do: ``[B, T, H, V]``.
        g, gq: ``[B, T, H, K]`` float32 cumulative gates (key side, query side).
        h: ``[B, NT, H, K, V]`` states entering each chunk; dh: the same shape, gradients
            of the states leaving each chunk (``chunk_gated_delta_rule_bwd_dhu``).
        exclusive: RWKV6's strictly causal intra-chunk scores.

    Returns:
        ``(dq, dk, dg)`` float32 ``[B, T, H, K]``; dg is ∂L/∂γ per token (not yet summed).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    NT = triton.cdiv(T, CHUNK_SIZE) if cu_seqlens is None else chunk_indices.shape[0]
    f32 = dict(dtype=torch.float32, device=k.device)
    dq, dk, dg = (torch.empty(B, T, H, K, **f32) for _ in range(3))
    chunk_gk_bwd_dqkg_kernel[lambda meta: (triton.cdiv(K, meta["BK"]), NT, B * H)](
        q=q, k=k, v=v, g=g, gq=gq, h=h, do=do, dh=dh, dq=dq, dk=dk, dg=dg,
        cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, scale=scale, T=T, H=H, K=K, V=V,
        EXCLUSIVE=exclusive, IS_VARLEN=cu_seqlens is not None,
        DOT_PRECISION=dot_precision(k.dtype))
    return dq, dk, dg
