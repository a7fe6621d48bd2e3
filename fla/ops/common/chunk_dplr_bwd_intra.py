"""DPLR delta rule, backward through the four intra-chunk score matrices, and the gate's
gradient.

For each matrix A[t,s] = Σ_k x_tk y_sk e^{gx_tk − gy_sk} of
:mod:`fla.ops.common.chunk_dplr_fwd_intra` (q·k, q·b with gx = γ; a·k, a·b with
gx = γ⁻; gy = γ) and its gradient dA::

    dx_t += Σ_s dA[t,s] y_s e^{gx_t − gy_s}      dy_s += Σ_t dA[t,s] x_t e^{gx_t − gy_s}

through the same gate-referenced factors as the forward (the diagonal 32×32 blocks as
two dots referenced at tokens 7 and 23 of the block, the off-diagonal block at γ_31):
every product a ``tl.dot`` with fp32 accumulation, its operands in bf16 for bf16 inputs,
in fp32 at tf32 for fp16 inputs (a gated operand's exponent reaches past fp16's range
at the steepest documented gates) and at full precision for fp32 inputs.

The gate's gradient below sums x⊙dx − y⊙dy over tokens, in which the products of every
pair (t, s) inside the summed range cancel: only the pairs straddling it remain. With
rounded operands, x_t ⊙ dx_t and y_s ⊙ dy_s would each carry the other side's rounding
of the pair, and the cancelled mass its error (dgk 1.1e-2 against float64 with bf16
operands, over the 5e-3 bound). So with 16-bit operands each side forms its intra-chunk
terms from the products of the rounded operands exactly as the other side's dot takes
them, Σ_p x̂⁽ᵖ⁾ ⊙ (dA ŷ⁽ᵖ⁾) with x̂⁽ᵖ⁾ = x ⊙ e^{γ − r_p} rounded, so that every pair
cancels to fp32 accumulation (dgk 3.2e-3, RWKV7-like inputs, the interpreter with
bf16 dots and rounding emulated).

One program per (chunk, head, BK columns of K); the partial gradients of
:mod:`fla.ops.common.chunk_dplr_bwd_local` are added, and with the complete fp32
gradients the gate's gradient is formed before anything is rounded
(:mod:`fla.ops.generalized_delta_rule.gate_grad` derives it), chunk-locally::

    dgk_s = Σ_{t ≥ s, t in the chunk} (q⊙dq − b⊙db − k⊙dk + a⊙da)_t − (a⊙da)_s + off

with ``off`` = Σ_v dS' ⊙ S' of the state leaving the chunk (from ``chunk_dplr_bwd_local``).
The reverse sum runs over at most 64 tokens in fp32: nothing accumulates across chunks.
dq, dk, da, db and dgk are written in their inputs' dtypes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fla.ops.common.chunk_dplr_fwd_intra import (
    CHUNK_SIZE,
    HALF,
    diag_factor_pair,
    dot_args,
    half_gates,
    load_rows,
)
from fla.ops.utils.index import locate_sequence_chunk, prepare_chunk_offsets
from fla.ops.utils.tiles import tile_width
from fla.utils.grid import cdiv
from fla.utils.tuning import Config, tuned

__all__ = ["chunk_dplr_bwd_intra"]


def _default(args) -> Config:
    # H100, Triton 3.6, bf16, RWKV7 4x4096x32x64, the space timed (2026-11-26, after the
    # halves were reordered to hold fewer tiles): BK = 64 at 8 warps 2.47 ms (one or two
    # stages), BK = 32 at 4 warps 3.16, BK = 64 at 4 warps 3.72, BK = 32 at 8 warps 4.80.
    # Before the reordering BK = 32 at 4 warps was the best config, at 5.2 ms.
    return Config(BK=tile_width(args["K"], 64), num_warps=8, num_stages=2)


def _space(args) -> list[Config]:
    widths = sorted({tile_width(args["K"], bk) for bk in (32, 64)})
    return [Config(BK=bk, num_warps=w, num_stages=s) for bk in widths for w in (4, 8)
            for s in (1, 2)]


@triton.jit
def _mm(x, y, DT: tl.constexpr, PRECISION: tl.constexpr):
    return tl.dot(x.to(DT), y.to(DT), input_precision=PRECISION)


@triton.jit
def _pair(m11, m12, m21, m22, u, w, DT: tl.constexpr, PRECISION: tl.constexpr):
    """``(m11 u + m12 w, m21 u + m22 w)``: two gradients through four score blocks sharing
    their operands, before their output factor."""
    return (_mm(m11, u, DT, PRECISION) + _mm(m12, w, DT, PRECISION),
            _mm(m21, u, DT, PRECISION) + _mm(m22, w, DT, PRECISION))


@triton.jit
def _as_operand(x, DT: tl.constexpr):
    """``x`` rounded as :func:`_mm` rounds its operands (to DT), back in fp32."""
    return x.to(DT).to(tl.float32)


@triton.jit
def _diag_side(m11, m12, m21, m22, u, w, x1, x2, c, o_r, HALF: tl.constexpr,
               ROWS: tl.constexpr, DT: tl.constexpr, PRECISION: tl.constexpr):
    """One side's gradients through a diagonal block, summed over its two dots:
    ``o1 = Σ (m11 û + m12 ŵ) ⊙ f_out``, ``o2 = Σ (m21 û + m22 ŵ) ⊙ f_out``, û = u ⊙ f_in,
    ŵ = w ⊙ f_in; and this side's terms of the gate's gradient, ``s1 = Σ x̂1 ⊙ (m11 û +
    m12 ŵ)``, ``s2 = Σ x̂2 ⊙ (m21 û + m22 ŵ)``, x̂ = x ⊙ f_out rounded as the other side's
    operand is (see the module docstring; the column side returns s1 + s2 as s1, and
    neither with fp32 operands). Row side (``ROWS``): the dA blocks (qk, qb,
    ak, ab), u, w = k, b, x1, x2 = q, a e^{−gk}, f_in = ey, f_out = ex: the (dq,
    d(a e^{−gk})) contributions Σ_s dA[t,s] y_s e^{γ_t − γ_s}. Column side: the
    transposed blocks (qk, ak, qb, ab), u, w = q, a e^{−gk}, x1, x2 = k, b, f_in = ex,
    f_out = ey: the (dk, db) contributions Σ_t dA[t,s] x_t e^{γ_t − γ_s}."""
    o1 = tl.zeros_like(u)
    o2 = tl.zeros_like(u)
    s1 = tl.zeros_like(u)
    s2 = tl.zeros_like(u)
    for part in tl.static_range(2):
        ex, ey = diag_factor_pair(c, o_r, HALF, part == 1)
        if ROWS:
            f_in, f_out = ey, ex
        else:
            f_in, f_out = ex, ey
        g1, g2 = _pair(m11, m12, m21, m22, u * f_in, w * f_in, DT, PRECISION)
        o1 += g1 * f_out
        o2 += g2 * f_out
        if DT != tl.float32:   # (fp32 operands: the caller forms x ⊙ o instead)
            if ROWS:
                s1 += _as_operand(x1 * f_out, DT) * g1
                s2 += _as_operand(x2 * f_out, DT) * g2
            else:   # one sum: the caller needs only s1 + s2
                s1 += _as_operand(x1 * f_out, DT) * g1 + _as_operand(x2 * f_out, DT) * g2
    return o1, o2, s1, s2


@triton.jit
def _load_block(dA, row0, H: tl.constexpr, BT: tl.constexpr, o_r, m_r, col0):
    """A [32, 32] block of a [.., H, BT] matrix from token-row offset ``row0``."""
    p = dA + row0 + o_r[:, None].to(tl.int64) * (H * BT) + col0 + o_r[None, :]
    return tl.load(p, mask=m_r[:, None], other=0.0)


@triton.jit
def _load_block_t(dA, row0, H: tl.constexpr, BT: tl.constexpr, o_r, m_r, col0):
    """The transpose of :func:`_load_block`'s block, read transposed from memory: the
    column-side products take it as a plain operand (a register transpose of the block
    loaded once for both sides went through shared memory and spilled)."""
    p = dA + row0 + o_r[None, :].to(tl.int64) * (H * BT) + col0 + o_r[:, None]
    return tl.load(p, mask=m_r[None, :], other=0.0)


@triton.jit
def _blocks(dAqk, dAqb, dAak, dAab, row0, H: tl.constexpr, BT: tl.constexpr, o_r, m_r,
            col0, COLUMNS: tl.constexpr):
    """The four dA blocks at (row0, col0) as :func:`_pair` takes them: for the row side
    (qk, qb, ak, ab); for the column side (``COLUMNS``) their transposes, read so, in the
    order (qk, ak, qb, ab)."""
    if COLUMNS:
        return (_load_block_t(dAqk, row0, H, BT, o_r, m_r, col0),
                _load_block_t(dAak, row0, H, BT, o_r, m_r, col0),
                _load_block_t(dAqb, row0, H, BT, o_r, m_r, col0),
                _load_block_t(dAab, row0, H, BT, o_r, m_r, col0))
    return (_load_block(dAqk, row0, H, BT, o_r, m_r, col0),
            _load_block(dAqb, row0, H, BT, o_r, m_r, col0),
            _load_block(dAak, row0, H, BT, o_r, m_r, col0),
            _load_block(dAab, row0, H, BT, o_r, m_r, col0))


@triton.jit
def _finish(x, dx_part, dx, row, H: tl.constexpr, K: tl.constexpr, o_r, m_r, o_k, m_k):
    """Add the partial gradient, store the sum in dx's dtype; returns the partial."""
    p = row + o_r[:, None].to(tl.int64) * (H * K) + o_k[None, :]
    m = m_r[:, None] & m_k[None, :]
    part = tl.load(dx_part + p, mask=m, other=0.0)
    tl.store(dx + p, (x + part).to(dx.dtype.element_ty), mask=m)
    return part


