"""The PyTorch path of ``fused_recurrent_dplr_delta_rule`` (CPU tensors).

ALGORITHMS.md §4 one token at a time in float32, vectorised over batch and heads;
autograd through it gives the backward (one state kept per step: a fallback, not a fast
path).
"""
from __future__ import annotations

import torch


def _scan(q, k, v, a, b, gk, scale, S):
    outs = []
    for t in range(q.shape[1]):
        s = torch.einsum('bhkv,bhk->bhv', S, a[:, t])
        S = (S * gk[:, t].exp()[..., None] + b[:, t, ..., None] * s[..., None, :]
             + k[:, t, ..., None] * v[:, t, ..., None, :])
        outs.append(scale * torch.einsum('bhkv,bhk->bhv', S, q[:, t]))
    return torch.stack(outs, dim=1), S


def recurrent_dplr_torch(q, k, v, a, b, gk, scale: float, initial_state,
                         output_final_state: bool, seq_offsets: list[int] | None):
    """Time-major validated inputs; returns ``(o in v's dtype, final_state float32 or None)``."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    out_dtype = v.dtype
    acc = torch.promote_types(q.dtype, torch.float32)
    q, k, v, a, b, gk = (x.to(acc) for x in (q, k, v, a, b, gk))
    N = B if seq_offsets is None else len(seq_offsets) - 1
    h0 = q.new_zeros(N, H, K, V) if initial_state is None else initial_state.to(acc)
    if seq_offsets is None:
        o, S = _scan(q, k, v, a, b, gk, scale, h0)
    else:
        outs, finals = [], []
        for n, (bos, eos) in enumerate(zip(seq_offsets[:-1], seq_offsets[1:])):
            o_n, S_n = _scan(*(x[:, bos:eos] for x in (q, k, v, a, b, gk)), scale, h0[n:n + 1])
            outs.append(o_n)
            finals.append(S_n)
        o, S = torch.cat(outs, dim=1), torch.cat(finals, dim=0)
    return o.to(out_dtype), (S.to(torch.float32) if output_final_state else None)
