"""DPLR delta rule, intra-chunk stage: the four C×C score matrices of each chunk.

Per chunk of BT = 64 tokens and head, with γ the chunk-local cumulative gate (a
K-vector per token) and γ⁻_t = γ_t − gk_t::

    A_qk[t,s] =  Σ_k q_tk k_sk e^{γ_tk − γ_sk}     s ≤ t
    A_qb[t,s] =  Σ_k q_tk b_sk e^{γ_tk − γ_sk}     s ≤ t
    A_ak[t,s] =  Σ_k a_tk k_sk e^{γ⁻_tk − γ_sk}    s < t
    A_nab[t,s] = −Σ_k a_tk b_sk e^{γ⁻_tk − γ_sk}   s < t   (so that solve_tril's
                                                            (I + A_nab)⁻¹ = (I − A_ab)⁻¹)

Layout of the work: one program per (32-row half of a chunk, head) computes the rows of
its half of all four matrices. Every product is a ``tl.dot`` of gate-referenced
operands x̂ = x ⊙ e^{gx − r}, ŷ = y ⊙ e^{r − γ} (so x̂ ŷᵀ = Σ_k x y e^{gx − γ}), with
the reference r (a K-vector, a cumulative gate at one token) chosen per block:

* the off-diagonal block (rows 32..63, columns 0..31): r = γ_31; both exponents ≤ 0;
* each diagonal 32×32 block as two dots: rows 0..31 × columns 0..15 of the block at
  r = γ of its token 7, and rows 16..31 × columns 16..31 at r = γ of its token 23
  (the other rows/columns of each dot are masked to zero before the exponential). An
  exponent is positive only inside a 16-token sub-block, by at most 8 steps of gate
  (e^{4.9} at RWKV7's w ≥ −e^{−0.5}: finite in fp16; in bf16/fp32 for gates down to
  about −11 per step). exp(±γ) over a whole chunk is never formed.

Dot operands: bf16 for bf16 inputs (fp32 accumulation); fp32 otherwise, at tf32 for fp16
inputs (an operand's positive exponent, up to 8 steps of gate, leaves fp16's range past
about −1.4 a step, inside the ops' documented gates) and at full precision for fp32.
K is walked in BK-wide tiles. Each stored row has 64 entries (float32), zeros above the
diagonal.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fla.ops.utils.index import locate_chunk, prepare_chunk_indices
from fla.ops.utils.tiles import tile_width
from fla.utils.grid import cdiv
from fla.utils.triton_facts import dot_precision
from fla.utils.tuning import Config, tuned

__all__ = ["chunk_dplr_fwd_intra", "CHUNK_SIZE", "row_of", "load_rows", "half_gates",
           "diag_factor_pair", "diag_factors", "dot_precision_of", "dot_args"]

CHUNK_SIZE = 64
HALF = 32


def dot_precision_of(dtype: torch.dtype) -> str:
    """``input_precision`` of the stages' dots for inputs of ``dtype``."""
    return dot_precision(torch.float32 if dtype == torch.float32 else torch.float16)


_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def dot_args(dtype: torch.dtype, wide: bool = False) -> dict:
    """``DT`` (the operand dtype of the stages' dots) and ``PRECISION`` for inputs of
    ``dtype``: fp32 inputs keep fp32 operands at full accuracy; 16-bit inputs give
    operands in their dtype, or (``wide``) fp32 operands at tf32."""
    if dtype != torch.float32 and wide:
        return dict(DT=tl.float32, PRECISION="tf32")
    return dict(DT=_TL[dtype], PRECISION=dot_precision_of(dtype))


@triton.jit
def row_of(x, o_r, r):
    """Row ``r`` of the register tile ``x`` (rows indexed by ``o_r``) as a vector."""
    return tl.sum(tl.where(o_r[:, None] == r, x, 0.0), axis=0)


