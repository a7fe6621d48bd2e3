"""The chunked vector-gate forward (GLA and RWKV6, ALGORITHMS.md §3) in two kernels.

With g the per-token log gate ``[B, T, H, K]``, γ its chunk-local cumsum (64-token
chunks), γq the query side's gate (γ for GLA; the exclusive γ − g for RWKV6, whose query
reads the state before its token) and S = h[chunk] the state entering the chunk::

    A_ij = Σ_k q_ik k_jk exp(γq_ik − γ_jk)   j < i   (and j = i unless ``EXCLUSIVE``)
    A_ii = Σ_k q_ik u_k k_ik                 RWKV6's bonus (``EXCLUSIVE`` with u)
    O    = scale · [ (Q ⊙ exp(γq)) S + A V ]
    S'   = diag(exp(γ_C)) S + (K ⊙ exp(γ_C − γ))ᵀ V

``chunk_gk_fwd_A_kernel`` (one program per chunk and head) computes γ from g in
registers, writes it (the state pass and the backward read it) and A, and for the
forward's own pass the gated operands Q ⊙ e^{γq} and K ⊙ e^{γ_C − γ}: the sequential
pass ``chunk_gk_fwd_h_kernel`` (one program per V tile, head and sequence, the state
held transposed in registers) then runs no exponential (``GATED_OPERANDS``; without them
it gates q and k itself). No [T, K, V]-sized tensor is written on the way to O; the
backward's recomputation of the per-chunk states runs the same pass storing h
(``STORE_H``) instead of O.

Few long sequences leave that pass's grid thin (2x16384x16x128: 128 programs on 132 SMs,
each walking 256 chunks), so it may run split into segments of chunks (``SPLIT``), as
the gated delta rule's does (``fla.ops.common.chunk_fwd_inter``): over a segment the
update is S_out = diag(e^d) S_in + X with d = Σ γ_C over its chunks (a K-vector). The
transitions (X, d) of all segments in parallel (``TRANSITION``), a short serial combine
per sequence (``fla.ops.common.chunk_state_combine``, form "vector") giving each segment
its entering state, then o (or h) of all segments in parallel: the same kernel body each
time.

Numerics: γ reaches −5 · 64 = −320 inside a chunk (exp(320) overflows even fp32), so A
is built as tensor-core dots over factor-scaled q and k, with the identity (s_k any
shift of channel k, a reference row's γ_mk below)::

    q_ik k_jk exp(γq_ik − γ_jk) = [q_ik exp(γq_ik − s_k)] · [k_jk exp(s_k − γ_jk)]

in the cheapest of three forms whose exponents stay ≤ ``ONE_REFERENCE_MAX_SPAN`` (60):

- the chunk form (``_gk_fwd_A_chunk_form``): the whole chunk in one [64, K] x [K, 64]
  product, s_k the midpoint of the chunk's range of γ in channel k, so that its
  exponents are at most half that range (the span; mild gates, ≤ ~1.9 a step);
- one reference per 16-row strip (``_gk_fwd_A_strip_one_ref``, m = 16·S + 7): every key
  up to the strip's end meets the strip's queries in one [16, K] x [K, 16·S + 16]
  product, exponents bounded by the strip's span (γ over 7-8 steps: 40 at −5 a step);
- the halving (``_gk_fwd_A_strip``), whose exponents are all ≤ 0: pairs in different
  strips meet through m = 16·S − 1 (one [16, K] x [K, 16·S] product), pairs inside a
  strip at level b ∈ {16, 8, 4, 2} through the middle row of their b-row block (a
  [16, K] x [K, 16] product a level); always for fp16 inputs, whose range cannot hold
  e^60.

Two launches: the first, compiled with its form only, forms γ and every chunk its form
can take and marks the rest with the form they need, for good (the chunks the chunk form
refuses are sorted between the strips and the halving from γ there); then one follow-up,
compiled with the forms after the first's, in which each program reads its chunk's mark
and forms it as marked (most find none and exit at once). A forward that feeds no
backward starts from the chunk form (γ written at each chunk's last row only); one that
feeds a backward from the strips up to K = 128 (γ written in full, the chunk form
storing it lost there), above that from the chunk form writing γ in a pass of its own;
fp16 inputs take the halving alone, in one launch. The diagonal j = i is Σ_k q k (GLA:
exponent 0) or RWKV6's bonus. In every form a factor that underflows belongs to a
product below e^(span − 87); a reference row past the chunk's end is clamped to its
last row, and masked elements are zeroed before the exp.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fla.ops.common import chunk_segments
from fla.ops.common.chunk_fwd_inter import segment_of_program
from fla.ops.common.chunk_state_combine import combine_segment_states
from fla.ops.utils.index import first_chunk_row, locate_chunk
from fla.ops.utils.tiles import sixteen_bit, state_row_heights, tile_width
from fla.utils import triton_facts
from fla.utils.grid import cdiv, sequential_grid_fill
from fla.utils.triton_facts import dot_precision, warp_choices
from fla.utils.tuning import Config, tuned

__all__ = ["chunk_gk_fwd", "chunk_gk_fwd_A", "chunk_gk_fwd_h", "chunk_gk_fwd_A_kernel",
           "chunk_gk_fwd_h_kernel", "gk_default_segment_chunks", "CHUNK_SIZE"]

CHUNK_SIZE = 64
# The one-reference strips run where no exponent exceeds this: e^60 ≈ 1.1e26, so a factor
# times q or k stays inside bf16's and fp32's range (3.4e38) for |q|, |k| up to ~3e12.
# fp16 (65504) cannot hold such factors: fp16 inputs always take the halving.
ONE_REFERENCE_MAX_SPAN = tl.constexpr(60.)
# The forms of a chunk's scores, cheapest first (the scores kernel's FORM): one reference
# row for the whole chunk, one for each 16-row strip, the halving.
CHUNK_FORM, STRIP_FORM, HALVING_FORM = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
# A forward feeding a backward starts from the chunk form only above this K (it then
# writes γ in a pass of its own first): at K = 128 that lost to the strips (H100,
# 1x8192x96x128: 0.98 ms against 0.87); at K = 256 it won (H100, GLA 8x2048x32x256
# fwd+bwd 8.38 -> 8.26 ms, 2026-11-26).
CHUNK_FORM_WITH_GRADIENTS_ABOVE_K = 128


@triton.jit
def gk_level_factor(b_g, b_gq, g_b, o_t, o_k, m_k, L, HK, b: tl.constexpr):
    """Level ``b`` of the halving for the chunk rows ``o_t`` (all 64, or one 16-row
    strip with b ≤ 16): (second-half rows mask [R], e [R, BK]) with
    e_i = exp(γq_i − γ_m) for rows in a block's second half and exp(γ_m − γ_i) for
    rows in its first half, m the block's middle row (clamped to the last valid row;
    a first-half key whose m is past the end meets no valid query). ``g_b`` points at
    γ of the chunk's first row (row stride ``HK``); invalid rows give e = 0."""
    h: tl.constexpr = b // 2
    second = (o_t & h) != 0
    m = tl.minimum((o_t // b) * b + (h - 1), L - 1)
    m_tk = (o_t < L)[:, None] & m_k[None, :]
    b_gm = tl.load(g_b + m[:, None] * HK + o_k[None, :], mask=m_tk, other=0.)
    d = tl.where(second[:, None], b_gq - b_gm, b_gm - b_g)
    return second, tl.where(m_tk, tl.exp(tl.where(m_tk, d, 0.)), 0.)


@triton.jit
def gk_level_mask(o_t, b: tl.constexpr):
    """[R, R] pairs (i, j) of the rows ``o_t`` met at level b: same block, i in the
    second half, j in the first."""
    h: tl.constexpr = b // 2
    return (((o_t // b)[:, None] == (o_t // b)[None, :]) & ((o_t & h) != 0)[:, None]
            & ((o_t & h) == 0)[None, :])


def _A_default(args) -> Config:
    # The follow-up, its programs mostly reading one byte and exiting: BK = 32 in one
    # stage (H100, K = 256, the follow-ups' space timed: 0.010-0.014 ms against
    # 0.011-0.019 at the BK = 64 default; the same rule at K <= 128, not timed alone:
    # GLA's fwd+bwd at 1x8192x96x128 4.068 -> 4.070 ms with it, H200).
    if not args["FIRST"]:
        return Config(BK=tile_width(args["K"], 32), num_warps=4, num_stages=1)
    # H100, Triton 3.6, bf16, every config of the space timed (1x8192x96x128 and RWKV6's
    # 4x4096x16x128): BK = 64 with 4 warps the fastest or within 7% (8 warps 1.5-2.6x
    # slower: the strips' [16, BK] tiles spread thin over 256 threads). One stage for
    # the one-reference strips (1.055 / 0.420 ms against 1.062 / 0.485 at two); the
    # halving (fp16 inputs) writing the gated operands, two (1.47 against 1.76 ms).
    # The chunk form, its space timed (H100, K = 128, two stages the fastest for both):
    # GLA BK = 32 0.701 ms (BK = 64 0.713; 8 warps 1.07-1.61), RWKV6's exclusive scores
    # BK = 64 0.245 (BK = 32 0.312).
    if args["FORM"] == CHUNK_FORM.value:
        width = 64 if args["EXCLUSIVE"] else 32
        return Config(BK=tile_width(args["K"], width), num_warps=4, num_stages=2)
    two = args["GATE_OPERANDS"] and args["FORM"] == HALVING_FORM.value
    return Config(BK=tile_width(args["K"], 64), num_warps=4, num_stages=2 if two else 1)


def _A_space(args) -> list[Config]:
    return list(dict.fromkeys(
        Config(BK=tile_width(args["K"], bk), num_warps=w, num_stages=s)
        for bk in (32, 64) for w in (4, 8) for s in (1, 2)))


@triton.jit
def _gk_cross_keys(k_b, gc_b, b_gm, o_k, m_k, m, J0: tl.constexpr, NJ: tl.constexpr, HK):
    """[NJ, BK] k_j exp(γ_m − γ_j) for the keys j = J0 … J0 + NJ − 1, zero past row m
    (a valid row: the reference row clamped to the chunk's last)."""
    o_j = J0 + tl.arange(0, NJ)
    m_jk = (o_j <= m)[:, None] & m_k[None, :]
    o_jk = o_j[:, None] * HK + o_k[None, :]
    b_k = tl.load(k_b + o_jk, mask=m_jk, other=0.).to(tl.float32)
    b_g = tl.load(gc_b + o_jk, mask=m_jk, other=0.)
    b_e = tl.exp(tl.where(m_jk, b_gm[None, :] - b_g, 0.))
    return tl.where(m_jk, b_k * b_e, 0.).to(k_b.dtype.element_ty)


@triton.jit
def _gk_store_gated_operands(b_q, b_k, b_g, b_gq, b_gl, qg_b, kg_b, o_ik, m_ik):
    """The state pass's operands for the rows ``o_ik`` of one K tile (q, k fp32; γ, γq;
    ``b_gl`` [BK] γ_C, the chunk's last valid row): q ⊙ e^{γq} and k ⊙ e^{γ_C − γ}
    (exponents ≤ 0)."""
    dt = qg_b.dtype.element_ty
    tl.store(qg_b + o_ik, (b_q * tl.exp(b_gq)).to(dt), mask=m_ik)
    b_kg = b_k * tl.exp(tl.where(m_ik, b_gl[None, :] - b_g, 0.))
    tl.store(kg_b + o_ik, b_kg.to(dt), mask=m_ik)


@triton.jit
def _gk_diagonal(b_q, b_k, u_h, o_k, m_k, EXCLUSIVE: tl.constexpr, USE_U: tl.constexpr):
    """One K tile's share of A's diagonal (no gate): Σ q k (GLA), Σ q u k (RWKV6's
    bonus), or zeros (exclusive scores without a bonus)."""
    if USE_U:
        b_u = tl.load(u_h + o_k, mask=m_k, other=0.).to(tl.float32)
        return tl.sum(b_q * b_k * b_u[None, :], axis=1)
    elif not EXCLUSIVE:
        return tl.sum(b_q * b_k, axis=1)
    else:
        return tl.sum(b_q * 0., axis=1)


@triton.jit
def _gk_strip_rows(q_b, k_b, gc_b, u_h, qg_b, kg_b, o_i, m_i, i_k, L, HK, K: tl.constexpr,
                   BK: tl.constexpr, EXCLUSIVE: tl.constexpr, USE_U: tl.constexpr,
                   GATE_OPERANDS: tl.constexpr):
    """What both strip forms take from the strip's own rows ``o_i`` in K tile ``i_k``:
    ``(o_k, m_k, o_ik, m_ik, q, k, γ, γq, diagonal share)`` (q, k in fp32; γq = γ_{i−1},
    0 at the chunk's first row, for exclusive scores), storing the rows' gated operands
    on the way (``GATE_OPERANDS``)."""
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_ik = m_i[:, None] & m_k[None, :]
    o_ik = o_i[:, None] * HK + o_k[None, :]
    b_q = tl.load(q_b + o_ik, mask=m_ik, other=0.).to(tl.float32)
    b_k = tl.load(k_b + o_ik, mask=m_ik, other=0.).to(tl.float32)
    b_g = tl.load(gc_b + o_ik, mask=m_ik, other=0.)
    if EXCLUSIVE:
        b_gq = tl.load(gc_b + o_ik - HK, mask=m_ik & (o_i > 0)[:, None], other=0.)
    else:
        b_gq = b_g
    if GATE_OPERANDS:
        b_gl = tl.load(gc_b + (L - 1) * HK + o_k, mask=m_k, other=0.)
        _gk_store_gated_operands(b_q, b_k, b_g, b_gq, b_gl, qg_b, kg_b, o_ik, m_ik)
    return (o_k, m_k, o_ik, m_ik, b_q, b_k, b_g, b_gq,
            _gk_diagonal(b_q, b_k, u_h, o_k, m_k, EXCLUSIVE, USE_U))


@triton.jit
def gk_strip_span(gc_b, L, HK, S: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                   EXCLUSIVE: tl.constexpr):
    """The largest exponent the one-reference form of strip S would exponentiate: the
    maximum over channels of γq_f − γ_m and γ_m − γ_e (f, e the strip's first and last
    valid rows, m its reference row), γ being non-increasing (log decays ≤ 0)."""
    f = tl.minimum(16 * S, L - 1)
    m = tl.minimum(16 * S + 7, L - 1)
    e = tl.minimum(16 * S + 15, L - 1)
    span = 0.
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        if EXCLUSIVE:
            # γq_f = γ_{f−1}, 0 at the chunk's first row.
            b_gf = tl.load(gc_b + tl.maximum(f - 1, 0) * HK + o_k, mask=m_k, other=0.)
            b_gf = tl.where(f > 0, b_gf, 0.)
        else:
            b_gf = tl.load(gc_b + f * HK + o_k, mask=m_k, other=0.)
        b_gm = tl.load(gc_b + m * HK + o_k, mask=m_k, other=0.)
        b_ge = tl.load(gc_b + e * HK + o_k, mask=m_k, other=0.)
        span = tl.maximum(span, tl.max(tl.maximum(b_gf - b_gm, b_gm - b_ge), axis=0))
    return span


@triton.jit
def _gk_fwd_A_strip_one_ref(q_b, k_b, gc_b, u_h, A_b, qg_b, kg_b, L, HK, S: tl.constexpr,
                            K: tl.constexpr, BK: tl.constexpr, RS,
                            EXCLUSIVE: tl.constexpr, USE_U: tl.constexpr,
                            GATE_OPERANDS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Rows 16·S … 16·S + 15 of the chunk's A through one reference row, the strip's
    m = 16·S + 7: A_ij = [q_i e^{γq_i − γ_m}] · [k_j e^{γ_m − γ_j}] for every key j up
    to the strip's end, one [16, BK] x [BK, 16·S + 16] product. Exponents are ≤ 0 except
    for queries before m and keys after it, where they are at most the strip's span
    (``gk_strip_span``, checked by the caller); a key so far back that its factor
    underflows meets queries whose factors are at most e^span, so what is lost is below
    e^(span − 87). The diagonal is formed without a gate, as in the halving form."""
    dt = k_b.dtype.element_ty
    NJ: tl.constexpr = 16 if S == 0 else (32 if S == 1 else 64)
    o_i = 16 * S + tl.arange(0, 16)
    m_i = o_i < L
    m = tl.minimum(16 * S + 7, L - 1)
    o_j = tl.arange(0, NJ)
    m_j = (o_j < L) & (o_j < 16 * S + 16)
    b_a = tl.zeros([16, NJ], dtype=tl.float32)
    b_d = tl.zeros([16], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k, m_k, o_ik, m_ik, b_q, b_k, b_g, b_gq, b_dk = _gk_strip_rows(
            q_b, k_b, gc_b, u_h, qg_b, kg_b, o_i, m_i, i_k, L, HK, K, BK, EXCLUSIVE, USE_U,
            GATE_OPERANDS)
        b_d += b_dk
        b_gm = tl.load(gc_b + m * HK + o_k, mask=m_k, other=0.)
        b_qx = (b_q * tl.exp(tl.where(m_ik, b_gq - b_gm[None, :], 0.))).to(dt)
        m_jk = m_j[:, None] & m_k[None, :]
        o_jk = o_j[:, None] * HK + o_k[None, :]
        b_kj = tl.load(k_b + o_jk, mask=m_jk, other=0.).to(tl.float32)
        b_gj = tl.load(gc_b + o_jk, mask=m_jk, other=0.)
        b_kx = (b_kj * tl.exp(tl.where(m_jk, b_gm[None, :] - b_gj, 0.))).to(dt)
        b_a = tl.dot(b_qx, tl.trans(b_kx), b_a, input_precision=DOT_PRECISION)
    b_a = tl.where(o_j[None, :] < o_i[:, None], b_a, 0.)
    b_a += tl.where(o_j[None, :] == o_i[:, None], b_d[:, None], 0.)
    ot = A_b.dtype.element_ty
    p_i = A_b + o_i[:, None] * RS
    tl.store(p_i + o_j[None, :], b_a.to(ot), mask=m_i[:, None])
    if NJ < 64:
        o_z = tl.arange(0, 64)
        tl.store(p_i + o_z[None, :], tl.zeros([16, 64], dtype=ot),
                 mask=m_i[:, None] & (o_z >= NJ)[None, :])


@triton.jit
def _gk_store_gamma(g_b, gc_b, L, HK, K: tl.constexpr, BK: tl.constexpr):
    """γ = cumsum(g) over the chunk's rows, stored (fp32), for the strips to read back
    rows of it."""
    o_t = tl.arange(0, 64)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = (o_t < L)[:, None] & (o_k < K)[None, :]
        o_tk = o_t[:, None] * HK + o_k[None, :]
        b_g = tl.cumsum(tl.load(g_b + o_tk, mask=m_tk, other=0.).to(tl.float32), axis=0)
        tl.store(gc_b + o_tk, b_g, mask=m_tk)


@triton.jit
def _gk_fwd_A_chunk_form(q_b, k_b, g_b, gc_b, u_h, A_b, qg_b, kg_b, L, HK, K: tl.constexpr,
                         BK: tl.constexpr, RS, EXCLUSIVE: tl.constexpr, USE_U: tl.constexpr,
                         GATE_OPERANDS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The whole chunk in one [64, K] x [K, 64] product, returning its span. Per K tile
    γ = cumsum(g) in registers (only its row at the chunk's last valid token stored, all
    the state pass reads; the gated operands under ``GATE_OPERANDS``), then the tile's
    share of A through a per-channel shift s_k in place of a reference row::

        A_ij = Σ_k [q_ik e^{γq_ik − s_k}] · [k_jk e^{s_k − γ_jk}]

    s_k the midpoint of the chunk's largest γq_k and smallest γ_k, so that no factor's
    exponent exceeds half the chunk's range of γ in its channel (the span: ~26-38 for
    logsigmoid(randn) gates, against ~52-76 through the last row). Pairs above the
    diagonal may form larger products (even inf); they are masked away. A is stored
    only where the span is ≤ ONE_REFERENCE_MAX_SPAN (what an underflowing factor then
    loses is below e^(span − 87), the strips' argument), else the caller leaves the
    chunk to the strips; exponents are capped at the limit so that a refused chunk forms
    no inf factor. The diagonal is formed without a gate, as in the strips."""
    dt = k_b.dtype.element_ty
    o_t = tl.arange(0, 64)
    m_t = o_t < L
    b_a = tl.zeros([64, 64], dtype=tl.float32)
    b_d = tl.zeros([64], dtype=tl.float32)
    span = 0.
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        o_tk = o_t[:, None] * HK + o_k[None, :]
        # Rows past the chunk's end load g = 0: their γ stays finite (and masked below).
        b_gi = tl.load(g_b + o_tk, mask=m_tk, other=0.).to(tl.float32)
        b_g = tl.cumsum(b_gi, axis=0)
        # γ_C is the cumsum's own row at the last valid token, the very value its γ_t
        # is, so that the last token's k ⊙ e^{γ_C − γ_t} has exponent 0 exactly. Not a
        # separate sum of g, nor the scan's row 63 past a short chunk's end: each rounds
        # apart from that row (a parallel scan associates rows differently) by ulps of
        # γ, whose magnitude reaches ~1000 under steep gates, and the state, which those
        # last tokens dominate then, carried it (fp32 on the GPU, gates of −10 to −20 a
        # step, 150 seeds: the final state 6.5e-5 off the float64 loop at worst, 1.1e-7
        # with this row).
        b_gl = tl.sum(tl.where(o_t[:, None] == L - 1, b_g, 0.), axis=0)
        tl.store(gc_b + (L - 1) * HK + o_k, b_gl, mask=m_k)
        if EXCLUSIVE:
            b_gq = b_g - b_gi
        else:
            b_gq = b_g
        b_hi = tl.max(tl.where(m_tk, b_gq, float("-inf")), axis=0)
        b_lo = tl.min(tl.where(m_tk, b_g, float("inf")), axis=0)
        b_half = tl.where(m_k, 0.5 * (b_hi - b_lo), 0.)
        b_s = tl.where(m_k, 0.5 * (b_hi + b_lo), 0.)
        span = tl.maximum(span, tl.max(b_half, axis=0))
        b_q = tl.load(q_b + o_tk, mask=m_tk, other=0.).to(tl.float32)
        b_k = tl.load(k_b + o_tk, mask=m_tk, other=0.).to(tl.float32)
        if GATE_OPERANDS:
            _gk_store_gated_operands(b_q, b_k, b_g, b_gq, b_gl, qg_b, kg_b, o_tk, m_tk)
        b_qx = b_q * tl.exp(tl.minimum(tl.where(m_tk, b_gq - b_s[None, :], 0.),
                                       ONE_REFERENCE_MAX_SPAN))
        b_kx = b_k * tl.exp(tl.minimum(tl.where(m_tk, b_s[None, :] - b_g, 0.),
                                       ONE_REFERENCE_MAX_SPAN))
        b_a = tl.dot(b_qx.to(dt), tl.trans(b_kx.to(dt)), b_a, input_precision=DOT_PRECISION)
        b_d += _gk_diagonal(b_q, b_k, u_h, o_k, m_k, EXCLUSIVE, USE_U)
    if span <= ONE_REFERENCE_MAX_SPAN:
        b_a = tl.where(o_t[None, :] < o_t[:, None], b_a, 0.)
        b_a += tl.where(o_t[None, :] == o_t[:, None], b_d[:, None], 0.)
        tl.store(A_b + o_t[:, None] * RS + o_t[None, :], b_a.to(A_b.dtype.element_ty),
                 mask=m_t[:, None])
    return span


@triton.jit
def _gk_fwd_A_strip(q_b, k_b, gc_b, u_h, A_b, qg_b, kg_b, L, HK, S: tl.constexpr,
                    K: tl.constexpr, BK: tl.constexpr, RS, EXCLUSIVE: tl.constexpr,
                    USE_U: tl.constexpr, GATE_OPERANDS: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    """Rows 16·S … 16·S + 15 of the chunk's A, stored (row stride ``RS``): the pairs
    with keys in earlier strips through the reference row M = 16·S − 1, the strip's own
    16 x 16 block by halving (levels 16, 8, 4, 2) and the diagonal. With
    ``GATE_OPERANDS`` also the strip's rows of q ⊙ e^{γq} and k ⊙ e^{γ_C − γ}, from the
    tiles it has loaded anyway."""
    dt = k_b.dtype.element_ty
    M: tl.constexpr = 16 * S - 1
    # Keys 0 … M in power-of-two blocks: [0, 16) for S = 1, [0, 32) for S = 2 and 3,
    # and [32, 48) for S = 3 (one 64-wide block would leave a quarter of its dot zero).
    NC: tl.constexpr = 16 + 16 * (S // 2)
    o_i = 16 * S + tl.arange(0, 16)
    m_i = o_i < L
    b_c = tl.zeros([16, NC], dtype=tl.float32)
    b_c2 = tl.zeros([16, 16], dtype=tl.float32)
    b_s = tl.zeros([16, 16], dtype=tl.float32)
    b_d = tl.zeros([16], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k, m_k, o_ik, m_ik, b_q, b_k, b_g, b_gq, b_dk = _gk_strip_rows(
            q_b, k_b, gc_b, u_h, qg_b, kg_b, o_i, m_i, i_k, L, HK, K, BK, EXCLUSIVE, USE_U,
            GATE_OPERANDS)
        b_d += b_dk
        if S > 0:
            # A strip with a valid row has M < L; without one, no query survives its
            # mask and the clamp keeps the keys' exponents ≤ 0 all the same.
            m = tl.minimum(M, L - 1)
            b_gm = tl.load(gc_b + m * HK + o_k, mask=m_k, other=0.)
            b_qx = (b_q * tl.exp(tl.where(m_ik, b_gq - b_gm[None, :], 0.))).to(dt)
            b_c = tl.dot(b_qx, tl.trans(_gk_cross_keys(k_b, gc_b, b_gm, o_k, m_k, m, 0, NC,
                                                       HK)),
                         b_c, input_precision=DOT_PRECISION)
            if S == 3:
                b_c2 = tl.dot(b_qx, tl.trans(_gk_cross_keys(k_b, gc_b, b_gm, o_k, m_k, m,
                                                            32, 16, HK)),
                              b_c2, input_precision=DOT_PRECISION)
        for lvl in tl.static_range(4):
            second, b_e = gk_level_factor(b_g, b_gq, gc_b, o_i, o_k, m_k, L, HK, 16 >> lvl)
            b_qe = tl.where(second[:, None], b_q * b_e, 0.).to(dt)
            b_ke = tl.where(second[:, None], 0., b_k * b_e).to(dt)
            b_l = tl.dot(b_qe, tl.trans(b_ke), input_precision=DOT_PRECISION)
            b_s += tl.where(gk_level_mask(o_i, 16 >> lvl), b_l, 0.)
    b_s += tl.where(o_i[:, None] == o_i[None, :], b_d[:, None], 0.)
    # Every address of the row block is written once: the cross blocks left of the
    # strip, its own block, zeros right of it.
    ot = A_b.dtype.element_ty
    p_i = A_b + o_i[:, None] * RS
    o_j = tl.arange(0, 16)
    tl.store(p_i + 16 * S + o_j[None, :], b_s.to(ot), mask=m_i[:, None])
    if S > 0:
        tl.store(p_i + tl.arange(0, NC)[None, :], b_c.to(ot), mask=m_i[:, None])
    if S == 3:
        tl.store(p_i + 32 + o_j[None, :], b_c2.to(ot), mask=m_i[:, None])
    if S < 3:
        o_z = tl.arange(0, 64)
        tl.store(p_i + o_z[None, :], tl.zeros([16, 64], dtype=ot),
                 mask=m_i[:, None] & (o_z >= 16 * S + 16)[None, :])


@triton.jit
def _gk_fwd_A_strips(q_b, k_b, gc_b, u_h, A_b, qg_b, kg_b, L, HK, K: tl.constexpr,
                     BK: tl.constexpr, RS, FORM: tl.constexpr, EXCLUSIVE: tl.constexpr,
                     USE_U: tl.constexpr, GATE_OPERANDS: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
    """The chunk's A (γ stored) strip by strip in the strips' form ``FORM``: one
    reference row a strip (STRIP_FORM) or the halving (HALVING_FORM)."""
    for s in tl.static_range(4):
        if FORM == STRIP_FORM:
            _gk_fwd_A_strip_one_ref(q_b, k_b, gc_b, u_h, A_b, qg_b, kg_b, L, HK, s, K, BK, RS,
                                    EXCLUSIVE, USE_U, GATE_OPERANDS, DOT_PRECISION)
        else:
            _gk_fwd_A_strip(q_b, k_b, gc_b, u_h, A_b, qg_b, kg_b, L, HK, s, K, BK, RS,
                            EXCLUSIVE, USE_U, GATE_OPERANDS, DOT_PRECISION)


@tuned(key=["K", "q", "g", "EXCLUSIVE", "USE_U", "GATE_OPERANDS", "FORM", "FIRST",
            "STORE_GAMMA"],
       default=_A_default,
       space=_A_space)
@triton.jit(do_not_specialize=["T", "H"])
def chunk_gk_fwd_A_kernel(
    q, k, g, u, g_cum, A, qg, kg, form, cu_seqlens, chunk_indices, T,
    H, K: tl.constexpr, BK: tl.constexpr, EXCLUSIVE: tl.constexpr, USE_U: tl.constexpr,
    GATE_OPERANDS: tl.constexpr, FORM: tl.constexpr, FIRST: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr, STORE_GAMMA: tl.constexpr = False,
):
    """Grid ``(NT, B·H)``. q, k, g ``[B, T, H, K]``; u ``[H, K]``; g_cum (out, fp32)
    ``[B, T, H, K]``; A (out) ``[B, T, H, 64]`` (row t: token t's scores in its chunk;
    zeros above the diagonal and past the chunk's end). With ``GATE_OPERANDS`` also the
    state pass's gated operands (out, q's dtype, ``[B, T, H, K]``): qg = q ⊙ e^{γq} and
    kg = k ⊙ e^{γ_C − γ}, γ_C the chunk's last row.

    ``FORM``: CHUNK_FORM (the whole chunk through a per-channel shift), STRIP_FORM (one
    reference row a 16-row strip) or HALVING_FORM. Two launches at most share the work
    through ``form`` ``[B·H, NT]`` int8 (the form each chunk still needs, 0 once
    formed): the ``FIRST`` one forms γ and every chunk its form can take and marks the
    others with their final form; the follow-up (not ``FIRST``) forms the chunks marked
    ``FORM`` or a later form, the one after the first launch's (after the chunk form,
    the strips or the halving as marked; after the strips, the halving). The chunk form
    writes γ only at each chunk's last valid row (all the state pass reads), and in full
    for the chunks it leaves to the follow-up; with ``STORE_GAMMA`` (a forward feeding
    a backward, K above CHUNK_FORM_WITH_GRADIENTS_ABOVE_K) it writes all of γ first, in
    a pass of its own. A first halving launch (fp16 inputs) forms every chunk alone."""
    BT: tl.constexpr = 64
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    p_form = form + i_bh * tl.num_programs(0) + i_t
    i_b, i_h = i_bh // H, i_bh % H
    i_t, bos, T = locate_chunk(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    row0 = bos + i_t * BT
    L = tl.minimum(T - i_t * BT, BT)
    HK = H * K
    base = (row0 * H + i_h) * K
    # Scalar int64 bases, int32 tile offsets: 64-bit address tiles cost two registers
    # an element.
    q_b, k_b, g_b, gc_b = q + base, k + base, g + base, g_cum + base
    A_b = A + (row0 * H + i_h) * BT
    if USE_U:
        u_h = u + i_h * K
    else:
        u_h = u
    if GATE_OPERANDS:
        qg_b, kg_b = qg + base, kg + base
    else:
        qg_b, kg_b = qg, kg

    if FORM == CHUNK_FORM:
        if STORE_GAMMA:
            # A pass of its own: γ's store inside the chunk form's loop held 176 registers.
            _gk_store_gamma(g_b, gc_b, L, HK, K, BK)
        span = _gk_fwd_A_chunk_form(q_b, k_b, g_b, gc_b, u_h, A_b, qg_b, kg_b, L, HK, K, BK,
                                    H * BT, EXCLUSIVE, USE_U, GATE_OPERANDS, DOT_PRECISION)
        needed = tl.zeros([], dtype=tl.int32)
        if span > ONE_REFERENCE_MAX_SPAN:
            # The follow-up reads rows of γ: this (rare) chunk's are written, and read
            # back (every thread of the program stored some) for the strips' spans.
            if not STORE_GAMMA:
                _gk_store_gamma(g_b, gc_b, L, HK, K, BK)
            tl.debug_barrier()
            needed = _gk_strips_form(gc_b, L, HK, K, BK, EXCLUSIVE)
        tl.store(p_form, needed.to(tl.int8))
    elif FIRST:
        # γ written first: the strips read rows of it back.
        _gk_store_gamma(g_b, gc_b, L, HK, K, BK)
        tl.debug_barrier()
        if FORM == STRIP_FORM:
            needed = _gk_strips_form(gc_b, L, HK, K, BK, EXCLUSIVE)
            tl.store(p_form, tl.where(needed == STRIP_FORM, 0, needed).to(tl.int8))
            if needed == STRIP_FORM:
                _gk_fwd_A_strips(q_b, k_b, gc_b, u_h, A_b, qg_b, kg_b, L, HK, K, BK, H * BT,
                                 STRIP_FORM, EXCLUSIVE, USE_U, GATE_OPERANDS, DOT_PRECISION)
        else:
            _gk_fwd_A_strips(q_b, k_b, gc_b, u_h, A_b, qg_b, kg_b, L, HK, K, BK, H * BT,
                             HALVING_FORM, EXCLUSIVE, USE_U, GATE_OPERANDS, DOT_PRECISION)
    else:
        # The follow-up: one byte read instead of the spans' 24 rows of γ, its programs
        # mostly finding nothing to do (H100, 1x8192x96x128: 0.17 ms measuring the spans
        # again). The marks are final (the first launch chose between the strips' forms
        # from γ), so that one launch serves every later form: after the chunk form,
        # compiled with the strips and the halving, whose registers together slowed a
        # launch forming every chunk (1.06 ms against 0.86), not one whose programs
        # mostly exit at once.
        needed = tl.load(p_form)
        if FORM == STRIP_FORM:
            if needed == STRIP_FORM:
                _gk_fwd_A_strips(q_b, k_b, gc_b, u_h, A_b, qg_b, kg_b, L, HK, K, BK, H * BT,
                                 STRIP_FORM, EXCLUSIVE, USE_U, GATE_OPERANDS, DOT_PRECISION)
        if needed == HALVING_FORM:
            _gk_fwd_A_strips(q_b, k_b, gc_b, u_h, A_b, qg_b, kg_b, L, HK, K, BK, H * BT,
                             HALVING_FORM, EXCLUSIVE, USE_U, GATE_OPERANDS, DOT_PRECISION)


@triton.jit
def _gk_strips_form(gc_b, L, HK, K: tl.constexpr, BK: tl.constexpr, EXCLUSIVE: tl.constexpr):
    """The strips' form a chunk needs (γ stored): STRIP_FORM where every strip's span is
    ≤ ONE_REFERENCE_MAX_SPAN, else HALVING_FORM."""
    span = tl.maximum(tl.maximum(gk_strip_span(gc_b, L, HK, 0, K, BK, EXCLUSIVE),
                                 gk_strip_span(gc_b, L, HK, 1, K, BK, EXCLUSIVE)),
                      tl.maximum(gk_strip_span(gc_b, L, HK, 2, K, BK, EXCLUSIVE),
                                 gk_strip_span(gc_b, L, HK, 3, K, BK, EXCLUSIVE)))
    return tl.where(span <= ONE_REFERENCE_MAX_SPAN, STRIP_FORM, HALVING_FORM)


def _h_default(args) -> Config:
    if args["GATED_OPERANDS"]:
        # No exponential and no fp32 γ tile in the loop. 128-row tiles (H100, Triton
        # 3.6, bf16, 2026-11-27, BK = 64 -> 128 with S held [BK, BV]: the output pass GLA
        # 1x8192x96x128 0.412 -> 0.395 ms, 8x2048x32x256 1.204 -> 1.112, RWKV6
        # 4x4096x16x128 0.168 -> 0.141). Thin grids (FEW_PROGRAMS from the launcher,
        # fla.utils.grid.grid_fill): a third stage, and 32 columns where even those leave
        # each SM one program (the gated delta rule's pass at 2x16384x16x128: 0.22 ms
        # against 0.41).
        # The transposed state (2026-11-27, H100, Triton 3.6, bf16, each config of the
        # new space forced in turn, ms): above K = 128 (GLA 8x2048x32x256) the output
        # pass at 128 columns, 8 warps, two stages, 0.698 (the pass holding S [BK, BV]
        # took 1.122 at its best; here 64 rows 0.684, 4 warps at 32 columns 0.894, the
        # rule kept for fp32 operands, not timed at 8 warps), the h pass at 64 columns, 8
        # warps, 0.690 (128 columns 0.853; S [BK, BV] 0.79). Up to K = 128 on a full grid
        # (1x8192x96x128) the output pass 0.393 and the h pass 0.331 at 64 columns, 4
        # warps, as S [BK, BV] did (0.395, 0.325). On a thin grid (FEW_PROGRAMS) 8 warps
        # at three stages: GLA 4x2048x16x128 0.077 against 0.083 at 4, RWKV6
        # 4x4096x16x128 0.139 against 0.151; the h pass there at 32 columns, 8 warps, two
        # stages, 0.071 against 0.075 and 0.134 against 0.141.
        bk = tile_width(args["K"], 128)
        wide = sixteen_bit(args)
        states_only = args.get("STORE_H") and not args.get("STORE_O", True)
        if args["K"] > 128:
            if states_only:
                # (fp32 tiles: one stage, as the S [BK, BV] pass took for shared memory)
                return Config(BV=tile_width(args["V"], 64), BK=bk, num_warps=8,
                              num_stages=2 if sixteen_bit(args) else 1)
            if wide:
                # 64 rows: as fast as 128 (0.684 against 0.698 ms, above) and the tile
                # Triton 3.5 computes right (triton_facts.TRANSPOSED_GK_128X128_OK).
                return Config(BV=tile_width(args["V"], 128), BK=tile_width(args["K"], 64),
                              num_warps=8, num_stages=2)
            return Config(BV=tile_width(args["V"], 32), BK=bk, num_warps=4, num_stages=2)
        few = args.get("FEW_PROGRAMS", 0) if sixteen_bit(args) else 0
        if states_only and sixteen_bit(args):
            if few:
                return Config(BV=tile_width(args["V"], 32), BK=bk, num_warps=8, num_stages=2)
            return Config(BV=tile_width(args["V"], 64), BK=bk, num_warps=4, num_stages=3)
        return Config(BV=tile_width(args["V"], 32 if few == 2 else 64), BK=bk,
                      num_warps=8 if few and wide else 4, num_stages=3 if few else 2)
    # The K x BV fp32 state lives in registers next to [64, 64] operand tiles of q, k, γ:
    # 8 warps (offline sm_90 compile, K = 128: 4 warps spill 2 KB a thread with BV = 64,
    # 8 warps 0.7 KB; storing h only, 32 B).
    return Config(BV=tile_width(args["V"], 64 if args["K"] <= 128 else 32),
                  BK=tile_width(args["K"], 64), num_warps=_h_max_warps(args), num_stages=2)


def _h_max_warps(args) -> int:
    # On the gated operands the transposed pass takes 8 warps on every release: Triton
    # 3.3.1 aborted building the pass that held S [BK, BV] at 8 warps with its output
    # fused; the transposed one it builds (offline sm_90, every config at K = 256) and
    # runs right (H100, GLA's config sweeps at D = 128 and 256 with 8 warps in the
    # space, its GPU tests and RWKV6's, 2026-11-27). Gating its own operands (the
    # public stage's path) it keeps the release's rule: not run at 8 warps on 3.3.
    if args["GATED_OPERANDS"]:
        return 8
    return max(warp_choices(stmatrix_prone=args["STORE_O"]))


def _h_space(args) -> list[Config]:
    # H100, Triton 3.6, bf16, every config run in its own process and in the GPU sweep
    # (the pass holding S [BK, BV], before 2026-11-27): BV = 32 with one stage faulted
    # with an illegal address (1x8192x96x128, 4 and 8 warps), never the fastest since
    # either. Shared memory (q, k, and without the gated operands fp32 γ and γq tiles
    # per stage) bounds the stages: three only on the gated operands up to K = 128, two
    # elsewhere (offline sm_90 builds of the transposed pass, Triton 3.6, bf16: at most
    # 180 KB, K = 256 at two stages). 128 columns only at 8 warps: at 4 their [128, BK]
    # fp32 tiles spill (2.98 ms against 0.70 at K = 256).
    max_warps = _h_max_warps(args)
    widths = sorted({tile_width(args["V"], bv) for bv in (32, 64, 128)})
    deep = args["GATED_OPERANDS"] and args["K"] <= 128
    rows = (state_row_heights(args["K"]) if args["GATED_OPERANDS"]
            else (tile_width(args["K"], 64),))
    return list(dict.fromkeys(
        Config(BV=bv, BK=bk, num_warps=w, num_stages=s)
        for bv in widths for bk in rows for w in (4, 8) if w <= max_warps
        for s in ((1, 2, 3) if deep else (1, 2))
        if not (bv <= 32 and s == 1) and not (bv > 64 and w < 8)
        and (triton_facts.TRANSPOSED_GK_128X128_OK or not (bk >= 128 and bv >= 128))))


@triton.jit
def _gk_state_step(b_s, b_d, b_o, b_vt, q_b, k_b, g_b, h_b, i_kt: tl.constexpr, o_t, m_t, L,
                   HK, o_v, m_v, V: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                   EXCLUSIVE: tl.constexpr, GATED_OPERANDS: tl.constexpr,
                   STORE_H: tl.constexpr, STORE_O: tl.constexpr, TRANSITION: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """One K tile of the transposed state, ``b_s`` = Sᵀ [BV, BK], through one chunk:
    stores it as rows of h (``STORE_H``), adds Sᵀ (Q ⊙ exp(γq))ᵀ to the transposed
    output ``b_o`` [BV, 64] (``STORE_O``), then decays and updates it by Vᵀ (K ⊙
    exp(γ_C − γ)) (``b_vt`` = Vᵀ [BV, 64]); a ``TRANSITION`` adds the chunk's γ_C to the
    tile's entries of the log decay ``b_d`` [BK]. ``q_b``, ``k_b``, ``g_b`` point at the
    chunk's first row, ``h_b`` at its state; with ``GATED_OPERANDS`` q and k are already
    Q ⊙ e^{γq} and K ⊙ e^{γ_C − γ}."""
    dt = k_b.dtype.element_ty
    o_k = i_kt * BK + tl.arange(0, BK)
    m_k = o_k < K
    if STORE_H:
        tl.store(h_b + o_k[None, :] * V + o_v[:, None], b_s.to(h_b.dtype.element_ty),
                 mask=m_v[:, None] & m_k[None, :])
    m_tk = m_t[:, None] & m_k[None, :]
    o_tk = o_t[:, None] * HK + o_k[None, :]
    b_gl = tl.load(g_b + (L - 1) * HK + o_k, mask=m_k, other=0.)
    if GATED_OPERANDS:
        if STORE_O:
            b_o = tl.dot(b_s.to(dt), tl.trans(tl.load(q_b + o_tk, mask=m_tk, other=0.)), b_o,
                         input_precision=DOT_PRECISION)
        b_kd = tl.load(k_b + o_tk, mask=m_tk, other=0.)
    else:
        b_g = tl.load(g_b + o_tk, mask=m_tk, other=0.)
        if STORE_O:
            if EXCLUSIVE:
                b_gq = tl.load(g_b + o_tk - HK, mask=m_tk & (o_t > 0)[:, None], other=0.)
            else:
                b_gq = b_g
            b_q = tl.load(q_b + o_tk, mask=m_tk, other=0.).to(tl.float32)
            # γq is chunk-local and ≤ 0.
            b_o = tl.dot(b_s.to(dt), tl.trans((b_q * tl.exp(b_gq)).to(dt)), b_o,
                         input_precision=DOT_PRECISION)
        b_k = tl.load(k_b + o_tk, mask=m_tk, other=0.).to(tl.float32)
        b_kd = tl.where(m_tk, b_k * tl.exp(tl.where(m_tk, b_gl[None, :] - b_g, 0.)),
                        0.).to(dt)
    if TRANSITION:
        b_d += b_gl
    b_s = b_s * tl.exp(b_gl)[None, :]
    b_s = tl.dot(b_vt, b_kd, b_s, input_precision=DOT_PRECISION)
    return b_s, b_d, b_o


@tuned(key=["K", "V", "k", "EXCLUSIVE", "GATED_OPERANDS", "STORE_H", "STORE_O",
            "FEW_PROGRAMS", "SPLIT", "TRANSITION"],
       default=_h_default,
       space=_h_space)
@triton.jit(do_not_specialize=["T", "H"])
def chunk_gk_fwd_h_kernel(
    q, k, v, g_cum, A, h, o, h0, ht, cu_seqlens, chunk_offsets, scale, T,
    H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    EXCLUSIVE: tl.constexpr, GATED_OPERANDS: tl.constexpr, STORE_H: tl.constexpr,
    STORE_O: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr, FEW_PROGRAMS: tl.constexpr = 0,
    segments=None, seg_decay=None, SPLIT: tl.constexpr = False,
    TRANSITION: tl.constexpr = False,
):
    """Grid ``(cdiv(V, BV), H, P)``: one program walks one sequence's chunks for one V
    tile, the K x BV fp32 state held transposed, as up to four [BV, BK] tiles (BK a
    tuning choice). Transposed, the update Sᵀ += Vᵀ K̃ accumulates into the tile in
    place and the output's Sᵀ Q̃ᵀ takes it (cast to 16-bit) as a register operand: no
    trip of the state through shared memory a chunk (H100, GLA 8x2048x32x256, the
    output pass: 0.70 ms against 1.12 holding S [BK, BV]). Tensors keep their layouts:
    h, h0 and ht are ``[.., K, V]`` and o ``[B, T, H, V]`` (stored through a transpose).
    P = N, or with ``SPLIT`` one program per row of ``segments [P, 3]`` int32 (sequence,
    first chunk, end chunk) walking that segment's chunks, ``h0`` and ``ht`` then
    indexed by segment (h, o still by the sequence's tokens and global chunks).
    A ``TRANSITION`` (with ``SPLIT``, no o, no h) starts from zeros and stores the
    segment's X to ``ht [P, H, K, V]`` and, from the first V tile's program, its log
    decay d = Σ γ_C over its chunks to ``seg_decay [P, H, K]`` (fp32): over the segment
    S_out = diag(e^d) S_in + X.
    ``FEW_PROGRAMS`` (:func:`fla.utils.grid.grid_fill`) is read by the tuning layer only."""
    BT: tl.constexpr = 64
    i_v, i_h, i_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, bos, T, first, end = segment_of_program(i_p, segments, cu_seqlens, T, BT, SPLIT,
                                                 IS_VARLEN)
    boh = first_chunk_row(i_n, chunk_offsets, T, BT, IS_VARLEN)   # the sequence's h rows
    dt = k.dtype.element_ty
    HK = H * K
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    # Element (v, k) of a transposed tile is the state's (k, v): address k·V + v.
    o_s = o_v[:, None] + o_k[None, :] * V
    m_s = m_v[:, None] & (o_k < K)[None, :]

    b_s1 = tl.zeros([BV, BK], dtype=tl.float32)
    b_s2 = tl.zeros([BV, BK], dtype=tl.float32)
    b_s3 = tl.zeros([BV, BK], dtype=tl.float32)
    b_s4 = tl.zeros([BV, BK], dtype=tl.float32)
    # A transition's log decay, per K tile (zeros elsewhere: unused, compiled away).
    b_d1 = tl.zeros([BK], dtype=tl.float32)
    b_d2 = tl.zeros([BK], dtype=tl.float32)
    b_d3 = tl.zeros([BK], dtype=tl.float32)
    b_d4 = tl.zeros([BK], dtype=tl.float32)
    if USE_INITIAL_STATE:
        p_h0 = h0 + (i_p.to(tl.int64) * H + i_h) * (K * V) + o_s
        b_s1 += tl.load(p_h0, mask=m_s, other=0.).to(tl.float32)
        if K > BK:
            b_s2 += tl.load(p_h0 + BK * V, mask=m_s & (BK + o_k < K)[None, :],
                            other=0.).to(tl.float32)
        if K > 2 * BK:
            b_s3 += tl.load(p_h0 + 2 * BK * V, mask=m_s & (2 * BK + o_k < K)[None, :],
                            other=0.).to(tl.float32)
        if K > 3 * BK:
            b_s4 += tl.load(p_h0 + 3 * BK * V, mask=m_s & (3 * BK + o_k < K)[None, :],
                            other=0.).to(tl.float32)

    for i_t in range(first, end):
        row0 = bos + i_t * BT
        L = tl.minimum(T - i_t * BT, BT)
        m_t = o_t < L
        base = (row0 * H + i_h) * K
        q_b, k_b, g_b = q + base, k + base, g_cum + base
        if STORE_H:
            h_b = h + ((boh + i_t) * H + i_h) * (K * V)
        else:
            h_b = h
        v_b = v + (row0 * H + i_h) * V
        o_tv = o_t[:, None] * (H * V) + o_v[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_vt = tl.trans(tl.load(v_b + o_tv, mask=m_tv, other=0.).to(dt))
        b_o = tl.zeros([BV, BT], dtype=tl.float32)
        if STORE_O:
            b_a = tl.load(A + (row0 * H + i_h) * BT + o_t[:, None] * (H * BT) + o_t[None, :],
                          mask=m_t[:, None], other=0.).to(dt)
            b_o = tl.dot(b_vt, tl.trans(b_a), b_o, input_precision=DOT_PRECISION)
        b_s1, b_d1, b_o = _gk_state_step(b_s1, b_d1, b_o, b_vt, q_b, k_b, g_b, h_b, 0, o_t,
                                         m_t, L, HK, o_v, m_v, V, K, BK, EXCLUSIVE,
                                         GATED_OPERANDS, STORE_H, STORE_O, TRANSITION,
                                         DOT_PRECISION)
        if K > BK:
            b_s2, b_d2, b_o = _gk_state_step(b_s2, b_d2, b_o, b_vt, q_b, k_b, g_b, h_b, 1,
                                             o_t, m_t, L, HK, o_v, m_v, V, K, BK, EXCLUSIVE,
                                             GATED_OPERANDS, STORE_H, STORE_O, TRANSITION,
                                             DOT_PRECISION)
        if K > 2 * BK:
            b_s3, b_d3, b_o = _gk_state_step(b_s3, b_d3, b_o, b_vt, q_b, k_b, g_b, h_b, 2,
                                             o_t, m_t, L, HK, o_v, m_v, V, K, BK, EXCLUSIVE,
                                             GATED_OPERANDS, STORE_H, STORE_O, TRANSITION,
                                             DOT_PRECISION)
        if K > 3 * BK:
            b_s4, b_d4, b_o = _gk_state_step(b_s4, b_d4, b_o, b_vt, q_b, k_b, g_b, h_b, 3,
                                             o_t, m_t, L, HK, o_v, m_v, V, K, BK, EXCLUSIVE,
                                             GATED_OPERANDS, STORE_H, STORE_O, TRANSITION,
                                             DOT_PRECISION)
        if STORE_O:
            tl.store(o + (row0 * H + i_h) * V + o_tv,
                     tl.trans(b_o * scale).to(o.dtype.element_ty), mask=m_tv)

    if STORE_FINAL_STATE:
        p_ht = ht + (i_p.to(tl.int64) * H + i_h) * (K * V) + o_s
        tl.store(p_ht, b_s1, mask=m_s)
        if K > BK:
            tl.store(p_ht + BK * V, b_s2, mask=m_s & (BK + o_k < K)[None, :])
        if K > 2 * BK:
            tl.store(p_ht + 2 * BK * V, b_s3, mask=m_s & (2 * BK + o_k < K)[None, :])
        if K > 3 * BK:
            tl.store(p_ht + 3 * BK * V, b_s4, mask=m_s & (3 * BK + o_k < K)[None, :])
    if TRANSITION:
        # Every V tile's program sums the same decays; one stores them.
        if i_v == 0:
            p_d = seg_decay + (i_p.to(tl.int64) * H + i_h) * K + o_k
            tl.store(p_d, b_d1, mask=o_k < K)
            if K > BK:
                tl.store(p_d + BK, b_d2, mask=BK + o_k < K)
            if K > 2 * BK:
                tl.store(p_d + 2 * BK, b_d3, mask=2 * BK + o_k < K)
            if K > 3 * BK:
                tl.store(p_d + 3 * BK, b_d4, mask=3 * BK + o_k < K)


def chunk_gk_fwd_A(q, k, g, u=None, cu_seqlens=None, chunk_indices=None,
                   exclusive: bool = False, gate_operands: bool = False,
                   store_gamma: bool = True):
    """γ and the intra-chunk scores (inputs validated, time-major, contiguous).

    Args:
        q, k: ``[B, T, H, K]`` (one dtype), K ≤ 256; g: ``[B, T, H, K]`` per-token log gate.
        u: RWKV6's bonus ``[H, K]`` (the diagonal of A), or None.
        cu_seqlens, chunk_indices: packed sequences (B == 1) and their 64-token chunk table.
        exclusive: RWKV6's strictly causal gated scores (query gate γ − g).
        gate_operands: also return the state pass's gated operands.
        store_gamma: write all of γ (a backward reads it); if False, g_cum is valid only
            at each chunk's last row (what the state pass with the gated operands reads):
            a forward that feeds no backward skips ~2/3 of this kernel's writes.

    Returns:
        ``(g_cum, A, qg, kg)``: γ float32 ``[B, T, H, K]``; A ``[B, T, H, 64]`` in k's
        dtype; with ``gate_operands`` qg = Q ⊙ e^{γq} and kg = K ⊙ e^{γ_C − γ} (γ_C the
        chunk's last row) ``[B, T, H, K]`` in k's dtype, else None and None.
    """
    B, T, H, K = k.shape
    NT = cdiv(T, CHUNK_SIZE) if cu_seqlens is None else chunk_indices.shape[0]
    g_cum = torch.empty(B, T, H, K, dtype=torch.float32, device=k.device)
    A = torch.empty(B, T, H, CHUNK_SIZE, dtype=k.dtype, device=k.device)
    qg = torch.empty_like(k) if gate_operands else None
    kg = torch.empty_like(k) if gate_operands else None
    # The first launch compiled with its form only (H100, 1x8192x96x128 bf16: one kernel
    # choosing the strips' form at run time held the registers of both, 1.06 ms against
    # 0.86 for the one-reference strips alone), then one follow-up for the chunks it
    # refused, whatever form they need (its programs mostly exit at once: each follow-up
    # cost 10-20 µs of GPU time, and a launch's host time). fp16 inputs take the halving
    # everywhere (their range cannot hold one reference's factors). A forward that feeds
    # a backward writes γ in full and, up to CHUNK_FORM_WITH_GRADIENTS_ABOVE_K, starts
    # from the strips: the chunk form storing γ too took 0.98-1.12 ms there against 0.87
    # (H100 / H200, K = 128), without it 0.70.
    # The chunk form writes every chunk's gated operands, refused ones too (they do not
    # depend on the form): its follow-up writes none. The strips write only those of
    # the chunks they form: their follow-up writes the halving's.
    if k.dtype == torch.float16:
        launches = ((HALVING_FORM, True, gate_operands),)
    elif store_gamma and K <= CHUNK_FORM_WITH_GRADIENTS_ABOVE_K:
        launches = ((STRIP_FORM, True, gate_operands), (HALVING_FORM, False, gate_operands))
    else:
        launches = ((CHUNK_FORM, True, gate_operands), (STRIP_FORM, False, False))
    form = torch.empty(B * H, NT, dtype=torch.int8, device=k.device)
    for kernel_form, first, operands in launches:
        chunk_gk_fwd_A_kernel[(NT, B * H)](
            q=q, k=k, g=g, u=u, g_cum=g_cum, A=A, qg=qg, kg=kg, form=form,
            cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, T=T, H=H, K=K,
            EXCLUSIVE=exclusive, USE_U=u is not None, GATE_OPERANDS=operands,
            FORM=kernel_form.value, FIRST=first, IS_VARLEN=cu_seqlens is not None,
            DOT_PRECISION=dot_precision(k.dtype),
            STORE_GAMMA=store_gamma and kernel_form.value == CHUNK_FORM.value)
    return g_cum, A, qg, kg


def gk_default_segment_chunks(offsets: list[int] | None, B: int, T: int, H: int, K: int,
                              V: int, gated_operands: bool = True) -> int:
    """What :func:`chunk_gk_fwd_h` picks for ``segment_chunks=None`` (0: no split): the
    split's launch model (:func:`fla.ops.common.chunk_segments.segment_chunks_for`, form
    "vector") over the sequences of the host token ``offsets`` (None: B of T tokens),
    with the output and transition programs' tile widths of the tuning defaults."""
    output_tiles, transition_tiles = _pass_tiles(K, V, gated_operands)
    # Through the module: tests and scripts/compile_check.py patch it to force a split.
    return chunk_segments.segment_chunks_for(chunk_segments.sequence_chunks(offsets, B, T),
                                             H, output_tiles, transition_tiles, "vector")


@functools.lru_cache(maxsize=64)
def _pass_tiles(K: int, V: int, gated_operands: bool) -> tuple[int, int]:
    """V tiles of the output and of the transition programs at their default configs
    (remembered: every call of every layer asks; 7 µs a call on a CPU host before)."""
    args = dict(K=K, V=V, GATED_OPERANDS=gated_operands, STORE_H=False, FEW_PROGRAMS=0)
    output_bv = _h_default(dict(args, STORE_O=True)).meta["BV"]
    transition_bv = _h_default(dict(args, STORE_O=False)).meta["BV"]
    return cdiv(V, output_bv), cdiv(V, transition_bv)


def chunk_gk_fwd_h(q, k, v, g_cum, A=None, scale: float = 1.0, initial_state=None,
                   output_final_state: bool = False, store_h: bool = False,
                   store_o: bool = True, cu_seqlens=None, chunk_offsets=None, NT=None,
                   exclusive: bool = False, out_dtype=None, gated_operands: bool = False,
                   offsets: list[int] | None = None, segment_chunks: int | None = None):
    """The state pass: ``(o, h, final_state)``, each None unless asked for.

    o ``[B, T, H, V]`` (``out_dtype``, default v's) = scale·[(Q ⊙ e^{γq}) S + A V];
    h ``[B, NT, H, K, V]`` in k's dtype (``[1, NT_total, ...]`` under varlen) the state
    entering each chunk; final_state ``[N, H, K, V]`` float32. ``chunk_offsets`` (the
    first global chunk of each sequence) and ``NT`` (chunks in all) with ``cu_seqlens``,
    ``offsets`` its host copy (``[N + 1]`` ints; without it a packed batch never splits).
    ``gated_operands``: q and k are ``chunk_gk_fwd_A``'s qg and kg (the pass then reads
    only γ's last row of each chunk).

    ``segment_chunks``: cut the sequences into segments of this many 64-token chunks and
    run the pass as three launches (few long sequences leave most SMs idle otherwise):
    each segment's transition S ↦ diag(e^d) S + X from a zero state, all in parallel; a
    serial combine per sequence giving every segment its entering state (and the final
    state); then the segments' o / h in parallel. None: the launch model's choice
    (:func:`gk_default_segment_chunks`); 0: never.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if NT is None:
        NT = cdiv(T, CHUNK_SIZE)
    if segment_chunks is None:
        segment_chunks = (0 if cu_seqlens is not None and offsets is None else
                          gk_default_segment_chunks(offsets, B, T, H, K, V, gated_operands))
    if segment_chunks and cu_seqlens is not None and offsets is None:
        raise ValueError("segment_chunks with cu_seqlens needs offsets, its host copy")
    o = (torch.empty(B, T, H, V, dtype=out_dtype or v.dtype, device=v.device)
         if store_o else None)
    h = torch.empty(B, NT, H, K, V, dtype=k.dtype, device=k.device) if store_h else None
    ht = (torch.empty(N, H, K, V, dtype=torch.float32, device=k.device)
          if output_final_state else None)
    common = dict(q=q, k=k, v=v, g_cum=g_cum, A=A, h=h, o=o, cu_seqlens=cu_seqlens,
                  chunk_offsets=chunk_offsets, scale=scale, T=T, H=H, K=K, V=V,
                  EXCLUSIVE=exclusive, GATED_OPERANDS=gated_operands,
                  IS_VARLEN=cu_seqlens is not None, DOT_PRECISION=dot_precision(k.dtype))
    kernel = chunk_gk_fwd_h_kernel
    if not segment_chunks:
        kernel[lambda meta: (cdiv(V, meta["BV"]), H, N)](
            h0=initial_state, ht=ht, STORE_H=store_h, STORE_O=store_o,
            USE_INITIAL_STATE=initial_state is not None, STORE_FINAL_STATE=output_final_state,
            FEW_PROGRAMS=sequential_grid_fill(N, H, V), SPLIT=False, TRANSITION=False,
            **common)
        return o, h, ht

    if offsets is None:
        offsets = list(range(0, B * T + 1, T))
    segments, seg_offsets = chunk_segments.segment_tables(offsets, segment_chunks, k.device)
    P = segments.shape[0]
    x = torch.empty(P, H, K, V, dtype=torch.float32, device=k.device)
    seg_decay = torch.empty(P, H, K, dtype=torch.float32, device=k.device)
    # The split launches fill the GPU by design: FEW_PROGRAMS 0, as the launch model
    # assumed when it counted their programs.
    kernel[lambda meta: (cdiv(V, meta["BV"]), H, P)](
        h0=None, ht=x, segments=segments, seg_decay=seg_decay, SPLIT=True, TRANSITION=True,
        STORE_H=False, STORE_O=False, USE_INITIAL_STATE=False, STORE_FINAL_STATE=True,
        FEW_PROGRAMS=0, **dict(common, A=None, h=None, o=None))
    seg_h0 = combine_segment_states(x, seg_decay, "vector", seg_offsets, V, initial_state,
                                    ht)
    kernel[lambda meta: (cdiv(V, meta["BV"]), H, P)](
        h0=seg_h0, ht=None, segments=segments, SPLIT=True, TRANSITION=False, STORE_H=store_h,
        STORE_O=store_o, USE_INITIAL_STATE=True, STORE_FINAL_STATE=False, FEW_PROGRAMS=0, **common)
    return o, h, ht


def chunk_gk_fwd(q, k, v, g, scale: float, u=None, initial_state=None,
                 output_final_state: bool = False, cu_seqlens=None, chunk_indices=None,
                 chunk_offsets=None, exclusive: bool = False, out_dtype=None,
                 keep_operands: bool = False, offsets: list[int] | None = None,
                 segment_chunks: int | None = None):
    """The whole forward: ``(o, final_state, g_cum, A, qg, kg)`` (γ and A for the
    backward; the gated operands qg, kg too with ``keep_operands``, else None).
    ``offsets`` (the host copy of ``cu_seqlens``) and ``segment_chunks`` as in
    :func:`chunk_gk_fwd_h`.

    The scores kernel also writes the gated operands, so that the state pass reads two
    [B, T, H, K] tiles in q's dtype a chunk instead of q, k and two fp32 γ tiles and runs
    no exponential on its sequential chain; the backward's two state passes can read
    them the same way (``keep_operands``), else they are dropped after the pass."""
    g_cum, A, qg, kg = chunk_gk_fwd_A(q, k, g, u, cu_seqlens, chunk_indices, exclusive,
                                      gate_operands=True, store_gamma=keep_operands)
    NT = None if cu_seqlens is None else chunk_indices.shape[0]
    o, _, ht = chunk_gk_fwd_h(qg, kg, v, g_cum, A, scale, initial_state, output_final_state,
                              store_h=False, store_o=True, cu_seqlens=cu_seqlens,
                              chunk_offsets=chunk_offsets, NT=NT, exclusive=exclusive,
                              out_dtype=out_dtype, gated_operands=True, offsets=offsets,
                              segment_chunks=segment_chunks)
    if not keep_operands:
        qg = kg = None
    return o, ht, g_cum, A, qg, kg
