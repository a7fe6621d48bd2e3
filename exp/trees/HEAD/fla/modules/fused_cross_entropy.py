"""Cross-entropy over given logits, with the log-sum-exp and the gradient in Triton.

    loss_i = (1 − ε)(lse_i − s z_{i,t_i}) + ε (lse_i − s mean_j z_ij),  lse_i = log Σ_j e^{s z_ij}

(s the logit scale, ε the label smoothing: torch's definition, (1 − ε) nll + ε times the
mean over classes of −log p). Rows whose target is ``ignore_index`` contribute 0 and are
left out of the mean's denominator.

Memory: the forward keeps a reference to the logits (no copy) and one fp32 lse per row;
the backward writes dlogits in a single pass over the logits. Computing dlogits in the
forward instead would hold a second [N, V] tensor from the forward to the backward (or
overwrite the caller's logits); recomputing softmax from the stored lse costs the same
two reads and one write in total and holds nothing extra.

The kernels run behind the custom ops ``fla::cross_entropy_fwd`` / ``_bwd``. The check
that every id lies in the vocabulary reads the ids' range on the host, before them: under
``torch.compile`` a graph break, after which the rest traces whole.

The input checks shared with :mod:`fla.modules.fused_linear_cross_entropy` live here.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from fla.modules.cross_entropy_kernels import cross_entropy_bwd, cross_entropy_fwd
from fla.utils.backend import use_triton
from fla.utils.custom_ops import stage_op
from fla.utils.validation import FLOAT_DTYPES, check_same_device, check_tensor

__all__ = ["FusedCrossEntropyLoss", "cross_entropy_loss", "check_loss_options",
           "check_target", "count_valid_targets", "REDUCTIONS"]

REDUCTIONS = ("mean", "sum", "none")


# ------------------------------------------------------------------------- input checks
def check_loss_options(reduction: str, label_smoothing: float, ignore_index: int,
                       logit_scale: float) -> tuple[str, float, int, float]:
    """Validate the loss options; returns them as (str, float, int, float)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of 'mean', 'sum', 'none', got "
                         f"{reduction!r}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
        raise TypeError(f"label_smoothing: expected a float in [0, 1), got "
                        f"{type(label_smoothing).__name__}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing: expected a float in [0, 1), got {label_smoothing}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index: expected an int, got {type(ignore_index).__name__}")
    if isinstance(logit_scale, bool) or not isinstance(logit_scale, (int, float)):
        raise TypeError(f"logit_scale: expected a float, got {type(logit_scale).__name__}")
    if not math.isfinite(logit_scale) or logit_scale == 0:
        raise ValueError(f"logit_scale: expected a finite non-zero number, got {logit_scale}")
    return reduction, float(label_smoothing), int(ignore_index), float(logit_scale)


def check_target(target: object, rows_name: str, rows_shape: tuple[int, ...]) -> torch.Tensor:
    """``target`` is an integer tensor of shape ``rows_shape`` (the leading dims of the
    logits or of x) or flat with as many entries; returns it flattened to ``[N]``."""
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target: expected a torch.Tensor of class ids, got "
                        f"{type(target).__name__}")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(f"target: expected an integer dtype (int64 or int32 class ids), got "
                        f"{str(target.dtype).replace('torch.', '')}")
    N = math.prod(rows_shape)
    if tuple(target.shape) != tuple(rows_shape) and tuple(target.shape) != (N,):
        raise ValueError(f"target: expected shape {tuple(rows_shape)} (the leading dims of "
                         f"{rows_name}) or ({N},), got {tuple(target.shape)}: {rows_name} "
                         f"has N = {N} rows, target has {target.numel()} ids")
    if N == 0:
        raise ValueError(f"{rows_name}: expected at least one row, got N = 0")
    target = target.reshape(-1)
    if target.dtype not in (torch.int32, torch.int64):
        target = target.to(torch.int64)
    return target


