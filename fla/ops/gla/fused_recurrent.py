"""Fused recurrent GLA (decoding; also trains): one program per (V tile, head, sequence)
keeps its ``[K, BV]`` tile of the state in float32 registers, forward and backward.

The recurrence (ALGORITHMS.md §3), per sequence and head::

    S_t = diag(exp(gk_t)) · S_{t-1} · diag(exp(gv_t)) + k_t ⊗ v_t
    o_t = scale · S_tᵀ q_t                 (EXCLUSIVE, RWKV6's state part: S_{t-1}ᵀ q_t)

Backward (exact, two sweeps, nothing saved but the final state). With D_t = ∂L/∂S_t::

    reverse sweep:  D_t += scale q_t do_tᵀ ; dk_t = D_t v_t ; dv_t = D_tᵀ k_t ;
                    D_{t-1} = diag(e^{gk_t}) D_t diag(e^{gv_t})      (D_T = dht, dh0 = D_0)
    forward sweep:  S_t rebuilt from h0 ; dq_t = scale S_t do_t ; o_t (for dgv)

(EXCLUSIVE: q_t do_tᵀ enters D after the decay, and dq_t reads S_{t-1}.) The gates need
neither sweep: with the cumulative log gates bk, bv, S_t = e^{bk_t} S̃_t e^{bv_t}, so q
carries +bk, k carries −bk, o carries +bv and v carries −bv, whence::

    dgk_t = Σ_{s≥t} (q_s⊙dq_s − k_s⊙dk_s) + Σ_v dht ⊙ S_T
    dgv_t = Σ_{s≥t} (o_s⊙do_s − v_s⊙dv_s) + Σ_k dht ⊙ S_T

(EXCLUSIVE: q_s reads bk_{s-1}, so the q term of s = t drops: dgk_t −= q_t⊙dq_t.)
Reverse cumulative sums per sequence, in float64, in PyTorch.

``reverse=True`` runs the recurrence from each sequence's last token to its first: the
inputs are flipped per sequence (a gather autograd differentiates) around the same
kernels.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.standard import _sum_combine

from fla.ops.common.fused_recurrent_tiles import (
    block_k as _block_k,
    bwd_block_v as _bwd_block_v,
    bwd_config_space as _bwd_config_space,
    bwd_default_config as _bwd_default_config,
    config_space as _config_space,
    thin_grid_default,
    token_row,
)
from fla.ops.gla.inputs import GLAInputs, prepare_gla_inputs
from fla.ops.gla.recurrent_torch import recurrent_gla_torch
from fla.ops.utils.index import locate_sequence
from fla.ops.utils.state_tiles import load_state_tiles, state_tile
from fla.utils.backend import Backend, select_backend
from fla.utils.custom_ops import needs_backward, present, stage_op
from fla.utils.grid import cdiv, sequential_grid_fill
from fla.utils.tuning import Config, tuned

__all__ = ["fused_recurrent_gla", "fused_recurrent_gla_on_inputs"]


@triton.jit
def _decay(b_s, gk, gv, t, i_h, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, o_k, o_v,
           m_k, m_v, USE_GK: tl.constexpr, USE_GV: tl.constexpr):
    """``b_s`` [BK, BV] times token t's gates: diag(e^{gk_t}) · b_s · diag(e^{gv_t})."""
    if USE_GK:
        b_gk = tl.load(token_row(gk, t, H, i_h, K, o_k), mask=m_k, other=0.).to(tl.float32)
        b_s = b_s * tl.exp(b_gk)[:, None]
    if USE_GV:
        b_gv = tl.load(token_row(gv, t, H, i_h, V, o_v), mask=m_v, other=0.).to(tl.float32)
        b_s = b_s * tl.exp(b_gv)[None, :]
    return b_s


# Few sequences x heads (FEW_PROGRAMS): H100, Triton 3.6, bf16, the no-grad forward with
# each config forced (2026-11-27): K = 128, 8 columns at 4 warps, 2.93 ms against 3.64 for
# the one-warp 16-column default at 4x2048x16x128.
_forward_default = thin_grid_default({128: Config(BV=8, num_warps=4, num_stages=1)})


@tuned(key=["K", "V", "q", "h0", "FEW_PROGRAMS"], default=_forward_default,
       space=_config_space)
