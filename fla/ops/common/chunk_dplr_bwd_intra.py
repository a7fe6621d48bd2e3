"""DPLR delta rule, backward through the four intra-chunk score matrices.

For each matrix A[t,s] = Σ_k x_tk y_sk e^{gx_tk − gy_sk} of
:mod:`fla.ops.common.chunk_dplr_fwd_intra` (q·k, q·b with gx = γ; a·k, a·b with
gx = γ⁻; gy = γ) and its gradient dA::

    dx_t += Σ_s dA[t,s] y_s e^{gx_t − gy_s}      dy_s += Σ_t dA[t,s] x_t e^{gx_t − gy_s}

formed per 32-row sub-block pair with the same reference gates as the forward (every
factor's exponent bounded by 16 steps of gate, ≤ 0 off the diagonal). One program per
(chunk, head), K walked in BK tiles; the partial gradients of
:mod:`fla.ops.common.chunk_dplr_bwd_local` are added and dq, dk, da, db written
(float32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fla.ops.common.chunk_dplr_fwd_intra import SUB, load_sub_block, sub_block_gates
from fla.ops.utils.index import locate_chunk
from fla.ops.utils.tiles import tile_width
from fla.utils.triton_facts import dot_precision
from fla.utils.tuning import Config, tuned

__all__ = ["chunk_dplr_bwd_intra"]


def _default(args) -> Config:
    return Config(BK=tile_width(args["K"], 64), num_warps=4, num_stages=2)


def _space(args) -> list[Config]:
    widths = sorted({tile_width(args["K"], bk) for bk in (32, 64, 128)})
    return [Config(BK=bk, num_warps=w, num_stages=s) for bk in widths for w in (2, 4, 8)
            for s in (1, 2)]


@triton.jit
def _pair(x, gx, y, gy, ref, dA, PRECISION: tl.constexpr):
    """(dx, dy) of one sub-block pair, referenced at ``ref``."""
    ex = tl.exp(gx - ref[None, :])
    ey = tl.exp(ref[None, :] - gy)
    dx = tl.dot(dA, y * ey, input_precision=PRECISION) * ex
    dy = tl.dot(tl.trans(dA), x * ex, input_precision=PRECISION) * ey
    return dx, dy


@triton.jit
def _load_dA(dA, ra, H: tl.constexpr, BT: tl.constexpr, o_r, m_r, col0):
    p = dA + ra + o_r[:, None].to(tl.int64) * (H * BT) + col0 + o_r[None, :]
    return tl.load(p, mask=m_r[:, None], other=0.0)


@triton.jit
def _add_store(x, dx, row0, H: tl.constexpr, K: tl.constexpr, o_r, m_r, o_k, m_k, value):
    p = row0 + o_r[:, None].to(tl.int64) * (H * K) + o_k[None, :]
    m = m_r[:, None] & m_k[None, :]
    tl.store(x + p, tl.load(dx + p, mask=m, other=0.0) + value, mask=m)


@tuned(key=["K", "q", "PRECISION"], default=_default, space=_space)
@triton.jit(do_not_specialize=["T"])
def chunk_dplr_bwd_intra_kernel(
    q, k, a, b, gk, dAqk, dAqb, dAak, dAab, dq, dk, da, db, cu_seqlens, chunk_indices, T,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, SUB: tl.constexpr,
    BK: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_t, bos, T = locate_chunk(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    o_r = tl.arange(0, SUB)
    m_r0 = i_t * BT + o_r < T
    m_r1 = i_t * BT + SUB + o_r < T
    tok = bos + i_t * BT
    row0 = (tok * H + i_h) * K
    row1 = row0 + SUB * H * K
    ra0 = (tok * H + i_h) * BT
    ra1 = ra0 + SUB * H * BT
    # The three non-zero sub-blocks (00, 10, 11) of each matrix's gradient.
    qk00 = _load_dA(dAqk, ra0, H, BT, o_r, m_r0, 0)
    qk10 = _load_dA(dAqk, ra1, H, BT, o_r, m_r1, 0)
    qk11 = _load_dA(dAqk, ra1, H, BT, o_r, m_r1, SUB)
    qb00 = _load_dA(dAqb, ra0, H, BT, o_r, m_r0, 0)
    qb10 = _load_dA(dAqb, ra1, H, BT, o_r, m_r1, 0)
    qb11 = _load_dA(dAqb, ra1, H, BT, o_r, m_r1, SUB)
    ak00 = _load_dA(dAak, ra0, H, BT, o_r, m_r0, 0)
    ak10 = _load_dA(dAak, ra1, H, BT, o_r, m_r1, 0)
    ak11 = _load_dA(dAak, ra1, H, BT, o_r, m_r1, SUB)
    ab00 = _load_dA(dAab, ra0, H, BT, o_r, m_r0, 0)
    ab10 = _load_dA(dAab, ra1, H, BT, o_r, m_r1, 0)
    ab11 = _load_dA(dAab, ra1, H, BT, o_r, m_r1, SUB)
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
        # q·k and q·b
        dq0, dk0 = _pair(q0, c0, k0, c0, r15, qk00, PRECISION)
        dq1, dk0_ = _pair(q1, c1, k0, c0, r31, qk10, PRECISION)
        dq1_, dk1 = _pair(q1, c1, k1, c1, r47, qk11, PRECISION)
        dk0 += dk0_
        dq1 += dq1_
        x0, db0 = _pair(q0, c0, b0, c0, r15, qb00, PRECISION)
        dq0 += x0
        x1, db0_ = _pair(q1, c1, b0, c0, r31, qb10, PRECISION)
        dq1 += x1
        x1, db1 = _pair(q1, c1, b1, c1, r47, qb11, PRECISION)
        dq1 += x1
        db0 += db0_
        # a·k and a·b
        da0, y0 = _pair(a0, e0, k0, c0, r15, ak00, PRECISION)
        dk0 += y0
        da1, y0 = _pair(a1, e1, k0, c0, r31, ak10, PRECISION)
        dk0 += y0
        x1, y1 = _pair(a1, e1, k1, c1, r47, ak11, PRECISION)
        da1 += x1
        dk1 += y1
        x0, y0 = _pair(a0, e0, b0, c0, r15, ab00, PRECISION)
        da0 += x0
        db0 += y0
        x1, y0 = _pair(a1, e1, b0, c0, r31, ab10, PRECISION)
        da1 += x1
        db0 += y0
        x1, y1 = _pair(a1, e1, b1, c1, r47, ab11, PRECISION)
        da1 += x1
        db1 += y1
        _add_store(dq, dq, row0, H, K, o_r, m_r0, o_k, m_k, dq0)
        _add_store(dq, dq, row1, H, K, o_r, m_r1, o_k, m_k, dq1)
        _add_store(dk, dk, row0, H, K, o_r, m_r0, o_k, m_k, dk0)
        _add_store(dk, dk, row1, H, K, o_r, m_r1, o_k, m_k, dk1)
        _add_store(da, da, row0, H, K, o_r, m_r0, o_k, m_k, da0)
        _add_store(da, da, row1, H, K, o_r, m_r1, o_k, m_k, da1)
        _add_store(db, db, row0, H, K, o_r, m_r0, o_k, m_k, db0)
        _add_store(db, db, row1, H, K, o_r, m_r1, o_k, m_k, db1)


def chunk_dplr_bwd_intra(q, k, a, b, gk, dA, grads, cu_seqlens=None, chunk_indices=None,
                         chunk_size=64):
    """Adds the score-matrix gradients ``dA = (dA_qk, dA_qb, dA_ak, dA_ab)`` into the
    float32 partial gradients ``grads = [dq, dk, da, db]`` (in place); returns them."""
    B, T, H, K = q.shape
    NT = triton.cdiv(T, chunk_size) if cu_seqlens is None else chunk_indices.shape[0]
    chunk_dplr_bwd_intra_kernel[(NT, B * H)](
        q, k, a, b, gk, *dA, *grads, cu_seqlens, chunk_indices, T, H=H, K=K, BT=chunk_size,
        SUB=SUB, IS_VARLEN=cu_seqlens is not None,
        PRECISION=dot_precision(torch.float32 if q.dtype == torch.float32 else torch.float16))
    return grads
