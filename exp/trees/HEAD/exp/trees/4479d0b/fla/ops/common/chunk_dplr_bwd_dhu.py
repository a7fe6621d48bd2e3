"""DPLR delta rule, the backward (reverse) state pass.

One program per (V tile, sequence·head) walks the chunks last to first with the
gradient of the state leaving the chunk, dS', in float32 registers. Per chunk (the
forward's equations in :mod:`fla.ops.common.chunk_dplr_fwd_h`, u = Ai Z)::

    du = scale A_qbᵀ dO + (b ⊙ e^{γ_C − γ}) dS'
    dZ = Aiᵀ du
    dV = scale A_qkᵀ dO + (k ⊙ e^{γ_C − γ}) dS' + A_akᵀ dZ          (complete)
    dS = scale (q ⊙ e^{γ})ᵀ dO + e^{γ_C} ⊙ dS' + (a ⊙ e^{γ⁻})ᵀ dZ

It stores dS' per chunk (``dh``, laid out like the forward's h), dZ, dV and dh0.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fla.ops.common.chunk_dplr_fwd_h import (
    chunk_gates,
    chunk_tokens,
    head_128_in_sixteen_bits,
    state_pass_default,
    state_pass_space,
)
from fla.ops.common.chunk_dplr_fwd_intra import dot_args
from fla.ops.utils.index import first_chunk_row, locate_sequence, prepare_chunk_offsets
from fla.ops.utils.state_tiles import state_tile
from fla.ops.utils.tiles import tile_width
from fla.utils.grid import cdiv
from fla.utils.tuning import Config, tuned

__all__ = ["chunk_dplr_bwd_dhu"]


def _default(args) -> Config:
    # The forward pass's tiles (state_pass_default), except at K = 128 in 16 bits: 64
    # columns at 4 warps, 1.80 ms against 2.10 at 32 (8 warps 1.88; H100, RWKV7
    # 4x4096x16x128, the space timed 2026-11-26 night).
    if head_128_in_sixteen_bits(args):
        return Config(BV=64, num_warps=4, num_stages=1)
    return state_pass_default(args)


@tuned(key=["K", "V", "q", "dht", "dh0", "DT", "PRECISION"], default=_default,
       space=state_pass_space)  # the tiles of the forward pass it mirrors
@triton.jit(do_not_specialize=["T"])
def chunk_dplr_bwd_dhu_kernel(
    q, k, a, b, gk, Aqk, Aqb, Aak, Ai, do, dht, dh, dz, dv, dh0, cu_seqlens, chunk_offsets,
    scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
    IS_VARLEN: tl.constexpr, DT: tl.constexpr, PRECISION: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, T = locate_sequence(i_n, T, cu_seqlens, IS_VARLEN)
    first_chunk = first_chunk_row(i_n, chunk_offsets, T, BT, IS_VARLEN)
    NT = tl.cdiv(T, BT)
    o_t = tl.arange(0, BT)
    o_k, o_v, m_k, m_v, o_s, m_s, state = state_tile(i_v, i_nh, K, V, BK, BV)
    m_a = o_t < BT

    b_dS = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        b_dS += tl.load(dht + state + o_s, mask=m_s, other=0.0).to(tl.float32)
    for i_r in range(0, NT):
        i_t = NT - 1 - i_r
        m_t = i_t * BT + o_t < T
        m_tv = m_t[:, None] & m_v[None, :]
        tok = bos + i_t * BT
        rk = (tok * H + i_h) * K
        rv = (tok * H + i_h) * V
        ra = (tok * H + i_h) * BT
        tl.store(dh + ((first_chunk + i_t) * H + i_h) * K * V + o_s, b_dS, mask=m_s)
        c, ce, last = chunk_gates(gk, rk, H, K, o_t, m_t, o_k, m_k, BT)
        to_end = tl.exp(last[None, :] - c)
        b_do = chunk_tokens(do, rv, V, H, o_t, m_t, o_v, m_v)
        b_b = chunk_tokens(b, rk, K, H, o_t, m_t, o_k, m_k) * to_end
        b_Aqb = chunk_tokens(Aqb, ra, BT, H, o_t, m_t, o_t, m_a)
        b_du = scale * tl.dot(tl.trans(b_Aqb), b_do, input_precision=PRECISION)
        b_du += tl.dot(b_b, b_dS, input_precision=PRECISION)
        b_Ai = chunk_tokens(Ai, ra, BT, H, o_t, m_t, o_t, m_a)
        b_dz = tl.dot(tl.trans(b_Ai), b_du, input_precision=PRECISION)
        p_tv = rv + o_t[:, None].to(tl.int64) * (H * V) + o_v[None, :]
        tl.store(dz + p_tv, b_dz, mask=m_tv)
        b_k = chunk_tokens(k, rk, K, H, o_t, m_t, o_k, m_k) * to_end
        b_Aqk = chunk_tokens(Aqk, ra, BT, H, o_t, m_t, o_t, m_a)
        b_Aak = chunk_tokens(Aak, ra, BT, H, o_t, m_t, o_t, m_a)
        b_dv = scale * tl.dot(tl.trans(b_Aqk), b_do, input_precision=PRECISION)
        b_dv += tl.dot(b_k, b_dS, input_precision=PRECISION)
        b_dv += tl.dot(tl.trans(b_Aak), b_dz, input_precision=PRECISION)
        tl.store(dv + p_tv, b_dv.to(dv.dtype.element_ty), mask=m_tv)
        b_q = chunk_tokens(q, rk, K, H, o_t, m_t, o_k, m_k) * tl.exp(c) * scale
        b_a = chunk_tokens(a, rk, K, H, o_t, m_t, o_k, m_k) * tl.exp(ce)
        b_dS = b_dS * tl.exp(last)[:, None]
        b_dS += tl.dot(tl.trans(b_q), b_do, input_precision=PRECISION)
        b_dS += tl.dot(tl.trans(b_a), b_dz, input_precision=PRECISION)
    if STORE_DH0:
        tl.store(dh0 + state + o_s, b_dS, mask=m_s)


def chunk_dplr_bwd_dhu(q, k, a, b, gk, Aqk, Aqb, Aak, Ai, do, dht, scale, v_dtype,
                       cu_seqlens=None, offsets=None, N=None, need_dh0=True,
                       NT_total=None, chunk_size=64):
    """Returns ``(dh [NT_total, H, K, V] float32, dz [B, T, H, V] float32,
    dv [B, T, H, V] in v_dtype, dh0 [N, H, K, V] float32 or None)``."""
    B, T, H, K = q.shape
    V = do.shape[-1]
    N = (B if cu_seqlens is None else cu_seqlens.numel() - 1) if N is None else N
    chunk_offsets = (None if cu_seqlens is None else
                     prepare_chunk_offsets(cu_seqlens, chunk_size, cu_seqlens_cpu=offsets))
    f32 = dict(dtype=torch.float32, device=q.device)
    dh = torch.empty(NT_total, H, K, V, **f32)
    dz = torch.empty(B, T, H, V, **f32)
    dv = torch.empty(B, T, H, V, dtype=v_dtype, device=q.device)
    dh0 = torch.empty(N, H, K, V, **f32) if need_dh0 else None
    grid = lambda meta: (cdiv(V, meta["BV"]), N * H)  # noqa: E731
    chunk_dplr_bwd_dhu_kernel[grid](
        q, k, a, b, gk, Aqk, Aqb, Aak, Ai, do, dht, dh, dz, dv, dh0, cu_seqlens,
        chunk_offsets, scale, T, H=H, K=K, V=V, BT=chunk_size, BK=tile_width(K, 256),
        USE_DHT=dht is not None, STORE_DH0=need_dh0, IS_VARLEN=cu_seqlens is not None,
        **dot_args(q.dtype, wide=True))
    return dh, dz, dv, dh0
