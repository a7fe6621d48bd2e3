"""Chunked simple GLA (training and prefill): the shared chunk stages chained with autograd.

Simple GLA is the gated delta rule without the delta: Vn = V, no (I + A)⁻¹ (ALGORITHMS.md
§2). Its forward is one pass over the chunks (``chunk_fwd_inter`` with ``delta=False``)
after the chunk-local cumsum γ of the gate:

    Aqk = Q Kᵀ ⊙ Γ (causal), O = scale(e^γ Q S + Aqk V), S' = e^{γ_C} S + K̃ᵀ V

the scores formed per chunk from the Q and K tiles the pass loads for Q S, and written
out (64 values a token and head) only when a backward will follow. Where the pass would
leave program slots idle it runs as a lead split (``chunk_fwd_inter``'s module text).
Its backward is the staged gradient of the gated delta rule with W = 0: the states h are
recomputed (``chunk_delta_h`` without W; where the forward split few long sequences into
segments, segment by segment from the states entering them, which the forward keeps),
then the reverse state pass (``chunk_delta_h_bwd`` without W, split into the same
segments; dV's in-chunk part scale·Aqkᵀ dO from the stored scores) and dQ, dK, dγ
(``chunk_bwd_dqkwg`` without W); ∂L/∂g is the reverse chunk-local cumsum of ∂L/∂γ.
Above K = 128 (unless the pass would split few long sequences) the forward runs in two
stages: the state entering each chunk (``chunk_delta_h``), then every chunk's output in
parallel (``chunk_o``), which also writes the scores when a backward will follow; that
backward reads the forward's states instead of recomputing them. Where the pass splits,
the scores come from ``chunk_fwd_intra``.
"""
from __future__ import annotations

import torch

from fla.ops.common import chunk_torch
from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
from fla.ops.common.chunk_delta_h_bwd import chunk_gated_delta_rule_bwd_dhu, scaled_dh_buffer
from fla.ops.common.chunk_fwd_inter import (
    MAX_K_FORMING_SCORES,
    chunk_gated_delta_rule_fwd_inter,
    default_segment_chunks,
    split_states,
    state_buffers,
)
from fla.ops.common.chunk_fwd_intra import chunk_gated_delta_rule_fwd_intra
from fla.ops.common.chunk_o import chunk_fwd_o
from fla.ops.common.chunk_o_bwd import chunk_bwd_dqkwg
from fla.ops.gated_delta_rule.inputs import GatedDeltaInputs
from fla.ops.simple_gla.inputs import prepare_simple_gla_inputs
from fla.ops.utils.cumsum import chunk_local_cumsum, chunk_local_cumsum_fwd
from fla.ops.utils.index import prepare_chunk_indices
from fla.utils import compile_ahead
from fla.utils.custom_ops import needs_backward, present, stage_op, upstream_grads
from fla.utils.backend import Backend, select_backend

__all__ = ["chunk_simple_gla"]

CHUNK_SIZE = 64
# Up to this K the forward pass forms each chunk's 64 x 64 scores from its own Q and K
# tiles (at most the pass's MAX_K_FORMING_SCORES: at K = 256 its four 64-row state tiles
# leave no registers for them); above it the intra-chunk scores kernel writes Aqk first.
# H100, 1x8192x96x128 bf16: forward 0.58 ms against 0.76 with the one-warp intra kernel
# of that time (0 restores that path everywhere). Re-timed against the two-warp scores
# kernel that replaced it (H200, 2026-11-28, ``benchmarks.gdn_stages --family
# simple_gla``): forward 0.454 ms against 0.517 at 1x8192x96x128, fwd+bwd 2.044 against
# 2.093; 0.557 / 2.500 either way at 4x4096x64x128.
SCORES_IN_PASS_MAX_K = MAX_K_FORMING_SCORES
# Above this K the forward stores each chunk's entering state (``chunk_delta_h``, K and V
# in 64-wide tiles over many programs) and then computes every chunk's output in parallel
# (``chunk_o``), instead of the intra kernel and the pass holding a K x 32 state: H100,
# 8x2048x32x256 bf16, 0.70 + 0.88 ms of kernels against 0.36 + 1.66, for an h as large
# as q, k, v and o together. Not when the fused pass would split few long sequences into
# segments: the staged state pass cannot. With a backward to feed, ``chunk_o`` writes the
# scores too and h is kept for it (H200, 8x2048x32x256: the staged forward ~1.06 ms of
# kernels against 0.15 + 1.02 for the scores kernel and the pass, and the backward's
# 0.44 ms state pass saved; +512 MiB held from forward to backward).
STAGED_FORWARD_ABOVE_K = 128


