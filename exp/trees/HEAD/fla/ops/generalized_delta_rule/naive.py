"""Float64 reference loop of the diagonal-plus-low-rank delta rule (ALGORITHMS.md §4)."""
from __future__ import annotations

import torch

from fla.ops.common.naive_loop import as_float64, run_sequences, scan
from fla.utils.validation import check_scale


def naive_recurrent_dplr_delta_rule(q, k, v, a, b, gk, scale=None, initial_state=None,
                                    output_final_state=False, cu_seqlens=None):
    """The generalized (DPLR) delta rule one token at a time in float64 (the ground truth)::

        S_t = diag(exp(gk_t)) · S_{t-1} + b_t ⊗ (a_tᵀ S_{t-1}) + k_t ⊗ v_t
        o_t = scale · S_tᵀ q_t

    i.e. ``S_t = (diag(exp(gk_t)) + b_t a_tᵀ) S_{t-1} + k_t v_tᵀ``. The gated delta rule is
    the case ``a = −β·exp(g)·k, b = k, gk = g, v ← β·v``.

    Args:
        q, k, a, b: ``[B, T, H, K]``; v: ``[B, T, H, V]``.
        gk: ``[B, T, H, K]`` natural-log decay of the state's K rows.
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, H, K, V]``; N = B, or the number of sequences with ``cu_seqlens``.
        cu_seqlens: ``[N + 1]`` int offsets of packed sequences (B must be 1).
    Returns:
        ``(o [B, T, H, V], final_state [N, H, K, V] or None)``, float64.
    """
    q, k, v, a, b, gk = (as_float64(x) for x in (q, k, v, a, b, gk))
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    scale = check_scale(scale, K ** -0.5)

    def recurrence(inputs, S):
        q, k, v, a, b, gk = inputs

        def step(t, S):
            low_rank = b[:, t, :, :, None] * torch.einsum('bhk,bhkv->bhv', a[:, t], S)[..., None, :]
            S = (S * gk[:, t, :, :, None].exp() + low_rank
                 + k[:, t, :, :, None] * v[:, t, :, None, :])
            return S, scale * torch.einsum('bhkv,bhk->bhv', S, q[:, t])

        return scan(step, S, q.shape[1])

    return run_sequences(recurrence, (q, k, v, a, b, gk), initial_state, (H, K, V), cu_seqlens,
                         output_final_state)
