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


def _forward(q, k, v, a, b, gk, initial_state, scale, output_final_state, cu_seqlens,
             chunk_indices, offsets, N, save):
    """``(o, ht, Aqk, Aqb, Aak, Ai, h, u)``; h and u (for the backward) only with ``save``."""
    Aqk, Aqb, Aak, Anab = chunk_dplr_fwd_intra(q, k, a, b, gk, cu_seqlens, chunk_indices)
    Ai = solve_tril_fwd(Anab, cu_seqlens, torch.float32, chunk_indices, offsets)
    o, ht, h, u = chunk_dplr_fwd_h(q, k, v, a, b, gk, Aqk, Aqb, Aak, Ai, scale,
                                   initial_state, output_final_state, cu_seqlens,
                                   offsets, N, save=save, chunk_size=CHUNK_SIZE)
    return o, ht, Aqk, Aqb, Aak, Ai, h, u


class ChunkDPLRFunction(torch.autograd.Function):
    """Autograd over the Triton stages; inputs validated, time-major, contiguous."""

    @staticmethod
    def forward(ctx, q, k, v, a, b, gk, initial_state, scale, output_final_state, cu_seqlens,
                chunk_indices, offsets, N):
        o, ht, Aqk, Aqb, Aak, Ai, h, u = compile_ahead.run(
            "dplr.fwd", _forward, q, k, v, a, b, gk, initial_state, scale, output_final_state,
            cu_seqlens, chunk_indices, offsets, N, True)
        ctx.save_for_backward(q, k, v, a, b, gk, initial_state, Aqk, Aqb, Aak, Ai, h, u, ht,
                              cu_seqlens, chunk_indices)
        ctx.scale, ctx.offsets, ctx.N = scale, offsets, N
        ctx.set_materialize_grads(False)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        from fla.ops.generalized_delta_rule.chunk_backward import chunk_dplr_bwd
        (q, k, v, a, b, gk, initial_state, Aqk, Aqb, Aak, Ai, h, u, ht, cu_seqlens,
         chunk_indices) = ctx.saved_tensors
        do = torch.zeros_like(v) if do is None else do.contiguous()
        dht = None if dht is None else dht.contiguous()
        grads = compile_ahead.run(
            "dplr.bwd", chunk_dplr_bwd, q, k, v, a, b, gk, initial_state, Aqk, Aqb, Aak, Ai, h,
            u, ht, do, dht, ctx.scale, cu_seqlens, chunk_indices, ctx.offsets, ctx.N)
        return (*grads, None, None, None, None, None, None)


def chunk_dplr_triton(x: DPLRInputs, output_final_state: bool):
    """Validated inputs -> time-major ``(o, final_state)`` through the Triton stages."""
    chunk_indices = (None if x.cu_seqlens is None else
                     prepare_chunk_indices(x.cu_seqlens, CHUNK_SIZE, cu_seqlens_cpu=x.seq_offsets))
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (*x.tensors(), x.initial_state))
    if needs_grad:
        return ChunkDPLRFunction.apply(*x.tensors(), x.initial_state, x.scale,
                                       output_final_state, x.cu_seqlens, chunk_indices,
                                       x.seq_offsets, x.N)
    o, ht, *_ = compile_ahead.run(
        "dplr.fwd", _forward, *x.tensors(), x.initial_state, x.scale, output_final_state,
        x.cu_seqlens, chunk_indices, x.seq_offsets, x.N, False)
    return o, ht
