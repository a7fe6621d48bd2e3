"""The K × W state of a sequential chunk pass as up to four [BK, BV] float32 row tiles.

A pass that walks a sequence's chunks keeps its state in registers for the whole walk.
A K × BV block cannot be one tile for K up to 256 without spilling, so it is held as
row tiles ``b_1 … b_4`` (rows j·BK … j·BK + BK, BK = 64 or 128 a tuning choice, tiles
past K never formed: K > j·BK decides at compile time). The state tensors in memory are
``[.., K, W]`` with W contiguous; ``o_s`` (the first tile's [BK, BV] offsets, rows
times W plus the program's columns) and the column mask ``m_w`` place every tile.
Passes whose state is one ``[BK, BV]`` tile (BK covering K: the fused recurrent kernels,
the DPLR chunk passes) find it with :func:`state_tile`.
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["state_tile", "load_state_tiles", "identity_state_tiles", "store_state_tiles",
           "decay_state_tiles"]


@triton.jit
def _row_mask(j: tl.constexpr, o_k, m_w, K: tl.constexpr, BK: tl.constexpr):
    return (j * BK + o_k < K)[:, None] & m_w[None, :]


@triton.jit
def load_state_tiles(x, offset, o_s, o_k, m_w, K: tl.constexpr, W: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, LOAD: tl.constexpr):
    """``(b_1, b_2, b_3, b_4)``: the state at ``x + offset`` (``[K, W]``) as float32 row
    tiles, zeros without ``LOAD`` (``x`` may then be None) and for tiles past K."""
    b_1 = tl.zeros([BK, BV], dtype=tl.float32)
    b_2 = tl.zeros([BK, BV], dtype=tl.float32)
    b_3 = tl.zeros([BK, BV], dtype=tl.float32)
    b_4 = tl.zeros([BK, BV], dtype=tl.float32)
    if LOAD:
        p = x + offset + o_s
        b_1 += tl.load(p, mask=_row_mask(0, o_k, m_w, K, BK), other=0.).to(tl.float32)
        if K > BK:
            b_2 += tl.load(p + BK * W, mask=_row_mask(1, o_k, m_w, K, BK),
                           other=0.).to(tl.float32)
        if K > 2 * BK:
            b_3 += tl.load(p + 2 * BK * W, mask=_row_mask(2, o_k, m_w, K, BK),
                           other=0.).to(tl.float32)
        if K > 3 * BK:
            b_4 += tl.load(p + 3 * BK * W, mask=_row_mask(3, o_k, m_w, K, BK),
                           other=0.).to(tl.float32)
    return b_1, b_2, b_3, b_4


@triton.jit
def identity_state_tiles(b_1, b_2, b_3, b_4, o_k, o_w, K: tl.constexpr, BK: tl.constexpr):
    """The row tiles plus ones where the state's row equals its column ``o_w`` (the
    identity block of an augmented ``[I | 0]`` state)."""
    b_1 += (o_k[:, None] == o_w[None, :]).to(tl.float32)
    if K > BK:
        b_2 += (BK + o_k[:, None] == o_w[None, :]).to(tl.float32)
    if K > 2 * BK:
        b_3 += (2 * BK + o_k[:, None] == o_w[None, :]).to(tl.float32)
    if K > 3 * BK:
        b_4 += (3 * BK + o_k[:, None] == o_w[None, :]).to(tl.float32)
    return b_1, b_2, b_3, b_4


@triton.jit
def store_state_tiles(x, offset, b_1, b_2, b_3, b_4, o_s, o_k, m_w, K: tl.constexpr,
                      W: tl.constexpr, BK: tl.constexpr):
    """Stores the row tiles (those inside K) to the ``[K, W]`` state at ``x + offset``,
    in ``x``'s element type."""
    p = x + offset + o_s
    dt = x.dtype.element_ty
    tl.store(p, b_1.to(dt), mask=_row_mask(0, o_k, m_w, K, BK))
    if K > BK:
        tl.store(p + BK * W, b_2.to(dt), mask=_row_mask(1, o_k, m_w, K, BK))
    if K > 2 * BK:
        tl.store(p + 2 * BK * W, b_3.to(dt), mask=_row_mask(2, o_k, m_w, K, BK))
    if K > 3 * BK:
        tl.store(p + 3 * BK * W, b_4.to(dt), mask=_row_mask(3, o_k, m_w, K, BK))


@triton.jit
def decay_state_tiles(b_1, b_2, b_3, b_4, b_decay, K: tl.constexpr, BK: tl.constexpr):
    """Every row tile inside K times ``b_decay`` (a scalar)."""
    b_1 *= b_decay
    if K > BK:
        b_2 *= b_decay
    if K > 2 * BK:
        b_3 *= b_decay
    if K > 3 * BK:
        b_4 *= b_decay
    return b_1, b_2, b_3, b_4


@triton.jit
def state_tile(i_v, i_nh, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
               BV: tl.constexpr):
    """Program (V tile ``i_v``, sequence·head ``i_nh``)'s tile of its [K, V] state:
    ``(o_k, o_v, m_k, m_v, o_s, m_s, state)``, the row (K) and column (V) offsets and
    masks, the tile's offsets and mask inside one state (V contiguous, so each row of
    the tile is one vectorised access) and the state's first element in an
    ``[N·H, K, V]`` tensor (int64)."""
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    return (o_k, o_v, m_k, m_v, o_k[:, None] * V + o_v[None, :], m_k[:, None] & m_v[None, :],
            i_nh.to(tl.int64) * K * V)
