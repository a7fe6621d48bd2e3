"""The inter-chunk half of the fused gated-delta-rule forward: the state pass, with the
output computed on the way (ALGORITHMS.md §1, chunked form).

For each chunk in order, with S the state entering it, γ the chunk-local cumulative
decay (γ_C at the chunk's last valid token) and ``Ai``, ``Aqk`` from
``chunk_fwd_intra``:

    Vn = Ai · β ⊙ (V − e^γ ⊙ K S)          (= U − W S of the WY form, never stored)
    O  = scale · ( e^γ ⊙ Q S + Aqk Vn )
    S ← e^{γ_C} S + (K ⊙ e^{γ_C − γ})ᵀ Vn

Reading Q, K, V once and writing O once (plus the 64-wide Ai and Aqk rows) is all the
memory traffic the pass needs: the per-chunk states h, the new values Vn and the WY
factors W, U stay in registers. The backward recomputes what it needs from the saved
Ai.

One program per (V tile, head, sequence) walks the sequence's chunks; the K x BV fp32
state lives in up to four 64-row register tiles (K ≤ 256). Programs of one head's V
tiles are adjacent in the grid, so they run together and share Q, K, Ai and Aqk through
the L2 cache.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fla.ops.utils.tiles import tile_width
from fla.utils.triton_facts import dot_precision
from fla.utils.tuning import Config, tuned

__all__ = ["chunk_gated_delta_rule_fwd_inter"]

BT = 64  # the chunk size of chunk_fwd_intra's Ai and Aqk


def _default(args) -> Config:
    # BV = 32: a K = 128 state is 32 fp32 registers a thread at 4 warps, and a head's
    # V = 128 is spread over 4 programs, which balances H = 96 heads over 132 SMs
    # (384 programs, 3 a SM) better than BV = 64 (192 programs: 1.45 waves).
    return Config(BV=tile_width(args["V"], 32), num_warps=4, num_stages=2)


def _space(args) -> list[Config]:
    widths = sorted({tile_width(args["V"], bv) for bv in (32, 64)})
    return [Config(BV=bv, num_warps=w, num_stages=s)
            for bv in widths for w in (2, 4, 8) for s in (1, 2, 3)]


@triton.jit
def _state_tile_dots(b_k, b_q, b_h, b_ks, b_qs, DOT_PRECISION: tl.constexpr):
    """K S and Q S accumulated over one 64-row tile of the state (16-bit operands)."""
    b_hc = b_h.to(b_k.dtype)
    b_ks = tl.dot(b_k, b_hc, b_ks, input_precision=DOT_PRECISION)
    b_qs = tl.dot(b_q, b_hc, b_qs, input_precision=DOT_PRECISION)
    return b_ks, b_qs


@tuned(key=["K", "V", "k", "h0"], default=_default, space=_space)
@triton.jit(do_not_specialize=["T"])
def chunk_gated_delta_rule_fwd_inter_kernel(
    q, k, v, g_cum, beta, Ai, Aqk, o, h0, ht, cu_seqlens, scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid ``(NV, H, N)``. ``q, k [B, T, H, K]``, ``v, o [B, T, H, V]``, ``g_cum, beta
    [B, T, H]``, ``Ai, Aqk [B, T, H, 64]``, ``h0, ht [N, H, K, V]`` (fp32 ht)."""
    i_v, i_h, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    else:
        bos = i_n.to(tl.int64) * T
    NT = tl.cdiv(T, BT)

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    # The state's j-th 64-row tile is rows j·BK .. j·BK + BK of the K x V matrix.
    o_s = o_k[:, None] * V + o_v[None, :]
    m_s1 = (o_k < K)[:, None] & m_v[None, :]
    m_s2 = (BK + o_k < K)[:, None] & m_v[None, :]
    m_s3 = (2 * BK + o_k < K)[:, None] & m_v[None, :]
    m_s4 = (3 * BK + o_k < K)[:, None] & m_v[None, :]

    b_h1 = tl.zeros([BK, BV], dtype=tl.float32)
    if K > BK:
        b_h2 = tl.zeros([BK, BV], dtype=tl.float32)
    if K > 2 * BK:
        b_h3 = tl.zeros([BK, BV], dtype=tl.float32)
    if K > 3 * BK:
        b_h4 = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        p_h0 = h0 + (i_n.to(tl.int64) * H + i_h) * (K * V) + o_s
        b_h1 += tl.load(p_h0, mask=m_s1, other=0.).to(tl.float32)
        if K > BK:
            b_h2 += tl.load(p_h0 + BK * V, mask=m_s2, other=0.).to(tl.float32)
        if K > 2 * BK:
            b_h3 += tl.load(p_h0 + 2 * BK * V, mask=m_s3, other=0.).to(tl.float32)
        if K > 3 * BK:
            b_h4 += tl.load(p_h0 + 3 * BK * V, mask=m_s4, other=0.).to(tl.float32)

    for i_t in range(NT):
        row0 = bos + i_t * BT
        m_t = (i_t * BT + o_t) < T
        m_tv = m_t[:, None] & m_v[None, :]
        p_qk = (row0 * H + i_h) * K + o_t[:, None] * (H * K) + o_k[None, :]

        # K S and Q S, one 64-row tile of the state at a time.
        b_ks = tl.zeros([BT, BV], dtype=tl.float32)
        b_qs = tl.zeros([BT, BV], dtype=tl.float32)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        b_ks, b_qs = _state_tile_dots(tl.load(k + p_qk, mask=m_tk, other=0.),
                                      tl.load(q + p_qk, mask=m_tk, other=0.),
                                      b_h1, b_ks, b_qs, DOT_PRECISION)
        if K > BK:
            m_tk = m_t[:, None] & (BK + o_k < K)[None, :]
            b_ks, b_qs = _state_tile_dots(tl.load(k + p_qk + BK, mask=m_tk, other=0.),
                                          tl.load(q + p_qk + BK, mask=m_tk, other=0.),
                                          b_h2, b_ks, b_qs, DOT_PRECISION)
        if K > 2 * BK:
            m_tk = m_t[:, None] & (2 * BK + o_k < K)[None, :]
            b_ks, b_qs = _state_tile_dots(tl.load(k + p_qk + 2 * BK, mask=m_tk, other=0.),
                                          tl.load(q + p_qk + 2 * BK, mask=m_tk, other=0.),
                                          b_h3, b_ks, b_qs, DOT_PRECISION)
        if K > 3 * BK:
            m_tk = m_t[:, None] & (3 * BK + o_k < K)[None, :]
            b_ks, b_qs = _state_tile_dots(tl.load(k + p_qk + 3 * BK, mask=m_tk, other=0.),
                                          tl.load(q + p_qk + 3 * BK, mask=m_tk, other=0.),
                                          b_h4, b_ks, b_qs, DOT_PRECISION)

        b_beta = tl.load(beta + (row0 + o_t) * H + i_h, mask=m_t, other=0.).to(tl.float32)
        if USE_G:
            # γ is chunk-local and ≤ 0 for decays: exp(γ) ≤ 1 needs no difference trick.
            b_g = tl.load(g_cum + (row0 + o_t) * H + i_h, mask=m_t, other=0.).to(tl.float32)
            b_eg = tl.exp(b_g)
            b_ks *= b_eg[:, None]
            b_qs *= b_eg[:, None]

        # Vn = Ai · β(V − e^γ K S): the residual is formed in fp32 before the one cast, so
        # the cancellation between V and the state's prediction loses nothing.
        p_tv = (row0 * H + i_h) * V + o_t[:, None] * (H * V) + o_v[None, :]
        b_v = tl.load(v + p_tv, mask=m_tv, other=0.).to(tl.float32)
        b_r = ((b_v - b_ks) * b_beta[:, None]).to(k.dtype.element_ty)
        p_tt = (row0 * H + i_h) * BT + o_t[:, None] * (H * BT) + o_t[None, :]
        m_tt = m_t[:, None] & m_t[None, :]
        b_ai = tl.load(Ai + p_tt, mask=m_tt, other=0.)
        b_vn = tl.dot(b_ai, b_r, input_precision=DOT_PRECISION)

        b_aqk = tl.load(Aqk + p_tt, mask=m_tt, other=0.)
        b_o = tl.dot(b_aqk, b_vn.to(k.dtype.element_ty), b_qs, input_precision=DOT_PRECISION)
        tl.store(o + p_tv, (b_o * scale).to(o.dtype.element_ty), mask=m_tv)

        if USE_G:
            # Decay to the chunk's last valid token: exponents γ_C − γ_t ≤ 0, rows past
            # the end masked to 0 before they could overflow.
            last = tl.minimum((i_t + 1) * BT, T) - 1
            b_g_last = tl.load(g_cum + (bos + last) * H + i_h).to(tl.float32)
            b_vn = b_vn * tl.where(m_t, tl.exp(b_g_last - b_g), 0.)[:, None]
            b_decay = tl.exp(b_g_last)
            b_h1 *= b_decay
            if K > BK:
                b_h2 *= b_decay
            if K > 2 * BK:
                b_h3 *= b_decay
            if K > 3 * BK:
                b_h4 *= b_decay
        b_vn = b_vn.to(k.dtype.element_ty)

        # S += Kᵀ Vn with K read as [BK, BT] tiles (L1/L2-resident from above).
        p_kt = k + (row0 * H + i_h) * K + o_k[:, None] + o_t[None, :] * (H * K)
        b_h1 = tl.dot(tl.load(p_kt, mask=(o_k < K)[:, None] & m_t[None, :], other=0.),
                      b_vn, b_h1, input_precision=DOT_PRECISION)
        if K > BK:
            b_h2 = tl.dot(tl.load(p_kt + BK, mask=(BK + o_k < K)[:, None] & m_t[None, :],
                                  other=0.), b_vn, b_h2, input_precision=DOT_PRECISION)
        if K > 2 * BK:
            b_h3 = tl.dot(tl.load(p_kt + 2 * BK, mask=(2 * BK + o_k < K)[:, None] & m_t[None, :],
                                  other=0.), b_vn, b_h3, input_precision=DOT_PRECISION)
        if K > 3 * BK:
            b_h4 = tl.dot(tl.load(p_kt + 3 * BK, mask=(3 * BK + o_k < K)[:, None] & m_t[None, :],
                                  other=0.), b_vn, b_h4, input_precision=DOT_PRECISION)

    if STORE_FINAL_STATE:
        p_ht = ht + (i_n.to(tl.int64) * H + i_h) * (K * V) + o_s
        tl.store(p_ht, b_h1, mask=m_s1)
        if K > BK:
            tl.store(p_ht + BK * V, b_h2, mask=m_s2)
        if K > 2 * BK:
            tl.store(p_ht + 2 * BK * V, b_h3, mask=m_s3)
        if K > 3 * BK:
            tl.store(p_ht + 3 * BK * V, b_h4, mask=m_s4)


