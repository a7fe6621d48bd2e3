"""PyTorch versions of the forward chunk stages of the gated delta rule (ALGORITHMS.md §1).

They run when :func:`fla.utils.select_backend` picks the PyTorch path (CPU tensors,
``FLA_BACKEND=torch``) and state, in plain tensor algebra, what each Triton kernel of
``fla.ops.common`` computes:

* :func:`chunk_scaled_dot_kkt_fwd_torch`      A  = strict_lower(diag(β) K Kᵀ ⊙ Γ)
* :func:`recompute_w_u_fwd_torch`             W  = Tinv diag(β)(K ⊙ e^γ), U = Tinv diag(β) V
* :func:`chunk_gated_delta_rule_fwd_h_torch`  the state pass: h, Vn = U − W S, final S
* :func:`chunk_fwd_o_torch`                   O = scale[(Q ⊙ e^γ)S + (QKᵀ ⊙ Γ ⊙ causal)Vn]

Inputs are already validated and time-major (``[B, T, H, ...]``); ``offsets`` is the host
copy of ``cu_seqlens`` (None: B sequences of length T). ``g`` is always the chunk-local
cumulative log decay γ. Arithmetic runs in float32 (float64 stays float64) and uses no
in-place update of a tensor autograd needs, so gradients flow through these functions.
"""
from __future__ import annotations

from typing import Callable

import torch

__all__ = [
    "chunk_scaled_dot_kkt_fwd_torch", "recompute_w_u_fwd_torch",
    "chunk_gated_delta_rule_fwd_h_torch", "chunk_fwd_o_torch",
]


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _chunked(x: torch.Tensor, BT: int) -> torch.Tensor:
    """``[B, T, ...] -> [B, NT, BT, ...]``, the partial last chunk padded with zeros."""
    B, T = x.shape[:2]
    NT = -(-T // BT)
    if NT * BT != T:
        x = torch.cat([x, x.new_zeros(B, NT * BT - T, *x.shape[2:])], dim=1)
    return x.reshape(B, NT, BT, *x.shape[2:])


def _unchunked(x: torch.Tensor, T: int) -> torch.Tensor:
    """``[B, NT, BT, ...] -> [B, T, ...]`` (padding dropped)."""
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :T]


def _per_sequence(fn: Callable[..., torch.Tensor], offsets: list[int] | None,
                  *tensors: torch.Tensor | None) -> torch.Tensor:
    """Apply a token-wise stage to each packed sequence and concatenate along T."""
    if offsets is None:
        return fn(*tensors)
    pieces = [fn(*[None if t is None else t[:, bos:eos] for t in tensors])
              for bos, eos in zip(offsets[:-1], offsets[1:])]
    return torch.cat(pieces, dim=1)


