"""The gradient of the DPLR gate gk from the gradients of q, k, a, b (no state needed).

Rescale the state row-wise, S̃_t = e^{−G_t} ⊙ S_t with G_t = Σ_{s≤t} gk_s (per sequence)::

    S̃_t = S̃_{t-1} + (b_t e^{−G_t})(a_t e^{G_{t-1}})ᵀ S̃_{t-1} + (k_t e^{−G_t}) v_tᵀ
    o_t = scale (q_t e^{G_t})ᵀ S̃_t,    S_T = e^{G_T} ⊙ S̃_T

so G enters only through these factors, and with dq, dk, da, db the gradients of the
original inputs::

    ∂L/∂G_t = q_t⊙dq_t − b_t⊙db_t − k_t⊙dk_t + a_{t+1}⊙da_{t+1} + [t = T] Σ_v dht ⊙ S_T
    dgk_s   = Σ_{t≥s} ∂L/∂G_t

The fused recurrent backward uses it as written: it need not carry ∂/∂γ through its
decay factors. The chunked backward applies it per chunk (the chunk's entry state held
fixed, Σ_v dS'⊙S' of the state leaving the chunk in place of the dht term), in fp32
inside ``chunk_dplr_bwd_intra``: its sums then run over at most 64 tokens.
"""
from __future__ import annotations

import torch


def dplr_gate_grad(q, k, a, b, dq, dk, da, db, dht=None, ht=None, cu_seqlens=None,
                   out_dtype=torch.float32) -> torch.Tensor:
    """``dgk [B, T, H, K]`` in ``out_dtype`` from time-major inputs and their gradients;
    ``dht``/``ht`` (``[N, H, K, V]``) the final state's gradient and value, or None.
    The reverse sum runs in float64: over thousands of tokens a float32 running sum
    loses digits that cancel in the result."""
    f64 = torch.float64
    ada = a.to(f64) * da.to(f64)
    x = q.to(f64) * dq.to(f64) - b.to(f64) * db.to(f64) - k.to(f64) * dk.to(f64) + ada
    if dht is not None:
        last = (dht.to(f64) * ht.to(f64)).sum(-1)                     # [N, H, K]
        if cu_seqlens is None:
            x[:, -1] += last
        else:
            x[0].index_add_(0, cu_seqlens[1:].long() - 1, last)
    T = x.shape[1]
    total = x.flip(1).cumsum(1).flip(1)
    if cu_seqlens is not None:
        # One pass over the packed axis, minus what the later sequences contributed.
        total = torch.cat([total, total.new_zeros(1, 1, *total.shape[2:])], dim=1)
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        next_start = torch.repeat_interleave(cu_seqlens[1:].long(), lengths.long(),
                                             output_size=T)
        total = total[:, :T] - total[:, next_start]
    return (total - ada).to(out_dtype)