def count_valid_targets(target: torch.Tensor, V: int, ignore_index: int) -> int:
    """The number of rows not ignored; raises ValueError if any other id is outside [0, V).

    An id past the vocabulary would make the kernel read outside the row (on the GPU a
    device-side assert that leaves the CUDA context unusable), so this runs before any
    kernel. The minimum and maximum of the non-ignored ids and their count reach the
    host in one copy: a single synchronisation per call (needed anyway for the mean's
    denominator).
    """
    valid = target != ignore_index
    t64 = target.to(torch.int64)
    info = torch.iinfo(torch.int64)
    stats = torch.stack((torch.where(valid, t64, info.max).amin(),
                         torch.where(valid, t64, info.min).amax(),
                         valid.sum()))
    lo, hi, count = stats.tolist()
    if count and (lo < 0 or hi >= V):
        raise ValueError(
            f"target: class ids must lie in [0, V) = [0, {V}) or equal ignore_index = "
            f"{ignore_index}; got min {lo}, max {hi} over the other ids, for a "
            f"vocabulary of V = {V}")
    return int(count)


# ------------------------------------------------------------------------------ autograd
def _ce_fwd(logits: torch.Tensor, target: torch.Tensor, ignore_index: int,
            label_smoothing: float, logit_scale: float):
    """``(loss_rows [N], lse [N])`` fp32 over ``logits [N, V]`` (unit stride along V)."""
    N = logits.shape[0]
    loss_rows = torch.empty(N, dtype=torch.float32, device=logits.device)
    lse = torch.empty(N, dtype=torch.float32, device=logits.device)
    cross_entropy_fwd(logits, target, loss_rows, lse, ignore_index=ignore_index,
                      label_smoothing=label_smoothing, logit_scale=logit_scale)
    return loss_rows, lse


def _ce_bwd(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
            grad_rows: torch.Tensor, ignore_index: int, label_smoothing: float,
            logit_scale: float) -> torch.Tensor:
    """dlogits in the logits' dtype from the gradient of each row's loss (``[N]``, any
    stride: the gradient of a sum is one value expanded with stride 0)."""
    dlogits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    cross_entropy_bwd(logits, target, lse, grad_rows.reshape(-1), dlogits,
                      ignore_index=ignore_index, label_smoothing=label_smoothing,
                      logit_scale=logit_scale, grad_scale=logit_scale)
    return dlogits


# The kernels as the custom ops fla::cross_entropy_fwd / _bwd (one node each under
# torch.compile; their fakes are the launchers with the launches skipped), joined by the
# autograd formula below. They work on per-row losses: the reduction (and the mean's
# count) is left to PyTorch ops around them, so that no host number enters the graph.
_ce_fwd_op = stage_op(
    "cross_entropy_fwd", _ce_fwd, label="cross_entropy.fwd",
    schema="(Tensor logits, Tensor target, int ignore_index, float label_smoothing, "
           "float logit_scale) -> (Tensor, Tensor)", ahead=False)
_ce_bwd_op = stage_op(
    "cross_entropy_bwd", _ce_bwd, label="cross_entropy.bwd",
    schema="(Tensor logits, Tensor target, Tensor lse, Tensor grad_rows, int ignore_index, "
           "float label_smoothing, float logit_scale) -> Tensor", ahead=False)


def _setup_context(ctx, inputs, output):
    logits, target, ignore_index, label_smoothing, logit_scale = inputs
    ctx.save_for_backward(logits, target, output[1])
    ctx.options = (ignore_index, label_smoothing, logit_scale)
    # lse is an output only for the backward: no zeros for its gradient.
    ctx.set_materialize_grads(False)


def _backward_formula(ctx, grad_rows, _dlse):
    logits, target, lse = ctx.saved_tensors
    return (_ce_bwd_op(logits, target, lse, grad_rows, *ctx.options),
            None, None, None, None)


_ce_fwd_op.register_autograd(_backward_formula, setup_context=_setup_context)