def _forward(q, k, v, g, initial_state, scale, output_final_state, save_scores, cu_seqlens,
             chunk_indices, offsets):
    """``(o, final_state, γ, Aqk, segment_states, h)``; Aqk (the scores, for the backward)
    is None unless ``save_scores``, or K > SCORES_IN_PASS_MAX_K and the staged forward was
    not taken; segment_states (the state entering each segment where the pass split the
    sequences) None where it did not split; h (the state entering each chunk) None unless
    the staged forward ran with ``save_scores``."""
    K = k.shape[-1]
    staged = _staged(k, v, offsets)
    scores_out = None
    if staged or K <= SCORES_IN_PASS_MAX_K:
        g_cum = None if g is None else chunk_local_cumsum_fwd(
            g, CHUNK_SIZE, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, offsets=offsets)
    if save_scores and (staged or K <= SCORES_IN_PASS_MAX_K):
        scores_out = k.new_empty(*k.shape[:-1], CHUNK_SIZE)
    if staged:
        varlen = dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
        h, _, final_state = chunk_gated_delta_rule_fwd_h(
            k, None, v, g_cum, initial_state, output_final_state, chunk_size=CHUNK_SIZE,
            save_new_value=False, **varlen)
        o = chunk_fwd_o(q, k, v, h, g_cum, scale, chunk_size=CHUNK_SIZE,
                        scores_out=scores_out, **varlen)
        return o, final_state, g_cum, scores_out, None, h if save_scores else None
    if K <= SCORES_IN_PASS_MAX_K:
        Aqk = None
    else:
        g_cum, _, Aqk = chunk_gated_delta_rule_fwd_intra(
            q, k, g, None, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, delta=False)
    o, final_state, segment_states = chunk_gated_delta_rule_fwd_inter(
        q, k, v, g_cum, None, None, Aqk, scale, initial_state, output_final_state,
        cu_seqlens=cu_seqlens, offsets=offsets, scores_out=scores_out,
        segment_chunks=_segment_chunks(k, v, offsets), return_segment_states=True,
        lead_chunks=None)
    return (o, final_state, g_cum, Aqk if scores_out is None else scores_out,
            segment_states, None)


def _staged(k, v, offsets) -> bool:
    """Whether the forward runs as the state pass then the parallel output kernel."""
    return k.shape[-1] > STAGED_FORWARD_ABOVE_K and not _pass_would_split(k, v, offsets)


def _segment_chunks(k, v, offsets) -> int:
    # The forward pass's split (it forms its scores up to K = 128), computed alike by the
    # backward, whose states pass restarts from the forward's segment states.
    B, T, H, K = k.shape
    return default_segment_chunks(offsets, B, T, H, K, v.shape[-1], False,
                                  K <= SCORES_IN_PASS_MAX_K)


def _pass_would_split(k, v, offsets) -> bool:
    # Few long sequences: the staged state pass would walk them whole, one program per
    # tile, where the fused pass cuts them into segments run in parallel.
    B, T, H, K = k.shape
    return default_segment_chunks(offsets, B, T, H, K, v.shape[-1], False, False) > 0


