"""The split's serial step: the state entering every segment of a sequence cut into
segments (ALGORITHMS.md §1-§3, chunked forms split across programs).

Over a segment the state update is affine, ``S_out = M S_in + X``; the transitions
``[M | X]`` of all segments come from the state passes in parallel
(:mod:`fla.ops.common.chunk_fwd_inter`, :mod:`fla.ops.common.chunk_gk_fwd`, and mirrored
for the gradients by :mod:`fla.ops.common.chunk_delta_h_bwd`). This walks each sequence's
segments in order, one program per (V tile, head, sequence), storing every segment's
entering state and, when asked, the sequence's final state. Three forms of M:

* ``"delta"`` (the delta rule): M is a K x K matrix, ``mx [P, H, K, K + V]`` holds
  ``[M | X]``. Up to K = 128 the whole K x BV state stays in registers from segment to
  segment, one K-deep dot a step (:func:`_affine_walk`); above it each step stores S and
  reads it back by row tiles (:func:`_affine_step`).
* ``"scalar"`` (simple GLA, the backward without W): M = e^d I, d one log decay a
  segment and head.
* ``"vector"`` (GLA, RWKV6): M = diag(e^d), d a K-vector.

The scalar form's forward needs no launch of its own (each output program of
``chunk_fwd_inter`` carries its sequence's state through the earlier transitions); its
backward and the other forms launch :func:`chunk_state_combine_kernel` through
:func:`combine_segment_states`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fla.ops.utils.tiles import check_buffer, tile_width
from fla.utils.grid import cdiv
from fla.utils.triton_facts import dot_precision, multiprocessor_count
from fla.utils.tuning import Config, tuned

__all__ = ["combine_segment_states", "chunk_state_combine_kernel", "one_tile_walk"]


# The walk in registers on a thin grid takes 16 columns, under MIN_DOT_TILE (set for a
# Triton 3.6 miscompile of a 16-column fp16 product). This kernel's dots are fp32 (tf32x3):
# compute-sanitizer's memcheck found no error in them at 16 columns on Triton 3.3.1, 3.6.0
# and 3.9.0 (H200, 2026-11-28: K = 64 and 128, two and three stages, with and without the
# forward's maps, each matching the float64 walk to 5e-7; 3.9.0's launcher also reports
# four cuFuncSetAttribute host calls refused, the same at 32 columns), and each of those
# releases passed the GPU config sweeps with this width. 3.4, 3.5, 3.7 and 3.8 did not
# run it.
COMBINE_THIN_TILE = 16


def one_tile_walk(form: str, K: int) -> bool:
    """Whether the combine keeps the whole ``K x BV`` state in one register tile from
    segment to segment (:func:`_affine_walk`): the delta form up to K = 128."""
    return form == "delta" and K <= 128


def _combine_default(args) -> Config:
    # The scalar form (simple GLA: an elementwise S ← e^d S + X a segment, no dot) is bound
    # by its loads: 8 warps keep more in flight (H100, Triton 3.6, 2x16384x16x128, the
    # space timed 2026-11-27: 13.0 µs against 16.8 at 4). The delta form's walk in
    # registers (the delta rule at 1x65536x8x128, 16 segments, 2026-11-28): 32 columns at
    # 8 warps and three stages 71 µs, 4 warps 127-133; the tiled walk through memory it
    # replaced took 125-380 over its whole space. The walk is one chain of dots, so where
    # 16-column programs leave at most one an SM (``THIN_GRID``) the narrower tile halves
    # each program's chain (H200, Triton 3.6, bf16, 2026-11-28, the op with the combine
    # forced, two rounds each, ms: 1x65536x8x128 fwd 0.933 / 0.928 -> 0.917 / 0.914,
    # fwd+bwd 3.007 / 3.006 -> 2.984 / 2.981; 2x16384x16x128, 256 programs at 16
    # columns, fwd 0.862 -> 0.868: kept at 32 there).
    if one_tile_walk(args["FORM"], args["K"]):
        bv = COMBINE_THIN_TILE if args.get("THIN_GRID", False) else tile_width(args["V"], 32)
        return Config(BV=bv, num_warps=8, num_stages=3)
    return Config(BV=tile_width(args["V"], 32),
                  num_warps=8 if args["FORM"] == "scalar" else 4, num_stages=2)


def _combine_space(args) -> list[Config]:
    if one_tile_walk(args["FORM"], args["K"]):
        # 8 warps: at 4 the K = 128 walk spills 650-1230 B a thread (offline sm_90). A
        # pipeline buffer holds a K x K M and a K x BV X in fp32 (160 KB at 32 columns
        # and three stages, 128 at 64 and two); 64 columns at three stages builds (192
        # KB, 255 registers) but was never timed nor run on a GPU, so it stays out.
        widths = sorted({COMBINE_THIN_TILE} | {tile_width(args["V"], bv) for bv in (32, 64)})
        return [Config(BV=bv, num_warps=8, num_stages=s)
                for bv in widths for s in (2, 3) if bv < 64 or s < 3]
    widths = sorted({tile_width(args["V"], bv) for bv in (32, 64)})
    return [Config(BV=bv, num_warps=w, num_stages=s)
            for bv in widths for w in (2, 4, 8) for s in (1, 2)]


@triton.jit
def _segment_map(p_mx, maps, i_s, s0, s1, i_h, H, K: tl.constexpr, V: tl.constexpr,
                 FORWARD_MAPS: tl.constexpr):
    """Where segment ``i_s``'s M lies: ``(pointer, row stride, column stride, rows)``,
    its rows below ``rows`` read (those past it as zero). M is the first K columns of
    ``mx[i_s, i_h]`` (``p_mx`` points at it), or with ``FORWARD_MAPS`` the transpose of
    the forward pass's map of the same segment: the reverse pass lists a sequence's
    segments last to first, so its row ``i_s`` is the forward's row ``s0 + s1 - 1 -
    i_s``. Its first row (the sequence's last segment) has no forward map (``rows`` 0: M
    reads as zero); the walk starts there from a zero state, which that map would only
    multiply."""
    if FORWARD_MAPS:
        mirror = s0 + s1 - 1 - i_s
        p_m = maps + (tl.full([], 0, tl.int64) + mirror * H + i_h) * (K * (K + V))
        # (A row count, not a scalar bool and-ed into the mask: the interpreter turns a
        # bool tile & a bool scalar into int32, which it then refuses as a mask.)
        return p_m, 1, K + V, tl.where(i_s != s0, K, 0)
    return p_mx, K + V, 1, K


@triton.jit
def _affine_step(mx, maps, src, dst, i_s, s0, s1, i_h, H, K: tl.constexpr, V: tl.constexpr,
                 BK: tl.constexpr, o_v, m_v, FORWARD_MAPS: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """dst[:, cols] = M_s src[:, cols] + X_s[:, cols] for segment ``i_s``'s transition
    ``mx[i_s, i_h] = [M | X]`` (K x (K + V); M placed by :func:`_segment_map`);
    ``src``/``dst`` point at K x V states."""
    o_k = tl.arange(0, BK)
    # int64 offsets: P·H·K·(K + V) can pass 2³¹. (A loop counter is a Python int in the
    # interpreter, hence the add rather than .to().)
    p_mx = mx + (tl.full([], 0, tl.int64) + i_s * H + i_h) * (K * (K + V))
    p_m, stride_r, stride_c, m_rows = _segment_map(p_mx, maps, i_s, s0, s1, i_h, H, K, V,
                                                   FORWARD_MAPS)
    for i_r in range(tl.cdiv(K, BK)):
        rows = i_r * BK + o_k
        m_r = rows < K
        b_s = tl.load(p_mx + rows[:, None] * (K + V) + K + o_v[None, :],
                      mask=m_r[:, None] & m_v[None, :], other=0.)
        for i_c in range(tl.cdiv(K, BK)):
            cols = i_c * BK + o_k
            m_c = cols < K
            b_m = tl.load(p_m + rows[:, None] * stride_r + cols[None, :] * stride_c,
                          mask=(rows < m_rows)[:, None] & m_c[None, :], other=0.)
            b_src = tl.load(src + cols[:, None] * V + o_v[None, :],
                            mask=m_c[:, None] & m_v[None, :], other=0.)
            b_s = tl.dot(b_m, b_src, b_s, input_precision=DOT_PRECISION)
        tl.store(dst + rows[:, None] * V + o_v[None, :], b_s, mask=m_r[:, None] & m_v[None, :])


@triton.jit
def _scaled_step(x, seg_decay, src, dst, i_s, i_h, H, K: tl.constexpr, V: tl.constexpr,
                 BK: tl.constexpr, o_v, m_v, PER_CHANNEL: tl.constexpr):
    """dst[:, cols] = diag(exp(d)) src[:, cols] + X_s[:, cols]: the transition of a
    segment whose M is diagonal, with ``x[i_s, i_h]`` its X (K x V) and d its log decay:
    one value ``seg_decay[i_s, i_h]`` (simple GLA, M = e^d I) or with ``PER_CHANNEL`` a
    K-vector ``seg_decay[i_s, i_h, :]`` (the vector gate's Σ γ_C over the segment)."""
    o_k = tl.arange(0, BK)
    base = (tl.full([], 0, tl.int64) + i_s * H + i_h)
    for i_r in range(tl.cdiv(K, BK)):
        rows = i_r * BK + o_k
        p_s = rows[:, None] * V + o_v[None, :]
        m_s = (rows < K)[:, None] & m_v[None, :]
        if PER_CHANNEL:
            b_d = tl.load(seg_decay + base * K + rows, mask=rows < K, other=0.)[:, None]
        else:
            b_d = tl.load(seg_decay + base)
        b_s = (tl.exp(b_d) * tl.load(src + p_s, mask=m_s, other=0.)
               + tl.load(x + base * (K * V) + p_s, mask=m_s, other=0.))
        tl.store(dst + p_s, b_s, mask=m_s)


@triton.jit
def _affine_walk(mx, maps, h0, seg_h0, ht, s0, s1, i_n, i_h, H, K: tl.constexpr,
                 V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, o_v, m_v,
                 USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
                 FORWARD_MAPS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The delta form's walk with the whole K x BV state one register tile (K ≤ BK):
    ``S ← M_s S + X_s`` a segment as one K-deep dot, S kept in registers from segment to
    segment (no store and reload through L2, no barrier between steps: the chain is the
    dot alone) while the loop's pipeline loads the next segments' ``[M | X]``, which do
    not depend on S. Every entering state is still stored for the output pass."""
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    p_s = o_k[:, None] * V + o_v[None, :]
    m_s = m_k[:, None] & m_v[None, :]
    if USE_INITIAL_STATE:
        b_s = tl.load(h0 + (i_n.to(tl.int64) * H + i_h) * (K * V) + p_s, mask=m_s,
                      other=0.).to(tl.float32)
    else:
        b_s = tl.zeros([BK, BV], dtype=tl.float32)
    tl.store(seg_h0 + (s0.to(tl.int64) * H + i_h) * (K * V) + p_s, b_s, mask=m_s)
    p_x = o_k[:, None] * (K + V) + K + o_v[None, :]
    # The last segment's step only when its result, the final state, is asked for.
    for i_s in range(s0, s1 - 1 + STORE_FINAL_STATE):
        p_mx = mx + (tl.full([], 0, tl.int64) + i_s * H + i_h) * (K * (K + V))
        p_m, stride_r, stride_c, m_rows = _segment_map(p_mx, maps, i_s, s0, s1, i_h, H, K,
                                                       V, FORWARD_MAPS)
        b_m = tl.load(p_m + o_k[:, None] * stride_r + o_k[None, :] * stride_c,
                      mask=(o_k < m_rows)[:, None] & m_k[None, :], other=0.)
        b_x = tl.load(p_mx + p_x, mask=m_s, other=0.)
        b_s = tl.dot(b_m, b_s, b_x, input_precision=DOT_PRECISION)
        dst = seg_h0 + (tl.full([], 0, tl.int64) + (i_s + 1) * H + i_h) * (K * V)
        if STORE_FINAL_STATE:
            if i_s + 1 == s1:
                dst = ht + (i_n.to(tl.int64) * H + i_h) * (K * V)
        tl.store(dst + p_s, b_s, mask=m_s)


# ``maps`` and ``ht`` in the key: the reverse pass's combine (the forward's maps read
# transposed, a final state where h0 is given) builds and runs otherwise than the
# forward's (plain loads, no final state), so FLA_TUNE times them apart.
@tuned(key=["K", "V", "h0", "FORM", "maps", "ht", "THIN_GRID"], default=_combine_default,
       space=_combine_space)
@triton.jit
def chunk_state_combine_kernel(
    mx, maps, seg_decay, h0, seg_h0, ht, seg_offsets,
    H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
    FORM: tl.constexpr, FORWARD_MAPS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    THIN_GRID: tl.constexpr = False,
):
    """Grid ``(NV, H, N)``: walk sequence n's segments s0 .. s1 − 1 in order, giving each
    its entering state ``seg_h0[s] = S`` and ``S ← M_s S + X_s``; the state after the
    last segment is the sequence's final state ``ht[n]``. All states fp32 ``K x V``.
    ``FORM`` is the transitions' (see
    :func:`fla.ops.common.chunk_segments.transition_width`): ``"delta"``, where ``mx [P,
    H, K, K + V]`` holds ``[M | X]``; ``"scalar"`` (simple GLA), where ``mx [P, H, K,
    V]`` holds X and ``seg_decay [P, H]`` log M (M = e^d I); ``"vector"`` (GLA, RWKV6),
    X and ``seg_decay [P, H, K]`` the log of M's diagonal. With ``FORWARD_MAPS`` (the
    delta form's reverse pass) M comes transposed from the forward's ``maps [P, H, K, K
    + V]`` (:func:`_segment_map`) and ``mx``'s M columns are not read. The delta form
    with K ≤ BK walks with S in registers (:func:`_affine_walk`); otherwise each step
    stores S and reads it back by row tiles of BK. ``THIN_GRID`` (the walk in registers
    where 16-column programs would be at most one an SM) is read by the tuning layer
    only."""
    i_v, i_h, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    s0 = tl.load(seg_offsets + i_n)
    s1 = tl.load(seg_offsets + i_n + 1)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    if FORM == "delta" and BK >= K:
        _affine_walk(mx, maps, h0, seg_h0, ht, s0, s1, i_n, i_h, H, K, V, BK, BV, o_v, m_v,
                     USE_INITIAL_STATE, STORE_FINAL_STATE, FORWARD_MAPS, DOT_PRECISION)
    else:
        first = seg_h0 + (s0.to(tl.int64) * H + i_h) * (K * V)
        for i_r in range(tl.cdiv(K, BK)):
            rows = i_r * BK + o_k
            m_s = (rows < K)[:, None] & m_v[None, :]
            p_s = rows[:, None] * V + o_v[None, :]
            if USE_INITIAL_STATE:
                b_s = tl.load(h0 + (i_n.to(tl.int64) * H + i_h) * (K * V) + p_s, mask=m_s,
                              other=0.).to(tl.float32)
            else:
                b_s = tl.zeros([BK, BV], dtype=tl.float32)
            tl.store(first + p_s, b_s, mask=m_s)
        for i_s in range(s0, s1 - 1):
            # Every thread's part of seg_h0[i_s] must be stored before any thread reads it.
            tl.debug_barrier()
            src = seg_h0 + (tl.full([], 0, tl.int64) + i_s * H + i_h) * (K * V)
            if FORM == "delta":
                _affine_step(mx, maps, src, src + H * K * V, i_s, s0, s1, i_h, H, K, V, BK,
                             o_v, m_v, FORWARD_MAPS, DOT_PRECISION)
            else:
                _scaled_step(mx, seg_decay, src, src + H * K * V, i_s, i_h, H, K, V, BK, o_v, m_v,
                             FORM == "vector")
        if STORE_FINAL_STATE:
            tl.debug_barrier()
            src = seg_h0 + (tl.full([], 0, tl.int64) + (s1 - 1) * H + i_h) * (K * V)
            dst = ht + (i_n.to(tl.int64) * H + i_h) * (K * V)
            if FORM == "delta":
                _affine_step(mx, maps, src, dst, s1 - 1, s0, s1, i_h, H, K, V, BK, o_v, m_v,
                             FORWARD_MAPS, DOT_PRECISION)
            else:
                _scaled_step(mx, seg_decay, src, dst, s1 - 1, i_h, H, K, V, BK, o_v, m_v,
                             FORM == "vector")


def combine_segment_states(mx: torch.Tensor, seg_decay: torch.Tensor | None, form: str,
                           seg_offsets: torch.Tensor, V: int,
                           initial_state: torch.Tensor | None = None,
                           final_state: torch.Tensor | None = None,
                           forward_maps: torch.Tensor | None = None) -> torch.Tensor:
    """The split's serial step (:func:`chunk_state_combine_kernel`, one program per V
    tile, head and sequence): the state entering each segment, ``seg_h0 [P, H, K, V]``
    float32, from the transitions ``mx [P, H, K, W]`` (and ``seg_decay``, ``[P, H]`` for
    ``form == "scalar"``, ``[P, H, K]`` for ``"vector"``, None for ``"delta"``), the
    sequences' ``initial_state [N, H, K, V]`` (None: zeros), with ``seg_offsets [N + 1]``
    from :func:`fla.ops.common.chunk_segments.segment_tables`. Writes each sequence's
    state after its last segment to ``final_state [N, H, K, V]`` float32 when given.

    ``forward_maps [P, H, K, K + V]`` float32 (the delta form's reverse pass, without an
    initial state): the forward pass's transitions of the same segments, listed first to
    last where ``mx`` lists each sequence's last to first (the same ``seg_offsets``);
    each M is then the transpose of its segment's forward M and ``mx``'s M columns are
    not read (the forward has no map of a sequence's last segment, which the reverse
    walk enters with a zero state)."""
    P, H, K = mx.shape[:3]
    N = seg_offsets.numel() - 1
    if forward_maps is not None:
        if form != "delta" or initial_state is not None:
            raise ValueError("forward_maps: only for the delta form without an initial "
                             "state (the reverse pass without a final-state gradient)")
        check_buffer("forward_maps", forward_maps, mx.shape, torch.float32, mx.device)
    seg_h0 = torch.empty(P, H, K, V, dtype=torch.float32, device=mx.device)
    one_tile = one_tile_walk(form, K)
    # A bool in the tuning key: a packed batch whose sequence count crosses the bound
    # compiles the other variant once.
    thin = one_tile and N * H * cdiv(V, COMBINE_THIN_TILE) <= multiprocessor_count()
    chunk_state_combine_kernel[lambda meta: (cdiv(V, meta["BV"]), H, N)](
        mx=mx, maps=forward_maps, seg_decay=seg_decay, h0=initial_state, seg_h0=seg_h0,
        ht=final_state,
        seg_offsets=seg_offsets, H=H, K=K, V=V,
        BK=tile_width(K, 128) if one_tile else tile_width(K, 64),
        USE_INITIAL_STATE=initial_state is not None,
        STORE_FINAL_STATE=final_state is not None, FORM=form,
        FORWARD_MAPS=forward_maps is not None,
        DOT_PRECISION=dot_precision(torch.float32), THIN_GRID=thin)
    return seg_h0