@triton.jit(do_not_specialize=["T"])
def fused_recurrent_gla_fwd_kernel(
    q, k, v, gk, gv, o, h0, ht, cu_seqlens, scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_GK: tl.constexpr, USE_GV: tl.constexpr, USE_H0: tl.constexpr,
    STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr, EXCLUSIVE: tl.constexpr,
    FEW_PROGRAMS: tl.constexpr = 0,
):
    """Grid ``(NV, N·H)``; q, k, gk ``[B, T, H, K]``, v, gv, o ``[B, T, H, V]``.
    ``FEW_PROGRAMS`` (:func:`fla.utils.grid.sequential_grid_fill`) is read by the tuning
    layer only."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, length = locate_sequence(i_n, T, cu_seqlens, IS_VARLEN)
    o_k, o_v, m_k, m_v, o_s, m_s, state = state_tile(i_v, i_nh, K, V, BK, BV)

    b_s, _, _, _ = load_state_tiles(h0, state, o_s, o_k, m_v, K, V, BK, BV, USE_H0)
    for i in range(0, length):
        t = bos + i
        b_q = tl.load(token_row(q, t, H, i_h, K, o_k), mask=m_k, other=0.).to(tl.float32)
        b_q = b_q * scale
        b_k = tl.load(token_row(k, t, H, i_h, K, o_k), mask=m_k, other=0.).to(tl.float32)
        b_v = tl.load(token_row(v, t, H, i_h, V, o_v), mask=m_v, other=0.).to(tl.float32)
        if EXCLUSIVE:
            b_o = tl.reduce(b_s * b_q[:, None], 0, _sum_combine)
        b_s = _decay(b_s, gk, gv, t, i_h, H, K, V, o_k, o_v, m_k, m_v, USE_GK, USE_GV)
        b_s += b_k[:, None] * b_v[None, :]
        if not EXCLUSIVE:
            b_o = tl.reduce(b_s * b_q[:, None], 0, _sum_combine)
        tl.store(token_row(o, t, H, i_h, V, o_v), b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_HT:
        tl.store(ht + state + o_s, b_s, mask=m_s)


@tuned(key=["K", "V", "BV", "q", "h0"], default=_bwd_default_config, space=_bwd_config_space)
@triton.jit(do_not_specialize=["T"])
def fused_recurrent_gla_bwd_kernel(
    q, k, v, gk, gv, h0, do, dht, dq, dk, dv, dgv, dh0, cu_seqlens, scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_GK: tl.constexpr, USE_GV: tl.constexpr, USE_H0: tl.constexpr,
    USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, IS_VARLEN: tl.constexpr,
    EXCLUSIVE: tl.constexpr,
):
    """Grid ``(NV, N·H)``. dq, dk ``[B, T, H, NV, K]`` float32 partial sums over V tiles;
    dv ``[B, T, H, V]`` float32; dgv ``[B, T, H, V]`` float32 = o⊙do − v⊙dv (per token,
    not yet summed over time)."""
    NV: tl.constexpr = (V + BV - 1) // BV
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, length = locate_sequence(i_n, T, cu_seqlens, IS_VARLEN)
    o_k, o_v, m_k, m_v, o_s, m_s, state = state_tile(i_v, i_nh, K, V, BK, BV)
    # Partial sums over V tiles: row h·NV + i_v of the H·NV rows a token.
    part = i_h * NV + i_v

    # ---- reverse sweep: the adjoint state D, from dht back to dh0
    b_d, _, _, _ = load_state_tiles(dht, state, o_s, o_k, m_v, K, V, BK, BV, USE_DHT)
    for i in range(0, length):
        t = bos + length - 1 - i
        b_q = tl.load(token_row(q, t, H, i_h, K, o_k), mask=m_k, other=0.).to(tl.float32)
        b_q = b_q * scale
        b_k = tl.load(token_row(k, t, H, i_h, K, o_k), mask=m_k, other=0.).to(tl.float32)
        b_v = tl.load(token_row(v, t, H, i_h, V, o_v), mask=m_v, other=0.).to(tl.float32)
        b_do = tl.load(token_row(do, t, H, i_h, V, o_v), mask=m_v, other=0.).to(tl.float32)
        if not EXCLUSIVE:
            b_d += b_q[:, None] * b_do[None, :]
        tl.store(token_row(dk, t, H * NV, part, K, o_k),
                 tl.reduce(b_d * b_v[None, :], 1, _sum_combine), mask=m_k)
        tl.store(token_row(dv, t, H, i_h, V, o_v),
                 tl.reduce(b_d * b_k[:, None], 0, _sum_combine), mask=m_v)
        b_d = _decay(b_d, gk, gv, t, i_h, H, K, V, o_k, o_v, m_k, m_v, USE_GK, USE_GV)
        if EXCLUSIVE:
            b_d += b_q[:, None] * b_do[None, :]
    if STORE_DH0:
        tl.store(dh0 + state + o_s, b_d, mask=m_s)
    # The forward sweep reads back dv written above by other threads of this program.
    tl.debug_barrier()

    # ---- forward sweep: rebuild S_t from h0; dq, and o for the gv gradient
    b_s, _, _, _ = load_state_tiles(h0, state, o_s, o_k, m_v, K, V, BK, BV, USE_H0)
    for i in range(0, length):
        t = bos + i
        b_k = tl.load(token_row(k, t, H, i_h, K, o_k), mask=m_k, other=0.).to(tl.float32)
        b_v = tl.load(token_row(v, t, H, i_h, V, o_v), mask=m_v, other=0.).to(tl.float32)
        b_do = tl.load(token_row(do, t, H, i_h, V, o_v), mask=m_v, other=0.).to(tl.float32)
        p_dq = token_row(dq, t, H * NV, part, K, o_k)
        if EXCLUSIVE:
            tl.store(p_dq, tl.reduce(b_s * b_do[None, :], 1, _sum_combine) * scale, mask=m_k)
        b_s = _decay(b_s, gk, gv, t, i_h, H, K, V, o_k, o_v, m_k, m_v, USE_GK, USE_GV)
        b_s += b_k[:, None] * b_v[None, :]
        if not EXCLUSIVE:
            tl.store(p_dq, tl.reduce(b_s * b_do[None, :], 1, _sum_combine) * scale, mask=m_k)
        if USE_GV:
            b_q = tl.load(token_row(q, t, H, i_h, K, o_k), mask=m_k, other=0.).to(tl.float32)
            b_o = tl.reduce(b_s * (b_q * scale)[:, None], 0, _sum_combine)
            b_dv = tl.load(token_row(dv, t, H, i_h, V, o_v), mask=m_v, other=0.)
            tl.store(token_row(dgv, t, H, i_h, V, o_v), b_o * b_do - b_v * b_dv, mask=m_v)


def _forward(q, k, v, gk, gv, scale, initial_state, store_final_state, cu_seqlens, offsets,
             N, exclusive, out_dtype):
    """Launch the forward on validated, contiguous, time-major inputs (q, k, gk
    ``[B, T, H, K]``, v, gv ``[B, T, H, V]``, initial_state ``[N, H, K, V]``). Returns
    ``(o [B, T, H, V] in out_dtype, final_state [N, H, K, V] float32 or None)``.
    ``offsets`` (the host copy of cu_seqlens) is the backward's: an op input, so that
    the autograd formula finds it."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = torch.empty(B, T, H, V, dtype=out_dtype, device=v.device)
    ht = (torch.empty(N, H, K, V, dtype=torch.float32, device=q.device)
          if store_final_state else None)
    fused_recurrent_gla_fwd_kernel[lambda meta: (cdiv(V, meta["BV"]), N * H)](
        q, k, v, gk, gv, o, initial_state, ht, cu_seqlens, scale, T,
        H=H, K=K, V=V, BK=_block_k(K), USE_GK=gk is not None, USE_GV=gv is not None,
        USE_H0=initial_state is not None, STORE_HT=store_final_state,
        IS_VARLEN=cu_seqlens is not None, EXCLUSIVE=exclusive,
        FEW_PROGRAMS=sequential_grid_fill(N, H, V))
    return o, ht


