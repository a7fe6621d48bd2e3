"""Chunked gated delta rule (training and prefill): the kernels chained with autograd.

Forward, in chunks of 64 tokens (ALGORITHMS.md §1, chunked form), three kernels:

    γ, Aqk = Q Kᵀ ⊙ Γ (causal); Ai = (I + A)⁻¹     chunk_fwd_intra   (two, parallel over chunks)
    Vn = Ai β(V − e^γ K S), O, S' per chunk         chunk_fwd_inter   (sequential over chunks)

with A = strict_lower(diag(β) K Kᵀ ⊙ Γ). The WY factors W, U, the per-chunk states h and
the new values Vn never reach memory in the forward.

The backward keeps only q, k, v, γ, β, Ai, Aqk, the initial state and, where the forward
split few long sequences into segments, the state entering each segment ([P, H, K, V]
fp32), or, where its states pass would leave program slots idle, the state at one cut of
each sequence (a checkpoint the forward keeps by running its pass in two launches:
[2N, H, K, V] fp32 with the initial states). It recomputes the per-chunk states h and
Vn, with the forward's own pass storing them instead of the output (``chunk_fwd_inter``
with ``states_out``: Vn = Ai β(V − e^γ K S), no U formed; a split pass restarts every
segment from its kept state, with no transitions or combine again, and a checkpointed
one runs both pieces of every sequence in one launch) for bf16 inputs (see
``_backward``), and in fp32 where the grid is full or the pass splits sequences, else
with the staged pass over the WY factors W, U (``wy_fast``, ``chunk_delta_h``); then the
reverse state pass (split into the same segments where the forward split) and the
gradient stages (``fla.ops.common``, ``wy_fast_bwd``).
Storing h instead would cost [B, NT, H, K, V] per layer; Aqk, 64 values a token and head
like Ai, lets the reverse pass form dV's in-chunk part scale·Aqkᵀ dO itself (no separate
kernel, no round trip of it through memory).
"""
from __future__ import annotations

import torch

from fla.ops.common.chunk_delta_h_bwd import chunk_gated_delta_rule_bwd_dhu, scaled_dh_buffer
from fla.ops.common.chunk_o_bwd import chunk_bwd_dqkwg
from fla.ops.common import chunk_torch
from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
from fla.ops.common.chunk_fwd_inter import (
    chunk_gated_delta_rule_fwd_inter,
    default_checkpoint_lead_chunks,
    default_segment_chunks,
    split_states,
    state_buffers,
)
from fla.ops.common.chunk_fwd_intra import chunk_gated_delta_rule_fwd_intra
from fla.ops.gated_delta_rule.inputs import GatedDeltaInputs, prepare_gated_delta_inputs
from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd
from fla.ops.gated_delta_rule.wy_fast_bwd import prepare_wy_repr_bwd
from fla.ops.utils.cumsum import chunk_local_cumsum, chunk_local_cumsum_fwd
from fla.ops.utils.index import prepare_chunk_indices
from fla.modules.l2norm import l2norm as fused_l2norm
from fla.ops.utils.l2norm import l2norm
from fla.ops.utils.solve_tril import solve_tril
from fla.utils import compile_ahead
from fla.utils.custom_ops import needs_backward, present, stage_op, upstream_grads
from fla.utils.backend import Backend, select_backend
from fla.utils.grid import cdiv, sequential_grid_fill

CHUNK_SIZE = 64


