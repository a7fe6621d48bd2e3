"""L2 normalisation over the last dimension, as a differentiable Triton op.

For ``x: [..., D]``::

    rstd = 1 / sqrt(Σ_d x_d² + eps),   y = x · rstd
    dx   = rstd · (dy − y · Σ_d dy_d y_d)

with the epsilon of ``fla.ops.utils.l2norm`` (:data:`L2NORM_EPS`) by default, so that
normalising q and k here or inside an op (``use_qk_l2norm_in_kernel``) is one function.
Rows up to ``layernorm_kernels.MAX_SINGLE_PASS_D`` wide are held in registers (several
narrow rows, such as heads of 64-256, per program); wider rows are walked in chunks.
The kernels run behind the custom ops ``fla::l2norm_fwd`` / ``fla::l2norm_bwd``, so that
``torch.compile`` traces through them.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import triton
import triton.language as tl

from fla.modules import layernorm_kernels as rows
from fla.modules.layernorm import check_eps
from fla.ops.utils.l2norm import L2NORM_EPS
from fla.utils.backend import Backend, select_backend
from fla.utils.custom_ops import stage_op
from fla.utils.grid import cdiv
from fla.utils.tuning import Config, tuned
from fla.utils.validation import FLOAT_DTYPES, check_tensor

__all__ = ["l2norm", "l2_norm", "l2norm_fwd", "l2norm_bwd", "L2Norm", "L2NORM_EPS",
           "l2norm_fwd_kernel", "l2norm_bwd_kernel", "token_rows"]


def _default(args) -> Config:
    BR, warps = rows.row_tile(args["BLOCK"], args["NCHUNK"] > 1)
    return Config(BR=BR, num_warps=warps, num_stages=2)


def _space(args) -> list[Config]:
    BR, warps = rows.row_tile(args["BLOCK"], args["NCHUNK"] > 1)
    row_options = [BR] if BR == 1 else sorted({max(1, BR // 2), BR, BR * 2})
    return [Config(BR=r, num_warps=w, num_stages=2) for r in row_options
            for w in sorted({max(1, warps // 2), warps, min(32, warps * 2)})]


@triton.jit
def _rows_at(o_r, heads, stride, D: tl.constexpr):
    """Offsets of rows ``o_r`` in a tensor laid out as [tokens, heads, D] with the tokens
    ``stride`` elements apart (contiguous: heads = 1, stride = D)."""
    return (o_r // heads) * stride + (o_r % heads) * D


@tuned(key=["D", "BLOCK", "x", "y"], default=_default, space=_space)
@triton.jit(do_not_specialize=["N"])
def l2norm_fwd_kernel(x, y, rstd, eps, N, x_heads, x_stride, D: tl.constexpr,
                      BLOCK: tl.constexpr, NCHUNK: tl.constexpr, BR: tl.constexpr):
    """BR rows per program: x ``[N, D]`` rows at :func:`_rows_at` (x_heads, x_stride), y
    ``[N, D]`` contiguous, rstd fp32 ``[N]``. With NCHUNK > 1 (BR = 1) the row is walked
    twice: Σx², then y."""
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m_r = o_r < N
    p_x = x + _rows_at(o_r, x_heads, x_stride, D)[:, None]
    p_y = y + o_r[:, None] * D
    if NCHUNK == 1:
        o_d = tl.arange(0, BLOCK)
        mask = m_r[:, None] & (o_d < D)[None, :]
        b_x = tl.load(p_x + o_d[None, :], mask=mask, other=0.).to(tl.float32)
        b_rstd = 1. / tl.sqrt(tl.sum(b_x * b_x, axis=1) + eps)
        tl.store(p_y + o_d[None, :], (b_x * b_rstd[:, None]).to(y.dtype.element_ty),
                 mask=mask)
    else:
        b_acc = tl.zeros([BR, BLOCK], dtype=tl.float32)
        for i_c in range(NCHUNK):
            o_d = i_c * BLOCK + tl.arange(0, BLOCK)
            mask = m_r[:, None] & (o_d < D)[None, :]
            b_x = tl.load(p_x + o_d[None, :], mask=mask, other=0.)
            b_acc += b_x.to(tl.float32) * b_x.to(tl.float32)
        b_rstd = 1. / tl.sqrt(tl.sum(b_acc, axis=1) + eps)
        for i_c in range(NCHUNK):
            o_d = i_c * BLOCK + tl.arange(0, BLOCK)
            mask = m_r[:, None] & (o_d < D)[None, :]
            b_x = tl.load(p_x + o_d[None, :], mask=mask, other=0.).to(tl.float32)
            tl.store(p_y + o_d[None, :], (b_x * b_rstd[:, None]).to(y.dtype.element_ty),
                     mask=mask)
    tl.store(rstd + o_r, b_rstd, mask=m_r)


@tuned(key=["D", "BLOCK", "src", "dy"], default=_default, space=_space)
@triton.jit(do_not_specialize=["N"])
def l2norm_bwd_kernel(src, rstd, dy, dx, N, src_heads, src_stride, dx_heads, dx_stride,
                      D: tl.constexpr, BLOCK: tl.constexpr, NCHUNK: tl.constexpr,
                      FROM_Y: tl.constexpr, BR: tl.constexpr):
    """dx = rstd (dy − y Σ dy·y). ``src`` is the forward's input x (y = x·rstd recomputed
    in fp32, not read back rounded) or, with FROM_Y, its output y. src and dx rows at
    :func:`_rows_at` with their own (heads, stride); dy contiguous ``[N, D]``."""
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m_r = o_r < N
    b_rstd = tl.load(rstd + o_r, mask=m_r, other=0.)
    # y = src · b_f: rstd for x, 1 when src is y itself.
    if FROM_Y:
        b_f = tl.full([BR], 1., tl.float32)
    else:
        b_f = b_rstd
    p_src = src + _rows_at(o_r, src_heads, src_stride, D)[:, None]
    p_dx = dx + _rows_at(o_r, dx_heads, dx_stride, D)[:, None]
    p_dy = dy + o_r[:, None] * D
    if NCHUNK == 1:
        o_d = tl.arange(0, BLOCK)
        mask = m_r[:, None] & (o_d < D)[None, :]
        b_y = tl.load(p_src + o_d[None, :], mask=mask, other=0.).to(tl.float32) * b_f[:, None]
        b_dy = tl.load(p_dy + o_d[None, :], mask=mask, other=0.).to(tl.float32)
        b_c = tl.sum(b_dy * b_y, axis=1)
        b_dx = (b_dy - b_y * b_c[:, None]) * b_rstd[:, None]
        tl.store(p_dx + o_d[None, :], b_dx.to(dx.dtype.element_ty), mask=mask)
    else:
        b_acc = tl.zeros([BR, BLOCK], dtype=tl.float32)
        for i_c in range(NCHUNK):
            o_d = i_c * BLOCK + tl.arange(0, BLOCK)
            mask = m_r[:, None] & (o_d < D)[None, :]
            b_y = tl.load(p_src + o_d[None, :], mask=mask, other=0.).to(tl.float32) \
                * b_f[:, None]
            b_acc += tl.load(p_dy + o_d[None, :], mask=mask, other=0.).to(tl.float32) * b_y
        b_c = tl.sum(b_acc, axis=1)
        for i_c in range(NCHUNK):
            o_d = i_c * BLOCK + tl.arange(0, BLOCK)
            mask = m_r[:, None] & (o_d < D)[None, :]
            b_y = tl.load(p_src + o_d[None, :], mask=mask, other=0.).to(tl.float32) \
                * b_f[:, None]
            b_dy = tl.load(p_dy + o_d[None, :], mask=mask, other=0.).to(tl.float32)
            b_dx = (b_dy - b_y * b_c[:, None]) * b_rstd[:, None]
            tl.store(p_dx + o_d[None, :], b_dx.to(dx.dtype.element_ty), mask=mask)


def token_rows(x: torch.Tensor) -> tuple[int, int] | None:
    """``(heads, token_stride)`` when the rows of ``x [..., D]`` lie as [tokens, heads, D]
    with unit-stride rows, heads D apart and the tokens evenly ``token_stride`` apart
    (contiguous: ``(1, D)``; q of a fused q/k/v projection viewed ``[B, T, H, D]``:
    ``(H, width of the projection)``); None for any other layout (then it is copied)."""
    D = x.shape[-1]
    if x.is_contiguous():
        return 1, D
    if x.dim() < 3 or (D > 1 and x.stride(-1) != 1):
        return None
    heads = x.shape[-2]
    if heads > 1 and x.stride(-2) != D:
        return None
    # The dims before [heads, D] must flatten into one evenly strided token index.
    stride = expected = None
    for size, step in zip(reversed(x.shape[:-2]), reversed(x.stride()[:-2])):
        if size == 1:
            continue
        if stride is None:
            stride = expected = step
        elif step != expected:
            return None
        expected = step * size
    stride = heads * D if stride is None else stride
    return (heads, stride) if stride >= heads * D else None


def _launch_rows(kernel, N: int, D: int, **args) -> None:
    BLOCK, NCHUNK = rows.row_layout(D)
    kernel[lambda meta: (cdiv(N, meta["BR"]),)](N=N, D=D, BLOCK=BLOCK, NCHUNK=NCHUNK, **args)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``x`` and its :func:`token_rows` layout; a contiguous copy for other layouts."""
    layout = token_rows(x)
    if layout is None:
        x = x.contiguous()
        layout = (1, x.shape[-1])
    return x, *layout