@triton.jit
def load_rows(x, row0, H: tl.constexpr, K: tl.constexpr, o_r, m_r, o_k, m_k):
    """A [len(o_r), BK] float32 tile of a [.., H, K] token tensor from token-row offset
    ``row0`` (int64, the head's element of the first row); masked entries read 0."""
    p = x + row0 + o_r[:, None].to(tl.int64) * (H * K) + o_k[None, :]
    return tl.load(p, mask=m_r[:, None] & m_k[None, :], other=0.0).to(tl.float32)


@triton.jit
def half_gates(gk, row0, H: tl.constexpr, K: tl.constexpr, o_r, m_lo, m_hi, o_k, m_k,
               HALF: tl.constexpr):
    """Gates of a chunk's two 32-row halves: (gk_lo, γ_lo, gk_hi, γ_hi, γ_31), γ the
    inclusive chunk-local cumulative gate (padded rows read gk = 0)."""
    g_lo = load_rows(gk, row0, H, K, o_r, m_lo, o_k, m_k)
    g_hi = load_rows(gk, row0 + HALF * H * K, H, K, o_r, m_hi, o_k, m_k)
    c_lo = tl.cumsum(g_lo, axis=0)
    r31 = row_of(c_lo, o_r, HALF - 1)
    c_hi = tl.cumsum(g_hi, axis=0) + r31[None, :]
    return g_lo, c_lo, g_hi, c_hi, r31


@triton.jit
def diag_factor_pair(c, o_r, HALF: tl.constexpr, SECOND: tl.constexpr):
    """Exponential factors ``(ex, ey)`` of one of a 32×32 diagonal block's two dots (see
    the module docstring): the first (``SECOND`` false) at r = γ of row 7, ex on every
    row and ey zero on rows 16..31; the second at r = γ of row 23, both zero on rows
    0..15. ex = e^{γ − r}, ey = e^{r − γ}; the factor for γ⁻ = γ − gk is ex · e^{−gk}
    (one step of gate)."""
    Q: tl.constexpr = HALF // 4
    lo = (o_r < 2 * Q)[:, None]
    if SECOND:
        r = row_of(c, o_r, 3 * Q - 1)
        ex = tl.where(lo, 0.0, tl.exp(tl.where(lo, 0.0, c - r[None, :])))
        ey = tl.where(lo, 0.0, tl.exp(r[None, :] - c))
    else:
        r = row_of(c, o_r, Q - 1)
        ex = tl.exp(c - r[None, :])
        ey = tl.where(lo, tl.exp(tl.where(lo, r[None, :] - c, 0.0)), 0.0)
    return ex, ey


@triton.jit
def diag_factors(c, o_r, HALF: tl.constexpr):
    """Both dots' factors of one 32×32 diagonal block: (ex_a, ex_b, ey_a, ey_b), see
    :func:`diag_factor_pair`."""
    ex_a, ey_a = diag_factor_pair(c, o_r, HALF, False)
    ex_b, ey_b = diag_factor_pair(c, o_r, HALF, True)
    return ex_a, ex_b, ey_a, ey_b


@triton.jit
def _dot_t(x, y, DT: tl.constexpr, PRECISION: tl.constexpr):
    """x yᵀ with both operands cast to DT."""
    return tl.dot(x.to(DT), tl.trans(y.to(DT)), input_precision=PRECISION)


@triton.jit
def _four(xq, xa, yk, yb, DT: tl.constexpr, PRECISION: tl.constexpr):
    """(xq ykᵀ, xq ybᵀ, xa ykᵀ, xa ybᵀ)."""
    return (_dot_t(xq, yk, DT, PRECISION), _dot_t(xq, yb, DT, PRECISION),
            _dot_t(xa, yk, DT, PRECISION), _dot_t(xa, yb, DT, PRECISION))


