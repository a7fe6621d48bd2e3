"""Cross-entropy of a linear layer's output (an LM head) without its [N, V] logits.

    z = s (x Wᵀ + b),   loss = CE(z, target)     (x [N, H], W [V, H], b [V])

The rows are processed in chunks. Per chunk c, in the forward:

    z_c  = x_c Wᵀ (+ b)              torch matmul in the input dtype, into one reused buffer
    kernel: loss rows, then z_c ← s (softmax(s z_c) − (1 − ε) onehot − ε / V)   (in place)
    dx_c = z_c W                     written into dx's rows
    dW  += z_cᵀ x_c,  db += Σ_rows z_c   (fp32 accumulators when there are several chunks)

so the gradients exist when the forward returns; the backward only multiplies them by
grad_output (and by 1/count for the mean: folded there, not into z_c, because 16-bit
values of (p − y)/count underflow fp16 at real token counts). The three big matmuls
dominate the time; the kernel reads each logits row twice and writes it once.

Reduction 'none' needs a per-row grad_output, unknown in the forward: there the forward
computes losses only (keeping an fp32 lse per row) and the backward recomputes each
chunk's logits (one extra matmul) to build the gradients.

Both passes run behind the custom ops ``fla::linear_cross_entropy_fwd`` / ``_bwd``; as
for :mod:`fla.modules.fused_cross_entropy`, the ids' range check before them is a graph
break under ``torch.compile``.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from fla.modules.cross_entropy_kernels import cross_entropy_bwd, cross_entropy_fwd
from fla.modules.fused_cross_entropy import (
    check_loss_options,
    check_target,
    count_valid_targets,
)
from fla.utils.backend import use_triton
from fla.utils.custom_ops import present, stage_op
from fla.utils.validation import FLOAT_DTYPES, check_same_device, check_tensor

__all__ = ["FusedLinearCrossEntropyLoss", "fused_linear_cross_entropy", "chunk_rows",
           "CHUNK_LOGITS_BYTES"]

# The logits of one chunk take at most about this much memory: 1 GiB is 4096 rows at
# V = 128256 in bf16 (4 chunks for 16384 tokens). Fewer, larger chunks cost memory;
# more, smaller ones cost time, since every chunk re-reads and re-writes the whole
# [V, H] dW accumulator (2 GiB in fp32 at that size).
CHUNK_LOGITS_BYTES = 1 << 30


def chunk_rows(N: int, V: int, itemsize: int, num_chunks: int | None = None) -> int:
    """Rows per chunk: ``ceil(N / num_chunks)`` when given; otherwise chunks of at most
    about :data:`CHUNK_LOGITS_BYTES` of logits, balanced (equal sizes) and rounded up to
    a multiple of 64 rows for the matmul tiles. Never depends on anything but sizes."""
    if num_chunks is None:
        num_chunks = max(1, math.ceil(N * V * itemsize / CHUNK_LOGITS_BYTES))
    rows = math.ceil(N / max(1, min(num_chunks, N)))
    if num_chunks > 1 and rows > 64:
        rows = min(N, math.ceil(rows / 64) * 64)
    return max(1, rows)


# ------------------------------------------------------------------- fp32 dW accumulation
_ADDMM_FP32_OK: dict[torch.device, bool] = {}


def _addmm_fp32_supported(device: torch.device) -> bool:
    """Whether ``torch.mm``/``torch.addmm(..., out_dtype=torch.float32)`` take 16-bit
    operands here (CUDA, recent torch): the GEMM then adds into the fp32 accumulator
    itself, with no 16-bit temporary. Probed once per device on tiny tensors; CPU builds
    have no such kernel."""
    if device.type != "cuda":
        return False
    ok = _ADDMM_FP32_OK.get(device)
    if ok is None:
        try:
            a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
            acc = torch.mm(a, a, out_dtype=torch.float32)
            torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
            ok = acc.dtype == torch.float32 and bool((acc == 4).all())
        except (TypeError, RuntimeError, NotImplementedError):
            ok = False
        _ADDMM_FP32_OK[device] = ok
    return ok


class _Accumulator:
    """Σ over chunks of ``aᵀ b`` (``b`` None: column sums of ``a``), in fp32 when there
    are several chunks (or fp16 inputs, whose range the unscaled sum can exceed), else
    straight in the input dtype (one product, fp32 inside the GEMM)."""

    def __init__(self, dtype: torch.dtype, chunks: int):
        self.fp32 = chunks > 1 or dtype == torch.float16
        self.value: torch.Tensor | None = None

    def add(self, a: torch.Tensor, b: torch.Tensor | None) -> None:
        if b is None:
            part = a.sum(0, dtype=torch.float32 if self.fp32 else a.dtype)
            self.value = part if self.value is None else self.value.add_(part)
            return
        a = a.t()
        if not self.fp32 or a.dtype == torch.float32:
            if self.value is None:
                self.value = torch.mm(a, b)
            else:
                self.value.addmm_(a, b)
        # Not in the op's fake implementation (torch.compile tracing): torch's meta kernel
        # of mm(out_dtype=) fails on FakeTensors (torch 2.11), and a fake probe would cache
        # False. The fallback's fp32 result has the same shape.
        elif not is_fake(a) and _addmm_fp32_supported(a.device):
            if self.value is None:
                self.value = torch.mm(a, b, out_dtype=torch.float32)
            else:
                torch.addmm(self.value, a, b, out_dtype=torch.float32, out=self.value)
        else:
            # A 16-bit product per chunk, added in fp32 (one [V, H] temporary).
            part = torch.mm(a, b)
            if self.value is None:
                self.value = part.float()
            else:
                self.value.add_(part)


# ------------------------------------------------------------------------------ chunks
def _chunk_logits(x_c, weight, bias, out):
    if bias is None:
        return torch.mm(x_c, weight.t(), out=out)
    return torch.addmm(bias, x_c, weight.t(), out=out)


def _chunked_pass(x, target, weight, bias, rows, options, *, lse=None, grad_rows=None,
                  grad_scale=None, need=(True, True, True)):
    """One pass over row chunks. Without ``lse``: the forward (losses and lse; with
    ``grad_scale`` also the gradients, unscaled by grad_output). With ``lse``: the
    'none' backward (gradients weighted by ``grad_rows``). Returns
    (loss_rows, lse, dx, dW accumulator, db accumulator)."""
    ignore_index, label_smoothing, logit_scale = options
    N, V = x.shape[0], weight.shape[0]
    need_dx, need_dw, need_db = need
    with_grad = grad_scale is not None
    chunks = math.ceil(N / rows)
    buf = torch.empty(min(rows, N), V, dtype=x.dtype, device=x.device)
    loss_rows = lse_out = None
    if lse is None:
        loss_rows = torch.empty(N, dtype=torch.float32, device=x.device)
        lse_out = torch.empty(N, dtype=torch.float32, device=x.device)
    dx = torch.empty_like(x) if with_grad and need_dx else None
    dW = _Accumulator(x.dtype, chunks) if with_grad and need_dw else None
    db = _Accumulator(x.dtype, chunks) if with_grad and need_db else None
    for start in range(0, N, rows):
        end = min(start + rows, N)
        x_c, t_c = x[start:end], target[start:end]
        z_c = _chunk_logits(x_c, weight, bias, buf[:end - start])
        if lse is None:
            cross_entropy_fwd(z_c, t_c, loss_rows[start:end], lse_out[start:end],
                              ignore_index=ignore_index, label_smoothing=label_smoothing,
                              logit_scale=logit_scale, grad_scale=grad_scale)
        else:
            cross_entropy_bwd(z_c, t_c, lse[start:end], grad_rows[start:end], z_c,
                              ignore_index=ignore_index, label_smoothing=label_smoothing,
                              logit_scale=logit_scale, grad_scale=grad_scale)
        if not with_grad:
            continue
        # z_c now holds d loss / d z for the chunk.
        if dx is not None:
            torch.mm(z_c, weight, out=dx[start:end])
        if dW is not None:
            dW.add(z_c, x_c)
        if db is not None:
            db.add(z_c, None)
    return loss_rows, lse_out, dx, dW, db


def _finish(acc: _Accumulator | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Cast an accumulator to the parameter's dtype now, except fp16's (kept in fp32
    until the backward knows grad_output: the unscaled sum can overflow fp16)."""
    if acc is None:
        return None
    if dtype == torch.float16:
        return acc.value
    return acc.value.to(dtype)


