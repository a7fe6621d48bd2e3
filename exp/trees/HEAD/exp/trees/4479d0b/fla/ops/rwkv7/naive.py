"""Float64 reference loop of RWKV7 (Goose): the DPLR delta rule with q = r, gk = w."""
from __future__ import annotations

from fla.ops.generalized_delta_rule.naive import naive_recurrent_dplr_delta_rule


def naive_recurrent_rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=None,
                          output_final_state=False, cu_seqlens=None):
    """RWKV7 one token at a time in float64::

        S_t = diag(exp(w_t)) · S_{t-1} + b_t ⊗ (a_tᵀ S_{t-1}) + k_t ⊗ v_t
        o_t = scale · S_tᵀ r_t

    Args:
        r, w, k, a, b: ``[B, T, H, K]`` (w the natural-log decay); v: ``[B, T, H, V]``.
        scale: defaults to 1.0 (None also means 1.0).
        initial_state: ``[N, H, K, V]``; N = B, or the number of sequences with ``cu_seqlens``.
        cu_seqlens: ``[N + 1]`` int offsets of packed sequences (B must be 1).
    Returns:
        ``(o [B, T, H, V], final_state [N, H, K, V] or None)``, float64.
    """
    return naive_recurrent_dplr_delta_rule(
        r, k, v, a, b, gk=w, scale=1.0 if scale is None else scale,
        initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens)
