"""Float64 reference loops of Mamba2's SSD (ALGORITHMS.md §2).

:func:`naive_ssd` loops the state-space recurrence directly; :func:`ssd_as_simple_gla`
computes the same output through the simple GLA reference (q = C, k = B, v = dt·x,
g = dt·A, scale = 1), which is how the fast path computes it. The tests check that the two
agree, which proves the mapping.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fla.ops.common.naive_loop import as_float64, run_sequences, scan
from fla.ops.simple_gla.naive import naive_recurrent_simple_gla


def prepare_ssd(x, dt, A, B, C, dt_bias, dt_softplus, dt_limit):
    """float64 inputs; dt biased, softplus-ed, clamped; B, C expanded from groups to heads."""
    x, dt, A, B, C, dt_bias = (as_float64(t) for t in (x, dt, A, B, C, dt_bias))
    H, G = x.shape[2], B.shape[2]
    if H % G:
        raise ValueError(f"B: the groups G = {G} must divide the heads H = {H}")
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    if G != H:
        B, C = B.repeat_interleave(H // G, dim=2), C.repeat_interleave(H // G, dim=2)
    return x, dt, A, B, C


def skip_and_gate(y, x, D, z):
    """``y + D·x``, then ``· silu(z)``."""
    if D is not None:
        D = as_float64(D)
        y = y + x * (D[:, None] if D.dim() == 1 else D)
    if z is not None:
        y = y * F.silu(as_float64(z))
    return y


def naive_ssd(x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
              dt_limit=(0.0, float("inf")), initial_states=None, cu_seqlens=None,
              return_final_states=False):
    """Mamba2's SSD, one token at a time in float64 (the ground truth).

    With dt_t ← clamp(softplus?(dt_t + dt_bias_h), *dt_limit), per head h (group
    g = h // (H // G)) and h₀ = ``initial_states[n]`` (zeros if None)::

        h_t = exp(dt_t A_h) · h_{t-1} + dt_t · x_t ⊗ B_t      # P×N
        y_t = h_t C_t + D_h x_t
        y_t = y_t · silu(z_t)                                 # if z is given

    Args:
        x: ``[B, T, H, P]``; dt: ``[B, T, H]``; A: ``[H]`` (negative).
        B, C: ``[B, T, G, N]``, G dividing H.
        D: ``[H]`` or ``[H, P]``; z: ``[B, T, H, P]``; dt_bias: ``[H]`` (each optional).
        initial_states: ``[Ns, H, P, N]``; Ns = B, or the number of sequences with ``cu_seqlens``.
        cu_seqlens: ``[Ns + 1]`` int offsets of packed sequences (batch must be 1).
    Returns:
        ``y [B, T, H, P]``, or ``(y, final_states [Ns, H, P, N])`` if ``return_final_states``;
        float64.
    """
    x, dt, A, B, C = prepare_ssd(x, dt, A, B, C, dt_bias, dt_softplus, dt_limit)
    H, P, N = x.shape[2], x.shape[3], B.shape[3]

    def recurrence(inputs, h):
        x, dt, B, C = inputs

        def step(t, h):
            decay = (dt[:, t] * A).exp()[..., None, None]
            h = decay * h + (dt[:, t, :, None] * x[:, t])[..., :, None] * B[:, t, :, None, :]
            return h, torch.einsum('bhpn,bhn->bhp', h, C[:, t])

        return scan(step, h, x.shape[1])

    y, final = run_sequences(recurrence, (x, dt, B, C), initial_states, (H, P, N), cu_seqlens,
                             return_final_states)
    y = skip_and_gate(y, x, D, z)
    return (y, final) if return_final_states else y


def ssd_as_simple_gla(x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                      dt_limit=(0.0, float("inf")), initial_states=None, cu_seqlens=None,
                      return_final_states=False):
    """:func:`naive_ssd` computed as simple GLA: ``q = C, k = B, v = dt·x, g = dt·A,
    scale = 1`` (the state is stored transposed, N×P, inside), plus the D skip and z gate.
    Same arguments, shapes and float64 returns as :func:`naive_ssd`.
    """
    x, dt, A, B, C = prepare_ssd(x, dt, A, B, C, dt_bias, dt_softplus, dt_limit)
    h0 = None if initial_states is None else as_float64(initial_states).transpose(-1, -2)
    y, final = naive_recurrent_simple_gla(C, B, dt[..., None] * x, g=dt * A, scale=1.0,
                                          initial_state=h0,
                                          output_final_state=return_final_states,
                                          cu_seqlens=cu_seqlens)
    y = skip_and_gate(y, x, D, z)
    return (y, final.transpose(-1, -2)) if return_final_states else y