def _lce_fwd(x, target, weight, bias, count, ignore_index, label_smoothing, logit_scale,
             reduction, rows, need_dx, need_dw, need_db):
    """The forward pass. Returns ``(loss, lse, dx, dW, db)``: for 'none' the per-row losses
    and their lse (for the backward's recomputation), no gradient; otherwise the loss
    summed (over ``count``, a device scalar, for the mean) and the gradients asked for,
    unscaled by grad_output (None where not asked)."""
    options = (ignore_index, label_smoothing, logit_scale)
    need = (need_dx, need_dw, need_db)
    if reduction == "none" or not any(need):
        loss_rows, lse, *_ = _chunked_pass(x, target, weight, bias, rows, options)
        dx = dW = db = None
    else:
        loss_rows, lse, dx, dW, db = _chunked_pass(x, target, weight, bias, rows, options,
                                                   grad_scale=logit_scale, need=need)
    if reduction == "none":
        return loss_rows, lse, None, None, None
    total = loss_rows.sum()
    # count == 0 under 'mean' gives 0/0 = nan, as torch's cross_entropy does.
    loss = total / count if reduction == "mean" else total
    return loss, lse, dx, _finish(dW, weight.dtype), _finish(db, weight.dtype)


def _lce_bwd(x, target, weight, bias, lse, grad_rows, ignore_index, label_smoothing,
             logit_scale, rows, need_dx, need_dw, need_db):
    """The 'none' backward: each chunk's logits recomputed, the gradients weighted by
    ``grad_rows [N]``. Returns ``(dx, dW, db)`` in the inputs' dtypes (None where not
    asked)."""
    _, _, dx, dW, db = _chunked_pass(
        x, target, weight, bias, rows, (ignore_index, label_smoothing, logit_scale),
        lse=lse, grad_rows=grad_rows.reshape(-1), grad_scale=logit_scale,
        need=(need_dx, need_dw, need_db))
    # grad_output is already inside these sums: cast them straight away.
    return (dx, None if dW is None else dW.value.to(weight.dtype),
            None if db is None else db.value.to(weight.dtype))