def _default(args) -> Config:
    # H100 (Triton 3.6, bf16, RWKV7 4x4096x32x64): 0.96 ms at BK = 32, 4 warps, 2 stages
    # (2026-11-23, v2), 1.42 ms at BK = 64, 8 warps, one stage (2026-11-26), the config
    # chosen offline in between for having no spills (one program an SM). Re-timed
    # 2026-11-26 08:40 UTC: 0.98 ms. The space timed (11:45 UTC): at K = 64 one K tile,
    # BK = 64 at 4 warps, 0.826 ms (two stages 0.827; BK = 32 0.979); K = 128 keeps
    # BK = 32 (not timed there). With bf16 operands (H200, 2026-11-28, the space timed):
    # at K = 64 BK = 64 stays best (0.544 ms; two stages 0.540, BK = 32 0.74-0.79, 8 warps
    # 1.03-1.25); at K = 128 (4x4096x16x128) one 128-wide tile, 0.552 ms against 0.708 at
    # BK = 32 (BK = 64 0.583, 8 warps 0.79-1.12), though offline it keeps 728 B of stack
    # a thread (255 registers). fp32 operands (fp16, fp32 inputs) keep the rule timed
    # with them; above K = 128 nothing was timed with either.
    K = args["K"]
    if args["DT"] == tl.bfloat16 and K <= 128:
        return Config(BK=tile_width(K, 128), num_warps=4, num_stages=1)
    return Config(BK=tile_width(K, 64 if K <= 64 else 32), num_warps=4, num_stages=1)


def _space(args) -> list[Config]:
    widths = sorted({tile_width(args["K"], bk) for bk in (32, 64, 128)})
    return [Config(BK=bk, num_warps=w, num_stages=s) for bk in widths for w in (4, 8)
            for s in (1, 2)]


