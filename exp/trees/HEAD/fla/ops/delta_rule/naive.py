"""Float64 reference loop of the delta rule: the gated delta rule with g ≡ 0."""
from __future__ import annotations

from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule


def naive_recurrent_delta_rule(q, k, v, beta=None, scale=None, initial_state=None,
                               output_final_state=False, cu_seqlens=None, use_qk_l2norm=False):
    """The delta rule (DeltaNet) one token at a time in float64::

        S_t = S_{t-1} + β_t · k_t ⊗ (v_t − S_{t-1}ᵀ k_t)
        o_t = scale · S_tᵀ q_t

    Shapes and options as :func:`naive_recurrent_gated_delta_rule` (q, k ``[B, T, H, K]``,
    v ``[B, T, HV, V]``, beta ``[B, T, HV]`` or None = 1, states ``[N, HV, K, V]``, scale
    default ``K ** -0.5``). Returns ``(o [B, T, HV, V], final_state or None)`` in float64.
    """
    return naive_recurrent_gated_delta_rule(
        q, k, v, g=None, beta=beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        use_qk_l2norm=use_qk_l2norm)