def _decay_matrix(gc: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Γ_ij = exp(γ_i − γ_j) where ``mask`` holds, else 0: the exponent is masked
    before ``exp`` so the discarded (anti-causal) entries cannot overflow to inf."""
    diff = gc[..., :, None] - gc[..., None, :]
    return torch.where(mask, torch.exp(torch.where(mask, diff, torch.zeros_like(diff))),
                       torch.zeros_like(diff))


# --------------------------------------------------------------------------- stage 1
def _kkt(k, beta, g, BT: int, output_dtype):
    T = k.shape[1]
    acc = _acc(k.dtype)
    kc = _chunked(k.to(acc), BT)                                   # [B, NT, BT, H, K]
    A = torch.einsum("bnihk,bnjhk->bnhij", kc, kc)                 # [B, NT, H, BT, BT]
    if beta is not None:
        A = A * _chunked(beta.to(acc), BT).transpose(2, 3)[..., None]
    mask = torch.ones(BT, BT, dtype=torch.bool, device=k.device).tril(-1)
    if g is not None:
        A = A * _decay_matrix(_chunked(g.to(acc), BT).transpose(2, 3), mask)
    A = torch.where(mask, A, torch.zeros_like(A))
    return _unchunked(A.transpose(2, 3), T).to(output_dtype)       # [B, T, H, BT]


def chunk_scaled_dot_kkt_fwd_torch(k, beta=None, g=None, offsets=None, chunk_size=64,
                                   output_dtype=torch.float32):
    """A[t, j] = β_t (k_t·k_s) exp(γ_t − γ_s), s the j-th token of t's chunk, j strictly
    below t's position; ``[B, T, H, BT]`` in ``output_dtype``."""
    return _per_sequence(lambda k_, b_, g_: _kkt(k_, b_, g_, chunk_size, output_dtype),
                         offsets, k, beta, g)


# --------------------------------------------------------------------------- stage 2
def _w_u(k, v, beta, A, g, BT: int):
    T = k.shape[1]
    acc = _acc(k.dtype)
    NT = -(-T // BT)
    Ac = _chunked(A.to(acc), BT)                                   # [B, NT, BT, H, BT]
    # Columns past the partial last chunk's end belong to no token: ignore what they hold.
    valid = T - torch.arange(NT, device=k.device)[:, None] * BT
    cols = torch.arange(BT, device=k.device)[None, :] < valid      # [NT, BT]
    Ac = torch.where(cols[None, :, None, None, :], Ac, torch.zeros_like(Ac))
    b = beta.to(acc)[..., None]
    kb = k.to(acc) * b
    if g is not None:
        kb = kb * torch.exp(g.to(acc))[..., None]
    w = torch.einsum("bnihj,bnjhk->bnihk", Ac, _chunked(kb, BT))
    u = torch.einsum("bnihj,bnjhv->bnihv", Ac, _chunked(v.to(acc) * b, BT))
    return torch.cat([_unchunked(w, T).to(k.dtype), _unchunked(u, T).to(v.dtype)], dim=-1)


def recompute_w_u_fwd_torch(k, v, beta, A, g=None, offsets=None, chunk_size=64):
    """W = Tinv·diag(β)·(K ⊙ exp(γ)), U = Tinv·diag(β)·V per chunk (``A`` is Tinv);
    returns ``(w [B, T, H, K] in k's dtype, u [B, T, H, V] in v's dtype)``."""
    if k.dtype != v.dtype:
        raise TypeError("recompute_w_u_fwd_torch: k and v must share a dtype")
    K = k.shape[-1]
    wu = _per_sequence(lambda k_, v_, b_, A_, g_: _w_u(k_, v_, b_, A_, g_, chunk_size),
                       offsets, k, v, beta, A, g)
    return wu[..., :K], wu[..., K:]


# --------------------------------------------------------------------------- stage 3
def _fwd_h(k, w, u, g, h0, BT: int):
    B, T, H, K = k.shape
    V = u.shape[-1]
    acc = _acc(k.dtype)
    S = (h0.to(acc) if h0 is not None
         else torch.zeros(B, H, K, V, dtype=acc, device=k.device))
    states, values = [], []
    for start in range(0, T, BT):
        end = min(start + BT, T)
        kc, uc = k[:, start:end].to(acc), u[:, start:end].to(acc)
        states.append(S)
        vn = uc if w is None else uc - torch.einsum("bthk,bhkv->bthv", w[:, start:end].to(acc), S)
        values.append(vn)
        if g is not None:
            gc = g[:, start:end].to(acc)                            # [B, C, H]
            g_last = gc[:, -1]                                      # last valid token
            vn = vn * torch.exp(g_last[:, None] - gc)[..., None]
            S = S * torch.exp(g_last)[..., None, None]
        S = S + torch.einsum("bthk,bthv->bhkv", kc, vn)
    return torch.stack(states, dim=1), torch.cat(values, dim=1), S


def chunk_gated_delta_rule_fwd_h_torch(k, w, u, g=None, initial_state=None,
                                       output_final_state=False, offsets=None,
                                       chunk_size=64, save_new_value=True):
    """The state pass (time-major inputs; ``w=None``: Vn = U): returns ``(h [B, NT, H, K, V] in k's dtype,
    v_new [B, T, H, V] in u's dtype or None, final_state [N, H, K, V] float32 or None)``;
    under varlen h is ``[1, NT_total, H, K, V]``."""
    if offsets is None:
        h, v_new, S = _fwd_h(k, w, u, g, initial_state, chunk_size)
    else:
        hs, vs, Ss = [], [], []
        for n, (bos, eos) in enumerate(zip(offsets[:-1], offsets[1:])):
            h0 = None if initial_state is None else initial_state[n:n + 1]
            h_n, v_n, S_n = _fwd_h(k[:, bos:eos], None if w is None else w[:, bos:eos],
                                   u[:, bos:eos],
                                   None if g is None else g[:, bos:eos], h0, chunk_size)
            hs.append(h_n), vs.append(v_n), Ss.append(S_n)
        h, v_new, S = torch.cat(hs, 1), torch.cat(vs, 1), torch.cat(Ss, 0)
    return (h.to(k.dtype), v_new.to(u.dtype) if save_new_value else None,
            S.to(torch.float32) if output_final_state else None)


# --------------------------------------------------------------------------- stage 4
def _fwd_o(q, k, v, h, g, scale: float, BT: int, with_scores: bool = False):
    """``(o [B, T, H, V], Aqk [B, T, H, BT] or None)``: the output and, ``with_scores``,
    the causal gated scores laid out token by token (a copy: only when asked)."""
    T = q.shape[1]
    acc = _acc(q.dtype)
    qc, kc, vc = (_chunked(x.to(acc), BT) for x in (q, k, v))      # [B, NT, BT, H, *]
    mask = torch.ones(BT, BT, dtype=torch.bool, device=q.device).tril()
    Aqk = torch.einsum("bnihk,bnjhk->bnhij", qc, kc)
    if g is not None:
        gc = _chunked(g.to(acc), BT)                                # [B, NT, BT, H]
        qc = qc * torch.exp(gc)[..., None]
        Aqk = Aqk * _decay_matrix(gc.transpose(2, 3), mask)
    Aqk = torch.where(mask, Aqk, torch.zeros_like(Aqk))
    o = (torch.einsum("bnihk,bnhkv->bnihv", qc, h.to(acc))
         + torch.einsum("bnhij,bnjhv->bnihv", Aqk, vc))
    scores = _unchunked(Aqk.transpose(2, 3), T) if with_scores else None
    return _unchunked(o * scale, T).to(v.dtype), scores


def chunk_fwd_o_torch(q, k, v_new, h, g=None, scale=1.0, offsets=None, chunk_size=64,
                      scores_out=None):
    """O = scale·[(Q ⊙ exp(γ)) S + (Q Kᵀ ⊙ Γ ⊙ causal_incl_diag) Vn] per chunk;
    ``[B, T, H, V]`` in v_new's dtype. ``scores_out`` ``[B, T, H, BT]``, if given,
    receives the causal gated scores ``Q Kᵀ ⊙ Γ`` (row t: token t's, within its chunk)."""
    if offsets is None:
        o, Aqk = _fwd_o(q, k, v_new, h, g, scale, chunk_size, scores_out is not None)
    else:
        pieces, scores, first = [], [], 0
        for bos, eos in zip(offsets[:-1], offsets[1:]):
            nt = -(-(eos - bos) // chunk_size)
            sl = slice(bos, eos)
            o, Aqk = _fwd_o(q[:, sl], k[:, sl], v_new[:, sl], h[:, first:first + nt],
                            None if g is None else g[:, sl], scale, chunk_size,
                            scores_out is not None)
            pieces.append(o)
            scores.append(Aqk)
            first += nt
        o = torch.cat(pieces, dim=1)
        Aqk = torch.cat(scores, dim=1) if scores_out is not None else None
    if scores_out is not None:
        scores_out.copy_(Aqk)
    return o
