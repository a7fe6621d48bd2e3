"""A 16-bit tensor-core dot with an fp32 operand kept to ~16 mantissa bits.

A chunked recurrence multiplies 16-bit inputs (K, Q, Ai) with fp32 values it computes
on the way (the state S, the residual β(V − K S), the new values Vn, the state gradient
dh read back from its scaled fp16). As one 16-bit operand such a value keeps 8 mantissa
bits (bf16), and where the products are then cancelled (Vn = Ai β(V − K S) is the small
remainder of what the state already predicts) the rounding shows at the size of the
cancelled terms. Written as the sum of two 16-bit tiles, its rounding ``hi`` and the
rounding's remainder ``lo = x − hi``, the value keeps about twice the bits, and both
products stay exact 16-bit tensor-core dots accumulated in fp32: twice a dot's work on
the fastest units, with none of tf32's operand staging (twice the bytes a tile) and none
of its layouts (Triton 3.6 miscompiles some tf32 dots on 32-column tiles on Hopper;
benchmarks/NOTES.md, 2026-11-28 17:34-).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def two_term_dot(a, b, acc, TWO_TERM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``acc + a · b`` for a 16-bit ``a [M, R]`` and an fp32 ``b [R, N]``, ``acc [M, N]``
    fp32. With ``TWO_TERM`` b enters as ``hi + lo`` (two 16-bit dots, lo = b − hi formed
    after hi's dot), without as b rounded to a's dtype (one dot: the plain form). With
    fp32 ``a`` the one dot is fp32's own; TWO_TERM is then pointless."""
    b_hi = b.to(a.dtype)
    acc = tl.dot(a, b_hi, acc, input_precision=DOT_PRECISION)
    if TWO_TERM:
        b_lo = (b - b_hi.to(tl.float32)).to(a.dtype)
        acc = tl.dot(a, b_lo, acc, input_precision=DOT_PRECISION)
    return acc
