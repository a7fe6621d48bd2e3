"""The fused recurrent (decoding) ops under ``torch.compile(fullgraph=True)``: the Triton
forward and backward of every family are registered custom ops (``torch.ops.fla.*``,
fla/utils/custom_ops.py), so the whole call, argument checks included, traces without a
graph break; the compiled call gives the eager outputs, final states and gradients, and
the custom ops really ran (their steps are seen going through compile ahead's entry
point). ``selective_state_update`` is one op that updates the state in place (a declared
mutation) and has no backward.

Packed sequences are the exception to fullgraph: the argument checks read ``cu_seqlens``
on the host once per call (a data-dependent graph break), so the varlen case compiles
with breaks allowed and must still give the eager results."""
import pytest
import torch

from fla.ops.delta_rule import fused_recurrent_delta_rule
from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
from fla.ops.generalized_delta_rule import fused_recurrent_dplr_delta_rule
from fla.ops.gla import fused_recurrent_gla
from fla.ops.mamba2 import selective_state_update
from fla.ops.retention import fused_recurrent_retention
from fla.ops.rwkv6 import fused_recurrent_rwkv6
from fla.ops.rwkv7 import fused_recurrent_rwkv7
from fla.ops.simple_gla import fused_recurrent_simple_gla
from fla.utils import compile_ahead
from tests.helpers import cu_seqlens_of, generator, l2_normalized, log_gate, randn, unit_interval

pytestmark = pytest.mark.interpret

B, T, H, K, V = 2, 5, 2, 16, 16
GDR, GLA, DPLR = ("fused_recurrent_gated_delta_rule", "fused_recurrent_gla",
                  "fused_recurrent_dplr")


def _leaves(gen, device, **shapes):
    return {name: randn(shape, gen, device=device, requires_grad=True)
            for name, shape in shapes.items()}


def _gate(gen, device, shape):
    return log_gate(shape, gen, low=-0.5, device=device, requires_grad=True)


def _h0(gen, device, n=B, heads=H):
    return randn((n, heads, K, V), gen, device=device, scale=0.5, requires_grad=True)


def gated_delta_rule(gen, device):
    # Grouped value heads (HV = 2H) and the l2norm of q, k inside the kernels.
    x = _leaves(gen, device, q=(B, T, 1, K), k=(B, T, 1, K), v=(B, T, H, V))
    x.update(g=_gate(gen, device, (B, T, H)),
             beta=unit_interval((B, T, H), gen, device=device, requires_grad=True),
             initial_state=_h0(gen, device))
    return (fused_recurrent_gated_delta_rule, x,
            dict(output_final_state=True, use_qk_l2norm_in_kernel=True), GDR)


def gated_delta_rule_varlen(gen, device):
    lengths = [3, 6]
    n = sum(lengths)
    x = dict(q=randn((1, n, H, K), gen, device=device, requires_grad=True),
             k=l2_normalized((1, n, H, K), gen, device=device, requires_grad=True),
             v=randn((1, n, H, V), gen, device=device, requires_grad=True),
             g=_gate(gen, device, (1, n, H)),
             beta=unit_interval((1, n, H), gen, device=device, requires_grad=True),
             initial_state=_h0(gen, device, n=len(lengths)))
    return (fused_recurrent_gated_delta_rule, x,
            dict(output_final_state=True, cu_seqlens=cu_seqlens_of(lengths, device)), GDR)


def delta_rule(gen, device):
    x = dict(q=randn((B, T, H, K), gen, device=device, requires_grad=True),
             k=l2_normalized((B, T, H, K), gen, device=device, requires_grad=True),
             v=randn((B, T, H, V), gen, device=device, requires_grad=True),
             beta=unit_interval((B, T, H), gen, device=device, requires_grad=True))
    # No initial state and no final state: both optional outputs are placeholders.
    return fused_recurrent_delta_rule, x, {}, GDR


