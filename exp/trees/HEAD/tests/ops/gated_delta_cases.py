"""Shared by the gated-delta-rule op tests (chunk and fused recurrent): input factories
and the comparison of an op against the float64 loop for o, the final state and every
gradient (q, k, v, g, beta, initial_state)."""
import torch
import torch.nn.functional as F

from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
from tests.helpers import (
    TOLERANCE,
    assert_rel_close,
    log_gate,
    output_grad,
    randn,
    reference_device,
    unit_interval,
)

INTERPRETER_DTYPES = [torch.float32, torch.float16]
GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def make_inputs(gen, *, B, T, H, HV, K, V, N=None, gate=True, beta=True, h0=True,
                normalized_k=True):
    """float64 leaves: q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV]; h0."""
    N = B if N is None else N
    k = randn((B, T, H, K), gen, torch.float64)
    return {
        "q": randn((B, T, H, K), gen, torch.float64),
        # Keys of unit norm (what layers feed, and what keeps I − βkkᵀ a contraction).
        "k": F.normalize(k, dim=-1) if normalized_k else k,
        "v": randn((B, T, HV, V), gen, torch.float64),
        "g": log_gate((B, T, HV), gen, low=-0.5, dtype=torch.float64) if gate else None,
        "beta": unit_interval((B, T, HV), gen, torch.float64) if beta else None,
        "initial_state": randn((N, HV, K, V), gen, torch.float64, scale=0.5) if h0 else None,
    }


def cast(inputs, dtype, device, state_dtype=torch.float32):
    """Leaves for one run: inputs rounded to ``dtype`` (state to ``state_dtype``)."""
    out = {}
    for name, x in inputs.items():
        if x is None:
            out[name] = None
            continue
        target = state_dtype if name == "initial_state" else dtype
        out[name] = x.to(target).to(device).detach().requires_grad_()
    return out


def run(fn, leaves, do, dht, **kwargs):
    """Forward, then backward of <o, do> + <final_state, dht>; returns o, ht, grads."""
    o, ht = fn(**leaves, output_final_state=True, **kwargs)
    loss = (o.double() * do.to(o.device)).sum()
    if dht is not None:
        loss = loss + (ht.double() * dht.to(ht.device)).sum()
    loss.backward()
    grads = {n: (x.grad if x is not None else None) for n, x in leaves.items()}
    return o, ht, grads


def loss_weights(inputs, gen, dtype, cu_seqlens=None, use_dht=True):
    """The weights of the loss <o, do> + <final_state, dht> for inputs with k ``[B, T, H,
    K]`` and v ``[B, T, HV, V]``: do in ``dtype``, dht ``[N, HV, K, V]`` float64 (N = the
    initial state's, else B or the packed sequences'), or None without ``use_dht``."""
    B, T, HV, V = inputs["v"].shape
    h0 = inputs.get("initial_state")
    N = h0.shape[0] if h0 is not None else (
        B if cu_seqlens is None else cu_seqlens.numel() - 1)
    do = output_grad((B, T, HV, V), gen, dtype)
    dht = randn((N, HV, inputs["k"].shape[-1], V), gen, torch.float64) if use_dht else None
    return do, dht


def compare(inputs, dtype, device, *, fn,
            ref_fn=naive_recurrent_gated_delta_rule, gen, use_dht=True, tol=None,
            state_dtype=torch.float32, **kwargs):
    do, dht = loss_weights(inputs, gen, dtype, kwargs.get("cu_seqlens"), use_dht)

    l2 = kwargs.pop("use_qk_l2norm_in_kernel", False)
    ref_kwargs = dict(kwargs, use_qk_l2norm=l2)
    if "cu_seqlens" in ref_kwargs and ref_kwargs["cu_seqlens"] is not None:
        ref_kwargs["cu_seqlens"] = ref_kwargs["cu_seqlens"].cpu()
    ref_dev = reference_device(device)
    ref_leaves = {n: None if x is None else
                  x.to(state_dtype if n == "initial_state" else dtype).to(torch.float64)
                  .to(ref_dev).detach().requires_grad_() for n, x in inputs.items()}
    o_ref, ht_ref, g_ref = run(ref_fn, ref_leaves, do, dht, **ref_kwargs)

    leaves = cast(inputs, dtype, device, state_dtype)
    o, ht, grads = run(fn, leaves, do, dht, use_qk_l2norm_in_kernel=l2, **kwargs)

    tol = TOLERANCE[dtype] if tol is None else tol
    assert o.dtype == dtype and o.device.type == torch.device(device).type
    assert ht.dtype == torch.float32 and ht.shape == ht_ref.shape
    assert_rel_close("o", o, o_ref, tol)
    assert_rel_close("final_state", ht, ht_ref, tol)
    for name in leaves:
        if leaves[name] is None:
            continue
        grad = grads[name]
        assert grad is not None, f"no gradient for {name}"
        assert grad.dtype == leaves[name].dtype, name
        assert_rel_close(f"d{name}", grad, g_ref[name], tol)
