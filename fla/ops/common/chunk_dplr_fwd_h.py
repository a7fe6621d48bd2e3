"""DPLR delta rule, the forward state pass with the output fused in.

One program per (V tile, sequence·head) walks the sequence's chunks in order with its
``[K, BV]`` tile of S in float32 registers. Per chunk (γ the chunk-local cumulative
gate, recomputed here from gk; A_* from :mod:`fla.ops.common.chunk_dplr_fwd_intra`,
Ai = (I − A_ab)⁻¹ from solve_tril)::

    u  = Ai [(a ⊙ e^{γ⁻}) S + A_ak V]           (u_t = a_tᵀ S_{t-1})
    O  = scale (q ⊙ e^{γ}) S + scale (A_qb u + A_qk V)
    S' = e^{γ_C} ⊙ S + (b ⊙ e^{γ_C − γ})ᵀ u + (k ⊙ e^{γ_C − γ})ᵀ V

Every exponent is ≤ 0. With ``SAVE`` (training) the state entering each chunk (h) and u
are stored for the backward. Products are fp32 ``tl.dot``s (tf32 for 16-bit inputs: the
state recurrence is where rounding accumulates).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fla.ops.common.chunk_dplr_fwd_intra import dot_args
from fla.ops.utils.index import first_chunk_row, locate_sequence, prepare_chunk_offsets
from fla.ops.utils.state_tiles import state_tile
from fla.ops.utils.tiles import sixteen_bit, tile_width
from fla.utils.grid import cdiv, next_power_of_2
from fla.utils.tuning import Config, tuned

__all__ = ["chunk_dplr_fwd_h", "chunk_tokens"]


@triton.jit
def chunk_tokens(x, row, W: tl.constexpr, H: tl.constexpr, o_t, m_t, o_c, m_c):
    """A [BT, len(o_c)] float32 tile of a [.., H, W] token tensor from token-row offset
    ``row`` (int64, the head's first element of the chunk's first token)."""
    p = x + row + o_t[:, None].to(tl.int64) * (H * W) + o_c[None, :]
    return tl.load(p, mask=m_t[:, None] & m_c[None, :], other=0.0).to(tl.float32)


@triton.jit
def chunk_gates(gk, row, H: tl.constexpr, K: tl.constexpr, o_t, m_t, o_k, m_k,
                BT: tl.constexpr):
    """γ (inclusive), γ⁻ (exclusive) chunk-local cumulative gates [BT, BK] and γ_C."""
    g = chunk_tokens(gk, row, K, H, o_t, m_t, o_k, m_k)
    c = tl.cumsum(g, axis=0)
    # γ_C is the scan's own row at the last valid token, not its last row: a parallel
    # scan associates the padded rows' zeros differently, so in a chunk cut short the last
    # row can sit ulps from the last token's, and that token's e^{γ_C − γ} must be exactly 1
    # (the same defect fixed in GLA's chunk form, chunk_gk_fwd._gk_fwd_A_chunk_form).
    last_row = tl.sum(m_t.to(tl.int32), axis=0) - 1
    last = tl.sum(tl.where(o_t[:, None] == last_row, c, 0.0), axis=0)
    return c, c - g, last


def state_pass_default(args) -> Config:
    # BV = 32 (the narrowest state tile, fla.utils.triton_facts.MIN_DOT_TILE): twice
    # the programs of 64 for this latency-bound loop. 4 warps: two programs an SM (at 8
    # warps, 255 registers, one: RWKV7 4x4096x32x64's 256 programs then take two waves
    # on 132 SMs instead of one; offline sm_90 K = 64: 192 B of stack against 152). H100,
    # 2026-11-26: forward pass 1.376 -> 0.838 ms, reverse (chunk_dplr_bwd_dhu) 1.817 ->
    # 1.111 against 8 warps. Its space timed (11:45 UTC): BV = 64 for the forward pass
    # without saving h (0.812 against 0.837) and the reverse pass (1.058 against 1.122);
    # the pass saving h stays at 32 (0.987 against 1.043). At K = 128 (RWKV7
    # 4x4096x16x128, 16-bit, the spaces timed 2026-11-26 night) 64 columns at 8 warps:
    # saving h 1.51 ms against 1.61 at 32 / 4 warps (64 at 4 warps: 1.97), without 1.19
    # against 1.73 (1.34). Above K = 128 nothing was timed: 32.
    if head_128_in_sixteen_bits(args):
        return Config(BV=64, num_warps=8, num_stages=1)
    wide = not args.get("SAVE") and args["K"] <= 64 and args["V"] > 32
    return Config(BV=64 if wide else 32, num_warps=4, num_stages=1)


def head_128_in_sixteen_bits(args) -> bool:
    """K in (64, 128], V > 32, 16-bit operands: where the K = 128 timings apply."""
    return 64 < args["K"] <= 128 and args["V"] > 32 and sixteen_bit(args, "q")


def state_pass_space(args) -> list[Config]:
    # Two stages only up to K = 32 (192 KB there). Offline sm_90 builds (Triton 3.6,
    # bf16; shared memory a program, limit 227 KB) of this pass and of the reverse pass
    # that shares its space: at K = 64 two stages take 220-252 KB (only BV = 32 at 4
    # warps fits, one program an SM), at K = 128 292-344 KB, at K = 256 436-536 KB: the
    # tuning layer compiled them for nothing.
    BK, Vp = tile_width(args["K"], 256), next_power_of_2(args["V"])
    stages = (1, 2) if args["K"] <= 32 else (1,)
    return [Config(BV=bv, num_warps=w, num_stages=s) for bv in (32, 64)
            if bv <= max(32, Vp) and BK * bv <= 16384 for w in (4, 8) for s in stages]


@tuned(key=["K", "V", "q", "h0", "SAVE", "DT", "PRECISION"], default=state_pass_default,
       space=state_pass_space)
@triton.jit(do_not_specialize=["T"])
def chunk_dplr_fwd_h_kernel(
    q, k, v, a, b, gk, Aqk, Aqb, Aak, Ai, o, h, u, h0, ht, cu_seqlens, chunk_offsets,
    scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr,
    SAVE: tl.constexpr, IS_VARLEN: tl.constexpr, DT: tl.constexpr, PRECISION: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, T = locate_sequence(i_n, T, cu_seqlens, IS_VARLEN)
    first_chunk = first_chunk_row(i_n, chunk_offsets, T, BT, IS_VARLEN)
    NT = tl.cdiv(T, BT)
    o_t = tl.arange(0, BT)
    o_k, o_v, m_k, m_v, o_s, m_s, state = state_tile(i_v, i_nh, K, V, BK, BV)
    o_a = tl.arange(0, BT)
    m_a = o_a < BT

    b_S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_S += tl.load(h0 + state + o_s, mask=m_s, other=0.0).to(tl.float32)
    for i_t in range(0, NT):
        m_t = i_t * BT + o_t < T
        tok = bos + i_t * BT
        rk = (tok * H + i_h) * K
        rv = (tok * H + i_h) * V
        ra = (tok * H + i_h) * BT
        c, ce, last = chunk_gates(gk, rk, H, K, o_t, m_t, o_k, m_k, BT)
        b_a = (chunk_tokens(a, rk, K, H, o_t, m_t, o_k, m_k) * tl.exp(ce)).to(DT)
        b_v = chunk_tokens(v, rv, V, H, o_t, m_t, o_v, m_v).to(DT)
        b_Aak = chunk_tokens(Aak, ra, BT, H, o_t, m_t, o_a, m_a).to(DT)
        if SAVE:
            p_h = h + ((first_chunk + i_t) * H + i_h) * K * V + o_s
            tl.store(p_h, b_S, mask=m_s)
        b_Sd = b_S.to(DT)
        b_z = tl.dot(b_a, b_Sd, input_precision=PRECISION)
        b_z += tl.dot(b_Aak, b_v, input_precision=PRECISION)
        b_Ai = chunk_tokens(Ai, ra, BT, H, o_t, m_t, o_a, m_a).to(DT)
        b_u = tl.dot(b_Ai, b_z.to(DT), input_precision=PRECISION)
        b_ud = b_u.to(DT)
        b_q = (chunk_tokens(q, rk, K, H, o_t, m_t, o_k, m_k) * (tl.exp(c) * scale)).to(DT)
        b_o = tl.dot(b_q, b_Sd, input_precision=PRECISION)
        b_Aqb = chunk_tokens(Aqb, ra, BT, H, o_t, m_t, o_a, m_a).to(DT)
        b_Aqk = chunk_tokens(Aqk, ra, BT, H, o_t, m_t, o_a, m_a).to(DT)
        b_o2 = tl.dot(b_Aqb, b_ud, input_precision=PRECISION)
        b_o2 += tl.dot(b_Aqk, b_v, input_precision=PRECISION)
        b_o += scale * b_o2
        p_o = o + rv + o_t[:, None].to(tl.int64) * (H * V) + o_v[None, :]
        tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
        if SAVE:
            p_u = u + rv + o_t[:, None].to(tl.int64) * (H * V) + o_v[None, :]
            tl.store(p_u, b_u, mask=m_t[:, None] & m_v[None, :])
        to_end = tl.exp(last[None, :] - c)
        b_b = (chunk_tokens(b, rk, K, H, o_t, m_t, o_k, m_k) * to_end).to(DT)
        b_k = (chunk_tokens(k, rk, K, H, o_t, m_t, o_k, m_k) * to_end).to(DT)
        b_S = b_S * tl.exp(last)[:, None]
        b_S += tl.dot(tl.trans(b_b), b_ud, input_precision=PRECISION)
        b_S += tl.dot(tl.trans(b_k), b_v, input_precision=PRECISION)
    if STORE_HT:
        tl.store(ht + state + o_s, b_S, mask=m_s)


def chunk_dplr_fwd_h(q, k, v, a, b, gk, Aqk, Aqb, Aak, Ai, scale, initial_state,
                     output_final_state, cu_seqlens=None, offsets=None, N=None,
                     save=False, chunk_size=64):
    """Run the state pass. Returns ``(o [B, T, H, V] in v's dtype, final_state
    [N, H, K, V] float32 or None, h [NT_total, H, K, V] float32 or None, u [B, T, H, V]
    float32 or None)``; h (the state entering each chunk, chunks of all sequences in
    order) and u only with ``save``."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = (B if cu_seqlens is None else cu_seqlens.numel() - 1) if N is None else N
    if cu_seqlens is None:
        chunk_offsets = None
        NT_total = B * cdiv(T, chunk_size)
    else:
        chunk_offsets = prepare_chunk_offsets(cu_seqlens, chunk_size, cu_seqlens_cpu=offsets)
        NT_total = int(sum(-(-(e - s) // chunk_size) for s, e in zip(offsets[:-1], offsets[1:]))) \
            if offsets is not None else int(chunk_offsets[-1])
    f32 = dict(dtype=torch.float32, device=q.device)
    o = torch.empty_like(v)
    ht = torch.empty(N, H, K, V, **f32) if output_final_state else None
    h = torch.empty(NT_total, H, K, V, **f32) if save else None
    u = torch.empty(B, T, H, V, **f32) if save else None
    grid = lambda meta: (cdiv(V, meta["BV"]), N * H)  # noqa: E731
    chunk_dplr_fwd_h_kernel[grid](
        q, k, v, a, b, gk, Aqk, Aqb, Aak, Ai, o, h, u, initial_state, ht, cu_seqlens,
        chunk_offsets, scale, T, H=H, K=K, V=V, BT=chunk_size, BK=tile_width(K, 256),
        USE_H0=initial_state is not None, STORE_HT=output_final_state, SAVE=save,
        IS_VARLEN=cu_seqlens is not None, **dot_args(q.dtype, wide=True))
    return o, ht, h, u
