"""Input checks and layout normalisation shared by every DPLR (generalized delta rule)
entry point: ``chunk_dplr_delta_rule``, ``fused_recurrent_dplr_delta_rule`` and the
RWKV7 wrappers. A bad call is refused identically, before any kernel, whichever path runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fla.utils.validation import (
    FLOAT_DTYPES,
    Dims,
    check_head_dim,
    check_positive_length,
    check_same_device,
    check_scale,
    check_sequences,
    check_shape,
    check_tensor,
    check_time_major,
    time_major,
    token_layout,
)


@dataclass
class DPLRInputs:
    """Validated, time-major, contiguous inputs of one call."""

    q: torch.Tensor    # [B, T, H, K]
    k: torch.Tensor    # [B, T, H, K]
    v: torch.Tensor    # [B, T, H, V]
    a: torch.Tensor    # [B, T, H, K]
    b: torch.Tensor    # [B, T, H, K]
    gk: torch.Tensor   # [B, T, H, K] natural-log decay of the state's K rows
    initial_state: torch.Tensor | None  # [N, H, K, V]
    scale: float
    cu_seqlens: torch.Tensor | None
    seq_offsets: list[int] | None  # host copy of cu_seqlens, read once here
    B: int
    T: int
    H: int
    K: int
    V: int
    N: int

    def tensors(self):
        return self.q, self.k, self.v, self.a, self.b, self.gk




def prepare_dplr_inputs(q, k, v, a, b, gk, scale=None, initial_state=None, cu_seqlens=None,
                        head_first: bool = False, names=("q", "k", "v", "a", "b", "gk"),
                        default_scale: float | None = None) -> DPLRInputs:
    """Check every argument of a DPLR call and return them time-major.

    Shapes (time-major; ``head_first=True`` swaps T and H): q, k, a, b, gk ``[B, T, H, K]``,
    v ``[B, T, H, V]``, initial_state ``[N, H, K, V]``, cu_seqlens ``[N + 1]``. ``names``
    are the caller's argument names (RWKV7 calls q ``r`` and gk ``w``) so that messages
    name what the caller passed. ``scale`` None means ``default_scale`` (``K ** -0.5`` when
    that is None). Raises ``TypeError`` / ``ValueError``.
    """
    tensors = dict(zip(names, (q, k, v, a, b, gk)))
    for name, x in tensors.items():
        check_tensor(name, x, dtypes=FLOAT_DTYPES)
    dims = Dims()
    for name, x in tensors.items():
        layout = "B T H V" if name == names[2] else "B T H K"
        check_shape(name, x, token_layout(layout, head_first), dims)
    check_positive_length(dims)
    check_head_dim(names[0], dims["K"], "K")
    check_head_dim(names[2], dims["V"], "V")
    check_time_major(names[0], q, head_first, head_dims=(dims["V"],))
    check_same_device(**tensors, initial_state=initial_state)
    offsets, N, cu_seqlens = check_sequences(cu_seqlens, initial_state, dims, device=q.device,
                                             batch_name=names[0])
    default = dims["K"] ** -0.5 if default_scale is None else default_scale
    q, k, v, a, b, gk = (time_major(x, head_first) for x in (q, k, v, a, b, gk))
    return DPLRInputs(
        q=q, k=k, v=v, a=a, b=b, gk=gk,
        initial_state=None if initial_state is None else initial_state.contiguous(),
        scale=check_scale(scale, default), cu_seqlens=cu_seqlens, seq_offsets=offsets,
        B=dims["B"], T=dims["T"], H=dims["H"], K=dims["K"], V=dims["V"], N=N)
