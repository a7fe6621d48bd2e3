"""Short causal depthwise convolution over time (the "short conv" of linear-attention
layers), forward, backward and the one-token decode step.

Per channel d, with the kernel ``w[d, 0..W-1]`` and the history h of the sequence::

    z_t = b_d + Σ_{i<W} w[d, i] · x_{t − (W−1) + i}        y_t = act(z_t)

``x_s`` for s < 0 comes from the cache (zeros without one): ``cache[n, d, W + s]``, so
the cache ``[N, D, W]`` holds a sequence's last W inputs, the most recent last, and its
oldest column is dropped by the next token (the layout the reference library's layers
pass around). ``act`` is SiLU or the identity.

Backward, with ``dz_t = dy_t · act'(z_t)``::

    dx_s      = Σ_i w[d, i] · dz_{s + (W−1) − i}          (s ≥ 0: x; s < 0: the cache)
    dw[d, i]  = Σ_t dz_t · x_{t − (W−1) + i}             db_d = Σ_t dz_t

plus what flows back from the final cache, which copies the last W inputs. Two passes:
the first recomputes z, writes dz (only with an activation; else dz is dy) and sums dw
and db; the second reads dz at W shifts for dx. dx needs dz W − 1 rows past a tile,
which one fused pass would have to recompute W times over (W² loads of x a row: it ran
at a fifth of the copy bandwidth on an H100).

The kernels run behind the custom ops ``fla::causal_conv1d_fwd`` / ``_bwd`` and
``fla::causal_conv1d_update`` (which writes the cache in place), so that
``torch.compile`` traces through training and decoding steps. Packed sequences read
their offsets on the host before the op: a graph break there.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.language as tl

from fla.ops.utils.index import locate_sequence_chunk, varlen_chunk_indices
from fla.ops.utils.partial_sums import sum_partial_pair
from fla.utils.backend import Backend, select_backend
from fla.utils.custom_ops import (
    decode_op,
    needs_backward,
    outside_graph,
    present,
    stage_op,
    upstream_grads,
)
from fla.utils.grid import cdiv, next_power_of_2
from fla.utils.tuning import Config, tuned
from fla.utils.validation import (
    Dims,
    check_cu_seqlens,
    check_positive_length,
    check_same_device,
    check_shape,
    check_tensor,
    contiguous_or_none,
)

__all__ = [
    "ShortConvolution", "causal_conv1d", "causal_conv1d_update",
    "causal_conv1d_fwd_kernel", "causal_conv1d_bwd_dw_kernel", "causal_conv1d_bwd_dx_kernel",
    "causal_conv1d_update_kernel",
]

ACTIVATIONS = (None, "silu", "swish")

# Tokens per program. Fixed by the launcher, not tuned: varlen launches precompute the
# list of (sequence, chunk) pairs for it on the host. 64 rows × BD channels of W shifted
# loads each keep the tile in L1 (the W loads overlap in all but W − 1 rows).
CONV_BT = 64


def _default(args, num_warps: int = 4) -> Config:
    # 64 channels × 64 rows on 4 warps. On an H100 (B=4, T=4096, D=4096, W=4, bf16,
    # Triton 3.6) it was the fastest forward (120-134 us, 2.0-2.2 TB/s) of BD in
    # {16, ..., 256} × warps in {1, 2, 4, 8}, although ptxas spills a few hundred bytes
    # with a cache (the W shifted x and cache tiles are all in flight at once).
    return Config(BD=min(64, next_power_of_2(args["D"])), num_warps=num_warps,
                  num_stages=1)


def _default_dw(args) -> Config:
    # Backward pass 1 at 2 warps: on an H100 (B=4, T=4096, D=3072, W=4, SiLU, bf16,
    # Triton 3.6; FLA_TUNE=1 over the space below) the whole backward took 0.267 ms with
    # it against 0.355 ms at 4 warps (its per-program column sums cross fewer warps).
    return _default(args, num_warps=2)


def _space(args) -> list[Config]:
    widths = sorted({min(bd, next_power_of_2(args["D"])) for bd in (16, 32, 64, 128, 256)})
    return [Config(BD=bd, num_warps=w, num_stages=1) for bd in widths for w in (1, 2, 4, 8)]


@triton.jit
def _load_rows(x, h0, rows, bos, T, i_n, o_d, m_d, D, W: tl.constexpr,
               HAS_H0: tl.constexpr):
    """x at sequence-local rows (``[len(rows), BD]`` float32): rows in [0, T) from x, rows
    in [−(W−1), 0) from the cache (column W + row), anything else 0."""
    m_x = ((rows >= 0) & (rows < T))[:, None] & m_d[None, :]
    b_x = tl.load(x + (bos + rows)[:, None] * D + o_d[None, :], mask=m_x, other=0.)
    b_x = b_x.to(tl.float32)
    if HAS_H0:
        col = rows + W
        m_h = ((rows < 0) & (col >= 1))[:, None] & m_d[None, :]
        p_h = h0 + (i_n.to(tl.int64) * D + o_d[None, :]) * W + col[:, None]
        b_x += tl.load(p_h, mask=m_h, other=0.).to(tl.float32)
    return b_x


@tuned(key=["D", "W", "x", "ACTIVATION"], default=_default, space=_space)
@triton.jit(do_not_specialize=["T"])
def causal_conv1d_fwd_kernel(
    x, w, b, h0, y, ht, cu_seqlens, chunk_indices, T,
    D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr,
    STORE_FINAL: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """One program per (chunk of BT tokens, BD channels, batch row); the W taps of its
    channels stay in registers. The program holding a sequence's last chunk also writes
    its final cache. Axis 0 runs over (chunk, channel block) with the channels fastest,
    so that programs running together read whole token rows (DRAM locality); axis 1 is
    the batch row."""
    ND = tl.cdiv(D, BD)
    i_dt, i_b = tl.program_id(0), tl.program_id(1)
    i_t, i_d = i_dt // ND, i_dt % ND
    i_n, i_t, bos, T = locate_sequence_chunk(i_t, i_b, T, cu_seqlens, chunk_indices,
                                             IS_VARLEN)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D

    b_y = tl.zeros([BT, BD], dtype=tl.float32)
    if HAS_BIAS:
        b_y += tl.load(b + o_d, mask=m_d, other=0.).to(tl.float32)[None, :]
    for i in tl.static_range(W):
        b_w = tl.load(w + o_d * W + i, mask=m_d, other=0.).to(tl.float32)
        b_y += _load_rows(x, h0, o_t - (W - 1) + i, bos, T, i_n, o_d, m_d, D, W,
                          HAS_H0) * b_w[None, :]
    if ACTIVATION:
        b_y = b_y * tl.sigmoid(b_y)
    m_y = (o_t < T)[:, None] & m_d[None, :]
    tl.store(y + (bos + o_t)[:, None] * D + o_d[None, :], b_y.to(y.dtype.element_ty), mask=m_y)

    if STORE_FINAL:
        if i_t == tl.cdiv(T, BT) - 1:
            # Final cache column j holds the input at row T − W + j (the cache's own
            # columns when the sequence is shorter than W).
            o_w = tl.arange(0, BW)
            b_h = _load_rows(x, h0, T - W + o_w, bos, T, i_n, o_d, m_d, D, W, HAS_H0)
            p_ht = ht + (i_n.to(tl.int64) * D + o_d[None, :]) * W + o_w[:, None]
            tl.store(p_ht, b_h.to(ht.dtype.element_ty), mask=(o_w < W)[:, None] & m_d[None, :])


@tuned(key=["D", "W", "x", "ACTIVATION"], default=_default_dw, space=_space)
@triton.jit(do_not_specialize=["T"])
def causal_conv1d_bwd_dw_kernel(
    x, w, b, h0, dy, dz, dw, db, cu_seqlens, chunk_indices, T,
    D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """Backward pass 1, one program per (chunk, BD channels, batch row): dz = dy · act'(z)
    (z recomputed; dz written only with an activation, else it is dy) and the chunk's
    partial sums of dw ``[D, W]`` and db ``[D]``, one slice per program, summed by the
    launcher (no atomics: the result is deterministic)."""
    ND = tl.cdiv(D, BD)
    i_dt, i_b = tl.program_id(0), tl.program_id(1)
    i_t, i_d = i_dt // ND, i_dt % ND
    i_p = (i_b * (tl.num_programs(0) // ND) + i_t).to(tl.int64)
    i_n, i_t, bos, T = locate_sequence_chunk(i_t, i_b, T, cu_seqlens, chunk_indices,
                                             IS_VARLEN)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    m_y = (o_t < T)[:, None] & m_d[None, :]
    p_y = (bos + o_t)[:, None] * D + o_d[None, :]

    b_dz = tl.load(dy + p_y, mask=m_y, other=0.).to(tl.float32)
    if ACTIVATION:
        b_z = tl.zeros([BT, BD], dtype=tl.float32)
        if HAS_BIAS:
            b_z += tl.load(b + o_d, mask=m_d, other=0.).to(tl.float32)[None, :]
        for i in tl.static_range(W):
            b_w = tl.load(w + o_d * W + i, mask=m_d, other=0.).to(tl.float32)
            b_z += _load_rows(x, h0, o_t - (W - 1) + i, bos, T, i_n, o_d, m_d, D, W,
                              HAS_H0) * b_w[None, :]
        b_s = tl.sigmoid(b_z)
        b_dz = b_dz * b_s * (1. + b_z * (1. - b_s))
        tl.store(dz + p_y, b_dz.to(dz.dtype.element_ty), mask=m_y)
    for i in tl.static_range(W):
        b_x = _load_rows(x, h0, o_t - (W - 1) + i, bos, T, i_n, o_d, m_d, D, W, HAS_H0)
        tl.store(dw + (i_p * D + o_d) * W + i, tl.sum(b_dz * b_x, 0), mask=m_d)
    if HAS_BIAS:
        tl.store(db + i_p * D + o_d, tl.sum(b_dz, 0), mask=m_d)


@tuned(key=["D", "W", "dz"], default=_default, space=_space)
@triton.jit(do_not_specialize=["T"])
def causal_conv1d_bwd_dx_kernel(
    w, dz, dht, dx, dh0, cu_seqlens, chunk_indices, T,
    D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr,
    HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """Backward pass 2, one program per (chunk, BD channels, batch row): dx of its rows
    (``Σ_i w_i dz_{s+W−1−i}`` plus the final cache's gradient) and, where the chunk is a
    sequence's first, the gradient of the initial cache."""
    ND = tl.cdiv(D, BD)
    i_dt, i_b = tl.program_id(0), tl.program_id(1)
    i_t, i_d = i_dt // ND, i_dt % ND
    i_n, i_t, bos, T = locate_sequence_chunk(i_t, i_b, T, cu_seqlens, chunk_indices,
                                             IS_VARLEN)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    m_y = (o_t < T)[:, None] & m_d[None, :]

    b_dx = tl.zeros([BT, BD], dtype=tl.float32)
    for i in tl.static_range(W):
        b_w = tl.load(w + o_d * W + i, mask=m_d, other=0.).to(tl.float32)
        # dz is zero past the sequence end (and no row here is before its start).
        b_dx += _load_rows(dz, dz, o_t + (W - 1) - i, bos, T, i_n, o_d, m_d, D, W,
                           False) * b_w[None, :]
    if HAS_DHT:
        # The final cache copies x at rows T − W .. T − 1.
        o_j = o_t - (T - W)
        m_j = (o_j >= 0)[:, None] & m_y
        p_dht = dht + (i_n.to(tl.int64) * D + o_d[None, :]) * W + o_j[:, None]
        b_dx += tl.load(p_dht, mask=m_j, other=0.).to(tl.float32)
    tl.store(dx + (bos + o_t)[:, None] * D + o_d[None, :], b_dx.to(dx.dtype.element_ty),
             mask=m_y)

    if STORE_DH0:
        if i_t == 0:
            # Cache column c plays x at row c − W (column 0 is dropped: its gradient is 0).
            o_c = tl.arange(0, BW)
            b_dh = tl.zeros([BW, BD], dtype=tl.float32)
            for i in tl.static_range(W):
                b_w = tl.load(w + o_d * W + i, mask=m_d, other=0.).to(tl.float32)
                b_dh += _load_rows(dz, dz, o_c - W + (W - 1) - i, bos, T, i_n, o_d, m_d, D,
                                   W, False) * b_w[None, :]
            if HAS_DHT:
                # A sequence shorter than W keeps cache columns c ≥ T in its final cache.
                # (Names differ from the tiles above: a branch on i_t may not re-type them.)
                m_kept = ((o_c >= T) & (o_c < W))[:, None] & m_d[None, :]
                p_kept = dht + (i_n.to(tl.int64) * D + o_d[None, :]) * W + (o_c - T)[:, None]
                b_dh += tl.load(p_kept, mask=m_kept, other=0.).to(tl.float32)
            p_dh0 = dh0 + (i_n.to(tl.int64) * D + o_d[None, :]) * W + o_c[:, None]
            tl.store(p_dh0, b_dh.to(dh0.dtype.element_ty),
                     mask=(o_c < W)[:, None] & m_d[None, :])


def _step_default(args) -> Config:
    return Config(BD=min(256, next_power_of_2(args["D"])), num_warps=4, num_stages=1)


def _step_space(args) -> list[Config]:
    widths = sorted({min(bd, next_power_of_2(args["D"])) for bd in (64, 128, 256, 512)})
    return [Config(BD=bd, num_warps=w, num_stages=1) for bd in widths for w in (1, 2, 4)]


@tuned(key=["D", "W", "x", "ACTIVATION"], default=_step_default, space=_step_space,
       restore=["cache"])
@triton.jit
def causal_conv1d_update_kernel(
    x, w, b, cache, y, s_n, s_d, s_w,
    D: tl.constexpr, W: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """One program per (BD channels, sequence): shift the cache left by one, append x,
    and y = act(b + Σ_i w_i · cache_i). The cache is updated in place (strides given, so
    a view into a larger state works); the program reads its whole slice first."""
    i_d, i_n = tl.program_id(0), tl.program_id(1)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    o_w = tl.arange(0, BW)
    p_c = cache + i_n.to(tl.int64) * s_n + o_d[:, None] * s_d
    b_x = tl.load(x + i_n.to(tl.int64) * D + o_d, mask=m_d, other=0.)
    b_c = tl.load(p_c + (o_w[None, :] + 1) * s_w,
                  mask=m_d[:, None] & (o_w < W - 1)[None, :], other=0.)
    b_c = tl.where((o_w == W - 1)[None, :], b_x[:, None].to(b_c.dtype), b_c)
    b_w = tl.load(w + o_d[:, None] * W + o_w[None, :],
                  mask=m_d[:, None] & (o_w < W)[None, :], other=0.).to(tl.float32)
    b_y = tl.sum(b_c.to(tl.float32) * b_w, 1)
    if HAS_BIAS:
        b_y += tl.load(b + o_d, mask=m_d, other=0.).to(tl.float32)
    if ACTIVATION:
        b_y = b_y * tl.sigmoid(b_y)
    tl.store(y + i_n.to(tl.int64) * D + o_d, b_y.to(y.dtype.element_ty), mask=m_d)
    tl.store(p_c + o_w[None, :] * s_w, b_c, mask=m_d[:, None] & (o_w < W)[None, :])


# ------------------------------------------------------------------------ launchers
def _grid(B: int, T: int, chunk_indices) -> tuple[int, int]:
    """(chunks per row, rows) of a launch: every chunk of the packed row under varlen."""
    if chunk_indices is None:
        return cdiv(T, CONV_BT), B
    return chunk_indices.shape[0], 1


def _conv_fwd_triton(x, weight, bias, h0, output_final_state, activation, cu_seqlens,
                     chunk_indices, N):
    """Forward on contiguous inputs (x ``[B, T, D]``, weight ``[D, W]``, h0 ``[N, D, W]``;
    under varlen cu_seqlens and its chunk list on x's device): ``(y, final cache or
    None)``."""
    B, T, D = x.shape
    W = weight.shape[1]
    NT, rows = _grid(B, T, chunk_indices)
    y = torch.empty_like(x)
    ht = x.new_empty(N, D, W) if output_final_state else None
    causal_conv1d_fwd_kernel[lambda meta: (NT * cdiv(D, meta["BD"]), rows)](
        x=x, w=weight, b=bias, h0=h0, y=y, ht=ht, cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices, T=T, D=D, W=W, BT=CONV_BT, BW=next_power_of_2(W),
        ACTIVATION=activation is not None, HAS_BIAS=bias is not None, HAS_H0=h0 is not None,
        STORE_FINAL=output_final_state, IS_VARLEN=chunk_indices is not None,
    )
    return y, ht


def _conv_bwd_triton(x, weight, bias, h0, dy, dht, activation, cu_seqlens, chunk_indices, N,
                     need_dh0: bool):
    """``(dx, dw, db or None, dh0 or None)`` in the inputs' dtypes; arguments as
    :func:`_conv_fwd_triton`'s, dy and dht contiguous."""
    B, T, D = x.shape
    W = weight.shape[1]
    NT, rows = _grid(B, T, chunk_indices)
    varlen = dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
                  IS_VARLEN=chunk_indices is not None)
    # With an activation, pass 1 writes dz (in x's dtype: pass 2 reads it W times over)
    # for pass 2; without one dz is dy itself.
    dz = torch.empty_like(x) if activation is not None else dy
    dw = torch.empty(rows * NT, D, W, dtype=torch.float32, device=x.device)
    db = (torch.empty(rows * NT, D, dtype=torch.float32, device=x.device)
          if bias is not None else None)
    causal_conv1d_bwd_dw_kernel[lambda meta: (NT * cdiv(D, meta["BD"]), rows)](
        x=x, w=weight, b=bias, h0=h0, dy=dy, dz=dz, dw=dw, db=db, T=T, D=D, W=W, BT=CONV_BT,
        ACTIVATION=activation is not None, HAS_BIAS=bias is not None, HAS_H0=h0 is not None,
        **varlen,
    )
    dx = torch.empty_like(x)
    dh0 = torch.empty(N, D, W, dtype=torch.float32, device=x.device) if need_dh0 else None
    causal_conv1d_bwd_dx_kernel[lambda meta: (NT * cdiv(D, meta["BD"]), rows)](
        w=weight, dz=dz, dht=dht, dx=dx, dh0=dh0, T=T, D=D, W=W, BT=CONV_BT,
        BW=next_power_of_2(W), HAS_DHT=dht is not None, STORE_DH0=need_dh0, **varlen,
    )
    dw, db = sum_partial_pair(dw, weight, db, bias)
    dh0 = dh0.to(h0.dtype) if need_dh0 else None
    return dx, dw, db, dh0


def _conv_update_triton(x, cache, weight, bias, activation) -> torch.Tensor:
    """One decoding step on contiguous x ``[N, D]``, weight ``[D, W]``: returns y ``[N, D]``
    and updates ``cache [N, D, W]`` (any strides) in place."""
    N, D = x.shape
    W = weight.shape[1]
    y = torch.empty_like(x)
    causal_conv1d_update_kernel[lambda meta: (cdiv(D, meta["BD"]), N)](
        x=x, w=weight, b=bias, cache=cache, y=y, s_n=cache.stride(0), s_d=cache.stride(1),
        s_w=cache.stride(2), D=D, W=W, BW=next_power_of_2(W),
        ACTIVATION=activation is not None, HAS_BIAS=bias is not None,
    )
    return y


# ----------------------------------------------------------------------- custom ops
# Forward and backward as the custom ops fla::causal_conv1d_fwd / _bwd (one node each
# under torch.compile; their fakes are the launchers with the launches skipped), joined by
# the autograd formula below. Under varlen the chunk list is built on the host before the
# op, from the offsets that the argument checks read.
_conv_fwd_op = stage_op(
    "causal_conv1d_fwd", _conv_fwd_triton, label="causal_conv1d.fwd",
    schema="(Tensor x, Tensor weight, Tensor? bias, Tensor? h0, bool output_final_state, "
           "str? activation, Tensor? cu_seqlens, Tensor? chunk_indices, int N) "
           "-> (Tensor, Tensor)", ahead=False)
_conv_bwd_op = stage_op(
    "causal_conv1d_bwd", _conv_bwd_triton, label="causal_conv1d.bwd",
    schema="(Tensor x, Tensor weight, Tensor? bias, Tensor? h0, Tensor dy, Tensor? dht, "
           "str? activation, Tensor? cu_seqlens, Tensor? chunk_indices, int N, "
           "bool need_dh0) -> (Tensor, Tensor, Tensor, Tensor)", ahead=False)


def _setup_context(ctx, inputs, output):
    x, weight, bias, h0, output_final_state, activation, cu_seqlens, chunk_indices, N = inputs
    ctx.save_for_backward(x, weight, bias, h0, cu_seqlens, chunk_indices)
    ctx.activation, ctx.N, ctx.output_final_state = activation, N, output_final_state
    ctx.set_materialize_grads(False)


def _backward_formula(ctx, dy, dht):
    x, weight, bias, h0, cu_seqlens, chunk_indices = ctx.saved_tensors
    dy, dht = upstream_grads(dy, dht, x, ctx.output_final_state)
    need_dh0 = h0 is not None and ctx.needs_input_grad[3]
    dx, dw, db, dh0 = _conv_bwd_op(x, weight, bias, h0, dy, dht, ctx.activation, cu_seqlens,
                                   chunk_indices, ctx.N, need_dh0)
    return (dx, dw, present(db, bias is not None), present(dh0, need_dh0),
            None, None, None, None, None)


_conv_fwd_op.register_autograd(_backward_formula, setup_context=_setup_context)


# The decoding step as fla::causal_conv1d_update, writing the cache in place (see
# fla.utils.custom_ops.decode_op).
_conv_update = decode_op(
    "causal_conv1d_update", _conv_update_triton, mutates="cache",
    schema="(Tensor x, Tensor(a!) cache, Tensor weight, Tensor? bias, str? activation) "
           "-> Tensor")



# Packed sequences' offsets are read on the host (validated, then the chunk list that
# sizes the grid is built from them, once per tensor: both cached). Under torch.compile
# these calls run eagerly, a graph break before the op, so that the graph holds no guard
# on the offsets' values: a compiled caller would recompile for every batch.
_host_offsets = outside_graph(check_cu_seqlens)


def _check_cu_seqlens(cu_seqlens: torch.Tensor | None, T: int, B: int) -> list[int] | None:
    """:func:`check_cu_seqlens`; without packed sequences no call (and no graph break)."""
    return None if cu_seqlens is None else _host_offsets(cu_seqlens, T=T, B=B)


@outside_graph
def _chunk_list(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[NT, 2]`` (sequence, chunk) rows of a packed batch."""
    return varlen_chunk_indices(cu_seqlens, CONV_BT)


def _conv_triton(x, weight, bias, h0, output_final_state, activation, cu_seqlens, N):
    """The Triton path through fla::causal_conv1d_fwd: ``(y, final cache or None)``.
    Made contiguous here, before the op, so that autograd saves the same tensors that
    the kernels read."""
    chunk_indices = None
    if cu_seqlens is not None:
        chunk_indices = _chunk_list(cu_seqlens).to(x.device)
        cu_seqlens = cu_seqlens.to(x.device)
    y, ht = _conv_fwd_op(x.contiguous(), weight.contiguous(), contiguous_or_none(bias),
                         contiguous_or_none(h0), output_final_state, activation, cu_seqlens,
                         chunk_indices, N)
    return y, present(ht, output_final_state)


# ---------------------------------------------------------------------- torch path
def _conv_torch(x, weight, bias, h0, output_final_state, activation, offsets):
    """Differentiable PyTorch path: each sequence padded on the left with its history
    (the cache's last W − 1 columns, or zeros) and convolved with ``F.conv1d``."""
    B, T, D = x.shape
    W = weight.shape[1]
    acc = torch.promote_types(x.dtype, torch.float32)
    w = weight.to(acc).unsqueeze(1)
    b = None if bias is None else bias.to(acc)
    if offsets is None:
        spans = [(n, slice(None)) for n in range(B)]
        rows = x.to(acc).transpose(1, 2)                              # [B, D, T]
        if h0 is None:
            hist = rows.new_zeros(B, D, W - 1)
        else:
            hist = h0[:, :, 1:].to(acc)
        ext = torch.cat([hist, rows], dim=-1)
        z = F.conv1d(ext, w, b, groups=D)
        finals = [ext[:, :, -W:]] if output_final_state else []
        y = z.transpose(1, 2)
    else:
        spans = list(zip(offsets[:-1], offsets[1:]))
        outs, finals = [], []
        for n, (bos, eos) in enumerate(spans):
            seq = x[0, bos:eos].to(acc).T                               # [D, L]
            hist = seq.new_zeros(D, W - 1) if h0 is None else h0[n, :, 1:].to(acc)
            ext = torch.cat([hist, seq], dim=-1)
            outs.append(F.conv1d(ext[None], w, b, groups=D)[0].T)
            if output_final_state:
                finals.append(ext[None, :, -W:])
        y = torch.cat(outs, dim=0)[None]
    if activation is not None:
        y = F.silu(y)
    ht = torch.cat(finals, dim=0).to(x.dtype) if output_final_state else None
    return y.to(x.dtype), ht


# ----------------------------------------------------------------------- functional
def _check_weight(weight, bias, D: int):
    check_tensor("weight", weight)
    if weight.dim() == 3:
        if weight.shape[1] != 1:
            raise ValueError(f"weight: expected a depthwise kernel [D, 1, W] (or [D, W]), got "
                             f"shape {tuple(weight.shape)}")
        weight = weight[:, 0]
    if weight.dim() != 2 or weight.shape[0] != D:
        raise ValueError(f"weight: expected shape [D, W] = [{D}, W] (D the channels of x), "
                         f"got {tuple(weight.shape)}")
    if weight.shape[1] < 1:
        raise ValueError(f"weight: expected a kernel width W >= 1, got {weight.shape[1]}")
    if bias is not None:
        check_tensor("bias", bias)
        if tuple(bias.shape) != (D,):
            raise ValueError(f"bias: expected shape [D] = [{D}], got {tuple(bias.shape)}")
    return weight


def _check_activation(activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    return None if activation is None else "silu"


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    activation: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal depthwise convolution over time.

    Args:
        x: ``[B, T, D]`` fp32/fp16/bf16.
        weight: ``[D, W]`` (or ``[D, 1, W]``, the ``nn.Conv1d`` layout).
        bias: ``[D]`` or None.
        initial_state: ``[N, D, W]`` cache of each sequence's previous W inputs (most
            recent last; column 0 is not used), or None for zero history.
        output_final_state: also return the cache after the sequence.
        activation: None or ``'silu'``/``'swish'``.
        cu_seqlens: ``[N + 1]`` packed-sequence offsets (B == 1): no sequence sees
            another's inputs. Without it N = B.

    Returns:
        ``(y, final_state)``: y ``[B, T, D]`` in x's dtype with
        ``y_t = act(b + Σ_i w[:, i] x_{t−W+1+i})``, and ``[N, D, W]`` (x's dtype) holding
        the last W inputs of each sequence, or None. Differentiable in x, weight, bias
        and initial_state.
    """
    check_tensor("x", x, ndim=3)
    dims = Dims()
    check_shape("x", x, "B T D", dims)
    check_positive_length(dims)
    B, T, D = x.shape
    weight = _check_weight(weight, bias, D)
    activation = _check_activation(activation)
    offsets = _check_cu_seqlens(cu_seqlens, T=T, B=B)
    N = B if offsets is None else len(offsets) - 1
    if initial_state is not None:
        check_tensor("initial_state", initial_state)
        if tuple(initial_state.shape) != (N, D, weight.shape[1]):
            raise ValueError(
                f"initial_state: expected shape [N, D, W] = [{N}, {D}, {weight.shape[1]}] "
                f"(N = {'len(cu_seqlens) - 1' if offsets is not None else 'B'}), got "
                f"{tuple(initial_state.shape)}")
    check_same_device(x=x, weight=weight, bias=bias, initial_state=initial_state)

    if select_backend(x) is Backend.TORCH:
        return _conv_torch(x, weight, bias, initial_state, output_final_state, activation,
                           offsets)
    return _conv_triton(x, weight, bias, initial_state, output_final_state, activation,
                        cu_seqlens, N)


def causal_conv1d_update(
    x: torch.Tensor,
    cache: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step: each of N sequences takes one token.

    Args:
        x: ``[N, D]`` (or ``[N, 1, D]``).
        cache: ``[N, D, W]`` the last W inputs of each sequence, most recent last;
            **updated in place** (shifted left by one, x appended).
        weight: ``[D, W]`` (or ``[D, 1, W]``); bias: ``[D]`` or None.
        activation: None or ``'silu'``/``'swish'``.

    Returns:
        ``(y, cache)``: y shaped like x, ``act(b + Σ_i w[:, i] · cache[:, :, i])`` after the
        update (the same numbers as the full-sequence path gives that token), and the
        updated cache (the tensor passed in). Not differentiable.
    """
    check_tensor("x", x)
    shape = x.shape
    if x.dim() == 3:
        if x.shape[1] != 1:
            raise ValueError(f"x: expected one token per sequence, [N, 1, D], got shape "
                             f"{tuple(x.shape)}")
        x = x[:, 0]
    if x.dim() != 2:
        raise ValueError(f"x: expected [N, D] or [N, 1, D], got shape {tuple(shape)}")
    N, D = x.shape
    weight = _check_weight(weight, bias, D)
    W = weight.shape[1]
    activation = _check_activation(activation)
    check_tensor("cache", cache)
    if tuple(cache.shape) != (N, D, W):
        raise ValueError(f"cache: expected shape [N, D, W] = [{N}, {D}, {W}], got "
                         f"{tuple(cache.shape)}")
    check_same_device(x=x, cache=cache, weight=weight, bias=bias)

    if select_backend(x) is Backend.TORCH:
        with torch.no_grad():
            cache.copy_(torch.cat([cache[:, :, 1:], x[:, :, None].to(cache.dtype)], dim=-1))
            acc = torch.promote_types(x.dtype, torch.float32)
            y = (cache.to(acc) * weight.to(acc)).sum(-1)
            if bias is not None:
                y = y + bias.to(acc)
            if activation is not None:
                y = F.silu(y)
        return y.to(x.dtype).view(shape), cache

    args = (x.contiguous(), cache, weight.contiguous(), contiguous_or_none(bias), activation)
    y = _conv_update(*args)
    return y.view(shape), cache


# --------------------------------------------------------------------------- module
class ShortConvolution(nn.Conv1d):
    """Depthwise causal convolution over time with a short kernel, as linear-attention
    layers apply it to q, k and v.

    Args:
        hidden_size: channels D (one kernel per channel; weight ``[D, 1, W]`` like a
            depthwise ``nn.Conv1d``, initialised the same way).
        kernel_size: W, the number of taps (the current token and W − 1 before it).
        bias: add a learned bias per channel.
        activation: None or ``'silu'``/``'swish'``, applied after the convolution.
    """

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool = False,
                 activation: str | None = "silu", device=None, dtype=None):
        super().__init__(hidden_size, hidden_size, kernel_size, groups=hidden_size,
                         padding=kernel_size - 1, bias=bias, device=device, dtype=dtype)
        self.hidden_size = hidden_size
        self.activation = _check_activation(activation)

    def extra_repr(self) -> str:
        text = super().extra_repr()
        return text + (f", activation={self.activation}" if self.activation else "")

    @property
    def width(self) -> int:
        return self.kernel_size[0]

    def forward(
        self,
        x: torch.Tensor,
        cache: torch.Tensor | None = None,
        output_final_state: bool = False,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Convolve a batch, or take one decoding step.

        Args:
            x: ``[B, T, D]``; with ``cu_seqlens`` B == 1 and the sequences packed on T.
            cache: ``[N, D, W]`` the previous W inputs of each sequence (most recent
                last), or None for zero history.
            output_final_state: return the cache after this call.
            cu_seqlens: ``[N + 1]`` packed-sequence offsets.

        Returns:
            ``(y, cache)``: y ``[B, T, D]`` and the new ``[N, D, W]`` cache (None unless
            ``output_final_state``).

        Decoding (a cache given, one token per sequence, nothing requiring grad) runs
        :meth:`step`, which updates ``cache`` in place; otherwise the cache passed in is
        left untouched and the returned one is new. Use the returned cache either way.
        """
        check_tensor("x", x, ndim=3)
        B, T, D = x.shape
        if D != self.hidden_size:
            raise ValueError(f"x: expected [B, T, D] with D = hidden_size = "
                             f"{self.hidden_size}, got {tuple(x.shape)}")
        offsets = _check_cu_seqlens(cu_seqlens, T=T, B=B)
        if cache is not None:
            # Named here as the caller knows it: causal_conv1d calls it initial_state.
            check_tensor("cache", cache)
            N = B if offsets is None else len(offsets) - 1
            if tuple(cache.shape) != (N, D, self.width):
                raise ValueError(
                    f"cache: expected shape [N, D, W] = [{N}, {D}, {self.width}] (N = "
                    f"{'len(cu_seqlens) - 1' if offsets is not None else 'B'}, W = "
                    f"kernel_size), got {tuple(cache.shape)}")
        one_token_each = (T == 1 and cu_seqlens is None) or (
            cu_seqlens is not None and B == 1 and cu_seqlens.numel() == T + 1)
        grad = needs_backward(x, self.weight, self.bias, cache)
        if cache is not None and one_token_each and not grad:
            y, cache = self.step(x.view(B * T, D) if cu_seqlens is not None else x, cache)
            return y.view(B, T, D), cache if output_final_state else None
        return causal_conv1d(x, self.weight, self.bias, initial_state=cache,
                             output_final_state=output_final_state,
                             activation=self.activation, cu_seqlens=cu_seqlens)

    def step(self, x: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per sequence: x ``[N, D]`` or ``[N, 1, D]``, cache ``[N, D, W]``
        updated in place. Returns ``(y, cache)``, y shaped like x."""
        return causal_conv1d_update(x, cache, self.weight, self.bias, self.activation)
