"""The PyTorch paths of GLA and RWKV6 (CPU tensors): the recurrence one token at a time
(``fused_recurrent_*``) and the chunked algorithm (``chunk_*``), autograd through both.

Both compute the *state part* shared by the two families (ALGORITHMS.md §3)::

    S_t = diag(exp(gk_t)) · S_{t-1} · diag(exp(gv_t)) + k_t ⊗ v_t
    o_t = scale · S_tᵀ q_t              (GLA)
    o_t = scale · S_{t-1}ᵀ q_t          (``exclusive=True``: RWKV6, whose bonus is added
                                         by the caller)

Inputs are validated and time-major; ``offsets`` is the host copy of ``cu_seqlens``
(None: B sequences of length T). Arithmetic in float32; outputs float32 (the caller
casts), final state float32.
"""
from __future__ import annotations

import torch

__all__ = ["recurrent_gla_torch", "chunk_gla_torch"]


def _per_sequence(span_fn, tensors, initial_state, offsets, B, state_shape, device):
    """Run ``span_fn(tensors_of_span, S0) -> (o, S)`` per sequence and concatenate."""
    N = B if offsets is None else len(offsets) - 1
    h0 = (torch.zeros(N, *state_shape, dtype=torch.float32, device=device)
          if initial_state is None else initial_state.float())
    if offsets is None:
        return span_fn(tensors, h0)
    outs, finals = [], []
    for n, (bos, eos) in enumerate(zip(offsets[:-1], offsets[1:])):
        o_n, s_n = span_fn([None if x is None else x[:, bos:eos] for x in tensors],
                           h0[n:n + 1])
        outs.append(o_n)
        finals.append(s_n)
    return torch.cat(outs, dim=1), torch.cat(finals, dim=0)


def recurrent_gla_torch(q, k, v, gk, gv, scale: float, initial_state, offsets,
                        exclusive: bool = False):
    """Token-by-token state part; returns ``(o [B, T, H, V] float32, S [N, H, K, V])``."""
    B, T, H, K = q.shape

    def span(tensors, S):
        q, k, v, gk, gv = (None if x is None else x.float() for x in tensors)
        outs = []
        for t in range(q.shape[1]):
            if exclusive:
                outs.append(scale * torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
            if gk is not None:
                S = S * gk[:, t, :, :, None].exp()
            if gv is not None:
                S = S * gv[:, t, :, None, :].exp()
            S = S + k[:, t, :, :, None] * v[:, t, :, None, :]
            if not exclusive:
                outs.append(scale * torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
        return torch.stack(outs, dim=1), S

    return _per_sequence(span, [q, k, v, gk, gv], initial_state, offsets, B,
                         (H, K, v.shape[-1]), q.device)


def chunk_gla_torch(q, k, v, g, scale: float, initial_state, offsets, exclusive: bool = False,
                    chunk_size: int = 64):
    """The chunked state part with a vector gate ``g [B, T, H, K]``.

    Per chunk, with γ the chunk-local cumsum of g and γq the query side's (γ itself, or
    γ − g with ``exclusive``)::

        A_ij = Σ_k q_ik k_jk exp(γq_ik − γ_jk)    (j ≤ i; j < i with ``exclusive``)
        O    = scale · [ (Q ⊙ exp(γq)) S + A V ]
        S   ← diag(exp(γ_C)) S + (K ⊙ exp(γ_C − γ))ᵀ V

    Every exponent is a difference ≤ 0, masked before ``exp`` where it is discarded.
    Returns ``(o [B, T, H, V] float32, S [N, H, K, V] float32)``.
    """
    B, T, H, K = q.shape
    BT = chunk_size

    def span(tensors, S):
        q, k, v, g = (x.float() for x in tensors)
        L = q.shape[1]
        i = torch.arange(BT, device=q.device)
        outs = []
        for start in range(0, L, BT):
            end = min(start + BT, L)
            C = end - start
            qc, kc, vc = q[:, start:end], k[:, start:end], v[:, start:end]
            mask = (i[:C, None] > i[None, :C]) if exclusive else (i[:C, None] >= i[None, :C])
            mask = mask[None, :, :, None, None]
            gc = g[:, start:end].cumsum(1)                          # [b, C, H, K]
            gq = gc - g[:, start:end] if exclusive else gc
            diff = gq[:, :, None] - gc[:, None, :]                  # [b, C, C, H, K]
            decay = torch.where(mask, torch.exp(torch.where(mask, diff, 0.)), 0.)
            A = torch.einsum("bihk,bjhk,bijhk->bhij", qc, kc, decay)
            qs = qc * gq.exp()
            g_last = gc[:, -1]                                      # [b, H, K]
            ks = kc * torch.exp(g_last[:, None] - gc)
            outs.append(scale * (torch.einsum("bihk,bhkv->bihv", qs, S)
                                 + torch.einsum("bhij,bjhv->bihv", A, vc)))
            S = S * g_last.exp()[..., None] + torch.einsum("bthk,bthv->bhkv", ks, vc)
        return torch.cat(outs, dim=1), S

    return _per_sequence(span, [q, k, v, g], initial_state, offsets, B, (H, K, v.shape[-1]),
                         q.device)
