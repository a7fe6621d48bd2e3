"""Input checks and layout normalisation shared by the GLA and RWKV6 entry points.

``chunk_*`` and ``fused_recurrent_*`` of both families call :func:`prepare_gla_inputs`
first, so that a bad call is refused identically (and before any kernel) in either mode.
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
class GLAInputs:
    """Validated, time-major, contiguous inputs of one call."""

    q: torch.Tensor              # [B, T, H, K] (RWKV6: r)
    k: torch.Tensor              # [B, T, H, K]
    v: torch.Tensor              # [B, T, H, V]
    gk: torch.Tensor | None      # [B, T, H, K] natural-log decay of the state's rows
    gv: torch.Tensor | None      # [B, T, H, V] natural-log decay of the state's columns
    u: torch.Tensor | None       # [H, K] RWKV6's bonus of the current token
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




def prepare_gla_inputs(q, k, v, gk=None, gv=None, scale=None, initial_state=None,
                       cu_seqlens=None, head_first: bool = False, u=None,
                       names=("q", "gk")) -> GLAInputs:
    """Check every argument of a GLA / RWKV6 call and return them time-major.

    Shapes (time-major; ``head_first=True`` swaps T and H): q, k, gk ``[B, T, H, K]``;
    v, gv ``[B, T, H, V]``; u ``[H, K]``; initial_state ``[N, H, K, V]``; cu_seqlens
    ``[N + 1]`` (then B = 1). ``names`` are the caller's names of q and gk (RWKV6: r, w),
    used in the messages. Raises ``TypeError`` / ``ValueError`` naming the argument, the
    expected and the actual value.
    """
    qn, gn = names
    for name, x in ((qn, q), ("k", k), ("v", v)):
        check_tensor(name, x, dtypes=FLOAT_DTYPES)
    dims = Dims()
    check_shape(qn, q, token_layout("B T H K", head_first), dims)
    check_shape("k", k, token_layout("B T H K", head_first), dims)
    check_shape("v", v, token_layout("B T H V", head_first), dims)
    check_positive_length(dims)
    check_head_dim(qn, dims["K"], "K")
    check_head_dim("v", dims["V"], "V")
    check_time_major(qn, q, head_first, head_dims=(dims["V"],))
    if gk is not None:
        check_tensor(gn, gk, dtypes=FLOAT_DTYPES)
        check_shape(gn, gk, token_layout("B T H K", head_first), dims)
    if gv is not None:
        check_tensor("gv", gv, dtypes=FLOAT_DTYPES)
        check_shape("gv", gv, token_layout("B T H V", head_first), dims)
    if u is not None:
        check_tensor("u", u, dtypes=FLOAT_DTYPES)
        check_shape("u", u, "H K", dims)
    check_same_device(**{qn: q, "k": k, "v": v, gn: gk, "gv": gv, "u": u,
                         "initial_state": initial_state})
    offsets, N, cu_seqlens = check_sequences(cu_seqlens, initial_state, dims, device=q.device,
                                             batch_name=qn)
    return GLAInputs(
        q=time_major(q, head_first), k=time_major(k, head_first),
        v=time_major(v, head_first), gk=time_major(gk, head_first),
        gv=time_major(gv, head_first), u=None if u is None else u.contiguous(),
        initial_state=None if initial_state is None else initial_state.contiguous(),
        scale=check_scale(scale, dims["K"] ** -0.5), cu_seqlens=cu_seqlens,
        seq_offsets=offsets, B=dims["B"], T=dims["T"], H=dims["H"], K=dims["K"],
        V=dims["V"], N=N)
