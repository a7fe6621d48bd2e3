"""Fused recurrent (decoding) kernels of the DPLR delta rule, forward and backward.

The recurrence (ALGORITHMS.md §4), per sequence and head::

    s_t = S_{t-1}ᵀ a_t                                   (V-vector)
    S_t = diag(exp(gk_t)) S_{t-1} + b_t s_tᵀ + k_t v_tᵀ
    o_t = scale · S_tᵀ q_t

Forward: one program per (V tile, sequence·head) keeps its ``[BK, BV]`` tile of S in
float32 registers for the whole sequence (BK covers all of K, so ``Sᵀa`` is complete
inside the program). With training it saves s_t (float32, the size of v).

Backward (exact, no state checkpoints). With D_t = ∂L/∂S_t::

    D_t    += scale · q_t do_tᵀ
    ds_t    = D_tᵀ b_t ;  db_t = D_t s_t ;  dk_t = D_t v_t ;  dv_t = D_tᵀ k_t
    D_{t-1} = diag(exp(gk_t)) D_t + a_t ds_tᵀ            (D_T = dht, dh0 = D_0)
    da_t    = S_{t-1} ds_t ;  dq_t = scale · S_t do_t

A reverse sweep gives D (and dv, db, dk, ds, dh0); a forward sweep rebuilds S_t from
h0 (the same float operations as the forward, so the same states) for da and dq. dgk
needs neither: :func:`fla.ops.generalized_delta_rule.gate_grad.dplr_gate_grad`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
# tl.reduce with _sum_combine is tl.sum without a @jit call (milliseconds each in the
# interpreter); the same code on the GPU.
from triton.language.standard import _sum_combine

from fla.ops.common.fused_recurrent_tiles import (
    block_k as _block_k,
    bwd_block_v as _bwd_block_v,
    bwd_config_space as _bwd_config_space,
    bwd_default_config as _bwd_default_config,
    config_space as _config_space,
    thin_grid_default,
)
from fla.ops.generalized_delta_rule.gate_grad import dplr_gate_grad
from fla.ops.generalized_delta_rule.inputs import DPLRInputs, prepare_dplr_inputs
from fla.ops.generalized_delta_rule.recurrent_torch import recurrent_dplr_torch
from fla.ops.utils.index import locate_sequence
from fla.ops.utils.state_tiles import load_state_tiles, state_tile
from fla.utils.backend import Backend, select_backend
from fla.utils.custom_ops import needs_backward, present, stage_op, upstream_grads
from fla.utils.grid import cdiv, sequential_grid_fill
from fla.utils.tuning import Config, tuned


@triton.jit
def _token_offsets(t, i_h, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, o_k, o_v,
                   NV: tl.constexpr, i_v):
    """Token t's offsets (int64) into the [.., H, K] inputs (q, k, a, b, gk), the [.., H,
    V] ones (v, o, s and their gradients) and the partial sums over V tiles [.., H, NV,
    K] (this program's row i_v)."""
    return ((t * H + i_h) * K + o_k, (t * H + i_h) * V + o_v,
            ((t * H + i_h) * NV + i_v) * K + o_k)


# Few sequences x heads (FEW_PROGRAMS): H100, Triton 3.6, bf16, the no-grad forward with
# each config forced (2026-11-27): K = 64, 16 columns at 4 warps, 1.08 ms against 2.81 for
# the one-warp 32-column default at 4x1024x32x64 (4.31 against 11.19 at 4x4096x32x64);
# K = 128, 64 columns at 8 warps, 2.35 against 2.85 at 4x1024x16x128.
_forward_default = thin_grid_default({64: Config(BV=16, num_warps=4, num_stages=1),
                                      128: Config(BV=64, num_warps=8, num_stages=1)})


@tuned(key=["K", "V", "q", "h0", "FEW_PROGRAMS"], default=_forward_default,
       space=_config_space)
@triton.jit(do_not_specialize=["T"])
def fused_recurrent_dplr_fwd_kernel(
    q, k, v, a, b, gk, o, s, h0, ht, cu_seqlens, scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, SAVE_S: tl.constexpr,
    IS_VARLEN: tl.constexpr, FEW_PROGRAMS: tl.constexpr = 0,
):
    """``FEW_PROGRAMS`` (:func:`fla.utils.grid.sequential_grid_fill`) is read by the
    tuning layer only."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, length = locate_sequence(i_n, T, cu_seqlens, IS_VARLEN)
    o_k, o_v, m_k, m_v, o_s, m_s, state = state_tile(i_v, i_nh, K, V, BK, BV)

    b_S, _, _, _ = load_state_tiles(h0, state, o_s, o_k, m_v, K, V, BK, BV, USE_H0)
    for i in range(0, length):
        p_k, p_v, _no_partials = _token_offsets(bos + i, i_h, H, K, V, o_k, o_v, 1, 0)
        b_q = tl.load(q + p_k, mask=m_k, other=0.0).to(tl.float32) * scale
        b_k = tl.load(k + p_k, mask=m_k, other=0.0).to(tl.float32)
        b_a = tl.load(a + p_k, mask=m_k, other=0.0).to(tl.float32)
        b_b = tl.load(b + p_k, mask=m_k, other=0.0).to(tl.float32)
        b_g = tl.load(gk + p_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + p_v, mask=m_v, other=0.0).to(tl.float32)
        b_s = tl.reduce(b_S * b_a[:, None], 0, _sum_combine)
        if SAVE_S:
            tl.store(s + p_v, b_s, mask=m_v)
        b_S = b_S * tl.exp(b_g)[:, None] + b_b[:, None] * b_s[None, :] + b_k[:, None] * b_v[None, :]
        b_o = tl.reduce(b_S * b_q[:, None], 0, _sum_combine)
        tl.store(o + p_v, b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_HT:
        tl.store(ht + state + o_s, b_S, mask=m_s)


@tuned(key=["K", "V", "BV", "q", "h0"], default=_bwd_default_config, space=_bwd_config_space)
@triton.jit(do_not_specialize=["T"])
def fused_recurrent_dplr_bwd_kernel(
    q, k, v, a, b, gk, s, h0, do, dht, dq, dk, dv, da, db, ds, dh0, cu_seqlens, scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    # Partial sums over V tiles (dq, dk, da, db) are laid out [tokens, H, NV, K].
    NV: tl.constexpr = (V + BV - 1) // BV
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, length = locate_sequence(i_n, T, cu_seqlens, IS_VARLEN)
    o_k, o_v, m_k, m_v, o_s, m_s, state = state_tile(i_v, i_nh, K, V, BK, BV)

    # ---- reverse sweep: D from dht back to dh0
    b_D, _, _, _ = load_state_tiles(dht, state, o_s, o_k, m_v, K, V, BK, BV, USE_DHT)
    for i in range(0, length):
        p_k, p_v, p_p = _token_offsets(bos + length - 1 - i, i_h, H, K, V, o_k, o_v, NV, i_v)
        b_q = tl.load(q + p_k, mask=m_k, other=0.0).to(tl.float32) * scale
        b_k = tl.load(k + p_k, mask=m_k, other=0.0).to(tl.float32)
        b_a = tl.load(a + p_k, mask=m_k, other=0.0).to(tl.float32)
        b_b = tl.load(b + p_k, mask=m_k, other=0.0).to(tl.float32)
        b_g = tl.load(gk + p_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + p_v, mask=m_v, other=0.0).to(tl.float32)
        b_s = tl.load(s + p_v, mask=m_v, other=0.0)
        b_do = tl.load(do + p_v, mask=m_v, other=0.0).to(tl.float32)
        b_D += b_q[:, None] * b_do[None, :]
        b_ds = tl.reduce(b_D * b_b[:, None], 0, _sum_combine)
        tl.store(ds + p_v, b_ds, mask=m_v)
        tl.store(db + p_p, tl.reduce(b_D * b_s[None, :], 1, _sum_combine), mask=m_k)
        tl.store(dk + p_p, tl.reduce(b_D * b_v[None, :], 1, _sum_combine), mask=m_k)
        b_dv = tl.reduce(b_D * b_k[:, None], 0, _sum_combine)
        tl.store(dv + p_v, b_dv.to(dv.dtype.element_ty), mask=m_v)
        b_D = b_D * tl.exp(b_g)[:, None] + b_a[:, None] * b_ds[None, :]
    if STORE_DH0:
        tl.store(dh0 + state + o_s, b_D, mask=m_s)

    # The forward sweep reads ds written above by other threads of this program.
    tl.debug_barrier()

    # ---- forward sweep: rebuild S_t from h0
    b_S, _, _, _ = load_state_tiles(h0, state, o_s, o_k, m_v, K, V, BK, BV, USE_H0)
    for i in range(0, length):
        p_k, p_v, p_p = _token_offsets(bos + i, i_h, H, K, V, o_k, o_v, NV, i_v)
        b_k = tl.load(k + p_k, mask=m_k, other=0.0).to(tl.float32)
        b_a = tl.load(a + p_k, mask=m_k, other=0.0).to(tl.float32)
        b_b = tl.load(b + p_k, mask=m_k, other=0.0).to(tl.float32)
        b_g = tl.load(gk + p_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + p_v, mask=m_v, other=0.0).to(tl.float32)
        b_ds = tl.load(ds + p_v, mask=m_v, other=0.0)
        b_do = tl.load(do + p_v, mask=m_v, other=0.0).to(tl.float32)
        tl.store(da + p_p, tl.reduce(b_S * b_ds[None, :], 1, _sum_combine), mask=m_k)
        b_s = tl.reduce(b_S * b_a[:, None], 0, _sum_combine)
        b_S = b_S * tl.exp(b_g)[:, None] + b_b[:, None] * b_s[None, :] + b_k[:, None] * b_v[None, :]
        tl.store(dq + p_p, tl.reduce(b_S * b_do[None, :], 1, _sum_combine) * scale, mask=m_k)


def fused_recurrent_dplr_fwd(q, k, v, a, b, gk, scale, initial_state, output_final_state,
                             cu_seqlens=None, N=None, save_s=False):
    """Launch the forward on validated, contiguous, time-major inputs. Returns
    ``(o [B, T, H, V] in v's dtype, final_state [N, H, K, V] float32 or None,
    s [B, T, H, V] float32 (s_t = S_{t-1}ᵀ a_t) or None)``."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = (B if cu_seqlens is None else cu_seqlens.numel() - 1) if N is None else N
    o = torch.empty_like(v)
    ht = q.new_empty(N, H, K, V, dtype=torch.float32) if output_final_state else None
    s = torch.empty(v.shape, dtype=torch.float32, device=v.device) if save_s else None
    grid = lambda meta: (cdiv(V, meta["BV"]), N * H)  # noqa: E731
    fused_recurrent_dplr_fwd_kernel[grid](
        q, k, v, a, b, gk, o, s, initial_state, ht, cu_seqlens, scale, T,
        H=H, K=K, V=V, BK=_block_k(K), USE_H0=initial_state is not None,
        STORE_HT=output_final_state, SAVE_S=save_s, IS_VARLEN=cu_seqlens is not None,
        FEW_PROGRAMS=sequential_grid_fill(N, H, V))
    return o, ht, s


def fused_recurrent_dplr_bwd(q, k, v, a, b, gk, s, scale, initial_state, do, dht, ht,
                             cu_seqlens=None, N=None, need_dh0=True):
    """Gradients ``(dq, dk, dv, da, db, dgk, dh0)`` in the dtypes of the inputs
    (dh0 None without an initial state)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = (B if cu_seqlens is None else cu_seqlens.numel() - 1) if N is None else N
    BK, BV = _block_k(K), _bwd_block_v(K, V)
    NV = cdiv(V, BV)
    f32 = dict(dtype=torch.float32, device=q.device)
    dq, dk, da, db = (torch.empty(B, T, H, NV, K, **f32) for _ in range(4))
    dv = torch.empty_like(v)
    ds = torch.empty(B, T, H, V, **f32)
    store_dh0 = initial_state is not None and need_dh0
    dh0 = torch.empty(N, H, K, V, **f32) if store_dh0 else None
    fused_recurrent_dplr_bwd_kernel[(NV, N * H)](
        q, k, v, a, b, gk, s, initial_state, do, dht, dq, dk, dv, da, db, ds, dh0,
        cu_seqlens, scale, T, H=H, K=K, V=V, BK=BK, BV=BV,
        USE_H0=initial_state is not None, USE_DHT=dht is not None, STORE_DH0=store_dh0,
        IS_VARLEN=cu_seqlens is not None)
    dq, dk, da, db = (x.sum(3) for x in (dq, dk, da, db))
    dgk = dplr_gate_grad(q, k, a, b, dq, dk, da, db, dht, ht, cu_seqlens, gk.dtype)
    if dh0 is not None:
        dh0 = dh0.to(initial_state.dtype)
    return (dq.to(q.dtype), dk.to(k.dtype), dv, da.to(a.dtype), db.to(b.dtype), dgk, dh0)


# The forward and backward launchers as custom ops (one node each under torch.compile; a
# decode step can be captured in a CUDA graph), joined by the autograd formula below.
# The forward's third output is s, saved for the backward (a placeholder without save_s).
_fused_fwd = stage_op(
    "fused_recurrent_dplr_delta_rule_fwd", fused_recurrent_dplr_fwd,
    label="fused_recurrent_dplr.fwd",
    schema="(Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, Tensor gk, float scale, "
           "Tensor? initial_state, bool output_final_state, Tensor? cu_seqlens, int N, "
           "bool save_s) -> (Tensor, Tensor, Tensor)")
_fused_bwd = stage_op(
    "fused_recurrent_dplr_delta_rule_bwd", fused_recurrent_dplr_bwd,
    label="fused_recurrent_dplr.bwd",
    schema="(Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, Tensor gk, Tensor s, "
           "float scale, Tensor? initial_state, Tensor do, Tensor? dht, Tensor? ht, "
           "Tensor? cu_seqlens, int N, bool need_dh0) "
           "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")


def _setup_context(ctx, inputs, output):
    q, k, v, a, b, gk, scale, initial_state, output_final_state, cu_seqlens, N, _ = inputs
    _, ht, s = output
    ctx.save_for_backward(q, k, v, a, b, gk, s, initial_state,
                          present(ht, output_final_state), cu_seqlens)
    ctx.scale, ctx.N = scale, N


def _backward_formula(ctx, do, dht, _ds):
    q, k, v, a, b, gk, s, initial_state, ht, cu_seqlens = ctx.saved_tensors
    do, dht = upstream_grads(do, dht, v, ht is not None)
    need_dh0 = ctx.needs_input_grad[7]
    *grads, dh0 = _fused_bwd(q, k, v, a, b, gk, s, ctx.scale, initial_state, do, dht, ht,
                             cu_seqlens, ctx.N, need_dh0)
    return (*grads, None, present(dh0, initial_state is not None and need_dh0),
            None, None, None, None)


_fused_fwd.register_autograd(_backward_formula, setup_context=_setup_context)


def fused_recurrent_dplr_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    gk: torch.Tensor, scale: float | None = None, initial_state: torch.Tensor | None = None,
    output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
    head_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""The DPLR (generalized) delta rule one token at a time (decoding; also trains).

    For every sequence n and head h, from ``S_0 = initial_state[n, h]`` (zeros if None)::

        S_t = diag(exp(gk_t)) · S_{t-1} + b_t ⊗ (a_tᵀ S_{t-1}) + k_t ⊗ v_t
        o_t = scale · S_tᵀ q_t

    The rank-one term is ``b_t (a_tᵀ S_{t-1})``: a reads the state, b writes. The delta
    rule ``S_t = (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ`` is ``a = −β k, b = k,
    gk = 0`` with ``v ← β v``; the gated delta rule adds ``gk = g`` and ``a = −β e^{g} k``.

    Args:
        q, k, a, b: ``[B, T, H, K]`` (``[B, H, T, K]`` with ``head_first=True``), K ≤ 256.
        v: ``[B, T, H, V]``, V ≤ 256.
        gk: ``[B, T, H, K]`` natural-log decay (≤ 0) of the state's K rows.
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` (float32 preferred); N = B, or the number of
            sequences with ``cu_seqlens``.
        output_final_state: also return the last state.
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of packed sequences (B must be 1).
        head_first: inputs (and o) are ``[B, H, T, ...]``.

    Returns:
        ``(o, final_state)``: o like v (v's dtype); final_state float32 ``[N, H, K, V]``
        or None. Differentiable in q, k, v, a, b, gk and initial_state.

    CUDA tensors run the Triton kernels; CPU tensors a PyTorch loop (or the kernels in
    the interpreter with ``TRITON_INTERPRET=1``).
    """
    x = prepare_dplr_inputs(q, k, v, a, b, gk, scale, initial_state, cu_seqlens, head_first)
    o, final_state = fused_recurrent_dplr_on_inputs(x, output_final_state)
    if head_first:
        o = o.transpose(1, 2)
    return o, final_state


def fused_recurrent_dplr_on_inputs(x: DPLRInputs, output_final_state: bool):
    """Validated inputs (:func:`prepare_dplr_inputs`) -> time-major ``(o, final_state)``."""
    if select_backend(*x.tensors(), x.initial_state) is Backend.TORCH:
        return recurrent_dplr_torch(*x.tensors(), x.scale, x.initial_state,
                                    output_final_state, x.seq_offsets)
    # The Triton path, through the custom op; s is saved only when a gradient will be
    # taken (decoding launches one kernel that writes o and the final state).
    save_s = needs_backward(*x.tensors(), x.initial_state)
    o, final_state, _ = _fused_fwd(*x.tensors(), x.scale, x.initial_state, output_final_state,
                                   x.cu_seqlens, x.N, save_s)
    return o, present(final_state, output_final_state)
