"""Input checks shared by the simple GLA entry points (chunk and fused recurrent).

Simple GLA takes the gated delta rule's arguments without ``beta`` and with an optional
per-head constant decay ``g_gamma``; both are checked here, before any kernel, and
folded into one per-token log decay.
"""
from __future__ import annotations

from fla.ops.gated_delta_rule.inputs import GatedDeltaInputs, prepare_gated_delta_inputs
from fla.utils.validation import FLOAT_DTYPES, check_same_device, check_tensor


def prepare_simple_gla_inputs(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                              cu_seqlens=None, head_first: bool = False) -> GatedDeltaInputs:
    """Validate a simple GLA call and return time-major inputs whose ``g`` is the total
    per-token log decay ``g_t + g_gamma[h]`` (``[B, T, HV]`` float32 when ``g_gamma`` is
    given, else ``g`` as passed, or None for no decay) and whose ``beta`` is None.

    Raises ``TypeError`` / ``ValueError`` naming the argument, the expected and the actual
    value: the shapes of :func:`prepare_gated_delta_inputs`, plus ``g_gamma`` ``[HV]``.
    """
    x = prepare_gated_delta_inputs(q, k, v, g, None, scale, initial_state, cu_seqlens,
                                   head_first)
    if g_gamma is None:
        return x
    check_tensor("g_gamma", g_gamma, dtypes=FLOAT_DTYPES)
    if tuple(g_gamma.shape) != (x.HV,):
        raise ValueError(f"g_gamma: expected one log decay per head, shape [{x.HV}] "
                         f"(the heads of v), got {list(g_gamma.shape)}")
    check_same_device(q=q, g_gamma=g_gamma)
    # A per-head constant becomes a per-token gate: the kernels then need one code path,
    # and autograd sums its gradient over tokens. [B, T, HV] float32 is 1/32 of v's size
    # at V = 128 in bf16.
    total = g_gamma.float().expand(x.B, x.T, x.HV)
    if x.g is not None:
        total = total + x.g.float()
    x.g = total.contiguous()
    return x
