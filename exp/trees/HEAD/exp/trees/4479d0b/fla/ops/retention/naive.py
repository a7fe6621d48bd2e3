"""Float64 reference loop of retention (RetNet): simple GLA with a fixed per-head decay."""
from __future__ import annotations

import math

import torch

from fla.ops.simple_gla.naive import naive_recurrent_simple_gla


def retention_log_decay(H: int) -> torch.Tensor:
    """RetNet's per-head log decay ``log(1 − 2^(−5−h))`` for h = 0..H-1: float64 ``[H]``."""
    return torch.tensor([math.log1p(-2.0 ** (-5 - h)) for h in range(H)], dtype=torch.float64)


def naive_recurrent_retention(q, k, v, scale=None, initial_state=None, output_final_state=False,
                              cu_seqlens=None):
    """Retention one token at a time in float64: for head h with γ_h = 1 − 2^(−5−h)::

        S_t = γ_h · S_{t-1} + k_t ⊗ v_t
        o_t = scale · S_tᵀ q_t

    Args: q, k ``[B, T, H, K]``; v ``[B, T, H, V]``; scale (default ``K ** -0.5``);
    initial_state ``[N, H, K, V]``; cu_seqlens ``[N + 1]`` (B must be 1).
    Returns ``(o [B, T, H, V], final_state [N, H, K, V] or None)``, float64.
    """
    g_gamma = retention_log_decay(q.shape[2]).to(q.device)
    return naive_recurrent_simple_gla(q, k, v, g_gamma=g_gamma, scale=scale,
                                      initial_state=initial_state,
                                      output_final_state=output_final_state,
                                      cu_seqlens=cu_seqlens)
