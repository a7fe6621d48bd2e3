"""Backward of the output stage, intra-chunk part: the gradient of Vn through O's local term.

Forward (ALGORITHMS.md §1, per chunk of BT tokens, γ the chunk-local cumulative log decay):

    O = scale·[ (Q ⊙ exp(γ)) S + (Q Kᵀ ⊙ Γ ⊙ causal_incl_diag) Vn ],   Γ_ij = exp(γ_i − γ_j)

This stage computes the part of dVn that stays inside the chunk,

    dVn_local = scale · (Q Kᵀ ⊙ Γ ⊙ causal_incl_diag)ᵀ dO,

which the reverse state pass (``chunk_delta_h_bwd``) completes with the part through the
state leaving the chunk.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fla.ops.utils.index import locate_chunk, varlen_chunk_indices
from fla.ops.utils.tiles import check_buffer, check_kernel_device, tile_width
from fla.ops.utils.two_term import two_term_dot
from fla.utils import triton_facts
from fla.utils.grid import cdiv
from fla.utils.triton_facts import dot_precision
from fla.utils.tuning import Config, tuned

__all__ = ["chunk_bwd_dv_local", "chunk_bwd_dv_local_kernel", "chunk_bwd_dqkwg",
           "chunk_bwd_dqkwg_kernel"]


def _dv_local_warps(args) -> tuple[int, ...]:
    # Above K = 128, 4 warps only where this Triton computes them right
    # (triton_facts.FOUR_WARP_WIDE_DV_LOCAL_OK).
    if args["K"] > 128 and not triton_facts.FOUR_WARP_WIDE_DV_LOCAL_OK:
        return (2, 8)
    return (2, 4, 8)


def _dv_local_default(args) -> Config:
    # BT×BT fp32 scores plus one [BT, 64] 16-bit operand pair per step fit 4 warps on H100.
    # K = 256: 3 stages (FLA_TUNE=1 on H100, Triton 3.6, bf16, 2026-11-24: 0.062 -> 0.054
    # ms at 4x4096x4x256, 0.414 -> 0.370 at 8x2048x32x256); 8 warps where 4 are wrong (not
    # timed; correct on Triton 3.9, H100).
    warps = 4 if 4 in _dv_local_warps(args) else 8
    return Config(BK=tile_width(args["K"], 64), BV=tile_width(args["V"], 64),
                  num_warps=warps, num_stages=3 if args["K"] >= 256 else 2)


def _dv_local_space(args) -> list[Config]:
    bks = sorted({tile_width(args["K"], b) for b in (32, 64)})
    bvs = sorted({tile_width(args["V"], b) for b in (32, 64)})
    return [Config(BK=bk, BV=bv, num_warps=w, num_stages=s)
            for bk in bks for bv in bvs for w in _dv_local_warps(args) for s in (2, 3)]


@tuned(key=["q", "K", "V", "BT", "USE_G"], default=_dv_local_default, space=_dv_local_space)
@triton.jit(do_not_specialize=["T", "H"])
def chunk_bwd_dv_local_kernel(
    q, k, do, dv, g, cu_seqlens, chunk_indices, scale, T,
    H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, IS_VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program per (chunk, batch·head): dv rows of one chunk, all V columns."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_t, bos, T = locate_chunk(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    row0 = bos + i_t * BT          # int64 global index of the chunk's first token
    o_t = tl.arange(0, BT)
    m_t = (i_t * BT + o_t) < T

    # b_A[j, i] = k_j · q_i: the transposed score matrix, built over K tiles.
    b_A = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = m_t[:, None] & (o_k < K)[None, :]
        k_off = (row0 + o_t[:, None]) * (H * K) + i_h * K + o_k[None, :]
        b_k = tl.load(k + k_off, mask=m_k, other=0.)
        b_q = tl.load(q + k_off, mask=m_k, other=0.)
        b_A += tl.dot(b_k, tl.trans(b_q), input_precision=DOT_PRECISION)

    # Keep (j, i) with i ≥ j inside the sequence: causal_incl_diag, transposed.
    m_A = (o_t[None, :] >= o_t[:, None]) & m_t[:, None] & m_t[None, :]
    if USE_G:
        b_g = tl.load(g + (row0 + o_t) * H + i_h, mask=m_t, other=0.).to(tl.float32)
        # exp(γ_i − γ_j) with i ≥ j: the exponent is ≤ 0 and masked before exp.
        b_A *= tl.exp(tl.where(m_A, b_g[None, :] - b_g[:, None], 0.))
    b_A = tl.where(m_A, b_A * scale, 0.).to(k.dtype.element_ty)

    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = m_t[:, None] & (o_v < V)[None, :]
        v_off = (row0 + o_t[:, None]) * (H * V) + i_h * V + o_v[None, :]
        b_do = tl.load(do + v_off, mask=m_v, other=0.).to(k.dtype.element_ty)
        b_dv = tl.dot(b_A, b_do, input_precision=DOT_PRECISION)
        tl.store(dv + v_off, b_dv.to(dv.dtype.element_ty), mask=m_v)


def chunk_bwd_dv_local(
    q: torch.Tensor,
    k: torch.Tensor,
    do: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    chunk_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Intra-chunk gradient of Vn: ``dv = scale·(Q Kᵀ ⊙ Γ ⊙ causal_incl_diag)ᵀ dO`` per chunk.

    Args:
        q, k: ``[B, T, H, K]`` fp32/fp16/bf16, contiguous time-major, K ≤ 256.
        do: ``[B, T, H, V]``, the gradient of the output O.
        g: ``[B, T, H]`` chunk-local cumulative log decay γ (fp32), or None (no decay).
        scale: the output scale (default ``K ** -0.5``).
        cu_seqlens: ``[N + 1]`` packed-sequence offsets (B == 1); chunks restart at each
            sequence start and a sequence's last chunk may be partial.
        chunk_size: BT (64).
        chunk_indices: ``[NT, 2]`` (sequence, chunk in sequence) rows for ``cu_seqlens``
            (built here when None).

    Returns:
        dv: ``[B, T, H, V]`` in ``do``'s dtype; row t is
        ``scale · Σ_{s ≥ t in t's chunk} (q_s·k_t) exp(γ_s − γ_t) do_s``.
    """
    check_kernel_device(q, k, do, g)
    B, T, H, K = k.shape
    V = do.shape[-1]
    BT = chunk_size
    scale = K ** -0.5 if scale is None else float(scale)
    q, k, do = q.contiguous(), k.contiguous(), do.contiguous()
    g = None if g is None else g.contiguous()
    if cu_seqlens is not None:
        chunk_indices = varlen_chunk_indices(cu_seqlens, BT, chunk_indices)
        NT = chunk_indices.shape[0]
    else:
        chunk_indices = None
        NT = cdiv(T, BT)
    dv = torch.empty_like(do)
    chunk_bwd_dv_local_kernel[(NT, B * H)](
        q=q, k=k, do=do, dv=dv, g=g, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
        scale=scale, T=T, H=H, K=K, V=V, BT=BT, USE_G=g is not None,
        IS_VARLEN=cu_seqlens is not None, DOT_PRECISION=dot_precision(k.dtype),
    )
    return dv


