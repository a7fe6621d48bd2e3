"""Gated norms: a norm of x times an activation of a gate g, fused in one pass.

For ``x, g: [..., D]`` and γ, β of length D::

    s = x + residual                         (residual optional, summed in fp32)
    y = (norm(s) · γ + β) ⊙ act(g)           act = swish (g·σ(g), alias silu) or σ

with norm the RMS form (``rms_norm_gated``, ``FusedRMSNormGated``) or LayerNorm
(``layer_norm_gated``). It is the output gate of gated linear-attention layers
(``o = norm(o) ⊙ swish(g)``). The kernels are the norm row kernels of
``fla.modules.layernorm_kernels`` with their gate switched on: one read of x and g, one
write of y forward; dx, dγ, dβ and dg in one backward pass.
"""
from __future__ import annotations

import torch

from fla.modules.layernorm import _Norm, normalize
from fla.modules.layernorm_kernels import ACTIVATIONS
from fla.utils.validation import check_tensor

__all__ = ["rms_norm_gated", "layer_norm_gated", "FusedRMSNormGated", "FusedLayerNormGated"]


def _check_activation(activation) -> str:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {sorted(ACTIVATIONS)}, got "
                         f"{activation!r}")
    return activation


def layer_norm_gated(x: torch.Tensor, g: torch.Tensor, weight: torch.Tensor | None,
                     bias: torch.Tensor | None, activation: str = "swish",
                     residual: torch.Tensor | None = None, prenorm: bool = False,
                     residual_in_fp32: bool = False, eps: float = 1e-5,
                     is_rms_norm: bool = False):
    """``y = (LayerNorm(x + residual) · weight + bias) ⊙ act(g)`` over the last dim.

    Args:
        x, g: ``[..., D]`` fp32/fp16/bf16 (g may have another float dtype than x).
        weight, bias: ``[D]`` or None.
        activation: ``'swish'`` (= ``'silu'``) or ``'sigmoid'``.
        residual: like x, added before the norm; ``prenorm=True`` also returns the sum s
            (fp32 with ``residual_in_fp32``, else the residual's dtype, else x's).
        is_rms_norm: the RMS form (no mean subtraction).

    Returns:
        y ``[..., D]`` in x's dtype, or ``(y, s)`` with ``prenorm``. Differentiable in x,
        g, weight, bias and residual.
    """
    return _gated_norm(x, g, weight, bias, activation, residual, prenorm, residual_in_fp32,
                       eps, is_rms_norm)


def _gated_norm(x, g, weight, bias, activation, residual, prenorm, residual_in_fp32, eps,
                is_rms_norm, hidden_size=None):
    """The gated norms' checks, then :func:`normalize` (``hidden_size``: a module's
    width, None: any)."""
    _check_activation(activation)
    check_tensor("g", g)
    return normalize(x, weight, bias, residual, g, eps, prenorm, residual_in_fp32,
                     is_rms_norm=is_rms_norm, activation=activation, hidden_size=hidden_size)


def rms_norm_gated(x: torch.Tensor, g: torch.Tensor, weight: torch.Tensor | None,
                   bias: torch.Tensor | None, activation: str = "swish",
                   residual: torch.Tensor | None = None, prenorm: bool = False,
                   residual_in_fp32: bool = False, eps: float = 1e-5):
    """``y = (x / sqrt(mean(x²) + eps) · weight + bias) ⊙ act(g)`` (x plus residual);
    arguments and returns as :func:`layer_norm_gated`."""
    return layer_norm_gated(x, g, weight, bias, activation, residual, prenorm,
                            residual_in_fp32, eps, is_rms_norm=True)


class FusedRMSNormGated(_Norm):
    """``RMSNorm(x) · weight ⊙ act(g)``: weight ``[hidden_size]`` starts at ones; no bias.

    ``forward(x, g, residual=None, prenorm=False, residual_in_fp32=False)``, x and g
    ``[..., hidden_size]``; see :func:`rms_norm_gated`.
    """

    def __init__(self, hidden_size: int, elementwise_affine: bool = True, eps: float = 1e-5,
                 activation: str = "swish", device=None, dtype=None):
        _check_activation(activation)
        super().__init__(hidden_size, elementwise_affine, False, eps, device, dtype)
        self.activation = activation

    def forward(self, x: torch.Tensor, g: torch.Tensor, residual: torch.Tensor | None = None,
                prenorm: bool = False, residual_in_fp32: bool = False):
        return _gated_norm(x, g, self.weight, self.bias, self.activation, residual, prenorm,
                           residual_in_fp32, self.eps, True, self.hidden_size)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation!r}"


class FusedLayerNormGated(_Norm):
    """``(LayerNorm(x) · weight + bias) ⊙ act(g)``; see :func:`layer_norm_gated`."""

    def __init__(self, hidden_size: int, elementwise_affine: bool = True, bias: bool = False,
                 eps: float = 1e-5, activation: str = "swish", device=None, dtype=None):
        _check_activation(activation)
        super().__init__(hidden_size, elementwise_affine, bias, eps, device, dtype)
        self.activation = activation

    def forward(self, x: torch.Tensor, g: torch.Tensor, residual: torch.Tensor | None = None,
                prenorm: bool = False, residual_in_fp32: bool = False):
        return _gated_norm(x, g, self.weight, self.bias, self.activation, residual, prenorm,
                           residual_in_fp32, self.eps, False, self.hidden_size)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation!r}"
