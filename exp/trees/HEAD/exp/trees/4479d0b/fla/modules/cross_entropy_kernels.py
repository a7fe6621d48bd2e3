"""Row kernels of the fused cross-entropy losses (fused_cross_entropy.py and
fused_linear_cross_entropy.py).

One program per row of logits z (length V; a row is long, thousands to 256k classes, so
one row keeps a program busy and the grid has N programs). With s the logit scale, ε the
label smoothing and t the row's target:

    lse  = log Σ_j exp(s z_j)                  (fp32, online max/sum over blocks of BV)
    loss = (1 − ε)(lse − s z_t) + ε (lse − s mean_j z_j)
    dz_j = c · s · (softmax(s z)_j − (1 − ε) [j = t] − ε / V)

A row whose target is ``ignore_index`` has loss 0 and dz = 0. ``cross_entropy_fwd`` makes
one pass over the row for the loss and, when asked, a second that overwrites the row
with dz (the linear loss then needs no second logits buffer); ``cross_entropy_bwd`` makes
one pass that writes dz from the stored lse, with c read per row (reduction 'none') or
once (a scalar grad_output).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fla.utils.grid import next_power_of_2
from fla.utils.tuning import Config, tuned

__all__ = ["cross_entropy_fwd", "cross_entropy_bwd", "cross_entropy_fwd_kernel",
           "cross_entropy_bwd_kernel"]


def _block_v(V: int, dtype: torch.dtype) -> int:
    # 8 KiB of logits per block and loop step (4096 16-bit or 2048 fp32 values): with 8
    # warps that is 32 bytes per thread, two 16-byte vector loads in flight per step,
    # which keeps an H100's HBM busy with a few rows resident per SM; larger blocks
    # only add registers. A short row takes one block (a power of two >= V).
    cap = 2048 if dtype == torch.float32 else 4096
    return max(16, min(cap, next_power_of_2(V)))


def _default(args) -> Config:
    BV = _block_v(args["V"], args["logits"].dtype)
    return Config(BV=BV, num_warps=8 if BV >= 2048 else 4, num_stages=2)


def _space(args) -> list[Config]:
    full = next_power_of_2(args["V"])
    widths = sorted({max(16, min(full, bv)) for bv in (1024, 2048, 4096, 8192, 16384)})
    return [Config(BV=bv, num_warps=w, num_stages=2) for bv in widths for w in (4, 8, 16)]


@triton.jit
def _row_lse(p_z, V, logit_scale, BV: tl.constexpr, SMOOTH: tl.constexpr):
    """(lse, Σ_j s z_j) of one row, in fp32; the sum only when SMOOTH (else 0)."""
    o_v = tl.arange(0, BV)
    m_v = o_v < V
    b_z = tl.load(p_z + o_v, mask=m_v, other=0.).to(tl.float32) * logit_scale
    # Masked lanes become -inf after scaling (a negative scale would flip a -inf fill).
    b_z = tl.where(m_v, b_z, float("-inf"))
    b_m = tl.max(b_z, 0)
    # A block of -inf logits (a masked vocabulary) has max -inf: shifting by 0 instead
    # keeps exp(-inf - -inf) = nan out of the sum.
    b_shift = tl.where(b_m == float("-inf"), 0., b_m)
    b_s = tl.sum(tl.exp(b_z - b_shift), 0)
    b_sum = 0.
    if SMOOTH:
        b_sum = tl.sum(tl.where(m_v, b_z, 0.), 0)
    for i_v in range(1, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        b_z = tl.load(p_z + o_v, mask=m_v, other=0.).to(tl.float32) * logit_scale
        b_z = tl.where(m_v, b_z, float("-inf"))
        b_new = tl.maximum(b_m, tl.max(b_z, 0))
        b_shift = tl.where(b_new == float("-inf"), 0., b_new)
        # One exp per logit: the running sum is rescaled once per block, not per lane.
        b_s = b_s * tl.exp(b_m - b_shift) + tl.sum(tl.exp(b_z - b_shift), 0)
        b_m = b_new
        if SMOOTH:
            b_sum += tl.sum(tl.where(m_v, b_z, 0.), 0)
    return b_m + tl.log(b_s), b_sum


@triton.jit
def _store_row_grad(p_z, p_dz, i_t, b_lse, b_c, V, label_smoothing, logit_scale,
                    BV: tl.constexpr, SMOOTH: tl.constexpr):
    """dz = b_c (softmax − smoothed one-hot); b_c already holds the logit scale. p_dz may
    equal p_z: each element is read before it is overwritten, by the same thread."""
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        b_z = tl.load(p_z + o_v, mask=m_v, other=0.).to(tl.float32)
        b_p = tl.exp(b_z * logit_scale - b_lse)
        if SMOOTH:
            b_d = b_p - label_smoothing / V - tl.where(o_v == i_t, 1. - label_smoothing, 0.)
        else:
            b_d = b_p - tl.where(o_v == i_t, 1., 0.)
        tl.store(p_dz + o_v, (b_d * b_c).to(p_dz.dtype.element_ty), mask=m_v)


@triton.jit
def _store_row_zeros(p_dz, V, BV: tl.constexpr):
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        tl.store(p_dz + o_v, tl.zeros([BV], dtype=tl.float32).to(p_dz.dtype.element_ty),
                 mask=o_v < V)


@tuned(key=["logits", "V", "SMOOTH", "WRITE_GRAD"], default=_default, space=_space,
       restore=["logits"])
@triton.jit
def cross_entropy_fwd_kernel(
    logits, stride_z, target, loss, lse, V, ignore_index, label_smoothing, logit_scale,
    grad_scale, BV: tl.constexpr, SMOOTH: tl.constexpr, WRITE_GRAD: tl.constexpr,
):
    """One program per row: loss and lse; with WRITE_GRAD, the row becomes
    grad_scale · (softmax − smoothed one-hot) in place (a second pass over it)."""
    # int64 row offset: N·V exceeds 2³¹ elements at LM sizes (16384 × 128256).
    i_n = tl.program_id(0).to(tl.int64)
    p_z = logits + i_n * stride_z
    i_t = tl.load(target + i_n).to(tl.int64)
    if i_t == ignore_index:
        tl.store(loss + i_n, 0.)
        tl.store(lse + i_n, 0.)
        if WRITE_GRAD:
            _store_row_zeros(p_z, V, BV)
    else:
        b_lse, b_sum = _row_lse(p_z, V, logit_scale, BV, SMOOTH)
        b_loss = b_lse - tl.load(p_z + i_t).to(tl.float32) * logit_scale
        if SMOOTH:
            b_loss = (1. - label_smoothing) * b_loss + label_smoothing * (b_lse - b_sum / V)
        tl.store(loss + i_n, b_loss)
        tl.store(lse + i_n, b_lse)
        if WRITE_GRAD:
            _store_row_grad(p_z, p_z, i_t, b_lse, grad_scale, V, label_smoothing,
                            logit_scale, BV, SMOOTH)


@tuned(key=["logits", "dlogits", "V", "SMOOTH"], default=_default, space=_space)
@triton.jit
def cross_entropy_bwd_kernel(
    logits, stride_z, dlogits, stride_dz, target, lse, grad_loss, stride_g, V,
    ignore_index, label_smoothing, logit_scale, grad_scale,
    BV: tl.constexpr, SMOOTH: tl.constexpr,
):
    """One program per row: dz = grad_loss[row·stride_g] · grad_scale · (softmax −
    smoothed one-hot), from the forward's lse (dlogits may be logits itself)."""
    i_n = tl.program_id(0).to(tl.int64)
    p_dz = dlogits + i_n * stride_dz
    i_t = tl.load(target + i_n).to(tl.int64)
    if i_t == ignore_index:
        _store_row_zeros(p_dz, V, BV)
    else:
        b_c = tl.load(grad_loss + i_n * stride_g).to(tl.float32) * grad_scale
        _store_row_grad(logits + i_n * stride_z, p_dz, i_t, tl.load(lse + i_n), b_c, V,
                        label_smoothing, logit_scale, BV, SMOOTH)


