"""Fused recurrent simple GLA (decoding; also trains): the gated delta rule's recurrent
kernels with the delta switched off (``delta=False``: u = v, no β), ALGORITHMS.md §2."""
from __future__ import annotations

import torch

from fla.ops.gated_delta_rule.fused_recurrent import fused_recurrent_triton
from fla.ops.gated_delta_rule.recurrent_torch import recurrent_gated_delta_rule_torch
from fla.ops.simple_gla.inputs import prepare_simple_gla_inputs
from fla.utils.backend import Backend, select_backend

__all__ = ["fused_recurrent_simple_gla"]


def fused_recurrent_simple_gla(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None = None,
    g_gamma: torch.Tensor | None = None, scale: float | None = None,
    initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None, head_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Simple GLA computed one token at a time (decoding; also differentiable).

    For every sequence n and head h, from ``S_0 = initial_state[n, h]`` (zeros if None)::

        S_t = exp(g_t + g_gamma[h]) · S_{t-1} + k_t ⊗ v_t
        o_t = scale · S_tᵀ q_t

    Args:
        q, k: ``[B, T, H, K]`` (``[B, H, T, K]`` with ``head_first=True``), K ≤ 256.
        v: ``[B, T, HV, V]``, V ≤ 256, HV a multiple of H.
        g: ``[B, T, HV]`` natural-log decay per token, or None.
        g_gamma: ``[HV]`` per-head constant log decay, or None (adds to g).
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]``; N = B, or the number of sequences with
            ``cu_seqlens``.
        output_final_state: also return the last state.
        cu_seqlens: ``[N + 1]`` offsets of packed sequences (B must be 1).
        head_first: inputs (and o) are ``[B, H, T, ...]``.

    Returns:
        ``(o, final_state)``: ``o`` like v (v's dtype), ``final_state [N, HV, K, V]``
        float32 or None. Differentiable in q, k, v, g, g_gamma and initial_state.
    """
    x = prepare_simple_gla_inputs(q, k, v, g, g_gamma, scale, initial_state, cu_seqlens,
                                  head_first)
    if select_backend(x.q, x.k, x.v, x.g, x.initial_state) is Backend.TORCH:
        o, final_state = recurrent_gated_delta_rule_torch(
            x.q, x.k, x.v, x.g, None, x.scale, x.initial_state, output_final_state,
            x.seq_offsets, delta=False)
    else:
        o, final_state = fused_recurrent_triton(
            x.q, x.k, x.v, x.g, None, x.scale, x.initial_state, output_final_state,
            x.cu_seqlens, x.N, delta=False)
    if head_first:
        o = o.transpose(1, 2)
    return o, final_state