# The chunked passes as the custom ops fla::linear_cross_entropy_fwd / _bwd (one node each
# under torch.compile; their fakes are the passes with the kernel launches skipped),
# joined by the autograd formula below.
_OPTIONS = "int ignore_index, float label_smoothing, float logit_scale"
_lce_fwd_op = stage_op(
    "linear_cross_entropy_fwd", _lce_fwd, label="linear_cross_entropy.fwd",
    schema=f"(Tensor x, Tensor target, Tensor weight, Tensor? bias, Tensor count, {_OPTIONS}, "
           "str reduction, int rows, bool need_dx, bool need_dw, bool need_db) "
           "-> (Tensor, Tensor, Tensor, Tensor, Tensor)", ahead=False)
_lce_bwd_op = stage_op(
    "linear_cross_entropy_bwd", _lce_bwd, label="linear_cross_entropy.bwd",
    schema=f"(Tensor x, Tensor target, Tensor weight, Tensor? bias, Tensor lse, "
           f"Tensor grad_rows, {_OPTIONS}, int rows, bool need_dx, bool need_dw, "
           "bool need_db) -> (Tensor, Tensor, Tensor)", ahead=False)


def _setup_context(ctx, inputs, output):
    (x, target, weight, bias, count, ignore_index, label_smoothing, logit_scale, reduction,
     rows, *need) = inputs
    _, lse, dx, dW, db = output
    ctx.meta = ((ignore_index, label_smoothing, logit_scale), reduction, rows, need,
                x.dtype)
    if reduction == "none":
        ctx.save_for_backward(x, target, weight, bias, lse)
    else:
        ctx.save_for_backward(count)
        # Handed out once, not saved: the backward scales these buffers in place and
        # AccumulateGrad may take them over (no second [V, H] tensor). Detached: an
        # output held by its own node's ctx would be a reference cycle through C++ that
        # no collector sees, leaking them if no backward runs.
        ctx.grads = [t.detach() if wanted else None for t, wanted in zip((dx, dW, db), need)]
    # Only the loss carries a gradient: no zeros for the other outputs'.
    ctx.set_materialize_grads(False)


