"""Chunked GLA (training and prefill): the vector-gate chunk stages chained with autograd.

GLA is simple GLA with a gate per key channel (ALGORITHMS.md §3). Forward, with γ the
chunk-local cumsum of the log gate ``[B, T, H, K]``:

    γ = chunk_local_cumsum(g)                                     (parallel)
    h[c] = S entering chunk c, S' = diag(e^{γ_C}) S + (K ⊙ e^{γ_C − γ})ᵀ V
                                                chunk_delta_h, vector gate (sequential)
    A = (Q Kᵀ with e^{γ_i − γ_j} per channel, causal),  O = scale[(Q ⊙ e^γ) h + A V]
                                                chunk_gk_fwd (parallel)

Backward: h recomputed; the reverse state pass (``chunk_delta_h_bwd``, vector gate) gives
dh, dh0 and dV (its in-chunk part scale·Aᵀ dO from the saved A); ``chunk_gk_bwd`` gives
dQ, dK and ∂L/∂γ, whose reverse chunk-local cumsum is ∂L/∂g.

RWKV6 runs the same stages with ``exclusive=True`` (its query reads the state before its
token: query gate γ − w, strictly causal A; the bonus term is added by fla.ops.rwkv6).
"""
from __future__ import annotations

import torch

from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
from fla.ops.common.chunk_delta_h_bwd import chunk_gated_delta_rule_bwd_dhu
from fla.ops.common.chunk_gk_bwd import chunk_gk_bwd_dqkg
from fla.ops.common.chunk_gk_fwd import chunk_gk_fwd_o
from fla.ops.gla.inputs import GLAInputs, prepare_gla_inputs
from fla.ops.gla.recurrent_torch import chunk_gla_torch
from fla.ops.utils.cumsum import chunk_local_cumsum_fwd
from fla.ops.utils.index import prepare_chunk_indices
from fla.utils.backend import Backend, select_backend

__all__ = ["chunk_gla", "chunk_gla_on_inputs"]

CHUNK_SIZE = 64


def _gates(g, cu_seqlens, chunk_indices, offsets, exclusive):
    """γ (float32 chunk-local cumsum) and the query side's gate (γ, or γ − g)."""
    g_cum = chunk_local_cumsum_fwd(g, CHUNK_SIZE, cu_seqlens=cu_seqlens,
                                   chunk_indices=chunk_indices, offsets=offsets)
    return g_cum, (g_cum - g.float() if exclusive else g_cum)


class ChunkGLAFunction(torch.autograd.Function):
    """Autograd over the Triton stages; inputs are validated, time-major, contiguous."""

    @staticmethod
    def forward(ctx, q, k, v, g, initial_state, scale, output_final_state, cu_seqlens,
                chunk_indices, offsets, exclusive, out_dtype):
        varlen = dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
        g_cum, gq = _gates(g, cu_seqlens, chunk_indices, offsets, exclusive)
        h, _, final_state = chunk_gated_delta_rule_fwd_h(
            k, None, v, g_cum, initial_state, output_final_state, chunk_size=CHUNK_SIZE,
            save_new_value=False, **varlen)
        o, A = chunk_gk_fwd_o(q, k, v, g_cum, gq, h, scale, exclusive=exclusive,
                              out_dtype=out_dtype, **varlen)
        # A (64 values a token and head) is kept for the reverse state pass's dv_local;
        # h (K·V/64 a token) is recomputed.
        ctx.save_for_backward(q, k, v, g, A, initial_state, cu_seqlens, chunk_indices)
        ctx.scale, ctx.offsets, ctx.exclusive = scale, offsets, exclusive
        return o, final_state

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, A, initial_state, cu_seqlens, chunk_indices = ctx.saved_tensors
        scale, exclusive = ctx.scale, ctx.exclusive
        varlen = dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
        do = torch.zeros_like(v) if do is None else do.contiguous()
        dht = None if dht is None else dht.contiguous()
        g_cum, gq = _gates(g, cu_seqlens, chunk_indices, ctx.offsets, exclusive)
        h, _, _ = chunk_gated_delta_rule_fwd_h(k, None, v, g_cum, initial_state, False,
                                               chunk_size=CHUNK_SIZE, save_new_value=False,
                                               **varlen)
        dh, dh0, dv = chunk_gated_delta_rule_bwd_dhu(
            q, k, None, g_cum, initial_state, dht, do, None, scale, chunk_size=CHUNK_SIZE,
            Aqk=A, gq=gq, **varlen)
        dq, dk, dg = chunk_gk_bwd_dqkg(q, k, v, g_cum, gq, h, do, dh, scale,
                                       exclusive=exclusive, **varlen)
        # γ is a chunk-local prefix sum of g: ∂L/∂g is the reverse (suffix) sum of ∂L/∂γ;
        # RWKV6's query gate γ − g adds −q ⊙ dq.
        dg = chunk_local_cumsum_fwd(dg, CHUNK_SIZE, reverse=True, offsets=ctx.offsets, **varlen)
        if exclusive:
            dg = dg - q.float() * dq
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype),
                None if initial_state is None else dh0.to(initial_state.dtype),
                None, None, None, None, None, None, None)


