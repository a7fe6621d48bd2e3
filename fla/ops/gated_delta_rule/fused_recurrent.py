"""Fused recurrent (decoding) kernels of the gated delta rule, forward and backward.

The recurrence (ALGORITHMS.md §1), per sequence and value head::

    S_t = exp(g_t) · S_{t-1}
    u_t = v_t − S_tᵀ k_t                 # what the state mispredicts for k_t
    S_t = S_t + β_t · k_t ⊗ u_t
    o_t = scale · S_tᵀ q_t

Forward: one program per (V tile, value head, sequence) keeps its ``[BK, BV]`` tile of S
in float32 registers for the whole sequence (BK covers all of K, so ``Sᵀ k`` is complete
inside the program and V tiles never talk to each other). At T = 1 this is one read and
one write of the state: the kernel is bound by the bandwidth of S.

Backward (exact, no state checkpoints, no inversion of a step). Write
``w_t = β_t u_t`` so that ``S_t = a_t S_{t-1} + k_t w_tᵀ`` with ``a_t = exp(g_t)`` and
``w_t = β_t (v_t − a_t S_{t-1}ᵀ k_t)``. With D_t = ∂L/∂S_t (the adjoint state)::

    D_t     += scale · q_t do_tᵀ                    (o_t)
    dw_t     = D_tᵀ k_t ;  dv_t = β_t dw_t ;  dβ_t = dw_t · u_t
    dk_t     = D_t w_t − β_t (a_t S_{t-1}) dw_t
    D_{t-1}  = a_t (D_t − k_t dv_tᵀ)                 (D_0 = dh0, D_T = dht)
    dq_t     = scale · S_t do_t

Only ``dk``'s second term and ``dq`` need the state; nothing in the reverse sweep does.
So each backward program runs two sweeps over its sequence: a *reverse* sweep for
D (→ dv, dβ, dw, the first dk term, dh0), then a *forward* sweep that rebuilds S_t from
``h0`` and the ``u_t`` saved by the forward pass (the same float operations, so the
same states) and adds dq and the second dk term. dg needs neither state: rescaling
``S̃_t = S_t e^{-G_t}`` (``G_t = Σ_{s≤t} g_s``) turns the gates into ``q̃_t = e^{G_t} q_t``,
``ṽ_t = e^{-G_t} v_t`` and ``S_T = e^{G_T} S̃_T``, whence::

    dg_t = Σ_{s≥t} (o_s·do_s − v_s·dv_s) + <dht, S_T>     (o_s·do_s = q_s·dq_s)

a reverse cumulative sum per sequence, taken in PyTorch on a ``[B, T, HV]`` tensor.

Memory of the backward: the forward saves ``u`` (float32, ``[B, T, HV, V]``: the size
of v in float32) and nothing proportional to T·K·V; the backward allocates ``dw``
(float32, like u), and float32 partial sums over the NV = V / BV tiles for dq and dk
(``[B, T, HV, NV, K]`` each) and for dβ and dg (``[B, T, HV, NV]``). Compute: the
backward is two sweeps of the forward's cost. Checkpointing the state every C = 64
steps instead would keep K·V·4/64 bytes a token and head (1 KiB at K = V = 128, twice
u's 512 B) and recompute each segment's states in the backward; inverting a step to
walk back from S_T is not safe when exp(g) is tiny or I − βkkᵀ is near-singular.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# tl.sum is tl.reduce with this combine function. Kernels call tl.reduce directly: in the
# interpreter every call of a @jit function (tl.sum is one) costs milliseconds, while
# tl.reduce with _sum_combine maps to one numpy sum. On the GPU the two are the same.
from triton.language.standard import _sum_combine

from fla.ops.common.fused_recurrent_tiles import (
    block_k as _block_k,
    bwd_block_v as _bwd_block_v,
    bwd_config_space as _bwd_config_space,
    bwd_default_config as _bwd_default_config,
    config_space,
    default_config as _default_config,
    load_token_row,
    token_row,
)
from fla.ops.gated_delta_rule.inputs import prepare_gated_delta_inputs
from fla.ops.utils.index import locate_sequence
from fla.ops.utils.l2norm import L2NORM_EPS
from fla.ops.utils.state_tiles import load_state_tiles, state_tile
from fla.utils.backend import Backend, select_backend
from fla.utils.custom_ops import needs_backward, present, stage_op, upstream_grads
from fla.utils.grid import cdiv
from fla.utils.tuning import tuned

# The forward also tries V tiles of 128 (the other families stop at 64).
_config_space = functools.partial(config_space, block_vs=(8, 16, 32, 64, 128))


@triton.jit
def _unit(b_x, L2NORM: tl.constexpr):
    """``b_x`` over its L2 norm, rsqrt(‖x‖² + L2NORM_EPS), with ``L2NORM``; else as is."""
    if L2NORM:
        b_x = b_x * tl.rsqrt(tl.reduce(b_x * b_x, 0, _sum_combine) + 1e-6)
    return b_x


# ------------------------------------------------------------------------- forward
@tuned(key=["K", "V", "q", "h0"], default=_default_config, space=_config_space)
@triton.jit(do_not_specialize=["T"])
def fused_recurrent_gated_delta_rule_fwd_kernel(
    q, k, v, g, beta, o, u, h0, ht, cu_seqlens, scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, USE_BETA: tl.constexpr, USE_H0: tl.constexpr,
    STORE_HT: tl.constexpr, SAVE_U: tl.constexpr, IS_VARLEN: tl.constexpr,
    L2NORM: tl.constexpr, DELTA: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, length = locate_sequence(i_n, T, cu_seqlens, IS_VARLEN)

    o_k, o_v, m_k, m_v, o_s, m_s, state = state_tile(i_v, i_nh, K, V, BK, BV)

    b_s, _, _, _ = load_state_tiles(h0, state, o_s, o_k, m_v, K, V, BK, BV, USE_H0)

    for i in range(0, length):
        t = bos + i
        b_q = _unit(load_token_row(q, t, H, i_h, K, o_k, m_k), L2NORM) * scale
        b_k = _unit(load_token_row(k, t, H, i_h, K, o_k, m_k), L2NORM)
        b_v = load_token_row(v, t, HV, i_hv, V, o_v, m_v)
        # Optional inputs are None (a constexpr) when unused: no pointer is formed from them.
        if USE_G:
            b_s = b_s * tl.exp(tl.load(token_row(g, t, HV, i_hv, 1, 0)).to(tl.float32))
        if DELTA:
            b_u = b_v - tl.reduce(b_s * b_k[:, None], 0, _sum_combine)
        else:
            b_u = b_v
        if SAVE_U:
            tl.store(token_row(u, t, HV, i_hv, V, o_v), b_u, mask=m_v)
        if USE_BETA:
            b_u = b_u * tl.load(token_row(beta, t, HV, i_hv, 1, 0)).to(tl.float32)
        b_s += b_k[:, None] * b_u[None, :]
        b_o = tl.reduce(b_s * b_q[:, None], 0, _sum_combine)
        tl.store(token_row(o, t, HV, i_hv, V, o_v), b_o.to(o.dtype.element_ty), mask=m_v)

    if STORE_HT:
        tl.store(ht + state + o_s, b_s, mask=m_s)


# ------------------------------------------------------------------------ backward
@tuned(key=["K", "V", "BV", "q", "h0"], default=_bwd_default_config, space=_bwd_config_space)
@triton.jit(do_not_specialize=["T"])
def fused_recurrent_gated_delta_rule_bwd_kernel(
    q, k, v, g, beta, u, h0, do, dht, dq, dk, dv, dw, dbeta, dg, dh0, cu_seqlens, scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, USE_BETA: tl.constexpr, USE_H0: tl.constexpr,
    USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, IS_VARLEN: tl.constexpr,
    L2NORM: tl.constexpr, DELTA: tl.constexpr,
):
    # Partial sums over V tiles (dq, dk, dbeta, dg) are laid out [tokens, HV, NV, ...].
    NV: tl.constexpr = (V + BV - 1) // BV
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, length = locate_sequence(i_n, T, cu_seqlens, IS_VARLEN)

    o_k, o_v, m_k, m_v, o_s, m_s, state = state_tile(i_v, i_nh, K, V, BK, BV)

    # ---- reverse sweep: the adjoint state D, from dht back to dh0
    # (Pointers stepped a token at a time: recomputed from the token index, as the other
    # fused recurrent kernels do with token_row, this kernel took 80 -> 96 registers at K
    # = 64, fp16, 8 warps (offline sm_90 build): three programs an SM to two.)
    last = bos + length - 1
    p_q = q + (last * H + i_h) * K + o_k
    p_k = k + (last * H + i_h) * K + o_k
    p_u = u + (last * HV + i_hv) * V + o_v
    p_do = do + (last * HV + i_hv) * V + o_v
    p_dv = dv + (last * HV + i_hv) * V + o_v
    p_dw = dw + (last * HV + i_hv) * V + o_v
    p_dk = dk + ((last * HV + i_hv) * NV + i_v) * K + o_k
    if USE_G:
        p_g = g + last * HV + i_hv
    if USE_BETA:
        p_beta = beta + last * HV + i_hv
        p_db = dbeta + (last * HV + i_hv) * NV + i_v

    b_d, _, _, _ = load_state_tiles(dht, state, o_s, o_k, m_v, K, V, BK, BV, USE_DHT)
    for _ in range(0, length):
        b_q = _unit(tl.load(p_q, mask=m_k, other=0.0).to(tl.float32), L2NORM) * scale
        b_k = _unit(tl.load(p_k, mask=m_k, other=0.0).to(tl.float32), L2NORM)
        b_u = tl.load(p_u, mask=m_v, other=0.0).to(tl.float32)
        b_do = tl.load(p_do, mask=m_v, other=0.0).to(tl.float32)
        b_d += b_q[:, None] * b_do[None, :]
        b_dw = tl.reduce(b_d * b_k[:, None], 0, _sum_combine)
        if USE_BETA:
            b_beta = tl.load(p_beta).to(tl.float32)
            b_w = b_u * b_beta
            b_dv = b_dw * b_beta
            tl.store(p_db, tl.reduce(b_dw * b_u, 0, _sum_combine))
        else:
            b_w = b_u
            b_dv = b_dw
        tl.store(p_dk, tl.reduce(b_d * b_w[None, :], 1, _sum_combine), mask=m_k)
        tl.store(p_dv, b_dv.to(p_dv.dtype.element_ty), mask=m_v)
        tl.store(p_dw, b_dw, mask=m_v)
        if DELTA:
            b_d -= b_k[:, None] * b_dv[None, :]
        if USE_G:
            b_d = b_d * tl.exp(tl.load(p_g).to(tl.float32))

        p_q -= H * K
        p_k -= H * K
        p_u -= HV * V
        p_do -= HV * V
        p_dv -= HV * V
        p_dw -= HV * V
        p_dk -= HV * NV * K
        if USE_G:
            p_g -= HV
        if USE_BETA:
            p_beta -= HV
            p_db -= HV * NV
    if STORE_DH0:
        tl.store(dh0 + state + o_s, b_d, mask=m_s)

    # The forward sweep reads back dk and dw written above by other threads of this
    # program: a CTA barrier makes those global writes visible.
    tl.debug_barrier()

    # ---- forward sweep: rebuild S_t from h0 and the saved u_t
    p_q = q + (bos * H + i_h) * K + o_k
    p_k = k + (bos * H + i_h) * K + o_k
    p_v = v + (bos * HV + i_hv) * V + o_v
    p_u = u + (bos * HV + i_hv) * V + o_v
    p_do = do + (bos * HV + i_hv) * V + o_v
    p_dw = dw + (bos * HV + i_hv) * V + o_v
    p_dq = dq + ((bos * HV + i_hv) * NV + i_v) * K + o_k
    p_dk = dk + ((bos * HV + i_hv) * NV + i_v) * K + o_k
    if USE_G:
        p_g = g + bos * HV + i_hv
        p_dg = dg + (bos * HV + i_hv) * NV + i_v
    if USE_BETA:
        p_beta = beta + bos * HV + i_hv

    b_s, _, _, _ = load_state_tiles(h0, state, o_s, o_k, m_v, K, V, BK, BV, USE_H0)
    for _ in range(0, length):
        b_k = _unit(tl.load(p_k, mask=m_k, other=0.0).to(tl.float32), L2NORM)
        b_u = tl.load(p_u, mask=m_v, other=0.0).to(tl.float32)
        b_do = tl.load(p_do, mask=m_v, other=0.0).to(tl.float32)
        b_dw = tl.load(p_dw, mask=m_v, other=0.0)
        if USE_G:
            b_s = b_s * tl.exp(tl.load(p_g).to(tl.float32))
        if USE_BETA:
            b_beta = tl.load(p_beta).to(tl.float32)
            b_dw = b_dw * b_beta  # = dv, in float32
            b_u = b_u * b_beta    # = w
        if DELTA:
            # u_t = v_t − a_t S_{t-1}ᵀ k_t also depends on k_t.
            b_dk = tl.load(p_dk, mask=m_k, other=0.0)
            tl.store(p_dk, b_dk - tl.reduce(b_s * b_dw[None, :], 1, _sum_combine), mask=m_k)
        b_s += b_k[:, None] * b_u[None, :]
        b_dq = tl.reduce(b_s * b_do[None, :], 1, _sum_combine) * scale
        tl.store(p_dq, b_dq, mask=m_k)
        if USE_G:
            b_q = _unit(tl.load(p_q, mask=m_k, other=0.0).to(tl.float32), L2NORM)
            b_v = tl.load(p_v, mask=m_v, other=0.0).to(tl.float32)
            # o·do − v·dv (q·dq = o·do); b_dw holds dv here.
            b_dg = tl.reduce(b_q * b_dq, 0, _sum_combine) - tl.reduce(b_v * b_dw, 0, _sum_combine)
            tl.store(p_dg, b_dg)

        p_q += H * K
        p_k += H * K
        p_v += HV * V
        p_u += HV * V
        p_do += HV * V
        p_dw += HV * V
        p_dq += HV * NV * K
        p_dk += HV * NV * K
        if USE_G:
            p_g += HV
            p_dg += HV * NV
        if USE_BETA:
            p_beta += HV


# ------------------------------------------------------------------------ launchers
def fused_recurrent_gated_delta_rule_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
    beta: torch.Tensor | None, scale: float, initial_state: torch.Tensor | None,
    output_final_state: bool, cu_seqlens: torch.Tensor | None = None, N: int | None = None,
    use_qk_l2norm: bool = False, save_u: bool = False, delta: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Launch the forward kernel on validated, contiguous, time-major inputs.

    Returns ``(o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] float32 or None,
    u [B, T, HV, V] float32 or None)``; u (``v − a_t S_{t-1}ᵀ k``) only with ``save_u``.
    ``delta=False`` runs simple GLA's recurrence ``S_t = e^{g_t} S_{t-1} + β_t k_t ⊗ v_t``
    (u = v: nothing to save).
    """
    save_u = save_u and delta
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if N is None:
        N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    o = torch.empty_like(v)
    ht = q.new_empty(N, HV, K, V, dtype=torch.float32) if output_final_state else None
    u = torch.empty(v.shape, dtype=torch.float32, device=v.device) if save_u else None
    grid = lambda meta: (cdiv(V, meta["BV"]), N * HV)  # noqa: E731
    fused_recurrent_gated_delta_rule_fwd_kernel[grid](
        q, k, v, g, beta, o, u, initial_state, ht, cu_seqlens, scale, T,
        H=H, HV=HV, K=K, V=V, BK=_block_k(K),
        USE_G=g is not None, USE_BETA=beta is not None, USE_H0=initial_state is not None,
        STORE_HT=output_final_state, SAVE_U=save_u, IS_VARLEN=cu_seqlens is not None,
        L2NORM=use_qk_l2norm, DELTA=delta,
    )
    return o, ht, u