@tuned(key=["K", "q", "DT", "PRECISION"], default=_default, space=_space)
@triton.jit(do_not_specialize=["T"])
def chunk_dplr_bwd_intra_kernel(
    q, k, a, b, gk, dAqk, dAqb, dAak, dAab, pq, pk, pa, pb, off, dq, dk, da, db, dgk,
    cu_seqlens, chunk_indices, chunk_offsets, T,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, HALF: tl.constexpr,
    BK: tl.constexpr, IS_VARLEN: tl.constexpr, DT: tl.constexpr, PRECISION: tl.constexpr,
):
    i_c, i_bh, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    i_n, i_t, bos, T = locate_sequence_chunk(i_c, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    if IS_VARLEN:
        chunk = tl.load(chunk_offsets + i_n).to(tl.int64) + i_t
    else:
        chunk = i_b.to(tl.int64) * tl.cdiv(T, BT) + i_t
    o_r = tl.arange(0, HALF)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_lo = i_t * BT + o_r < T
    m_hi = i_t * BT + HALF + o_r < T
    tok = bos + i_t * BT
    r_lo = (tok * H + i_h) * K
    r_hi = r_lo + HALF * H * K
    ra_lo = (tok * H + i_h) * BT
    ra_hi = ra_lo + HALF * H * BT

    g_lo, c_lo, g_hi, c_hi, r31 = half_gates(gk, r_lo, H, K, o_r, m_lo, m_hi, o_k, m_k, HALF)
    b_off = tl.load(off + (chunk * H + i_h) * K + o_k, mask=m_k, other=0.0)
    # Each half (the upper first: its column sums carry into the reverse sum of the
    # lower) forms its rows' dq and da, then their dk and db, so that two gradient
    # accumulators are live at a time, and nothing but the lower half's gates and the
    # upper half's gated queries passes from one half to the other. The off-diagonal
    # block (rows 32..63 x columns 0..31, referenced at γ_31: exponents ≤ 0) adds to
    # the upper half's dq, da and to the lower half's dk, db, each where it is used.
    # (All four formed up front, and both dots' factors at once: 1.9 KB a thread of
    # stack at 4 warps, offline sm_90.)
    carry = tl.zeros([BK], dtype=tl.float32)
    for i in tl.static_range(2):
        if i == 0:
            c, m_r, row, ra, col = c_hi, m_hi, r_hi, ra_hi, HALF
            e_g = tl.exp(-g_hi)
        else:
            # The lower half's gates again (cheaper than holding them through the upper's).
            g_lo = load_rows(gk, r_lo, H, K, o_r, m_lo, o_k, m_k)
            c_lo = tl.cumsum(g_lo, axis=0)
            c, m_r, row, ra, col = c_lo, m_lo, r_lo, ra_lo, 0
            e_g = tl.exp(-g_lo)
        b11, b12, b21, b22 = _blocks(dAqk, dAqb, dAak, dAab, ra, H, BT, o_r, m_r, col, False)
        y_k = load_rows(k, row, H, K, o_r, m_r, o_k, m_k)
        y_b = load_rows(b, row, H, K, o_r, m_r, o_k, m_k)
        x_q = load_rows(q, row, H, K, o_r, m_r, o_k, m_k)
        x_a = load_rows(a, row, H, K, o_r, m_r, o_k, m_k)
        x_ag = x_a * e_g
        dx_q, dx_a, s_q, s_a = _diag_side(b11, b12, b21, b22, y_k, y_b, x_q, x_ag, c, o_r,
                                          HALF, True, DT, PRECISION)
        if i == 0:
            # Rows 32..63 through the lower half's keys; their gated queries kept for
            # the lower half's keys.
            ex_o = tl.exp(c_hi - r31[None, :])
            ey_o = tl.exp(r31[None, :] - c_lo)
            ko = load_rows(k, r_lo, H, K, o_r, m_lo, o_k, m_k) * ey_o
            bo = load_rows(b, r_lo, H, K, o_r, m_lo, o_k, m_k) * ey_o
            b11, b12, b21, b22 = _blocks(dAqk, dAqb, dAak, dAab, ra_hi, H, BT, o_r, m_hi, 0,
                                         False)
            g_q, g_a = _pair(b11, b12, b21, b22, ko, bo, DT, PRECISION)
            qo = (x_q * ex_o).to(DT)
            ao = (x_ag * ex_o).to(DT)
            dx_q += g_q * ex_o
            dx_a += g_a * ex_o
            if DT != tl.float32:
                s_q += qo.to(tl.float32) * g_q
                s_a += ao.to(tl.float32) * g_a
        p_q = _finish(dx_q, pq, dq, row, H, K, o_r, m_r, o_k, m_k)
        p_a = _finish(dx_a * e_g, pa, da, row, H, K, o_r, m_r, o_k, m_k)
        # a ⊙ da and the rows' terms of the gate's gradient: with 16-bit operands the
        # intra-chunk part as the products of the rounded operands (s_q, s_a), the
        # partial gradients' (through the states) in fp32.
        if DT == tl.float32:
            ada = x_a * (dx_a * e_g + p_a)
            term = x_q * (dx_q + p_q) + ada
        else:
            ada = s_a + x_a * p_a
            term = s_q + x_q * p_q + ada

        b11, b12, b21, b22 = _blocks(dAqk, dAqb, dAak, dAab, ra, H, BT, o_r, m_r, col, True)
        dy_k, dy_b, s_ky, _ = _diag_side(b11, b12, b21, b22, x_q, x_ag, y_k, y_b, c, o_r,
                                         HALF, False, DT, PRECISION)
        if i == 1:
            # Rows 0..31 as keys of the upper half's queries (the same dA blocks again).
            ey_o = tl.exp(r31[None, :] - c_lo)
            b11, b12, b21, b22 = _blocks(dAqk, dAqb, dAak, dAab, ra_hi, H, BT, o_r, m_hi, 0,
                                         True)
            g_k, g_b = _pair(b11, b12, b21, b22, qo, ao, DT, PRECISION)
            dy_k += g_k * ey_o
            dy_b += g_b * ey_o
            if DT != tl.float32:
                s_ky += (_as_operand(y_k * ey_o, DT) * g_k
                         + _as_operand(y_b * ey_o, DT) * g_b)
        p_k = _finish(dy_k, pk, dk, row, H, K, o_r, m_r, o_k, m_k)
        p_b = _finish(dy_b, pb, db, row, H, K, o_r, m_r, o_k, m_k)
        if DT == tl.float32:
            term -= y_k * (dy_k + p_k) + y_b * (dy_b + p_b)
        else:
            term -= s_ky + y_k * p_k + y_b * p_b
        b_dg = tl.cumsum(term, axis=0, reverse=True) + (carry + b_off)[None, :] - ada
        carry += tl.sum(term, axis=0)
        p = row + o_r[:, None].to(tl.int64) * (H * K) + o_k[None, :]
        tl.store(dgk + p, b_dg.to(dgk.dtype.element_ty), mask=m_r[:, None] & m_k[None, :])


def chunk_dplr_bwd_intra(q, k, a, b, gk, dA, grads, off, out, cu_seqlens=None,
                         chunk_indices=None, offsets=None, chunk_size=CHUNK_SIZE):
    """From the score-matrix gradients ``dA = (dA_qk, dA_qb, dA_ak, dA_ab)``, the
    float32 partial gradients ``grads = [dq, dk, da, db]`` and the per-chunk gate term
    ``off [NT_total, H, K]`` (see :mod:`fla.ops.common.chunk_dplr_bwd_local`), write
    ``out = (dq, dk, da, db, dgk)`` (allocated by the caller in the final dtypes)."""
    B, T, H, K = q.shape
    NT = cdiv(T, chunk_size) if cu_seqlens is None else chunk_indices.shape[0]
    chunk_offsets = (None if cu_seqlens is None else
                     prepare_chunk_offsets(cu_seqlens, chunk_size, cu_seqlens_cpu=offsets))
    chunk_dplr_bwd_intra_kernel[lambda meta: (NT, B * H, cdiv(K, meta["BK"]))](
        q, k, a, b, gk, *dA, *grads, off, *out, cu_seqlens, chunk_indices, chunk_offsets, T,
        H=H, K=K, BT=chunk_size, HALF=HALF, IS_VARLEN=cu_seqlens is not None,
        **dot_args(q.dtype, wide=q.dtype != torch.bfloat16))
    return out
