"""RMSNorm, LayerNorm and GroupNorm over the last dimension, with a fused residual add.

For ``x: [..., D]`` (γ, β of length D; G groups of D/G channels for GroupNorm)::

    s = x + residual                      (residual optional, summed in fp32)
    y = (s − μ) / sqrt(σ² + eps) · γ + β  per row (per group), μ = 0 for the RMS form

``prenorm=True`` also returns s — in fp32 with ``residual_in_fp32=True``, else in the
residual's dtype (x's dtype when no residual is given) — and gradients flow through both
outputs. Statistics are computed in fp32; y comes back in x's dtype.

Triton kernels on CUDA (``fla.modules.layernorm_kernels``, shared with the gated norms of
``fla.modules.fused_norm_gate``), a PyTorch path on CPU, the kernels again on CPU under
``TRITON_INTERPRET=1``. The kernels run behind the custom ops ``fla::norm_fwd`` /
``fla::norm_bwd``, so that ``torch.compile`` traces through them.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from fla.modules.layernorm_kernels import ACTIVATIONS, norm_bwd, norm_fwd
from fla.utils.backend import Backend, select_backend
from fla.utils.custom_ops import present, stage_op
from fla.utils.validation import (FLOAT_DTYPES, check_same_device, check_tensor,
                                  contiguous_or_none)

__all__ = [
    "RMSNorm", "LayerNorm", "GroupNorm", "rms_norm", "layer_norm", "group_norm",
    "normalize",
]


# ----------------------------------------------------------------------------- checks
def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name}: expected {name} >= 1, got {value}")
    return value


def check_eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps: expected a float, got {type(eps).__name__}")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps: expected a finite number >= 0, got {eps}")
    return float(eps)


def _check_groups(num_groups, hidden_size: int, what: str) -> int:
    _check_positive_int("num_groups", num_groups)
    if hidden_size % num_groups:
        raise ValueError(f"num_groups: {num_groups} groups do not divide {what} "
                         f"D = {hidden_size} (D % num_groups = {hidden_size % num_groups})")
    return num_groups


def check_hidden_size(x: torch.Tensor, hidden_size: int) -> None:
    """A module built for ``hidden_size`` refuses an input of another width."""
    if x.dim() < 1 or x.shape[-1] != hidden_size:
        raise ValueError(f"x: expected a last dim equal to hidden_size = {hidden_size}, got "
                         f"shape {tuple(x.shape)} (last dim "
                         f"{x.shape[-1] if x.dim() else 'none'})")


def check_norm_inputs(x, weight, bias, residual=None, g=None, eps=1e-5, num_groups=1,
                      activation=None, hidden_size=None) -> int:
    """Every rule of a norm call, before anything runs; returns the ACTIVATION code.
    ``hidden_size``: the width a module was built for (None: any).
    (Written for the common case's host time: every norm of a model runs it per call.)"""
    check_tensor("x", x)
    if hidden_size is not None and (x.dim() < 1 or x.shape[-1] != hidden_size):
        check_hidden_size(x, hidden_size)
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"x: expected shape [..., D] with D >= 1, got {tuple(x.shape)}")
    D = x.shape[-1]
    if num_groups.__class__ is not int or num_groups != 1:
        _check_groups(num_groups, D, "the hidden size (the last dim of x)")
    device = x.device
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        check_tensor(name, p)
        if p.dim() != 1 or p.shape[0] != D:
            raise ValueError(f"{name}: expected shape ({D},), the hidden size D = {D} (the "
                             f"last dim of x), got shape {tuple(p.shape)}")
        if p.device != device:
            check_same_device(x=x, **{name: p})
    for name, t in (("residual", residual), ("g", g)):
        if t is None:
            continue
        check_tensor(name, t)
        if t.shape != x.shape:
            raise ValueError(f"{name}: expected the shape of x, {tuple(x.shape)}, got "
                             f"{tuple(t.shape)}")
        if t.device != device:
            check_same_device(x=x, **{name: t})
    if eps.__class__ is not float or not 0.0 <= eps < math.inf:
        check_eps(eps)
    if activation is None:
        return 0
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {sorted(ACTIVATIONS)}, got "
                         f"{activation!r}")
    return ACTIVATIONS[activation]