def reverse_cumsum(x: torch.Tensor, offsets: list[int] | None) -> torch.Tensor:
    """``y_t = Σ_{s ≥ t} x_s`` within each sequence, over dim 1 of ``x [B, T, ...]``,
    summed in float64 (over thousands of tokens a float32 running sum loses digits)."""
    def rc(t):
        return t.double().flip(1).cumsum(1).flip(1)
    if offsets is None:
        return rc(x).to(x.dtype)
    return torch.cat([rc(x[:, s:e]) for s, e in zip(offsets[:-1], offsets[1:])],
                     dim=1).to(x.dtype)


def add_at_last_tokens(x: torch.Tensor, value: torch.Tensor, offsets: list[int] | None):
    """``x[:, last token of sequence n] += value[n]`` for x ``[B, T, ...]`` (in place)."""
    if offsets is None:
        x[:, -1] += value
    else:
        x[0].index_add_(0, torch.tensor(offsets[1:], device=x.device) - 1, value)
    return x


def _backward(q, k, v, gk, gv, scale, h0, ht, do, dht, cu_seqlens, offsets, N, exclusive):
    """Gradients ``(dq, dk, dv, dgk, dgv, dh0)`` in the inputs' dtypes (None where the
    input is None). ``ht`` is the forward's final state (needed with dht and a gate),
    ``offsets`` the host copy of cu_seqlens."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BK, BV = _block_k(K), _bwd_block_v(K, V)
    NV = cdiv(V, BV)
    f32 = dict(dtype=torch.float32, device=q.device)
    dq = torch.empty(B, T, H, NV, K, **f32)
    dk = torch.empty(B, T, H, NV, K, **f32)
    dv = torch.empty(B, T, H, V, **f32)
    dgv = torch.empty(B, T, H, V, **f32) if gv is not None else None
    dh0 = torch.empty(N, H, K, V, **f32) if h0 is not None else None
    fused_recurrent_gla_bwd_kernel[(NV, N * H)](
        q, k, v, gk, gv, h0, do, dht, dq, dk, dv, dgv, dh0, cu_seqlens, scale, T,
        H=H, K=K, V=V, BK=BK, BV=BV, USE_GK=gk is not None, USE_GV=gv is not None,
        USE_H0=h0 is not None, USE_DHT=dht is not None, STORE_DH0=h0 is not None,
        IS_VARLEN=cu_seqlens is not None, EXCLUSIVE=exclusive)
    dq, dk = dq.sum(3), dk.sum(3)
    dgk = None
    if gk is not None:
        q_term = q.float() * dq
        dgk = q_term - k.float() * dk
        if dht is not None:
            add_at_last_tokens(dgk, (dht.float() * ht).sum(-1), offsets)
        dgk = reverse_cumsum(dgk, offsets)
        if exclusive:
            dgk = dgk - q_term
        dgk = dgk.to(gk.dtype)
    if dgv is not None:
        if dht is not None:
            add_at_last_tokens(dgv, (dht.float() * ht).sum(-2), offsets)
        dgv = reverse_cumsum(dgv, offsets).to(gv.dtype)
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dgk, dgv,
            None if dh0 is None else dh0.to(h0.dtype))


# The forward and backward steps as custom ops (one node each under torch.compile; a
# decode step can be captured in a CUDA graph), joined by the autograd formula below.
_fused_fwd = stage_op(
    "fused_recurrent_gla_fwd", _forward, label="fused_recurrent_gla.fwd",
    schema="(Tensor q, Tensor k, Tensor v, Tensor? gk, Tensor? gv, float scale, "
           "Tensor? initial_state, bool store_final_state, Tensor? cu_seqlens, int[]? offsets, "
           "int N, bool exclusive, ScalarType out_dtype) -> (Tensor, Tensor)")
_fused_bwd = stage_op(
    "fused_recurrent_gla_bwd", _backward, label="fused_recurrent_gla.bwd",
    schema="(Tensor q, Tensor k, Tensor v, Tensor? gk, Tensor? gv, float scale, "
           "Tensor? h0, Tensor? ht, Tensor do, Tensor? dht, Tensor? cu_seqlens, "
           "int[]? offsets, int N, bool exclusive) "
           "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")


def _setup_context(ctx, inputs, output):
    (q, k, v, gk, gv, scale, initial_state, store_final_state, cu_seqlens, offsets, N,
     exclusive, _) = inputs
    ctx.save_for_backward(q, k, v, gk, gv, initial_state, present(output[1], store_final_state),
                          cu_seqlens)
    ctx.scale, ctx.offsets, ctx.N, ctx.exclusive = scale, offsets, N, exclusive


def _backward_formula(ctx, do, dht):
    q, k, v, gk, gv, h0, ht, cu_seqlens = ctx.saved_tensors
    do = torch.zeros(v.shape, dtype=torch.float32, device=v.device) if do is None \
        else do.contiguous()
    # No final state, no gradient for it (dht is then a placeholder's). A final state
    # stored only for the gate gradients gets a zero dht: it adds nothing.
    dht = dht.contiguous() if ht is not None and dht is not None else None
    dq, dk, dv, dgk, dgv, dh0 = _fused_bwd(q, k, v, gk, gv, ctx.scale, h0, ht, do, dht,
                                           cu_seqlens, ctx.offsets, ctx.N, ctx.exclusive)
    return (dq, dk, dv, present(dgk, gk is not None), present(dgv, gv is not None),
            None, present(dh0, h0 is not None), None, None, None, None, None, None)


_fused_fwd.register_autograd(_backward_formula, setup_context=_setup_context)


def _fused_triton(q, k, v, gk, gv, x: GLAInputs, output_final_state: bool, exclusive: bool,
                  out_dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The Triton path through the custom op: ``(o, final_state)``; q, k, v, gk, gv
    time-major (possibly flipped), the rest of the call from ``x``."""
    train = needs_backward(q, k, v, gk, gv, x.initial_state)
    # The final state is also what the gate gradients need from the forward.
    store = output_final_state or (train and (gk is not None or gv is not None))
    o, ht = _fused_fwd(q, k, v, gk, gv, x.scale, x.initial_state, store, x.cu_seqlens,
                       x.seq_offsets, x.N, exclusive, out_dtype)
    return o, present(ht, output_final_state)


