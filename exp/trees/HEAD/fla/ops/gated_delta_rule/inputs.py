"""Input checks and layout normalisation shared by every gated-delta-rule entry point.

``chunk_*`` and ``fused_recurrent_*`` accept the same arguments; both call
:func:`prepare_gated_delta_inputs` first, so a bad call is refused identically (and
before any kernel) whichever mode a layer picks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fla.utils.validation import (
    FLOAT_DTYPES,
    Dims,
    check_dtype,
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
class GatedDeltaInputs:
    """Validated, time-major, contiguous inputs of one call."""

    q: torch.Tensor            # [B, T, H, K]
    k: torch.Tensor            # [B, T, H, K]
    v: torch.Tensor            # [B, T, HV, V]
    g: torch.Tensor | None     # [B, T, HV] natural-log decay per token
    beta: torch.Tensor | None  # [B, T, HV]
    initial_state: torch.Tensor | None  # [N, HV, K, V]
    scale: float
    cu_seqlens: torch.Tensor | None
    seq_offsets: list[int] | None  # host copy of cu_seqlens, read once here
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    N: int

    def with_tensors(self, q: torch.Tensor, k: torch.Tensor,
                     beta: torch.Tensor | None) -> "GatedDeltaInputs":
        """A copy with q, k and beta replaced (field by field: ``torch.compile`` traces
        this on every supported torch, unlike ``__dict__`` or ``dataclasses.replace``)."""
        return GatedDeltaInputs(
            q=q, k=k, v=self.v, g=self.g, beta=beta, initial_state=self.initial_state,
            scale=self.scale, cu_seqlens=self.cu_seqlens, seq_offsets=self.seq_offsets,
            B=self.B, T=self.T, H=self.H, HV=self.HV, K=self.K, V=self.V, N=self.N)




def prepare_gated_delta_inputs(q, k, v, g=None, beta=None, scale=None, initial_state=None,
                               cu_seqlens=None, head_first: bool = False) -> GatedDeltaInputs:
    """Check every argument of a gated-delta-rule call and return them time-major.

    Raises ``TypeError`` / ``ValueError`` naming the argument, the expected and the
    actual value. Shapes (time-major; ``head_first=True`` swaps T and H):
    q, k ``[B, T, H, K]``; v ``[B, T, HV, V]`` with ``HV`` a multiple of ``H``;
    g, beta ``[B, T, HV]``; initial_state ``[N, HV, K, V]``; cu_seqlens ``[N + 1]``.
    """
    if not isinstance(head_first, bool):
        raise TypeError(f"head_first: expected a bool, got {type(head_first).__name__}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, dtypes=FLOAT_DTYPES)
    # q and k meet in one matrix product (q·kᵀ inside a chunk), which takes one dtype;
    # v may differ (the output takes v's dtype).
    check_dtype("k", k, (q.dtype,), what="the dtype of q")
    dims = Dims()
    check_shape("q", q, token_layout("B T H K", head_first), dims)
    check_shape("k", k, token_layout("B T H K", head_first), dims)
    check_shape("v", v, token_layout("B T HV V", head_first), dims)
    check_positive_length(dims)
    check_head_dim("q", dims["K"], "K")
    check_head_dim("v", dims["V"], "V")
    check_time_major("q", q, head_first, head_dims=(dims["V"],))
    if dims["HV"] % dims["H"]:
        raise ValueError(f"v: expected a number of value heads HV that is a multiple of the "
                         f"q/k heads H = {dims['H']}, got HV = {dims['HV']}")
    for name, x in (("g", g), ("beta", beta)):
        if x is not None:
            check_tensor(name, x, dtypes=FLOAT_DTYPES)
            check_shape(name, x, token_layout("B T HV", head_first), dims)
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
    offsets, N, cu_seqlens = check_sequences(cu_seqlens, initial_state, dims, device=q.device,
                                             batch_name="q", state_layout="N HV K V")
    return GatedDeltaInputs(
        q=time_major(q, head_first), k=time_major(k, head_first),
        v=time_major(v, head_first), g=time_major(g, head_first),
        beta=time_major(beta, head_first),
        initial_state=None if initial_state is None else initial_state.contiguous(),
        scale=check_scale(scale, dims["K"] ** -0.5), cu_seqlens=cu_seqlens,
        seq_offsets=offsets, B=dims["B"], T=dims["T"], H=dims["H"], HV=dims["HV"],
        K=dims["K"], V=dims["V"], N=N)