def chunk_gated_delta_rule_fwd_inter(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_cum: torch.Tensor | None,
    beta: torch.Tensor,
    Ai: torch.Tensor,
    Aqk: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    num_sequences: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The sequential pass over chunks, producing the output (inputs validated,
    time-major and contiguous by the op's entry point).

    Args:
        q, k: ``[B, T, H, K]``, K ≤ 256; v: ``[B, T, H, V]``, V ≤ 256 (one dtype).
        g_cum: ``[B, T, H]`` float32 chunk-local cumulative decay γ, or None.
        beta: ``[B, T, H]``.
        Ai, Aqk: ``[B, T, H, 64]`` from :func:`chunk_gated_delta_rule_fwd_intra`.
        scale: the output scale.
        initial_state: ``[N, H, K, V]`` or None (zeros).
        output_final_state: also return the state after each sequence.
        cu_seqlens: ``[N + 1]`` packed-sequence offsets on q's device (B == 1).
        num_sequences: N (B without ``cu_seqlens``).

    Returns:
        ``(o, final_state)``: ``o [B, T, H, V]`` in v's dtype; ``final_state
        [N, H, K, V]`` float32 or None.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    N = num_sequences if num_sequences is not None else B
    o = torch.empty_like(v)
    final_state = (torch.empty(N, H, K, V, dtype=torch.float32, device=k.device)
                   if output_final_state else None)
    chunk_gated_delta_rule_fwd_inter_kernel[lambda meta: (triton.cdiv(V, meta["BV"]), H, N)](
        q=q, k=k, v=v, g_cum=g_cum, beta=beta, Ai=Ai, Aqk=Aqk, o=o, h0=initial_state,
        ht=final_state, cu_seqlens=cu_seqlens, scale=scale, T=T, H=H, K=K, V=V,
        BK=tile_width(K, 64), USE_G=g_cum is not None,
        USE_INITIAL_STATE=initial_state is not None, STORE_FINAL_STATE=output_final_state,
        IS_VARLEN=cu_seqlens is not None, DOT_PRECISION=dot_precision(k.dtype),
    )
    return o, final_state