def _flip_per_sequence(x: torch.Tensor | None, offsets: list[int] | None, T: int):
    """Reverse the token order of each sequence (dim 1); differentiable."""
    if x is None:
        return None
    if offsets is None:
        return x.flip(1)
    index = torch.cat([torch.arange(e - 1, s - 1, -1) for s, e in zip(offsets[:-1], offsets[1:])])
    return x.index_select(1, index.to(x.device))


def fused_recurrent_gla_on_inputs(x: GLAInputs, output_final_state: bool, reverse: bool = False,
                                  exclusive: bool = False, out_dtype=None):
    """Run validated inputs through the recurrence (state part; ``exclusive``: read
    S_{t-1}); returns time-major ``(o, final_state)``, o in ``out_dtype`` (v's)."""
    out_dtype = x.v.dtype if out_dtype is None else out_dtype
    q, k, v, gk, gv = x.q, x.k, x.v, x.gk, x.gv
    if reverse:
        q, k, v, gk, gv = (_flip_per_sequence(t, x.seq_offsets, x.T) for t in (q, k, v, gk, gv))
    if select_backend(q, k, v, gk, gv, x.initial_state) is Backend.TORCH:
        o, ht = recurrent_gla_torch(q, k, v, gk, gv, x.scale, x.initial_state, x.seq_offsets,
                                    exclusive)
        o, ht = o.to(out_dtype), (ht if output_final_state else None)
    else:
        o, ht = _fused_triton(q, k, v, gk, gv, x, output_final_state, exclusive, out_dtype)
    if reverse:
        o = _flip_per_sequence(o, x.seq_offsets, x.T)
    return o, ht


