"""Stage 2 of the chunked gated delta rule (ALGORITHMS.md §1): the WY factors.

Per chunk, with ``Tinv = (I + A)⁻¹`` (what ``solve_tril`` returns for the A of
``chunk_scaled_dot_kkt_fwd``) and γ the chunk-local cumulative log decay:

    W = Tinv · diag(β) · (K ⊙ exp(γ))        U = Tinv · diag(β) · V
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fla.ops.common.chunk_torch import recompute_w_u_fwd_torch
from fla.ops.utils.chunk_rows import load_chunk_rows
from fla.ops.utils.index import locate_chunk, varlen_chunk_indices
from fla.ops.utils.tiles import check_chunk_size, tile_width
from fla.utils.backend import Backend, select_backend
from fla.utils.grid import cdiv
from fla.utils.triton_facts import dot_precision
from fla.utils.tuning import Config, tuned
from fla.utils.validation import (
    Dims,
    check_cu_seqlens,
    check_dtype,
    check_head_dim,
    check_positive_length,
    check_same_device,
    check_shape,
    check_tensor,
)

__all__ = ["recompute_w_u_fwd", "recompute_w_u_fwd_kernel"]


def _default(args) -> Config:
    # 64-wide column tiles: Tinv (BT×BT) stays in registers for the whole program while
    # one [BT, 64] operand and one [BT, 64] fp32 result tile of U and of W stream through.
    # 256-wide heads: 128-wide tiles at 8 warps (FLA_TUNE=1 on H100, Triton 3.6, bf16,
    # 2026-11-24: 0.061 -> 0.058 ms at 4x4096x4x256, 0.427 -> 0.405 at 8x2048x32x256).
    # Without U (the backward's W alone) 64-wide tiles and three stages: H200 (Triton 3.6,
    # bf16, FLA_TUNE=1, 2026-11-29 00:40 UTC), 8x2048x32x256, 0.173 ms against 0.208.
    if max(args["K"], args["V"]) >= 256:
        if not args.get("WITH_U", True):
            return Config(BD=64, num_warps=8, num_stages=3)
        return Config(BD=128, num_warps=8, num_stages=2)
    return Config(BD=tile_width(max(args["K"], args["V"]), 64), num_warps=4, num_stages=2)


def _space(args) -> list[Config]:
    return list(dict.fromkeys(
        Config(BD=tile_width(max(args["K"], args["V"]), bd), num_warps=w, num_stages=s)
        for bd in (32, 64, 128) for w in (2, 4, 8) for s in (2, 3)))


@tuned(key=["K", "V", "BT", "k", "WITH_U"], default=_default, space=_space)
@triton.jit(do_not_specialize=["T", "H"])
def recompute_w_u_fwd_kernel(
    k, v, beta, A, g, w, u, cu_seqlens, chunk_indices, T,
    H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BD: tl.constexpr, USE_G: tl.constexpr, IS_VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WITH_U: tl.constexpr = True,
):
    """One program per (chunk, batch·head): all K and V columns of W and U for it (of W
    alone without ``WITH_U``).

    U and W columns are produced by one loop over BD-wide tiles, so both products are
    [BT, BT]×[BT, BD] and share one MMA layout for the register-resident Tinv. (A first
    version with separate K and V loops of different widths gave a wrong W and an
    illegal address in the 16-bit K≠V test on H100 / Triton 3.6 once; it did not
    reproduce in isolation, and this form passed every GPU test.)
    """
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_t, bos, T = locate_chunk(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    row0 = bos + i_t * BT
    o_t = tl.arange(0, BT)
    m_t = (i_t * BT + o_t) < T

    b_beta = tl.load(beta + (row0 + o_t) * H + i_h, mask=m_t, other=0.).to(tl.float32)
    # Rows and columns past the partial last chunk's end belong to no token: masked off,
    # whatever the caller's A holds there.
    p_A = A + (row0 * H + i_h) * BT + o_t[:, None] * (H * BT) + o_t[None, :]
    b_A = load_chunk_rows(p_A, m_t, m_t[:, None] & m_t[None, :]).to(tl.float32)
    # 16-bit operands for tl.dot (fp32 accumulation); casting through fp32 also covers
    # an A stored in bf16 next to fp16 inputs (no direct bf16 -> fp16 on some releases).
    b_A = b_A.to(k.dtype.element_ty)
    b_kscale = b_beta
    if USE_G:
        # γ is chunk-local (≤ 0 for decays): exp(γ) ≤ 1 needs no difference trick.
        b_g = tl.load(g + (row0 + o_t) * H + i_h, mask=m_t, other=0.).to(tl.float32)
        b_kscale = b_beta * tl.exp(b_g)

    k_base = k + (row0 * H + i_h) * K
    w_base = w + (row0 * H + i_h) * K
    D: tl.constexpr = V if V > K and WITH_U else K
    for i_d in range(tl.cdiv(D, BD)):
        o_d = i_d * BD + tl.arange(0, BD)
        if WITH_U:
            # (Nested, not `WITH_U and ...`: Triton 3.3 traces the body of a runtime
            # condition even when a constexpr operand is False, and u is then None.)
            if i_d * BD < V:
                m_u = m_t[:, None] & (o_d < V)[None, :]
                off_u = (row0 * H + i_h) * V + o_t[:, None] * (H * V) + o_d[None, :]
                b_v = tl.load(v + off_u, mask=m_u, other=0.).to(tl.float32)
                b_vb = (b_v * b_beta[:, None]).to(v.dtype.element_ty)
                b_u = tl.dot(b_A, b_vb, input_precision=DOT_PRECISION)
                tl.store(u + off_u, b_u.to(u.dtype.element_ty), mask=m_u)
        if i_d * BD < K:
            m_w = m_t[:, None] & (o_d < K)[None, :]
            off_w = o_t[:, None] * (H * K) + o_d[None, :]
            b_k = tl.load(k_base + off_w, mask=m_w, other=0.).to(tl.float32)
            b_kb = (b_k * b_kscale[:, None]).to(k.dtype.element_ty)
            b_w = tl.dot(b_A, b_kb, input_precision=DOT_PRECISION)
            tl.store(w_base + off_w, b_w.to(w.dtype.element_ty), mask=m_w)


def recompute_w_u_fwd(
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    A: torch.Tensor,
    g: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    with_u: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The WY factors of each chunk: ``W = Tinv·diag(β)·(K ⊙ exp(γ))``,
    ``U = Tinv·diag(β)·V``.

    Args:
        k: ``[B, T, H, K]``; v: ``[B, T, H, V]`` (same dtype: fp32/fp16/bf16).
        beta: ``[B, T, H]``.
        A: ``[B, T, H, BT]`` the per-chunk inverse ``Tinv = (I + A_strict)⁻¹`` (the
            ``solve_tril`` output); BT, its last dimension, is the chunk size.
        g: ``[B, T, H]`` chunk-local cumulative log decay γ (None: no decay).
        cu_seqlens: ``[N + 1]`` packed-sequence offsets (B == 1).
        chunk_indices: ``[NT, 2]`` varlen chunk table (built here when None).
        with_u: False: W alone (u None), for a caller that has the new values already.

    Returns:
        ``(w [B, T, H, K] in k's dtype, u [B, T, H, V] in v's dtype or None)``.
    """
    check_tensor("k", k)
    check_tensor("v", v)
    check_dtype("v", v, (k.dtype,))
    dims = Dims()
    check_shape("k", k, "B T H K", dims)
    check_shape("v", v, "B T H V", dims)
    check_positive_length(dims)
    check_head_dim("k", dims["K"], "K")
    check_head_dim("v", dims["V"], "V")
    check_tensor("beta", beta)
    check_shape("beta", beta, "B T H", dims)
    check_tensor("A", A)
    check_shape("A", A, "B T H BT", dims)
    if g is not None:
        check_tensor("g", g)
        check_shape("g", g, "B T H", dims)
    check_same_device(k=k, v=v, beta=beta, A=A, g=g)
    try:
        BT = check_chunk_size(dims["BT"])
    except ValueError:
        raise ValueError(f"A: expected shape [B, T, H, BT] with BT the chunk size, a power "
                         f"of two in [16, 256], got {tuple(A.shape)}") from None
    B, T, H, K = k.shape
    V = v.shape[-1]
    offsets = check_cu_seqlens(cu_seqlens, T=T, B=B)

    if select_backend(k, v, beta, A, g) is Backend.TORCH:
        w, u = recompute_w_u_fwd_torch(k, v, beta, A, g, offsets, BT)
        return w, u if with_u else None

    k, v, beta, A = k.contiguous(), v.contiguous(), beta.contiguous(), A.contiguous()
    g = None if g is None else g.contiguous()
    if offsets is not None:
        cu_seqlens = cu_seqlens.to(k.device)
        chunk_indices = varlen_chunk_indices(cu_seqlens, BT, chunk_indices, offsets)
        NT = chunk_indices.shape[0]
    else:
        chunk_indices = None
        NT = cdiv(T, BT)
    w = torch.empty_like(k)
    u = torch.empty_like(v) if with_u else None
    recompute_w_u_fwd_kernel[(NT, B * H)](
        k=k, v=v, beta=beta, A=A, g=g, w=w, u=u, cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices, T=T, H=H, K=K, V=V, BT=BT, USE_G=g is not None,
        IS_VARLEN=offsets is not None, DOT_PRECISION=dot_precision(k.dtype), WITH_U=with_u,
    )
    return w, u
