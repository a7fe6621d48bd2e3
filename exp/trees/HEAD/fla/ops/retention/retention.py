"""Retention (RetNet) as thin wrappers over simple GLA with RetNet's fixed head decays."""
from __future__ import annotations

import torch

from fla.ops.retention.naive import retention_log_decay
from fla.ops.simple_gla.chunk import chunk_simple_gla
from fla.ops.simple_gla.fused_recurrent import fused_recurrent_simple_gla
from fla.utils.validation import Dims, check_shape, check_tensor, token_layout

__all__ = ["chunk_retention", "fused_recurrent_retention"]


def _head_decays(v: torch.Tensor, head_first: bool) -> torch.Tensor:
    """``log(1 − 2^(−5−h))`` for each head of v, float32 on v's device."""
    check_tensor("v", v)
    # Only the rank here (H is read from v); every other rule is simple GLA's.
    check_shape("v", v, token_layout("B T H V", head_first), Dims())
    H = v.shape[1] if head_first else v.shape[2]
    return retention_log_decay(H).to(device=v.device, dtype=torch.float32)


def chunk_retention(q, k, v, scale=None, initial_state=None, output_final_state=False,
                    cu_seqlens=None, head_first=False):
    r"""Retention over whole sequences, chunk by chunk: for head h with
    ``γ_h = 1 − 2^(−5−h)``::

        S_t = γ_h · S_{t-1} + k_t ⊗ v_t,    o_t = scale · S_tᵀ q_t

    Arguments, shapes and returns as :func:`fla.ops.simple_gla.chunk_simple_gla` without
    ``g``/``g_gamma`` (q, k ``[B, T, H, K]``, v ``[B, T, H, V]``; ``(o, final_state)``).
    """
    return chunk_simple_gla(q, k, v, g_gamma=_head_decays(v, head_first), scale=scale,
                            initial_state=initial_state, output_final_state=output_final_state,
                            cu_seqlens=cu_seqlens, head_first=head_first)


def fused_recurrent_retention(q, k, v, scale=None, initial_state=None, output_final_state=False,
                              cu_seqlens=None, head_first=False):
    r"""Retention one token at a time (decoding): the recurrence of
    :func:`chunk_retention`, arguments and returns as
    :func:`fla.ops.simple_gla.fused_recurrent_simple_gla` without ``g``/``g_gamma``."""
    return fused_recurrent_simple_gla(q, k, v, g_gamma=_head_decays(v, head_first),
                                      scale=scale, initial_state=initial_state,
                                      output_final_state=output_final_state,
                                      cu_seqlens=cu_seqlens, head_first=head_first)
