"""Shared pieces of the one-launch elementwise ops over token rows (Gated DeltaNet's gate,
Mamba2's time steps, operands and output epilogue): their launch rules, the tile
offsets of a row-major ``[R, C]`` tensor, and the softplus of time steps and decays.

These kernels have no loop: the tile a program owns is fixed by its launcher (a
backward's per-program partial sums then have one shape whatever the config), so only
the warps are tuned.
"""
from __future__ import annotations

import triton
import triton.language as tl

from fla.utils.grid import next_power_of_2
from fla.utils.tuning import Config

__all__ = ["rows_per_program", "one_stage_default", "one_stage_space", "row_tile",
           "softplus", "softplus_grad"]


def rows_per_program(width: int, values: int = 4096, least: int = 16, most: int = 128) -> int:
    """Rows of a ``width``-wide tile of at most ``values`` values, ``least`` to ``most``
    rows (the defaults: [4·4096 tokens, 32 heads] is 128 programs)."""
    return max(least, min(most, values // next_power_of_2(width)))


def one_stage_default(args) -> Config:
    """The element-wise kernels' default: 4 warps, no software pipelining (one pass over
    each tile, nothing to prefetch)."""
    return Config(num_warps=4, num_stages=1)


def one_stage_space(args) -> list[Config]:
    """What ``FLA_TUNE=1`` times for them: 1, 2, 4 or 8 warps at one stage."""
    return [Config(num_warps=w, num_stages=1) for w in (1, 2, 4, 8)]


@triton.jit
def row_tile(i_r, i_c, R, C: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """Tile (i_r, i_c), BR rows x BC columns, of a contiguous ``[R, C]`` tensor:
    ``(o_r, m_r, o_c, m_c, m, offsets)`` (rows int64, masks of rows, columns and both)."""
    o_r = i_r.to(tl.int64) * BR + tl.arange(0, BR)
    o_c = i_c * BC + tl.arange(0, BC)
    m_r = o_r < R
    m_c = o_c < C
    return o_r, m_r, o_c, m_c, m_r[:, None] & m_c[None, :], o_r[:, None] * C + o_c[None, :]


@triton.jit
def softplus(z):
    """``log(1 + e^z)``, and ``z`` itself past 20 (torch's threshold: a module global
    cannot be read inside @jit on every supported Triton). log1p(e) is computed as
    ``log(1 + e) · e / ((1 + e) − 1)``, exact where 1 + e rounds (tiny e), where plain
    ``log(1 + e)`` would return 0."""
    e = tl.exp(tl.minimum(z, 20.))
    u = 1. + e
    return tl.where(z > 20., z, tl.where(u == 1., e, tl.log(u) * (e / (u - 1.))))


@triton.jit
def softplus_grad(z):
    """d softplus / dz: σ(z), and 1 past the threshold (20), as :func:`softplus`."""
    return tl.where(z > 20., 1., tl.sigmoid(z))
