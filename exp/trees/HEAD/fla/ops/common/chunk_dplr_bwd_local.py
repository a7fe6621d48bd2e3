"""DPLR delta rule, backward: what each chunk's inputs get through the state and the
decayed vectors, and the gradients of the four score matrices.

One program per (chunk, head), V walked in BV tiles. With S the state entering the
chunk (h), dS' the gradient of the state leaving it (dh), u and dZ from the forward
and the reverse pass (γ the chunk-local cumulative gate, γ⁻ = γ − gk)::

    dq  = scale (dO Sᵀ) ⊙ e^{γ}          dk = (V dS'ᵀ) ⊙ e^{γ_C − γ}
    da  = (dZ Sᵀ) ⊙ e^{γ⁻}               db = (u dS'ᵀ) ⊙ e^{γ_C − γ}
    dA_qk = scale dO Vᵀ (s ≤ t)   dA_qb = scale dO uᵀ (s ≤ t)
    dA_ak = dZ Vᵀ (s < t)         dA_ab = dZ uᵀ (s < t)

(the last from u = (I − A_ab)⁻¹ Z: ∂L/∂A_ab = dZ uᵀ with dZ = Aiᵀ du). The grid's
third axis splits the work: 0 the four gradients (and the gate term below), 1 the four
dA. For the gate's gradient (formed in :mod:`fla.ops.common.chunk_dplr_bwd_intra`) it
also writes, per chunk, Σ_v dS' ⊙ S' of the state leaving it::

    off = e^{γ_C} ⊙ Σ_v (dS' ⊙ S) + Σ_t (k ⊙ dk_state + b ⊙ db_state)

(dk_state, db_state: the two state terms above). Dot operands are in the input dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fla.ops.common.chunk_dplr_fwd_h import (
    chunk_gates,
    chunk_tokens,
    head_128_in_sixteen_bits,
)
from fla.ops.common.chunk_dplr_fwd_intra import dot_args
from fla.ops.utils.index import locate_sequence_chunk
from fla.ops.utils.tiles import tile_width
from fla.utils.grid import cdiv
from fla.utils.tuning import Config, tuned

__all__ = ["chunk_dplr_bwd_local"]


def _default(args) -> Config:
    # The 4-warp, 2-stage config of the 2026-11-23 timings (RWKV7 fwd+bwd 10.5 ms at
    # 4x4096x32x64 on H100, against 15.5 with the 8-warp configs chosen offline for
    # their spills; 8 warps: 182 registers, one program an SM). Re-timed 2026-11-26:
    # 0.95 ms (fwd+bwd 10.54 ms with the other restored defaults).
    # Above K = 128 that config needs 256 KB of shared memory (offline sm_90), more than
    # an SM has: the tuning layer skipped it, with a warning, at every first call. There
    # one stage at 8 warps (96 KB; 1.3 KB of stack a thread against 4.3 KB at 4 warps),
    # not timed.
    # At K = 128 in 16 bits 8 warps: 1.07 ms against 2.22 at 4 (H100, RWKV7
    # 4x4096x16x128, the space timed 2026-11-26 night; BV = 32 at 8 warps 1.19).
    if args["K"] > 128:
        return Config(BV=tile_width(args["V"], 64), num_warps=8, num_stages=1)
    return Config(BV=tile_width(args["V"], 64),
                  num_warps=8 if head_128_in_sixteen_bits(args) else 4, num_stages=2)


def _space(args) -> list[Config]:
    widths = sorted({tile_width(args["V"], bv) for bv in (32, 64)})
    # Two stages of 64-column tiles do not fit an SM above K = 128 (see _default).
    return [Config(BV=bv, num_warps=w, num_stages=s) for bv in widths for w in (4, 8)
            for s in (1, 2) if not (bv == 64 and s == 2 and args["K"] > 128)]


@triton.jit
def _load_state(x, row, V: tl.constexpr, o_k, m_k, o_v, m_v):
    p = x + row + o_k[:, None] * V + o_v[None, :]
    return tl.load(p, mask=m_k[:, None] & m_v[None, :], other=0.0)


@triton.jit
def _store_rows(x, row, W: tl.constexpr, H: tl.constexpr, o_t, m_t, o_c, value):
    p = x + row + o_t[:, None].to(tl.int64) * (H * W) + o_c[None, :]
    tl.store(p, value, mask=m_t[:, None] & (o_c[None, :] < W))


@tuned(key=["K", "V", "q", "DT", "PRECISION"], default=_default, space=_space)
@triton.jit(do_not_specialize=["T"])
def chunk_dplr_bwd_local_kernel(
    q, k, v, a, b, gk, h, dh, u, dz, do, dq, dk, da, db, off, dAqk, dAqb, dAak, dAab,
    cu_seqlens, chunk_indices, chunk_offsets, scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr, DT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    i_c, i_bh, i_w = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    i_n, i_t, bos, T = locate_sequence_chunk(i_c, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    o_t = tl.arange(0, BT)
    m_t = i_t * BT + o_t < T
    tok = bos + i_t * BT
    rv = (tok * H + i_h) * V
    if i_w == 0:
        # The gradients through the state and the decayed vectors, and the gate term.
        if IS_VARLEN:
            chunk = tl.load(chunk_offsets + i_n).to(tl.int64) + i_t
        else:
            chunk = i_b.to(tl.int64) * tl.cdiv(T, BT) + i_t
        o_k = tl.arange(0, BK)
        m_k = o_k < K
        rk = (tok * H + i_h) * K
        rs = (chunk * H + i_h) * K * V
        b_dq = tl.zeros([BT, BK], dtype=tl.float32)
        b_dk = tl.zeros([BT, BK], dtype=tl.float32)
        b_da = tl.zeros([BT, BK], dtype=tl.float32)
        b_db = tl.zeros([BT, BK], dtype=tl.float32)
        b_hs = tl.zeros([BK], dtype=tl.float32)
        for i_v in range(0, tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = o_v < V
            b_S = _load_state(h, rs, V, o_k, m_k, o_v, m_v)
            b_dS = _load_state(dh, rs, V, o_k, m_k, o_v, m_v)
            b_hs += tl.sum(b_S * b_dS, axis=1)
            b_S = b_S.to(DT)
            b_dS = b_dS.to(DT)
            b_do = chunk_tokens(do, rv, V, H, o_t, m_t, o_v, m_v).to(DT)
            b_v = chunk_tokens(v, rv, V, H, o_t, m_t, o_v, m_v).to(DT)
            b_u = chunk_tokens(u, rv, V, H, o_t, m_t, o_v, m_v).to(DT)
            b_dz = chunk_tokens(dz, rv, V, H, o_t, m_t, o_v, m_v).to(DT)
            b_dq += tl.dot(b_do, tl.trans(b_S), input_precision=PRECISION)
            b_da += tl.dot(b_dz, tl.trans(b_S), input_precision=PRECISION)
            b_dk += tl.dot(b_v, tl.trans(b_dS), input_precision=PRECISION)
            b_db += tl.dot(b_u, tl.trans(b_dS), input_precision=PRECISION)
        c, ce, last = chunk_gates(gk, rk, H, K, o_t, m_t, o_k, m_k, BT)
        to_end = tl.exp(last[None, :] - c)
        b_dk = b_dk * to_end
        b_db = b_db * to_end
        _store_rows(dq, rk, K, H, o_t, m_t, o_k, b_dq * tl.exp(c) * scale)
        _store_rows(dk, rk, K, H, o_t, m_t, o_k, b_dk)
        _store_rows(da, rk, K, H, o_t, m_t, o_k, b_da * tl.exp(ce))
        _store_rows(db, rk, K, H, o_t, m_t, o_k, b_db)
        # Σ_v dS' ⊙ S' with S' = e^{γ_C} ⊙ S + (b ⊙ e^{γ_C − γ})ᵀ u + (k ⊙ e^{γ_C − γ})ᵀ V.
        b_k = chunk_tokens(k, rk, K, H, o_t, m_t, o_k, m_k)
        b_b = chunk_tokens(b, rk, K, H, o_t, m_t, o_k, m_k)
        b_off = tl.exp(last) * b_hs + tl.sum(b_k * b_dk + b_b * b_db, axis=0)
        tl.store(off + (chunk * H + i_h) * K + o_k, b_off, mask=m_k)
    else:
        # The gradients of the four score matrices.
        b_dAqk = tl.zeros([BT, BT], dtype=tl.float32)
        b_dAqb = tl.zeros([BT, BT], dtype=tl.float32)
        b_dAak = tl.zeros([BT, BT], dtype=tl.float32)
        b_dAab = tl.zeros([BT, BT], dtype=tl.float32)
        for i_v in range(0, tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = o_v < V
            b_do = chunk_tokens(do, rv, V, H, o_t, m_t, o_v, m_v).to(DT)
            b_v = chunk_tokens(v, rv, V, H, o_t, m_t, o_v, m_v).to(DT)
            b_u = chunk_tokens(u, rv, V, H, o_t, m_t, o_v, m_v).to(DT)
            b_dz = chunk_tokens(dz, rv, V, H, o_t, m_t, o_v, m_v).to(DT)
            b_dAqk += tl.dot(b_do, tl.trans(b_v), input_precision=PRECISION)
            b_dAqb += tl.dot(b_do, tl.trans(b_u), input_precision=PRECISION)
            b_dAak += tl.dot(b_dz, tl.trans(b_v), input_precision=PRECISION)
            b_dAab += tl.dot(b_dz, tl.trans(b_u), input_precision=PRECISION)
        ra = (tok * H + i_h) * BT
        causal = o_t[:, None] >= o_t[None, :]
        strict = o_t[:, None] > o_t[None, :]
        _store_rows(dAqk, ra, BT, H, o_t, m_t, o_t, tl.where(causal, b_dAqk * scale, 0.0))
        _store_rows(dAqb, ra, BT, H, o_t, m_t, o_t, tl.where(causal, b_dAqb * scale, 0.0))
        _store_rows(dAak, ra, BT, H, o_t, m_t, o_t, tl.where(strict, b_dAak, 0.0))
        _store_rows(dAab, ra, BT, H, o_t, m_t, o_t, tl.where(strict, b_dAab, 0.0))


def chunk_dplr_bwd_local(q, k, v, a, b, gk, h, dh, u, dz, do, scale, cu_seqlens=None,
                         chunk_indices=None, offsets=None, chunk_size=64, NT_total=None):
    """Returns ``(dq, dk, da, db)`` partial gradients ``[B, T, H, K]``, the gate term
    ``off [NT_total, H, K]`` (Σ_v dS' ⊙ S' of the state leaving each chunk) and
    ``(dA_qk, dA_qb, dA_ak, dA_ab)`` ``[B, T, H, BT]``, all float32."""
    from fla.ops.utils.index import prepare_chunk_offsets
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = cdiv(T, chunk_size) if cu_seqlens is None else chunk_indices.shape[0]
    NT_total = h.shape[0] if NT_total is None else NT_total
    chunk_offsets = (None if cu_seqlens is None else
                     prepare_chunk_offsets(cu_seqlens, chunk_size, cu_seqlens_cpu=offsets))
    f32 = dict(dtype=torch.float32, device=q.device)
    grads = [torch.empty(B, T, H, K, **f32) for _ in range(4)]
    off = torch.empty(NT_total, H, K, **f32)
    dA = [torch.empty(B, T, H, chunk_size, **f32) for _ in range(4)]
    chunk_dplr_bwd_local_kernel[(NT, B * H, 2)](
        q, k, v, a, b, gk, h, dh, u, dz, do, *grads, off, *dA, cu_seqlens, chunk_indices,
        chunk_offsets, scale, T, H=H, K=K, V=V, BT=chunk_size, BK=tile_width(K, 256),
        IS_VARLEN=cu_seqlens is not None, **dot_args(q.dtype))
    return grads, off, dA
