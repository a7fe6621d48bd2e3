"""SwiGLU, ``swish(gate) · up``, as one elementwise Triton kernel forward and backward.

With σ the logistic function::

    y      = g σ(g) · u
    ∂y/∂u  = g σ(g)
    ∂y/∂g  = u σ(g) (1 + g (1 − σ(g)))

The arithmetic is float32 whatever the dtype; σ(g) is recomputed in the backward, so
only the inputs are kept. gate and up may be two halves of one projection's output
(row stride 2I): the kernels take row strides and nothing is copied. They run behind
the custom ops ``fla::swiglu[_packed]_fwd`` / ``_bwd``, so that ``torch.compile`` traces
through them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fla.utils.backend import Backend, select_backend
from fla.utils.custom_ops import stage_op
from fla.utils.grid import cdiv, next_power_of_2
from fla.utils.tuning import Config, tuned
from fla.utils.validation import FLOAT_DTYPES, check_same_device, check_tensor

__all__ = ["swiglu", "swiglu_packed", "swiglu_fwd_kernel", "swiglu_bwd_kernel"]

# float64 is accepted and always takes the PyTorch path: the kernels compute in float32.
_DTYPES = (*FLOAT_DTYPES, torch.float64)


def _use_torch(x: torch.Tensor) -> bool:
    return (x.numel() == 0 or x.dtype == torch.float64
            or select_backend(x) is Backend.TORCH)


def _default(args) -> Config:
    # 1024 columns on 4 warps: 8 elements a thread, 16-byte vectors in 16-bit dtypes.
    return Config(BC=min(1024, next_power_of_2(args["C"])), num_warps=4, num_stages=1)


def _space(args) -> list[Config]:
    widths = sorted({min(bc, next_power_of_2(args["C"])) for bc in (512, 1024, 2048, 4096)})
    return [Config(BC=bc, num_warps=w, num_stages=1) for bc in widths for w in (2, 4, 8)]


@tuned(key=["C", "g"], default=_default, space=_space)
@triton.jit
def swiglu_fwd_kernel(g, u, y, s_g, s_u, C: tl.constexpr, BC: tl.constexpr):
    """One program per (row, BC columns): y = g σ(g) u."""
    i_r, i_c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    b_g = tl.load(g + i_r * s_g + o_c, mask=m_c, other=0.).to(tl.float32)
    b_u = tl.load(u + i_r * s_u + o_c, mask=m_c, other=0.).to(tl.float32)
    b_y = b_g * tl.sigmoid(b_g) * b_u
    tl.store(y + i_r * C + o_c, b_y.to(y.dtype.element_ty), mask=m_c)


@tuned(key=["C", "g"], default=_default, space=_space)
@triton.jit
def swiglu_bwd_kernel(g, u, dy, dg, du, s_g, s_u, s_dg, s_du, C: tl.constexpr,
                      BC: tl.constexpr):
    """One program per (row, BC columns): dg and du from dy, σ(g) recomputed."""
    i_r, i_c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    b_g = tl.load(g + i_r * s_g + o_c, mask=m_c, other=0.).to(tl.float32)
    b_u = tl.load(u + i_r * s_u + o_c, mask=m_c, other=0.).to(tl.float32)
    b_dy = tl.load(dy + i_r * C + o_c, mask=m_c, other=0.).to(tl.float32)
    b_s = tl.sigmoid(b_g)
    b_dg = b_dy * b_u * b_s * (1. + b_g * (1. - b_s))
    b_du = b_dy * b_g * b_s
    tl.store(dg + i_r * s_dg + o_c, b_dg.to(dg.dtype.element_ty), mask=m_c)
    tl.store(du + i_r * s_du + o_c, b_du.to(du.dtype.element_ty), mask=m_c)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[R, C]`` with unit column stride, a view where possible."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _swiglu_fwd(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    g2, u2 = _rows(g), _rows(u)
    R, C = g2.shape
    y = torch.empty(R, C, dtype=g.dtype, device=g.device)
    swiglu_fwd_kernel[lambda meta: (R, cdiv(C, meta["BC"]))](
        g=g2, u=u2, y=y, s_g=g2.stride(0), s_u=u2.stride(0), C=C)
    return y.view(g.shape)


def _swiglu_bwd_into(g, u, dy, dg, du) -> None:
    g2, u2, dy2 = _rows(g), _rows(u), _rows(dy).contiguous()
    R, C = g2.shape
    swiglu_bwd_kernel[lambda meta: (R, cdiv(C, meta["BC"]))](
        g=g2, u=u2, dy=dy2, dg=dg, du=du, s_g=g2.stride(0), s_u=u2.stride(0),
        s_dg=dg.stride(0), s_du=du.stride(0), C=C)


def _swiglu_bwd(g: torch.Tensor, u: torch.Tensor, dy: torch.Tensor):
    """``(dg, du)`` shaped like g and u (contiguous)."""
    C = g.shape[-1]
    dg = torch.empty(g.numel() // C, C, dtype=g.dtype, device=g.device)
    du = torch.empty(u.numel() // C, C, dtype=u.dtype, device=u.device)
    _swiglu_bwd_into(g, u, dy, dg, du)
    return dg.view(g.shape), du.view(u.shape)


def _swiglu_packed_fwd(gu: torch.Tensor) -> torch.Tensor:
    return _swiglu_fwd(*gu.chunk(2, dim=-1))


def _swiglu_packed_bwd(gu: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """The gradient of ``[..., 2I]`` in one buffer, so autograd has no halves to
    concatenate."""
    g, u = gu.chunk(2, dim=-1)
    C = g.shape[-1]
    dgu = torch.empty(gu.numel() // (2 * C), 2 * C, dtype=gu.dtype, device=gu.device)
    _swiglu_bwd_into(g, u, dy, dgu[:, :C], dgu[:, C:])
    return dgu.view(gu.shape)


# The kernels as custom ops (one node each under torch.compile; their fakes are the
# launchers with the launches skipped): fla::swiglu_fwd / _bwd on (gate, up), and
# fla::swiglu_packed_fwd / _bwd on the [..., 2I] tensor holding both halves.
_swiglu_fwd_op = stage_op("swiglu_fwd", _swiglu_fwd, label="swiglu.fwd",
                          schema="(Tensor g, Tensor u) -> Tensor", ahead=False)
_swiglu_bwd_op = stage_op("swiglu_bwd", _swiglu_bwd, label="swiglu.bwd",
                          schema="(Tensor g, Tensor u, Tensor dy) -> (Tensor, Tensor)",
                          ahead=False)
_swiglu_packed_fwd_op = stage_op("swiglu_packed_fwd", _swiglu_packed_fwd,
                                 label="swiglu_packed.fwd", schema="(Tensor gu) -> Tensor",
                                 ahead=False)
_swiglu_packed_bwd_op = stage_op("swiglu_packed_bwd", _swiglu_packed_bwd,
                                 label="swiglu_packed.bwd",
                                 schema="(Tensor gu, Tensor dy) -> Tensor", ahead=False)


def _save_inputs(ctx, inputs, output):
    # σ is recomputed from the inputs: they are all the backward needs.
    ctx.save_for_backward(*inputs)


_swiglu_fwd_op.register_autograd(lambda ctx, dy: _swiglu_bwd_op(*ctx.saved_tensors, dy),
                                 setup_context=_save_inputs)
_swiglu_packed_fwd_op.register_autograd(
    lambda ctx, dy: _swiglu_packed_bwd_op(*ctx.saved_tensors, dy), setup_context=_save_inputs)


def _swiglu_torch(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    acc = torch.promote_types(g.dtype, torch.float32)
    return (F.silu(g.to(acc)) * u.to(acc)).to(g.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``swish(gate) · up = gate · σ(gate) · up``, elementwise.

    Args:
        gate, up: tensors of one shape ``[..., I]`` and dtype (fp32/fp16/bf16; float64
            runs in PyTorch); any row strides, unit stride on the last dim preferred
            (else copied).

    Returns:
        ``[..., I]`` in the inputs' dtype, computed in float32. Differentiable in both.
    """
    check_tensor("gate", gate, dtypes=_DTYPES)
    check_tensor("up", up, dtypes=_DTYPES)
    if gate.shape != up.shape:
        raise ValueError(f"up: expected the shape of gate {tuple(gate.shape)}, got "
                         f"{tuple(up.shape)}")
    if gate.dtype != up.dtype:
        raise TypeError(f"up: expected the dtype of gate {gate.dtype}, got {up.dtype}")
    check_same_device(gate=gate, up=up)
    if _use_torch(gate):
        return _swiglu_torch(gate, up)
    return _swiglu_fwd_op(gate, up)


def swiglu_packed(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`swiglu` of the two halves of ``gate_up [..., 2I]``: ``[..., I]``."""
    check_tensor("gate_up", gate_up, dtypes=_DTYPES)
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up: expected an even last dim [..., 2I], got shape "
                         f"{tuple(gate_up.shape)}")
    if _use_torch(gate_up):
        return _swiglu_torch(*gate_up.chunk(2, dim=-1))
    return _swiglu_packed_fwd_op(gate_up)
