"""Chunked GLA (training and prefill): the vector-gate chunk stages chained with autograd.

GLA is simple GLA with a gate per key channel (ALGORITHMS.md §3). Forward, in two
kernels (``fla.ops.common.chunk_gk_fwd``), with γ the chunk-local cumsum of the log gate:

    γ = chunk_local_cumsum(g),  A = (Q Kᵀ with e^{γ_i − γ_j} per channel, causal)
                                                chunk_gk_fwd_A (parallel)
    S' = diag(e^{γ_C}) S + (K ⊙ e^{γ_C − γ})ᵀ V,  O = scale[(Q ⊙ e^γ) S + A V]
                                                chunk_gk_fwd_h (sequential over chunks)

Backward: the states h recomputed (``chunk_gk_fwd_h``, no output); the reverse state pass
(``chunk_delta_h_bwd``, vector gate) gives dh, dh0 and dV (its in-chunk part scale·Aᵀ dO
from the saved A); both passes read the forward's gated operands Q ⊙ e^{γq} and
K ⊙ e^{γ_C − γ}, kept when an input needed a gradient. ``chunk_gk_bwd`` gives dQ, dK and
∂L/∂g (the reverse chunk-local cumsum of ∂L/∂γ done in registers).

Both state passes ``chunk_gk_fwd_h`` (the forward's, the backward's recomputation of h)
split few long sequences into segments where the launch model says the GPU would
otherwise idle; the host copy of ``cu_seqlens`` read by the input checks travels with the
stages as ``offsets``, so that choice reads nothing back from the device.

RWKV6 runs the same stages with ``exclusive=True`` (its query reads the state before its
token: query gate γ − w, strictly causal A) and its bonus u on A's diagonal.
"""
from __future__ import annotations

import torch

from fla.ops.common.chunk_delta_h_bwd import chunk_gated_delta_rule_bwd_dhu
from fla.ops.common.chunk_gk_bwd import chunk_gk_bwd_dqkg
from fla.ops.common.chunk_gk_fwd import chunk_gk_fwd, chunk_gk_fwd_h
from fla.ops.gla.inputs import GLAInputs, prepare_gla_inputs
from fla.ops.gla.recurrent_torch import chunk_gla_torch
from fla.ops.utils.index import prepare_chunk_indices, varlen_chunk_offsets
from fla.utils import compile_ahead
from fla.utils.custom_ops import needs_backward, present, stage_op, upstream_grads
from fla.utils.backend import Backend, select_backend

__all__ = ["chunk_gla", "chunk_gla_on_inputs"]

CHUNK_SIZE = 64


def _forward(q, k, v, g, u, initial_state, scale, output_final_state, keep_operands,
             cu_seqlens, chunk_indices, chunk_offsets, offsets, exclusive, out_dtype):
    """``(o, final_state, g_cum, A, qg, kg)`` by the GLA forward stages; the gated
    operands qg, kg (for the backward's state passes) None unless ``keep_operands``.
    ``offsets``: the host copy of ``cu_seqlens`` (read once by the input checks), with
    which the state pass may split few long sequences into segments, no device read."""
    return chunk_gk_fwd(q, k, v, g, scale, u=u, initial_state=initial_state,
                        output_final_state=output_final_state, chunk_offsets=chunk_offsets,
                        exclusive=exclusive, out_dtype=out_dtype, cu_seqlens=cu_seqlens,
                        chunk_indices=chunk_indices, keep_operands=keep_operands,
                        offsets=offsets)


def _backward(q, k, v, g, u, g_cum, A, qg, kg, initial_state, cu_seqlens, chunk_indices,
              chunk_offsets, offsets, do, dht, scale, exclusive):
    """Gradients (dq, dk, dv, dg, du, dh0) from the forward's saved tensors. With the
    gated operands (a forward run with gradients enabled) both state passes read them
    and form no exponential over a tile; without, they gate q and k themselves."""
    varlen = dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    NT = None if cu_seqlens is None else chunk_indices.shape[0]
    gated = qg is not None
    q_pass, k_pass = (qg, kg) if gated else (q, k)
    _, h, _ = chunk_gk_fwd_h(q_pass, k_pass, v, g_cum, None, scale, initial_state, False,
                             store_h=True, store_o=False, cu_seqlens=cu_seqlens,
                             chunk_offsets=chunk_offsets, NT=NT, exclusive=exclusive,
                             gated_operands=gated, offsets=offsets)
    dh, dh0, dv = chunk_gated_delta_rule_bwd_dhu(
        q_pass, k_pass, None, g_cum, initial_state, dht, do, None, scale,
        chunk_size=CHUNK_SIZE, Aqk=A, gq_exclusive=exclusive, gated_operands=gated, **varlen)
    dq, dk, dg, du = chunk_gk_bwd_dqkg(q, k, v, g, g_cum, h, do, dh, scale, u=u,
                                       exclusive=exclusive, **varlen)
    return (dq, dk, dv.to(v.dtype), dg, None if u is None else du.to(u.dtype),
            None if initial_state is None else dh0.to(initial_state.dtype))


