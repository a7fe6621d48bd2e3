"""Chunked delta rule (DeltaNet): the chunked gated delta rule with g ≡ 0."""
from __future__ import annotations

import torch

from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule


def chunk_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor | None = None,
    scale: float | None = None, initial_state: torch.Tensor | None = None,
    output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
    head_first: bool = False, use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""The delta rule over whole sequences, chunk by chunk::

        S_t = S_{t-1} + β_t · k_t ⊗ (v_t − S_{t-1}ᵀ k_t)
        o_t = scale · S_tᵀ q_t

    Args:
        q, k: ``[B, T, H, K]`` (``[B, H, T, K]`` with ``head_first=True``), K ≤ 256.
        v: ``[B, T, HV, V]``, V ≤ 256, HV a multiple of H (grouped value heads).
        beta: ``[B, T, HV]``; None means 1.
        scale, initial_state, output_final_state, cu_seqlens, head_first,
        use_qk_l2norm_in_kernel: as in :func:`fla.ops.gated_delta_rule.chunk_gated_delta_rule`.

    Returns:
        ``(o, final_state)``: ``o [B, T, HV, V]`` in v's dtype; ``final_state`` float32
        ``[N, HV, K, V]`` or None. Differentiable in q, k, v, beta, initial_state.
    """
    return chunk_gated_delta_rule(
        q, k, v, g=None, beta=beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, head_first=head_first,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
