"""Mamba2's chunked SSD scan, ``mamba_chunk_scan_combined``, computed as simple GLA.

SSD (ALGORITHMS.md §2) per head h of group g, with dt_t ← clamp(softplus?(dt_t + dt_bias_h)),
state ``h_t ∈ R^{P×N}``::

    h_t = exp(dt_t A_h) · h_{t-1} + (dt_t x_t) ⊗ B_t
    y_t = h_t C_t + D_h x_t,   then y_t · silu(z_t)

is simple GLA ``S_t = exp(g_t) S_{t-1} + k_t ⊗ v_t, o_t = S_tᵀ q_t`` with

    q = C,  k = B,  v = dt · x,  g = dt · A,  scale = 1,  S = hᵀ  (N×P: K = N, V = P)

so this module forms those operands, calls the chunked simple GLA op, and adds the D skip
and the z gate. Each step around the scan is one differentiable kernel each way: the
time steps and g (:mod:`fla.ops.mamba2.time_steps`), B and C per head and v = dt·x
(:mod:`fla.ops.mamba2.operands`), the skip and gate (:mod:`fla.ops.mamba2.skip_gate`).
As PyTorch ops over float32 copies these moved most of the forward's bytes. Every
gradient (x, dt, A, B, C, D, z, dt_bias, initial_states) comes from autograd through
them and the simple GLA op's own backward.
"""
from __future__ import annotations

import math

import torch

from fla.ops.mamba2.operands import heads_of_groups, scaled_input
from fla.ops.mamba2.skip_gate import skip_and_gate
from fla.ops.mamba2.time_steps import time_steps
from fla.ops.simple_gla.chunk import chunk_simple_gla
from fla.ops.simple_gla.fused_recurrent import fused_recurrent_simple_gla
from fla.utils.validation import (
    INDEX_DTYPES,
    Dims,
    check_cu_seqlens,
    check_head_dim,
    check_positive_length,
    check_same_device,
    check_shape,
    check_tensor,
)

__all__ = ["mamba_chunk_scan_combined", "seq_idx_to_cu_seqlens"]


def seq_idx_to_cu_seqlens(seq_idx: torch.Tensor) -> torch.Tensor:
    """Mamba's packed-sequence marker turned into ``cu_seqlens``.

    Args:
        seq_idx: ``[1, T]`` int32/int64; token t belongs to sequence ``seq_idx[0, t]``.
            Ids must be non-decreasing; each run of equal ids is one sequence (an id that
            never appears names no sequence, so ids need not be consecutive).
    Returns:
        ``[Ns + 1]`` int32 offsets on seq_idx's device (0, the run starts, T).

    Reads seq_idx on the host once (a device synchronisation): pass ``cu_seqlens``
    directly where it is at hand.
    """
    ids = seq_idx[0]
    if ids.numel() > 1:
        step = ids[1:] - ids[:-1]
        if bool((step < 0).any()):
            t = int(torch.nonzero(step < 0)[0, 0]) + 1
            raise ValueError(f"seq_idx: expected non-decreasing sequence ids, got "
                             f"{int(ids[t - 1])} then {int(ids[t])} at positions {t - 1}, {t}")
        starts = torch.nonzero(step != 0).flatten() + 1
    else:
        starts = ids.new_zeros(0, dtype=torch.int64)
    T = ids.numel()
    ends = torch.tensor([T], dtype=torch.int64, device=ids.device)
    zero = torch.zeros(1, dtype=torch.int64, device=ids.device)
    return torch.cat([zero, starts.to(torch.int64), ends]).to(torch.int32)


