"""Float64 reference loop of RWKV6 (Finch): GLA plus the u bonus (ALGORITHMS.md §3)."""
from __future__ import annotations

import torch

from fla.ops.common.naive_loop import as_float64, run_sequences, scan
from fla.utils.validation import check_scale


def naive_recurrent_rwkv6(r, k, v, w, u, scale=None, initial_state=None,
                          output_final_state=False, cu_seqlens=None):
    """RWKV6 one token at a time in float64 (the ground truth)::

        o_t = scale · ( S_{t-1}ᵀ r_t + (Σ_i r_t,i u_i k_t,i) v_t )
        S_t = diag(exp(w_t)) · S_{t-1} + k_t ⊗ v_t

    Args:
        r, k: ``[B, T, H, K]`` (receptance, key); v: ``[B, T, H, V]``.
        w: ``[B, T, H, K]`` natural-log decay; u: ``[H, K]`` bonus of the current token.
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, H, K, V]``; N = B, or the number of sequences with ``cu_seqlens``.
        cu_seqlens: ``[N + 1]`` int offsets of packed sequences (B must be 1).
    Returns:
        ``(o [B, T, H, V], final_state [N, H, K, V] or None)``, float64.
    """
    r, k, v, w, u = (as_float64(x) for x in (r, k, v, w, u))
    H, K, V = r.shape[2], r.shape[3], v.shape[3]
    scale = check_scale(scale, K ** -0.5)

    def recurrence(inputs, S):
        r, k, v, w = inputs

        def step(t, S):
            r_t, k_t, v_t = r[:, t], k[:, t], v[:, t]
            bonus = (r_t * u * k_t).sum(-1, keepdim=True) * v_t
            o_t = scale * (torch.einsum('bhkv,bhk->bhv', S, r_t) + bonus)
            S = S * w[:, t, :, :, None].exp() + k_t[..., :, None] * v_t[..., None, :]
            return S, o_t

        return scan(step, S, r.shape[1])

    return run_sequences(recurrence, (r, k, v, w), initial_state, (H, K, V), cu_seqlens,
                         output_final_state)