def _cross_entropy_triton(logits, target, ignore_index, label_smoothing, logit_scale,
                          reduction, shape):
    """The Triton path on checked ``logits [N, V]`` and ``target [N]`` (ids in range):
    fla::cross_entropy_fwd, then the reduction. Reads nothing on the host, so that it
    traces whole under torch.compile."""
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    loss_rows, _ = _ce_fwd_op(logits, target.contiguous(), ignore_index, label_smoothing,
                              logit_scale)
    if reduction == "none":
        return loss_rows.view(shape)
    total = loss_rows.sum()
    if reduction == "sum":
        return total
    # Over the rows not ignored, counted on the device. No row: 0/0 = nan, as torch's
    # cross_entropy gives; the gradient stays 0 (every row ignored writes zeros).
    return total / (target != ignore_index).sum()


def _cross_entropy_torch(logits, target, ignore_index, label_smoothing, logit_scale,
                         reduction, shape):
    z = logits.float()
    if logit_scale != 1.0:
        z = z * logit_scale
    loss = F.cross_entropy(z, target.long(), ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
    return loss.view(shape) if reduction == "none" else loss


# -------------------------------------------------------------------------------- public
def cross_entropy_loss(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    logit_scale: float = 1.0,
) -> torch.Tensor:
    """Cross-entropy of ``logits`` against class ids ``target``.

    Args:
        logits: ``[N, V]`` (or ``[..., V]``) fp32/fp16/bf16; any V (up to 256k and more).
        target: ``[N]`` (or the leading dims of ``logits``), int32/int64, each id in
            [0, V) or equal to ``ignore_index`` (checked: anything else raises ValueError).
        ignore_index: rows with this target contribute 0 to the loss and the gradient and
            are left out of the mean's denominator.
        reduction: ``'mean'`` (over non-ignored rows; all rows ignored gives nan, as
            ``torch.nn.functional.cross_entropy``, with zero gradient), ``'sum'`` or
            ``'none'`` (a loss per row, shaped like ``target``; ignored rows 0).
        label_smoothing: ε in [0, 1): the loss is (1 − ε)·nll + ε·mean_j(−log p_j).
        logit_scale: s, the logits are multiplied by s before the softmax.

    Returns:
        The loss in float32 (a scalar, or ``target``'s shape for ``'none'``). Gradient:
        ``d loss / d z = s · (softmax(s z) − (1 − ε) onehot(t) − ε / V)``, over the count
        for the mean, in the dtype of ``logits``.

    On CUDA tensors the Triton kernels run (fp32 log-sum-exp, online over blocks of V);
    on CPU tensors the PyTorch path (``F.cross_entropy`` on fp32 logits), unless
    ``TRITON_INTERPRET=1``.
    """
    reduction, label_smoothing, ignore_index, logit_scale = check_loss_options(
        reduction, label_smoothing, ignore_index, logit_scale)
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES)
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits: expected shape [N, V] with V >= 1, got "
                         f"{tuple(logits.shape)}")
    rows_shape = tuple(logits.shape[:-1])
    target = check_target(target, "logits", rows_shape)
    check_same_device(logits=logits, target=target)
    V = logits.shape[-1]
    logits = logits.reshape(-1, V)
    # Ids outside the vocabulary would make the kernels read outside a row: a host read
    # of the ids' range, before anything runs (under torch.compile a graph break).
    count_valid_targets(target, V, ignore_index)

    if not use_triton(logits, target):
        return _cross_entropy_torch(logits, target, ignore_index, label_smoothing,
                                    logit_scale, reduction, rows_shape)
    return _cross_entropy_triton(logits, target, ignore_index, label_smoothing, logit_scale,
                                 reduction, rows_shape)


class FusedCrossEntropyLoss(nn.Module):
    """``nn.CrossEntropyLoss`` on class ids, with the log-sum-exp and the gradient
    computed by Triton kernels (see :func:`cross_entropy_loss`).

    ``forward(logits [N, V], target [N]) -> loss`` (float32).
    """

    def __init__(self, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, logit_scale: float = 1.0):
        super().__init__()
        (self.reduction, self.label_smoothing, self.ignore_index,
         self.logit_scale) = check_loss_options(reduction, label_smoothing, ignore_index,
                                                logit_scale)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cross_entropy_loss(logits, target, ignore_index=self.ignore_index,
                                  reduction=self.reduction,
                                  label_smoothing=self.label_smoothing,
                                  logit_scale=self.logit_scale)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, logit_scale={self.logit_scale}")
