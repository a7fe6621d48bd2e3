"""The GPU's 16-bit dot and cast arithmetic in Triton's CPU interpreter, for tests.

The interpreter (see ``fla/utils/triton_facts.py``) multiplies the operands of a bf16
``tl.dot`` as their uint16 storage, which gives garbage, casts fp32 to bf16 by dropping
the low bits, and multiplies fp32 operands exactly where the GPU takes them at tf32
(``input_precision="tf32"``). A GPU multiplies bf16 operands exactly, accumulating in
fp32, rounds the fp32 operands of a tf32 dot to 10 mantissa bits, and rounds a cast to
the nearest even value. Inside :func:`gpu_bf16` the interpreter does the same, so a
kernel's 16-bit numerics (the rounding of its operands and outputs; not the order of
its sums) can be checked against the float64 loops on the CPU.
"""
from __future__ import annotations

import contextlib

import numpy as np
import triton.language as tl

try:
    from triton.runtime import interpreter as _interpreter

    _BUILDER = _interpreter.InterpreterBuilder
    _HANDLE = _interpreter.TensorHandle
    AVAILABLE = hasattr(_BUILDER, "create_dot") and hasattr(_BUILDER, "cast_impl")
except (ImportError, AttributeError):   # another release's interpreter: tests skip
    AVAILABLE = False


def _is_bf16(handle) -> bool:
    return handle.dtype.scalar == tl.bfloat16


def _exact_fp32(handle):
    """A bf16 handle (uint16 storage) as the fp32 values it holds (exact)."""
    if not _is_bf16(handle):
        return handle
    bits = handle.data.astype(np.uint32) << 16
    return _HANDLE(bits.view(np.float32), tl.float32)


def _as_tf32(handle, precision):
    """An fp32 operand of a dot at input_precision tf32 rounded as the tensor cores take
    it: 10 mantissa bits, to nearest (ties away from zero); other handles unchanged."""
    if handle.dtype.scalar != tl.float32 or "TF32" not in str(precision).upper() or \
            "X3" in str(precision).upper():
        return handle
    data = np.ascontiguousarray(handle.data, dtype=np.float32)
    bits = data.view(np.uint32)
    rounded = ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)
    return _HANDLE(np.where(np.isfinite(data), rounded, data), tl.float32)


def _round_to_bf16(data: np.ndarray) -> np.ndarray:
    """fp32 values rounded to the nearest bf16 (ties to even), as uint16 storage."""
    bits = np.ascontiguousarray(data, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(data), np.uint16(0x7FC0), rounded)


@contextlib.contextmanager
def gpu_bf16():
    """Within the block, the interpreter's bf16 and tf32 dots and its fp32 -> bf16 casts
    match the GPU's (see the module docstring). Not thread-safe: it patches the
    interpreter's builder class."""
    if not AVAILABLE:
        raise RuntimeError("this Triton's interpreter has no create_dot / cast_impl")
    dot, cast = _BUILDER.create_dot, _BUILDER.cast_impl

    def create_dot(self, a, b, d, precision, *args):
        a, b = (_as_tf32(_exact_fp32(x), precision) for x in (a, b))
        return dot(self, a, b, d, precision, *args)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return _HANDLE(_round_to_bf16(src.data), dst_type.scalar)
        return cast(self, src, dst_type)

    _BUILDER.create_dot, _BUILDER.cast_impl = create_dot, cast_impl
    try:
        yield
    finally:
        _BUILDER.create_dot, _BUILDER.cast_impl = dot, cast
