"""RWKV6 (Finch) chunked and fused recurrent: GLA's stages with the exclusive switch plus
the bonus of the current token (ALGORITHMS.md §3)::

    o_t = scale · ( S_{t-1}ᵀ r_t + (Σ_i r_t,i u_i k_t,i) v_t )
    S_t = diag(exp(w_t)) · S_{t-1} + k_t ⊗ v_t

The state part ``scale · S_{t-1}ᵀ r_t`` is GLA with q = r, gate w, read *before* the
token's update: ``exclusive=True`` in :func:`fla.ops.gla.chunk.chunk_gla_on_inputs` and
:func:`fla.ops.gla.fused_recurrent.fused_recurrent_gla_on_inputs` (query gate γ − w,
strictly causal in-chunk scores). In the chunked form the bonus is the diagonal of the
in-chunk scores A (A_tt = Σ_i r_t,i u_i k_t,i), so the kernels add it with the rest of
A V, and du = Σ_t scale (do_t · v_t) r_t ⊙ k_t is reduced from per-chunk partials. The
fused recurrent form keeps its state part in float32 and adds the bonus here with
autograd.
"""
from __future__ import annotations

import torch

from fla.ops.gla.chunk import chunk_gla_on_inputs, with_bonus
from fla.ops.gla.fused_recurrent import fused_recurrent_gla_on_inputs
from fla.ops.gla.inputs import prepare_gla_inputs

__all__ = ["chunk_rwkv6", "fused_recurrent_rwkv6"]


def _prepare(r, k, v, w, u, scale, initial_state, cu_seqlens, head_first):
    if w is None or u is None:
        raise ValueError(f"{'w' if w is None else 'u'}: RWKV6 needs the log decay w "
                         f"[B, T, H, K] and the bonus u [H, K], got None")
    return prepare_gla_inputs(r, k, v, w, None, scale, initial_state, cu_seqlens, head_first,
                              u=u, names=("r", "w"))


def chunk_rwkv6(
    r: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, u: torch.Tensor,
    scale: float | None = None, initial_state: torch.Tensor | None = None,
    output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
    head_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""RWKV6 over whole sequences, chunk by chunk.

    For every sequence n and head h, from ``S_0 = initial_state[n, h]`` (zeros if None)::

        o_t = scale · ( S_{t-1}ᵀ r_t + (Σ_i r_t,i u_i k_t,i) v_t )
        S_t = diag(exp(w_t)) · S_{t-1} + k_t ⊗ v_t

    Args:
        r, k: ``[B, T, H, K]`` receptance and key (``[B, H, T, K]`` with
            ``head_first=True``), K ≤ 256.
        v: ``[B, T, H, V]``, V ≤ 256.
        w: ``[B, T, H, K]`` natural-log decay (≤ 0; float32 recommended).
        u: ``[H, K]`` bonus of the current token.
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` (float32 recommended); N = B, or the number of
            sequences with ``cu_seqlens``.
        output_final_state: also return the state after each sequence's last token.
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of packed sequences (B must be 1).
        head_first: inputs and output are ``[B, H, T, ...]``.

    Returns:
        ``(o, final_state)``: ``o [B, T, H, V]`` in v's dtype; ``final_state
        [N, H, K, V]`` float32 or None. Differentiable in r, k, v, w, u, initial_state.
    """
    x = _prepare(r, k, v, w, u, scale, initial_state, cu_seqlens, head_first)
    # The bonus is A's diagonal in the chunk kernels (and du their per-chunk partials).
    o, final_state = chunk_gla_on_inputs(x, output_final_state, exclusive=True)
    if head_first:
        o = o.transpose(1, 2)
    return o, final_state


def fused_recurrent_rwkv6(
    r: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, u: torch.Tensor,
    scale: float | None = None, initial_state: torch.Tensor | None = None,
    output_final_state: bool = False, reverse: bool = False,
    cu_seqlens: torch.Tensor | None = None, head_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""RWKV6 one token at a time (decoding; also trains); the recurrence and arguments of
    :func:`chunk_rwkv6`, plus ``reverse`` (run each sequence from its last token to its
    first). Returns ``(o, final_state)`` like :func:`chunk_rwkv6`."""
    x = _prepare(r, k, v, w, u, scale, initial_state, cu_seqlens, head_first)
    o, final_state = fused_recurrent_gla_on_inputs(x, output_final_state, reverse,
                                                   exclusive=True, out_dtype=torch.float32)
    o = with_bonus(x, o).to(x.v.dtype)
    if head_first:
        o = o.transpose(1, 2)
    return o, final_state
