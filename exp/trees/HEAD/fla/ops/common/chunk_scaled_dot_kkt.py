"""Stage 1 of the chunked gated delta rule (ALGORITHMS.md §1): the scaled, decayed K Kᵀ.

Per chunk of BT tokens (γ the chunk-local cumulative log decay):

    A = strict_lower( diag(β) (K Kᵀ) ⊙ Γ ),   Γ_ij = exp(γ_i − γ_j)

the matrix whose unit-lower-triangular inverse (``solve_tril``) gives the WY factors.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fla.ops.common.chunk_torch import chunk_scaled_dot_kkt_fwd_torch
from fla.ops.utils.index import locate_chunk, varlen_chunk_indices
from fla.ops.utils.tiles import check_chunk_size, tile_width
from fla.utils.backend import Backend, select_backend
from fla.utils.custom_ops import stage_op, use_op
from fla.utils.grid import cdiv
from fla.utils.triton_facts import dot_precision
from fla.utils.tuning import Config, tuned
from fla.utils.validation import (
    FLOAT_DTYPES,
    Dims,
    check_cu_seqlens,
    check_head_dim,
    check_positive_length,
    check_same_device,
    check_shape,
    check_tensor,
)

__all__ = ["chunk_scaled_dot_kkt_fwd", "chunk_scaled_dot_kkt_fwd_kernel"]


def _default(args) -> Config:
    # BK = 64: a [BT, 64] 16-bit tile per K step keeps the BT×BT fp32 accumulator plus
    # two operand tiles well inside 4 warps' registers on H100.
    return Config(BK=tile_width(args["K"], 64), num_warps=4, num_stages=2)


def _space(args) -> list[Config]:
    widths = sorted({tile_width(args["K"], bk) for bk in (32, 64, 128)})
    return [Config(BK=bk, num_warps=w, num_stages=s)
            for bk in widths for w in (2, 4, 8) for s in (2, 3)]


@tuned(key=["K", "BT", "k"], default=_default, space=_space)
@triton.jit(do_not_specialize=["T", "H"])
def chunk_scaled_dot_kkt_fwd_kernel(
    k, beta, g, A, cu_seqlens, chunk_indices, T,
    H, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    USE_BETA: tl.constexpr, USE_G: tl.constexpr, IS_VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program per (chunk, batch·head): A rows of one chunk, [BT, BT] in fp32."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_t, bos, T = locate_chunk(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    # Global index of the chunk's first token: every offset below starts from it in int64.
    row0 = bos + i_t * BT
    o_t = tl.arange(0, BT)
    m_t = (i_t * BT + o_t) < T

    b_A = tl.zeros([BT, BT], dtype=tl.float32)
    k_base = k + (row0 * H + i_h) * K
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        p_k = k_base + o_t[:, None] * (H * K) + o_k[None, :]
        b_k = tl.load(p_k, mask=m_t[:, None] & (o_k < K)[None, :], other=0.)
        b_A += tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PRECISION)

    if USE_BETA:
        b_beta = tl.load(beta + (row0 + o_t) * H + i_h, mask=m_t, other=0.).to(tl.float32)
        b_A *= b_beta[:, None]
    # Padded rows (past a partial chunk's end) are out of m_A: their exponents would be
    # −γ_j > 0, and they are never stored anyway.
    m_A = (o_t[:, None] > o_t[None, :]) & m_t[:, None]
    if USE_G:
        b_g = tl.load(g + (row0 + o_t) * H + i_h, mask=m_t, other=0.).to(tl.float32)
        # exp of the masked difference (≤ 0 for decays): never exp(γ) and exp(−γ) apart,
        # and the discarded upper triangle never reaches exp.
        b_A *= tl.exp(tl.where(m_A, b_g[:, None] - b_g[None, :], 0.))
    b_A = tl.where(m_A, b_A, 0.)

    p_A = A + (row0 * H + i_h) * BT + o_t[:, None] * (H * BT) + o_t[None, :]
    tl.store(p_A, b_A.to(A.dtype.element_ty), mask=m_t[:, None])


def chunk_scaled_dot_kkt_fwd(
    k: torch.Tensor,
    beta: torch.Tensor | None = None,
    g: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    output_dtype: torch.dtype = torch.float32,
    chunk_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """The strictly lower BT×BT block of each chunk of ``diag(β) K Kᵀ ⊙ Γ``.

    Args:
        k: ``[B, T, H, K]`` fp32/fp16/bf16, K ≤ 256.
        beta: ``[B, T, H]`` (None: β = 1).
        g: ``[B, T, H]`` chunk-local cumulative log decay γ (what ``chunk_local_cumsum``
            returns), fp32 preferred (None: no decay).
        cu_seqlens: ``[N + 1]`` packed-sequence offsets (B == 1); chunks restart at each
            sequence start and the last chunk of a sequence may be partial.
        chunk_size: BT, a power of two in [16, 256].
        output_dtype: dtype of A.
        chunk_indices: ``[NT, 2]`` (sequence, chunk in sequence) rows for ``cu_seqlens``,
            computed once by the caller (built here when None).

    Returns:
        A: ``[B, T, H, BT]`` with ``A[b, t, h, j] = β_t (k_t·k_s) exp(γ_t − γ_s)`` where s is
        the j-th token of t's chunk and j is strictly below t's position in it, else 0.
    """
    if cu_seqlens is None and use_op((k,)):
        return _chunk_scaled_dot_kkt_fwd_op(k, beta, g, chunk_size, output_dtype)
    check_tensor("k", k)
    dims = Dims()
    check_shape("k", k, "B T H K", dims)
    check_positive_length(dims)
    check_head_dim("k", dims["K"], "K")
    for name, x in (("beta", beta), ("g", g)):
        if x is not None:
            check_tensor(name, x)
            check_shape(name, x, "B T H", dims)
    check_same_device(k=k, beta=beta, g=g)
    if output_dtype not in FLOAT_DTYPES:
        raise TypeError(f"output_dtype: expected one of {FLOAT_DTYPES}, got {output_dtype}")
    BT = check_chunk_size(chunk_size)
    B, T, H, K = k.shape
    offsets = check_cu_seqlens(cu_seqlens, T=T, B=B)

    if select_backend(k, beta, g) is Backend.TORCH:
        return chunk_scaled_dot_kkt_fwd_torch(k, beta, g, offsets, BT, output_dtype)

    k = k.contiguous()
    beta = None if beta is None else beta.contiguous()
    g = None if g is None else g.contiguous()
    if offsets is not None:
        cu_seqlens = cu_seqlens.to(k.device)
        chunk_indices = varlen_chunk_indices(cu_seqlens, BT, chunk_indices, offsets)
        NT = chunk_indices.shape[0]
    else:
        chunk_indices = None
        NT = cdiv(T, BT)
    A = torch.empty(B, T, H, BT, dtype=output_dtype, device=k.device)
    chunk_scaled_dot_kkt_fwd_kernel[(NT, B * H)](
        k=k, beta=beta, g=g, A=A, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, T=T,
        H=H, K=K, BT=BT, USE_BETA=beta is not None, USE_G=g is not None,
        IS_VARLEN=offsets is not None, DOT_PRECISION=dot_precision(k.dtype),
    )
    return A


# The function as the custom op fla::chunk_scaled_dot_kkt_fwd for traced calls (packed
# sequences read offsets on the host: those stay eager); the op's step is the function.
_chunk_scaled_dot_kkt_fwd_op = stage_op(
    "chunk_scaled_dot_kkt_fwd",
    lambda k, beta, g, chunk_size, output_dtype: chunk_scaled_dot_kkt_fwd(
        k, beta, g, None, chunk_size, output_dtype),
    schema="(Tensor k, Tensor? beta, Tensor? g, int chunk_size, ScalarType output_dtype) "
           "-> Tensor", ahead=False)