# ---------------------------------------------------------------------------------------
# Gradients of q, k, w and γ through O and through the state leaving each chunk.
# ---------------------------------------------------------------------------------------
def _dqkwg_default(args) -> Config:
    # One [BT, BK] fp32 tile each for dq, dk, dw plus the BT×BT score gradient: BV = 64
    # operand tiles keep 4 warps under the register budget on H100.
    # K = 256: 3 stages (FLA_TUNE=1 on H100, Triton 3.6, bf16, 2026-11-24: 0.244 -> 0.227
    # ms at 4x4096x4x256, 1.838 -> 1.720 at 8x2048x32x256).
    # With the scaled dh (the bf16 scalar-gate backward's two-term dK state dot),
    # three stages at every K (H200, Triton 3.6, bf16, FLA_TUNE=1, 2026-11-28 22:00 UTC:
    # 1.389 -> 1.088 ms at 1x8192x96x128 from 32 columns and two stages, 1.793 -> 1.621 at
    # 8x2048x32x256 from 32 columns; offline BV = 64 spills 56-96 B, timed faster anyway).
    if args.get("DH_SCALED"):
        return Config(BV=tile_width(args["V"], 64), num_warps=4, num_stages=3)
    return Config(BV=tile_width(args["V"], 64), num_warps=4,
                  num_stages=3 if args["K"] >= 256 else 2)