# ------------------------------------------------------------------------- torch path
def _norm_torch(x, weight, bias, residual, g, eps, num_groups, is_rms_norm, activation,
                residual_dtype, y_dtype):
    """The same function in PyTorch ops (autograd differentiates it): fp32 statistics,
    y in ``y_dtype``, ``residual_out`` in ``residual_dtype`` (None: not returned)."""
    s = x.float()
    if residual is not None:
        s = s + residual.float()
    residual_out = None if residual_dtype is None else s.to(residual_dtype)
    D = x.shape[-1]
    grouped = s.reshape(*s.shape[:-1], num_groups, D // num_groups)
    if not is_rms_norm:
        grouped = grouped - grouped.mean(-1, keepdim=True)
    y = grouped * torch.rsqrt(grouped.square().mean(-1, keepdim=True) + eps)
    y = y.reshape(s.shape)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    if activation:
        gf = g.float()
        y = y * (gf * torch.sigmoid(gf) if activation == ACTIVATIONS["swish"]
                 else torch.sigmoid(gf))
    return y.to(y_dtype), residual_out


# ----------------------------------------------------------------------- Triton path
# The kernels as the custom ops fla::norm_fwd / fla::norm_bwd (one node each under
# torch.compile; their fakes are the launchers with the launches skipped), joined by the
# autograd formula below. They take contiguous ``[..., G·D]`` tensors, any leading shape.
_norm_fwd_op = stage_op(
    "norm_fwd", norm_fwd, label="norm.fwd",
    schema="(Tensor x, Tensor? weight, Tensor? bias, Tensor? residual, Tensor? g, float eps, "
           "int num_groups, bool is_rms_norm, int activation, ScalarType? residual_dtype, "
           "ScalarType? y_dtype) "
           "-> (Tensor, Tensor, Tensor, Tensor)", ahead=False)
_norm_bwd_op = stage_op(
    "norm_bwd", norm_bwd, label="norm.bwd",
    schema="(Tensor dy, Tensor s, Tensor? weight, Tensor? bias, Tensor? g, Tensor? mean, "
           "Tensor rstd, Tensor? dresidual_out, int num_groups, bool is_rms_norm, "
           "int activation, ScalarType x_dtype, ScalarType? residual_dtype) "
           "-> (Tensor, Tensor, Tensor, Tensor, Tensor)", ahead=False)


def _setup_context(ctx, inputs, output):
    x, weight, bias, residual, g, _, num_groups, is_rms_norm, activation, residual_dtype, _ \
        = inputs
    _, residual_out, mean, rstd = output
    # Backward normalises what the forward normalised: residual_out when stored (it is
    # x + residual), else x itself.
    ctx.save_for_backward(x if residual_dtype is None else residual_out, weight, bias, g,
                          present(mean, not is_rms_norm), rstd)
    ctx.meta = (num_groups, is_rms_norm, activation, x.dtype,
                None if residual is None else residual.dtype, residual_dtype is not None)
    # An output the loss does not use gets None, not a tensor of zeros.
    ctx.set_materialize_grads(False)


def _backward_formula(ctx, dy, dresidual_out, _dmean, _drstd):
    s, weight, bias, g, mean, rstd = ctx.saved_tensors
    num_groups, is_rms_norm, activation, x_dtype, dresidual_dtype, stores_residual = ctx.meta
    if dy is None:  # only residual_out reached the loss
        dy = torch.zeros(s.shape, dtype=x_dtype, device=s.device)
    # residual_out's gradient exists only if the forward returned it (else it is the
    # gradient of a placeholder).
    dresidual_out = (dresidual_out.contiguous()
                     if stores_residual and dresidual_out is not None else None)
    dx, dresidual, dg, dweight, dbias = _norm_bwd_op(
        dy.contiguous(), s, weight, bias, g, mean, rstd, dresidual_out, num_groups,
        is_rms_norm, activation, x_dtype, dresidual_dtype)
    return (dx, present(dweight, weight is not None), present(dbias, bias is not None),
            present(dresidual, dresidual_dtype is not None), present(dg, g is not None),
            None, None, None, None, None, None)


_norm_fwd_op.register_autograd(_backward_formula, setup_context=_setup_context)


def _norm_triton(x, weight, bias, residual, g, eps, num_groups, is_rms_norm, activation,
                 residual_dtype, y_dtype):
    """The Triton path through fla::norm_fwd: ``(y, residual_out or None)`` shaped like x
    (y in ``y_dtype``; None: x's)."""
    y, residual_out, _, _ = _norm_fwd_op(
        x.contiguous(), contiguous_or_none(weight), contiguous_or_none(bias),
        contiguous_or_none(residual), contiguous_or_none(g), eps, num_groups, is_rms_norm,
        activation, residual_dtype, y_dtype)
    return y, (None if residual_dtype is None else residual_out)


# ------------------------------------------------------------------------ entry point
def normalize(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
              residual: torch.Tensor | None = None, g: torch.Tensor | None = None,
              eps: float = 1e-5, prenorm: bool = False, residual_in_fp32: bool = False,
              num_groups: int = 1, is_rms_norm: bool = False, activation: str | None = None,
              output_dtype: torch.dtype | None = None, hidden_size: int | None = None):
    """The one entry point behind every norm of ``fla.modules`` (gated ones included).

    Args:
        x: ``[..., D]`` fp32/fp16/bf16.
        weight, bias: ``[D]`` or None (any float dtype; gradients come back in it).
        residual: shaped like x, added before the norm (None: nothing added).
        g: the gate, shaped like x; required iff ``activation`` is given.
        eps: added to the variance (mean square for the RMS form).
        prenorm: also return s = x + residual.
        residual_in_fp32: return s in fp32 (else in the residual's dtype, x's if none).
        num_groups: G; each row is normalised in G groups of D / G channels.
        is_rms_norm: no mean subtraction.
        activation: None, ``'swish'``/``'silu'`` or ``'sigmoid'``: y ⊙ act(g).
        output_dtype: y's dtype (None: x's). A float32 residual stream normed straight
            into the autocast dtype saves a cast pass forward and one backward.
        hidden_size: the width D a module was built for: an x of another width is
            refused (None: any D). The modules call this function directly, checks
            included, so that a norm's call costs one layer of Python.

    Returns:
        y ``[..., D]`` in ``output_dtype`` (x's by default), or ``(y, s)`` with
        ``prenorm``.
    """
    code = check_norm_inputs(x, weight, bias, residual, g, eps, num_groups, activation,
                             hidden_size)
    if code and g is None:
        raise ValueError(f"g: a gate is required with activation={activation!r}, got None")
    eps = float(eps)
    if residual_in_fp32:
        residual_dtype = torch.float32
    else:
        residual_dtype = x.dtype if residual is None else residual.dtype
    # s needs a tensor of its own only when it differs from x (or has another dtype).
    if residual is None and residual_dtype == x.dtype:
        residual_dtype = None
    g = g if code else None
    if output_dtype is not None and output_dtype not in FLOAT_DTYPES:
        raise TypeError(f"output_dtype: expected None or one of float32, float16, bfloat16, "
                        f"got {output_dtype}")
    y_dtype = None if output_dtype == x.dtype else output_dtype

    if x.numel() == 0 or select_backend(x, weight, bias, residual, g) is Backend.TORCH:
        y, residual_out = _norm_torch(x, weight, bias, residual, g, eps, num_groups,
                                      bool(is_rms_norm), code, residual_dtype,
                                      y_dtype or x.dtype)
    else:
        y, residual_out = _norm_triton(x, weight, bias, residual, g, eps, num_groups,
                                       bool(is_rms_norm), code, residual_dtype, y_dtype)
    if not prenorm:
        return y
    return y, (x if residual_out is None else residual_out)


# ------------------------------------------------------------------------- functional
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
             residual: torch.Tensor | None = None, eps: float = 1e-5, prenorm: bool = False,
             residual_in_fp32: bool = False, output_dtype: torch.dtype | None = None):
    """RMSNorm of the last dim: ``y = s / sqrt(mean(s²) + eps) · weight + bias`` with
    ``s = x + residual``.

    Args: x ``[..., D]`` fp32/fp16/bf16; weight, bias ``[D]`` or None; residual like x.
    Returns: y ``[..., D]`` in x's dtype (or ``output_dtype``); ``(y, s)`` with ``prenorm``
    (s in fp32 with ``residual_in_fp32``). Differentiable in x, weight, bias, residual.
    """
    return normalize(x, weight, bias, residual, None, eps, prenorm, residual_in_fp32,
                     is_rms_norm=True, output_dtype=output_dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               residual: torch.Tensor | None = None, eps: float = 1e-5, prenorm: bool = False,
               residual_in_fp32: bool = False, is_rms_norm: bool = False,
               output_dtype: torch.dtype | None = None):
    """LayerNorm of the last dim: ``y = (s − mean(s)) / sqrt(var(s) + eps) · weight +
    bias`` with ``s = x + residual`` (biased variance, as ``torch.nn.LayerNorm``).

    Shapes and returns as :func:`rms_norm`; ``is_rms_norm=True`` is :func:`rms_norm`.
    """
    return normalize(x, weight, bias, residual, None, eps, prenorm, residual_in_fp32,
                     is_rms_norm=is_rms_norm, output_dtype=output_dtype)


