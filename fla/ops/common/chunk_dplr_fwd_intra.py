"""DPLR delta rule, intra-chunk stage: the four C×C score matrices of each chunk.

Per chunk of BT = 64 tokens and head, with γ the chunk-local cumulative gate (a
K-vector per token) and γ⁻_t = γ_t − gk_t::

    A_qk[t,s] =  Σ_k q_tk k_sk e^{γ_tk − γ_sk}     s ≤ t
    A_qb[t,s] =  Σ_k q_tk b_sk e^{γ_tk − γ_sk}     s ≤ t
    A_ak[t,s] =  Σ_k a_tk k_sk e^{γ⁻_tk − γ_sk}    s < t
    A_nab[t,s] = −Σ_k a_tk b_sk e^{γ⁻_tk − γ_sk}   s < t   (so that solve_tril's
                                                            (I + A_nab)⁻¹ = (I − A_ab)⁻¹)

Numerics: the chunk is two 32-row sub-blocks. The off-diagonal block (rows 32..63,
columns 0..31) factors through the gate at token 31, so both factors have exponents ≤ 0;
each diagonal block through the gate at its middle token (15 or 47), so no factor's
exponent exceeds 16 steps of gate (e^{9.7} at RWKV7's w ≥ −e^{−0.5}; finite in fp32 for
gates down to about −5 per step). exp(±γ) over a whole chunk is never formed. Products
are fp32 ``tl.dot``s (32×BK×32); K is walked in BK-wide tiles (the gates of different
k never mix). Each stored row has 64 entries, zeros above the diagonal.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fla.ops.utils.index import locate_chunk, prepare_chunk_indices
from fla.ops.utils.tiles import tile_width
from fla.utils.triton_facts import dot_precision
from fla.utils.tuning import Config, tuned

__all__ = ["chunk_dplr_fwd_intra", "CHUNK_SIZE", "row_of"]

CHUNK_SIZE = 64
SUB = 32


@triton.jit
def row_of(x, o_r, r):
    """Row ``r`` of the register tile ``x`` (rows indexed by ``o_r``) as a vector."""
    return tl.sum(tl.where(o_r[:, None] == r, x, 0.0), axis=0)


@triton.jit
def load_sub_block(x, row0, H: tl.constexpr, K: tl.constexpr, o_r, m_r, o_k, m_k):
    """A [32, BK] tile of a [.., H, K] token tensor from token row ``row0`` (int64 offset
    of the head's first element) in float32; rows/columns outside the chunk read 0."""
    p = x + row0 + o_r[:, None].to(tl.int64) * (H * K) + o_k[None, :]
    return tl.load(p, mask=m_r[:, None] & m_k[None, :], other=0.0).to(tl.float32)


@triton.jit
def sub_block_gates(gk, row0, H: tl.constexpr, K: tl.constexpr, o_r, m_r0, m_r1, o_k, m_k,
                    SUB: tl.constexpr):
    """Cumulative gates of both 32-row sub-blocks of a chunk (inclusive γ and exclusive
    γ⁻ = γ − gk) and the reference gates at tokens 15, 31, 47."""
    g0 = load_sub_block(gk, row0, H, K, o_r, m_r0, o_k, m_k)
    g1 = load_sub_block(gk, row0 + SUB * H * K, H, K, o_r, m_r1, o_k, m_k)
    c0 = tl.cumsum(g0, axis=0)
    r31 = row_of(c0, o_r, SUB - 1)
    c1 = tl.cumsum(g1, axis=0) + r31[None, :]
    r15 = row_of(c0, o_r, SUB // 2 - 1)
    r47 = row_of(c1, o_r, SUB // 2 - 1)
    return c0, c1, c0 - g0, c1 - g1, r15, r31, r47


@triton.jit
def _scores(x, gx, y, gy, ref, PRECISION: tl.constexpr):
    """Σ_k x_tk y_sk e^{gx_tk − gy_sk} with both exponents referenced at ``ref``."""
    xh = x * tl.exp(gx - ref[None, :])
    yh = y * tl.exp(ref[None, :] - gy)
    return tl.dot(xh, tl.trans(yh), input_precision=PRECISION)


def _default(args) -> Config:
    return Config(BK=tile_width(args["K"], 64), num_warps=4, num_stages=2)


def _space(args) -> list[Config]:
    widths = sorted({tile_width(args["K"], bk) for bk in (32, 64, 128)})
    return [Config(BK=bk, num_warps=w, num_stages=s) for bk in widths for w in (2, 4, 8)
            for s in (1, 2)]


@tuned(key=["K", "q", "PRECISION"], default=_default, space=_space)
@triton.jit(do_not_specialize=["T"])
def chunk_dplr_fwd_intra_kernel(
    q, k, a, b, gk, Aqk, Aqb, Aak, Anab, cu_seqlens, chunk_indices, T,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, SUB: tl.constexpr,
    BK: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_t, bos, T = locate_chunk(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    o_r = tl.arange(0, SUB)
    m_r0 = i_t * BT + o_r < T
    m_r1 = i_t * BT + SUB + o_r < T
    row0 = ((bos + i_t * BT) * H + i_h) * K       # int64: first element of the chunk
    row1 = row0 + SUB * H * K
    causal = o_r[:, None] >= o_r[None, :]
    strict = o_r[:, None] > o_r[None, :]

    z = tl.zeros([SUB, SUB], dtype=tl.float32)
    qk00, qk10, qk11 = z, z, z
    qb00, qb10, qb11 = z, z, z
    ak00, ak10, ak11 = z, z, z
    ab00, ab10, ab11 = z, z, z
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        c0, c1, e0, e1, r15, r31, r47 = sub_block_gates(gk, row0, H, K, o_r, m_r0, m_r1,
                                                        o_k, m_k, SUB)
        q0 = load_sub_block(q, row0, H, K, o_r, m_r0, o_k, m_k)
        q1 = load_sub_block(q, row1, H, K, o_r, m_r1, o_k, m_k)
        k0 = load_sub_block(k, row0, H, K, o_r, m_r0, o_k, m_k)
        k1 = load_sub_block(k, row1, H, K, o_r, m_r1, o_k, m_k)
        a0 = load_sub_block(a, row0, H, K, o_r, m_r0, o_k, m_k)
        a1 = load_sub_block(a, row1, H, K, o_r, m_r1, o_k, m_k)
        b0 = load_sub_block(b, row0, H, K, o_r, m_r0, o_k, m_k)
        b1 = load_sub_block(b, row1, H, K, o_r, m_r1, o_k, m_k)
        qk00 += _scores(q0, c0, k0, c0, r15, PRECISION)
        qk10 += _scores(q1, c1, k0, c0, r31, PRECISION)
        qk11 += _scores(q1, c1, k1, c1, r47, PRECISION)
        qb00 += _scores(q0, c0, b0, c0, r15, PRECISION)
        qb10 += _scores(q1, c1, b0, c0, r31, PRECISION)
        qb11 += _scores(q1, c1, b1, c1, r47, PRECISION)
        ak00 += _scores(a0, e0, k0, c0, r15, PRECISION)
        ak10 += _scores(a1, e1, k0, c0, r31, PRECISION)
        ak11 += _scores(a1, e1, k1, c1, r47, PRECISION)
        ab00 += _scores(a0, e0, b0, c0, r15, PRECISION)
        ab10 += _scores(a1, e1, b0, c0, r31, PRECISION)
        ab11 += _scores(a1, e1, b1, c1, r47, PRECISION)

    # Row t of a chunk's matrix lives at token t: [.., H, BT] rows, 64 columns.
    p0 = ((bos + i_t * BT + o_r[:, None]).to(tl.int64) * H + i_h) * BT + o_r[None, :]
    p1 = p0 + SUB * H * BT
    m0 = m_r0[:, None]
    m1 = m_r1[:, None]
    tl.store(Aqk + p0, tl.where(causal, qk00, 0.0), mask=m0)
    tl.store(Aqk + p0 + SUB, z, mask=m0)
    tl.store(Aqk + p1, qk10, mask=m1)
    tl.store(Aqk + p1 + SUB, tl.where(causal, qk11, 0.0), mask=m1)
    tl.store(Aqb + p0, tl.where(causal, qb00, 0.0), mask=m0)
    tl.store(Aqb + p0 + SUB, z, mask=m0)
    tl.store(Aqb + p1, qb10, mask=m1)
    tl.store(Aqb + p1 + SUB, tl.where(causal, qb11, 0.0), mask=m1)
    tl.store(Aak + p0, tl.where(strict, ak00, 0.0), mask=m0)
    tl.store(Aak + p0 + SUB, z, mask=m0)
    tl.store(Aak + p1, ak10, mask=m1)
    tl.store(Aak + p1 + SUB, tl.where(strict, ak11, 0.0), mask=m1)
    tl.store(Anab + p0, tl.where(strict, -ab00, 0.0), mask=m0)
    tl.store(Anab + p0 + SUB, z, mask=m0)
    tl.store(Anab + p1, -ab10, mask=m1)
    tl.store(Anab + p1 + SUB, tl.where(strict, -ab11, 0.0), mask=m1)


def chunk_dplr_fwd_intra(q, k, a, b, gk, cu_seqlens=None, chunk_indices=None):
    """``(A_qk, A_qb, A_ak, A_nab)``, each ``[B, T, H, 64]`` float32 (see the module
    docstring), from time-major contiguous ``[B, T, H, K]`` inputs."""
    B, T, H, K = q.shape
    if cu_seqlens is not None and chunk_indices is None:
        chunk_indices = prepare_chunk_indices(cu_seqlens, CHUNK_SIZE)
    NT = triton.cdiv(T, CHUNK_SIZE) if cu_seqlens is None else chunk_indices.shape[0]
    out = [torch.empty(B, T, H, CHUNK_SIZE, dtype=torch.float32, device=q.device)
           for _ in range(4)]
    chunk_dplr_fwd_intra_kernel[(NT, B * H)](
        q, k, a, b, gk, *out, cu_seqlens, chunk_indices, T, H=H, K=K, BT=CHUNK_SIZE,
        SUB=SUB, IS_VARLEN=cu_seqlens is not None,
        PRECISION=dot_precision(torch.float32 if q.dtype == torch.float32 else torch.float16))
    return tuple(out)