def fused_recurrent_gla(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None, scale: float | None = None,
    initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    reverse: bool = False, cu_seqlens: torch.Tensor | None = None, head_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Gated linear attention computed one token at a time (decoding; also trains).

    For every sequence n and head h, from ``S_0 = initial_state[n, h]`` (zeros if None)::

        S_t = diag(exp(gk_t)) · S_{t-1} · diag(exp(gv_t)) + k_t ⊗ v_t
        o_t = scale · S_tᵀ q_t

    Args:
        q, k: ``[B, T, H, K]`` (``[B, H, T, K]`` with ``head_first=True``), K ≤ 256.
        v: ``[B, T, H, V]``, V ≤ 256.
        gk: ``[B, T, H, K]`` natural-log decay of the state's K rows (≤ 0; float32
            recommended), or None.
        gv: ``[B, T, H, V]`` natural-log decay of the state's V columns, or None.
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` (float32 recommended); N = B, or the number of
            sequences with ``cu_seqlens``.
        output_final_state: also return the state after each sequence.
        reverse: run each sequence from its last token to its first (the final state is
            then the state after the first token).
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of packed sequences (B must be 1).
        head_first: inputs and output are ``[B, H, T, ...]``.

    Returns:
        ``(o, final_state)``: ``o [B, T, H, V]`` in v's dtype; ``final_state
        [N, H, K, V]`` float32 or None. Differentiable in q, k, v, gk, gv, initial_state.

    CUDA tensors run the Triton kernels; CPU tensors the PyTorch recurrence (or the
    kernels in the interpreter with ``TRITON_INTERPRET=1``).
    """
    x = prepare_gla_inputs(q, k, v, gk, gv, scale, initial_state, cu_seqlens, head_first)
    o, final_state = fused_recurrent_gla_on_inputs(x, output_final_state, reverse)
    if head_first:
        o = o.transpose(1, 2)
    return o, final_state
