"""Row kernels shared by the norms: RMSNorm, LayerNorm, GroupNorm and the gated norms.

A *segment* is what one normalisation covers: a row of ``x`` for RMSNorm/LayerNorm, one
of its G groups for GroupNorm. With x viewed as ``[R, D]`` (R = N·G segments of D
elements) and γ, β of length G·D, segment r in group r mod G computes (all in fp32)

    s  = x_r + residual_r                                (residual optional)
    μ  = mean(s)   (0 for the RMS form),   rstd = 1 / sqrt(mean((s − μ)²) + eps)
    ŝ  = (s − μ) · rstd
    y  = (ŝ · γ + β) ⊙ act(g)                            (γ, β, the gate g optional)

and stores y in x's dtype, ``residual_out = s`` when asked, and μ, rstd as fp32 ``[R]``.
Backward, with u = dy ⊙ act(g) and w = u · γ:

    ds = rstd · (w − ŝ · mean(ŝ · w) − mean(w))          (no mean(w) term for RMS)
       + d residual_out
    dγ = Σ_rows u · ŝ,   dβ = Σ_rows u,   dg = dy · (ŝ γ + β) · act'(g)

Two paths, picked by the launchers from D alone:

* single pass (forward: D ≤ ``MAX_SINGLE_PASS_D``, backward: D ≤
  ``MAX_SINGLE_PASS_BWD_D``): a program holds whole segments in registers (BLOCK =
  next_power_of_2(D)); the forward takes BR segments per program, the backward is a
  persistent grid whose programs loop over rows, keep dγ/dβ partial sums in fp32
  registers and write one ``[P, G·D]`` partial each, summed afterwards in one launch
  (:func:`fla.ops.utils.partial_sums.sum_partials`).
* multi pass (wider segments): a statistics kernel walks each segment in BLOCK-wide
  chunks (μ and rstd forward, mean(ŝ·w) and mean(w) backward), then the same two kernels
  run with one chunk per program (``STATS_GIVEN``), reading the statistics instead of
  reducing.

The row count is never a compile-time constant (``do_not_specialize``) and no tuning key
contains it: a new batch or sequence length neither recompiles nor re-tunes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fla.ops.utils.partial_sums import sum_partial_pair
from fla.utils.grid import cdiv, next_power_of_2
from fla.utils.triton_facts import multiprocessor_count
from fla.utils.tuning import Config, tuned

__all__ = [
    "ACTIVATIONS", "MAX_SINGLE_PASS_D", "MAX_SINGLE_PASS_BWD_D", "MULTI_PASS_BLOCK",
    "norm_fwd", "norm_bwd", "row_layout", "row_tile", "bwd_row_tile",
    "norm_fwd_kernel", "norm_bwd_kernel", "norm_fwd_stats_kernel", "norm_bwd_stats_kernel",
]

# Widest segment a program normalises in registers. 65536 fp32 values over 16 warps is
# 128 per thread: wider ones would spill everything, so they take the multi-pass path.
# Read at call time (tests lower it to exercise the multi-pass path at small D).
MAX_SINGLE_PASS_D = 65536
# The backward holds x, dy, γ and the dγ sums per element: past 8192 they spill. On H100
# at [2048, 32768] bf16 the single pass took 2.3 ms, the multi-pass 0.26 ms; at 8192 the
# single pass is faster (0.16 vs 0.26 ms at [8192, 8192]).
MAX_SINGLE_PASS_BWD_D = 8192
# Chunk width of the multi-pass path: 4096 values at 8 warps (16 per thread) stream at
# full bandwidth, like the single-pass kernel at D = 4096.
MULTI_PASS_BLOCK = 4096

# Gate activations, as the ACTIVATION constexpr (0: no gate).
ACTIVATIONS = {"swish": 1, "silu": 1, "sigmoid": 2}


# ------------------------------------------------------------------------------ helpers
@triton.jit
def _activation(b_g, ACTIVATION: tl.constexpr):
    """act(g) and act'(g) in fp32: 1 = swish g·σ(g), 2 = sigmoid σ(g)."""
    b_s = tl.sigmoid(b_g)
    if ACTIVATION == 1:
        b_act = b_g * b_s
        b_dact = b_s * (1. + b_g * (1. - b_s))
    else:
        b_act = b_s
        b_dact = b_s * (1. - b_s)
    return b_act, b_dact


