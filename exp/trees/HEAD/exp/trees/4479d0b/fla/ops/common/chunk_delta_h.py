"""Stage 3 of the chunked gated delta rule (ALGORITHMS.md §1): the state pass.

The only sequential part. For each chunk in order, with S the state entering it and γ
the chunk-local cumulative log decay (γ_C at the chunk's last valid token):

    h[chunk] = S
    Vn       = U − W · S
    S        ← exp(γ_C) · S + (K ⊙ exp(γ_C − γ))ᵀ · Vn

Without W (``w=None``) Vn = U: the state pass of simple GLA (ALGORITHMS.md §2), which
calls this stage with U = V.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fla.ops.common.chunk_torch import chunk_gated_delta_rule_fwd_h_torch
from fla.ops.utils.index import first_chunk_row, locate_sequence, varlen_chunk_offsets
from fla.ops.utils.state_tiles import decay_state_tiles, load_state_tiles, store_state_tiles
from fla.ops.utils.tiles import check_chunk_size, sixteen_bit, tile_width
from fla.utils.backend import Backend, select_backend
from fla.utils.custom_ops import present, stage_op, use_op
from fla.utils.grid import cdiv, sequential_grid_fill
from fla.utils.triton_facts import dot_precision, warp_choices
from fla.utils.tuning import Config, tuned
from fla.utils.validation import (
    Dims,
    check_cu_seqlens,
    check_dtype,
    check_head_dim,
    check_positive_length,
    check_same_device,
    check_shape,
    check_tensor,
    token_layout,
)

__all__ = ["chunk_gated_delta_rule_fwd_h", "chunk_gated_delta_rule_fwd_h_kernel"]


def _default(args) -> Config:
    # The K×BV fp32 state lives in registers for the whole sequence: K·BV/(32·warps)
    # registers per thread. BV = 64 up to K = 128 and 32 beyond keeps it at 64 per
    # thread with 4 warps (K = 256: 4 tiles of 64×32), leaving room for the W, K and
    # Vn operand tiles without spilling.
    # Up to K = 128, a thin grid (FEW_PROGRAMS, set by the launcher: 1 when no SM would
    # hold two 64-column programs, 2 when no SM would hold two 32-column ones) takes
    # deeper pipelines, and at 2 BV = 32: each program's chain of chunks is the bound,
    # and a lone program has the shared memory. H100 (Triton 3.6, bf16, 2026-11-26), with
    # W / without: 2x16384x16x128 0.32 / 0.22 ms against 0.59 / 0.41 at the old default
    # (BV = 64, 2 stages); 4x2048x16x128 (fill 1, 3 stages) 0.077 / 0.055 against 0.095
    # / 0.075; 1x8192x64x128 0.29 / 0.20 against 0.38 / 0.29. With SMs to share
    # (1x8192x96x128) two stages stay best: 0.47 / 0.34 ms against 0.51 / 0.34 at three.
    few = args.get("FEW_PROGRAMS", 0) if args["K"] <= 128 and sixteen_bit(args) else 0
    # (At K = 64 the 32-column tiles measured no better: 8x1024x8x64 0.085 ms with W at
    # four stages against 0.025 at BV = 64.) Above K = 128 without W (simple GLA's
    # pass, forward and backward; 16-bit operands), 64 columns despite the 128 state
    # registers a thread: 8x2048x32x256 0.58 ms against 0.70 at BV = 32 (H100,
    # 2026-11-26 evening).
    K = args["K"]
    wide_without_w = K > 128 and args.get("w") is None and sixteen_bit(args)
    width = 64 if K <= 64 or (K <= 128 and few < 2) or wide_without_w else 32
    BV = tile_width(args["V"], width)
    KH = K
    if len(row_blocks(args)) > 1 and K in (128, 256) and few == 0 and sixteen_bit(args):
        # Without W on a full grid, half the rows a program (twice the programs; BV = 128
        # at K = 256: a 128 x 128 block, the registers of 256 x 64). The pass writes h
        # every chunk and is near its memory bound, so the gain is modest. H100, Triton
        # 3.6, bf16, 2026-11-27 (each config forced, h bit-equal): 1x8192x96x128 0.324 ms
        # against 0.336 at all rows, 4x4096x64x128 0.386 against 0.441, 8x2048x32x256
        # 0.566 against 0.582. Thin grids keep all rows and deeper pipelines: on an H200
        # 4x2048x16x128 0.041 ms at all rows and 4 stages against 0.045 at 64 rows,
        # 1x8192x64x128 0.150 against 0.171.
        KH, BV = K // 2, tile_width(args["V"], K // 2)
    return Config(BV=BV, KH=KH, num_warps=4,
                  num_stages=min((2, 3, 4)[few], max(_stage_counts(args, BV, KH))))


def _stage_counts(args, BV: int, KH: int) -> tuple[int, ...]:
    # Each pipeline stage buffers one chunk of W and K (BT×KH each, KH the program's rows
    # of K: all of them with W) and of U (BT×BV) in shared memory: deeper pipelines than
    # ~170 KB of stage buffers do not fit H100's 227 KB next to the layout-conversion
    # scratch (K = 256 in bf16: 2 stages at most, in fp32 one).
    k = args.get("k")
    size = k.element_size() if isinstance(k, torch.Tensor) else 2
    per_stage = args.get("BT", 64) * (2 * KH + BV) * size
    return tuple(s for s in (1, 2, 3, 4) if s == 1 or s * per_stage <= 170 * 1024)


def row_blocks(args) -> tuple[int, ...]:
    """The state rows a program may hold (``KH``): all K, and without W, whose rows
    then evolve independently, also blocks of 128 and 64 rows dividing K (more
    programs with smaller states: a shorter chain of work a chunk)."""
    K = args["K"]
    if "w" not in args or args["w"] is not None:
        return (K,)
    return (K,) + tuple(r for r in (128, 64) if r < K and K % r == 0)


def _space(args) -> list[Config]:
    # Triton 3.3.1 aborts building 8 warps above K = 128, and with W at K = 128 too (H100
    # config sweep, 2026-11-26; so with W none at any K); without W up to K = 128 it
    # built and ran all of them.
    configs = []
    for KH in row_blocks(args):
        warps = warp_choices(stmatrix_prone=KH > 128 or args.get("w") is not None)
        for bv in (32, 64, 128) if KH < args["K"] else (32, 64):
            BV = tile_width(args["V"], bv)
            configs += [Config(BV=BV, KH=KH, num_warps=w, num_stages=s)
                        for s in _stage_counts(args, BV, KH) for w in warps]
    return list(dict.fromkeys(configs))


@tuned(key=["K", "V", "BT", "k", "w", "FEW_PROGRAMS"], default=_default, space=_space)
@triton.jit(do_not_specialize=["T", "H"])
def chunk_gated_delta_rule_fwd_h_kernel(
    k, w, u, g, h, v_new, h0, ht, cu_seqlens, chunk_offsets, T,
    H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, USE_W: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
    SAVE_NEW_VALUE: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FEW_PROGRAMS: tl.constexpr = 0, KH: tl.constexpr = 0,
):
    """One program per (K rows, V tile, head, sequence), looping over the sequence's chunks.
    ``FEW_PROGRAMS`` (:func:`fla.utils.grid.grid_fill`) is read by the tuning layer only.

    The program's KH×BV block of the state (KH = K, or without W a divisor of K: the
    state's rows then evolve independently, so programs can split them) is held as up
    to four BK×BV fp32 accumulators (KH ≤ 4·BK = 256): one 2-D tile per 64 rows keeps
    every ``tl.dot`` at a 64-wide reduction and lets the compiler drop the tiles a small
    K does not need. The grid's first axis runs over V tiles, then K blocks.
    """
    tl.static_assert(KH == K or (not USE_W and K % KH == 0),
                     "rows split over programs only without W, in whole blocks")
    if KH < K:
        NV: tl.constexpr = (V + BV - 1) // BV
        i_kv = tl.program_id(0)
        i_k, i_v = i_kv // NV, i_kv % NV
        # This program's rows of K, S and the states: shift every base to them.
        k += i_k * KH
        row_shift = i_k * KH * V
    else:
        i_k, i_v = 0, tl.program_id(0)
        row_shift = 0
    i_h, i_n = tl.program_id(1), tl.program_id(2)
    bos, T = locate_sequence(i_n, T, cu_seqlens, IS_VARLEN)
    NT = tl.cdiv(T, BT)
    boh = first_chunk_row(i_n, chunk_offsets, T, BT, IS_VARLEN)

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    # The state as row tiles of the K x V matrix (fla.ops.utils.state_tiles).
    o_s = o_k[:, None] * V + o_v[None, :] + row_shift
    state = (i_n.to(tl.int64) * H + i_h) * (K * V)
    b_h1, b_h2, b_h3, b_h4 = load_state_tiles(h0, state, o_s, o_k, m_v, KH, V, BK, BV,
                                              USE_INITIAL_STATE)

    for i_t in range(NT):
        row0 = bos + i_t * BT
        m_t = (i_t * BT + o_t) < T

        # h[chunk] = the state entering it.
        store_state_tiles(h, ((boh + i_t) * H + i_h) * (K * V), b_h1, b_h2, b_h3, b_h4, o_s,
                          o_k, m_v, KH, V, BK)

        o_tv = (row0 * H + i_h) * V + o_t[:, None] * (H * V) + o_v[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_v = tl.load(u + o_tv, mask=m_tv, other=0.).to(tl.float32)
        if USE_W:
            # Vn = U − W·S (16-bit operands, fp32 accumulation).
            p_w = w + (row0 * H + i_h) * K + o_t[:, None] * (H * K) + o_k[None, :]
            b_w = tl.load(p_w, mask=m_t[:, None] & (o_k < K)[None, :], other=0.)
            b_v -= tl.dot(b_w, b_h1.to(w.dtype.element_ty), input_precision=DOT_PRECISION)
            if K > BK:
                b_w = tl.load(p_w + BK, mask=m_t[:, None] & (BK + o_k < K)[None, :], other=0.)
                b_v -= tl.dot(b_w, b_h2.to(w.dtype.element_ty), input_precision=DOT_PRECISION)
            if K > 2 * BK:
                b_w = tl.load(p_w + 2 * BK, mask=m_t[:, None] & (2 * BK + o_k < K)[None, :],
                              other=0.)
                b_v -= tl.dot(b_w, b_h3.to(w.dtype.element_ty), input_precision=DOT_PRECISION)
            if K > 3 * BK:
                b_w = tl.load(p_w + 3 * BK, mask=m_t[:, None] & (3 * BK + o_k < K)[None, :],
                              other=0.)
                b_v -= tl.dot(b_w, b_h4.to(w.dtype.element_ty), input_precision=DOT_PRECISION)
        if SAVE_NEW_VALUE:
            if i_k == 0:  # one program of the row blocks writes Vn
                tl.store(v_new + o_tv, b_v.to(v_new.dtype.element_ty), mask=m_tv)

        if USE_G:
            # Decay to the chunk's last valid token; every exponent is a difference
            # γ_C − γ_t ≤ 0 (rows past the end are masked before they could overflow).
            last = tl.minimum((i_t + 1) * BT, T) - 1
            b_g_last = tl.load(g + (bos + last) * H + i_h).to(tl.float32)
            b_g = tl.load(g + (row0 + o_t) * H + i_h, mask=m_t, other=0.).to(tl.float32)
            b_v = b_v * tl.where(m_t, tl.exp(b_g_last - b_g), 0.)[:, None]
            b_h1, b_h2, b_h3, b_h4 = decay_state_tiles(b_h1, b_h2, b_h3, b_h4,
                                                       tl.exp(b_g_last), KH, BK)
        b_v = b_v.to(k.dtype.element_ty)

        # S += Kᵀ·Vn: K read transposed as [BK, BT] tiles straight from memory.
        p_k = k + (row0 * H + i_h) * K + o_k[:, None] + o_t[None, :] * (H * K)
        b_k = tl.load(p_k, mask=(o_k < KH)[:, None] & m_t[None, :], other=0.)
        b_h1 += tl.dot(b_k, b_v, input_precision=DOT_PRECISION)
        if KH > BK:
            b_k = tl.load(p_k + BK, mask=(BK + o_k < KH)[:, None] & m_t[None, :], other=0.)
            b_h2 += tl.dot(b_k, b_v, input_precision=DOT_PRECISION)
        if KH > 2 * BK:
            b_k = tl.load(p_k + 2 * BK, mask=(2 * BK + o_k < KH)[:, None] & m_t[None, :],
                          other=0.)
            b_h3 += tl.dot(b_k, b_v, input_precision=DOT_PRECISION)
        if KH > 3 * BK:
            b_k = tl.load(p_k + 3 * BK, mask=(3 * BK + o_k < KH)[:, None] & m_t[None, :],
                          other=0.)
            b_h4 += tl.dot(b_k, b_v, input_precision=DOT_PRECISION)

    if STORE_FINAL_STATE:
        store_state_tiles(ht, state, b_h1, b_h2, b_h3, b_h4, o_s, o_k, m_v, KH, V, BK)


def chunk_gated_delta_rule_fwd_h(
    k: torch.Tensor,
    w: torch.Tensor | None,
    u: torch.Tensor,
    g: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    save_new_value: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    head_first: bool = False,
    chunk_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The sequential pass over chunks of the gated delta rule (ALGORITHMS.md §1).

    Args:
        k, w: ``[B, T, H, K]`` keys and the W factor (same dtype: fp32/fp16/bf16), K ≤ 256;
            w may be None (Vn = U: simple GLA's state pass).
        u: ``[B, T, H, V]`` the U factor (k's dtype), V ≤ 256.
        g: ``[B, T, H]`` chunk-local cumulative natural-log decay γ, what
            ``chunk_local_cumsum`` returns (None: no decay).
        initial_state: ``[N, H, K, V]`` state before the first token (N = B, or the
            number of sequences with ``cu_seqlens``); None: zeros.
        output_final_state: also return the state after the last token.
        chunk_size: BT, a power of two in [16, 256].
        save_new_value: return ``v_new`` (else None).
        cu_seqlens: ``[N + 1]`` packed-sequence offsets (B == 1); each sequence starts
            from its own initial state and its last chunk may be partial.
        head_first: inputs are ``[B, H, T, ...]``; then h is returned ``[B, H, NT, K, V]``
            and v_new ``[B, H, T, V]``.
        chunk_indices: accepted for symmetry with the other stages; the state pass runs
            one program per sequence and needs only the per-sequence chunk offsets.

    Returns:
        ``(h, v_new, final_state)``: h ``[B, NT, H, K, V]`` (``[1, NT_total, H, K, V]``
        under varlen, indexed by the global chunk index) the state entering each chunk,
        in k's dtype; v_new ``[B, T, H, V]`` = U − W·h in u's dtype, or None;
        final_state ``[N, H, K, V]`` float32, or None.
    """
    if cu_seqlens is None and use_op((k,)):
        h, v_new, final_state = _chunk_gated_delta_rule_fwd_h_op(
            k, w, u, g, initial_state, output_final_state, chunk_size, save_new_value,
            head_first)
        return h, present(v_new, save_new_value), present(final_state, output_final_state)
    check_tensor("k", k)
    dims = Dims()
    check_shape("k", k, token_layout("B T H K", head_first), dims)
    check_positive_length(dims)
    check_head_dim("k", dims["K"], "K")
    if w is not None:
        check_tensor("w", w)
        check_dtype("w", w, (k.dtype,))
        check_shape("w", w, token_layout("B T H K", head_first), dims)
    check_tensor("u", u)
    check_dtype("u", u, (k.dtype,))
    check_shape("u", u, token_layout("B T H V", head_first), dims)
    check_head_dim("u", dims["V"], "V")
    if g is not None:
        check_tensor("g", g)
        check_shape("g", g, token_layout("B T H", head_first), dims)
    check_same_device(k=k, w=w, u=u, g=g, initial_state=initial_state)
    BT = check_chunk_size(chunk_size)
    B, T, H, K, V = dims["B"], dims["T"], dims["H"], dims["K"], dims["V"]
    offsets = check_cu_seqlens(cu_seqlens, T=T, B=B)
    N = B if offsets is None else len(offsets) - 1
    if initial_state is not None:
        check_tensor("initial_state", initial_state)
        dims["N"] = N
        dims.source["N"] = "cu_seqlens (N sequences)" if offsets is not None else "k (N = B)"
        check_shape("initial_state", initial_state, "N H K V", dims)

    if head_first:
        k, u = k.transpose(1, 2), u.transpose(1, 2)
        w = None if w is None else w.transpose(1, 2)
        g = None if g is None else g.transpose(1, 2)

    if select_backend(k, w, u, g, initial_state) is Backend.TORCH:
        h, v_new, final_state = chunk_gated_delta_rule_fwd_h_torch(
            k, w, u, g, initial_state, output_final_state, offsets, BT, save_new_value)
    else:
        k, u = k.contiguous(), u.contiguous()
        w = None if w is None else w.contiguous()
        g = None if g is None else g.contiguous()
        h0 = None if initial_state is None else initial_state.contiguous()
        if offsets is not None:
            cu_seqlens = cu_seqlens.to(k.device)
            chunk_offsets = varlen_chunk_offsets(cu_seqlens, BT, offsets)
            NT = sum(-(-(e - s) // BT) for s, e in zip(offsets[:-1], offsets[1:]))
        else:
            chunk_offsets = None
            NT = cdiv(T, BT)
        h = torch.empty(B, NT, H, K, V, dtype=k.dtype, device=k.device)
        v_new = torch.empty_like(u) if save_new_value else None
        final_state = (torch.empty(N, H, K, V, dtype=torch.float32, device=k.device)
                       if output_final_state else None)
        chunk_gated_delta_rule_fwd_h_kernel[
                lambda meta: (cdiv(V, meta["BV"]) * (K // meta["KH"]), H, N)](
            k=k, w=w, u=u, g=g, h=h, v_new=v_new, h0=h0, ht=final_state,
            cu_seqlens=cu_seqlens if offsets is not None else None,
            chunk_offsets=chunk_offsets, T=T, H=H, K=K, V=V, BT=BT,
            BK=tile_width(K, 64), USE_G=g is not None, USE_W=w is not None,
            USE_INITIAL_STATE=h0 is not None,
            STORE_FINAL_STATE=output_final_state, SAVE_NEW_VALUE=save_new_value,
            IS_VARLEN=offsets is not None, DOT_PRECISION=dot_precision(k.dtype),
            FEW_PROGRAMS=sequential_grid_fill(N, H, V),
        )
    if head_first:
        h = h.transpose(1, 2)
        v_new = None if v_new is None else v_new.transpose(1, 2)
    return h, v_new, final_state


# The function as the custom op fla::chunk_gated_delta_rule_fwd_h for traced calls
# (packed sequences read offsets on the host: those stay eager); the op's step is the
# function.
_chunk_gated_delta_rule_fwd_h_op = stage_op(
    "chunk_gated_delta_rule_fwd_h",
    lambda k, w, u, g, h0, output_final_state, chunk_size, save_new_value, head_first:
        chunk_gated_delta_rule_fwd_h(k, w, u, g, h0, output_final_state, chunk_size,
                                     save_new_value, None, head_first),
    schema="(Tensor k, Tensor? w, Tensor u, Tensor? g, Tensor? initial_state, "
           "bool output_final_state, int chunk_size, bool save_new_value, bool head_first) "
           "-> (Tensor, Tensor, Tensor)", ahead=False)
