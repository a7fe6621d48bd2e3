"""Float64 reference loop of GLA, the vector-gate recurrence (ALGORITHMS.md §3)."""
from __future__ import annotations

import torch

from fla.ops.common.naive_loop import as_float64, run_sequences, scan
from fla.utils.validation import check_scale


def naive_recurrent_gla(q, k, v, gk=None, gv=None, scale=None, initial_state=None,
                        output_final_state=False, cu_seqlens=None):
    """Gated linear attention one token at a time in float64 (the ground truth)::

        S_t = diag(exp(gk_t)) · S_{t-1} · diag(exp(gv_t)) + k_t ⊗ v_t
        o_t = scale · S_tᵀ q_t

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``.
        gk: ``[B, T, H, K]`` natural-log decay of the state's K rows (None: 0).
        gv: ``[B, T, H, V]`` natural-log decay of the state's V columns (None: 0).
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, H, K, V]``; N = B, or the number of sequences with ``cu_seqlens``.
        cu_seqlens: ``[N + 1]`` int offsets of packed sequences (B must be 1).
    Returns:
        ``(o [B, T, H, V], final_state [N, H, K, V] or None)``, float64.
    """
    q, k, v, gk, gv = (as_float64(x) for x in (q, k, v, gk, gv))
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    scale = check_scale(scale, K ** -0.5)

    def recurrence(inputs, S):
        q, k, v, gk, gv = inputs

        def step(t, S):
            if gk is not None:
                S = S * gk[:, t, :, :, None].exp()
            if gv is not None:
                S = S * gv[:, t, :, None, :].exp()
            S = S + k[:, t, :, :, None] * v[:, t, :, None, :]
            return S, scale * torch.einsum('bhkv,bhk->bhv', S, q[:, t])

        return scan(step, S, q.shape[1])

    return run_sequences(recurrence, (q, k, v, gk, gv), initial_state, (H, K, V), cu_seqlens,
                         output_final_state)
