"""The PyTorch path of ``fused_recurrent_gated_delta_rule`` (CPU tensors).

The recurrence of ALGORITHMS.md §1 in plain tensor operations, one token at a time in
float32, vectorised over batch and heads; autograd through it gives the backward. It is
the CPU fallback (and the ``FLA_BACKEND=torch`` cross-check), not a fast path: autograd
keeps one state per step, O(T·HV·K·V) memory.
"""
from __future__ import annotations

import torch

from fla.ops.utils.l2norm import l2norm


def _scan(q, k, v, g, beta, scale, state, delta):
    """One span ``[b, L, HV, ...]`` (q, k already per value head) from ``state [b, HV, K, V]``."""
    outs = []
    for t in range(q.shape[1]):
        if g is not None:
            state = state * g[:, t].exp()[..., None, None]
        k_t = k[:, t]
        u = v[:, t] - torch.einsum('bhkv,bhk->bhv', state, k_t) if delta else v[:, t]
        if beta is not None:
            u = u * beta[:, t, :, None]
        state = state + k_t[..., :, None] * u[..., None, :]
        outs.append(scale * torch.einsum('bhkv,bhk->bhv', state, q[:, t]))
    return torch.stack(outs, dim=1), state


def recurrent_gated_delta_rule_torch(q, k, v, g, beta, scale: float, initial_state,
                                     output_final_state: bool, seq_offsets: list[int] | None,
                                     use_qk_l2norm: bool = False, delta: bool = True):
    """Time-major validated inputs (q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g/beta
    ``[B, T, HV]`` or None, initial_state ``[N, HV, K, V]`` or None, ``seq_offsets`` the
    host list of cu_seqlens or None). Returns ``(o in v's dtype, final_state float32 or
    None)``. ``delta=False``: simple GLA's ``S_t = e^{g_t} S_{t-1} + β_t k_t ⊗ v_t``."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    out_dtype = v.dtype
    q, k, v = q.float(), k.float(), v.float()
    g = None if g is None else g.float()
    beta = None if beta is None else beta.float()
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if HV != H:
        q = q.repeat_interleave(HV // H, dim=2)
        k = k.repeat_interleave(HV // H, dim=2)
    N = B if seq_offsets is None else len(seq_offsets) - 1
    if initial_state is None:
        h0 = q.new_zeros(N, HV, K, V)
    else:
        h0 = initial_state.float()

    if seq_offsets is None:
        o, final = _scan(q, k, v, g, beta, scale, h0, delta)
    else:
        outs, finals = [], []
        for n, (bos, eos) in enumerate(zip(seq_offsets[:-1], seq_offsets[1:])):
            span = [None if x is None else x[:, bos:eos] for x in (q, k, v, g, beta)]
            o_n, final_n = _scan(*span, scale, h0[n:n + 1], delta)
            outs.append(o_n)
            finals.append(final_n)
        o, final = torch.cat(outs, dim=1), torch.cat(finals, dim=0)
    return o.to(out_dtype), (final if output_final_state else None)