def _reverse_cumsum(x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """``y_t = Σ_{s ≥ t} x_s`` within each sequence, over dim 1 of ``x [B, T, HV]``.

    Summed in float64 (a [B, T, HV] tensor: cheap): over thousands of tokens a float32
    running sum loses digits that a later sum over tokens (a per-head decay's gradient)
    would expose."""
    if cu_seqlens is None:
        return x.double().flip(1).cumsum(1).flip(1).to(x.dtype)
    T = x.shape[1]
    # One pass over the packed axis, then subtract what the later sequences contributed;
    # float64 so that the subtraction loses nothing.
    total = x[0].double().flip(0).cumsum(0).flip(0)
    total = torch.cat([total, total.new_zeros(1, total.shape[1])])
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    next_start = torch.repeat_interleave(cu_seqlens[1:], lengths, output_size=T)
    return (total[:T] - total[next_start]).to(x.dtype).unsqueeze(0)


def _l2norm_bwd(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """Gradient through ``y = x · rsqrt(‖x‖² + eps)`` (last dim), in float32."""
    x = x.float()
    r = torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)
    y = x * r
    return r * (dy - y * (y * dy).sum(-1, keepdim=True))


def fused_recurrent_gated_delta_rule_bwd(
    q, k, v, g, beta, u, scale, initial_state, do, dht, ht, cu_seqlens=None, N=None,
    use_qk_l2norm=False, need_dh0=True, delta=True,
):
    """Gradients of the fused recurrence: ``(dq, dk, dv, dg, dbeta, dh0)`` in the dtypes of
    q, k, v, g, beta and initial_state (None where the input is None).

    ``u`` is the forward's saved ``v − a_t S_{t-1}ᵀ k`` (ignored with ``delta=False``,
    where it is v); ``ht`` the final state (needed with ``dht`` for dg). Shapes as
    :func:`fused_recurrent_gated_delta_rule_fwd`.
    """
    if not delta:
        u = v
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if N is None:
        N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    BK, BV = _block_k(K), _bwd_block_v(K, V)
    NV = cdiv(V, BV)
    f32 = dict(dtype=torch.float32, device=q.device)

    dq = torch.empty(B, T, HV, NV, K, **f32)
    dk = torch.empty(B, T, HV, NV, K, **f32)
    dv = torch.empty_like(v)
    dw = torch.empty(B, T, HV, V, **f32)
    dbeta = torch.empty(B, T, HV, NV, **f32) if beta is not None else None
    dg = torch.empty(B, T, HV, NV, **f32) if g is not None else None
    store_dh0 = initial_state is not None and need_dh0
    dh0 = torch.empty(N, HV, K, V, **f32) if store_dh0 else None

    fused_recurrent_gated_delta_rule_bwd_kernel[(NV, N * HV)](
        q, k, v, g, beta, u, initial_state, do, dht, dq, dk, dv, dw, dbeta, dg, dh0,
        cu_seqlens, scale, T, H=H, HV=HV, K=K, V=V, BK=BK, BV=BV,
        USE_G=g is not None, USE_BETA=beta is not None, USE_H0=initial_state is not None,
        USE_DHT=dht is not None, STORE_DH0=store_dh0, IS_VARLEN=cu_seqlens is not None,
        L2NORM=use_qk_l2norm, DELTA=delta,
    )

    dq, dk = dq.sum(3), dk.sum(3)
    if HV != H:  # value heads of one q/k head: their gradients add up
        dq = dq.view(B, T, H, HV // H, K).sum(3)
        dk = dk.view(B, T, H, HV // H, K).sum(3)
    if use_qk_l2norm:
        dq, dk = _l2norm_bwd(q, dq), _l2norm_bwd(k, dk)
    if dbeta is not None:
        dbeta = dbeta.sum(3).to(beta.dtype)
    if dg is not None:
        dg = dg.sum(3)
        if dht is not None:
            # d/dG_T of <dht, S_T>, S_T = e^{G_T} S̃_T: enters every dg_t of the sequence.
            last = (dht.float() * ht).sum((-2, -1))  # [N, HV]
            if cu_seqlens is None:
                dg[:, -1] += last
            else:
                dg[0].index_add_(0, cu_seqlens[1:] - 1, last)
        dg = _reverse_cumsum(dg, cu_seqlens).to(g.dtype)
    if dh0 is not None:
        dh0 = dh0.to(initial_state.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv, dg, dbeta, dh0


# The forward and backward launchers as custom ops (torch.compile sees one node each, and
# a decode step can be captured in a CUDA graph), joined by the autograd formula below.
# The forward's third output is u, saved for the backward (a placeholder without save_u).
_fused_fwd = stage_op(
    "fused_recurrent_gated_delta_rule_fwd", fused_recurrent_gated_delta_rule_fwd,
    label="fused_recurrent_gated_delta_rule.fwd",
    schema="(Tensor q, Tensor k, Tensor v, Tensor? g, Tensor? beta, float scale, "
           "Tensor? initial_state, bool output_final_state, Tensor? cu_seqlens, int N, "
           "bool use_qk_l2norm, bool save_u, bool delta) -> (Tensor, Tensor, Tensor)")
_fused_bwd = stage_op(
    "fused_recurrent_gated_delta_rule_bwd", fused_recurrent_gated_delta_rule_bwd,
    label="fused_recurrent_gated_delta_rule.bwd",
    schema="(Tensor q, Tensor k, Tensor v, Tensor? g, Tensor? beta, Tensor? u, float scale, "
           "Tensor? initial_state, Tensor do, Tensor? dht, Tensor? ht, Tensor? cu_seqlens, "
           "int N, bool use_qk_l2norm, bool need_dh0, bool delta) "
           "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")


def _setup_context(ctx, inputs, output):
    (q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, N,
     use_qk_l2norm, _, delta) = inputs
    _, ht, u = output
    ctx.save_for_backward(q, k, v, g, beta, present(u, delta), initial_state,
                          present(ht, output_final_state), cu_seqlens)
    ctx.scale, ctx.N, ctx.use_qk_l2norm, ctx.delta = scale, N, use_qk_l2norm, delta


def _backward_formula(ctx, do, dht, _du):
    q, k, v, g, beta, u, initial_state, ht, cu_seqlens = ctx.saved_tensors
    do, dht = upstream_grads(do, dht, v, ht is not None)
    dq, dk, dv, dg, dbeta, dh0 = _fused_bwd(
        q, k, v, g, beta, u, ctx.scale, initial_state, do, dht, ht, cu_seqlens, ctx.N,
        ctx.use_qk_l2norm, ctx.needs_input_grad[6], ctx.delta)
    return (dq, dk, dv, present(dg, g is not None), present(dbeta, beta is not None), None,
            present(dh0, initial_state is not None and ctx.needs_input_grad[6]),
            None, None, None, None, None, None)


_fused_fwd.register_autograd(_backward_formula, setup_context=_setup_context)


def fused_recurrent_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
    beta: torch.Tensor | None, scale: float, initial_state: torch.Tensor | None,
    output_final_state: bool, cu_seqlens: torch.Tensor | None, N: int,
    use_qk_l2norm: bool = False, delta: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The Triton path through the custom op: ``(o, final_state)`` from validated,
    time-major inputs (shapes as :func:`fused_recurrent_gated_delta_rule_fwd`).

    u is saved only when a gradient will be taken: decoding is one kernel launch that
    writes o and the final state, nothing else."""
    save_u = needs_backward(q, k, v, g, beta, initial_state)
    o, ht, _ = _fused_fwd(q, k, v, g, beta, scale, initial_state, output_final_state,
                          cu_seqlens, N, use_qk_l2norm, save_u, delta)
    return o, present(ht, output_final_state)


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None, scale: float | None = None,
    initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None, use_qk_l2norm_in_kernel: bool = False,
    head_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""The gated delta rule computed one token at a time (decoding; also trains).

    For every sequence n and value head j, from ``S_0 = initial_state[n, j]`` (zeros if
    None)::

        S_t = exp(g_t) · S_{t-1}
        S_t = S_t + β_t · k_t ⊗ (v_t − S_tᵀ k_t)
        o_t = scale · S_tᵀ q_t

    Args:
        q, k: ``[B, T, H, K]`` (``[B, H, T, K]`` with ``head_first=True``), K ≤ 256.
        v: ``[B, T, HV, V]``, V ≤ 256, HV a multiple of H: value head j reads the q/k
            head ``j // (HV // H)``.
        g: ``[B, T, HV]`` natural-log decay per token; None means 0 (no decay).
        beta: ``[B, T, HV]`` write strength; None means 1.
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]``, float32 preferred (other float dtypes are
            read as float32); N = B, or the number of sequences with ``cu_seqlens``.
        output_final_state: also return the last state.
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of packed sequences (B must be 1).
        use_qk_l2norm_in_kernel: normalise q and k to unit L2 norm first (inside the
            kernel; the gradient goes through the normalisation).
        head_first: inputs (and o) are ``[B, H, T, ...]``.

    Returns:
        ``(o, final_state)``: ``o`` like v (v's dtype), ``final_state`` float32
        ``[N, HV, K, V]`` or None. Differentiable in q, k, v, g, beta, initial_state.

    CUDA tensors run the Triton kernels; CPU tensors the PyTorch recurrence (or the
    kernels in the interpreter with ``TRITON_INTERPRET=1``).
    """
    x = prepare_gated_delta_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens,
                                   head_first)
    backend = select_backend(x.q, x.k, x.v, x.g, x.beta, x.initial_state)
    if backend is Backend.TORCH:
        from fla.ops.gated_delta_rule.recurrent_torch import recurrent_gated_delta_rule_torch
        o, final_state = recurrent_gated_delta_rule_torch(
            x.q, x.k, x.v, x.g, x.beta, x.scale, x.initial_state, output_final_state,
            x.seq_offsets, use_qk_l2norm_in_kernel)
    else:
        o, final_state = fused_recurrent_triton(
            x.q, x.k, x.v, x.g, x.beta, x.scale, x.initial_state, output_final_state,
            x.cu_seqlens, x.N, use_qk_l2norm_in_kernel)
    if head_first:
        o = o.transpose(1, 2)
    return o, final_state
