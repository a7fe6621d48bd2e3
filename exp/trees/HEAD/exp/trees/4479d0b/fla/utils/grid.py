"""Integer arithmetic of launch grids and tile widths, on the host.

Since Triton 3.5 ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions:
called from Python they first unwrap every argument, about 2 µs a call (Triton 3.9 on
the development machine) against a few ns for the plain expression, and a launcher
evaluates them on every launch (its grid, its tile widths), dozens of times a training
step per layer. Host code uses these; kernels keep ``tl.cdiv``.
"""
from __future__ import annotations

from fla.utils.triton_facts import multiprocessor_count

__all__ = ["cdiv", "grid_fill", "next_power_of_2", "sequential_grid_fill"]


def cdiv(x: int, y: int) -> int:
    """⌈x / y⌉ for y > 0 (Triton's ``cdiv``)."""
    return (x + y - 1) // y


def next_power_of_2(n: int) -> int:
    """The smallest power of two ≥ n for n ≥ 1 (0 for 0, as Triton's)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def grid_fill(programs_at_64: int, sms: int) -> int:
    """How thinly a chunk kernel's sequential pass (one program per 64 value columns,
    head and sequence, each walking its chunks) covers ``sms`` multiprocessors: 0 if some
    SM would hold two programs, 1 if none would (though 32-column tiles would give some
    SM two), 2 if even 32-column tiles leave every SM at most one.

    Those passes are bound by each program's chain of dependent dots a chunk, not by the
    SM they share, so a thin grid wants narrower tiles (more programs) and deeper
    pipelines (shared memory a lone program has to spare); their tuning defaults read this
    as the ``FEW_PROGRAMS`` hint. Three values: a packed batch whose sequence count crosses
    a bound compiles one more variant, once."""
    if programs_at_64 > sms:
        return 0
    return 1 if 2 * programs_at_64 > sms else 2


def sequential_grid_fill(sequences: int, heads: int, V: int) -> int:
    """:func:`grid_fill` of a sequential chunk pass over ``sequences`` x ``heads`` with
    ``V`` value columns, on this process's GPU: the ``FEW_PROGRAMS`` hint its launcher
    passes."""
    return grid_fill(sequences * heads * cdiv(V, 64), multiprocessor_count())
