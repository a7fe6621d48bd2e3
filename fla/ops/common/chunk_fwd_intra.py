"""The intra-chunk half of the fused chunked forward: everything one chunk of 64 tokens
can compute without the state (gated delta rule, ALGORITHMS.md §1; with ``delta=False``
only γ and Aqk, for simple GLA, §2, above K = 128: below, its forward pass forms Aqk).

Per chunk and head, with g the per-token log decay and β the write strength:

    γ   = cumsum(g) inside the chunk                       (stored: the backward needs it)
    Aqk = (Q Kᵀ ⊙ Γ) on and below the diagonal,  Γ_ij = exp(γ_i − γ_j)
    A   = strict_lower( diag(β) (K Kᵀ) ⊙ Γ )
    Ai  = (I + A)⁻¹                                        (the T⁻¹ of the UT transform)

Two kernels, launched in that order: the scores kernel (γ and Aqk: one 64 x 64 product
a chunk, two warps) and the WY kernel (Ai, one warp, reading γ back). They were one
one-warp kernel until 2026-11-28, whose Q Kᵀ strips held its register peak (255 a
thread, 192 without them) and a third of its time. H200, Triton 3.6, bf16,
1x8192x96x128: 0.433 ms as one kernel, 0.148 (scores) + 0.152 (WY) apart.

Nothing of size T·K or T·V is written: the state pass (``chunk_fwd_inter``) forms
``W·S`` and ``U`` as ``Ai·β(V − e^γ K S)`` on the fly. Compared with the staged forward
(kkᵀ, solve_tril, W/U, state pass with h and v_new, output) this removes the fp32 A
round trip and the W, U, h and v_new tensors from the forward's memory traffic.

The inverse is built from 16 x 16 blocks held in registers: the four diagonal blocks by
forward substitution (:func:`fla.ops.utils.solve_tril.unit_lower_inverse_blocks`), the
six below by block substitution (:func:`fla.ops.utils.solve_tril.merge_block_inverse_64`),
in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fla.ops.utils.index import locate_chunk
from fla.ops.utils.solve_tril import (
    merge_block_inverse_64,
    stack_blocks_4,
    store_block_inverse_64,
    unit_lower_inverse_blocks,
    unstack_blocks_4,
)
from fla.ops.common.chunk_scores import gate_causal_scores
from fla.ops.utils.tiles import sixteen_bit, tile_width
from fla.utils.grid import cdiv
from fla.utils.triton_facts import dot_precision, warp_choices
from fla.utils.tuning import Config, tuned

__all__ = ["chunk_gated_delta_rule_fwd_intra", "CHUNK_SIZE"]

CHUNK_SIZE = 64  # four 16-row blocks: the block inverse is written out for this size
# The WY kernel's register cap (see _default): 65536 / (12 programs x 32 threads), rounded
# down to the allocation granule of 8.
WY_MAX_REGISTERS = 168


def _default(args) -> Config:
    # One warp. The forward substitution of the 16 x 16 diagonal blocks is a chain of
    # dependent row steps, each a reduction across a block's rows: within one warp those
    # are shuffles, across warps barriers. Measured on H100 (Triton 3.6, bf16, K = 128,
    # B·T·H = 786K, with the Q Kᵀ strips then in this kernel): 1 warp 0.47 ms, 2 warps
    # 0.49, 4 warps 0.96, 8 warps 1.54.
    # 16-bit inputs: registers capped at 168 a thread, 12 programs an SM instead of the
    # 10 that the compiler's free choice (~196) leaves, for a few spilled values (offline
    # sm_90, Triton 3.9: 64-72 B of stack; Ai bit-identical). H200, Triton 3.6, bf16,
    # 2026-11-28, ms uncapped -> 168: 1x8192x96x128 0.167 -> 0.152, 4x4096x64x128 0.214
    # -> 0.192, 2x16384x16x128 0.114 -> 0.103, 8x2048x32x256 0.149 -> 0.134; 184 (11 an
    # SM) gained 1-2%, 152 and 128 lost 7-20% (spills).
    # fp32 inputs (tf32x3 dots, three products a dot) overflow the registers at any warp
    # count; offline at K = 128 the least stack is BK = 32 uncapped (240 B, against 1.4
    # KB at BK = 64 and 2.5 KB capped). Not timed on a GPU.
    if not sixteen_bit(args):
        return Config(BK=tile_width(args["K"], 32), num_warps=1, num_stages=2)
    return Config(BK=tile_width(args["K"], 64), num_warps=1, num_stages=2,
                  maxnreg=WY_MAX_REGISTERS)


def _space(args) -> list[Config]:
    widths = sorted({tile_width(args["K"], bk) for bk in (32, 64)})
    configs = [Config(BK=bk, num_warps=w, num_stages=s)
               for bk in widths for w in (1, 2, 4) for s in (1, 2)]
    return configs + [Config(BK=bk, num_warps=1, num_stages=s, maxnreg=WY_MAX_REGISTERS)
                      for bk in widths for s in (1, 2)]


def _scores_default(args) -> Config:
    # H200 (Triton 3.6, bf16, 2026-11-28), the space timed: 2 warps, 64-wide K tiles, two
    # stages at 1x8192x96x128 (0.148 ms against 0.157 at 4 warps, 0.219 at BK = 32) and
    # at 8x2048x32x256 (0.159 against 0.164).
    # fp32 inputs: that config spills 6.5 KB a thread (offline sm_90, K = 128; the
    # tf32x3 products hold three operand copies); 4 warps at BK = 32 keep 136 registers
    # and no stack. Not timed on a GPU.
    if not sixteen_bit(args):
        return Config(BK=tile_width(args["K"], 32), num_warps=4, num_stages=2)
    return Config(BK=tile_width(args["K"], 64), num_warps=2, num_stages=2)


def _scores_space(args) -> list[Config]:
    widths = sorted({tile_width(args["K"], bk) for bk in (32, 64)})
    return [Config(BK=bk, num_warps=w, num_stages=s)
            for bk in widths for w in warp_choices(stmatrix_prone=True) for s in (1, 2)]


@triton.jit
def _gate_block(b_A, b_gi, b_gj, b_beta_i, DIAGONAL: tl.constexpr):
    """β_i · A_ij · exp(γ_i − γ_j) for one 16 x 16 block of K Kᵀ; strictly lower for a
    diagonal block. The exponent is masked before exp, so the discarded upper triangle
    cannot overflow; below the diagonal it is a sum of log decays, ≤ 0."""
    o_i = tl.arange(0, 16)
    diff = b_gi[:, None] - b_gj[None, :]
    if DIAGONAL:
        keep = o_i[:, None] > o_i[None, :]
        return tl.where(keep, b_A * tl.exp(tl.where(keep, diff, 0.)), 0.) * b_beta_i[:, None]
    return b_A * tl.exp(diff) * b_beta_i[:, None]


@triton.jit
def _beta_block(beta, row0, first, L, H, i_h):
    o_i = first + tl.arange(0, 16)
    return tl.load(beta + (row0 + o_i) * H + i_h, mask=o_i < L, other=0.).to(tl.float32)


@triton.jit
def _gamma_block(g_cum, row0, first, L, H, i_h):
    """γ of 16 rows; rows past the chunk's end (L valid rows) repeat the last valid γ.
    With 0 there instead, γ_pad − γ_j = −γ_j > 88 in a steep last chunk overflowed exp
    to inf, and 0 · inf = NaN spread through the block inverse into the valid rows."""
    o_i = tl.minimum(first + tl.arange(0, 16), L - 1)
    return tl.load(g_cum + (row0 + o_i) * H + i_h)


@tuned(key=["K", "k"], default=_scores_default, space=_scores_space)
@triton.jit(do_not_specialize=["T", "H"])
def chunk_fwd_scores_kernel(
    q, k, g, g_cum, Aqk, cu_seqlens, chunk_indices, T, H, K: tl.constexpr, BK: tl.constexpr,
    USE_G: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """γ and the causal gated scores, one program per (chunk, batch·head). ``q, k [B, T,
    H, K]``; ``g, g_cum [B, T, H]``; ``Aqk [B, T, H, 64]`` (row t: token t's scores)."""
    BT: tl.constexpr = 64
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_t, bos, T = locate_chunk(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    row0 = bos + i_t * BT
    o_t = tl.arange(0, BT)
    m_t = o_t < T - i_t * BT  # valid rows: all but in a sequence's last chunk
    if USE_G:
        b_g = tl.load(g + (row0 + o_t) * H + i_h, mask=m_t, other=0.).to(tl.float32)
        b_g = tl.cumsum(b_g, axis=0)
        tl.store(g_cum + (row0 + o_t) * H + i_h, b_g, mask=m_t)
    else:
        b_g = tl.zeros([BT], dtype=tl.float32)

    # One 64 x 64 product over K's tiles: a few warps hold the fp32 accumulator in 32
    # registers a thread or less (in one warp it cost all 255 and 16-row strips).
    rows = (row0 * H + i_h) * K + o_t[:, None] * (H * K)  # the chunk's rows in q and k
    p_q = q + rows
    p_k = k + rows
    b_S = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m = m_t[:, None] & (o_k < K)[None, :]
        b_q = tl.load(p_q + o_k[None, :], mask=m, other=0.)
        b_k = tl.load(p_k + o_k[None, :], mask=m, other=0.)
        b_S = tl.dot(b_q, tl.trans(b_k), b_S, input_precision=DOT_PRECISION)
    b_S = gate_causal_scores(b_S, m_t, b_g, BT, USE_G)
    tl.store(Aqk + (row0 * H + i_h) * BT + o_t[:, None] * (H * BT) + o_t[None, :],
             b_S.to(Aqk.dtype.element_ty), mask=m_t[:, None])


@tuned(key=["K", "k"], default=_default, space=_space)
@triton.jit(do_not_specialize=["T", "H"])
def chunk_gated_delta_rule_fwd_intra_kernel(
    k, beta, g_cum, Ai, cu_seqlens, chunk_indices, T,
    H, K: tl.constexpr, BK: tl.constexpr, USE_G: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """(I + A)⁻¹, one program per (chunk, batch·head). ``k [B, T, H, K]``; ``beta, g_cum
    [B, T, H]`` (γ as :func:`chunk_fwd_scores_kernel` stored it); ``Ai [B, T, H, 64]``
    (row t: token t's row of its chunk's inverse)."""
    BT: tl.constexpr = 64
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_t, bos, T = locate_chunk(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    row0 = bos + i_t * BT
    L = T - i_t * BT  # valid rows of this chunk (more than BT except in the last one)
    o_c = tl.arange(0, 16)

    # K Kᵀ in ten 16 x 16 blocks (i ≥ j).
    k_base = k + (row0 * H + i_h) * K
    b_A11 = tl.zeros([16, 16], dtype=tl.float32)
    b_A21 = tl.zeros([16, 16], dtype=tl.float32)
    b_A22 = tl.zeros([16, 16], dtype=tl.float32)
    b_A31 = tl.zeros([16, 16], dtype=tl.float32)
    b_A32 = tl.zeros([16, 16], dtype=tl.float32)
    b_A33 = tl.zeros([16, 16], dtype=tl.float32)
    b_A41 = tl.zeros([16, 16], dtype=tl.float32)
    b_A42 = tl.zeros([16, 16], dtype=tl.float32)
    b_A43 = tl.zeros([16, 16], dtype=tl.float32)
    b_A44 = tl.zeros([16, 16], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = (o_k < K)[None, :]
        p_k = k_base + o_c[:, None] * (H * K) + o_k[None, :]
        b_k1 = tl.load(p_k, mask=(o_c < L)[:, None] & m_k, other=0.)
        b_k2 = tl.load(p_k + 16 * H * K, mask=(16 + o_c < L)[:, None] & m_k, other=0.)
        b_k3 = tl.load(p_k + 32 * H * K, mask=(32 + o_c < L)[:, None] & m_k, other=0.)
        b_k4 = tl.load(p_k + 48 * H * K, mask=(48 + o_c < L)[:, None] & m_k, other=0.)
        b_A11 = tl.dot(b_k1, tl.trans(b_k1), b_A11, input_precision=DOT_PRECISION)
        b_A21 = tl.dot(b_k2, tl.trans(b_k1), b_A21, input_precision=DOT_PRECISION)
        b_A22 = tl.dot(b_k2, tl.trans(b_k2), b_A22, input_precision=DOT_PRECISION)
        b_A31 = tl.dot(b_k3, tl.trans(b_k1), b_A31, input_precision=DOT_PRECISION)
        b_A32 = tl.dot(b_k3, tl.trans(b_k2), b_A32, input_precision=DOT_PRECISION)
        b_A33 = tl.dot(b_k3, tl.trans(b_k3), b_A33, input_precision=DOT_PRECISION)
        b_A41 = tl.dot(b_k4, tl.trans(b_k1), b_A41, input_precision=DOT_PRECISION)
        b_A42 = tl.dot(b_k4, tl.trans(b_k2), b_A42, input_precision=DOT_PRECISION)
        b_A43 = tl.dot(b_k4, tl.trans(b_k3), b_A43, input_precision=DOT_PRECISION)
        b_A44 = tl.dot(b_k4, tl.trans(b_k4), b_A44, input_precision=DOT_PRECISION)

    b_b1 = _beta_block(beta, row0, 0, L, H, i_h)
    b_b2 = _beta_block(beta, row0, 16, L, H, i_h)
    b_b3 = _beta_block(beta, row0, 32, L, H, i_h)
    b_b4 = _beta_block(beta, row0, 48, L, H, i_h)
    if USE_G:
        b_g1 = _gamma_block(g_cum, row0, 0, L, H, i_h)
        b_g2 = _gamma_block(g_cum, row0, 16, L, H, i_h)
        b_g3 = _gamma_block(g_cum, row0, 32, L, H, i_h)
        b_g4 = _gamma_block(g_cum, row0, 48, L, H, i_h)
    else:
        b_g1 = tl.zeros([16], dtype=tl.float32)
        b_g2 = b_g1
        b_g3 = b_g1
        b_g4 = b_g1
    b_A11 = _gate_block(b_A11, b_g1, b_g1, b_b1, True)
    b_A21 = _gate_block(b_A21, b_g2, b_g1, b_b2, False)
    b_A22 = _gate_block(b_A22, b_g2, b_g2, b_b2, True)
    b_A31 = _gate_block(b_A31, b_g3, b_g1, b_b3, False)
    b_A32 = _gate_block(b_A32, b_g3, b_g2, b_b3, False)
    b_A33 = _gate_block(b_A33, b_g3, b_g3, b_b3, True)
    b_A41 = _gate_block(b_A41, b_g4, b_g1, b_b4, False)
    b_A42 = _gate_block(b_A42, b_g4, b_g2, b_b4, False)
    b_A43 = _gate_block(b_A43, b_g4, b_g3, b_b4, False)
    b_A44 = _gate_block(b_A44, b_g4, b_g4, b_b4, True)

    # The four diagonal blocks are inverted together: 15 substitution steps, not 60.
    b_D1, b_D2, b_D3, b_D4 = unstack_blocks_4(unit_lower_inverse_blocks(
        stack_blocks_4(b_A11, b_A22, b_A33, b_A44)))
    b_X21, b_X31, b_X32, b_X41, b_X42, b_X43 = merge_block_inverse_64(
        b_D1, b_D2, b_D3, b_D4, b_A21, b_A31, b_A32, b_A41, b_A42, b_A43, DOT_PRECISION)
    store_block_inverse_64(Ai + (row0 * H + i_h) * BT, H * BT, L, b_D1, b_D2, b_D3, b_D4,
                           b_X21, b_X31, b_X32, b_X41, b_X42, b_X43)


def chunk_gated_delta_rule_fwd_intra(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    delta: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """The per-chunk quantities of the fused forward: two launches, one program per
    chunk and head each.

    Inputs are validated, time-major and contiguous (the op's entry point did that).

    Args:
        q, k: ``[B, T, H, K]`` fp32/fp16/bf16, K ≤ 256.
        g: ``[B, T, H]`` per-token natural-log decay (not cumulated), or None.
        beta: ``[B, T, H]`` (unused without ``delta``).
        cu_seqlens: ``[N + 1]`` packed-sequence offsets on k's device (B == 1).
        chunk_indices: ``prepare_chunk_indices(cu_seqlens, 64)`` when ``cu_seqlens`` is
            given.
        delta: False for simple GLA: no (I + A)⁻¹, Ai is None.

    Returns:
        ``(g_cum, Ai, Aqk)``: ``g_cum [B, T, H]`` float32 chunk-local cumulative decay
        γ (None without g); ``Ai [B, T, H, 64]`` in k's dtype, row t holding token t's
        row of its chunk's ``(I + A)⁻¹`` (zeros above the diagonal and past a partial
        chunk's end); ``Aqk [B, T, H, 64]`` in k's dtype, the causal gated scores
        ``(q_t·k_s) exp(γ_t − γ_s)`` for s ≤ t in the chunk, zeros elsewhere.
    """
    B, T, H, K = k.shape
    NT = cdiv(T, CHUNK_SIZE) if cu_seqlens is None else chunk_indices.shape[0]
    g_cum = None if g is None else torch.empty(B, T, H, dtype=torch.float32, device=k.device)
    Aqk = torch.empty(B, T, H, CHUNK_SIZE, dtype=k.dtype, device=k.device)
    shared = dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, T=T, H=H, K=K,
                  USE_G=g is not None, IS_VARLEN=cu_seqlens is not None,
                  DOT_PRECISION=dot_precision(k.dtype))
    chunk_fwd_scores_kernel[(NT, B * H)](q=q, k=k, g=g, g_cum=g_cum, Aqk=Aqk, **shared)
    if not delta:
        return g_cum, None, Aqk
    # After the scores kernel, in stream order: it reads the γ that one stored.
    Ai = torch.empty(B, T, H, CHUNK_SIZE, dtype=k.dtype, device=k.device)
    chunk_gated_delta_rule_fwd_intra_kernel[(NT, B * H)](k=k, beta=beta, g_cum=g_cum, Ai=Ai,
                                                         **shared)
    return g_cum, Ai, Aqk