def group_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               residual: torch.Tensor | None = None, eps: float = 1e-5, prenorm: bool = False,
               residual_in_fp32: bool = False, is_rms_norm: bool = False,
               num_groups: int = 1, output_dtype: torch.dtype | None = None):
    """GroupNorm of the last dim: each row of ``s = x + residual`` (``[..., D]``) is split
    into ``num_groups`` groups of D / num_groups consecutive channels, each normalised
    on its own (RMS form with ``is_rms_norm``), then scaled by ``weight [D]`` and shifted
    by ``bias [D]``.

    Returns: y ``[..., D]`` in x's dtype; ``(y, s)`` with ``prenorm``.
    """
    return normalize(x, weight, bias, residual, None, eps, prenorm, residual_in_fp32,
                     num_groups=num_groups, is_rms_norm=is_rms_norm,
                     output_dtype=output_dtype)


# ---------------------------------------------------------------------------- modules
class _Norm(nn.Module):
    """Parameters, checks and the forward shared by the norm modules (the gated ones
    bring their own forward)."""

    # Overridden by RMSNorm (class) and GroupNorm (instance).
    is_rms_norm = False
    num_groups = 1

    def __init__(self, hidden_size: int, elementwise_affine: bool, bias: bool, eps: float,
                 device=None, dtype=None):
        super().__init__()
        self.hidden_size = _check_positive_int("hidden_size", hidden_size)
        self.elementwise_affine = bool(elementwise_affine)
        self.eps = check_eps(eps)
        factory = {"device": device, "dtype": dtype}
        # Without elementwise_affine there is neither weight nor bias (as in torch.nn).
        self.register_parameter("weight", nn.Parameter(torch.empty(hidden_size, **factory))
                                if self.elementwise_affine else None)
        self.register_parameter("bias", nn.Parameter(torch.empty(hidden_size, **factory))
                                if self.elementwise_affine and bias else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                prenorm: bool = False, residual_in_fp32: bool = False,
                output_dtype: torch.dtype | None = None):
        """x ``[..., hidden_size]`` (and residual like it) -> y like x, or ``(y, s)``
        with ``prenorm``; arguments as :func:`normalize`."""
        return normalize(x, self.weight, self.bias, residual, None, self.eps, prenorm,
                         residual_in_fp32, self.num_groups, self.is_rms_norm,
                         output_dtype=output_dtype, hidden_size=self.hidden_size)

    def extra_repr(self) -> str:
        text = f"{self.hidden_size}, eps={self.eps}"
        if not self.elementwise_affine:
            text += ", elementwise_affine=False"
        elif self.bias is not None:
            text += ", bias=True"
        return text


