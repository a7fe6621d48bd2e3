"""Shared by the gated linear-attention op tests (GLA, RWKV6, simple GLA): the vector
gate's factory and the comparison of an op against the float64 loop for o, the final
state and every gradient."""
import torch
import torch.nn.functional as F

from tests.helpers import TOLERANCE, assert_rel_close, assert_sum_close
from tests.ops.gated_delta_cases import loss_weights, run


def log_sigmoid_gate(shape, gen, low=-5.0, spread=3.0):
    """log σ(spread · x), x ~ N(0, 1), clamped at ``low``: many channels near 0, many
    at the bottom of the range."""
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * spread
    return F.logsigmoid(x).clamp(min=low)


def cast_leaves(inputs, dtype, device, fp32_names):
    """Leaves for one run: the inputs named in ``fp32_names`` (gates, states) in float32,
    the rest rounded to ``dtype``."""
    return {n: None if x is None else
            x.to(torch.float32 if n in fp32_names else dtype).to(device).detach()
            .requires_grad_() for n, x in inputs.items()}


def compare_with_loop(inputs, dtype, device, *, fn, ref_fn, gen, fp32_names, tol=None,
                      ref_device="cpu", sums=None, **kwargs):
    """fn and the float64 loop ``ref_fn`` (on ``ref_device``) on the same rounded inputs:
    o, the final state and the gradient of every input. ``inputs`` hold k ``[B, T, H,
    K]`` and v ``[B, T, HV, V]``; ``kwargs`` go to both (cu_seqlens moved to the CPU for
    the loop). ``sums`` maps an input whose gradient is a sum of another's terms (simple
    GLA's per-head g_gamma: dg_gamma[h] = Σ_t dg[t, h]) to that input: its error is then
    bounded by the size of the terms, which may cancel."""
    cu = kwargs.get("cu_seqlens")
    do, dht = loss_weights(inputs, gen, dtype, cu)
    ref_kwargs = dict(kwargs)
    if cu is not None:
        ref_kwargs["cu_seqlens"] = cu.cpu()
    ref_leaves = {n: None if x is None else x.detach().to(torch.float64).requires_grad_()
                  for n, x in cast_leaves(inputs, dtype, ref_device, fp32_names).items()}
    o_ref, ht_ref, g_ref = run(ref_fn, ref_leaves, do, dht, **ref_kwargs)
    leaves = cast_leaves(inputs, dtype, device, fp32_names)
    o, ht, grads = run(fn, leaves, do, dht, **kwargs)
    tol = TOLERANCE[dtype] if tol is None else tol
    assert o.dtype == dtype and ht.dtype == torch.float32 and ht.shape == ht_ref.shape
    assert_rel_close("o", o, o_ref, tol)
    assert_rel_close("final_state", ht, ht_ref, tol)
    sums = sums or {}
    for name, leaf in leaves.items():
        if leaf is not None:
            assert grads[name] is not None and grads[name].dtype == leaf.dtype, name
            terms = g_ref.get(sums.get(name))
            if terms is not None:
                assert_sum_close(f"d{name}", grads[name], g_ref[name], terms, tol)
            else:
                assert_rel_close(f"d{name}", grads[name], g_ref[name], tol)
