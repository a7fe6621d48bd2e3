"""Mamba2's time steps and log decays from the raw dt, one kernel each way.

From ``dt [b, T, H]`` (any float dtype) and the per-head ``A``, ``dt_bias`` ``[H]``::

    u  = dt + dt_bias
    d  = softplus(u)            (with dt_softplus; else d = u)
    dt' = clamp(d, low, high)   (float32)
    g  = dt' · A                (float32: simple GLA's log decay)

and backward, from the gradients ``ddt'`` (through v = dt'·x) and ``dg``::

    dd       = (ddt' + dg · A) · [low ≤ d ≤ high]
    du       = dd · σ(u)        (softplus' = σ; 1 past softplus's threshold, 20)
    ddt      = du               (dt's dtype)
    dA       = Σ_tokens dg · dt'
    ddt_bias = Σ_tokens du

In PyTorch that is ~6 small kernels forward and ~12 backward (each a few µs of GPU time
but ~10-20 µs of host time, and the step is host-bound); here one launch each way plus
one sum of the per-program partials of dA and ddt_bias (no atomics: deterministic).
Behind the custom ops ``fla::mamba2_time_steps_fwd`` / ``_bwd``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fla.ops.utils.elementwise import (
    one_stage_default,
    one_stage_space,
    row_tile,
    rows_per_program,
    softplus,
    softplus_grad,
)
from fla.ops.utils.partial_sums import sum_partial_pair
from fla.utils.backend import Backend, select_backend
from fla.utils.custom_ops import present, stage_op
from fla.utils.grid import cdiv, next_power_of_2
from fla.utils.tuning import tuned

__all__ = ["time_steps", "time_steps_fwd_kernel", "time_steps_bwd_kernel"]


@triton.jit
def _steps(dt, dt_bias, p, o_h, m, m_h, low, high, HAS_BIAS: tl.constexpr,
           SOFTPLUS: tl.constexpr):
    """(u, d, dt') of one tile (see the module docstring)."""
    b_u = tl.load(dt + p, mask=m, other=0.).to(tl.float32)
    if HAS_BIAS:
        b_u += tl.load(dt_bias + o_h, mask=m_h, other=0.).to(tl.float32)[None, :]
    if SOFTPLUS:
        b_d = softplus(b_u)
    else:
        b_d = b_u
    return b_u, b_d, tl.minimum(tl.maximum(b_d, low), high)


@tuned(key=["dt", "H", "HAS_BIAS", "SOFTPLUS"], default=one_stage_default, space=one_stage_space)
@triton.jit(do_not_specialize=["R"])
def time_steps_fwd_kernel(dt, A, dt_bias, dt_out, g, low, high, R, H: tl.constexpr,
                          BH: tl.constexpr, BR: tl.constexpr, HAS_BIAS: tl.constexpr,
                          SOFTPLUS: tl.constexpr):
    """One program per BR rows of ``dt [R, H]``: ``dt_out`` and ``g`` ``[R, H]`` float32."""
    _, _, o_h, m_h, m, p = row_tile(tl.program_id(0), 0, R, H, BR, BH)
    _, _, b_dt = _steps(dt, dt_bias, p, o_h, m, m_h, low, high, HAS_BIAS, SOFTPLUS)
    b_A = tl.load(A + o_h, mask=m_h, other=0.).to(tl.float32)
    tl.store(dt_out + p, b_dt, mask=m)
    tl.store(g + p, b_dt * b_A[None, :], mask=m)


@tuned(key=["dt", "H", "HAS_BIAS", "SOFTPLUS", "HAS_DDT", "HAS_DG"], default=one_stage_default,
       space=one_stage_space)
@triton.jit(do_not_specialize=["R"])
def time_steps_bwd_kernel(dt, A, dt_bias, ddt_out, dg, ddt, dA_part, dbias_part, low, high,
                          R, H: tl.constexpr, BH: tl.constexpr, BR: tl.constexpr,
                          HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                          HAS_DDT: tl.constexpr, HAS_DG: tl.constexpr):
    """Same grid: ``ddt [R, H]`` (dt's dtype) and this program's partial sums of dA and
    ddt_bias (row ``program_id`` of ``[programs, H]`` float32, summed by the launcher)."""
    i_p = tl.program_id(0)
    _, _, o_h, m_h, m, p = row_tile(i_p, 0, R, H, BR, BH)
    b_u, b_d, b_dt = _steps(dt, dt_bias, p, o_h, m, m_h, low, high, HAS_BIAS, SOFTPLUS)
    b_dd = tl.zeros([BR, BH], dtype=tl.float32)
    if HAS_DDT:
        b_dd += tl.load(ddt_out + p, mask=m, other=0.)
    if HAS_DG:
        b_dg = tl.load(dg + p, mask=m, other=0.)
        b_dd += b_dg * tl.load(A + o_h, mask=m_h, other=0.).to(tl.float32)[None, :]
        # Masked entries loaded dg = 0: they add nothing.
        tl.store(dA_part + i_p * H + o_h, tl.sum(b_dg * b_dt, 0), mask=m_h)
    else:
        tl.store(dA_part + i_p * H + o_h, tl.zeros([BH], dtype=tl.float32), mask=m_h)
    # clamp passes the gradient where low ≤ d ≤ high (torch.clamp's rule).
    b_dd = tl.where((b_d >= low) & (b_d <= high), b_dd, 0.)
    if SOFTPLUS:
        b_dd *= softplus_grad(b_u)
    tl.store(ddt + p, b_dd.to(ddt.dtype.element_ty), mask=m)
    if HAS_BIAS:
        tl.store(dbias_part + i_p * H + o_h, tl.sum(b_dd, 0), mask=m_h)


def _time_steps_fwd(dt, A, dt_bias, softplus: bool, low: float, high: float):
    """``(dt', g)``, each ``[b, T, H]`` float32; dt contiguous."""
    H = dt.shape[-1]
    R = dt.numel() // H
    dt_out = torch.empty(dt.shape, dtype=torch.float32, device=dt.device)
    g = torch.empty_like(dt_out)
    BR = rows_per_program(H)
    time_steps_fwd_kernel[(cdiv(R, BR),)](
        dt=dt, A=A, dt_bias=dt_bias, dt_out=dt_out, g=g, low=low, high=high, R=R, H=H,
        BH=next_power_of_2(H), BR=BR, HAS_BIAS=dt_bias is not None, SOFTPLUS=softplus)
    return dt_out, g


def _time_steps_bwd(dt, A, dt_bias, softplus: bool, low: float, high: float, ddt_out, dg):
    """``(ddt, dA, ddt_bias)``: ddt like dt, dA like A, ddt_bias like dt_bias (None
    without it)."""
    H = dt.shape[-1]
    R = dt.numel() // H
    BR = rows_per_program(H)
    programs = cdiv(R, BR)
    ddt = torch.empty_like(dt)
    # One row of partial sums per program, every row written by every launch.
    dA_part = torch.empty(programs, H, dtype=torch.float32, device=dt.device)
    dbias_part = None if dt_bias is None else torch.empty_like(dA_part)
    time_steps_bwd_kernel[(programs,)](
        dt=dt, A=A, dt_bias=dt_bias,
        ddt_out=None if ddt_out is None else ddt_out.contiguous(),
        dg=None if dg is None else dg.contiguous(), ddt=ddt, dA_part=dA_part,
        dbias_part=dbias_part, low=low, high=high, R=R, H=H, BH=next_power_of_2(H), BR=BR,
        HAS_BIAS=dt_bias is not None, SOFTPLUS=softplus, HAS_DDT=ddt_out is not None,
        HAS_DG=dg is not None)
    dA, dbias = sum_partial_pair(dA_part, A, dbias_part, dt_bias)
    return ddt, dA, dbias


_fwd_op = stage_op(
    "mamba2_time_steps_fwd", _time_steps_fwd, label="mamba2_time_steps.fwd", ahead=False,
    schema="(Tensor dt, Tensor A, Tensor? dt_bias, bool softplus, float low, float high) "
           "-> (Tensor, Tensor)")
_bwd_op = stage_op(
    "mamba2_time_steps_bwd", _time_steps_bwd, label="mamba2_time_steps.bwd", ahead=False,
    schema="(Tensor dt, Tensor A, Tensor? dt_bias, bool softplus, float low, float high, "
           "Tensor? ddt_out, Tensor? dg) -> (Tensor, Tensor, Tensor)")


def _setup_context(ctx, inputs, output):
    dt, A, dt_bias, softplus, low, high = inputs
    ctx.save_for_backward(dt, A, dt_bias)
    ctx.args = (softplus, low, high)
    ctx.has_bias = dt_bias is not None


def _backward(ctx, ddt_out, dg):
    dt, A, dt_bias = ctx.saved_tensors
    ddt, dA, dbias = _bwd_op(dt, A, dt_bias, *ctx.args, ddt_out, dg)
    return ddt, dA, present(dbias, ctx.has_bias), None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def _time_steps_torch(dt, A, dt_bias, softplus: bool, low: float, high: float):
    acc = torch.promote_types(dt.dtype, torch.float32)    # float64 stays float64
    u = dt.to(acc)
    if dt_bias is not None:
        u = u + dt_bias.to(acc)
    if softplus:
        u = F.softplus(u)
    u = u.clamp(min=low, max=high)
    return u, u * A.to(acc)


def time_steps(dt: torch.Tensor, A: torch.Tensor, dt_bias: torch.Tensor | None = None,
               softplus: bool = False, low: float = 0.0, high: float = float("inf")):
    """Mamba2's processed time steps and simple GLA's log decay from the raw dt.

    Args:
        dt: ``[b, T, H]`` raw time steps, any float dtype.
        A: ``[H]`` per-head decay rates (negative for a decay).
        dt_bias: ``[H]`` added before the softplus, or None.
        softplus: apply softplus to ``dt + dt_bias``.
        low, high: the clamp of the result (low <= high; high may be inf).

    Returns:
        ``(dt', g)``, each ``[b, T, H]`` float32 (float64 for float64 dt):
        ``dt' = clamp(softplus?(dt + dt_bias), low, high)``, ``g = dt' · A``.
        Differentiable in dt, A and dt_bias. Shapes are the caller's to check.
    """
    low, high = float(low), float(high)
    if dt.numel() == 0 or dt.dtype == torch.float64 or select_backend(dt) is Backend.TORCH:
        return _time_steps_torch(dt, A, dt_bias, softplus, low, high)
    return _fwd_op(dt.contiguous(), A.contiguous(),
                   None if dt_bias is None else dt_bias.contiguous(), bool(softplus),
                   low, high)
