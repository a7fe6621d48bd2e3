"""Float64 reference loop of simple GLA, the scalar-gate recurrence (ALGORITHMS.md §2)."""
from __future__ import annotations

import torch

from fla.ops.common.naive_loop import as_float64, run_sequences, scan
from fla.utils.validation import check_scale


def naive_recurrent_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                               output_final_state=False, cu_seqlens=None):
    """Simple GLA one token at a time in float64 (the ground truth)::

        S_t = exp(g_t + γ_h) · S_{t-1} + k_t ⊗ v_t
        o_t = scale · S_tᵀ q_t

    Args:
        q, k: ``[B, T, Hqk, K]``; v: ``[B, T, H, V]`` (H a multiple of Hqk: grouped value
            heads).
        g: ``[B, T, H]`` per-token natural-log decay (None: 0).
        g_gamma: ``[H]`` per-head constant log decay γ (None: 0); given with ``g``, they add.
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, H, K, V]``; N = B, or the number of sequences with ``cu_seqlens``.
        cu_seqlens: ``[N + 1]`` int offsets of packed sequences (B must be 1).
    Returns:
        ``(o, final_state)``: ``o [B, T, H, V]`` and ``final_state [N, H, K, V]`` (None
        unless ``output_final_state``), both float64.
    """
    q, k, v, g, g_gamma = (as_float64(x) for x in (q, k, v, g, g_gamma))
    H, K, V = v.shape[2], q.shape[3], v.shape[3]
    if H != q.shape[2]:  # grouped value heads: value head j reads q/k head j // (H / Hqk)
        q = q.repeat_interleave(H // q.shape[2], dim=2)
        k = k.repeat_interleave(H // k.shape[2], dim=2)
    scale = check_scale(scale, K ** -0.5)

    def recurrence(inputs, S):
        q, k, v, g = inputs

        def step(t, S):
            log_decay = None if g is None else g[:, t]
            if g_gamma is not None:
                log_decay = g_gamma if log_decay is None else log_decay + g_gamma
            if log_decay is not None:
                S = S * log_decay.exp()[..., None, None]
            S = S + k[:, t, :, :, None] * v[:, t, :, None, :]
            return S, scale * torch.einsum('bhkv,bhk->bhv', S, q[:, t])

        return scan(step, S, q.shape[1])

    return run_sequences(recurrence, (q, k, v, g), initial_state, (H, K, V), cu_seqlens,
                         output_final_state)