@tuned(key=["K", "q", "DT", "PRECISION"], default=_default, space=_space)
@triton.jit(do_not_specialize=["T"])
def chunk_dplr_fwd_intra_kernel(
    q, k, a, b, gk, Aqk, Aqb, Aak, Anab, cu_seqlens, chunk_indices, T,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, HALF: tl.constexpr,
    BK: tl.constexpr, IS_VARLEN: tl.constexpr, DT: tl.constexpr, PRECISION: tl.constexpr,
):
    i_th, i_bh = tl.program_id(0), tl.program_id(1)
    i_t, i_half = i_th // 2, i_th % 2
    i_b, i_h = i_bh // H, i_bh % H
    i_t, bos, T = locate_chunk(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    o_r = tl.arange(0, HALF)
    m_lo = i_t * BT + o_r < T
    m_hi = i_t * BT + HALF + o_r < T
    m_me = i_t * BT + i_half * HALF + o_r < T
    row0 = ((bos + i_t * BT) * H + i_h) * K       # int64: first element of the chunk
    row_me = row0 + i_half * HALF * H * K

    zero = tl.zeros([HALF, HALF], dtype=tl.float32)
    qk_d, qb_d, ak_d, ab_d = zero, zero, zero, zero
    qk_o, qb_o, ak_o, ab_o = zero, zero, zero, zero
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        g_lo, c_lo, g_hi, c_hi, r31 = half_gates(gk, row0, H, K, o_r, m_lo, m_hi, o_k, m_k,
                                                 HALF)
        if i_half == 0:
            c, g = c_lo, g_lo
        else:
            c, g = c_hi, g_hi
        x_q = load_rows(q, row_me, H, K, o_r, m_me, o_k, m_k)
        x_a = load_rows(a, row_me, H, K, o_r, m_me, o_k, m_k) * tl.exp(-g)
        y_k = load_rows(k, row_me, H, K, o_r, m_me, o_k, m_k)
        y_b = load_rows(b, row_me, H, K, o_r, m_me, o_k, m_k)
        ex_a, ex_b, ey_a, ey_b = diag_factors(c, o_r, HALF)
        # The diagonal block's two dots, one after the other (fewer live tiles).
        d_qk, d_qb, d_ak, d_ab = _four(x_q * ex_a, x_a * ex_a, y_k * ey_a, y_b * ey_a,
                                       DT, PRECISION)
        qk_d += d_qk
        qb_d += d_qb
        ak_d += d_ak
        ab_d += d_ab
        d_qk, d_qb, d_ak, d_ab = _four(x_q * ex_b, x_a * ex_b, y_k * ey_b, y_b * ey_b,
                                       DT, PRECISION)
        qk_d += d_qk
        qb_d += d_qb
        ak_d += d_ak
        ab_d += d_ab
        if i_half == 1:
            # Rows 32..63 × columns 0..31 through γ_31: both exponents ≤ 0.
            ex = tl.exp(c_hi - r31[None, :])
            ey = tl.exp(r31[None, :] - c_lo)
            ko = load_rows(k, row0, H, K, o_r, m_lo, o_k, m_k) * ey
            bo = load_rows(b, row0, H, K, o_r, m_lo, o_k, m_k) * ey
            d_qk, d_qb, d_ak, d_ab = _four(x_q * ex, x_a * ex, ko, bo, DT, PRECISION)
            qk_o += d_qk
            qb_o += d_qb
            ak_o += d_ak
            ab_o += d_ab

    # Row t of a chunk's matrix lives at token t: [.., H, BT] rows, 64 columns. This
    # half's rows: the diagonal block at column i_half·32, the other 32 columns hold
    # the off-diagonal block (half 1) or zeros (half 0).
    p = (((bos + i_t * BT + i_half * HALF + o_r[:, None]).to(tl.int64) * H + i_h) * BT
         + o_r[None, :])
    p_d = p + i_half * HALF
    p_o = p + (1 - i_half) * HALF
    m = m_me[:, None]
    causal = o_r[:, None] >= o_r[None, :]
    strict = o_r[:, None] > o_r[None, :]
    tl.store(Aqk + p_d, tl.where(causal, qk_d, 0.0), mask=m)
    tl.store(Aqb + p_d, tl.where(causal, qb_d, 0.0), mask=m)
    tl.store(Aak + p_d, tl.where(strict, ak_d, 0.0), mask=m)
    tl.store(Anab + p_d, tl.where(strict, -ab_d, 0.0), mask=m)
    tl.store(Aqk + p_o, qk_o, mask=m)
    tl.store(Aqb + p_o, qb_o, mask=m)
    tl.store(Aak + p_o, ak_o, mask=m)
    tl.store(Anab + p_o, -ab_o, mask=m)


def chunk_dplr_fwd_intra(q, k, a, b, gk, cu_seqlens=None, chunk_indices=None):
    """``(A_qk, A_qb, A_ak, A_nab)``, each ``[B, T, H, 64]`` float32 (see the module
    docstring), from time-major contiguous ``[B, T, H, K]`` inputs."""
    B, T, H, K = q.shape
    if cu_seqlens is not None and chunk_indices is None:
        chunk_indices = prepare_chunk_indices(cu_seqlens, CHUNK_SIZE)
    NT = cdiv(T, CHUNK_SIZE) if cu_seqlens is None else chunk_indices.shape[0]
    out = [torch.empty(B, T, H, CHUNK_SIZE, dtype=torch.float32, device=q.device)
           for _ in range(4)]
    chunk_dplr_fwd_intra_kernel[(2 * NT, B * H)](
        q, k, a, b, gk, *out, cu_seqlens, chunk_indices, T, H=H, K=K, BT=CHUNK_SIZE,
        HALF=HALF, IS_VARLEN=cu_seqlens is not None,
        # bf16 operands (H200, RWKV7 4x4096x32x64, 2026-11-28): 849 -> 544 µs against
        # tf32, no stack (offline: 239 registers against 255 and 344 B); the float64
        # loop's errors at that shape o 2.0e-3 -> 2.8e-3, da 3.2e-3 -> 3.6e-3.
        **dot_args(q.dtype, wide=q.dtype != torch.bfloat16))
    return tuple(out)
