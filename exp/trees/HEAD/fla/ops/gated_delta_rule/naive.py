"""Float64 reference loop of the gated delta rule (ALGORITHMS.md §1)."""
from __future__ import annotations

import torch

from fla.ops.common.naive_loop import as_float64, l2_normalize, run_sequences, scan
from fla.utils.validation import check_scale


def naive_recurrent_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, cu_seqlens=None,
                                     use_qk_l2norm=False):
    """The gated delta rule, one token at a time in float64 (the ground truth).

    For every sequence and value head, with S₀ = ``initial_state[n]`` (zeros if None)::

        S_t = exp(g_t) · S_{t-1}
        S_t = S_t + β_t · k_t ⊗ (v_t − S_tᵀ k_t)
        o_t = scale · S_tᵀ q_t

    i.e. ``S_t = exp(g_t)(I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ``.

    Args:
        q, k: ``[B, T, H, K]``.
        v: ``[B, T, HV, V]``, HV a multiple of H: value head j reads q/k head j // (HV // H).
        g: ``[B, T, HV]`` natural-log decay (None: 0, the plain delta rule).
        beta: ``[B, T, HV]`` write strength (None: 1).
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]``; N = B, or the number of sequences with ``cu_seqlens``.
        cu_seqlens: ``[N + 1]`` int offsets of packed sequences (B must be 1).
        use_qk_l2norm: replace q, k by q/‖q‖₂, k/‖k‖₂ first.
    Returns:
        ``(o, final_state)``: ``o [B, T, HV, V]`` and ``final_state [N, HV, K, V]`` (None
        unless ``output_final_state``), both float64 whatever the input dtype.
    """
    q, k, v, g, beta = (as_float64(x) for x in (q, k, v, g, beta))
    H, K = q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    if HV % H:
        raise ValueError(f"v: expected the value heads HV to be a multiple of the q/k heads "
                         f"H = {H}, got HV = {HV}")
    scale = check_scale(scale, K ** -0.5)
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    if HV != H:
        q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)

    def recurrence(inputs, S):
        q, k, v, g, beta = inputs

        def step(t, S):
            if g is not None:
                S = S * g[:, t].exp()[..., None, None]
            k_t = k[:, t]
            delta = v[:, t] - torch.einsum('bhkv,bhk->bhv', S, k_t)
            if beta is not None:
                delta = delta * beta[:, t, :, None]
            S = S + k_t[..., :, None] * delta[..., None, :]
            return S, scale * torch.einsum('bhkv,bhk->bhv', S, q[:, t])

        return scan(step, S, q.shape[1])

    return run_sequences(recurrence, (q, k, v, g, beta), initial_state, (HV, K, V), cu_seqlens,
                         output_final_state)