class RMSNorm(_Norm):
    """RMSNorm over the last dim (see :func:`rms_norm`); weight ``[hidden_size]`` starts
    at ones, bias (``bias=True``) at zeros."""

    is_rms_norm = True

    def __init__(self, hidden_size: int, elementwise_affine: bool = True, bias: bool = False,
                 eps: float = 1e-5, device=None, dtype=None):
        super().__init__(hidden_size, elementwise_affine, bias, eps, device, dtype)


class LayerNorm(_Norm):
    """LayerNorm over the last dim (see :func:`layer_norm`); weight starts at ones, bias
    at zeros."""

    def __init__(self, hidden_size: int, elementwise_affine: bool = True, bias: bool = True,
                 eps: float = 1e-5, device=None, dtype=None):
        super().__init__(hidden_size, elementwise_affine, bias, eps, device, dtype)


class GroupNorm(_Norm):
    """GroupNorm over the last dim in ``num_groups`` groups (see :func:`group_norm`)."""

    def __init__(self, num_groups: int, hidden_size: int, elementwise_affine: bool = True,
                 bias: bool = False, eps: float = 1e-5, is_rms_norm: bool = False,
                 device=None, dtype=None):
        _check_groups(num_groups, _check_positive_int("hidden_size", hidden_size),
                      "hidden_size")
        super().__init__(hidden_size, elementwise_affine, bias, eps, device, dtype)
        self.num_groups = num_groups
        self.is_rms_norm = bool(is_rms_norm)

    def extra_repr(self) -> str:
        text = f"{self.num_groups}, {super().extra_repr()}"
        return text + (", is_rms_norm=True" if self.is_rms_norm else "")