def _forward(q, k, v, g, beta, scale, initial_state, output_final_state, for_backward,
             cu_seqlens, chunk_indices, offsets):
    g_cum, Ai, Aqk = chunk_gated_delta_rule_fwd_intra(q, k, g, beta, cu_seqlens=cu_seqlens,
                                                      chunk_indices=chunk_indices)
    # The segment states (where the pass split few long sequences) let the backward
    # recompute its states without the transitions and their combine; the segments' maps
    # give the reverse pass's maps (their transposes), so that its transitions run on the
    # X columns alone.
    # For a backward whose states pass would leave program slots idle (no split), the
    # pass keeps the state at a cut (a checkpoint: two launches), and the backward runs
    # both pieces of every sequence at once: H200, 1x8192x96x128, fwd+bwd 4.37 -> 4.16 ms
    # (the states pass 696 -> 526 µs; the forward +22 µs, so not without a backward).
    o, final_state, segment_states, segment_maps = chunk_gated_delta_rule_fwd_inter(
        q, k, v, g_cum, beta, Ai, Aqk, scale, initial_state, output_final_state,
        cu_seqlens=cu_seqlens, offsets=offsets, return_segment_states=True,
        return_segment_maps=True,
        lead_chunks=None if for_backward and _states_from_the_forward_pass(k, v, offsets)
        else 0)
    return o, g_cum, Ai, final_state, Aqk, segment_states, segment_maps


def _forward_segment_chunks(k, v, offsets) -> int:
    """The segment length the forward pass's launcher picks (0: it does not split)."""
    B, T, H, K = k.shape
    return default_segment_chunks(offsets, B, T, H, K, v.shape[-1], True, False)


def _forward_lead_chunks(k, v, offsets) -> int:
    """The lead at which the forward pass kept its checkpoint (0: none), where it did not
    split (with a split, the segment states are the split's)."""
    if _forward_segment_chunks(k, v, offsets):
        return 0
    B, T, H, K = k.shape
    return default_checkpoint_lead_chunks(offsets, B, T, H, K, v.shape[-1])


def _states_from_the_forward_pass(k, v, offsets) -> bool:
    """Whether the backward recomputes h and Vn with the forward's own pass (storing them
    instead of the output) rather than the staged pass over W and U. The forward's pass
    moves less (no U; 0.53 + 0.20 ms for the pass and W against 0.36 + 0.47 for W, U and
    the staged pass at 1x8192x96x128 on H100) but chains one more dot a chunk, which a
    thin grid feels: 0.60 + 0.13 against 0.24 + 0.31 at 2x16384x16x128 unsplit. So: where
    some SM holds two programs, or where the pass would split few long sequences into
    segments, which the staged pass cannot (from the forward's segment states,
    1x65536x8x128 and 2x16384x16x128 each ~0.29 + 0.13 ms on H100, 2026-11-28).
    And always for bf16 inputs: the staged pass rounds U and W to bf16 before Vn = U − W S
    cancels them, which two-term dots cannot undo (emulated at T ~ 1000, 1x1000x2x64 with
    the backward's two-term dots: dk 4.84e-3 and, the gated rule at weak decays, dg
    5.99e-3 against 3.97e-3 and 4.54e-3 from the forward's pass). fp16's 11 bits need
    neither (see ``_backward``)."""
    if k.dtype == torch.bfloat16:
        return True
    B, T, H, K = k.shape
    V = v.shape[-1]
    n = B if offsets is None else len(offsets) - 1
    return sequential_grid_fill(n, H, V) == 0 or _forward_segment_chunks(k, v, offsets) > 0