def _rows(name: str, x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{name}: expected a 2-D tensor with unit stride along V, got shape "
                         f"{tuple(x.shape)} and strides {tuple(x.stride())}")
    return x


def cross_entropy_fwd(
    logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor, lse: torch.Tensor, *,
    ignore_index: int, label_smoothing: float, logit_scale: float,
    grad_scale: float | None = None,
) -> None:
    """Per-row loss and log-sum-exp; optionally the gradient in place of the logits.

    Args:
        logits: ``[n, V]`` fp32/fp16/bf16, unit stride along V (any row stride).
        target: ``[n]`` int32/int64, each in [0, V) or ``ignore_index`` (checked by the
            caller: the kernel does not bound-check the target load).
        loss, lse: ``[n]`` fp32, written (0 on ignored rows).
        grad_scale: None, or c: then ``logits`` is overwritten with
            ``c · (softmax(s z) − (1 − ε) onehot(t) − ε / V)`` (0 on ignored rows); the
            caller folds the logit scale s into c (d loss / d z carries a factor s).
    """
    n, V = _rows("logits", logits).shape
    if n == 0:
        return
    write_grad = grad_scale is not None
    cross_entropy_fwd_kernel[(n,)](
        logits=logits, stride_z=logits.stride(0), target=target, loss=loss, lse=lse, V=V,
        ignore_index=int(ignore_index), label_smoothing=float(label_smoothing),
        logit_scale=float(logit_scale),
        grad_scale=float(grad_scale) if write_grad else 0.,
        SMOOTH=label_smoothing > 0, WRITE_GRAD=write_grad,
    )


def cross_entropy_bwd(
    logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, grad_loss: torch.Tensor,
    dlogits: torch.Tensor, *, ignore_index: int, label_smoothing: float, logit_scale: float,
    grad_scale: float,
) -> None:
    """``dlogits = grad_loss · grad_scale · (softmax(s z) − (1 − ε) onehot(t) − ε / V)``.

    Args:
        logits, dlogits: ``[n, V]``, unit stride along V; ``dlogits`` may be ``logits``
            (each row is read, then overwritten).
        target: ``[n]``; lse: ``[n]`` fp32 from :func:`cross_entropy_fwd`.
        grad_loss: ``[n]`` (one factor per row) or a one-element tensor (shared).
        grad_scale: a host factor on top: s, times 1/count for the mean.
    """
    n, V = _rows("logits", logits).shape
    _rows("dlogits", dlogits)
    if n == 0:
        return
    per_row = grad_loss.numel() != 1
    cross_entropy_bwd_kernel[(n,)](
        logits=logits, stride_z=logits.stride(0), dlogits=dlogits,
        stride_dz=dlogits.stride(0), target=target, lse=lse, grad_loss=grad_loss,
        stride_g=grad_loss.stride(0) if per_row else 0, V=V,
        ignore_index=int(ignore_index), label_smoothing=float(label_smoothing),
        logit_scale=float(logit_scale), grad_scale=float(grad_scale),
        SMOOTH=label_smoothing > 0,
    )
