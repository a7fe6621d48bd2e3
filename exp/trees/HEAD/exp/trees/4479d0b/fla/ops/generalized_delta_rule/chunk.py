"""Chunked DPLR delta rule (training and prefill): the public function and its dispatch.

Per chunk of C = 64 tokens, γ the chunk-local cumulative gate (a K-vector per token),
γ⁻_t = γ_t − gk_t, and u_t = a_tᵀ S_{t-1} the value the low-rank term reads::

    A_qk = (Q Kᵀ ⊙ Γ) causal incl.,  A_qb = (Q Bᵀ ⊙ Γ) causal incl.
    A_ak = (A Kᵀ ⊙ Γ⁻) strict,       A_ab = (A Bᵀ ⊙ Γ⁻) strict
        (Γ[t,s,k] = e^{γ_tk − γ_sk}, Γ⁻[t,s,k] = e^{γ⁻_tk − γ_sk}, summed over k)
    Ai = (I − A_ab)⁻¹,  W = Ai (A ⊙ e^{γ⁻}),  U = Ai A_ak V
    u  = W S + U
    O  = scale [(Q ⊙ e^{γ}) S + A_qb u + A_qk V]
    S' = e^{γ_C} ⊙ S + (B ⊙ e^{γ_C − γ})ᵀ u + (K ⊙ e^{γ_C − γ})ᵀ V

CUDA tensors run the Triton stages (:mod:`fla.ops.common.chunk_dplr_fwd` and
``chunk_dplr_bwd``); CPU tensors the same equations in PyTorch
(:mod:`fla.ops.generalized_delta_rule.chunk_torch`), differentiated by autograd.
"""
from __future__ import annotations

import torch

from fla.ops.generalized_delta_rule.chunk_torch import chunk_dplr_delta_rule_torch
from fla.ops.generalized_delta_rule.inputs import DPLRInputs, prepare_dplr_inputs
from fla.utils.backend import Backend, select_backend


def chunk_dplr_on_inputs(x: DPLRInputs, output_final_state: bool):
    """Validated inputs (:func:`prepare_dplr_inputs`) -> time-major ``(o, final_state)``."""
    if select_backend(*x.tensors(), x.initial_state) is Backend.TORCH:
        return chunk_dplr_delta_rule_torch(*x.tensors(), x.scale, x.initial_state,
                                           output_final_state, x.seq_offsets)
    from fla.ops.generalized_delta_rule.chunk_function import chunk_dplr_triton
    return chunk_dplr_triton(x, output_final_state)


def chunk_dplr_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    gk: torch.Tensor, scale: float | None = None, initial_state: torch.Tensor | None = None,
    output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
    head_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""The DPLR (generalized) delta rule over whole sequences, chunk by chunk.

    For every sequence n and head h, from ``S_0 = initial_state[n, h]`` (zeros if None)::

        S_t = diag(exp(gk_t)) · S_{t-1} + b_t ⊗ (a_tᵀ S_{t-1}) + k_t ⊗ v_t
        o_t = scale · S_tᵀ q_t

    The rank-one term is ``b_t (a_tᵀ S_{t-1})``: a reads the state, b writes. The delta
    rule ``S_t = (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ`` is ``a = −β k, b = k,
    gk = 0`` with ``v ← β v``; the gated delta rule adds ``gk = g`` and ``a = −β e^{g} k``.

    Args:
        q, k, a, b: ``[B, T, H, K]`` (``[B, H, T, K]`` with ``head_first=True``), K ≤ 256.
        v: ``[B, T, H, V]``, V ≤ 256.
        gk: ``[B, T, H, K]`` natural-log decay (≤ 0) of the state's K rows; stable down to
            about −5 per step (RWKV7 keeps it above −e^{−0.5}).
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` (float32 preferred); N = B, or the number of
            sequences with ``cu_seqlens``.
        output_final_state: also return the state after each sequence's last token.
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of packed sequences (B must be 1).
        head_first: inputs and output are ``[B, H, T, ...]``.

    Returns:
        ``(o, final_state)``: ``o [B, T, H, V]`` in v's dtype; ``final_state [N, H, K, V]``
        float32, or None unless ``output_final_state``. Differentiable in q, k, v, a, b,
        gk and initial_state.
    """
    x = prepare_dplr_inputs(q, k, v, a, b, gk, scale, initial_state, cu_seqlens, head_first)
    o, final_state = chunk_dplr_on_inputs(x, output_final_state)
    if head_first:
        o = o.transpose(1, 2)
    return o, final_state