def _check_number(name: str, value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected {what}, got {type(value).__name__}")
    return float(value)


def _validate(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
              cu_seqlens, dt_softplus, dt_limit, return_final_states):
    """Every check before any computation; returns ``cu_seqlens`` (built from
    ``seq_idx`` when that marks the sequences) or None."""
    for name, t in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C)):
        check_tensor(name, t)
    dims = Dims()
    check_shape("x", x, "b T H P", dims)
    check_shape("dt", dt, "b T H", dims)
    check_shape("A", A, "H", dims)
    check_shape("B", B, "b T G N", dims)
    check_shape("C", C, "b T G N", dims)
    check_positive_length(dims, "b T H G")
    check_head_dim("x", dims["P"], "P")
    check_head_dim("B", dims["N"], "N")
    if dims["H"] % dims["G"]:
        raise ValueError(f"B: the groups G = {dims['G']} must divide the heads H = "
                         f"{dims['H']}")
    if D is not None:
        check_tensor("D", D)
        if D.dim() == 1:
            check_shape("D", D, "H", dims)
        else:
            check_shape("D", D, "H P", dims)
    if z is not None:
        check_tensor("z", z)
        check_shape("z", z, "b T H P", dims)
    if dt_bias is not None:
        check_tensor("dt_bias", dt_bias)
        check_shape("dt_bias", dt_bias, "H", dims)

    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size: expected an int, got {type(chunk_size).__name__}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size}")
    if not isinstance(dt_softplus, bool):
        raise TypeError(f"dt_softplus: expected a bool, got {type(dt_softplus).__name__}")
    if not isinstance(return_final_states, bool):
        raise TypeError(f"return_final_states: expected a bool, got "
                        f"{type(return_final_states).__name__}")
    if not isinstance(dt_limit, (tuple, list)) or len(dt_limit) != 2:
        raise TypeError(f"dt_limit: expected a pair (low, high), got {dt_limit!r}")
    low = _check_number("dt_limit[0]", dt_limit[0], "a number")
    high = _check_number("dt_limit[1]", dt_limit[1], "a number")
    if math.isnan(low) or math.isnan(high) or low > high:
        raise ValueError(f"dt_limit: expected low <= high, got low = {low}, high = {high}")

    if initial_states is not None:
        check_tensor("initial_states", initial_states)
    if seq_idx is not None:
        if cu_seqlens is not None:
            raise ValueError("seq_idx: give either seq_idx or cu_seqlens, not both (both "
                             "mark the packed sequences)")
        check_tensor("seq_idx", seq_idx, dtypes=INDEX_DTYPES)
        check_shape("seq_idx", seq_idx, "b T", dims)
    check_same_device(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                      initial_states=initial_states, seq_idx=seq_idx)
    if seq_idx is not None:
        if dims["b"] != 1:
            raise ValueError(f"seq_idx: packed sequences need the batch size b == 1 (all "
                             f"sequences concatenated along T), got b = {dims['b']}")
        cu_seqlens = seq_idx_to_cu_seqlens(seq_idx)
    offsets = check_cu_seqlens(cu_seqlens, T=dims["T"], B=dims["b"])
    Ns = dims["b"] if offsets is None else len(offsets) - 1
    if initial_states is not None:
        dims["Ns"] = Ns
        dims.source["Ns"] = ("the packed sequences (Ns sequences)" if offsets is not None
                             else "x (Ns = b)")
        check_shape("initial_states", initial_states, "Ns H P N", dims)
    return cu_seqlens


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                              initial_states=None, seq_idx=None, cu_seqlens=None,
                              dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False):
    """Mamba2's SSD over whole sequences (training and prefill), differentiable.

    With dt_t ← clamp(softplus?(dt_t + dt_bias), *dt_limit) (in float32) and, per head h
    of group g = h // (H // G), ``h_0 = initial_states[n]`` (zeros if None)::

        h_t = exp(dt_t A_h) · h_{t-1} + (dt_t x_t) ⊗ B_t      # [P, N]
        y_t = h_t C_t + D_h x_t
        y_t = y_t · silu(z_t)                                 # if z is given

    Computed as chunked simple GLA (q = C, k = B, v = dt·x, g = dt·A, scale = 1), then the
    D skip and the z gate; the gradients of every input come from autograd.

    Args:
        x: ``[b, T, H, P]`` fp32/fp16/bf16.
        dt: ``[b, T, H]`` raw time steps.
        A: ``[H]`` negative per-head decay rates (not checked: a positive A grows).
        B, C: ``[b, T, G, N]`` with G dividing H (B and C are cast to x's dtype).
        chunk_size: accepted for compatibility with Mamba (a positive int). The result
            does not depend on it beyond rounding: the kernels use their own chunk of 64.
        D: ``[H]`` or ``[H, P]`` skip (optional).
        z: ``[b, T, H, P]`` gate (optional).
        dt_bias: ``[H]`` (optional).
        initial_states: ``[Ns, H, P, N]`` (Mamba's layout), Ns = b or the number of packed
            sequences (optional; zeros).
        seq_idx: ``[1, T]`` int, Mamba's packed-sequence marker: token t belongs to
            sequence ``seq_idx[0, t]``; ids non-decreasing, each run one sequence. Needs
            b == 1; converted to ``cu_seqlens`` on the host (a synchronisation).
            Not together with ``cu_seqlens``.
        cu_seqlens: ``[Ns + 1]`` int offsets of packed sequences (b == 1).
        dt_softplus: apply softplus to ``dt + dt_bias``.
        dt_limit: ``(low, high)`` clamp of dt, low <= high; applied always (the default
            (0, inf) only clips negative steps, which softplus never gives).
        return_final_states: also return the state after each sequence's last token.

    Returns:
        ``y [b, T, H, P]`` in x's dtype, or ``(y, final_states [Ns, H, P, N] float32)``.

    Raises ``TypeError`` / ``ValueError`` naming the argument before anything runs. (The
    simple GLA op also refuses, as a likely ``[b, H, T, ...]`` mix-up, a call with more
    heads than both tokens and max(P, N): e.g. T = 1 with H = 80, P = 64, N = 16.)
    """
    cu_seqlens = _validate(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states,
                           seq_idx, cu_seqlens, dt_softplus, dt_limit, return_final_states)
    if cu_seqlens is not None and cu_seqlens.device != x.device:
        cu_seqlens = cu_seqlens.to(x.device)

    # Time steps and log decays in float32 whatever the inputs: dt·A summed over a chunk
    # is the exponent of every decay, and 16-bit rounding there is amplified by exp.
    dt, g = time_steps(dt, A, dt_bias, dt_softplus, dt_limit[0], dt_limit[1])
    y, final = _ssd(x, dt, g, B, C, D, initial_states, cu_seqlens, return_final_states,
                    False, z)
    if not return_final_states:
        return y
    return y, final


