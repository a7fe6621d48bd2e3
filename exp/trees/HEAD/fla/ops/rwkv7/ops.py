"""RWKV7 (Goose): the DPLR delta rule with q = r, gk = w and scale 1.0 by default."""
from __future__ import annotations

import torch

from fla.ops.generalized_delta_rule.chunk import chunk_dplr_on_inputs
from fla.ops.generalized_delta_rule.fused_recurrent import fused_recurrent_dplr_on_inputs
from fla.ops.generalized_delta_rule.inputs import prepare_dplr_inputs

_NAMES = ("r", "k", "v", "a", "b", "w")

_DOC = r"""RWKV7's state update, {how}.

    For every sequence n and head h, from ``S_0 = initial_state[n, h]`` (zeros if None)::

        S_t = diag(exp(w_t)) · S_{{t-1}} + b_t ⊗ (a_tᵀ S_{{t-1}}) + k_t ⊗ v_t
        o_t = scale · S_tᵀ r_t

    RWKV7 layers pass w ∈ (−e^{{−0.5}}, 0) (log decay), ``a = −κ̂`` and
    ``b = κ̂ ⊙ a_gate`` with κ̂ the L2-normalised key.

    Args:
        r, w, k, a, b: ``[B, T, H, K]`` (``[B, H, T, K]`` with ``head_first=True``),
            K ≤ 256; v: ``[B, T, H, V]``.
        scale: defaults to 1.0 (None also means 1.0).
        initial_state: ``[N, H, K, V]``; N = B, or the number of sequences with ``cu_seqlens``.
        output_final_state: also return the last state.
        cu_seqlens: ``[N + 1]`` offsets of packed sequences (B must be 1).
        head_first: inputs and output are ``[B, H, T, ...]``.

    Returns:
        ``(o [B, T, H, V] in v's dtype, final_state [N, H, K, V] float32 or None)``;
        differentiable in every input and the initial state.
    """


def _call(on_inputs, r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens,
          head_first):
    x = prepare_dplr_inputs(r, k, v, a, b, w, scale, initial_state, cu_seqlens, head_first,
                            names=_NAMES, default_scale=1.0)
    o, final_state = on_inputs(x, output_final_state)
    return (o.transpose(1, 2) if head_first else o), final_state


def chunk_rwkv7(r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                a: torch.Tensor, b: torch.Tensor, scale: float | None = 1.0,
                initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                cu_seqlens: torch.Tensor | None = None, head_first: bool = False):
    return _call(chunk_dplr_on_inputs, r, w, k, v, a, b, scale, initial_state,
                 output_final_state, cu_seqlens, head_first)


def fused_recurrent_rwkv7(r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          a: torch.Tensor, b: torch.Tensor, scale: float | None = 1.0,
                          initial_state: torch.Tensor | None = None,
                          output_final_state: bool = False,
                          cu_seqlens: torch.Tensor | None = None, head_first: bool = False):
    return _call(fused_recurrent_dplr_on_inputs, r, w, k, v, a, b, scale, initial_state,
                 output_final_state, cu_seqlens, head_first)


chunk_rwkv7.__doc__ = _DOC.format(how="computed chunk by chunk (training, prefill)")
fused_recurrent_rwkv7.__doc__ = _DOC.format(how="one token at a time (decoding; also trains)")