def _backward(q, k, v, g_cum, beta, A, Aqk, segment_states, segment_maps, initial_state,
              cu_seqlens, chunk_indices, offsets, do, dht, scale, g_dtype):
    """Gradients (dq, dk, dv, dg, dβ, dh0) from the forward's saved tensors.

    bf16 inputs: with bf16 operands alone the delta rule's gradients missed the 5e-3
    bound (dk 5.43e-3 at 2x1000x4x128 on the H200; the gated rule at weak decays alike, in
    the interpreter's emulation of the GPU's arithmetic). So the states are recomputed by
    the forward's pass (never the staged one, see ``_states_from_the_forward_pass``) with
    its recurrence's fp32 operands as two 16-bit tiles (``fla.ops.utils.two_term``), and
    dqkwg's part of dk stays fp32 until the WY part is added (one rounding, not two).
    Emulated at 1x1000x2x128: dk 5.11e-3 -> 4.20e-3 (the pass alone 4.49e-3, the fp32
    partial alone 4.86e-3). Two terms in dqkwg's score gradient and the WY stage's dA chain
    too took it to 4.05e-3 but cost 0.15 + 0.21 ms of 3.77 at 1x8192x96x128 on the H200:
    left out (benchmarks/NOTES.md, 2026-11-28 21:52-). With a gate in bf16, dh is also
    stored as scaled fp16 (11 significant bits for bf16's 8, same bytes): dγ = q·dq − k·dk
    cancels, and at unit-norm queries the gated rule's dg reached 7.8e-3 (emulated, max
    over 40 seeds; 5.3e-3 with the two changes above, 3.8e-3 with the scaled dh too).
    fp16 inputs take none of this: their 11 bits leave dk at 0.64e-3 (emulated,
    1x1000x2x128; 0.52e-3 with the two-term states pass, not worth its cost).
    """
    varlen = dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    bf16 = k.dtype == torch.bfloat16
    if _states_from_the_forward_pass(k, v, offsets):
        h, v_new = state_buffers(k, v, offsets, cu_seqlens is not None)
        chunk_gated_delta_rule_fwd_inter(None, k, v, g_cum, beta, A, None, scale,
                                         initial_state, cu_seqlens=cu_seqlens,
                                         offsets=offsets, states_out=(h, v_new),
                                         segment_states=segment_states, two_term=bf16,
                                         lead_chunks=_forward_lead_chunks(k, v, offsets))
        # W for the reverse pass's Wᵀ dVn. (Formed there from Ai and K instead, the pass
        # took 1.04 ms against 0.69 at 1x8192x96x128 on H100, more than W costs here.)
        w, _ = recompute_w_u_fwd(k, v, beta, A, g_cum, with_u=False, **varlen)
    else:
        w, u = recompute_w_u_fwd(k, v, beta, A, g_cum, **varlen)
        h, v_new, _ = chunk_gated_delta_rule_fwd_h(k, w, u, g_cum, initial_state, False,
                                                   chunk_size=CHUNK_SIZE, **varlen)
        del u
    dh_scale = scaled_dh_buffer(k, g_cum, h)   # with the gate in bf16 (see above)
    # Where the forward split few long sequences, so does the reverse pass (same segments).
    dh, dh0, dv = chunk_gated_delta_rule_bwd_dhu(
        q, k, w, g_cum, initial_state, dht, do, None, scale, chunk_size=CHUNK_SIZE, Aqk=Aqk,
        segment_chunks=0 if segment_states is None else _forward_segment_chunks(k, v, offsets),
        offsets=offsets, segment_maps=segment_maps, dh_scale=dh_scale, **varlen)
    dq, dk, dw, dg = chunk_bwd_dqkwg(q, k, v_new, w, g_cum, h, dv, do, dh, scale,
                                     chunk_size=CHUNK_SIZE,
                                     dk_dtype=torch.float32 if bf16 else None,
                                     dh_scale=dh_scale, **varlen)
    # Dropped once their last stage has run: the WY stage holds no h, Vn, dh or W.
    del h, v_new, dh, dh_scale, w
    # The WY part of dk and dγ is added to dqkwg's as the WY stage reads them (dγ in place).
    dk, dv, dbeta, dg = prepare_wy_repr_bwd(k, v, beta, A, dw, dv, g_cum, dk_acc=dk,
                                            dg_acc=dg, **varlen)
    if g_cum is not None:
        # γ is a chunk-local prefix sum of g, so ∂L/∂g is the reverse (suffix) sum of ∂L/∂γ.
        dg = chunk_local_cumsum_fwd(dg, CHUNK_SIZE, reverse=True,
                                    output_dtype=g_dtype, **varlen)
    return (dq, dk, dv, dg, dbeta.to(beta.dtype),
            None if initial_state is None else dh0.to(initial_state.dtype))