def simple_gla(gen, device):
    x = _leaves(gen, device, q=(B, T, H, K), k=(B, T, H, K), v=(B, T, H, V))
    x.update(g=_gate(gen, device, (B, T, H)), initial_state=_h0(gen, device))
    return fused_recurrent_simple_gla, x, dict(output_final_state=True), GDR


def retention(gen, device):
    x = _leaves(gen, device, q=(B, T, H, K), k=(B, T, H, K), v=(B, T, H, V))
    return fused_recurrent_retention, x, dict(output_final_state=True), GDR


def gla(gen, device):
    # Both gates, and no final state returned: the forward still keeps it for the gate
    # gradients (its gradient then must not count).
    x = _leaves(gen, device, q=(B, T, H, K), k=(B, T, H, K), v=(B, T, H, V))
    x.update(gk=_gate(gen, device, (B, T, H, K)), gv=_gate(gen, device, (B, T, H, V)),
             initial_state=_h0(gen, device))
    return fused_recurrent_gla, x, {}, GLA


def rwkv6(gen, device):
    x = _leaves(gen, device, r=(B, T, H, K), k=(B, T, H, K), v=(B, T, H, V), u=(H, K))
    x.update(w=_gate(gen, device, (B, T, H, K)), initial_state=_h0(gen, device))
    return fused_recurrent_rwkv6, x, dict(output_final_state=True, reverse=True), GLA


def _dplr_leaves(gen, device, q_name, g_name):
    kk = l2_normalized((B, T, H, K), gen, device=device)
    gate = unit_interval((B, T, H, K), gen, device=device)
    x = {q_name: randn((B, T, H, K), gen, device=device),
         "k": randn((B, T, H, K), gen, device=device, scale=K ** -0.5),
         "v": randn((B, T, H, V), gen, device=device), "a": -kk, "b": kk * gate,
         g_name: log_gate((B, T, H, K), gen, low=-0.6, device=device),
         "initial_state": randn((B, H, K, V), gen, device=device, scale=0.5)}
    return {n: t.requires_grad_() for n, t in x.items()}


def dplr(gen, device):
    return (fused_recurrent_dplr_delta_rule, _dplr_leaves(gen, device, "q", "gk"),
            dict(output_final_state=True), DPLR)


def rwkv7(gen, device):
    return (fused_recurrent_rwkv7, _dplr_leaves(gen, device, "r", "w"),
            dict(output_final_state=True), DPLR)


CASES = [gated_delta_rule, gated_delta_rule_varlen, delta_rule, simple_gla, retention, gla,
         rwkv6, dplr, rwkv7]


def _record_steps(monkeypatch) -> list[str]:
    """The labels of the steps run from now on (every custom op's real implementation
    goes through compile_ahead.run)."""
    steps = []
    real_run = compile_ahead.run
    monkeypatch.setattr(compile_ahead, "run",
                        lambda label, *a: steps.append(label) or real_run(label, *a))
    return steps


def _call(fn, names, kwargs):
    def f(*args):
        out = fn(**dict(zip(names, args)), **kwargs)
        return tuple(t for t in out if t is not None)
    return f


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_compiled_fullgraph_equals_eager(case, device, seed, monkeypatch):
    monkeypatch.setenv("FLA_BACKEND", "triton")
    torch._dynamo.reset()
    fn, leaves, kwargs, family = case(generator(seed), device)
    names, tensors = list(leaves), list(leaves.values())
    f = _call(fn, names, kwargs)
    steps = _record_steps(monkeypatch)
    compiled = torch.compile(f, fullgraph="varlen" not in case.__name__, backend="aot_eager")
    out = compiled(*tensors)
    ran = list(steps)
    ref = f(*tensors)
    assert len(out) == len(ref) == 1 + ("output_final_state" in kwargs)
    gen = generator(seed + 1)
    cotangents = [torch.randn(r.shape, generator=gen).to(r) for r in ref]
    grads = torch.autograd.grad(out, tensors, cotangents)
    backward_ran = steps[len(ran):]
    ref_grads = torch.autograd.grad(ref, tensors, cotangents)
    for name, a, b in zip(["out"] * len(out) + [f"d{n}" for n in names],
                          (*out, *grads), (*ref, *ref_grads)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)
    # The compiled forward ran the family's forward step behind its custom op, and the
    # compiled backward its backward step.
    assert f"{family}.fwd" in ran
    assert f"{family}.bwd" in backward_ran


