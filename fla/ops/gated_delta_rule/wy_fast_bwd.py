"""Backward of the WY representation of the chunked gated delta rule.

Forward (ALGORITHMS.md §1, per chunk, γ the chunk-local cumulative log decay):

    A    = strict_lower( diag(β) (K Kᵀ) ⊙ Γ ),   Γ_ij = exp(γ_i − γ_j)
    Tinv = (I + A)⁻¹
    W    = Tinv · diag(β) · (K ⊙ exp(γ)),    U = Tinv · diag(β) · V

Backward, given dW and dU, with Kb = diag(β)(K ⊙ e^γ) and Vb = diag(β) V:

    dTinv = dW Kbᵀ + dU Vbᵀ,   dKb = Tinvᵀ dW,   dVb = Tinvᵀ dU
    dA    = strict_lower( −Tinvᵀ dTinv Tinvᵀ )                  (d(X⁻¹) = −X⁻¹ dX X⁻¹)
    dM    = dA ⊙ Γ ⊙ β_i                                       (∂L/∂(k_i·k_j))
    dK    = dKb ⊙ β e^γ + dM K + dMᵀ K
    dV    = dVb ⊙ β
    dβ_i  = e^{γ_i} dKb_i·k_i + dVb_i·v_i + Σ_j dA_ij Γ_ij (k_i·k_j)
    dγ_i  = dKb_i·Kb_i + Σ_j (dA ⊙ A)_ij − Σ_j (dA ⊙ A)_ji
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fla.ops.utils.chunk_rows import load_chunk_rows
from fla.ops.utils.index import locate_chunk, varlen_chunk_indices
from fla.ops.utils.tiles import check_buffer, check_kernel_device, sixteen_bit, tile_width
from fla.utils.grid import cdiv
from fla.utils.triton_facts import dot_precision, warp_choices
from fla.utils.tuning import Config, tuned

__all__ = ["prepare_wy_repr_bwd", "prepare_wy_repr_bwd_kernel"]


def _narrow_sixteen_bit(args) -> bool:
    """K or V at most 32 (one 32-wide tile) with 16-bit operands: on H100 with Triton 3.6
    every 4- and 8-warp config of this kernel faults with an illegal address there
    (2026-11-26, each config in its own process under CUDA_LAUNCH_BLOCKING: K = V = 16
    and 32, fp16 and bf16, T = 128 and 150; 8 warps only at T = 150; K = 48 and 64,
    with 32- or 64-wide tiles, run at 4 warps). 2 warps (no wgmma) run: the space keeps
    only them."""
    return sixteen_bit(args) and min(args["K"], args["V"]) <= 32


def _wy_default(args) -> Config:
    # Tinv, dTinv and K Kᵀ are three BT×BT fp32 tiles held across the loops: [BT, 64]
    # operand tiles and 4 warps keep the program inside the H100 register file.
    # 3 stages (H100, Triton 3.6, bf16): K = 256 0.132 -> 0.113 ms at
    # 4x4096x4x256, 0.986 -> 0.815 at 8x2048x32x256 (FLA_TUNE=1, 2026-11-24); K = 128
    # 0.79 -> 0.68 at 1x8192x96x128, 0.52 -> 0.45 at 2x16384x16x128, 0.138 -> 0.121 at
    # 4x2048x16x128; K = 64 even at 8x1024x8x64 (config sweeps, 2026-11-26). fp32
    # operands below K = 256 keep two (twice the shared memory a stage).
    return Config(BK=tile_width(args["K"], 64), BV=tile_width(args["V"], 64),
                  num_warps=2 if _narrow_sixteen_bit(args) else 4,
                  num_stages=3 if args["K"] >= 256 or sixteen_bit(args) else 2)


def _wy_space(args) -> list[Config]:
    bks = sorted({tile_width(args["K"], b) for b in (32, 64)})
    bvs = sorted({tile_width(args["V"], b) for b in (32, 64)})
    warps = (2,) if _narrow_sixteen_bit(args) else warp_choices(stmatrix_prone=True)
    return [Config(BK=bk, BV=bv, num_warps=w, num_stages=s)
            for bk in bks for bv in bvs for w in warps for s in (2, 3)]


# ACCUMULATE adds into dk (in place where dk_acc is dk) and dg: tuning restores both.
@tuned(key=["k", "A", "K", "V", "BT", "USE_G"], default=_wy_default, space=_wy_space,
       restore=["dk", "dg"])
@triton.jit(do_not_specialize=["T", "H"])
def prepare_wy_repr_bwd_kernel(
    k, v, beta, g, A, dw, du, dk, dv, dbeta, dg, cu_seqlens, chunk_indices, T,
    H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, IS_VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr = False,
    dk_acc=None,
):
    """One program per (chunk, batch·head): every gradient of one chunk's W and U.
    ``ACCUMULATE``: ``dk_acc`` (dk itself, or an fp32 tensor) and dg hold the other part of
    their gradient (read, added in fp32, written to dk and dg: each program reads only the
    rows it writes, so in place is safe)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_t, bos, T = locate_chunk(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    dt = k.dtype.element_ty
    o_t = tl.arange(0, BT)
    m_t = (i_t * BT + o_t) < T
    rows = bos + i_t * BT + o_t        # int64 token indices
    m_lower = (o_t[:, None] >= o_t[None, :]) & m_t[:, None] & m_t[None, :]
    m_strict = (o_t[:, None] > o_t[None, :]) & m_t[:, None] & m_t[None, :]

    # Tinv is unit lower triangular: reading only the lower part (and valid tokens) keeps
    # whatever the forward left above the diagonal or past the sequence out of the sums.
    b_T = load_chunk_rows(A + rows[:, None] * (H * BT) + i_h * BT + o_t[None, :], m_t,
                          m_lower).to(dt)
    b_beta = tl.load(beta + rows * H + i_h, mask=m_t, other=0.).to(tl.float32)
    if USE_G:
        b_g = tl.load(g + rows * H + i_h, mask=m_t, other=0.).to(tl.float32)
        b_kscale = b_beta * tl.exp(b_g)    # γ ≤ 0 inside a chunk: exp(γ) ≤ 1
    else:
        b_kscale = b_beta

    b_dT = tl.zeros([BT, BT], dtype=tl.float32)
    b_kkt = tl.zeros([BT, BT], dtype=tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        k_off = rows[:, None] * (H * K) + i_h * K + o_k[None, :]
        b_k = tl.load(k + k_off, mask=m_tk, other=0.)
        b_dw = tl.load(dw + k_off, mask=m_tk, other=0.).to(dt)
        b_kkt += tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PRECISION)
        b_kb = (b_k.to(tl.float32) * b_kscale[:, None]).to(dt)
        b_dT += tl.dot(b_dw, tl.trans(b_kb), input_precision=DOT_PRECISION)

    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        v_off = rows[:, None] * (H * V) + i_h * V + o_v[None, :]
        b_v = tl.load(v + v_off, mask=m_tv, other=0.)
        b_du = tl.load(du + v_off, mask=m_tv, other=0.).to(dt)
        b_vb = (b_v.to(tl.float32) * b_beta[:, None]).to(dt)
        b_dT += tl.dot(b_du, tl.trans(b_vb), input_precision=DOT_PRECISION)
        b_dvb = tl.dot(tl.trans(b_T), b_du, input_precision=DOT_PRECISION)
        b_db += tl.sum(b_dvb * b_v.to(tl.float32), axis=1)
        tl.store(dv + v_off, (b_dvb * b_beta[:, None]).to(dv.dtype.element_ty), mask=m_tv)

    # dA = −Tinvᵀ dTinv Tinvᵀ, only its strictly lower part reaches A.
    b_dA = tl.dot(tl.trans(b_T), b_dT.to(dt), input_precision=DOT_PRECISION)
    b_dA = tl.dot(b_dA.to(dt), tl.trans(b_T), input_precision=DOT_PRECISION)
    b_dA = tl.where(m_strict, -b_dA, 0.)
    if USE_G:
        # Γ_ij = exp(γ_i − γ_j), i > j: exponent ≤ 0, masked before exp.
        b_dA *= tl.exp(tl.where(m_strict, b_g[:, None] - b_g[None, :], 0.))
    # Now b_dA = dA ⊙ Γ = ∂L/∂(β_i k_i·k_j).
    b_dAk = b_dA * b_kkt
    b_db += tl.sum(b_dAk, axis=1)
    if USE_G:
        b_dAA = b_dAk * b_beta[:, None]   # dA ⊙ A
        b_dgv = tl.sum(b_dAA, axis=1) - tl.sum(b_dAA, axis=0)
    b_dM = (b_dA * b_beta[:, None]).to(dt)

    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        k_off = rows[:, None] * (H * K) + i_h * K + o_k[None, :]
        b_k = tl.load(k + k_off, mask=m_tk, other=0.)
        b_dw = tl.load(dw + k_off, mask=m_tk, other=0.).to(dt)
        b_kf = b_k.to(tl.float32)
        b_dkb = tl.dot(tl.trans(b_T), b_dw, input_precision=DOT_PRECISION)
        b_dk = b_dkb * b_kscale[:, None]
        if USE_G:
            b_db += tl.sum(b_dkb * b_kf, axis=1) * tl.exp(b_g)
            b_dgv += tl.sum(b_dk * b_kf, axis=1)      # dKb_i·Kb_i
        else:
            b_db += tl.sum(b_dkb * b_kf, axis=1)
        b_kc = b_k.to(dt)
        b_dk += tl.dot(b_dM, b_kc, input_precision=DOT_PRECISION)
        b_dk += tl.dot(tl.trans(b_dM), b_kc, input_precision=DOT_PRECISION)
        if ACCUMULATE:
            b_dk += tl.load(dk_acc + k_off, mask=m_tk, other=0.).to(tl.float32)
        tl.store(dk + k_off, b_dk.to(dk.dtype.element_ty), mask=m_tk)

    tl.store(dbeta + rows * H + i_h, b_db.to(dbeta.dtype.element_ty), mask=m_t)
    if USE_G:
        if ACCUMULATE:
            b_dgv += tl.load(dg + rows * H + i_h, mask=m_t, other=0.)
        tl.store(dg + rows * H + i_h, b_dgv, mask=m_t)


def prepare_wy_repr_bwd(
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    A: torch.Tensor,
    dw: torch.Tensor,
    du: torch.Tensor,
    g: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    dk_acc: torch.Tensor | None = None,
    dg_acc: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of k, v, β and γ through W = Tinv·diag(β)(K ⊙ e^γ) and U = Tinv·diag(β)V.

    Args:
        k: ``[B, T, H, K]``, v: ``[B, T, H, V]`` fp32/fp16/bf16 (same dtype), K ≤ 256.
        beta: ``[B, T, H]``.
        A: ``[B, T, H, BT]``, Tinv = (I + A_strict)⁻¹ of each chunk as the forward stored
            it (row t holds t's row of its chunk's BT×BT block; only the lower triangle of
            valid tokens is read). The chunk size BT is read from its last dimension.
        dw: ``[B, T, H, K]`` ∂L/∂W (``chunk_bwd_dqkwg``'s dw); du: ``[B, T, H, V]`` ∂L/∂U
            (``chunk_gated_delta_rule_bwd_dhu``'s dv2).
        g: ``[B, T, H]`` chunk-local cumulative log decay γ (fp32), or None.
        cu_seqlens: ``[N + 1]`` packed-sequence offsets (B == 1).
        chunk_indices: ``[NT, 2]`` rows for ``cu_seqlens`` (built here when None).
        dk_acc: ``[B, T, H, K]`` contiguous, k's dtype or float32: the rest of ∂L/∂k
            (``chunk_bwd_dqkwg``'s dk). The WY part is added to it in fp32 as it is read,
            and the sum rounded once: in place (returned as dk) in k's dtype, into a new
            dk from float32 (a 16-bit partial would round dk twice). No separate WY dk is
            written and read back (at 1x8192x96x128 bf16 that add was 0.19 ms on H100).
        dg_acc: ``[B, T, H]`` contiguous float32, likewise for ∂L/∂γ (needs g).

    Returns:
        ``(dk, dv, dbeta, dg)``: dk ``[B, T, H, K]`` in k's dtype (the WY part, plus
        ``dk_acc`` when given), dv ``[B, T, H, V]`` in v's dtype, dbeta ``[B, T, H]`` in
        beta's dtype, dg ``[B, T, H]`` float32 = ∂L/∂γ per token (plus ``dg_acc``; None
        when g is None).
    """
    check_kernel_device(k, v, beta, A, dw, du, g)
    B, T, H, K = k.shape
    V = v.shape[-1]
    BT = A.shape[-1]
    if tuple(A.shape) != (B, T, H, BT) or BT < 16 or BT & (BT - 1):
        raise ValueError(f"A: expected shape [B, T, H, BT] = [{B}, {T}, {H}, BT] with BT a "
                         f"power of two >= 16, got {tuple(A.shape)}")
    k, v, beta, A, dw, du = (x.contiguous() for x in (k, v, beta, A, dw, du))
    g = None if g is None else g.contiguous()
    if cu_seqlens is not None:
        chunk_indices = varlen_chunk_indices(cu_seqlens, BT, chunk_indices)
        NT = chunk_indices.shape[0]
    else:
        chunk_indices = None
        NT = cdiv(T, BT)
    accumulate = dk_acc is not None
    if dg_acc is not None and not (accumulate and g is not None) or \
            accumulate and g is not None and dg_acc is None:
        raise ValueError("dk_acc and dg_acc come together (dg_acc only with g)")
    if accumulate:
        check_buffer("dk_acc", dk_acc, k.shape,
                     torch.float32 if dk_acc.dtype == torch.float32 else k.dtype, k.device)
        if g is not None:
            check_buffer("dg_acc", dg_acc, (B, T, H), torch.float32, k.device)
    # In place where dk_acc is in k's dtype; from an fp32 dk_acc into a new tensor.
    dk = dk_acc if accumulate and dk_acc.dtype == k.dtype else torch.empty_like(k)
    dv = torch.empty_like(v)
    dbeta = torch.empty_like(beta)
    if g is None:
        dg = None
    else:
        dg = dg_acc if accumulate else torch.empty(B, T, H, dtype=torch.float32,
                                                   device=k.device)
    prepare_wy_repr_bwd_kernel[(NT, B * H)](
        k=k, v=v, beta=beta, g=g, A=A, dw=dw, du=du, dk=dk, dv=dv, dbeta=dbeta, dg=dg,
        dk_acc=dk_acc,
        cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, T=T, H=H, K=K, V=V, BT=BT,
        USE_G=g is not None, IS_VARLEN=cu_seqlens is not None,
        DOT_PRECISION=dot_precision(k.dtype), ACCUMULATE=accumulate,
    )
    return dk, dv, dbeta, dg