@triton.jit
def _normalized(b_s, b_mean, b_rstd, mask, IS_RMS_NORM: tl.constexpr):
    """ŝ for a [BR, BLOCK] tile given per-row μ, rstd; 0 outside ``mask`` so that the
    padded lanes drop out of every row sum taken from it."""
    if IS_RMS_NORM:
        b_xhat = b_s * b_rstd[:, None]
    else:
        b_xhat = (b_s - b_mean[:, None]) * b_rstd[:, None]
    return tl.where(mask, b_xhat, 0.)


@triton.jit
def _gated_grad(b_xhat, b_dy, b_w, b_b, b_g, HAS_WEIGHT: tl.constexpr,
                HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr):
    """(u, w, dg): the gradient reaching the affine output, the one reaching ŝ, and the
    gate's gradient (0 without a gate)."""
    b_u = b_dy
    b_dg = b_dy
    if ACTIVATION != 0:
        b_y0 = b_xhat
        if HAS_WEIGHT:
            b_y0 = b_y0 * b_w
        if HAS_BIAS:
            b_y0 = b_y0 + b_b
        b_act, b_dact = _activation(b_g, ACTIVATION)
        b_dg = b_dy * b_y0 * b_dact
        b_u = b_dy * b_act
    b_wdy = b_u
    if HAS_WEIGHT:
        b_wdy = b_u * b_w
    return b_u, b_wdy, b_dg


