"""The loop shared by the float64 reference recurrences (every family's ``naive.py``).

A reference is written as one *step* (state in, state and output out, vectorised over
batch and heads); :func:`scan` runs it over time and :func:`run_sequences` runs the scan
once per sequence, so that the varlen rules (each packed sequence starts from its own
``initial_state[n]``, no state crosses a boundary) live in this one place.
Everything here is plain differentiable PyTorch: references provide reference gradients.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from fla.utils.validation import check_cu_seqlens

# (inputs sliced to one span [b, L, ...], state [b, ...]) -> (outputs [b, L, ...], state)
Recurrence = Callable[[tuple, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def as_float64(x: torch.Tensor | None) -> torch.Tensor | None:
    """``x`` in float64 (differentiable cast); None stays None."""
    return None if x is None else x.to(torch.float64)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """``x / ‖x‖₂`` over the last dimension (exact: no epsilon)."""
    return x / x.norm(dim=-1, keepdim=True)


def scan(step: Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
         state: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``state, out_t = step(t, state)`` for t = 0..length-1; returns
    (outputs stacked on dim 1, last state)."""
    outs = []
    for t in range(length):
        state, out = step(t, state)
        outs.append(out)
    return torch.stack(outs, dim=1), state


def run_sequences(recurrence: Recurrence, inputs: Sequence[torch.Tensor | None],
                  initial_state: torch.Tensor | None, state_shape: Sequence[int],
                  cu_seqlens: torch.Tensor | None, output_final_state: bool
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Apply ``recurrence`` to the whole batch, or to each packed sequence of ``cu_seqlens``.

    Args:
        recurrence: ``(inputs, S0) -> (o, S)`` on ``[b, L, ...]`` inputs and ``[b, *state_shape]``
            states.
        inputs: time-major ``[B, T, ...]`` float64 tensors (None entries passed through);
            the first tensor fixes B and T.
        initial_state: ``[N, *state_shape]`` or None (zeros); N = B, or the number of
            sequences with ``cu_seqlens`` (then B must be 1).
        state_shape: the state of one sequence, e.g. ``(H, K, V)``.
    Returns:
        ``o`` (``[B, T, ...]``, concatenated over sequences) and the final state
        ``[N, *state_shape]`` in float64, or None unless ``output_final_state``.
    """
    ref = next(x for x in inputs if x is not None)
    B, T = ref.shape[0], ref.shape[1]
    offsets = check_cu_seqlens(cu_seqlens, T=T, B=B)
    N = B if offsets is None else len(offsets) - 1
    shape = (N, *state_shape)
    if initial_state is None:
        initial_state = torch.zeros(shape, dtype=torch.float64, device=ref.device)
    elif tuple(initial_state.shape) != shape:
        raise ValueError(f"initial_state: expected shape {shape}, got "
                         f"{tuple(initial_state.shape)}")
    initial_state = as_float64(initial_state)

    if offsets is None:
        o, final = recurrence(tuple(inputs), initial_state)
    else:
        outs, finals = [], []
        for n, (bos, eos) in enumerate(zip(offsets[:-1], offsets[1:])):
            part = tuple(None if x is None else x[:, bos:eos] for x in inputs)
            o_n, final_n = recurrence(part, initial_state[n:n + 1])
            outs.append(o_n)
            finals.append(final_n)
        o, final = torch.cat(outs, dim=1), torch.cat(finals, dim=0)
    return o, (final if output_final_state else None)
