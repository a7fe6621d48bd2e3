"""q, k and v out of one fused projection, with q and k L2-normalised per head.

A layer that projects q, k and v as one GEMM (and convolves them as one tensor) holds them
as column blocks of ``qkv [B, T, 2·key_dim + value_dim]``. Normalising q and k from views
of it used to copy each view first, and autograd then concatenated the three gradients
back into one for the projection. Here one autograd node does both ends::

    forward    q̂ = l2norm(q), k̂ = l2norm(k), read in place from qkv's columns;
               v copied contiguous (the layout the chunk ops read)
    backward   dq, dk written by the l2norm backward straight into one dqkv's columns,
               dv copied beside them

The node keeps q̂, k̂ (the op that consumes them keeps them anyway) and the two rstd
vectors, not qkv: the backward works from the outputs (``l2norm_bwd(from_output=True)``).
"""
from __future__ import annotations

import torch

from fla.modules.l2norm import L2NORM_EPS, l2norm, l2norm_bwd, l2norm_fwd
from fla.utils.backend import Backend, select_backend
from fla.utils.custom_ops import stage_op

__all__ = ["split_qkv_l2norm"]


def _heads(x: torch.Tensor, start: int, width: int, head_dim: int) -> torch.Tensor:
    """Columns ``start : start + width`` of ``x [B, T, C]`` as ``[B, T, width / head_dim,
    head_dim]`` (a view)."""
    return x[..., start:start + width].unflatten(-1, (width // head_dim, head_dim))


def _forward(qkv, key_dim: int, head_k_dim: int, head_v_dim: int, eps: float):
    q, rstd_q = l2norm_fwd(_heads(qkv, 0, key_dim, head_k_dim), eps)
    k, rstd_k = l2norm_fwd(_heads(qkv, key_dim, key_dim, head_k_dim), eps)
    value_dim = qkv.shape[-1] - 2 * key_dim
    v = _heads(qkv, 2 * key_dim, value_dim, head_v_dim).contiguous()
    return q, k, v, rstd_q, rstd_k


def _backward(q, k, rstd_q, rstd_k, dq, dk, dv, value_dim: int, head_v_dim: int):
    B, T, H, Dk = q.shape
    key_dim = H * Dk
    dqkv = q.new_empty(B, T, 2 * key_dim + value_dim)
    for y, rstd, dy, start in ((q, rstd_q, dq, 0), (k, rstd_k, dk, key_dim)):
        dx = _heads(dqkv, start, key_dim, Dk)
        if dy is None:
            dx.zero_()
        else:
            l2norm_bwd(y, rstd, dy, from_output=True, dx=dx)
    dv_slot = _heads(dqkv, 2 * key_dim, value_dim, head_v_dim)
    if dv is None:
        dv_slot.zero_()
    else:
        dv_slot.copy_(dv)
    return dqkv


_split_fwd = stage_op(
    "split_qkv_l2norm_fwd", _forward, label="split_qkv_l2norm.fwd", ahead=False,
    schema="(Tensor qkv, int key_dim, int head_k_dim, int head_v_dim, float eps) "
           "-> (Tensor, Tensor, Tensor, Tensor, Tensor)")
_split_bwd = stage_op(
    "split_qkv_l2norm_bwd", _backward, label="split_qkv_l2norm.bwd", ahead=False,
    schema="(Tensor q, Tensor k, Tensor rstd_q, Tensor rstd_k, Tensor? dq, Tensor? dk, "
           "Tensor? dv, int value_dim, int head_v_dim) -> Tensor")


def _setup_context(ctx, inputs, output):
    qkv, key_dim, _, head_v_dim, _ = inputs
    q, k, _, rstd_q, rstd_k = output
    ctx.save_for_backward(q, k, rstd_q, rstd_k)
    ctx.value_dim, ctx.head_v_dim = qkv.shape[-1] - 2 * key_dim, head_v_dim
    # rstd_q, rstd_k are outputs only for the backward: no zeros for their gradients.
    ctx.set_materialize_grads(False)


def _backward_formula(ctx, dq, dk, dv, _drstd_q, _drstd_k):
    if dq is None and dk is None and dv is None:
        return None, None, None, None, None
    dqkv = _split_bwd(*ctx.saved_tensors, dq, dk, dv, ctx.value_dim, ctx.head_v_dim)
    return dqkv, None, None, None, None


_split_fwd.register_autograd(_backward_formula, setup_context=_setup_context)


def split_qkv_l2norm(qkv: torch.Tensor, key_dim: int, head_k_dim: int, head_v_dim: int,
                     eps: float = L2NORM_EPS):
    """q, k, v from the column blocks ``[q | k | v]`` of one fused projection, q and k
    normalised to unit L2 norm per head (``fla.modules.l2norm``, same eps and maths).

    Args:
        qkv: ``[B, T, 2·key_dim + value_dim]`` fp32/fp16/bf16; read in place when its rows
            are contiguous (other layouts are copied).
        key_dim: width of q and of k (``H · head_k_dim``).
        head_k_dim, head_v_dim: per-head widths of q/k and of v.
        eps: added to each head's sum of squares.

    Returns:
        ``(q̂ [B, T, H, head_k_dim], k̂ [B, T, H, head_k_dim], v [B, T, HV, head_v_dim])``,
        contiguous, in qkv's dtype; differentiable in qkv (one autograd node whose
        gradient is one ``[B, T, 2·key_dim + value_dim]`` tensor, no concatenation).
    """
    C = qkv.shape[-1]
    value_dim = C - 2 * key_dim
    if (qkv.dim() != 3 or key_dim < 1 or value_dim < 1 or key_dim % head_k_dim
            or value_dim % head_v_dim):
        raise ValueError(f"qkv: expected [B, T, 2·key_dim + value_dim] with key_dim = "
                         f"{key_dim} a multiple of head_k_dim = {head_k_dim} and value_dim a "
                         f"multiple of head_v_dim = {head_v_dim}; got shape {tuple(qkv.shape)}")
    if select_backend(qkv) is Backend.TORCH:
        q = l2norm(_heads(qkv, 0, key_dim, head_k_dim), eps)
        k = l2norm(_heads(qkv, key_dim, key_dim, head_k_dim), eps)
        return q, k, _heads(qkv, 2 * key_dim, value_dim, head_v_dim).contiguous()
    q, k, v, _, _ = _split_fwd(qkv, key_dim, head_k_dim, head_v_dim, float(eps))
    return q, k, v
