"""Fused recurrent (decoding) delta rule: the gated delta rule with g ≡ 0."""
from __future__ import annotations

import torch

from fla.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule


def fused_recurrent_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor | None = None,
    scale: float | None = None, initial_state: torch.Tensor | None = None,
    output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False, head_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""The delta rule (DeltaNet) one token at a time::

        S_t = S_{t-1} + β_t · k_t ⊗ (v_t − S_{t-1}ᵀ k_t)
        o_t = scale · S_tᵀ q_t

    Args:
        q, k: ``[B, T, H, K]`` (``[B, H, T, K]`` with ``head_first=True``), K ≤ 256.
        v: ``[B, T, HV, V]``, V ≤ 256, HV a multiple of H (grouped value heads).
        beta: ``[B, T, HV]``; None means 1.
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (float32 preferred); N = B or the number of
            sequences in ``cu_seqlens``.
        output_final_state, cu_seqlens, use_qk_l2norm_in_kernel, head_first: as in
            :func:`fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule`.

    Returns:
        ``(o, final_state)``: ``o`` like v in v's dtype; ``final_state`` float32
        ``[N, HV, K, V]`` or None. Differentiable in q, k, v, beta, initial_state.
    """
    return fused_recurrent_gated_delta_rule(
        q, k, v, g=None, beta=beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, head_first=head_first)