# The forward and backward steps as custom ops joined by the autograd formula below; the
# forward also returns γ and A (64 values a token and head) and, when an input needs a
# gradient, the gated operands (2·K values a token and head, in q's dtype; empty
# placeholders otherwise); h (K·V/64 a token) is recomputed in the backward.
_chunk_fwd = stage_op(
    "chunk_gla_fwd", _forward, label="gla.fwd",
    schema="(Tensor q, Tensor k, Tensor v, Tensor g, Tensor? u, Tensor? initial_state, "
           "float scale, bool output_final_state, bool keep_operands, Tensor? cu_seqlens, "
           "Tensor? chunk_indices, Tensor? chunk_offsets, int[]? offsets, bool exclusive, "
           "ScalarType out_dtype) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
_chunk_bwd = stage_op(
    "chunk_gla_bwd", _backward, label="gla.bwd",
    schema="(Tensor q, Tensor k, Tensor v, Tensor g, Tensor? u, Tensor g_cum, Tensor A, "
           "Tensor? qg, Tensor? kg, Tensor? initial_state, Tensor? cu_seqlens, "
           "Tensor? chunk_indices, Tensor? chunk_offsets, int[]? offsets, Tensor do, "
           "Tensor? dht, float scale, bool exclusive) "
           "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")


def _setup_context(ctx, inputs, output):
    (q, k, v, g, u, initial_state, scale, output_final_state, keep_operands, cu_seqlens,
     chunk_indices, chunk_offsets, offsets, exclusive, _) = inputs
    _, _, g_cum, A, qg, kg = output
    ctx.save_for_backward(q, k, v, g, u, g_cum, A, present(qg, keep_operands),
                          present(kg, keep_operands), initial_state, cu_seqlens,
                          chunk_indices, chunk_offsets)
    ctx.scale, ctx.exclusive, ctx.offsets = scale, exclusive, offsets
    ctx.output_final_state = output_final_state


def _backward_formula(ctx, do, dht, _dg_cum, _dA, _dqg, _dkg):
    saved = ctx.saved_tensors
    do, dht = upstream_grads(do, dht, saved[2], ctx.output_final_state)  # saved[2]: v
    dq, dk, dv, dg, du, dh0 = _chunk_bwd(*saved, ctx.offsets, do, dht, ctx.scale,
                                         ctx.exclusive)
    return (dq, dk, dv, dg, present(du, saved[4] is not None),
            present(dh0, saved[9] is not None), None, None, None, None, None, None, None,
            None, None)


_chunk_fwd.register_autograd(_backward_formula, setup_context=_setup_context)


def _backward_args(args, outputs):
    """The first backward's arguments (its compile-ahead prefetch in the first forward)."""
    (q, k, v, g, u, initial_state, scale, output_final_state, keep_operands, cu_seqlens,
     chunk_indices, chunk_offsets, offsets, exclusive, _) = args
    o, final_state, g_cum, A, qg, kg = outputs
    return (q, k, v, g, u, g_cum, A, present(qg, keep_operands), present(kg, keep_operands),
            initial_state, cu_seqlens, chunk_indices, chunk_offsets, offsets,
            torch.empty_like(o), final_state if output_final_state else None, scale,
            exclusive)


compile_ahead.follow("gla.fwd", "gla.bwd", _backward, _backward_args)


def with_bonus(x: GLAInputs, o_state: torch.Tensor) -> torch.Tensor:
    """RWKV6's current-token term: o_state + scale (Σ_i r_i u_i k_i) v, in float32 (the
    paths that do not fold it into their kernels: the PyTorch and recurrent ones)."""
    rk = (x.q.float() * x.u.float() * x.k.float()).sum(-1, keepdim=True)   # [B, T, H, 1]
    return o_state.float() + x.scale * rk * x.v.float()


def chunk_gla_on_inputs(x: GLAInputs, output_final_state: bool, exclusive: bool = False,
                        out_dtype=None):
    """Run validated inputs (``x.gk`` the per-token log gate) through the chunked algorithm;
    returns time-major ``(o, final_state)``, o in ``out_dtype`` (default v's).
    ``exclusive``: RWKV6 (the query reads the state before its token), with the bonus of
    the current token ``scale (Σ_i r_i u_i k_i) v`` when ``x.u`` is given."""
    out_dtype = x.v.dtype if out_dtype is None else out_dtype
    if select_backend(x.q, x.k, x.v, x.gk, x.u, x.initial_state) is Backend.TORCH:
        o, final_state = chunk_gla_torch(x.q, x.k, x.v, x.gk, x.scale, x.initial_state,
                                         x.seq_offsets, exclusive, CHUNK_SIZE)
        if exclusive and x.u is not None:
            o = with_bonus(x, o)
        return o.to(out_dtype), (final_state if output_final_state else None)
    if x.cu_seqlens is None:
        chunk_indices = chunk_offsets = None
    else:
        chunk_indices = prepare_chunk_indices(x.cu_seqlens, CHUNK_SIZE,
                                              cu_seqlens_cpu=x.seq_offsets)
        chunk_offsets = varlen_chunk_offsets(x.cu_seqlens, CHUNK_SIZE, x.seq_offsets)
    u = x.u.contiguous() if exclusive and x.u is not None else None
    keep_operands = needs_backward(x.q, x.k, x.v, x.gk, u, x.initial_state)
    o, final_state, *_ = _chunk_fwd(x.q, x.k, x.v, x.gk, u, x.initial_state, x.scale,
                                    output_final_state, keep_operands, x.cu_seqlens,
                                    chunk_indices, chunk_offsets, x.seq_offsets, exclusive,
                                    out_dtype)
    return o, present(final_state, output_final_state)


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
