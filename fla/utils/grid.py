"""Integer arithmetic of launch grids and tile widths, on the host.

Since Triton 3.5 ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions:
called from Python they first unwrap every argument, about 2 µs a call (Triton 3.9 on
the development machine) against a few ns for the plain expression, and a launcher
evaluates them on every launch (its grid, its tile widths), dozens of times a training
step per layer. Host code uses these; kernels keep ``tl.cdiv``.
"""
from __future__ import annotations

__all__ = ["cdiv", "next_power_of_2"]


def cdiv(x: int, y: int) -> int:
    """⌈x / y⌉ for y > 0 (Triton's ``cdiv``)."""
    return (x + y - 1) // y


def next_power_of_2(n: int) -> int:
    """The smallest power of two ≥ n for n ≥ 1 (0 for 0, as Triton's)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
