"""L2 normalisation over the last dimension, as the delta-rule ops apply it to q and k.

``y = x · rsqrt(‖x‖² + eps)`` with the reference library's epsilon, so that
``use_qk_l2norm_in_kernel=True`` computes the same function here as there. Kernels that
fuse the normalisation use :data:`L2NORM_EPS` too.
"""
from __future__ import annotations

import torch

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """Differentiable ``x · rsqrt(‖x‖² + eps)`` over the last dim, computed in float32
    (float64 stays float64) and returned in x's dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + L2NORM_EPS)).to(x.dtype)