def _backward(q, k, v, g_cum, Aqk, segment_states, h, initial_state, cu_seqlens,
              chunk_indices, offsets, do, dht, scale, g_dtype):
    """Gradients (dq, dk, dv, dg, dh0) from the forward's saved tensors (``h``: the states
    entering each chunk where the staged forward kept them, else None: recomputed)."""
    varlen = dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    if Aqk is None:
        # A forward that kept no scores (no input needed a gradient when it ran): the
        # forward pass again, keeping them this time. Above K = 128 the pass cannot form
        # them, and γ alone (saved instead of g) cannot feed the intra kernel.
        if k.shape[-1] > MAX_K_FORMING_SCORES:
            raise RuntimeError("chunk_simple_gla: a backward above K = 128 needs the "
                               "scores of a forward run with gradients enabled")
        Aqk = k.new_empty(*k.shape[:-1], CHUNK_SIZE)
        chunk_gated_delta_rule_fwd_inter(
            q, k, v, g_cum, None, None, None, scale, initial_state, cu_seqlens=cu_seqlens,
            offsets=offsets, scores_out=Aqk, segment_chunks=_segment_chunks(k, v, offsets))
    if h is None and segment_states is not None:
        # The forward split the sequences: every segment's chunks again from its entering
        # state, in parallel, instead of one sequential walk a sequence (H100, Triton 3.6,
        # bf16, 2x16384x16x128: ~0.19 ms against the walk's 0.22; fwd+bwd 1.775 -> 1.761).
        h, _ = state_buffers(k, v, offsets, cu_seqlens is not None, delta=False)
        chunk_gated_delta_rule_fwd_inter(
            q, k, v, g_cum, None, None, None, scale, cu_seqlens=cu_seqlens, offsets=offsets,
            segment_chunks=_segment_chunks(k, v, offsets), states_out=(h, None),
            segment_states=segment_states)
    elif h is None:
        h, _, _ = chunk_gated_delta_rule_fwd_h(k, None, v, g_cum, initial_state, False,
                                               chunk_size=CHUNK_SIZE, save_new_value=False,
                                               **varlen)
    # With the gate in bf16, dh as fp16 scaled per chunk (see scaled_dh_buffer).
    dh_scale = scaled_dh_buffer(k, g_cum, h)
    # Where the forward split few long sequences, so does the reverse pass (same segments).
    dh, dh0, dv = chunk_gated_delta_rule_bwd_dhu(
        q, k, None, g_cum, initial_state, dht, do, None, scale, chunk_size=CHUNK_SIZE,
        Aqk=Aqk, segment_chunks=0 if segment_states is None else _segment_chunks(k, v, offsets),
        offsets=offsets, dh_scale=dh_scale, **varlen)
    dq, dk, _, dg = chunk_bwd_dqkwg(q, k, v, None, g_cum, h, dv, do, dh, scale,
                                    chunk_size=CHUNK_SIZE, dg_parts=True, dh_scale=dh_scale,
                                    **varlen)
    if dg is not None:
        # γ is a chunk-local prefix sum of g: ∂L/∂g is the reverse (suffix) sum of ∂L/∂γ,
        # the cumsum adding the K tiles' partial sums as it reads them.
        dg = chunk_local_cumsum_fwd(dg, CHUNK_SIZE, reverse=True, output_dtype=g_dtype,
                                    sum_parts=True, **varlen)
    return dq, dk, dv, dg, None if initial_state is None else dh0.to(initial_state.dtype)


