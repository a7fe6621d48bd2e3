"""Backward of the state pass of the chunked gated delta rule: the reverse pass over chunks.

Forward (ALGORITHMS.md §1), per chunk with S the state entering it, γ the chunk-local
cumulative log decay and γ_L its value at the chunk's last valid token:

    Vn = U − W S
    O  = scale·[ (Q ⊙ exp(γ)) S + (Q Kᵀ ⊙ Γ ⊙ causal_incl_diag) Vn ]
    S' = exp(γ_L) S + (K ⊙ exp(γ_L − γ))ᵀ Vn

Backward, from the last chunk to the first with the adjoint dS = ∂L/∂S' (starting from
``dht``, the gradient of the final state, or 0):

    dVn = dv_local + (K ⊙ exp(γ_L − γ)) dS                   (``dv2``: the full gradient of Vn)
    dS  ← exp(γ_L) dS + scale·(Q ⊙ exp(γ))ᵀ dO − Wᵀ dVn       (∂L/∂S, S entering the chunk)

Without W (simple GLA: Vn = U = V) the last term drops and dVn is dV.

With a vector gate (``USE_GK``, GLA / RWKV6, §3: γ ``[B, T, H, K]``) the decays act per
state row and the query side may read its own cumulative gate γq (RWKV6: exclusive):

    dVn = dv_local + (K ⊙ exp(γ_L − γ)) dS
    dS  ← diag(exp(γ_L)) dS + scale·(Q ⊙ exp(γq))ᵀ dO

``dv_local`` = scale·(Q Kᵀ ⊙ Γ)ᵀ dO is :func:`fla.ops.common.chunk_o_bwd.chunk_bwd_dv_local`'s
output, or formed in the pass from the forward's saved scores ``Aqk``. The gradient
of ``initial_state`` is dS after the first chunk of each sequence.

Few long sequences leave most of the GPU idle walking them whole. The step above is
affine in dS, dS_in = M dS_out + X (M = e^{γ_L} I − Wᵀ (K ⊙ e^{γ_L − γ}), X the dO and
dv_local terms), so the pass can cut them into segments (``segment_chunks``): each
segment's composed map in parallel, a serial combine of the maps per sequence from dht
(:func:`fla.ops.common.chunk_state_combine.combine_segment_states`, giving dh0 too), then
every segment walked from the gradient leaving it, in parallel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fla.ops.common.chunk_fwd_inter import segment_of_program, state_columns
from fla.ops.common.chunk_state_combine import combine_segment_states
from fla.ops.common.chunk_segments import segment_tables
from fla.ops.utils.index import first_chunk_row, prepare_chunk_offsets, varlen_chunk_indices
from fla.ops.utils.tiles import (check_buffer, check_kernel_device, sixteen_bit,
                                 state_row_heights, tile_width)
from fla.utils.grid import cdiv, sequential_grid_fill
from fla.utils.triton_facts import dot_precision, warp_choices
from fla.utils.tuning import Config, tuned

__all__ = ["chunk_gated_delta_rule_bwd_dhu", "chunk_gated_delta_rule_bwd_dhu_kernel",
           "scaled_dh_buffer"]


def _vector_gate_on_gated_operands(args) -> bool:
    """The vector gate (GLA, RWKV6) reading the forward's gated operands: no γ tile
    staged, and the only reverse pass whose state takes 128-row tiles."""
    return bool(args.get("USE_GK") and args.get("GATED_OPERANDS"))


def _dhu_default(args) -> Config:
    # dS lives in registers as up to four [64, BV] fp32 tiles: with K = 256 and 4 warps,
    # BV = 32 keeps it at 64 registers per thread and leaves room for the operands.
    # With the vector gate staging fp32 γ tiles (no gated operands), one stage: its
    # two-stage kernel needs 156 KB of shared memory at K = 128 (one program an SM); H100,
    # GLA fwd+bwd at 1x8192x96x128 9.47-9.61 -> 9.14-9.29 ms (2026-11-26; BV = 32 was
    # slower at one or two stages).
    # Without it, up to K = 128 (H100, Triton 3.6, bf16, 2026-11-26): with W three
    # stages, 0.69 ms against 0.86 at two (1x8192x96x128), 0.35 against 0.47
    # (1x8192x64x128); without W two where SMs hold two programs (0.55 against 0.69 at
    # three), three where the grid is thin (FEW_PROGRAMS, from the launcher, see
    # fla.utils.grid.grid_fill; 0.39 against 0.43 at 1x8192x64x128). Where even 32-column
    # programs leave each SM one (FEW_PROGRAMS = 2), BV = 32: 2x16384x16x128 0.53 ms
    # against 0.79 (with W) and 0.53 against 0.67 (without, 8 warps; 0.61 at 4).
    # Above K = 128 and for fp32 operands, the fewest stages its space holds.
    # The vector gate on the forward's gated operands (no γ tile staged), K <= 128: the
    # rule without the gate, at 4 warps (32-column tiles and a third stage on the
    # thinnest grids, two stages elsewhere). H100, 2026-11-26, each space timed: GLA
    # 2x16384x16x128 0.58 ms against 1.24 for the one-stage BV = 64 it ran before (the
    # launcher passed no FEW_PROGRAMS with the gate, so no thin-grid rule fired),
    # 1x8192x96x128 0.57 against ~0.80.
    few = args.get("FEW_PROGRAMS", 0)
    gated_gk = _vector_gate_on_gated_operands(args)
    # dS's row tiles: 128 rows for the vector gate on gated operands where the grid is
    # full (H100, Triton 3.6, bf16, 2026-11-27, BK = 64 -> 128, ms: GLA 1x8192x96x128
    # 0.559 -> 0.512, 8x2048x32x256 1.461 -> 1.339, 4x4096x64x128 0.643 -> 0.624), 64 on
    # thin grids (GLA 4x2048x16x128 0.099 -> 0.105, 2x16384x16x128 0.576 -> 0.629) and
    # for the scalar gate and the delta (1x8192x96x128: simple GLA 0.542 -> 0.568, the
    # delta rule 0.675 -> 0.855).
    bk = tile_width(args["K"], 128 if gated_gk and not few else 64)
    if (args.get("USE_GK") and not gated_gk) or args["K"] > 128 or not sixteen_bit(args):
        # At K = 256 the vector gate on the gated operands takes 64-column tiles too (GLA
        # 8x2048x32x256, H100, its space timed: 1.47 ms against 2.16 at 32), and so does
        # the scalar gate without W in 16 bits (simple GLA 8x2048x32x256: 1.14 ms against
        # 1.63; 2026-11-26 evening). With W, 32 columns stay: 64 do not fit 4 warps there.
        scalar_without_w = (not args.get("USE_GK") and not args["USE_W"]
                            and sixteen_bit(args))
        wide = args["K"] <= 128 or gated_gk or scalar_without_w
        if (args["K"] > 128 and args.get("DH_SCALED") and not args.get("USE_GK")
                and not few and 8 in warp_choices(stmatrix_prone=True)):
            # dh stored scaled (bf16, scalar gate) on a full grid: 64 columns at 8 warps
            # and two stages. H200 (Triton 3.6, bf16, FLA_TUNE=1, 2026-11-29 00:40 UTC),
            # 8x2048x32x256: with W 1.650 ms against 2.483 at 32 columns / 4 warps and
            # 2.456 at 64 / 4; without W (simple GLA) 1.496 against 1.527 at 64 / 4.
            return Config(BV=tile_width(args["V"], 64), BK=bk, num_warps=8,
                          num_stages=min(_dhu_stages(args)))
        return Config(BV=tile_width(args["V"], 64 if wide else 32), BK=bk, num_warps=4,
                      num_stages=min(_dhu_stages(args)))
    thin = few == 2
    # With W on a full grid dh stored scaled (DH_SCALED: a max over dS and a scaled copy a
    # chunk) keeps the rule below, 64 columns, 4 warps, three stages. H200 (Triton 3.6,
    # bf16, FLA_TUNE=1, 2026-11-28 22:00 UTC), 1x8192x96x128: 0.841 ms, against 0.846 at
    # two stages and 0.988 at 8 warps (offline, 4 warps spill 112-136 B there).
    # (8 warps only where this Triton builds them: see _dhu_space.)
    # A split's transitions without W (they store no dh) take three stages too: H200,
    # Triton 3.6, bf16, FLA_TUNE=1, 2026-11-29, simple GLA 2x16384x16x128 (192
    # programs): 0.096 ms against 0.123 at two; its output launch keeps two (0.281
    # against 0.417).
    warps = 8 if thin and not (args["USE_W"] or gated_gk) else 4
    deep = args["USE_W"] or few or args.get("TRANSITION", False)
    return Config(BV=tile_width(args["V"], 32 if thin else 64), BK=bk,
                  num_warps=min(warps, max(warp_choices(stmatrix_prone=True))),
                  num_stages=3 if deep else 2)


def _dhu_stages(args) -> tuple[int, ...]:
    # Pipeline stages that fit the 227 KB of shared memory on H100/H200 (Triton 3.6):
    # K > 128 overflows at three stages of the four [BT, 64] q/w/k tiles. The vector gate
    # (GLA, RWKV6) also stages the fp32 γ tiles: three stages overflow at K = 128 (239-271
    # KB) and two at K = 256 (247-271 KB), at every BV and warp count of the space; K = 64
    # drops three stages too (it fits, but was not faster where measured).
    # The forward's gated operands stage no γ tile: three stages fit at K = 128 (offline
    # sm_90: 128 KB at BV = 32, 152 KB at 64).
    if args.get("USE_GK"):
        if args.get("GATED_OPERANDS"):
            return (1, 2, 3) if args["K"] <= 128 else (1,)
        return (1, 2) if args["K"] <= 128 else (1,)
    return (2, 3) if args["K"] <= 128 else (2,)


def _dhu_space(args) -> list[Config]:
    bvs = sorted({tile_width(args["V"], b) for b in (32, 64)})
    # Triton 3.3.1 aborts building 8 warps at every K, with W or without (H100 config
    # sweeps at K = 64 and 128, 2026-11-26; offline builds had shown it at K = 256 only).
    warps = warp_choices(stmatrix_prone=True)
    if args["K"] > 128:
        # No 2 warps above K = 128: the scalar gate's 4-35x slower wherever timed
        # (8x2048x32x256: 5-60 ms against 1.1-2.5), the vector gate's 1.3x (GLA, 1.94 ms
        # against 1.47), and with the scaled dh and no W, 64 columns at 2 warps wrote out
        # of bounds (illegal address; H200, Triton 3.6, bf16, 2026-11-29 config sweep).
        warps = tuple(w for w in warps if w != 2)
    gated_gk = _vector_gate_on_gated_operands(args)
    rows = state_row_heights(args["K"]) if gated_gk else (tile_width(args["K"], 64),)
    return [Config(BV=bv, BK=bk, num_warps=w, num_stages=s)
            for bv in bvs for bk in rows for w in warps for s in _dhu_stages(args)]


@triton.jit
def _abs_max_by_row(b_x):
    """max |x| along each row of a [BK, BV] fp32 tile, as max(max, −min): [BK]. Along
    rows stays inside a warp in the MMA layout; no |x| copy beside the tile."""
    return tl.maximum(tl.max(b_x, axis=1), -tl.min(b_x, axis=1))


@triton.jit
def _gk_decay_to_end(b_x, g, p_g, m, b_gl, dt, GATED: tl.constexpr):
    """A [BT, BK] tile times exp(γ_L − γ) channel by channel (``b_gl`` [BK] = γ_L; the
    exponents are ≤ 0 and masked before exp), in ``dt``; ``GATED``: the tile is already
    K ⊙ exp(γ_L − γ) (the forward's gated operand)."""
    if GATED:
        return b_x.to(dt)
    b_g = tl.load(g + p_g, mask=m, other=0.).to(tl.float32)
    return (b_x.to(tl.float32) * tl.where(m, tl.exp(tl.where(m, b_gl[None, :] - b_g, 0.)),
                                          0.)).to(dt)


@triton.jit
def _gk_query_tile(b_q, gq, p_g, m, scale, dt, GATED: tl.constexpr):
    """scale · Q ⊙ exp(γq) for one [BT, BK] tile (γq chunk-local, ≤ 0), in ``dt``;
    ``GATED``: the tile is already Q ⊙ exp(γq)."""
    if GATED:
        return (b_q.to(tl.float32) * scale).to(dt)
    b_g = tl.load(gq + p_g, mask=m, other=0.).to(tl.float32)
    return (b_q.to(tl.float32) * scale * tl.exp(b_g)).to(dt)


@tuned(key=["k", "K", "V", "BT", "USE_G", "USE_W", "LOCAL_FROM_AQK", "USE_INITIAL_STATE",
             "USE_FINAL_STATE_GRADIENT", "USE_GK", "GQ_EXCLUSIVE", "GATED_OPERANDS",
             "FEW_PROGRAMS", "SPLIT", "TRANSITION", "X_ONLY", "DH_SCALED"],
       default=_dhu_default, space=_dhu_space)
@triton.jit(do_not_specialize=["T", "H"])
def chunk_gated_delta_rule_bwd_dhu_kernel(
    q, k, w, g, dht, dh0, do, dh, dv, dv2, Aqk, cu_seqlens, chunk_offsets, scale, T,
    H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, USE_W: tl.constexpr,
    LOCAL_FROM_AQK: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, USE_FINAL_STATE_GRADIENT: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    gq=None, USE_GK: tl.constexpr = False, GQ_EXCLUSIVE: tl.constexpr = False,
    GATED_OPERANDS: tl.constexpr = False, FEW_PROGRAMS: tl.constexpr = 0,
    segments=None, seg_state=None, seg_decay=None, SPLIT: tl.constexpr = False,
    TRANSITION: tl.constexpr = False, X_ONLY: tl.constexpr = False,
    dh_scale=None, DH_SCALED: tl.constexpr = False,
):
    """One program per (column tile, sequence·head) walks its sequence's chunks backwards.
    ``FEW_PROGRAMS`` (:func:`fla.utils.grid.grid_fill`) is read by the tuning layer only.

    dS[K, BV] is held in fp32 registers as up to four [BK, BV] tiles (BK = 64 or 128, a
    tuning choice): a K × BV block cannot be one tile for K up to 256 without spilling.

    With ``SPLIT`` a program walks one segment (row i_p of ``segments [P, 3]``: sequence,
    first chunk, end chunk; grid axis 1 is i_p·H + head), starting from the gradient
    leaving it, ``seg_state [P, H, K, V]``. With ``TRANSITION`` too it stores nothing per
    chunk: it runs the segment's affine map dS_in = M dS_out + X from dS_out = 0, on the
    augmented ``[M | X]`` (K x (K + V), from ``[I | 0]``; dO and dv_local reach only the X
    columns) with W, into ``seg_state [P, H, K, K + V]``; without W, M is e^{Σ γ_L} I:
    X into ``seg_state [P, H, K, V]`` and Σ γ_L into ``seg_decay [P, H]``. (No vector
    gate.) With W and ``X_ONLY`` the programs skip the column tiles that lie wholly in M
    (grid axis 0 starts at tile K // BV of ``[M | X]``): M's columns are left unwritten,
    the combine reading M from the forward's maps instead.
    :func:`fla.ops.common.chunk_state_combine.combine_segment_states` then turns the
    transitions into each segment's leaving gradient and dh0.

    With ``DH_SCALED`` dh is fp16 scaled per chunk and program: each chunk's [K, BV]
    block is stored divided by 2^(e − 14), 2^e ≥ its largest |value|, and that factor
    is written to ``dh_scale [B, NT, H, V]`` (fp32, per column): 11 significant bits
    for bf16's 8 at the same bytes (``chunk_bwd_dqkwg_kernel`` reads it back).
    """
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_p, i_h = i_nh // H, i_nh % H
    i_n, bos, T, first, end = segment_of_program(i_p, segments, cu_seqlens, T, BT, SPLIT,
                                                 IS_VARLEN)
    boh = first_chunk_row(i_n, chunk_offsets, T, BT, IS_VARLEN)
    dt = k.dtype.element_ty

    AUGMENTED: tl.constexpr = TRANSITION and USE_W
    WC: tl.constexpr = K + V if AUGMENTED else V      # the state's columns
    # X_ONLY: the first K // BV column tiles (M's alone) are not run.
    o_w, m_w, o_v, m_v = state_columns(i_v + X_ONLY * (K // BV), BV, K, V, AUGMENTED)
    o_k1 = tl.arange(0, BK)
    o_k2 = BK + o_k1
    o_k3 = 2 * BK + o_k1
    o_k4 = 3 * BK + o_k1
    m_k1 = o_k1 < K
    m_k2 = o_k2 < K
    m_k3 = o_k3 < K
    m_k4 = o_k4 < K

    b_dh1 = tl.zeros([BK, BV], dtype=tl.float32)
    if K > BK:
        b_dh2 = tl.zeros([BK, BV], dtype=tl.float32)
    if K > 2 * BK:
        b_dh3 = tl.zeros([BK, BV], dtype=tl.float32)
    if K > 3 * BK:
        b_dh4 = tl.zeros([BK, BV], dtype=tl.float32)

    state_base = i_nh.to(tl.int64) * K * V
    if AUGMENTED:
        # [I | 0]: ones where the state row equals the column.
        b_dh1 += (o_k1[:, None] == o_w[None, :]).to(tl.float32)
        if K > BK:
            b_dh2 += (o_k2[:, None] == o_w[None, :]).to(tl.float32)
        if K > 2 * BK:
            b_dh3 += (o_k3[:, None] == o_w[None, :]).to(tl.float32)
        if K > 3 * BK:
            b_dh4 += (o_k4[:, None] == o_w[None, :]).to(tl.float32)
    # Pointer names are never reused across the chunk loop: a name assigned before a
    # `for` and inside it is loop-carried and must keep its type (dht is fp32, dh is not).
    if (SPLIT and not TRANSITION) or (USE_FINAL_STATE_GRADIENT and not SPLIT):
        if SPLIT:
            # The segment's leaving gradient (seg_state's row i_p·H + i_h is i_nh).
            p_dht = seg_state + state_base + o_v[None, :]
        else:
            p_dht = dht + state_base + o_v[None, :]
        b_dh1 += tl.load(p_dht + o_k1[:, None] * V, mask=m_k1[:, None] & m_v[None, :],
                         other=0.).to(tl.float32)
        if K > BK:
            b_dh2 += tl.load(p_dht + o_k2[:, None] * V, mask=m_k2[:, None] & m_v[None, :],
                             other=0.).to(tl.float32)
        if K > 2 * BK:
            b_dh3 += tl.load(p_dht + o_k3[:, None] * V, mask=m_k3[:, None] & m_v[None, :],
                             other=0.).to(tl.float32)
        if K > 3 * BK:
            b_dh4 += tl.load(p_dht + o_k4[:, None] * V, mask=m_k4[:, None] & m_v[None, :],
                             other=0.).to(tl.float32)

    b_log_decay = tl.zeros([], dtype=tl.float32)   # Σ γ_L over a transition's chunks
    for i_t in range(end - 1, first - 1, -1):
        if not TRANSITION:
            # dh[chunk] = ∂L/∂(state leaving the chunk), what chunk_bwd_dqkwg pairs with Vn.
            p_dh = dh + ((boh + i_t) * H + i_h) * K * V + o_v[None, :]
            if DH_SCALED:
                # The block's largest |value| (rows past K and columns past V hold 0):
                # each tile's rows first, max(max, −min) along a row staying inside a warp,
                # then the tiles' [BK] vectors elementwise and one reduction across warps.
                # A whole-block tl.max per tile pays that cross-warp step eight times.
                b_row_max = _abs_max_by_row(b_dh1)
                if K > BK:
                    b_row_max = tl.maximum(b_row_max, _abs_max_by_row(b_dh2))
                if K > 2 * BK:
                    b_row_max = tl.maximum(b_row_max, _abs_max_by_row(b_dh3))
                if K > 3 * BK:
                    b_row_max = tl.maximum(b_row_max, _abs_max_by_row(b_dh4))
                b_max = tl.max(b_row_max, axis=0)
                # A power of two (exact to apply and undo); 1e-30 keeps an all-zero
                # block's factor finite.
                b_exp = tl.ceil(tl.log2(tl.maximum(b_max, 1e-30)))
                b_inv = tl.exp2(14.0 - b_exp)
                tl.store(dh_scale + ((boh + i_t) * H + i_h) * V + o_v,
                         tl.zeros([BV], dtype=tl.float32) + tl.exp2(b_exp - 14.0), mask=m_v)
            else:
                b_inv = 1.0
            tl.store(p_dh + o_k1[:, None] * V, (b_dh1 * b_inv).to(dh.dtype.element_ty),
                     mask=m_k1[:, None] & m_v[None, :])
            if K > BK:
                tl.store(p_dh + o_k2[:, None] * V, (b_dh2 * b_inv).to(dh.dtype.element_ty),
                         mask=m_k2[:, None] & m_v[None, :])
            if K > 2 * BK:
                tl.store(p_dh + o_k3[:, None] * V, (b_dh3 * b_inv).to(dh.dtype.element_ty),
                         mask=m_k3[:, None] & m_v[None, :])
            if K > 3 * BK:
                tl.store(p_dh + o_k4[:, None] * V, (b_dh4 * b_inv).to(dh.dtype.element_ty),
                         mask=m_k4[:, None] & m_v[None, :])

        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        rows = bos + o_t                       # int64 token indices
        last = tl.minimum((i_t + 1) * BT, T) - 1
        if USE_G:
            b_g = tl.load(g + rows * H + i_h, mask=m_t, other=0.).to(tl.float32)
            b_g_last = tl.load(g + (bos + last) * H + i_h).to(tl.float32)
            # Decay from each token to the chunk's end: exponent γ_L − γ_t ≤ 0, masked first.
            b_decay = tl.where(m_t, tl.exp(tl.where(m_t, b_g_last - b_g, 0.)), 0.)
            if TRANSITION:
                b_log_decay += b_g_last

        # dVn = dv_local + (K ⊙ exp(γ_L − γ)) dS
        k_rows = rows[:, None] * (H * K) + i_h * K
        if USE_GK:
            if GQ_EXCLUSIVE:
                # The query reads the state before its token: γq_t = γ_{t−1} (0 at the
                # chunk's first row), read from γ one row up.
                gq_shift = -H * K
                m_q = m_t & (tl.arange(0, BT) > 0)
            else:
                gq_shift = 0
                m_q = m_t
            # γ_L per channel: the decay of each state row over the rest of the chunk.
            p_gl = g + (bos + last) * H * K + i_h * K
            b_gl1 = tl.load(p_gl + o_k1, mask=m_k1, other=0.).to(tl.float32)
            if K > BK:
                b_gl2 = tl.load(p_gl + o_k2, mask=m_k2, other=0.).to(tl.float32)
            if K > 2 * BK:
                b_gl3 = tl.load(p_gl + o_k3, mask=m_k3, other=0.).to(tl.float32)
            if K > 3 * BK:
                b_gl4 = tl.load(p_gl + o_k4, mask=m_k4, other=0.).to(tl.float32)
        b_dv2 = tl.zeros([BT, BV], dtype=tl.float32)
        b_k = tl.load(k + k_rows + o_k1[None, :], mask=m_t[:, None] & m_k1[None, :], other=0.)
        if USE_GK:
            # exp(γ_L − γ) = 1 / exp(γ − γ_L): passed as exp(−(γ − γ_L)) via the negated
            # reference, never as a quotient.
            b_k = _gk_decay_to_end(b_k, g, k_rows + o_k1[None, :],
                                   m_t[:, None] & m_k1[None, :], b_gl1, dt,
                                   GATED_OPERANDS)
        b_dv2 += tl.dot(b_k, b_dh1.to(dt), input_precision=DOT_PRECISION)
        if K > BK:
            b_k = tl.load(k + k_rows + o_k2[None, :], mask=m_t[:, None] & m_k2[None, :],
                          other=0.)
            if USE_GK:
                b_k = _gk_decay_to_end(b_k, g, k_rows + o_k2[None, :],
                                       m_t[:, None] & m_k2[None, :], b_gl2, dt,
                                       GATED_OPERANDS)
            b_dv2 += tl.dot(b_k, b_dh2.to(dt), input_precision=DOT_PRECISION)
        if K > 2 * BK:
            b_k = tl.load(k + k_rows + o_k3[None, :], mask=m_t[:, None] & m_k3[None, :],
                          other=0.)
            if USE_GK:
                b_k = _gk_decay_to_end(b_k, g, k_rows + o_k3[None, :],
                                       m_t[:, None] & m_k3[None, :], b_gl3, dt,
                                       GATED_OPERANDS)
            b_dv2 += tl.dot(b_k, b_dh3.to(dt), input_precision=DOT_PRECISION)
        if K > 3 * BK:
            b_k = tl.load(k + k_rows + o_k4[None, :], mask=m_t[:, None] & m_k4[None, :],
                          other=0.)
            if USE_GK:
                b_k = _gk_decay_to_end(b_k, g, k_rows + o_k4[None, :],
                                       m_t[:, None] & m_k4[None, :], b_gl4, dt,
                                       GATED_OPERANDS)
            b_dv2 += tl.dot(b_k, b_dh4.to(dt), input_precision=DOT_PRECISION)
        if USE_G:
            b_dv2 *= b_decay[:, None]
        v_off = rows[:, None] * (H * V) + i_h * V + o_v[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_do = tl.load(do + v_off, mask=m_tv, other=0.).to(dt)
        if LOCAL_FROM_AQK:
            # dv_local = scale·Aqkᵀ dO from the forward's causal scores: no separate kernel
            # and no dv round trip through memory.
            o_c = tl.arange(0, BT)
            b_a = tl.load(Aqk + (rows[:, None] * H + i_h) * BT + o_c[None, :],
                          mask=m_t[:, None], other=0.).to(dt)
            b_dv2 += scale * tl.dot(tl.trans(b_a), b_do, input_precision=DOT_PRECISION)
        else:
            b_dv2 += tl.load(dv + v_off, mask=m_tv, other=0.).to(tl.float32)
        if not TRANSITION:
            tl.store(dv2 + v_off, b_dv2.to(dv2.dtype.element_ty), mask=m_tv)

        # dS ← exp(γ_L) dS + scale·(Q ⊙ exp(γ))ᵀ dO − Wᵀ dVn
        b_dv2c = b_dv2.to(dt)
        if USE_G:
            b_qscale = scale * tl.exp(b_g)     # γ ≤ 0 in a chunk: exp(γ) ≤ 1
            b_last = tl.exp(b_g_last)
        else:
            b_qscale = tl.full([BT], scale, dtype=tl.float32)

        b_q = tl.load(q + k_rows + o_k1[None, :], mask=m_t[:, None] & m_k1[None, :], other=0.)
        if USE_W:
            b_w = tl.load(w + k_rows + o_k1[None, :], mask=m_t[:, None] & m_k1[None, :],
                          other=0.)
        if USE_GK:
            b_q = _gk_query_tile(b_q, gq, k_rows + o_k1[None, :] + gq_shift,
                                 m_q[:, None] & m_k1[None, :],
                                 scale, dt, GATED_OPERANDS)
            b_dh1 *= tl.exp(b_gl1)[:, None]
        else:
            b_q = (b_q.to(tl.float32) * b_qscale[:, None]).to(dt)
        if USE_G:
            b_dh1 *= b_last
        b_dh1 += tl.dot(tl.trans(b_q), b_do, input_precision=DOT_PRECISION)
        if USE_W:
            b_dh1 -= tl.dot(tl.trans(b_w.to(dt)), b_dv2c,
                            input_precision=DOT_PRECISION)
        if K > BK:
            b_q = tl.load(q + k_rows + o_k2[None, :], mask=m_t[:, None] & m_k2[None, :],
                          other=0.)
            if USE_W:
                b_w = tl.load(w + k_rows + o_k2[None, :], mask=m_t[:, None] & m_k2[None, :],
                              other=0.)
            if USE_GK:
                b_q = _gk_query_tile(b_q, gq, k_rows + o_k2[None, :] + gq_shift,
                                     m_q[:, None] & m_k2[None, :], scale, dt,
                                     GATED_OPERANDS)
                b_dh2 *= tl.exp(b_gl2)[:, None]
            else:
                b_q = (b_q.to(tl.float32) * b_qscale[:, None]).to(dt)
            if USE_G:
                b_dh2 *= b_last
            b_dh2 += tl.dot(tl.trans(b_q), b_do, input_precision=DOT_PRECISION)
            if USE_W:
                b_dh2 -= tl.dot(tl.trans(b_w.to(dt)), b_dv2c,
                                input_precision=DOT_PRECISION)
        if K > 2 * BK:
            b_q = tl.load(q + k_rows + o_k3[None, :], mask=m_t[:, None] & m_k3[None, :],
                          other=0.)
            if USE_W:
                b_w = tl.load(w + k_rows + o_k3[None, :], mask=m_t[:, None] & m_k3[None, :],
                              other=0.)
            if USE_GK:
                b_q = _gk_query_tile(b_q, gq, k_rows + o_k3[None, :] + gq_shift,
                                     m_q[:, None] & m_k3[None, :], scale, dt,
                                     GATED_OPERANDS)
                b_dh3 *= tl.exp(b_gl3)[:, None]
            else:
                b_q = (b_q.to(tl.float32) * b_qscale[:, None]).to(dt)
            if USE_G:
                b_dh3 *= b_last
            b_dh3 += tl.dot(tl.trans(b_q), b_do, input_precision=DOT_PRECISION)
            if USE_W:
                b_dh3 -= tl.dot(tl.trans(b_w.to(dt)), b_dv2c,
                                input_precision=DOT_PRECISION)
        if K > 3 * BK:
            b_q = tl.load(q + k_rows + o_k4[None, :], mask=m_t[:, None] & m_k4[None, :],
                          other=0.)
            if USE_W:
                b_w = tl.load(w + k_rows + o_k4[None, :], mask=m_t[:, None] & m_k4[None, :],
                              other=0.)
            if USE_GK:
                b_q = _gk_query_tile(b_q, gq, k_rows + o_k4[None, :] + gq_shift,
                                     m_q[:, None] & m_k4[None, :], scale, dt,
                                     GATED_OPERANDS)
                b_dh4 *= tl.exp(b_gl4)[:, None]
            else:
                b_q = (b_q.to(tl.float32) * b_qscale[:, None]).to(dt)
            if USE_G:
                b_dh4 *= b_last
            b_dh4 += tl.dot(tl.trans(b_q), b_do, input_precision=DOT_PRECISION)
            if USE_W:
                b_dh4 -= tl.dot(tl.trans(b_w.to(dt)), b_dv2c,
                                input_precision=DOT_PRECISION)

    if TRANSITION:
        # [M | X] (or X) of the segment; the decay of a scalar M once per segment.
        p_mx = seg_state + i_nh.to(tl.int64) * K * WC + o_w[None, :]
        tl.store(p_mx + o_k1[:, None] * WC, b_dh1, mask=m_k1[:, None] & m_w[None, :])
        if K > BK:
            tl.store(p_mx + o_k2[:, None] * WC, b_dh2, mask=m_k2[:, None] & m_w[None, :])
        if K > 2 * BK:
            tl.store(p_mx + o_k3[:, None] * WC, b_dh3, mask=m_k3[:, None] & m_w[None, :])
        if K > 3 * BK:
            tl.store(p_mx + o_k4[:, None] * WC, b_dh4, mask=m_k4[:, None] & m_w[None, :])
        if not USE_W:
            if i_v == 0:
                tl.store(seg_decay + i_nh, b_log_decay)
    elif USE_INITIAL_STATE and not SPLIT:
        p_dh0 = dh0 + state_base + o_v[None, :]
        tl.store(p_dh0 + o_k1[:, None] * V, b_dh1.to(dh0.dtype.element_ty),
                 mask=m_k1[:, None] & m_v[None, :])
        if K > BK:
            tl.store(p_dh0 + o_k2[:, None] * V, b_dh2.to(dh0.dtype.element_ty),
                     mask=m_k2[:, None] & m_v[None, :])
        if K > 2 * BK:
            tl.store(p_dh0 + o_k3[:, None] * V, b_dh3.to(dh0.dtype.element_ty),
                     mask=m_k3[:, None] & m_v[None, :])
        if K > 3 * BK:
            tl.store(p_dh0 + o_k4[:, None] * V, b_dh4.to(dh0.dtype.element_ty),
                     mask=m_k4[:, None] & m_v[None, :])


def scaled_dh_buffer(k: torch.Tensor, g: torch.Tensor | None,
                     h: torch.Tensor) -> torch.Tensor | None:
    """The ``dh_scale`` buffer ``[B, NT, H, V]`` float32 for the reverse pass where a scaled
    fp16 dh pays, else None: bf16 inputs with a scalar gate (``h [B, NT, H, K, V]`` the
    per-chunk states, for the sizes). There dγ = q·dq − k·dk cancels, and bf16's rounding
    of dh in k's state term took dg past 5e-3 at unit-norm queries (emulated: the gated
    delta rule 7.8e-3, simple GLA 5.8e-3; benchmarks/NOTES.md, 2026-11-28 19:15- and
    21:52-). fp16 inputs store dh in fp16 anyway, where a power of two changes no bit in
    range; fp32 keeps fp32's dh."""
    if g is None or g.dim() != 3 or k.dtype != torch.bfloat16:
        return None
    return torch.empty(*h.shape[:3], h.shape[-1], dtype=torch.float32, device=k.device)


def chunk_gated_delta_rule_bwd_dhu(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor | None,
    g: torch.Tensor | None,
    h0: torch.Tensor | None,
    dht: torch.Tensor | None,
    do: torch.Tensor,
    dv: torch.Tensor | None,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    chunk_indices: torch.Tensor | None = None,
    Aqk: torch.Tensor | None = None,
    gq: torch.Tensor | None = None,
    gq_exclusive: bool = False,
    gated_operands: bool = False,
    segment_chunks: int = 0,
    offsets: list[int] | None = None,
    segment_maps: torch.Tensor | None = None,
    dh_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Reverse state pass: per-chunk state gradients, ``initial_state``'s gradient and dVn.

    Args:
        q, k, w: ``[B, T, H, K]`` (w = W of the WY form; None when Vn = U, as in simple
            GLA), fp32/fp16/bf16, K ≤ 256.
        g: ``[B, T, H]`` chunk-local cumulative log decay γ (fp32), or None (no decay);
            or ``[B, T, H, K]`` fp32, a vector gate (GLA / RWKV6).
        h0: the forward's ``initial_state`` ``[N, H, K, V]`` or None; only decides whether
            ``dh0`` is computed.
        dht: ``[N, H, K, V]`` gradient of the final state, or None (zero).
        do: ``[B, T, H, V]`` gradient of the output.
        dv: ``[B, T, H, V]`` intra-chunk gradient of Vn (``chunk_bwd_dv_local``), or None
            with ``Aqk``.
        scale: the output scale (default ``K ** -0.5``).
        cu_seqlens: ``[N + 1]`` packed-sequence offsets (B == 1).
        chunk_size: BT (64).
        chunk_indices: ``[NT, 2]`` rows for ``cu_seqlens`` (built here when None).
        Aqk: ``[B, T, H, BT]`` the forward's causal gated scores (``chunk_fwd_intra``'s,
            or those the simple GLA forward pass wrote to its ``scores_out``);
            given, the pass computes dv_local = scale·Aqkᵀ dO itself and ``dv`` is unused.
        gq: with a vector gate, the query side's cumulative gate ``[B, T, H, K]`` fp32
            (RWKV6: exclusive, γ − w); None: γ itself.
        gq_exclusive: with a vector gate, the query side's gate is γ one token earlier
            (RWKV6's γ − w, read from g itself; ``gq`` is ignored).
        gated_operands: with a vector gate, q and k are the forward's gated operands
            Q ⊙ exp(γq) and K ⊙ exp(γ_L − γ) (``chunk_gk_fwd_A``'s qg and kg): the pass
            then reads only γ_L from g and runs no exponential over a tile.
        segment_chunks: cut each sequence into segments of this many chunks (0: walk
            whole sequences): the segments' affine maps (transitions, in parallel), their
            serial combine from dht, then every segment walked from its leaving gradient,
            in parallel; for few long sequences, whose whole walks leave the GPU idle. No
            vector gate.
        offsets: the host copy of ``cu_seqlens`` (needed with it for ``segment_chunks``).
        segment_maps: with W, ``segment_chunks`` and no ``dht``, the forward pass's
            transitions ``[P, H, K, K + V]`` float32 over the same segments
            (:func:`fla.ops.common.chunk_fwd_inter.chunk_gated_delta_rule_fwd_inter`'s
            ``return_segment_maps``; each sequence's last row unset). A segment's reverse
            map is the transpose of its forward map M, so the transitions then run on
            the X columns alone (half the columns at K = V) and the combine reads M
            from these, transposed.
        dh_scale: a ``[B, NT, H, V]`` float32 buffer (contiguous): dh is then returned
            in fp16, each chunk's block scaled by a power of two written here per column
            (``chunk_bwd_dqkwg``'s ``dh_scale`` reads it back): 11 significant bits
            instead of bf16's 8 at the same bytes. No vector gate. Meant for bf16 inputs
            (the ops pass it only there); with fp32 inputs it stores fp32's dh in fp16,
            which the tests use to check the scaling against the fp32 pass.

    Returns:
        ``(dh, dh0, dv2)``:
        dh ``[B, NT, H, K, V]`` in k's dtype (fp16 with ``dh_scale``: dh / dh_scale),
        ``dh[:, c]`` = ∂L/∂S' for the state S' *leaving*
        chunk c (the adjoint the reverse pass carries into chunk c; what
        ``chunk_bwd_dqkwg`` needs); with ``cu_seqlens`` B = 1 and NT counts the chunks of
        all sequences;
        dh0 ``[N, H, K, V]`` float32, ∂L/∂initial_state, or None when ``h0`` is None;
        dv2 ``[B, T, H, V]`` in dv's (else do's) dtype, the full gradient of Vn (= ∂L/∂U).
    """
    check_kernel_device(q, k, w, g, do, dv, Aqk)
    B, T, H, K = k.shape
    V = do.shape[-1]
    if K > 256:
        raise ValueError(f"k: expected head dimension K <= 256, got {K}")
    BT = chunk_size
    scale = K ** -0.5 if scale is None else float(scale)
    q, k, do = q.contiguous(), k.contiguous(), do.contiguous()
    w, dv, Aqk = (None if x is None else x.contiguous() for x in (w, dv, Aqk))
    g = None if g is None else g.contiguous()
    vector_gate = g is not None and g.dim() == 4
    if vector_gate:
        gq = g if gq is None or gq_exclusive else gq.contiguous()
    if cu_seqlens is not None:
        chunk_indices = varlen_chunk_indices(cu_seqlens, BT, chunk_indices)
        chunk_offsets = prepare_chunk_offsets(cu_seqlens, BT).to(k.device)
        N, NT = cu_seqlens.numel() - 1, chunk_indices.shape[0]
    else:
        chunk_offsets = None
        N, NT = B, cdiv(T, BT)
    if dht is not None:
        dht = dht.contiguous()
    if dh_scale is not None:
        if vector_gate:
            raise ValueError("dh_scale: not with a vector gate")
        check_buffer("dh_scale", dh_scale, (B, NT, H, V), torch.float32, k.device)
    dh = k.new_empty(B, NT, H, K, V, dtype=k.dtype if dh_scale is None else torch.float16)
    dh0 = torch.empty(N, H, K, V, dtype=torch.float32, device=k.device) if h0 is not None else None
    dv2 = torch.empty_like(do if dv is None else dv)

    kernel = chunk_gated_delta_rule_bwd_dhu_kernel
    common = dict(q=q, k=k, w=w, g=g, do=do, dh=dh, dv=dv, dv2=dv2, Aqk=Aqk,
                  cu_seqlens=cu_seqlens, chunk_offsets=chunk_offsets, scale=scale, T=T,
                  H=H, K=K, V=V, BT=BT, USE_G=g is not None and not vector_gate,
                  USE_W=w is not None, LOCAL_FROM_AQK=Aqk is not None,
                  IS_VARLEN=cu_seqlens is not None, DOT_PRECISION=dot_precision(k.dtype),
                  dh_scale=dh_scale, DH_SCALED=dh_scale is not None)
    if not segment_chunks:
        kernel[lambda meta: (cdiv(V, meta["BV"]), N * H)](
            dht=dht, dh0=dh0, USE_INITIAL_STATE=dh0 is not None,
            USE_FINAL_STATE_GRADIENT=dht is not None,
            FEW_PROGRAMS=sequential_grid_fill(N, H, V), **common,
            **(dict(gq=gq, USE_GK=True, GQ_EXCLUSIVE=gq_exclusive,
                    GATED_OPERANDS=gated_operands) if vector_gate else {}),
        )
        return dh, dh0, dv2

    if vector_gate:
        raise ValueError("segment_chunks: the reverse pass splits only without a vector gate")
    if cu_seqlens is not None and offsets is None:
        raise ValueError("segment_chunks with cu_seqlens needs its host copy, offsets")
    if offsets is None:
        offsets = list(range(0, B * T + 1, T))
    segments, seg_offsets = segment_tables(offsets, segment_chunks, k.device, reverse=True)
    P = segments.shape[0]
    width = K + V if w is not None else V
    mx = torch.empty(P, H, K, width, dtype=torch.float32, device=k.device)
    seg_decay = None if w is not None else torch.empty(P, H, dtype=torch.float32,
                                                       device=k.device)
    split = dict(segments=segments, SPLIT=True, FEW_PROGRAMS=0, USE_INITIAL_STATE=False,
                 USE_FINAL_STATE_GRADIENT=False, dht=None, dh0=None)
    x_only = w is not None and dht is None and segment_maps is not None
    if x_only:
        check_buffer("segment_maps", segment_maps, (P, H, K, K + V), torch.float32, k.device)
    kernel[lambda meta: (cdiv(width, meta["BV"]) - (K // meta["BV"] if x_only else 0),
                         P * H)](
        seg_state=mx, seg_decay=seg_decay, TRANSITION=True, X_ONLY=x_only, **split,
        # The transitions store no dh: no scale (and no second variant to build and tune).
        **dict(common, dh_scale=None, DH_SCALED=False))
    # Segments listed last to first: the combine's "entering" state of each is the
    # gradient leaving it, and its final state the gradient of the initial state.
    leaving = combine_segment_states(mx, seg_decay, "delta" if w is not None else "scalar",
                                     seg_offsets, V, dht, dh0,
                                     forward_maps=segment_maps if x_only else None)
    kernel[lambda meta: (cdiv(V, meta["BV"]), P * H)](
        seg_state=leaving, TRANSITION=False, **split, **common)
    return dh, dh0, dv2