def _dqkwg_space(args) -> list[Config]:
    bvs = sorted({tile_width(args["V"], b) for b in (32, 64)})
    return [Config(BV=bv, num_warps=w, num_stages=s)
            for bv in bvs for w in (2, 4, 8) for s in (2, 3)]


@tuned(key=["k", "K", "V", "BT", "BK", "USE_G", "USE_W", "DH_SCALED"],
       default=_dqkwg_default, space=_dqkwg_space)
@triton.jit(do_not_specialize=["T", "H"])
def chunk_bwd_dqkwg_kernel(
    q, k, v_new, w, g, h, dv2, do, dh, dq, dk, dw, dg, cu_seqlens, chunk_indices, scale, T,
    H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, USE_W: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    dh_scale=None, DH_SCALED: tl.constexpr = False,
):
    """One program per (K tile, chunk, batch·head); the V dimension is looped over.
    With ``DH_SCALED`` dh is the reverse pass's scaled fp16 (times ``dh_scale [B, NT, H,
    V]`` per column), read into fp32, and enters dK's state dot as two 16-bit tiles
    (``fla.ops.utils.two_term``).

    K is split across programs (BK fixed by the launcher, not tuned) so each program's dγ
    is a partial sum over its K tile, written to its own slice ``dg[i_k]``.
    """
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    # dg is [NK, B·T·H]: the slice stride, from the grid, before T turns per-sequence.
    dg_slice = (tl.num_programs(2) // H).to(tl.int64) * T * H
    # The grid's chunk index over all chunks: h is [B, NT, H, K, V] ([1, NT_total, ...] varlen).
    if IS_VARLEN:
        i_tg = i_t.to(tl.int64)
    else:
        i_tg = i_b.to(tl.int64) * tl.cdiv(T, BT) + i_t
    i_t, bos, T = locate_chunk(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    dt = k.dtype.element_ty
    o_t = tl.arange(0, BT)
    m_t = (i_t * BT + o_t) < T
    rows = bos + i_t * BT + o_t        # int64 token indices
    last = tl.minimum(T - i_t * BT, BT) - 1   # position of the last valid token
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    h_base = (i_tg * H + i_h) * K * V

    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_ds = tl.zeros([BT, BT], dtype=tl.float32)
    b_hdh = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        v_off = rows[:, None] * (H * V) + i_h * V + o_v[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_vn = tl.load(v_new + v_off, mask=m_tv, other=0.).to(dt)
        b_do = tl.load(do + v_off, mask=m_tv, other=0.).to(dt)
        h_off = h_base + o_k[:, None] * V + o_v[None, :]
        m_kv = m_k[:, None] & m_v[None, :]
        b_h = tl.load(h + h_off, mask=m_kv, other=0.).to(dt)
        if DH_SCALED:
            b_dh = tl.load(dh + h_off, mask=m_kv, other=0.).to(tl.float32) * tl.load(
                dh_scale + (i_tg * H + i_h) * V + o_v, mask=m_v, other=0.)[None, :]
        else:
            b_dh = tl.load(dh + h_off, mask=m_kv, other=0.).to(dt)
        if USE_G:
            b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=1)
        b_ds += tl.dot(b_do, tl.trans(b_vn), input_precision=DOT_PRECISION)
        b_dq += tl.dot(b_do, tl.trans(b_h), input_precision=DOT_PRECISION)
        b_dk = two_term_dot(b_vn, tl.trans(b_dh), b_dk, DH_SCALED, DOT_PRECISION)
        if USE_W:
            b_dv = tl.load(dv2 + v_off, mask=m_tv, other=0.).to(dt)
            b_dw += tl.dot(b_dv, tl.trans(b_h), input_precision=DOT_PRECISION)

    k_off = rows[:, None] * (H * K) + i_h * K + o_k[None, :]
    m_tk = m_t[:, None] & m_k[None, :]
    if USE_W:
        # Vn = U − W S: dW = −dVn Sᵀ.
        tl.store(dw + k_off, (-b_dw).to(dw.dtype.element_ty), mask=m_tk)

    b_q = tl.load(q + k_off, mask=m_tk, other=0.)
    b_k = tl.load(k + k_off, mask=m_tk, other=0.)
    m_A = (o_t[:, None] >= o_t[None, :]) & m_t[:, None] & m_t[None, :]
    if USE_G:
        b_g = tl.load(g + rows * H + i_h, mask=m_t, other=0.).to(tl.float32)
        b_g_last = tl.load(g + (bos + i_t * BT + last) * H + i_h).to(tl.float32)
        b_dq *= (tl.exp(b_g) * scale)[:, None]
        # Through S' = exp(γ_L) S + (K ⊙ exp(γ_L − γ))ᵀ Vn: exponents γ_L − γ_t ≤ 0.
        b_dk *= tl.where(m_t, tl.exp(tl.where(m_t, b_g_last - b_g, 0.)), 0.)[:, None]
        # ∂L/∂γ_L: exp(γ_L)⟨S, dS'⟩ + Σ_t k_t·dk_state_t (partial over this K tile).
        b_dg_last = (tl.sum(b_hdh) * tl.exp(b_g_last)
                     + tl.sum(b_dk * b_k.to(tl.float32)))
        b_ds *= tl.exp(tl.where(m_A, b_g[:, None] - b_g[None, :], 0.))
    else:
        b_dq *= scale
    b_ds = tl.where(m_A, b_ds * scale, 0.).to(dt)
    b_dq += tl.dot(b_ds, b_k.to(dt), input_precision=DOT_PRECISION)
    b_dk += tl.dot(tl.trans(b_ds), b_q.to(dt), input_precision=DOT_PRECISION)
    tl.store(dq + k_off, b_dq.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + k_off, b_dk.to(dk.dtype.element_ty), mask=m_tk)

    if USE_G:
        # γ_t enters as exp(γ_t) on q_t's side and exp(−γ_t) on k_t's side of every term:
        # dγ_t = q_t·dq_t − k_t·dk_t, plus ∂L/∂γ_L at the last token.
        b_dg = (tl.sum(b_dq * b_q.to(tl.float32), axis=1)
                - tl.sum(b_dk * b_k.to(tl.float32), axis=1))
        b_dg = tl.where(o_t == last, b_dg + b_dg_last, b_dg)
        tl.store(dg + i_k * dg_slice + rows * H + i_h, b_dg, mask=m_t)


def chunk_bwd_dqkwg(
    q: torch.Tensor,
    k: torch.Tensor,
    v_new: torch.Tensor,
    w: torch.Tensor | None,
    g: torch.Tensor | None,
    h: torch.Tensor,
    dv2: torch.Tensor,
    do: torch.Tensor,
    dh: torch.Tensor,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    chunk_indices: torch.Tensor | None = None,
    dg_parts: bool = False,
    dk_dtype: torch.dtype | None = None,
    dh_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of q, k, w and γ through O and the state update, per chunk.

    With S = ``h[:, c]`` (state entering chunk c), dS' = ``dh[:, c]`` (gradient of the state
    leaving it) and dVn = ``dv2``, differentiating
    ``O = scale·[(Q ⊙ e^γ) S + (Q Kᵀ ⊙ Γ ⊙ causal) Vn]``, ``S' = e^{γ_L} S + (K ⊙ e^{γ_L−γ})ᵀ Vn``
    and ``Vn = U − W S`` with S, Vn held fixed gives

        dQ = scale·[(dO Sᵀ) ⊙ e^γ + (dO Vnᵀ ⊙ Γ ⊙ causal) K]
        dK = (Vn dS'ᵀ) ⊙ e^{γ_L−γ} + scale·(dO Vnᵀ ⊙ Γ ⊙ causal)ᵀ Q
        dW = −dVn Sᵀ
        dγ_t = q_t·dq_t − k_t·dk_t + [t = last] (e^{γ_L}⟨S, dS'⟩ + Σ_s k_s·(dS' Vn_s) e^{γ_L−γ_s})

    Args:
        q, k, w: ``[B, T, H, K]``; v_new, dv2, do: ``[B, T, H, V]`` (Vn, dVn, dO). w is
            None when Vn does not depend on the state (simple GLA: Vn = V); dw is then None.
        g: ``[B, T, H]`` chunk-local cumulative log decay γ (fp32), or None.
        h, dh: ``[B, NT, H, K, V]`` states entering each chunk (forward) and gradients of the
            states leaving each chunk (``chunk_gated_delta_rule_bwd_dhu``).
        scale: the output scale (default ``K ** -0.5``).
        cu_seqlens, chunk_size, chunk_indices: as in the other chunk stages.
        dg_parts: return dg unsummed, ``[NK, B, T, H]`` with one partial sum per 64-wide
            K tile (NK = ceil(K / 64)), for ``chunk_local_cumsum_fwd(..., sum_parts=True)``
            to add as it loads them.
        dk_dtype: dk's dtype (default k's): float32 where a later stage adds its own
            part (``prepare_wy_repr_bwd``'s ``dk_acc``), so that dk is rounded once.
        dh_scale: ``[B, NT, H, V]`` float32, with dh in fp16 as the reverse pass scaled
            it (``chunk_gated_delta_rule_bwd_dhu``'s ``dh_scale``): dh is read as
            dh · dh_scale in fp32, and enters dK's state dot as two 16-bit tiles.

    Returns:
        ``(dq, dk, dw, dg)``: dq in k's dtype, dk in ``dk_dtype`` (default k's), dw in w's
        dtype, each ``[B, T, H, K]`` (dk is only the part through O and S'; the WY stage
        adds the rest); dg ``[B, T, H]`` float32
        (``[NK, B, T, H]`` with ``dg_parts``) is ∂L/∂γ per token through these terms (None
        when g is None). The caller adds the WY stage's dγ and applies a reverse
        chunk-local cumsum to get the raw gate's gradient.
    """
    check_kernel_device(q, k, v_new, w, g, h, dv2, do, dh)
    B, T, H, K = k.shape
    V = do.shape[-1]
    BT = chunk_size
    scale = K ** -0.5 if scale is None else float(scale)
    q, k, v_new, h, dv2, do, dh = (x.contiguous() for x in (q, k, v_new, h, dv2, do, dh))
    w = None if w is None else w.contiguous()
    g = None if g is None else g.contiguous()
    if cu_seqlens is not None:
        chunk_indices = varlen_chunk_indices(cu_seqlens, BT, chunk_indices)
        NT = chunk_indices.shape[0]
    else:
        chunk_indices = None
        NT = cdiv(T, BT)
    BK = tile_width(K, 64)
    NK = cdiv(K, BK)
    dq = torch.empty_like(k)
    if dh_scale is not None:
        if dh.dtype != torch.float16:
            raise ValueError("dh_scale: dh must be the reverse pass's scaled fp16, got "
                             f"{dh.dtype}")
        check_buffer("dh_scale", dh_scale, (*h.shape[:3], V), torch.float32, k.device)
    dk = torch.empty_like(k, dtype=k.dtype if dk_dtype is None else dk_dtype)
    dw = None if w is None else torch.empty_like(w)
    dg = torch.empty(NK, B, T, H, dtype=torch.float32, device=k.device) if g is not None else None
    chunk_bwd_dqkwg_kernel[(NK, NT, B * H)](
        q=q, k=k, v_new=v_new, w=w, g=g, h=h, dv2=dv2, do=do, dh=dh, dq=dq, dk=dk, dw=dw,
        dg=dg, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, scale=scale, T=T,
        H=H, K=K, V=V, BT=BT, BK=BK, USE_G=g is not None, USE_W=w is not None,
        IS_VARLEN=cu_seqlens is not None, DOT_PRECISION=dot_precision(k.dtype),
        dh_scale=dh_scale, DH_SCALED=dh_scale is not None,
    )
    if dg is not None:
        if not dg_parts:
            dg = dg[0] if NK == 1 else dg.sum(0)
    return dq, dk, dw, dg