def test_compiled_decode_step_equals_eager(device, seed, monkeypatch):
    """One token without gradients (decoding): the fullgraph-compiled step gives the eager
    output and state; the forward saved nothing for a backward (u is a placeholder)."""
    monkeypatch.setenv("FLA_BACKEND", "triton")
    torch._dynamo.reset()
    gen = generator(seed)
    q, k, v = (randn((B, 1, H, n), gen, device=device) for n in (K, K, V))
    g = log_gate((B, 1, H), gen, device=device)
    beta = unit_interval((B, 1, H), gen, device=device)
    state = randn((B, H, K, V), gen, device=device)

    def step(q, k, v, g, beta, state):
        return fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                                output_final_state=True)

    calls = []
    real_run = compile_ahead.run
    monkeypatch.setattr(compile_ahead, "run",
                        lambda label, *a: calls.append((label, a)) or real_run(label, *a))
    with torch.no_grad():
        out = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, g, beta, state)
        ref = step(q, k, v, g, beta, state)
    # The op's arguments after the step: (q, k, v, g, beta, scale, initial_state,
    # output_final_state, cu_seqlens, N, use_qk_l2norm, save_u, delta).
    assert [label for label, _ in calls] == [f"{GDR}.fwd"] * 2  # compiled, eager
    assert not any(args[1 + 11] for _, args in calls)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("with_indices", [False, True])
def test_selective_state_update_compiled_fullgraph_equals_eager(with_indices, device, seed,
                                                                monkeypatch):
    """The compiled decoding step gives the eager y and updates the state in place the
    same way (a strided view of a larger cache: updated where it lives)."""
    monkeypatch.setenv("FLA_BACKEND", "triton")
    torch._dynamo.reset()
    gen = generator(seed)
    b, Hs, P, N, G = 2, 4, 8, 16, 2
    args = dict(x=randn((b, Hs, P), gen, device=device), dt=randn((b, Hs), gen, device=device),
                A=-unit_interval((Hs,), gen, device=device), B=randn((b, G, N), gen, device=device),
                C=randn((b, G, N), gen, device=device), D=randn((Hs,), gen, device=device),
                z=randn((b, Hs, P), gen, device=device),
                dt_bias=randn((Hs,), gen, device=device))
    rows = 3 if with_indices else b
    if with_indices:
        args["state_batch_indices"] = torch.tensor([2, 0], device=device)
    cache = randn((2, rows, Hs, P, N), gen, device=device)
    names = list(args)

    def f(state, *tensors):
        return selective_state_update(state, **dict(zip(names, tensors)), dt_softplus=True)

    steps = _record_steps(monkeypatch)
    compiled_cache, eager_cache = cache.clone(), cache.clone()
    y = torch.compile(f, fullgraph=True, backend="aot_eager")(compiled_cache[1], *args.values())
    assert steps == ["mamba2.selective_state_update"]
    y_ref = f(eager_cache[1], *args.values())
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(compiled_cache, eager_cache, rtol=1e-6, atol=1e-6)
    assert not torch.equal(compiled_cache[1], cache[1])  # the state did change
    torch.testing.assert_close(compiled_cache[0], cache[0], rtol=0, atol=0)


def test_ops_are_registered():
    for family in ("gated_delta_rule", "gla", "dplr_delta_rule"):
        for step in ("fwd", "bwd"):
            assert hasattr(torch.ops.fla, f"fused_recurrent_{family}_{step}")
    assert hasattr(torch.ops.fla, "selective_state_update")