# The forward and backward steps as custom ops joined by the autograd formula below; the
# forward also returns γ and the scores Aqk (an empty placeholder when not kept), which the
# reverse state pass turns into dv_local.
_chunk_fwd = stage_op(
    "chunk_simple_gla_fwd", _forward, label="simple_gla.fwd",
    schema="(Tensor q, Tensor k, Tensor v, Tensor? g, Tensor? initial_state, float scale, "
           "bool output_final_state, bool save_scores, Tensor? cu_seqlens, "
           "Tensor? chunk_indices, int[]? offsets) "
           "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
_chunk_bwd = stage_op(
    "chunk_simple_gla_bwd", _backward, label="simple_gla.bwd",
    schema="(Tensor q, Tensor k, Tensor v, Tensor? g_cum, Tensor? Aqk, "
           "Tensor? segment_states, Tensor? h, Tensor? initial_state, Tensor? cu_seqlens, "
           "Tensor? chunk_indices, int[]? offsets, Tensor do, Tensor? dht, float scale, "
           "ScalarType? g_dtype) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")


def _setup_context(ctx, inputs, output):
    (q, k, v, g, initial_state, scale, output_final_state, save_scores, cu_seqlens,
     chunk_indices, offsets) = inputs
    _, _, g_cum, Aqk, segment_states, h = output
    ctx.save_for_backward(q, k, v, present(g_cum, g is not None),
                          present(Aqk, _scores_kept(k, save_scores)),
                          split_states(segment_states),
                          present(h, _states_kept(k, v, offsets, save_scores)),
                          initial_state, cu_seqlens, chunk_indices)
    ctx.scale = scale
    ctx.g_dtype = None if g is None else g.dtype
    ctx.output_final_state = output_final_state
    ctx.offsets = offsets


def _backward_formula(ctx, do, dht, _dg_cum, _dAqk, _dsegment_states, _dh):
    saved = ctx.saved_tensors
    do, dht = upstream_grads(do, dht, saved[2], ctx.output_final_state)  # saved[2]: v
    dq, dk, dv, dg, dh0 = _chunk_bwd(*saved, ctx.offsets, do, dht, ctx.scale, ctx.g_dtype)
    return (dq, dk, dv, present(dg, ctx.g_dtype is not None),
            present(dh0, saved[7] is not None), None, None, None, None, None, None)


def _scores_kept(k, save_scores: bool) -> bool:
    return save_scores or SCORES_IN_PASS_MAX_K < k.shape[-1] <= STAGED_FORWARD_ABOVE_K


def _states_kept(k, v, offsets, save_scores: bool) -> bool:
    return save_scores and _staged(k, v, offsets)


_chunk_fwd.register_autograd(_backward_formula, setup_context=_setup_context)


def _backward_args(args, outputs):
    """The first backward's arguments (its compile-ahead prefetch in the first forward)."""
    (q, k, v, g, initial_state, scale, output_final_state, save_scores, cu_seqlens,
     chunk_indices, offsets) = args
    o, final_state, g_cum, Aqk, segment_states, h = outputs
    return (q, k, v, g_cum, present(Aqk, _scores_kept(k, save_scores)),
            split_states(segment_states),
            present(h, _states_kept(k, v, offsets, save_scores)), initial_state, cu_seqlens,
            chunk_indices, offsets, torch.empty_like(o),
            final_state if output_final_state else None, scale,
            None if g is None else g.dtype)


compile_ahead.follow("simple_gla.fwd", "simple_gla.bwd", _backward, _backward_args)


def _chunk_torch(x: GatedDeltaInputs, output_final_state: bool):
    """The PyTorch path: the same chunk equations in tensor algebra, autograd through them."""
    offsets = x.seq_offsets
    g_cum = None if x.g is None else chunk_local_cumsum(x.g, CHUNK_SIZE, cu_seqlens=x.cu_seqlens)
    h, _, final_state = chunk_torch.chunk_gated_delta_rule_fwd_h_torch(
        x.k, None, x.v, g_cum, x.initial_state, output_final_state, offsets, CHUNK_SIZE,
        save_new_value=False)
    o = chunk_torch.chunk_fwd_o_torch(x.q, x.k, x.v, h, g_cum, x.scale, offsets, CHUNK_SIZE)
    return o, final_state


def chunk_simple_gla_on_inputs(x: GatedDeltaInputs, output_final_state: bool):
    """Run validated inputs (``g`` already the total log decay) through the chunked
    algorithm; returns time-major ``(o, final_state)``."""
    q, k = x.q, x.k
    if x.HV != x.H:
        # Grouped value heads: each q/k head serves HV // H value heads (autograd sums).
        q = q.repeat_interleave(x.HV // x.H, dim=2)
        k = k.repeat_interleave(x.HV // x.H, dim=2)
    x = x.with_tensors(q, k, x.beta)
    if select_backend(x.q, x.v) is Backend.TORCH:
        return _chunk_torch(x, output_final_state)
    chunk_indices = (None if x.cu_seqlens is None else
                     prepare_chunk_indices(x.cu_seqlens, CHUNK_SIZE, cu_seqlens_cpu=x.seq_offsets))
    # The scores are written out only for a backward (100 MB at 1x8192x96x128 in bf16).
    save_scores = needs_backward(q, k, x.v, x.g, x.initial_state)
    o, final_state, _, _, _, _ = _chunk_fwd(q, k, x.v, x.g, x.initial_state, x.scale,
                                         output_final_state, save_scores, x.cu_seqlens,
                                         chunk_indices, x.seq_offsets)
    return o, present(final_state, output_final_state)


def chunk_simple_gla(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None = None,
    g_gamma: torch.Tensor | None = None, scale: float | None = None,
    initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None, head_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Simple GLA (scalar-gate linear attention) over whole sequences, chunk by chunk.

    For every sequence n and head h, from ``S_0 = initial_state[n, h]`` (zeros if None)::

        S_t = exp(g_t + g_gamma[h]) · S_{t-1} + k_t ⊗ v_t
        o_t = scale · S_tᵀ q_t

    Args:
        q, k: ``[B, T, H, K]`` (``[B, H, T, K]`` with ``head_first=True``), K ≤ 256.
        v: ``[B, T, HV, V]``, V ≤ 256, HV a multiple of H (grouped value heads).
        g: ``[B, T, HV]`` natural-log decay per token (≤ 0; fp32 recommended), or None.
        g_gamma: ``[HV]`` per-head constant log decay (RetNet's), or None; with ``g``
            they add.
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (float32 recommended); N = B, or the number of
            sequences with ``cu_seqlens``.
        output_final_state: also return the state after each sequence's last token.
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of packed sequences (B must be 1).
        head_first: inputs and output are ``[B, H, T, ...]``.

    Returns:
        ``(o, final_state)``: ``o [B, T, HV, V]`` in v's dtype; ``final_state
        [N, HV, K, V]`` float32, or None unless ``output_final_state``. Differentiable in
        q, k, v, g, g_gamma and initial_state.

    CUDA tensors run the Triton kernels; CPU tensors run the same chunked algorithm in
    PyTorch (or the kernels themselves under ``TRITON_INTERPRET=1``).
    """
    x = prepare_simple_gla_inputs(q, k, v, g, g_gamma, scale, initial_state, cu_seqlens,
                                  head_first)
    o, final_state = chunk_simple_gla_on_inputs(x, output_final_state)
    if head_first:
        o = o.transpose(1, 2)
    return o, final_state
