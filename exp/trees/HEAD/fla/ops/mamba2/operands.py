"""Simple GLA's operands from Mamba2's inputs, one kernel each way.

* :func:`heads_of_groups`: B and C, ``[b, T, G, N]`` -> ``[b, T, H, N]`` (head h reads
  group h // (H / G)); backward, each group's gradient is the sum over its heads.
* :func:`scaled_input`: ``v = dt ⊙ x`` (``x [b, T, H, P]``, ``dt [b, T, H]`` float32),
  in float32 and rounded once to x's dtype; backward ``dx = dv ⊙ dt``,
  ``ddt = Σ_p dv ⊙ x``.

In PyTorch the broadcast copy runs at ~1 TB/s (a strided copy: 134 µs for each of B and C
at 4x4096x32x128 bf16 on H100) and its backward is a reduction kernel per tensor; the
product went through a float32 [b, T, H, P] tensor and a second kernel to round it.
Here each is one launch at copy speed. Behind custom ops (``fla::mamba2_*``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fla.ops.utils.elementwise import (
    one_stage_default,
    one_stage_space,
    row_tile,
    rows_per_program,
)
from fla.utils.backend import Backend, select_backend
from fla.utils.custom_ops import stage_op
from fla.utils.grid import cdiv, next_power_of_2
from fla.utils.tuning import tuned

__all__ = ["heads_of_groups", "scaled_input", "group_heads_kernel", "sum_group_heads_kernel",
           "scaled_input_fwd_kernel", "scaled_input_bwd_kernel"]

def _rows_per_program(width: int) -> int:
    # 2048 values a tile (16 fp32 registers a thread at 4 warps), as many rows as fit.
    return rows_per_program(width, values=2048, least=1, most=2048)


# ------------------------------------------------------------------------ heads of groups
@tuned(key=["t", "G", "H", "N"], default=one_stage_default, space=one_stage_space)
@triton.jit(do_not_specialize=["R"])
def group_heads_kernel(t, out, R, G: tl.constexpr, H: tl.constexpr, N: tl.constexpr,
                       BN: tl.constexpr, BR: tl.constexpr):
    """Grid ``(cdiv(R, BR), G)`` over R tokens: ``t [R, G, N]`` -> ``out [R, H, N]``, the
    group's tile loaded once and stored to each of its H / G heads."""
    i_r, i_g = tl.program_id(0), tl.program_id(1)
    o_r = i_r.to(tl.int64) * BR + tl.arange(0, BR)
    o_n = tl.arange(0, BN)
    m = (o_r < R)[:, None] & (o_n < N)[None, :]
    b_t = tl.load(t + o_r[:, None] * (G * N) + i_g * N + o_n[None, :], mask=m)
    p_out = out + o_r[:, None] * (H * N) + i_g * (H // G) * N + o_n[None, :]
    for i_j in range(H // G):
        tl.store(p_out + i_j * N, b_t, mask=m)


@tuned(key=["dout", "G", "H", "N"], default=one_stage_default, space=one_stage_space)
@triton.jit(do_not_specialize=["R"])
def sum_group_heads_kernel(dout, dt, R, G: tl.constexpr, H: tl.constexpr, N: tl.constexpr,
                           BN: tl.constexpr, BR: tl.constexpr):
    """The backward, same grid: ``dt [R, G, N]`` = the sum (fp32, rounded once) of
    ``dout [R, H, N]`` over each group's heads."""
    i_r, i_g = tl.program_id(0), tl.program_id(1)
    o_r = i_r.to(tl.int64) * BR + tl.arange(0, BR)
    o_n = tl.arange(0, BN)
    m = (o_r < R)[:, None] & (o_n < N)[None, :]
    p_d = dout + o_r[:, None] * (H * N) + i_g * (H // G) * N + o_n[None, :]
    b_acc = tl.zeros([BR, BN], dtype=tl.float32)
    for i_j in range(H // G):
        b_acc += tl.load(p_d + i_j * N, mask=m, other=0.).to(tl.float32)
    tl.store(dt + o_r[:, None] * (G * N) + i_g * N + o_n[None, :],
             b_acc.to(dt.dtype.element_ty), mask=m)


def _group_heads(t: torch.Tensor, H: int) -> torch.Tensor:
    b, T, G, N = t.shape
    out = t.new_empty(b, T, H, N)
    R, BR = b * T, _rows_per_program(N)
    group_heads_kernel[(cdiv(R, BR), G)](t=t, out=out, R=R, G=G, H=H, N=N,
                                         BN=next_power_of_2(N), BR=BR)
    return out


def _sum_group_heads(dout: torch.Tensor, G: int) -> torch.Tensor:
    b, T, H, N = dout.shape
    dt = dout.new_empty(b, T, G, N)
    R, BR = b * T, _rows_per_program(N)
    sum_group_heads_kernel[(cdiv(R, BR), G)](dout=dout.contiguous(), dt=dt, R=R, G=G, H=H,
                                             N=N, BN=next_power_of_2(N), BR=BR)
    return dt


_group_op = stage_op("mamba2_group_heads", _group_heads, label="mamba2_group_heads",
                     ahead=False, schema="(Tensor t, int H) -> Tensor")
_sum_op = stage_op("mamba2_sum_group_heads", _sum_group_heads,
                   label="mamba2_sum_group_heads", ahead=False,
                   schema="(Tensor dout, int G) -> Tensor")


def _group_setup(ctx, inputs, output):
    ctx.G = inputs[0].shape[2]


def _group_backward(ctx, dout):
    return _sum_op(dout, ctx.G), None


_group_op.register_autograd(_group_backward, setup_context=_group_setup)


def heads_of_groups(t: torch.Tensor, H: int) -> torch.Tensor:
    """``[b, T, G, N]`` -> ``[b, T, H, N]``, head h reading group h // (H // G) (G divides
    H; the caller checked). Differentiable: a group's gradient sums its heads'. Returns
    ``t`` itself when G == H."""
    b, T, G, N = t.shape
    if G == H:
        return t
    if t.numel() == 0 or t.dtype == torch.float64 or select_backend(t) is Backend.TORCH:
        return t[:, :, :, None, :].expand(b, T, G, H // G, N).reshape(b, T, H, N)
    return _group_op(t.contiguous(), H)


# ---------------------------------------------------------------------------- dt ⊙ x
@tuned(key=["x", "P"], default=one_stage_default, space=one_stage_space)
@triton.jit(do_not_specialize=["R"])
def scaled_input_fwd_kernel(x, dt, v, R, P: tl.constexpr, BP: tl.constexpr,
                            BR: tl.constexpr):
    """Grid ``cdiv(R, BR)`` over R (token, head) rows: ``v [R, P] = dt[R] · x [R, P]``."""
    o_r, m_r, _, _, m, p = row_tile(tl.program_id(0), 0, R, P, BR, BP)
    b_dt = tl.load(dt + o_r, mask=m_r, other=0.)
    b_x = tl.load(x + p, mask=m, other=0.).to(tl.float32)
    tl.store(v + p, (b_x * b_dt[:, None]).to(v.dtype.element_ty), mask=m)


@tuned(key=["x", "P"], default=one_stage_default, space=one_stage_space)
@triton.jit(do_not_specialize=["R"])
def scaled_input_bwd_kernel(x, dt, dv, dx, ddt, R, P: tl.constexpr, BP: tl.constexpr,
                            BR: tl.constexpr):
    """Same grid: ``dx = dv · dt`` (x's dtype) and ``ddt = Σ_p dv · x`` (float32)."""
    o_r, m_r, _, _, m, p = row_tile(tl.program_id(0), 0, R, P, BR, BP)
    b_dt = tl.load(dt + o_r, mask=m_r, other=0.)
    b_dv = tl.load(dv + p, mask=m, other=0.).to(tl.float32)
    b_x = tl.load(x + p, mask=m, other=0.).to(tl.float32)
    tl.store(dx + p, (b_dv * b_dt[:, None]).to(dx.dtype.element_ty), mask=m)
    tl.store(ddt + o_r, tl.sum(b_dv * b_x, 1), mask=m_r)


def _scaled_input_fwd(x: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
    P = x.shape[-1]
    R, BR = x.numel() // P, _rows_per_program(P)
    v = torch.empty_like(x)
    scaled_input_fwd_kernel[(cdiv(R, BR),)](x=x, dt=dt, v=v, R=R, P=P,
                                            BP=next_power_of_2(P), BR=BR)
    return v


def _scaled_input_bwd(x: torch.Tensor, dt: torch.Tensor, dv: torch.Tensor):
    P = x.shape[-1]
    R, BR = x.numel() // P, _rows_per_program(P)
    dx = torch.empty_like(x)
    ddt = torch.empty_like(dt)
    scaled_input_bwd_kernel[(cdiv(R, BR),)](x=x, dt=dt, dv=dv.contiguous(), dx=dx, ddt=ddt,
                                            R=R, P=P, BP=next_power_of_2(P), BR=BR)
    return dx, ddt


_scaled_fwd_op = stage_op("mamba2_scaled_input_fwd", _scaled_input_fwd,
                          label="mamba2_scaled_input.fwd", ahead=False,
                          schema="(Tensor x, Tensor dt) -> Tensor")
_scaled_bwd_op = stage_op("mamba2_scaled_input_bwd", _scaled_input_bwd,
                          label="mamba2_scaled_input.bwd", ahead=False,
                          schema="(Tensor x, Tensor dt, Tensor dv) -> (Tensor, Tensor)")


def _scaled_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _scaled_backward(ctx, dv):
    x, dt = ctx.saved_tensors
    return _scaled_bwd_op(x, dt, dv)


_scaled_fwd_op.register_autograd(_scaled_backward, setup_context=_scaled_setup)


def scaled_input(x: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
    """``v = dt ⊙ x`` in x's dtype, computed in float32 and rounded once.

    Args:
        x: ``[b, T, H, P]``; dt: ``[b, T, H]`` float32 (the caller checked both).
    Returns:
        ``v [b, T, H, P]``, differentiable in x and dt.
    """
    if x.numel() == 0 or x.dtype == torch.float64 or select_backend(x) is Backend.TORCH:
        return torch.mul(x, dt[..., None]).to(x.dtype)
    return _scaled_fwd_op(x.contiguous(), dt.float().contiguous())
