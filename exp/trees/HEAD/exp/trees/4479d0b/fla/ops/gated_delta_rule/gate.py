"""Gated DeltaNet's per-token gates from its two small projections, in one kernel.

From the packed projection output ``ab = [a | b]`` (``[..., 2H]``: ``a = x W_aᵀ``,
``b = x W_bᵀ``) and the per-head parameters ``A_log``, ``dt_bias`` [H]::

    g    = −exp(A_log) · softplus(a + dt_bias)      (log decay, float32)
    beta = beta_scale · σ(b)                         (ab's dtype)

and backward, with z = a + dt_bias (softplus' = σ)::

    da       = −dg · exp(A_log) · σ(z)
    db       = dbeta · beta_scale · σ(b) (1 − σ(b))
    dA_log   = Σ_tokens dg · g
    ddt_bias = Σ_tokens da

In PyTorch these are ~10 elementwise kernels forward and ~15 backward on ``[B, T, H]``
tensors, a few microseconds of GPU time each but tens of microseconds of host time: in
a training step of a 20-layer model they are ~500 launches during which the GPU waits.
Here each direction is one launch (plus a sum of per-program partials of the two
per-head gradients: no atomics, deterministic). Behind the custom ops
``fla::gdn_gate_fwd`` / ``_bwd``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fla.ops.utils.elementwise import (
    one_stage_default,
    one_stage_space,
    rows_per_program,
    softplus,
    softplus_grad,
)
from fla.ops.utils.partial_sums import sum_partial_pair
from fla.utils.backend import Backend, select_backend
from fla.utils.custom_ops import stage_op
from fla.utils.grid import cdiv, next_power_of_2
from fla.utils.tuning import tuned
from fla.utils.validation import (
    FLOAT_DTYPES,
    check_same_device,
    check_tensor,
    contiguous_or_none,
)

__all__ = ["gated_delta_rule_gate", "gdn_gate_fwd_kernel", "gdn_gate_bwd_kernel"]

# softplus(z) = z above this (torch.nn.functional.softplus's default threshold).
_SOFTPLUS_THRESHOLD = 20.0


@tuned(key=["H", "ab", "HAS_DT_BIAS"], default=one_stage_default, space=one_stage_space)
@triton.jit(do_not_specialize=["R"])
def gdn_gate_fwd_kernel(ab, A_log, dt_bias, g, beta, beta_scale, R, H: tl.constexpr,
                        BH: tl.constexpr, BR: tl.constexpr, HAS_DT_BIAS: tl.constexpr):
    """One program per BR rows: ``ab [R, 2H]`` -> ``g [R, H]`` float32, ``beta [R, H]``."""
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_h = tl.arange(0, BH)
    m_h = o_h < H
    m = (o_r < R)[:, None] & m_h[None, :]
    p_a = ab + o_r[:, None] * (2 * H) + o_h[None, :]
    b_z = tl.load(p_a, mask=m, other=0.).to(tl.float32)
    if HAS_DT_BIAS:
        b_z += tl.load(dt_bias + o_h, mask=m_h, other=0.).to(tl.float32)[None, :]
    b_A = tl.exp(tl.load(A_log + o_h, mask=m_h, other=0.).to(tl.float32))
    b_g = -b_A[None, :] * softplus(b_z)
    b_b = tl.load(p_a + H, mask=m, other=0.).to(tl.float32)
    b_beta = beta_scale * tl.sigmoid(b_b)
    p_o = o_r[:, None] * H + o_h[None, :]
    tl.store(g + p_o, b_g, mask=m)
    tl.store(beta + p_o, b_beta.to(beta.dtype.element_ty), mask=m)


@tuned(key=["H", "ab", "HAS_DT_BIAS", "HAS_DG", "HAS_DBETA"], default=one_stage_default,
       space=one_stage_space)
@triton.jit(do_not_specialize=["R"])
def gdn_gate_bwd_kernel(ab, A_log, dt_bias, dg, dbeta, dab, dA_part, ddt_part, beta_scale, R,
                        H: tl.constexpr, BH: tl.constexpr, BR: tl.constexpr,
                        HAS_DT_BIAS: tl.constexpr, HAS_DG: tl.constexpr,
                        HAS_DBETA: tl.constexpr):
    """One program per BR rows: ``dab [R, 2H]`` and this program's partial sums of dA_log
    and ddt_bias (row ``program_id`` of ``[programs, H]``, summed by the launcher)."""
    i_p = tl.program_id(0)
    o_r = i_p.to(tl.int64) * BR + tl.arange(0, BR)
    o_h = tl.arange(0, BH)
    m_h = o_h < H
    m = (o_r < R)[:, None] & m_h[None, :]
    p_a = ab + o_r[:, None] * (2 * H) + o_h[None, :]
    p_o = o_r[:, None] * H + o_h[None, :]
    if HAS_DG:
        b_z = tl.load(p_a, mask=m, other=0.).to(tl.float32)
        if HAS_DT_BIAS:
            b_z += tl.load(dt_bias + o_h, mask=m_h, other=0.).to(tl.float32)[None, :]
        b_A = tl.exp(tl.load(A_log + o_h, mask=m_h, other=0.).to(tl.float32))
        b_dg = tl.load(dg + p_o, mask=m, other=0.).to(tl.float32)
        b_sp = softplus(b_z)
        b_da = -b_dg * b_A[None, :] * softplus_grad(b_z)
        # dA_log = Σ dg · g with g = −A · softplus(z).
        tl.store(dA_part + i_p * H + o_h, tl.sum(-b_dg * b_A[None, :] * b_sp, 0), mask=m_h)
        tl.store(ddt_part + i_p * H + o_h, tl.sum(b_da, 0), mask=m_h)
    else:
        b_da = tl.zeros([BR, BH], dtype=tl.float32)
        tl.store(dA_part + i_p * H + o_h, tl.zeros([BH], dtype=tl.float32), mask=m_h)
        tl.store(ddt_part + i_p * H + o_h, tl.zeros([BH], dtype=tl.float32), mask=m_h)
    if HAS_DBETA:
        b_s = tl.sigmoid(tl.load(p_a + H, mask=m, other=0.).to(tl.float32))
        b_db = tl.load(dbeta + p_o, mask=m, other=0.).to(tl.float32) * beta_scale \
            * b_s * (1. - b_s)
    else:
        b_db = tl.zeros([BR, BH], dtype=tl.float32)
    p_d = dab + o_r[:, None] * (2 * H) + o_h[None, :]
    tl.store(p_d, b_da.to(dab.dtype.element_ty), mask=m)
    tl.store(p_d + H, b_db.to(dab.dtype.element_ty), mask=m)


def _gate_fwd(ab: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None,
              beta_scale: float):
    """``(g float32, beta in ab's dtype)``, each ``[..., H]``; ab contiguous."""
    H = ab.shape[-1] // 2
    R = ab.numel() // (2 * H)
    g = torch.empty(*ab.shape[:-1], H, dtype=torch.float32, device=ab.device)
    beta = torch.empty(*ab.shape[:-1], H, dtype=ab.dtype, device=ab.device)
    BR = rows_per_program(H)
    gdn_gate_fwd_kernel[(cdiv(R, BR),)](
        ab=ab, A_log=A_log, dt_bias=dt_bias, g=g, beta=beta, beta_scale=beta_scale, R=R,
        H=H, BH=next_power_of_2(H), BR=BR, HAS_DT_BIAS=dt_bias is not None)
    return g, beta


def _gate_bwd(ab, A_log, dt_bias, beta_scale: float, dg, dbeta):
    """``(dab, dA_log, ddt_bias)``: dab like ab; the per-head ones float32 sums cast to
    the parameters' dtypes (ddt_bias an empty placeholder without dt_bias)."""
    H = ab.shape[-1] // 2
    R = ab.numel() // (2 * H)
    dab = torch.empty_like(ab)
    BR = rows_per_program(H)
    programs = cdiv(R, BR)
    # One row of partial sums per program, every row written by every launch.
    dA_part = torch.empty(programs, H, dtype=torch.float32, device=ab.device)
    ddt_part = torch.empty(programs, H, dtype=torch.float32, device=ab.device)
    gdn_gate_bwd_kernel[(programs,)](
        ab=ab, A_log=A_log, dt_bias=dt_bias,
        dg=contiguous_or_none(dg), dbeta=contiguous_or_none(dbeta),
        dab=dab, dA_part=dA_part, ddt_part=ddt_part, beta_scale=beta_scale, R=R, H=H,
        BH=next_power_of_2(H), BR=BR, HAS_DT_BIAS=dt_bias is not None,
        HAS_DG=dg is not None, HAS_DBETA=dbeta is not None)
    dA_log, ddt_bias = sum_partial_pair(dA_part, A_log, ddt_part, dt_bias)
    return dab, dA_log, ddt_bias


_gate_fwd_op = stage_op(
    "gdn_gate_fwd", _gate_fwd, label="gdn_gate.fwd", ahead=False,
    schema="(Tensor ab, Tensor A_log, Tensor? dt_bias, float beta_scale) -> (Tensor, Tensor)")
_gate_bwd_op = stage_op(
    "gdn_gate_bwd", _gate_bwd, label="gdn_gate.bwd", ahead=False,
    schema="(Tensor ab, Tensor A_log, Tensor? dt_bias, float beta_scale, Tensor? dg, "
           "Tensor? dbeta) -> (Tensor, Tensor, Tensor)")


def _setup_context(ctx, inputs, output):
    ab, A_log, dt_bias, beta_scale = inputs
    ctx.save_for_backward(ab, A_log, dt_bias)
    ctx.beta_scale = beta_scale
    ctx.has_dt_bias = dt_bias is not None


def _backward(ctx, dg, dbeta):
    ab, A_log, dt_bias = ctx.saved_tensors
    dab, dA_log, ddt_bias = _gate_bwd_op(ab, A_log, dt_bias, ctx.beta_scale, dg, dbeta)
    return dab, dA_log, (ddt_bias if ctx.has_dt_bias else None), None


_gate_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def _gate_torch(ab, A_log, dt_bias, beta_scale: float):
    H = ab.shape[-1] // 2
    acc = torch.promote_types(ab.dtype, torch.float32)  # float64 stays float64
    a, b = ab[..., :H].to(acc), ab[..., H:].to(acc)
    if dt_bias is not None:
        a = a + dt_bias.to(acc)
    g = -A_log.to(acc).exp() * F.softplus(a, threshold=_SOFTPLUS_THRESHOLD)
    beta = (beta_scale * b.sigmoid()).to(ab.dtype)
    return g, beta


def gated_delta_rule_gate(ab: torch.Tensor, A_log: torch.Tensor,
                          dt_bias: torch.Tensor | None = None,
                          beta_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's log decay and write strength from its packed gate projections.

    Args:
        ab: ``[..., 2H]``: ``a`` (the decay projection) in the first H columns, ``b``
            (the β projection) in the last H; fp32/fp16/bf16 (float64 runs in PyTorch).
        A_log: ``[H]`` log decay rates (``A = exp(A_log)``).
        dt_bias: ``[H]`` or None, added to ``a`` before the softplus.
        beta_scale: β's range is (0, beta_scale) (2 allows negative eigenvalues).

    Returns:
        ``(g, beta)``, each ``[..., H]``: ``g = −exp(A_log) · softplus(a + dt_bias)`` in
        float32 (float64 for float64 inputs), ``beta = beta_scale · σ(b)`` in ab's dtype.
        Differentiable in ab, A_log and dt_bias.
    """
    check_tensor("ab", ab, dtypes=(*FLOAT_DTYPES, torch.float64))
    if ab.dim() == 0 or ab.shape[-1] % 2 or ab.shape[-1] == 0:
        raise ValueError(f"ab: expected [..., 2H] with H >= 1, got shape {tuple(ab.shape)}")
    H = ab.shape[-1] // 2
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t is not None:
            check_tensor(name, t, dtypes=(*FLOAT_DTYPES, torch.float64))
            if tuple(t.shape) != (H,):
                raise ValueError(f"{name}: expected shape [H] = [{H}] (half of ab's last "
                                 f"dim), got {tuple(t.shape)}")
    check_same_device(ab=ab, A_log=A_log, dt_bias=dt_bias)
    beta_scale = float(beta_scale)
    if ab.numel() == 0 or ab.dtype == torch.float64 or select_backend(ab) is Backend.TORCH:
        return _gate_torch(ab, A_log, dt_bias, beta_scale)
    return _gate_fwd_op(ab.contiguous(), A_log.contiguous(), contiguous_or_none(dt_bias),
                        beta_scale)