# The forward and backward steps as custom ops (torch.compile sees one node each), joined
# by the autograd formula below. The forward also returns γ, Ai and Aqk for the backward.
_chunk_fwd = stage_op(
    "chunk_gated_delta_rule_fwd", _forward, label="gated_delta_rule.fwd",
    schema="(Tensor q, Tensor k, Tensor v, Tensor? g, Tensor beta, float scale, "
           "Tensor? initial_state, bool output_final_state, bool for_backward, "
           "Tensor? cu_seqlens, "
           "Tensor? chunk_indices, int[]? offsets) "
           "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
_chunk_bwd = stage_op(
    "chunk_gated_delta_rule_bwd", _backward, label="gated_delta_rule.bwd",
    schema="(Tensor q, Tensor k, Tensor v, Tensor? g_cum, Tensor beta, Tensor A, "
           "Tensor Aqk, Tensor? segment_states, Tensor? segment_maps, "
           "Tensor? initial_state, Tensor? cu_seqlens, "
           "Tensor? chunk_indices, int[]? offsets, Tensor do, Tensor? dht, float scale, "
           "ScalarType? g_dtype) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, scale, initial_state, output_final_state, _, cu_seqlens, \
        chunk_indices, offsets = inputs
    _, g_cum, A, _, Aqk, segment_states, segment_maps = output
    ctx.save_for_backward(q, k, v, present(g_cum, g is not None), beta, A, Aqk,
                          split_states(segment_states), split_states(segment_maps),
                          initial_state, cu_seqlens, chunk_indices)
    ctx.scale = scale
    ctx.g_dtype = None if g is None else g.dtype
    ctx.output_final_state = output_final_state
    ctx.offsets = offsets


def _backward_formula(ctx, do, _dg_cum, _dA, dht, _dAqk, _dsegment_states, _dsegment_maps):
    saved = ctx.saved_tensors
    do, dht = upstream_grads(do, dht, saved[2], ctx.output_final_state)  # saved[2]: v
    dq, dk, dv, dg, dbeta, dh0 = _chunk_bwd(*saved, ctx.offsets, do, dht, ctx.scale,
                                            ctx.g_dtype)
    return (dq, dk, dv, present(dg, ctx.g_dtype is not None), dbeta, None,
            present(dh0, saved[9] is not None), None, None, None, None, None)


_chunk_fwd.register_autograd(_backward_formula, setup_context=_setup_context)


def _backward_args(args, outputs):
    """The backward step's arguments as the first backward will pass them (for its
    compile-ahead prefetch during the first forward)."""
    q, k, v, g, beta, scale, initial_state, output_final_state, _, cu_seqlens, \
        chunk_indices, offsets = args
    o, g_cum, A, final_state, Aqk, segment_states, segment_maps = outputs
    return (q, k, v, g_cum, beta, A, Aqk, split_states(segment_states),
            split_states(segment_maps), initial_state, cu_seqlens, chunk_indices, offsets,
            torch.empty_like(o), final_state if output_final_state else None, scale,
            None if g is None else g.dtype)


compile_ahead.follow("gated_delta_rule.fwd", "gated_delta_rule.bwd", _backward, _backward_args)


def _chunk_triton(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                  chunk_indices, offsets):
    """The Triton path: ``(o, final_state)`` through the custom op."""
    for_backward = needs_backward(q, k, v, g, beta, initial_state)
    o, _, _, final_state, _, _, _ = _chunk_fwd(q, k, v, g, beta, scale, initial_state,
                                               output_final_state, for_backward, cu_seqlens,
                                               chunk_indices, offsets)
    return o, present(final_state, output_final_state)


def _chunk_torch(x: GatedDeltaInputs, output_final_state: bool):
    """The PyTorch path: the same chunk stages in tensor algebra, autograd through them."""
    offsets = x.seq_offsets
    g_cum = None if x.g is None else chunk_local_cumsum(x.g, CHUNK_SIZE, cu_seqlens=x.cu_seqlens)
    A = chunk_torch.chunk_scaled_dot_kkt_fwd_torch(x.k, x.beta, g_cum, offsets, CHUNK_SIZE)
    A = solve_tril(A, cu_seqlens=x.cu_seqlens, output_dtype=torch.float32)
    w, u = chunk_torch.recompute_w_u_fwd_torch(x.k, x.v, x.beta, A, g_cum, offsets, CHUNK_SIZE)
    h, v_new, final_state = chunk_torch.chunk_gated_delta_rule_fwd_h_torch(
        x.k, w, u, g_cum, x.initial_state, output_final_state, offsets, CHUNK_SIZE)
    o = chunk_torch.chunk_fwd_o_torch(x.q, x.k, v_new, h, g_cum, x.scale, offsets, CHUNK_SIZE)
    return o, final_state


def chunk_gated_delta_rule_on_inputs(x: GatedDeltaInputs, output_final_state: bool,
                                     use_qk_l2norm_in_kernel: bool):
    """Run validated inputs (see :func:`prepare_gated_delta_inputs`) through the chunked
    algorithm; returns time-major ``(o, final_state)``."""
    q, k = x.q, x.k
    triton_path = select_backend(x.q, x.v) is Backend.TRITON
    if use_qk_l2norm_in_kernel:
        # Kernels: the fused row norm (one pass each way over q and k, where the tensor
        # algebra of the PyTorch path makes ~8 passes forward and ~12 backward).
        norm = fused_l2norm if triton_path else l2norm
        q, k = norm(q), norm(k)
    if x.HV != x.H:
        # Grouped value heads: each q/k head serves HV // H value heads. The chunk stages
        # work on matched heads, so q and k are repeated (autograd sums their gradients).
        q = q.repeat_interleave(x.HV // x.H, dim=2)
        k = k.repeat_interleave(x.HV // x.H, dim=2)
    beta = x.beta if x.beta is not None else torch.ones_like(x.v[..., 0])
    x = x.with_tensors(q, k, beta)
    if not triton_path:
        return _chunk_torch(x, output_final_state)
    chunk_indices = (None if x.cu_seqlens is None else
                     prepare_chunk_indices(x.cu_seqlens, CHUNK_SIZE, cu_seqlens_cpu=x.seq_offsets))
    return _chunk_triton(q, k, x.v, x.g, beta, x.scale, x.initial_state, output_final_state,
                         x.cu_seqlens, chunk_indices, x.seq_offsets)


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: float | None = None, initial_state: torch.Tensor | None = None,
    output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
    head_first: bool = False, use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""The gated delta rule over whole sequences, computed chunk by chunk.

    For every sequence n and value head j, from ``S_0 = initial_state[n, j]`` (zeros if
    None)::

        S_t = exp(g_t) · S_{t-1}
        S_t = S_t + β_t · k_t ⊗ (v_t − S_tᵀ k_t)
        o_t = scale · S_tᵀ q_t

    Args:
        q, k: ``[B, T, H, K]`` (``[B, H, T, K]`` with ``head_first=True``), K ≤ 256.
        v: ``[B, T, HV, V]``, V ≤ 256, HV a multiple of H (grouped value heads).
        g: ``[B, T, HV]`` natural-log decay per token (≤ 0; fp32 recommended); None for
            no decay (the delta rule).
        beta: ``[B, T, HV]`` write strength, usually in (0, 1); None means 1.
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (float32 recommended); N = B, or the number of
            sequences with ``cu_seqlens``.
        output_final_state: also return the state after each sequence's last token.
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of packed sequences (B must be 1).
        head_first: inputs and output are ``[B, H, T, ...]``.
        use_qk_l2norm_in_kernel: normalise q, k to unit L2 norm first
            (``x · rsqrt(‖x‖² + 1e-6)``); gradients flow through it.

    Returns:
        ``(o, final_state)``: ``o [B, T, HV, V]`` in v's dtype; ``final_state [N, HV, K, V]``
        float32, or None unless ``output_final_state``. Differentiable in q, k, v, g,
        beta and initial_state.

    CUDA tensors run the Triton kernels; CPU tensors run the same chunked algorithm in
    PyTorch (or the kernels themselves under ``TRITON_INTERPRET=1``).
    """
    x = prepare_gated_delta_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens,
                                   head_first)
    o, final_state = chunk_gated_delta_rule_on_inputs(x, output_final_state,
                                                      use_qk_l2norm_in_kernel)
    if head_first:
        o = o.transpose(1, 2)
    return o, final_state
