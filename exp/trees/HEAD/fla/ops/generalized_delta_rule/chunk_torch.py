"""The PyTorch chunked path of the DPLR delta rule (CPU tensors, ``FLA_BACKEND=torch``).

The same chunk equations as the Triton stages (see :mod:`fla.ops.generalized_delta_rule.chunk`),
in plain tensor algebra; autograd through them gives the backward. Per chunk of C tokens,
with γ_t the chunk-local cumulative gate (a K-vector) and γ⁻_t = γ_t − gk_t::

    A_qk[t,s] = Σ_k q_tk k_sk e^{γ_tk − γ_sk}     (s ≤ t)     A_qb: b in place of k
    A_ak[t,s] = Σ_k a_tk k_sk e^{γ⁻_tk − γ_sk}    (s < t)     A_ab: b in place of k
    u  = (I − A_ab)⁻¹ [(a ⊙ e^{γ⁻}) S + A_ak V]     (u_t = a_tᵀ S_{t-1}, C×V)
    O  = scale [(q ⊙ e^{γ}) S + A_qb u + A_qk V]
    S' = e^{γ_C} ⊙ S + (b ⊙ e^{γ_C − γ})ᵀ u + (k ⊙ e^{γ_C − γ})ᵀ V

The C×C products are formed in 32-row sub-blocks, each with its own reference gate:
off-diagonal blocks (rows i, columns j < i) are referenced at the last token before row
block i, so both factors carry an exponent ≤ 0; diagonal blocks at their middle token,
so each factor's exponent is bounded by 16 steps of gate (e^{±9.7} at RWKV7's
w ≥ −e^{−0.5}). No exp(±γ) over a whole chunk is ever formed.
"""
from __future__ import annotations

import torch

SUB = 32  # sub-block rows


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _chunked(x: torch.Tensor, C: int) -> torch.Tensor:
    """``[B, L, H, D] -> [B, NT, H, C, D]``, the partial last chunk padded with zeros."""
    B, L, H, D = x.shape
    NT = -(-L // C)
    if NT * C != L:
        x = torch.cat([x, x.new_zeros(B, NT * C - L, H, D)], dim=1)
    return x.reshape(B, NT, C, H, D).transpose(2, 3)


def sub_block_scores(x, gx, y, gy, g, C: int, strict: bool) -> torch.Tensor:
    """``A[t, s] = Σ_k x_tk y_sk exp(gx_tk − gy_sk)`` on ``[..., C, K]`` chunk tiles, causal
    (``s < t`` if ``strict`` else ``s ≤ t``), with per-sub-block reference gates taken
    from ``g`` (the inclusive cumulative gate) as described in the module docstring."""
    rows = []
    zeros = x.new_zeros(*x.shape[:-2], SUB, SUB)
    for i in range(C // SUB):
        ri = slice(i * SUB, (i + 1) * SUB)
        blocks = []
        for j in range(C // SUB):
            if j > i:
                blocks.append(zeros)
                continue
            cj = slice(j * SUB, (j + 1) * SUB)
            ref = g[..., i * SUB - 1 if j < i else i * SUB + SUB // 2 - 1, None, :]
            xh = x[..., ri, :] * torch.exp(gx[..., ri, :] - ref)
            yh = y[..., cj, :] * torch.exp(ref - gy[..., cj, :])
            blocks.append(xh @ yh.transpose(-1, -2))
        rows.append(torch.cat(blocks, dim=-1))
    A = torch.cat(rows, dim=-2)
    mask = torch.ones(C, C, dtype=torch.bool, device=x.device).tril(-1 if strict else 0)
    return torch.where(mask, A, torch.zeros_like(A))


def _span(q, k, v, a, b, gk, scale, S, C):
    """One batch of equal-length sequences ``[B, L, H, ...]`` from state ``S [B, H, K, V]``."""
    L = q.shape[1]
    acc = _acc(q.dtype)
    q, k, a, b, gk = (_chunked(x.to(acc), C) for x in (q, k, a, b, gk))  # [B, NT, H, C, K]
    v = _chunked(v.to(acc), C)                                            # [B, NT, H, C, V]
    g = gk.cumsum(-2)
    ge = g - gk
    A_qk = sub_block_scores(q, g, k, g, g, C, strict=False)
    A_qb = sub_block_scores(q, g, b, g, g, C, strict=False)
    A_ak = sub_block_scores(a, ge, k, g, g, C, strict=True)
    A_ab = sub_block_scores(a, ge, b, g, g, C, strict=True)
    eye = torch.eye(C, dtype=acc, device=q.device)
    # W = (I − A_ab)⁻¹ (a ⊙ e^{γ⁻}), U = (I − A_ab)⁻¹ A_ak V: the chunk's u = W S + U.
    rhs = torch.cat([a * torch.exp(ge), A_ak @ v], dim=-1)
    WU = torch.linalg.solve_triangular(eye - A_ab, rhs, upper=False, unitriangular=True)
    K = q.shape[-1]
    W, U = WU[..., :K], WU[..., K:]
    g_last = g[..., -1:, :]                                               # [B, NT, H, 1, K]
    qg = q * torch.exp(g)
    decay_to_end = torch.exp(g_last - g)
    bg, kg = b * decay_to_end, k * decay_to_end
    outs = []
    S = S.to(acc)
    for n in range(q.shape[1]):
        u = W[:, n] @ S + U[:, n]
        outs.append(scale * (qg[:, n] @ S + A_qb[:, n] @ u + A_qk[:, n] @ v[:, n]))
        S = (S * torch.exp(g_last[:, n]).transpose(-1, -2) + bg[:, n].transpose(-1, -2) @ u
             + kg[:, n].transpose(-1, -2) @ v[:, n])
    o = torch.stack(outs, dim=1)                                          # [B, NT, H, C, V]
    o = o.transpose(2, 3).reshape(o.shape[0], -1, o.shape[2], o.shape[-1])[:, :L]
    return o, S


def chunk_dplr_delta_rule_torch(q, k, v, a, b, gk, scale: float, initial_state,
                                output_final_state: bool, seq_offsets: list[int] | None,
                                chunk_size: int = 64):
    """Validated time-major inputs (``[B, T, H, ...]``; ``seq_offsets`` the host list of
    cu_seqlens or None). Returns ``(o [B, T, H, V] in v's dtype, final_state
    [N, H, K, V] float32 or None)``; differentiable in every input."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B if seq_offsets is None else len(seq_offsets) - 1
    h0 = (initial_state if initial_state is not None
          else q.new_zeros(N, H, K, V, dtype=torch.float32))
    if seq_offsets is None:
        o, S = _span(q, k, v, a, b, gk, scale, h0, chunk_size)
    else:
        outs, finals = [], []
        for n, (bos, eos) in enumerate(zip(seq_offsets[:-1], seq_offsets[1:])):
            part = (x[:, bos:eos] for x in (q, k, v, a, b, gk))
            o_n, S_n = _span(*part, scale, h0[n:n + 1], chunk_size)
            outs.append(o_n)
            finals.append(S_n)
        o, S = torch.cat(outs, dim=1), torch.cat(finals, dim=0)
    return o.to(v.dtype), (S.to(torch.float32) if output_final_state else None)