def ssd_as_simple_gla(x, dt, A, B, C, D=None, initial_states=None, cu_seqlens=None,
                      output_final_state=False, recurrent=False, z=None):
    """The SSD recurrence as simple GLA (q = C, k = B, v = dt·x, g = dt·A, scale = 1)
    plus the D skip and the z gate (one kernel: :func:`skip_and_gate`), on time steps
    already processed (bias, softplus, clamp, padding).

    Shared by :func:`mamba_chunk_scan_combined` (chunked) and the Mamba2 layer's
    multi-token recurrent mode (``recurrent=True``: ``fused_recurrent_simple_gla``).

    Args:
        x: ``[b, T, H, P]``; dt: ``[b, T, H]`` float32; A: ``[H]``;
        B, C: ``[b, T, G, N]``; D: ``[H]`` or ``[H, P]`` or None;
        initial_states: ``[Ns, H, P, N]`` (Mamba's layout) or None;
        z: ``[b, T, H, P]`` gate or None.
    Returns:
        ``(y [b, T, H, P] in x's dtype, final_states [Ns, H, P, N] float32 or None)``.
    """
    return _ssd(x, dt, dt * A.float(), B, C, D, initial_states, cu_seqlens,
                output_final_state, recurrent, z)


def _ssd(x, dt, g, B, C, D, initial_states, cu_seqlens, output_final_state, recurrent, z):
    """:func:`ssd_as_simple_gla` with the log decay ``g = dt·A`` ``[b, T, H]`` given."""
    H = x.shape[2]
    # x is read twice (v = dt·x and the D skip): one contiguous copy for both where it
    # is a view (the Mamba2 layer's x is a slice of its xBC projection).
    x = x.contiguous()
    # The simple GLA operands: one dtype for q, k, v (x's); v = dt·x formed in float32.
    q = heads_of_groups(C.to(x.dtype), H)
    k = heads_of_groups(B.to(x.dtype), H)
    v = scaled_input(x, dt)
    # Mamba keeps h as [P, N]; simple GLA keeps S = hᵀ as [K, V] = [N, P].
    h0 = None if initial_states is None else initial_states.float().transpose(-1, -2)
    op = fused_recurrent_simple_gla if recurrent else chunk_simple_gla
    o, final = op(q, k, v, g=g, scale=1.0, initial_state=h0,
                  output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    y = skip_and_gate(o, x, D, z)
    if final is not None:
        final = final.float().transpose(-1, -2).contiguous()
    return y, final
