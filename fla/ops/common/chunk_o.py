"""Stage 4 of the chunked gated delta rule (ALGORITHMS.md §1): the output.

Per chunk, with S = h[chunk] the state entering it, Vn the new values of the state pass
and γ the chunk-local cumulative log decay (Γ_ij = exp(γ_i − γ_j)):

    O = scale · [ (Q ⊙ exp(γ)) S + (Q Kᵀ ⊙ Γ ⊙ causal_incl_diag) Vn ]

Also the output stage of simple GLA (§2), with Vn = V.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fla.ops.common.chunk_torch import chunk_fwd_o_torch
from fla.ops.utils.index import locate_chunk, varlen_chunk_indices
from fla.ops.utils.tiles import check_buffer, check_chunk_size, sixteen_bit, tile_width
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
    check_scale,
    check_shape,
    check_tensor,
)

__all__ = ["chunk_fwd_o", "chunk_fwd_o_kernel"]


def _default(args) -> Config:
    # 64×64 tiles: the [BT, BV] output and [BT, BT] score accumulators (fp32) plus the
    # Q, K, h operand tiles of one K step fit 4 warps without spilling. Above K = 128 the
    # K loop is long enough for a third stage, and 128-wide V tiles halve the re-reads of
    # Q, K and the scores: 8x2048x32x256 0.75 ms against 0.88 (H100, 2026-11-26 evening).
    # (16-bit operands: fp32 ones take twice the shared memory a stage.)
    if args["K"] > 128 and sixteen_bit(args, "q"):
        return Config(BK=64, BV=tile_width(args["V"], 128), num_warps=4, num_stages=3)
    return Config(BK=tile_width(args["K"], 64), BV=tile_width(args["V"], 64), num_warps=4,
                  num_stages=2)


def _space(args) -> list[Config]:
    return list(dict.fromkeys(
        Config(BK=tile_width(args["K"], bk), BV=tile_width(args["V"], bv), num_warps=w,
               num_stages=s)
        for bk in (64, 128) for bv in (64, 128) for w in (2, 4, 8) for s in (2, 3)))


@tuned(key=["K", "V", "BT", "q"], default=_default, space=_space)
@triton.jit(do_not_specialize=["T", "H"])
def chunk_fwd_o_kernel(
    q, k, v, h, g, o, Aqk, cu_seqlens, chunk_indices, scale, T,
    H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, IS_VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr, STORE_AQK: tl.constexpr = False,
):
    """One program per (V tile, chunk, batch·head); with ``STORE_AQK`` the first V tile's
    programs also write the chunk's causal gated scores to ``Aqk [B, T, H, BT]``."""
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    # The grid's chunk index over all chunks: h is [B, NT, H, K, V] ([1, NT_total, ...] varlen).
    if IS_VARLEN:
        i_tg = i_t.to(tl.int64)
    else:
        i_tg = i_b.to(tl.int64) * tl.cdiv(T, BT) + i_t
    i_t, bos, T = locate_chunk(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    row0 = bos + i_t * BT
    o_t = tl.arange(0, BT)
    m_t = (i_t * BT + o_t) < T
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V

    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    b_A = tl.zeros([BT, BT], dtype=tl.float32)
    q_base = q + (row0 * H + i_h) * K
    k_base = k + (row0 * H + i_h) * K
    h_base = h + (i_tg * H + i_h) * (K * V)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_q = tl.load(q_base + o_t[:, None] * (H * K) + o_k[None, :],
                      mask=m_t[:, None] & m_k[None, :], other=0.)
        b_k = tl.load(k_base + o_k[:, None] + o_t[None, :] * (H * K),
                      mask=m_k[:, None] & m_t[None, :], other=0.)
        b_h = tl.load(h_base + o_k[:, None] * V + o_v[None, :],
                      mask=m_k[:, None] & m_v[None, :], other=0.)
        b_o += tl.dot(b_q, b_h, input_precision=DOT_PRECISION)
        b_A += tl.dot(b_q, b_k, input_precision=DOT_PRECISION)

    # Rows past a partial chunk's end are never stored; out of m_A, their exponents
    # (γ there is 0, not a decay sum) never reach exp.
    m_A = (o_t[:, None] >= o_t[None, :]) & m_t[:, None]
    if USE_G:
        b_g = tl.load(g + (row0 + o_t) * H + i_h, mask=m_t, other=0.).to(tl.float32)
        # γ is chunk-local (≤ 0 for decays), so exp(γ) ≤ 1; inside the chunk only the
        # masked differences γ_i − γ_j (i ≥ j) reach exp, which cannot overflow.
        b_o *= tl.exp(b_g)[:, None]
        b_A *= tl.exp(tl.where(m_A, b_g[:, None] - b_g[None, :], 0.))
    b_A = tl.where(m_A, b_A, 0.)
    if STORE_AQK:
        if i_v == 0:
            tl.store(Aqk + (row0 * H + i_h) * BT + o_t[:, None] * (H * BT) + o_t[None, :],
                     b_A.to(Aqk.dtype.element_ty), mask=m_t[:, None])

    o_tv = (row0 * H + i_h) * V + o_t[:, None] * (H * V) + o_v[None, :]
    m_tv = m_t[:, None] & m_v[None, :]
    b_v = tl.load(v + o_tv, mask=m_tv, other=0.)
    b_o += tl.dot(b_A.to(v.dtype.element_ty), b_v, input_precision=DOT_PRECISION)
    tl.store(o + o_tv, (b_o * scale).to(o.dtype.element_ty), mask=m_tv)


def chunk_fwd_o(
    q: torch.Tensor,
    k: torch.Tensor,
    v_new: torch.Tensor,
    h: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    chunk_indices: torch.Tensor | None = None,
    scores_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The chunked output, ``O = scale·[(Q ⊙ exp(γ)) S + (Q Kᵀ ⊙ Γ ⊙ causal) Vn]`` with
    the causal mask including the diagonal.

    Args:
        q, k: ``[B, T, H, K]`` (fp32/fp16/bf16, one dtype for all four tensors).
        v_new: ``[B, T, H, V]`` the state pass's new values (or V for simple GLA).
        h: ``[B, NT, H, K, V]`` the state entering each chunk (``[1, NT_total, H, K, V]``
            under varlen, indexed by the global chunk index).
        g: ``[B, T, H]`` chunk-local cumulative log decay γ (None: no decay).
        scale: defaults to ``K ** -0.5``.
        cu_seqlens: ``[N + 1]`` packed-sequence offsets (B == 1).
        chunk_size: BT, a power of two in [16, 256].
        chunk_indices: ``[NT, 2]`` varlen chunk table (built here when None).
        scores_out: optional ``[B, T, H, BT]`` buffer in q's dtype that receives the
            scores ``Q Kᵀ ⊙ Γ ⊙ causal`` (unscaled; row t holds token t's scores within
            its chunk), as simple GLA's backward reads them: formed here anyway, so a
            forward feeding a backward needs no scores kernel of its own.

    Returns:
        o: ``[B, T, H, V]`` in v_new's dtype.
    """
    check_tensor("q", q)
    for name, x in (("k", k), ("v_new", v_new), ("h", h)):
        check_tensor(name, x)
        check_dtype(name, x, (q.dtype,))
    dims = Dims()
    check_shape("q", q, "B T H K", dims)
    check_shape("k", k, "B T H K", dims)
    check_shape("v_new", v_new, "B T H V", dims)
    check_positive_length(dims)
    check_head_dim("q", dims["K"], "K")
    check_head_dim("v_new", dims["V"], "V")
    if g is not None:
        check_tensor("g", g)
        check_shape("g", g, "B T H", dims)
    check_same_device(q=q, k=k, v_new=v_new, h=h, g=g)
    BT = check_chunk_size(chunk_size)
    B, T, H, K = q.shape
    V = v_new.shape[-1]
    scale = check_scale(scale, K ** -0.5)
    offsets = check_cu_seqlens(cu_seqlens, T=T, B=B)
    if offsets is None:
        dims["NT"] = cdiv(T, BT)
    else:
        dims["NT"] = sum(-(-(e - s) // BT) for s, e in zip(offsets[:-1], offsets[1:]))
    dims.source["NT"] = f"the number of chunks of size {BT}"
    check_shape("h", h, "B NT H K V", dims)
    if scores_out is not None:
        check_buffer("scores_out", scores_out, (B, T, H, BT), q.dtype, q.device)

    if select_backend(q, k, v_new, h, g) is Backend.TORCH:
        return chunk_fwd_o_torch(q, k, v_new, h, g, scale, offsets, BT, scores_out)

    q, k, v_new, h = q.contiguous(), k.contiguous(), v_new.contiguous(), h.contiguous()
    g = None if g is None else g.contiguous()
    if offsets is not None:
        cu_seqlens = cu_seqlens.to(q.device)
        chunk_indices = varlen_chunk_indices(cu_seqlens, BT, chunk_indices, offsets)
    else:
        chunk_indices = None
    NT = dims["NT"]
    o = torch.empty_like(v_new)
    chunk_fwd_o_kernel[lambda meta: (cdiv(V, meta["BV"]), NT, B * H)](
        q=q, k=k, v=v_new, h=h, g=g, o=o, Aqk=scores_out, cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices, scale=scale, T=T, H=H, K=K, V=V, BT=BT,
        USE_G=g is not None, IS_VARLEN=offsets is not None,
        DOT_PRECISION=dot_precision(q.dtype), STORE_AQK=scores_out is not None,
    )
    return o