def _scaled(g: torch.Tensor | None, c: torch.Tensor, dtype: torch.dtype):
    if g is None:
        return None
    # In place, on buffers only this op's forward made: no second [V, H] tensor.
    g.mul_(c)
    return g if g.dtype == dtype else g.to(dtype)


def _backward_formula(ctx, grad, _dlse, _ddx, _ddw, _ddb):
    options, reduction, rows, need, dtype = ctx.meta
    rest = (None,) * 9  # count, the options, reduction, rows and the flags
    if grad is None:
        return (None,) * 4 + rest
    if reduction == "none":
        x, target, weight, bias, lse = ctx.saved_tensors
        dx, dW, db = _lce_bwd_op(x, target, weight, bias, lse, grad, *options, rows, *need)
        return present(dx, need[0]), None, present(dW, need[1]), present(db, need[2]), *rest
    if ctx.grads is None:
        raise RuntimeError(
            "FusedLinearCrossEntropyLoss: backward ran twice through one forward. The "
            "gradients are computed in the forward and handed out once (no second "
            "[V, H] copy is kept); run the forward again instead of retain_graph=True")
    (count,) = ctx.saved_tensors
    dx, dW, db = ctx.grads
    ctx.grads = None   # AccumulateGrad may take these buffers over: drop our references
    c = grad.to(torch.float32)
    if reduction == "mean":
        # No row counted: zero gradients (the loss is nan, as torch's).
        c = torch.where(count > 0, c / count.clamp(min=1), 0.0)
    return _scaled(dx, c, dtype), None, _scaled(dW, c, dtype), _scaled(db, c, dtype), *rest


_lce_fwd_op.register_autograd(_backward_formula, setup_context=_setup_context)


def _linear_cross_entropy_torch(x, target, weight, bias, options, reduction, shape):
    ignore_index, label_smoothing, logit_scale = options
    z = F.linear(x, weight, bias).float()
    if logit_scale != 1.0:
        z = z * logit_scale
    loss = F.cross_entropy(z, target.long(), ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
    return loss.view(shape) if reduction == "none" else loss


def _linear_cross_entropy_triton(x, target, weight, bias, options, reduction, shape,
                                 num_chunks):
    """The Triton path on checked ``x [N, H]``, ``target [N]`` (ids in range), ``weight
    [V, H]``: fla::linear_cross_entropy_fwd. Reads nothing on the host, so that it traces
    whole under torch.compile."""
    target = target.contiguous()
    rows = chunk_rows(x.shape[0], weight.shape[0], x.element_size(), num_chunks)
    grads = torch.is_grad_enabled()
    need = [grads and t is not None and t.requires_grad for t in (x, weight, bias)]
    # The mean's denominator, counted on the device.
    count = (target != options[0]).sum()
    loss = _lce_fwd_op(x, target, weight, bias, count, *options, reduction, rows, *need)[0]
    return loss.view(shape) if reduction == "none" else loss


# -------------------------------------------------------------------------------- public
def _check_inputs(x, target, weight, bias):
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 2:
        raise ValueError(f"x: expected shape [N, H] or [..., H], got {tuple(x.shape)}")
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, ndim=2)
    H = x.shape[-1]
    if weight.shape[1] != H:
        raise ValueError(f"weight: expected shape [V, H] with H = {H} (the hidden size of "
                         f"x {tuple(x.shape)}), got {tuple(weight.shape)}: hidden size "
                         f"{weight.shape[1]} != {H}")
    V = weight.shape[0]
    if V < 1 or H < 1:
        raise ValueError(f"weight: expected V >= 1 and H >= 1, got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight: expected the dtype of x "
                        f"({str(x.dtype).replace('torch.', '')}), got "
                        f"{str(weight.dtype).replace('torch.', '')}")
    if bias is not None:
        check_tensor("bias", bias, dtypes=FLOAT_DTYPES)
        if tuple(bias.shape) != (V,):
            raise ValueError(f"bias: expected shape ({V},) = [V] (V from weight "
                             f"{tuple(weight.shape)}), got {tuple(bias.shape)}")
        if bias.dtype != x.dtype:
            raise TypeError(f"bias: expected the dtype of x "
                            f"({str(x.dtype).replace('torch.', '')}), got "
                            f"{str(bias.dtype).replace('torch.', '')}")
    rows_shape = tuple(x.shape[:-1])
    target = check_target(target, "x", rows_shape)
    check_same_device(x=x, target=target, weight=weight, bias=bias)
    return target, rows_shape, V, H


