"""The Triton chunked DPLR delta rule: the stages chained with autograd.

Forward (:mod:`fla.ops.generalized_delta_rule.chunk` states the equations):

    A_qk, A_qb, A_ak, −A_ab      chunk_dplr_fwd_intra   (parallel over chunks)
    Ai = (I − A_ab)⁻¹            solve_tril             (parallel over chunks)
    O, S', h, u                  chunk_dplr_fwd_h       (sequential over chunks)

Backward, with dS' the gradient of the state leaving a chunk and dZ = Aiᵀ du (the
adjoint of the chunk's triangular system u = Ai Z, Z = (a ⊙ e^{γ⁻}) S + A_ak V):

    dS', du, dZ, dv, dh0         chunk_dplr_bwd_dhu     (sequential, reverse)
    ∂/∂(q, k, a, b) through the decayed vectors, dA_* = (scale·dO Vᵀ, scale·dO uᵀ,
        dZ Vᵀ, dZ uᵀ), Σ_v dS'⊙S' chunk_dplr_bwd_local  (parallel)
    dq, dk, da, db through dA_*, and dgk from them (gate_grad's identity, summed
        within the chunk in fp32)  chunk_dplr_bwd_intra (parallel)
"""
from __future__ import annotations

import torch

from fla.ops.common.chunk_dplr_fwd_h import chunk_dplr_fwd_h
from fla.ops.common.chunk_dplr_fwd_intra import CHUNK_SIZE, chunk_dplr_fwd_intra
from fla.ops.generalized_delta_rule.inputs import DPLRInputs
from fla.ops.utils.index import prepare_chunk_indices
from fla.ops.utils.solve_tril import solve_tril_fwd
from fla.utils import compile_ahead
from fla.utils.custom_ops import needs_backward, present, stage_op, upstream_grads


def _forward(q, k, v, a, b, gk, initial_state, scale, output_final_state, cu_seqlens,
             chunk_indices, offsets, N, save):
    """``(o, ht, Aqk, Aqb, Aak, Ai, h, u)``; h and u (for the backward) only with ``save``."""
    Aqk, Aqb, Aak, Anab = chunk_dplr_fwd_intra(q, k, a, b, gk, cu_seqlens, chunk_indices)
    Ai = solve_tril_fwd(Anab, cu_seqlens, torch.float32, chunk_indices, offsets)
    o, ht, h, u = chunk_dplr_fwd_h(q, k, v, a, b, gk, Aqk, Aqb, Aak, Ai, scale,
                                   initial_state, output_final_state, cu_seqlens,
                                   offsets, N, save=save, chunk_size=CHUNK_SIZE)
    return o, ht, Aqk, Aqb, Aak, Ai, h, u


def _backward(q, k, v, a, b, gk, initial_state, Aqk, Aqb, Aak, Ai, h, u, ht, do, dht, scale,
              cu_seqlens, chunk_indices, offsets, N):
    from fla.ops.generalized_delta_rule.chunk_backward import chunk_dplr_bwd

    return chunk_dplr_bwd(q, k, v, a, b, gk, initial_state, Aqk, Aqb, Aak, Ai, h, u, ht, do,
                          dht, scale, cu_seqlens, chunk_indices, offsets, N)


# The forward and backward steps as custom ops joined by the autograd formula below. With
# ``save`` the forward also returns the per-chunk states h and u for the backward.
_chunk_fwd = stage_op(
    "chunk_dplr_delta_rule_fwd", _forward, label="dplr.fwd",
    schema="(Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, Tensor gk, "
           "Tensor? initial_state, float scale, bool output_final_state, Tensor? cu_seqlens, "
           "Tensor? chunk_indices, int[]? offsets, int N, bool save) "
           "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
_chunk_bwd = stage_op(
    "chunk_dplr_delta_rule_bwd", _backward, label="dplr.bwd",
    schema="(Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, Tensor gk, "
           "Tensor? initial_state, Tensor Aqk, Tensor Aqb, Tensor Aak, Tensor Ai, Tensor h, "
           "Tensor u, Tensor? ht, Tensor do, Tensor? dht, float scale, Tensor? cu_seqlens, "
           "Tensor? chunk_indices, int[]? offsets, int N) "
           "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")


def _setup_context(ctx, inputs, output):
    (q, k, v, a, b, gk, initial_state, scale, output_final_state, cu_seqlens, chunk_indices,
     offsets, N, _) = inputs
    _, ht, Aqk, Aqb, Aak, Ai, h, u = output
    ctx.save_for_backward(q, k, v, a, b, gk, initial_state, Aqk, Aqb, Aak, Ai, h, u,
                          present(ht, output_final_state), cu_seqlens, chunk_indices)
    ctx.scale, ctx.offsets, ctx.N = scale, offsets, N
    ctx.output_final_state = output_final_state


def _backward_formula(ctx, do, dht, *_):
    (q, k, v, a, b, gk, initial_state, Aqk, Aqb, Aak, Ai, h, u, ht, cu_seqlens,
     chunk_indices) = ctx.saved_tensors
    do, dht = upstream_grads(do, dht, v, ctx.output_final_state)
    *grads, dh0 = _chunk_bwd(q, k, v, a, b, gk, initial_state, Aqk, Aqb, Aak, Ai, h, u, ht,
                             do, dht, ctx.scale, cu_seqlens, chunk_indices, ctx.offsets, ctx.N)
    return (*grads, present(dh0, initial_state is not None), None, None, None, None, None,
            None, None)


_chunk_fwd.register_autograd(_backward_formula, setup_context=_setup_context)


def _backward_args(args, outputs):
    """The first backward's arguments (its compile-ahead prefetch in the first forward)."""
    (q, k, v, a, b, gk, initial_state, scale, output_final_state, cu_seqlens, chunk_indices,
     offsets, N, save) = args
    o, ht, Aqk, Aqb, Aak, Ai, h, u = outputs
    if not save:
        return None
    return (q, k, v, a, b, gk, initial_state, Aqk, Aqb, Aak, Ai, h, u, ht, torch.empty_like(o),
            ht if output_final_state else None, scale, cu_seqlens, chunk_indices, offsets, N)


compile_ahead.follow("dplr.fwd", "dplr.bwd", _backward, _backward_args)


def chunk_dplr_triton(x: DPLRInputs, output_final_state: bool):
    """Validated inputs -> time-major ``(o, final_state)`` through the Triton stages."""
    chunk_indices = (None if x.cu_seqlens is None else
                     prepare_chunk_indices(x.cu_seqlens, CHUNK_SIZE, cu_seqlens_cpu=x.seq_offsets))
    # h and u ([NT, H, K, V] and [B, T, H, V]) are kept only when a backward will need them.
    save = needs_backward(*x.tensors(), x.initial_state)
    o, ht, *_ = _chunk_fwd(*x.tensors(), x.initial_state, x.scale, output_final_state,
                           x.cu_seqlens, chunk_indices, x.seq_offsets, x.N, save)
    return o, present(ht, output_final_state)