def l2norm_fwd(x: torch.Tensor, eps: float = L2NORM_EPS,
               output_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton forward on validated input: ``x [..., D]`` -> ``(y [..., D] contiguous in
    output_dtype (None: x's), rstd [...] fp32)``. Nothing is reshaped (a view per call is
    host time on every layer), and x is read in place when its rows are evenly strided
    tokens of contiguous heads (:func:`token_rows`: q and k as views of a fused q/k/v
    projection), copied otherwise."""
    x, heads, stride = _rows(x)
    D = x.shape[-1]
    y = torch.empty(x.shape, dtype=output_dtype or x.dtype, device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    _launch_rows(l2norm_fwd_kernel, x.numel() // D, D, x=x, y=y, rstd=rstd, eps=float(eps),
                 x_heads=heads, x_stride=stride)
    return y, rstd


def l2norm_bwd(x: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor,
               from_output: bool = False, dx: torch.Tensor | None = None) -> torch.Tensor:
    """Triton backward: ``dx [..., D]`` from the forward's input ``x`` (or, with
    ``from_output``, its output y: then x need not be kept, at the cost of y's rounding),
    its rstd and the output gradient dy. ``dx``: where to write it (any
    :func:`token_rows` layout, e.g. a slice of a fused projection's gradient); None: a
    new contiguous tensor in x's dtype."""
    x, src_heads, src_stride = _rows(x)
    D = x.shape[-1]
    if dx is None:
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dx_layout = token_rows(dx)
    if dx_layout is None or dx.shape != x.shape:
        raise ValueError(f"dx: expected shape {tuple(x.shape)} with rows of contiguous heads "
                         f"at an even token stride, got {tuple(dx.shape)}, strides "
                         f"{dx.stride()}")
    _launch_rows(l2norm_bwd_kernel, x.numel() // D, D, src=x, rstd=rstd.contiguous(),
                 dy=dy.contiguous(), dx=dx, src_heads=src_heads, src_stride=src_stride,
                 dx_heads=dx_layout[0], dx_stride=dx_layout[1], FROM_Y=from_output)
    return dx


# The Triton forward and backward as the custom ops fla::l2norm_fwd / fla::l2norm_bwd (one
# node each under torch.compile; their fakes are the launchers with the launches
# skipped), joined by the autograd formula below.
_l2norm_fwd_op = stage_op("l2norm_fwd", l2norm_fwd, label="l2norm.fwd",
                          schema="(Tensor x, float eps, ScalarType? output_dtype) "
                                 "-> (Tensor, Tensor)", ahead=False)
_l2norm_bwd_op = stage_op("l2norm_bwd", l2norm_bwd, label="l2norm.bwd",
                          schema="(Tensor x, Tensor rstd, Tensor dy) -> Tensor", ahead=False)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output[1])
    # rstd is an output only for the backward: no zeros for its gradient.
    ctx.set_materialize_grads(False)


def _backward_formula(ctx, dy, _drstd):
    x, rstd = ctx.saved_tensors
    return None if dy is None else _l2norm_bwd_op(x, rstd, dy), None, None


_l2norm_fwd_op.register_autograd(_backward_formula, setup_context=_setup_context)


def _l2norm_torch(x, eps, output_dtype):
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)).to(output_dtype)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS,
           output_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``y = x / sqrt(Σ x² + eps)`` over the last dim.

    Args:
        x: ``[..., D]`` fp32/fp16/bf16, D >= 1.
        eps: added to the sum of squares (default :data:`L2NORM_EPS`, as the ops use).
        output_dtype: dtype of y (None: x's). The sum is taken in fp32.

    Returns:
        y ``[..., D]``; differentiable in x.
    """
    check_tensor("x", x)
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"x: expected shape [..., D] with D >= 1, got {tuple(x.shape)}")
    eps = check_eps(eps)
    if output_dtype is not None and output_dtype not in FLOAT_DTYPES:
        raise TypeError(f"output_dtype: expected None or one of float32, float16, bfloat16, "
                        f"got {output_dtype}")
    output_dtype = output_dtype or x.dtype
    if x.numel() == 0 or select_backend(x) is Backend.TORCH:
        return _l2norm_torch(x, eps, output_dtype)
    return _l2norm_fwd_op(x, eps, output_dtype)[0]


l2_norm = l2norm


class L2Norm(nn.Module):
    """:func:`l2norm` as a module (no parameters)."""

    def __init__(self, eps: float = L2NORM_EPS, output_dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = check_eps(eps)
        self.output_dtype = output_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return l2norm(x, self.eps, self.output_dtype)

    def extra_repr(self) -> str:
        return f"eps={self.eps}"