def fused_linear_cross_entropy(
    x: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    logit_scale: float = 1.0,
    num_chunks: int | None = None,
) -> torch.Tensor:
    """``cross_entropy(logit_scale · (x Wᵀ + b), target)`` without the [N, V] logits.

    Args:
        x: ``[N, H]`` or ``[..., H]`` (flattened to rows) fp32/fp16/bf16.
        target: ``[N]`` or x's leading dims, int32/int64 ids in [0, V) or
            ``ignore_index`` (checked: anything else raises ValueError).
        weight: ``[V, H]``, x's dtype. bias: ``[V]`` or None.
        ignore_index, reduction, label_smoothing, logit_scale: as in
            :func:`fla.modules.fused_cross_entropy.cross_entropy_loss` ('mean' over no
            row gives nan with zero gradients, like torch).
        num_chunks: the number of row chunks (None: chunks of about
            :data:`CHUNK_LOGITS_BYTES` of logits, see :func:`chunk_rows`).

    Returns:
        The float32 loss (a scalar, or x's leading shape for ``'none'``). Gradients
        reach x, weight and bias (those that require grad) in their dtype.

    On CUDA (Triton kernels) the peak extra memory is one chunk of logits, dx, and for
    several chunks an fp32 [V, H] accumulator for dW; the gradients are computed in the
    forward (reductions 'mean'/'sum'), so backward may run once per forward. On CPU
    tensors (without ``TRITON_INTERPRET=1``) the PyTorch path builds the full logits.
    """
    reduction, label_smoothing, ignore_index, logit_scale = check_loss_options(
        reduction, label_smoothing, ignore_index, logit_scale)
    if num_chunks is not None and (isinstance(num_chunks, bool)
                                   or not isinstance(num_chunks, int) or num_chunks < 1):
        raise ValueError(f"num_chunks: expected None or an int >= 1, got {num_chunks!r}")
    target, rows_shape, V, H = _check_inputs(x, target, weight, bias)
    # Ids outside the vocabulary would make the kernel read outside a row: a host read of
    # the ids' range, before anything runs (under torch.compile a graph break).
    count_valid_targets(target, V, ignore_index)
    x = x.reshape(-1, H)
    options = (ignore_index, label_smoothing, logit_scale)

    if not use_triton(x, target, weight, bias):
        return _linear_cross_entropy_torch(x, target, weight, bias, options, reduction,
                                           rows_shape)
    return _linear_cross_entropy_triton(x, target, weight, bias, options, reduction,
                                        rows_shape, num_chunks)


class FusedLinearCrossEntropyLoss(nn.Module):
    """Linear layer + cross-entropy in chunks of rows (see
    :func:`fused_linear_cross_entropy`).

    ``forward(x [N, H], target [N], weight [V, H], bias=None) -> loss`` (float32).
    """

    def __init__(self, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, logit_scale: float = 1.0,
                 num_chunks: int | None = None):
        super().__init__()
        (self.reduction, self.label_smoothing, self.ignore_index,
         self.logit_scale) = check_loss_options(reduction, label_smoothing, ignore_index,
                                                logit_scale)
        if num_chunks is not None and (isinstance(num_chunks, bool)
                                       or not isinstance(num_chunks, int) or num_chunks < 1):
            raise ValueError(f"num_chunks: expected None or an int >= 1, got {num_chunks!r}")
        self.num_chunks = num_chunks

    def forward(self, x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        return fused_linear_cross_entropy(
            x, target, weight, bias, ignore_index=self.ignore_index, reduction=self.reduction,
            label_smoothing=self.label_smoothing, logit_scale=self.logit_scale,
            num_chunks=self.num_chunks)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, logit_scale={self.logit_scale}, "
                f"num_chunks={self.num_chunks}")
