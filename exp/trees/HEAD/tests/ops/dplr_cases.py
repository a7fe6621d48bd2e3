"""Shared by the DPLR / RWKV7 op tests: RWKV7-like inputs and the comparison of an op
against the float64 loop for o, the final state and every gradient."""
import math

import torch
import torch.nn.functional as F

from fla.ops.generalized_delta_rule.naive import naive_recurrent_dplr_delta_rule
from tests.helpers import TOLERANCE, assert_rel_close, randn
from tests.ops.gated_delta_cases import cast, loss_weights, run  # noqa: F401 (run: re-export)

INTERPRETER_DTYPES = [torch.float32, torch.float16]
NAMES = ("q", "k", "v", "a", "b", "gk", "initial_state")


def make_inputs(gen, *, B, T, H, K, V, N=None, h0=True):
    """float64 RWKV7-like leaves: gk ∈ (−e^{−0.5}, 0), a = −κ̂, b = κ̂·σ(·), κ̂ unit norm."""
    N = B if N is None else N
    kk = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    gate = torch.sigmoid(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64))
    w = -math.exp(-0.5) * torch.rand(B, T, H, K, generator=gen, dtype=torch.float64)
    return {
        "q": randn((B, T, H, K), gen, torch.float64),
        "k": randn((B, T, H, K), gen, torch.float64, scale=K ** -0.5),
        "v": randn((B, T, H, V), gen, torch.float64),
        "a": -kk, "b": kk * gate, "gk": w.clamp(max=-1e-4),
        "initial_state": randn((N, H, K, V), gen, torch.float64, scale=0.5) if h0 else None,
    }


def leaves(inputs, dtype, device):
    """Leaves for one run: inputs rounded to ``dtype``, the state in float32."""
    return cast(inputs, dtype, device)


def reference(inputs, dtype, do, dht, device="cpu", **kwargs):
    """The float64 loop on the inputs rounded to ``dtype`` (state to float32)."""
    xs = {n: None if x is None else
          x.to(torch.float32 if n == "initial_state" else dtype).double().to(device).detach()
          .requires_grad_() for n, x in inputs.items()}
    if kwargs.get("cu_seqlens") is not None:
        kwargs = dict(kwargs, cu_seqlens=kwargs["cu_seqlens"].to(device))
    return run(naive_recurrent_dplr_delta_rule, xs, do, dht, **kwargs)


def compare(inputs, dtype, device, *, fn, gen, tol=None, ref_device="cpu", **kwargs):
    do, dht = loss_weights(inputs, gen, dtype, kwargs.get("cu_seqlens"))
    o_ref, ht_ref, g_ref = reference(inputs, dtype, do, dht, ref_device, **kwargs)
    o, ht, grads = run(fn, leaves(inputs, dtype, device), do, dht, **kwargs)
    tol = TOLERANCE[dtype] if tol is None else tol
    assert o.dtype == dtype and ht.dtype == torch.float32
    assert_rel_close("o", o, o_ref, tol)
    assert_rel_close("final_state", ht, ht_ref, tol)
    for name, grad in grads.items():
        if inputs[name] is None:
            continue
        assert grad is not None, f"no gradient for {name}"
        assert grad.dtype == (torch.float32 if name == "initial_state" else dtype), name
        assert_rel_close(f"d{name}", grad, g_ref[name], tol)