# ------------------------------------------------------------------------ tuning rules
def row_tile(BLOCK: int, multi_pass: bool) -> tuple[int, int]:
    """Forward (rows per program, warps) for BLOCK-wide segments: narrow segments are
    packed several to a program (a [BR, BLOCK] tile of ~2048 values) so that a program
    still moves a few KB; each thread holds about 16 values, whose loads vectorise. One
    row per program on the multi-pass path (BLOCK is a chunk of a wider row there).
    On H100 at [16384, 4096] bf16 this runs at 98% of copy bandwidth (4, 8 or 16 warps
    within 1%)."""
    rows = 1 if multi_pass else max(1, 2048 // BLOCK)
    warps = max(1, min(16, rows * BLOCK // 512))
    return rows, warps


def bwd_row_tile(BLOCK: int, multi_pass: bool) -> tuple[int, int]:
    """Backward (rows per program, warps): a [BR, BLOCK] tile of 4096 values at 8 warps,
    16 warps for wider rows. Measured on H100 (bf16, 268 MB of x and dy), against tiles
    of 2048 or 8192 values at 4-16 warps: best or within 3% at D = 128, 1024, 4096 and
    8192."""
    rows = 1 if multi_pass else max(1, 4096 // BLOCK)
    return rows, (8 if rows * BLOCK <= 4096 else 16)


def _fwd_tile(args) -> tuple[int, int]:
    return row_tile(args["BLOCK"], bool(args["STATS_GIVEN"]))


def _bwd_tile(args) -> tuple[int, int]:
    return bwd_row_tile(args["BLOCK"], bool(args["STATS_GIVEN"]))


def _fwd_default(args) -> Config:
    rows, warps = _fwd_tile(args)
    return Config(BR=rows, num_warps=warps, num_stages=2)


def _fwd_space(args) -> list[Config]:
    rows, warps = _fwd_tile(args)
    row_options = [rows] if rows == 1 else sorted({max(1, rows // 2), rows, rows * 2})
    warp_options = sorted({max(1, warps // 2), warps, min(32, warps * 2)})
    return [Config(BR=r, num_warps=w, num_stages=2) for r in row_options for w in warp_options]


def _bwd_default(args) -> Config:
    rows, warps = _bwd_tile(args)
    return Config(BR=rows, num_warps=warps, num_stages=1)


def _bwd_space(args) -> list[Config]:
    rows, warps = _bwd_tile(args)
    row_options = [rows] if rows == 1 else sorted({max(1, rows // 2), rows, rows * 2})
    warp_options = sorted({max(1, warps // 2), warps, min(32, warps * 2)})
    # num_stages changed nothing measurable (the loop prefetches by hand): one value.
    return [Config(BR=r, num_warps=w, num_stages=1) for r in row_options
            for w in warp_options]


def _stats_default(args) -> Config:
    return Config(num_warps=max(1, min(16, args["BLOCK"] // 512)), num_stages=2)


def _stats_space(args) -> list[Config]:
    warps = _stats_default(args).num_warps
    return [Config(num_warps=w, num_stages=s) for w in sorted({max(1, warps // 2), warps,
                                                               min(32, warps * 2)})
            for s in (1, 2, 3)]


# ---------------------------------------------------------------------------- forward
@tuned(key=["D", "G", "BLOCK", "x", "residual_out", "ACTIVATION", "STATS_GIVEN"],
       default=_fwd_default, space=_fwd_space)
@triton.jit(do_not_specialize=["R"])
def norm_fwd_kernel(
    x, residual, weight, bias, g, y, residual_out, mean, rstd, eps, R,
    D: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr, NCHUNK: tl.constexpr,
    BR: tl.constexpr, IS_RMS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    STORE_RESIDUAL_OUT: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr, STATS_GIVEN: tl.constexpr,
):
    """One program: BR segments (single pass) or one BLOCK chunk of one segment
    (``STATS_GIVEN``: μ, rstd come from :func:`norm_fwd_stats_kernel`).

    x, residual, g, y, residual_out: ``[R, D]`` contiguous; weight, bias: ``[G·D]``;
    mean, rstd: fp32 ``[R]``. The program id is ``row_block · NCHUNK + chunk``.
    """
    i_p = tl.program_id(0)
    i_rb, i_c = i_p // NCHUNK, i_p % NCHUNK
    # int64 from here on: R·D may exceed 2^31 elements.
    o_r = i_rb.to(tl.int64) * BR + tl.arange(0, BR)
    m_r = o_r < R
    o_d = i_c * BLOCK + tl.arange(0, BLOCK)
    m_d = o_d < D
    mask = m_r[:, None] & m_d[None, :]
    offs = o_r[:, None] * D + o_d[None, :]

    b_s = tl.load(x + offs, mask=mask, other=0.).to(tl.float32)
    if HAS_RESIDUAL:
        b_s += tl.load(residual + offs, mask=mask, other=0.).to(tl.float32)
    if STORE_RESIDUAL_OUT:
        tl.store(residual_out + offs, b_s.to(residual_out.dtype.element_ty), mask=mask)

    if STATS_GIVEN:
        b_rstd = tl.load(rstd + o_r, mask=m_r, other=0.)
        b_mean = b_rstd
        if not IS_RMS_NORM:
            b_mean = tl.load(mean + o_r, mask=m_r, other=0.)
    else:
        if IS_RMS_NORM:
            b_mean = tl.zeros([BR], dtype=tl.float32)
            b_var = tl.sum(b_s * b_s, axis=1) / D
        else:
            b_mean = tl.sum(b_s, axis=1) / D
            # Two-pass variance (from the centred values, not E[s²] − μ²): no cancellation
            # when |μ| ≫ σ.
            b_c = tl.where(mask, b_s - b_mean[:, None], 0.)
            b_var = tl.sum(b_c * b_c, axis=1) / D
            tl.store(mean + o_r, b_mean, mask=m_r)
        b_rstd = 1. / tl.sqrt(b_var + eps)
        tl.store(rstd + o_r, b_rstd, mask=m_r)

    b_y = _normalized(b_s, b_mean, b_rstd, mask, IS_RMS_NORM)
    if G == 1:
        o_w = o_d[None, :]
        m_w = m_d[None, :]
    else:
        o_w = (o_r % G)[:, None] * D + o_d[None, :]
        m_w = mask
    if HAS_WEIGHT:
        b_y = b_y * tl.load(weight + o_w, mask=m_w, other=0.).to(tl.float32)
    if HAS_BIAS:
        b_y = b_y + tl.load(bias + o_w, mask=m_w, other=0.).to(tl.float32)
    if ACTIVATION != 0:
        b_g = tl.load(g + offs, mask=mask, other=0.).to(tl.float32)
        b_act, _ = _activation(b_g, ACTIVATION)
        b_y = b_y * b_act
    tl.store(y + offs, b_y.to(y.dtype.element_ty), mask=mask)


@tuned(key=["D", "BLOCK", "x", "IS_RMS_NORM"], default=_stats_default, space=_stats_space)
@triton.jit
def norm_fwd_stats_kernel(
    x, residual, mean, rstd, eps,
    D: tl.constexpr, BLOCK: tl.constexpr, NCHUNK: tl.constexpr,
    IS_RMS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    """Multi-pass forward statistics: one program per segment walks it in NCHUNK chunks;
    μ and rstd (fp32 ``[R]``) as :func:`norm_fwd_kernel` would compute them."""
    i_r = tl.program_id(0).to(tl.int64)
    base = i_r * D
    b_acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i_c in range(NCHUNK):
        o_d = i_c * BLOCK + tl.arange(0, BLOCK)
        m_d = o_d < D
        b_s = tl.load(x + base + o_d, mask=m_d, other=0.).to(tl.float32)
        if HAS_RESIDUAL:
            b_s += tl.load(residual + base + o_d, mask=m_d, other=0.).to(tl.float32)
        if IS_RMS_NORM:
            b_acc += b_s * b_s
        else:
            b_acc += b_s
    if IS_RMS_NORM:
        b_var = tl.sum(b_acc, axis=0) / D
    else:
        b_mean = tl.sum(b_acc, axis=0) / D
        tl.store(mean + i_r, b_mean)
        # A second walk for the centred variance (see norm_fwd_kernel); the segment is
        # still in L2 from the first.
        b_acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i_c in range(NCHUNK):
            o_d = i_c * BLOCK + tl.arange(0, BLOCK)
            m_d = o_d < D
            b_s = tl.load(x + base + o_d, mask=m_d, other=0.).to(tl.float32)
            if HAS_RESIDUAL:
                b_s += tl.load(residual + base + o_d, mask=m_d, other=0.).to(tl.float32)
            b_c = tl.where(m_d, b_s - b_mean, 0.)
            b_acc += b_c * b_c
        b_var = tl.sum(b_acc, axis=0) / D
    tl.store(rstd + i_r, 1. / tl.sqrt(b_var + eps))


# --------------------------------------------------------------------------- backward
@triton.jit
def _load_bwd_rows(x, dy, g, mean, rstd, o_n, o_d, m_d, N, i_g, G: tl.constexpr,
                   D: tl.constexpr, IS_RMS_NORM: tl.constexpr, ACTIVATION: tl.constexpr):
    """Rows o_n (group i_g) of s, dy, g as stored (converted at use: half the registers
    for 16-bit inputs while they wait) and their μ, rstd; masked rows read as 0."""
    m_n = o_n < N
    o_r = o_n * G + i_g
    mask = m_n[:, None] & m_d[None, :]
    offs = o_r[:, None] * D + o_d[None, :]
    b_s = tl.load(x + offs, mask=mask, other=0.)
    b_dy = tl.load(dy + offs, mask=mask, other=0.)
    b_g = b_dy
    if ACTIVATION != 0:
        b_g = tl.load(g + offs, mask=mask, other=0.)
    b_rstd = tl.load(rstd + o_r, mask=m_n, other=0.)
    b_mean = b_rstd
    if not IS_RMS_NORM:
        b_mean = tl.load(mean + o_r, mask=m_n, other=0.)
    return b_s, b_dy, b_g, b_mean, b_rstd


@tuned(key=["D", "G", "BLOCK", "x", "dy", "ACTIVATION", "STATS_GIVEN"],
       default=_bwd_default, space=_bwd_space)
@triton.jit(do_not_specialize=["N"])
def norm_bwd_kernel(
    x, weight, bias, g, dy, dresidual_out, dx, dresidual, dg, mean, rstd, dstats,
    dw, db, N,
    D: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr, NCHUNK: tl.constexpr,
    BR: tl.constexpr, IS_RMS_NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, HAS_DRESIDUAL_OUT: tl.constexpr,
    HAS_DRESIDUAL: tl.constexpr, STATS_GIVEN: tl.constexpr,
):
    """Persistent backward. Grid ``(G·NCHUNK, P)``: program (j, p) owns group
    j // NCHUNK, chunk j % NCHUNK of it, and the row blocks p, p + P, p + 2P, ...

    x is the normalised input s (``residual_out`` when one was stored), ``[N·G, D]``;
    ``dstats`` holds mean(ŝ·w), mean(w) per segment (``[N·G, 2]`` fp32) when
    ``STATS_GIVEN``; dw, db: fp32 ``[P, G·D]`` partials, every element written.
    """
    i_j, i_p = tl.program_id(0), tl.program_id(1)
    P = tl.num_programs(1)
    i_g, i_c = i_j // NCHUNK, i_j % NCHUNK
    o_d = i_c * BLOCK + tl.arange(0, BLOCK)
    m_d = o_d < D
    o_w = i_g * D + o_d

    b_w = tl.zeros([BLOCK], dtype=tl.float32)
    b_b = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_WEIGHT:
        b_w = tl.load(weight + o_w, mask=m_d, other=0.).to(tl.float32)
    if HAS_BIAS:
        b_b = tl.load(bias + o_w, mask=m_d, other=0.).to(tl.float32)
    # Summed over rows in registers; reduced over the BR rows once, at the end.
    b_dw = tl.zeros([BR, BLOCK], dtype=tl.float32)
    b_db = tl.zeros([BR, BLOCK], dtype=tl.float32)

    # Row blocks are loaded one iteration ahead: the next block's loads are in flight
    # while this one is reduced and stored (on H100, 7-15% faster than loading at the
    # top of each iteration, which waits for every load before the row sums).
    o_n = i_p * BR + tl.arange(0, BR).to(tl.int64)
    b_s, b_dy, b_g, b_mean, b_rstd = _load_bwd_rows(x, dy, g, mean, rstd, o_n, o_d, m_d, N,
                                                    i_g, G, D, IS_RMS_NORM, ACTIVATION)
    for _ in range(i_p, tl.cdiv(N, BR), P):
        o_next = o_n + P * BR
        n_s, n_dy, n_g, n_mean, n_rstd = _load_bwd_rows(x, dy, g, mean, rstd, o_next, o_d,
                                                        m_d, N, i_g, G, D, IS_RMS_NORM,
                                                        ACTIVATION)
        m_n = o_n < N
        o_r = o_n * G + i_g
        mask = m_n[:, None] & m_d[None, :]
        offs = o_r[:, None] * D + o_d[None, :]

        b_xhat = _normalized(b_s.to(tl.float32), b_mean, b_rstd, mask, IS_RMS_NORM)
        b_u, b_wdy, b_dg = _gated_grad(b_xhat, b_dy.to(tl.float32), b_w[None, :],
                                       b_b[None, :], b_g.to(tl.float32), HAS_WEIGHT,
                                       HAS_BIAS, ACTIVATION)
        if ACTIVATION != 0:
            tl.store(dg + offs, b_dg.to(dg.dtype.element_ty), mask=mask)
        if HAS_WEIGHT:
            b_dw += b_u * b_xhat
        if HAS_BIAS:
            b_db += b_u

        if STATS_GIVEN:
            b_c1 = tl.load(dstats + o_r * 2, mask=m_n, other=0.)
            b_c2 = tl.load(dstats + o_r * 2 + 1, mask=m_n, other=0.)
        else:
            b_c1 = tl.sum(b_xhat * b_wdy, axis=1) / D
            b_c2 = tl.sum(b_wdy, axis=1) / D
        if IS_RMS_NORM:
            b_ds = (b_wdy - b_xhat * b_c1[:, None]) * b_rstd[:, None]
        else:
            b_ds = (b_wdy - b_xhat * b_c1[:, None] - b_c2[:, None]) * b_rstd[:, None]
        if HAS_DRESIDUAL_OUT:
            b_ds += tl.load(dresidual_out + offs, mask=mask, other=0.).to(tl.float32)
        tl.store(dx + offs, b_ds.to(dx.dtype.element_ty), mask=mask)
        if HAS_DRESIDUAL:
            tl.store(dresidual + offs, b_ds.to(dresidual.dtype.element_ty), mask=mask)

        o_n = o_next
        b_s, b_dy, b_g, b_mean, b_rstd = n_s, n_dy, n_g, n_mean, n_rstd

    o_part = i_p.to(tl.int64) * (G * D) + o_w
    if HAS_WEIGHT:
        tl.store(dw + o_part, tl.sum(b_dw, axis=0), mask=m_d)
    if HAS_BIAS:
        tl.store(db + o_part, tl.sum(b_db, axis=0), mask=m_d)


@tuned(key=["D", "BLOCK", "x", "dy", "IS_RMS_NORM", "ACTIVATION"],
       default=_stats_default, space=_stats_space)
@triton.jit
def norm_bwd_stats_kernel(
    x, weight, bias, g, dy, mean, rstd, dstats,
    D: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr, NCHUNK: tl.constexpr,
    IS_RMS_NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
):
    """Multi-pass backward statistics: mean(ŝ·w) and mean(w) of each segment into
    ``dstats[r, 0:2]``, walking it in NCHUNK chunks."""
    i_r = tl.program_id(0).to(tl.int64)
    base = i_r * D
    i_g = i_r % G
    b_rstd = tl.load(rstd + i_r + tl.zeros([1], dtype=tl.int64))
    b_mean = b_rstd
    if not IS_RMS_NORM:
        b_mean = tl.load(mean + i_r + tl.zeros([1], dtype=tl.int64))
    b_acc1 = tl.zeros([1, BLOCK], dtype=tl.float32)
    b_acc2 = tl.zeros([1, BLOCK], dtype=tl.float32)
    for i_c in range(NCHUNK):
        o_d = i_c * BLOCK + tl.arange(0, BLOCK)
        m_d = (o_d < D)[None, :]
        offs = base + o_d[None, :]
        b_s = tl.load(x + offs, mask=m_d, other=0.).to(tl.float32)
        b_dy = tl.load(dy + offs, mask=m_d, other=0.).to(tl.float32)
        b_xhat = _normalized(b_s, b_mean, b_rstd, m_d, IS_RMS_NORM)
        b_w = b_dy
        b_b = b_dy
        b_g = b_dy
        if HAS_WEIGHT:
            b_w = tl.load(weight + i_g * D + o_d[None, :], mask=m_d, other=0.).to(tl.float32)
        if HAS_BIAS:
            b_b = tl.load(bias + i_g * D + o_d[None, :], mask=m_d, other=0.).to(tl.float32)
        if ACTIVATION != 0:
            b_g = tl.load(g + offs, mask=m_d, other=0.).to(tl.float32)
        _, b_wdy, _ = _gated_grad(b_xhat, b_dy, b_w, b_b, b_g, HAS_WEIGHT, HAS_BIAS,
                                  ACTIVATION)
        b_acc1 += b_xhat * b_wdy
        b_acc2 += b_wdy
    o_two = tl.arange(0, 2)
    b_out = tl.where(o_two == 0, tl.sum(tl.sum(b_acc1, axis=1), axis=0),
                     tl.sum(tl.sum(b_acc2, axis=1), axis=0)) / D
    tl.store(dstats + i_r * 2 + o_two, b_out)


# -------------------------------------------------------------------------- launchers
def row_layout(D: int, limit: int | None = None) -> tuple[int, int]:
    """(BLOCK, NCHUNK) for segments of D elements: one power-of-two block holding the
    whole segment, or (wider than ``limit``, default ``MAX_SINGLE_PASS_D``) NCHUNK
    chunks of BLOCK."""
    if D <= (MAX_SINGLE_PASS_D if limit is None else limit):
        return next_power_of_2(D), 1
    block = min(MULTI_PASS_BLOCK, next_power_of_2(D))
    return block, cdiv(D, block)


def _backward_programs(N: int, groups_and_chunks: int, device: torch.device) -> int:
    """P, the persistent grid's row dimension: two programs per SM in all (on H100 with
    the prefetching loop, 2 beat 3 and 4 at D = 128 to 8192; more programs also grow
    the [P, G·D] partials), never more programs than rows."""
    sms = multiprocessor_count(device.index or 0) if device.type == "cuda" else 1
    return max(1, min(N, cdiv(2 * sms, groups_and_chunks)))


def _check_contiguous(*tensors: torch.Tensor | None) -> None:
    """The kernels index rows as a contiguous [N, G·D]: any other layout would be read
    wrong, so it is refused (the public norms make their inputs contiguous first)."""
    for t in tensors:
        if t is not None and not t.is_contiguous():
            raise ValueError(f"norm kernels: expected contiguous tensors, got shape "
                             f"{tuple(t.shape)} with strides {t.stride()}")


def norm_fwd(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
             residual: torch.Tensor | None, g: torch.Tensor | None, eps: float,
             num_groups: int, is_rms_norm: bool, activation: int,
             residual_dtype: torch.dtype | None, y_dtype: torch.dtype | None = None):
    """Forward over the N rows of ``x: [..., G·D]`` (contiguous; residual and g alike).

    Returns ``(y shaped like x in y_dtype (None: x's), residual_out or None, mean [N·G] fp32 or
    None, rstd [N·G] fp32)``; ``residual_out = x + residual`` in ``residual_dtype`` is
    stored only when ``residual_dtype`` is given. Rows are never reshaped here: the
    kernels index contiguous rows, and a view per call costs host time.
    """
    _check_contiguous(x, residual, g)
    width = x.shape[-1]
    N = x.numel() // width
    G = num_groups
    D = width // G
    R = N * G
    BLOCK, NCHUNK = row_layout(D)
    # empty_like of the contiguous x: the fastest allocation call on the host.
    y = torch.empty_like(x, dtype=y_dtype)
    residual_out = None
    if residual_dtype is not None:
        residual_out = torch.empty_like(x, dtype=residual_dtype)
    rstd = torch.empty(R, dtype=torch.float32, device=x.device)
    mean = None if is_rms_norm else torch.empty(R, dtype=torch.float32, device=x.device)
    if NCHUNK > 1:
        norm_fwd_stats_kernel[(R,)](
            x=x, residual=residual, mean=mean, rstd=rstd, eps=eps, D=D, BLOCK=BLOCK,
            NCHUNK=NCHUNK, IS_RMS_NORM=is_rms_norm, HAS_RESIDUAL=residual is not None)
    # Bound launches (tensors apart from scalars): the host time of a launch is a large
    # share of a norm's step on slow hosts.
    norm_fwd_kernel.launch_bound(
        lambda meta: (cdiv(R, meta["BR"]) * NCHUNK,),
        dict(x=x, residual=residual, weight=weight, bias=bias, g=g, y=y,
             residual_out=residual_out, mean=mean, rstd=rstd),
        dict(eps=eps, R=R, D=D, G=G, BLOCK=BLOCK, NCHUNK=NCHUNK, IS_RMS_NORM=is_rms_norm,
             HAS_RESIDUAL=residual is not None, STORE_RESIDUAL_OUT=residual_out is not None,
             HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, ACTIVATION=activation,
             STATS_GIVEN=NCHUNK > 1))
    return y, residual_out, mean, rstd


def norm_bwd(dy: torch.Tensor, s: torch.Tensor, weight: torch.Tensor | None,
             bias: torch.Tensor | None, g: torch.Tensor | None, mean: torch.Tensor | None,
             rstd: torch.Tensor, dresidual_out: torch.Tensor | None, num_groups: int,
             is_rms_norm: bool, activation: int, x_dtype: torch.dtype,
             residual_dtype: torch.dtype | None):
    """Backward of :func:`norm_fwd`; ``s`` is what was normalised (x, or residual_out),
    ``[..., G·D]`` contiguous, dy, g and dresidual_out alike.

    Returns ``(dx in x_dtype, dresidual in residual_dtype or None, dg or None,
    dweight or None, dbias or None)``, each shaped like its input; dweight and dbias in
    the parameter's dtype.
    """
    _check_contiguous(dy, s, g, dresidual_out)
    width = s.shape[-1]
    N = s.numel() // width
    G = num_groups
    D = width // G
    BLOCK, NCHUNK = row_layout(D, min(MAX_SINGLE_PASS_D, MAX_SINGLE_PASS_BWD_D))
    dx = torch.empty_like(s, dtype=x_dtype)
    dresidual = None
    if residual_dtype is not None:
        dresidual = torch.empty_like(s, dtype=residual_dtype)
    dg = None if g is None else torch.empty_like(g)
    dstats = None
    if NCHUNK > 1:
        dstats = torch.empty(N * G, 2, dtype=torch.float32, device=s.device)
        norm_bwd_stats_kernel[(N * G,)](
            x=s, weight=weight, bias=bias, g=g, dy=dy, mean=mean, rstd=rstd, dstats=dstats,
            D=D, G=G, BLOCK=BLOCK, NCHUNK=NCHUNK, IS_RMS_NORM=is_rms_norm,
            HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, ACTIVATION=activation)
    P = _backward_programs(N, G * NCHUNK, s.device)
    dw_part = None if weight is None else torch.empty(P, width, dtype=torch.float32,
                                                      device=s.device)
    db_part = None if bias is None else torch.empty(P, width, dtype=torch.float32,
                                                    device=s.device)
    norm_bwd_kernel.launch_bound(
        (G * NCHUNK, P),
        dict(x=s, weight=weight, bias=bias, g=g, dy=dy, dresidual_out=dresidual_out, dx=dx,
             dresidual=dresidual, dg=dg, mean=mean, rstd=rstd, dstats=dstats, dw=dw_part,
             db=db_part),
        dict(N=N, D=D, G=G, BLOCK=BLOCK, NCHUNK=NCHUNK, IS_RMS_NORM=is_rms_norm,
             HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, ACTIVATION=activation,
             HAS_DRESIDUAL_OUT=dresidual_out is not None,
             HAS_DRESIDUAL=dresidual is not None, STATS_GIVEN=NCHUNK > 1))
    dweight, dbias = sum_partial_pair(dw_part, weight, db_part, bias)
    return dx, dresidual, dg, dweight, dbias