def chunk_gla_on_inputs(x: GLAInputs, output_final_state: bool, exclusive: bool = False,
                        out_dtype=None):
    """Run validated inputs (``x.gk`` the per-token log gate) through the chunked algorithm;
    returns time-major ``(o, final_state)``, o in ``out_dtype`` (default v's).
    ``exclusive``: RWKV6's state part (the query reads the state before its token)."""
    out_dtype = x.v.dtype if out_dtype is None else out_dtype
    if select_backend(x.q, x.k, x.v, x.gk, x.initial_state) is Backend.TORCH:
        o, final_state = chunk_gla_torch(x.q, x.k, x.v, x.gk, x.scale, x.initial_state,
                                         x.seq_offsets, exclusive, CHUNK_SIZE)
        return o.to(out_dtype), (final_state if output_final_state else None)
    chunk_indices = (None if x.cu_seqlens is None else
                     prepare_chunk_indices(x.cu_seqlens, CHUNK_SIZE, cu_seqlens_cpu=x.seq_offsets))
    return ChunkGLAFunction.apply(x.q, x.k, x.v, x.gk, x.initial_state, x.scale,
                                  output_final_state, x.cu_seqlens, chunk_indices,
                                  x.seq_offsets, exclusive, out_dtype)


def chunk_gla(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
    scale: float | None = None, initial_state: torch.Tensor | None = None,
    output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
    head_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Gated linear attention (a decay per key channel) over whole sequences, chunk by chunk.

    For every sequence n and head h, from ``S_0 = initial_state[n, h]`` (zeros if None)::

        S_t = diag(exp(g_t)) · S_{t-1} + k_t ⊗ v_t
        o_t = scale · S_tᵀ q_t

    Args:
        q, k: ``[B, T, H, K]`` (``[B, H, T, K]`` with ``head_first=True``), K ≤ 256.
        v: ``[B, T, H, V]``, V ≤ 256.
        g: ``[B, T, H, K]`` natural-log decay per token and key channel (≤ 0; down to −5
            a step is safe in every dtype; float32 recommended).
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` (float32 recommended); N = B, or the number of
            sequences with ``cu_seqlens``.
        output_final_state: also return the state after each sequence's last token.
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of packed sequences (B must be 1).
        head_first: inputs and output are ``[B, H, T, ...]``.

    Returns:
        ``(o, final_state)``: ``o [B, T, H, V]`` in v's dtype; ``final_state
        [N, H, K, V]`` float32, or None unless ``output_final_state``. Differentiable in
        q, k, v, g and initial_state.

    CUDA tensors run the Triton kernels; CPU tensors run the same chunked algorithm in
    PyTorch (or the kernels themselves under ``TRITON_INTERPRET=1``).
    """
    if g is None:
        raise ValueError("g: chunk_gla needs the log gate [B, T, H, K]; for no decay use "
                         "fla.ops.simple_gla.chunk_simple_gla")
    x = prepare_gla_inputs(q, k, v, g, None, scale, initial_state, cu_seqlens, head_first,
                           names=("q", "g"))
    o, final_state = chunk_gla_on_inputs(x, output_final_state)
    if head_first:
        o = o.transpose(1, 2)
    return o, final_state
