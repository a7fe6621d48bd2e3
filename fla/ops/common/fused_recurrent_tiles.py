"""Tile and config rules of the fused recurrent kernels, shared by their families.

The fused recurrent kernels of the gated delta rule (and simple GLA through it), of GLA
(and RWKV6) and of the DPLR delta rule (and RWKV7) have the same layout: one program per
(V tile, head, sequence) keeps a ``[BK, BV]`` float32 tile of the state in registers for
the whole sequence, BK covering all of K (so ``Sᵀx`` is complete inside one program and V
tiles never talk to each other). Their forwards choose BV and warps by the same rule,
their backwards fix BV in the launcher (it sets the layout of the partial sums over V
tiles) and tune warps only, and every kernel finds its state tile and each token's rows
the same way (its sequence's tokens through ``fla.ops.utils.index.locate_sequence`` and
its tile through ``fla.ops.utils.state_tiles.state_tile``, as the DPLR chunk passes do).
Those rules and building blocks live here once, with the measurements behind them; each
family's module imports them (the rules go to ``@tuned``).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import triton
import triton.language as tl

from fla.utils.grid import next_power_of_2
from fla.utils.tuning import Config

__all__ = ["block_k", "default_config", "thin_grid_default", "config_space", "bwd_block_v",
           "bwd_default_config", "bwd_config_space", "token_row", "load_token_row"]


def block_k(K: int) -> int:
    """One tile covers all of K: Sᵀq, Sᵀk (and S·dw, Sᵀa) are complete inside one program."""
    return next_power_of_2(K)


def default_config(args) -> Config:
    """About 64 float32 state elements a thread: BK = 64 -> BV = 32, BK = 128 -> BV = 16
    on 1 warp, BK = 256 -> BV = 16 on 2 warps. Measured with the gated delta rule's kernel
    on an H100 (Triton 3.6) at the decode step (B=256, T=1, H=32, K=V=128, fp32 state), in
    % of the copy bandwidth: BV=16/1 warp 92, BV=32/1 warp 96, BV=32 at 2/4/8 warps
    91/88/76, BV=64/1 warp 14 (spills). Over long sequences (4×1024 tokens, H=16, H200)
    BV=32/1 warp is 4× slower than the best while BV=16/1 warp is within 7% of it, hence
    64 elements a thread, not 128. GLA and the DPLR delta rule follow the same rule."""
    BK = args["BK"]
    BV = min(next_power_of_2(args["V"]), max(16, 2048 // BK))
    return Config(BV=BV, num_warps=max(1, BK * BV // 2048), num_stages=1)


def thin_grid_default(thin: Mapping[int, Config]) -> Callable[[Mapping[str, Any]], Config]:
    """A forward's default rule: ``thin[BK]`` where the launcher's ``FEW_PROGRAMS`` hint
    (:func:`fla.utils.grid.sequential_grid_fill`, from sequences x heads: a small batch's
    prefill) says one-warp programs would leave most SMs idle, :func:`default_config`
    elsewhere (the decode batches that rule was measured on). Each family gives the
    tiles measured for its kernel; a head size it does not list keeps the common rule."""
    def rule(args: Mapping[str, Any]) -> Config:
        if args.get("FEW_PROGRAMS", 0) and args["BK"] in thin:
            return thin[args["BK"]]
        return default_config(args)
    return rule


def config_space(args, block_vs: Sequence[int] = (8, 16, 32, 64)) -> list[Config]:
    """What ``FLA_TUNE=1`` benchmarks for a forward: V tiles ``block_vs`` (the gated delta
    rule also tries 128), at most 16384 state elements a tile, 1-8 warps and 1-2 stages."""
    BK, Vp = args["BK"], next_power_of_2(args["V"])
    space = []
    for BV in block_vs:
        if BV > Vp or BK * BV > 16384:
            continue
        for warps in (1, 2, 4, 8):
            if BK * BV // (32 * warps) < 4:  # fewer than 4 elements a thread: wasted lanes
                continue
            for stages in (1, 2):
                space.append(Config(BV=BV, num_warps=warps, num_stages=stages))
    return space


def bwd_block_v(K: int, V: int) -> int:
    """The backward's V tile. It fixes the layout of the partial-sum buffers (dq, dk and
    the family's other per-token gradients are summed over V tiles afterwards), so the
    launcher chooses it and the tuning layer only varies warps and stages. 4096 elements
    a tile: BK = 128 -> 32 (4 V tiles at V = 128; BV = 16 is 8% faster with the gated delta
    rule but doubles the partial buffers)."""
    return min(next_power_of_2(V), max(8, 4096 // block_k(K)))


def bwd_default_config(args) -> Config:
    """The fused recurrent backward's warps for its ``BK x BV`` state tile (one stage)."""
    # Measured (gated delta rule, H200, 4×1024 tokens, H=16, K=V=128, BV=32): 1/2/4/8 warps
    # 18.2/10.6/6.0/5.8 ms: the reverse sweep keeps D and its products live, so spread
    # them wide.
    return Config(num_warps=min(8, max(1, args["BK"] * args["BV"] // 512)), num_stages=1)


def bwd_config_space(args) -> list[Config]:
    """1-8 warps at one or two stages, each thread holding at least 4 of the tile's
    values."""
    tile = args["BK"] * args["BV"]
    return [Config(num_warps=w, num_stages=s) for w in (1, 2, 4, 8) for s in (1, 2)
            if tile // (32 * w) >= 4]


@triton.jit
def token_row(x, t, rows, row, width: tl.constexpr, offsets):
    """Pointers to ``offsets`` inside row ``row`` of token ``t`` of a token-major tensor
    with ``rows`` rows of ``width`` elements a token: ``x[t, row, offsets]`` of an
    ``[.., rows, width]`` view (t int64, in the packed token axis). Per-token scalars
    (a gate, β) are width 1 with offsets 0; partial sums over V tiles ``[tokens, H, NV,
    K]`` are rows = H·NV, row = h·NV + i_v. The sweeps index each token by this instead
    of carrying pointers that every step moves."""
    return x + (t * rows + row) * width + offsets


@triton.jit
def load_token_row(x, t, rows, row, width: tl.constexpr, offsets, mask):
    """:func:`token_row`'s elements, masked (zeros where ``mask`` is false), in float32."""
    return tl.load(token_row(x, t, rows, row, width, offsets), mask=mask,
                   other=0.).to(tl.float32)
