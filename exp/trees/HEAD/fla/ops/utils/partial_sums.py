"""Parameter gradients from per-program partial sums, in one launch.

Backward kernels that sum a parameter's gradient over many rows (a norm's γ and β, a
short convolution's filter and bias, the gated delta rule's per-head A and dt_bias)
keep one fp32 partial row per program, ``parts [P, ...]``, instead of atomics, so that
the result does not depend on the order programs finish in. What is left is
``parts.sum(0)`` in the parameter's dtype.

Done with torch that is a reduction then a cast: two kernels and two host calls per
gradient, and a backward call is often host-bound (autograd runs it on its device
thread). :func:`sum_partials` does both, for one or two gradients, in one launch: each
program sums a block of columns over all P rows in fp32 and writes the result once,
rounded to the output's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fla.utils.tuning import Config, tuned

__all__ = ["sum_partials", "sum_partial_pair", "sum_partials_kernel"]

# Columns per program: small enough that P x BM partial loads spread over many SMs
# (M = 4096 gives 128 programs), rows per step: BP x BM = 2048 fp32 values in flight.
_BM = 32
_BP = 64


def _default(args) -> Config:
    return Config(num_warps=4, num_stages=2)


def _space(args) -> list[Config]:
    return [Config(num_warps=w, num_stages=s) for w in (2, 4, 8) for s in (1, 2, 3)]


@triton.jit
def _sum_columns(parts, out, P, M, i_m, BP: tl.constexpr, BM: tl.constexpr):
    """out[i_m·BM : (i_m+1)·BM] = Σ_p parts[p, same columns], summed in fp32."""
    o_m = i_m * BM + tl.arange(0, BM)
    m_m = o_m < M
    b_acc = tl.zeros([BP, BM], dtype=tl.float32)
    for p0 in range(0, P, BP):
        o_p = p0 + tl.arange(0, BP)
        mask = (o_p < P)[:, None] & m_m[None, :]
        b_acc += tl.load(parts + o_p.to(tl.int64)[:, None] * M + o_m[None, :], mask=mask,
                         other=0.)
    tl.store(out + o_m, tl.sum(b_acc, axis=0).to(out.dtype.element_ty), mask=m_m)


@tuned(key=["out_a", "out_b"], default=_default, space=_space)
@triton.jit(do_not_specialize=["P"])
def sum_partials_kernel(parts_a, out_a, parts_b, out_b, P, MA, MB, HAS_B: tl.constexpr,
                        BP: tl.constexpr, BM: tl.constexpr):
    """Program i sums columns [i·BM, (i+1)·BM) of ``parts_a [P, MA]`` into ``out_a [MA]``
    and, with ``HAS_B``, of ``parts_b [P, MB]`` into ``out_b [MB]``."""
    i_m = tl.program_id(0)
    if i_m * BM < MA:
        _sum_columns(parts_a, out_a, P, MA, i_m, BP, BM)
    if HAS_B:
        if i_m * BM < MB:
            _sum_columns(parts_b, out_b, P, MB, i_m, BP, BM)


def sum_partials(parts_a: torch.Tensor, like_a: torch.Tensor,
                 parts_b: torch.Tensor | None = None, like_b: torch.Tensor | None = None):
    """Sum partial gradients over their first dim, in one launch.

    Args:
        parts_a: fp32 ``[P, *like_a.shape]``, contiguous (the partials of one gradient).
        like_a: the parameter: the result has its shape and dtype.
        parts_b, like_b: optionally a second gradient's partials and parameter (same P).

    Returns:
        ``Σ_p parts_a[p]`` shaped and typed like ``like_a`` (and the same for b when given:
        a pair), summed in fp32 and rounded once.
    """
    out_a = torch.empty(like_a.shape, dtype=like_a.dtype, device=parts_a.device)
    out_b = None
    MA, MB = like_a.numel(), 0
    if parts_b is not None:
        out_b = torch.empty(like_b.shape, dtype=like_b.dtype, device=parts_b.device)
        MB = like_b.numel()
    P = parts_a.shape[0]
    sum_partials_kernel.launch_bound(
        (-(-max(MA, MB) // _BM),),
        dict(parts_a=parts_a, out_a=out_a, parts_b=parts_b, out_b=out_b),
        dict(P=P, MA=MA, MB=MB, HAS_B=parts_b is not None, BP=_BP, BM=_BM))
    return out_a if parts_b is None else (out_a, out_b)


def sum_partial_pair(parts_a: torch.Tensor | None, like_a: torch.Tensor | None,
                     parts_b: torch.Tensor | None, like_b: torch.Tensor | None):
    """:func:`sum_partials` for a parameter pair either of which may be absent (a norm's
    weight and bias, a convolution's filter and bias, the gate's A and dt_bias): returns
    ``(grad_a or None, grad_b or None)``, the present ones in one launch; a ``like`` of
    None means that gradient does not exist."""
    if like_a is None:
        return None, (None if like_b is None else sum_partials(parts_b, like_b))
    if like_b is None:
        return sum_partials(parts_a, like_a), None
    return sum_partials(parts_a, like_a, parts_b, like_b)
