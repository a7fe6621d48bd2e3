"""Backward of the chunked vector-gate forward (GLA and RWKV6, ALGORITHMS.md §3): dQ, dK,
the gate's gradient and RWKV6's du, one program per (K tile, chunk, head).

Forward per chunk (``chunk_gk_fwd``; γ chunk-local, γq the query side's, S = h[chunk],
S' the state leaving the chunk)::

    O  = scale · [ (Q ⊙ e^{γq}) S + A V ],   A_ij = Σ_k q_ik k_jk e^{γq_ik − γ_jk} (j < i)
    A_ii = Σ_k q_ik k_ik (GLA) or Σ_k q_ik u_k k_ik (RWKV6)
    S' = diag(e^{γ_C}) S + (K ⊙ e^{γ_C − γ})ᵀ V

With dS' = dh[chunk] (``chunk_delta_h_bwd``) and dA = scale · dO Vᵀ (causal)::

    dQ = scale · (dO Sᵀ) ⊙ e^{γq}  +  Σ_j dA_ij k_j e^{γq_i − γ_j}   (+ dA_ii u k_i)
    dK = (V dS'ᵀ) ⊙ e^{γ_C − γ}     +  Σ_i dA_ij q_i e^{γq_i − γ_j}   (+ dA_ii u q_i)
    x_t = q_t ⊙ dq_t − k_t ⊙ dk_t  (gate-dependent parts; + Σ_v dS' ⊙ S' at t = C)
    dg_t = Σ_{s ≥ t in the chunk} x_s          (RWKV6, γq = γ − w: − q_t ⊙ dq_t)
    du  = Σ_t dA_tt q_t ⊙ k_t                  (per chunk here, summed by the caller)

(Σ_v dS' ⊙ S' = e^{γ_C} Σ_v dS' ⊙ S + Σ_j k_j ⊙ dk_inter_j.) The reverse chunk-local
cumsum is done in registers: dq, dk and dg are written once, in their final dtypes.

The intra-chunk sums run through levels (``chunk_gk_fwd``'s reference rows): per level
q̃ = Q ⊙ e (query rows), k̃ = K ⊙ e (key rows), dq̃ = (dA ⊙ M) k̃, dk̃ = (dA ⊙ M)ᵀ q̃,
and dq += dq̃ ⊙ e, dk += dk̃ ⊙ e: one level through row 31 for the whole chunk where
its exponents stay ≤ ONE_REFERENCE_MAX_SPAN; else the halving at 64 and 32 rows
(exponents ≤ 0) and one level through row 16·b + 7 of each 16-row block; else the six
halving levels.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fla.ops.common.chunk_gk_fwd import ONE_REFERENCE_MAX_SPAN
from fla.ops.utils.index import locate_chunk
from fla.ops.utils.tiles import tile_width
from fla.utils.grid import cdiv
from fla.utils.triton_facts import fp32_dot_precision
from fla.utils.tuning import Config, tuned

__all__ = ["chunk_gk_bwd_dqkg", "chunk_gk_bwd_dqkg_kernel"]

CHUNK_SIZE = 64


def _default(args) -> Config:
    # 32-channel K tiles at 4 warps: H100 (Triton 3.6, bf16, 2026-11-26), op fwd+bwd
    # 10.45 -> 9.45 ms for GLA at 1x8192x96x128 and 3.52 -> 3.22 for RWKV6 at
    # 4x4096x16x128 against BK = 64 at 8 warps (three alternating rounds each, spread
    # < 1%); one stage there. At K = 256 (GLA 8x2048x32x256, its space timed) two stages:
    # 3.41 ms (one: 3.44; BK = 64 at 8 warps, the earlier default, 3.88).
    return Config(BK=tile_width(args["K"], 32), BV=tile_width(args["V"], 64), num_warps=4,
                  num_stages=1 if args["K"] <= 128 else 2)


def _space(args) -> list[Config]:
    # BK fixes the grid (the launcher reads it back from the config).
    return list(dict.fromkeys(
        Config(BK=tile_width(args["K"], bk), BV=tile_width(args["V"], bv), num_warps=w,
               num_stages=s)
        for bk in (32, 64) for bv in (32, 64) for w in (4, 8) for s in (1, 2)))


@triton.jit
def _one_reference_span(b_g, b_gq, gc_b, o_t, o_k, m_tk, L, HK, b: tl.constexpr):
    """The largest exponent a one-reference level over b-row blocks would form in this
    tile: max of γq_i − γ_m and γ_m − γ_i over the valid rows, m the middle row of i's
    block (clamped to the chunk's last)."""
    o_m = tl.minimum((o_t // b) * b + (b // 2 - 1), L - 1)
    b_gm = tl.load(gc_b + o_m[:, None] * HK + o_k[None, :], mask=m_tk, other=0.)
    return tl.max(tl.max(tl.where(m_tk, tl.maximum(b_gm - b_g, b_gq - b_gm), 0.), axis=1),
                  axis=0)


@tuned(key=["K", "V", "q", "dg", "EXCLUSIVE", "USE_U"], default=_default, space=_space)
@triton.jit(do_not_specialize=["T", "H"])
def chunk_gk_bwd_dqkg_kernel(
    q, k, v, g_cum, u, h, do, dh, dq, dk, dg, du, cu_seqlens, chunk_indices, scale, T,
    H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    EXCLUSIVE: tl.constexpr, USE_U: tl.constexpr, IS_VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(NK, NT, B·H)``. dq, dk ``[B, T, H, K]`` (q's dtype), dg (g's dtype);
    du ``[NT_total, H, K]`` float32 per-chunk partials (``USE_U``)."""
    BT: tl.constexpr = 64
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    if IS_VARLEN:
        i_tg = i_t.to(tl.int64)
    else:
        i_tg = i_b.to(tl.int64) * tl.cdiv(T, BT) + i_t
    i_t, bos, T = locate_chunk(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    row0 = bos + i_t * BT
    L = tl.minimum(T - i_t * BT, BT)
    o_t = tl.arange(0, BT)
    m_t = o_t < L
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    HK = H * K
    # The gated dots on fp32 operands (DOT_PRECISION from fp32_dot_precision): dg is a
    # cancelling sum of q⊙dq − k⊙dk, and bf16-rounded dA, q̃ or k̃ miss its bound. The
    # dots over V take dO, V, h and dh as stored (their products are exact in any
    # operand precision that holds the inputs' dtype) at the 16-bit rate.
    dt = tl.float32
    if do.dtype.element_ty == v.dtype.element_ty:
        vt = v.dtype.element_ty
    else:
        vt = tl.float32
    base = (row0 * H + i_h) * K
    # Scalar int64 bases, int32 tile offsets (64-bit address tiles cost two registers
    # an element).
    o_tk = o_t[:, None] * HK + o_k[None, :]
    gc_b = g_cum + base
    v_b, do_b = v + (row0 * H + i_h) * V, do + (row0 * H + i_h) * V
    h_b, dh_b = h + (i_tg * H + i_h) * (K * V), dh + (i_tg * H + i_h) * (K * V)

    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    b_dqs = tl.zeros([BT, BK], dtype=tl.float32)   # dO Sᵀ
    b_dks = tl.zeros([BT, BK], dtype=tl.float32)   # V dS'ᵀ
    b_hdh = tl.zeros([BK], dtype=tl.float32)       # Σ_v S ⊙ dS'
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        o_tv = o_t[:, None] * (H * V) + o_v[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_do = tl.load(do_b + o_tv, mask=m_tv, other=0.).to(vt)
        b_v = tl.load(v_b + o_tv, mask=m_tv, other=0.).to(vt)
        o_s = o_k[:, None] * V + o_v[None, :]
        m_s = m_k[:, None] & m_v[None, :]
        b_h = tl.load(h_b + o_s, mask=m_s, other=0.)
        b_dh = tl.load(dh_b + o_s, mask=m_s, other=0.)
        b_dA = tl.dot(b_do, tl.trans(b_v), b_dA, input_precision=DOT_PRECISION)
        b_dqs = tl.dot(b_do, tl.trans(b_h.to(vt)), b_dqs,
                       input_precision=DOT_PRECISION)
        b_dks = tl.dot(b_v, tl.trans(b_dh.to(vt)), b_dks,
                       input_precision=DOT_PRECISION)
        b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=1)
    b_dA = b_dA * scale

    b_g = tl.load(gc_b + o_tk, mask=m_tk, other=0.)
    if EXCLUSIVE:
        b_gq = tl.load(gc_b + o_tk - HK, mask=m_tk & (o_t > 0)[:, None], other=0.)
    else:
        b_gq = b_g
    b_gl = tl.load(gc_b + (L - 1) * HK + o_k, mask=m_k, other=0.)
    b_q = tl.load(q + base + o_tk, mask=m_tk, other=0.)
    b_k = tl.load(k + base + o_tk, mask=m_tk, other=0.)
    # Through the states: exponents γq ≤ 0 and γ_C − γ ≤ 0.
    b_dq = b_dqs * scale * tl.exp(b_gq)
    b_dk = tl.where(m_tk, b_dks * tl.exp(tl.where(m_tk, b_gl[None, :] - b_g, 0.)), 0.)
    b_kdk = tl.sum(b_k.to(tl.float32) * b_dk, axis=0)

    # The pairs inside the chunk by levels of a loop whose trip count is read from the
    # tile (one compiled body for every case: a run-time choice between bodies, or a
    # second launch for the other, cost 0.4-0.6 ms at 1x8192x96x128 on H100). Level b
    # meets pairs of one b-row block through its middle row m = b·⌊i/b⌋ + b/2 − 1. The
    # halving (exponents ≤ 0): queries in the block's second half, keys in its first.
    # One reference (the last level where its exponents allow): every pair of the block
    # through m, dq_i += e^{γq_i − γ_m} Σ_j dA_ij k_j e^{γ_m − γ_j} and dk_j +=
    # e^{γ_m − γ_j} Σ_i dA_ij q_i e^{γq_i − γ_m}, exponents positive for queries before
    # m and keys after it, by at most the block's span (≤ ONE_REFERENCE_MAX_SPAN).
    # So: one level over the whole chunk (b = 64) where its span allows; else the
    # halving at b = 64 and 32, then one level over each 16-row block; else the six
    # halving levels.
    span_64 = _one_reference_span(b_g, b_gq, gc_b, o_t, o_k, m_tk, L, HK, 64)
    span_16 = _one_reference_span(b_g, b_gq, gc_b, o_t, o_k, m_tk, L, HK, 16)
    n_levels = tl.where(span_64 <= ONE_REFERENCE_MAX_SPAN, 1,
                        tl.where(span_16 <= ONE_REFERENCE_MAX_SPAN, 3, 6))
    for lvl in range(n_levels):
        b = 64 >> lvl
        half = b // 2
        o_m = tl.minimum((o_t // b) * b + (half - 1), L - 1)
        # Every row both a query and a key at a one-reference level.
        force = tl.where((lvl == n_levels - 1) & (n_levels < 6), half, 0)
        is_q = ((o_t | force) & half) != 0
        is_k = ((o_t & ~force) & half) == 0
        b_gm = tl.load(gc_b + o_m[:, None] * HK + o_k[None, :], mask=m_tk, other=0.)
        b_eq = tl.exp(tl.where(m_tk & is_q[:, None], b_gq - b_gm, 0.))
        b_ek = tl.exp(tl.where(m_tk & is_k[:, None], b_gm - b_g, 0.))
        pairs = (((o_t // b)[:, None] == (o_t // b)[None, :]) & is_q[:, None]
                 & is_k[None, :] & (o_t[None, :] < o_t[:, None]))
        b_dAl = tl.where(pairs, b_dA, 0.).to(dt)
        b_dq += tl.dot(b_dAl, (b_k.to(tl.float32) * b_ek).to(dt),
                       input_precision=DOT_PRECISION) * b_eq
        b_dk += tl.dot(tl.trans(b_dAl), (b_q.to(tl.float32) * b_eq).to(dt),
                       input_precision=DOT_PRECISION) * b_ek

    b_q = b_q.to(tl.float32)
    b_k = b_k.to(tl.float32)
    # The gate: x = q ⊙ dq − k ⊙ dk (+ the state's decay at the last row), summed from
    # each token to the chunk's end.
    b_qdq = b_q * b_dq
    b_x = b_qdq - b_k * b_dk
    b_term = tl.exp(b_gl) * b_hdh + b_kdk
    b_x += tl.where((o_t == L - 1)[:, None], b_term[None, :], 0.)
    b_dg = tl.sum(b_x, axis=0)[None, :] - tl.cumsum(b_x, axis=0) + b_x
    if EXCLUSIVE:
        b_dg -= b_qdq
    tl.store(dg + base + o_tk, b_dg.to(dg.dtype.element_ty), mask=m_tk)

    # The diagonal (no gate): GLA's Σ q k, RWKV6's bonus Σ q u k.
    b_dd = tl.sum(tl.where(o_t[:, None] == o_t[None, :], b_dA, 0.), axis=1)
    if USE_U:
        b_u = tl.load(u + i_h * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_dq += b_dd[:, None] * b_k * b_u[None, :]
        b_dk += b_dd[:, None] * b_q * b_u[None, :]
        tl.store(du + (i_tg * H + i_h) * K + o_k,
                 tl.sum(b_dd[:, None] * b_q * b_k, axis=0), mask=m_k)
    elif not EXCLUSIVE:
        b_dq += b_dd[:, None] * b_k
        b_dk += b_dd[:, None] * b_q
    tl.store(dq + base + o_tk, b_dq.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + base + o_tk, b_dk.to(dk.dtype.element_ty), mask=m_tk)


def chunk_gk_bwd_dqkg(q, k, v, g, g_cum, h, do, dh, scale: float, u=None, cu_seqlens=None,
                      chunk_indices=None, exclusive: bool = False):
    """dQ, dK, dg (and du) of the vector-gate chunk forward (inputs time-major, contiguous).

    Args:
        q, k: ``[B, T, H, K]``; v, do: ``[B, T, H, V]``.
        g: the per-token log gate (only its dtype is read: dg is written in it);
            g_cum: ``[B, T, H, K]`` float32 chunk-local cumsum γ.
        h: ``[B, NT, H, K, V]`` states entering each chunk; dh: the same shape, gradients
            of the states leaving each chunk (``chunk_gated_delta_rule_bwd_dhu``).
        u: RWKV6's bonus ``[H, K]`` or None.
        exclusive: RWKV6's strictly causal gated scores (query gate γ − g).

    Returns:
        ``(dq, dk, dg, du)``: dq, dk in q's and k's dtypes, dg in g's (∂L/∂g), du
        ``[H, K]`` float32 or None.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    NT = cdiv(T, CHUNK_SIZE) if cu_seqlens is None else chunk_indices.shape[0]
    dq, dk, dg = torch.empty_like(q), torch.empty_like(k), torch.empty_like(g)
    du = (torch.empty(B * NT, H, K, dtype=torch.float32, device=k.device)
          if u is not None else None)
    chunk_gk_bwd_dqkg_kernel[lambda meta: (cdiv(K, meta["BK"]), NT, B * H)](
        q=q, k=k, v=v, g_cum=g_cum, u=u, h=h, do=do, dh=dh, dq=dq, dk=dk, dg=dg, du=du,
        cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, scale=scale, T=T, H=H, K=K, V=V,
        EXCLUSIVE=exclusive, USE_U=u is not None, IS_VARLEN=cu_seqlens is not None,
        DOT_PRECISION=fp32_dot_precision(k.dtype))
    return dq, dk, dg, (du.sum(0) if du is not None else None)
