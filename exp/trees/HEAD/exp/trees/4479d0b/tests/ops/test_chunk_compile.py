"""The chunked ops under ``torch.compile(fullgraph=True)``: every Triton forward and
backward step is a registered custom op (``torch.ops.fla.*``, fla/utils/custom_ops.py),
so the whole call, argument checks included, traces without a graph break; the compiled
call gives the eager outputs, final states and gradients, and the custom ops really ran
(their steps are seen going through compile ahead's entry point).

Packed sequences are the exception to fullgraph: the chunk grid of a varlen call is sized
from ``cu_seqlens``'s values, read on the host once per call (a data-dependent graph
break), so the varlen case compiles with breaks allowed and must still give the eager
results."""
import math

import pytest
import torch
import torch.nn.functional as F

from fla.ops.delta_rule import chunk_delta_rule
from fla.ops.gated_delta_rule import chunk_gated_delta_rule
from fla.ops.generalized_delta_rule import chunk_dplr_delta_rule
from fla.ops.gla import chunk_gla
from fla.ops.mamba2 import mamba_chunk_scan_combined
from fla.ops.retention import chunk_retention
from fla.ops.rwkv6 import chunk_rwkv6
from fla.ops.rwkv7 import chunk_rwkv7
from fla.ops.simple_gla import chunk_simple_gla
from fla.utils import compile_ahead
from tests.helpers import cu_seqlens_of, generator, log_gate, randn, unit_interval

pytestmark = pytest.mark.interpret

B, T, H, K, V = 1, 70, 2, 16, 16  # T not a multiple of the chunk size (64)


def _leaves(gen, device, **shapes):
    return {name: randn(shape, gen, device=device).requires_grad_()
            for name, shape in shapes.items()}


def _gate(gen, device, shape, low=-1.0):
    return log_gate(shape, gen, low=low).to(device).requires_grad_()


def _h0(gen, device, n=B, k=K, v=V):
    return randn((n, H, k, v), gen, device=device, scale=0.5).requires_grad_()


def _unit_keys(gen, device, shape=(B, T, H, K)):
    return F.normalize(randn(shape, gen, device=device), dim=-1).requires_grad_()


def gated_delta_rule(gen, device):
    x = dict(q=randn((B, T, H, K), gen, device=device).requires_grad_(),
             k=_unit_keys(gen, device), v=randn((B, T, H, V), gen, device=device).requires_grad_(),
             g=_gate(gen, device, (B, T, H), -0.5),
             beta=unit_interval((B, T, H), gen, device=device).requires_grad_(),
             initial_state=_h0(gen, device))
    return chunk_gated_delta_rule, x, dict(output_final_state=True), "gated_delta_rule"


def gated_delta_rule_varlen(gen, device):
    lengths = [23, 81]
    n = sum(lengths)
    x = dict(q=randn((1, n, H, K), gen, device=device).requires_grad_(),
             k=_unit_keys(gen, device, (1, n, H, K)),
             v=randn((1, n, H, V), gen, device=device).requires_grad_(),
             g=_gate(gen, device, (1, n, H), -0.5),
             beta=unit_interval((1, n, H), gen, device=device).requires_grad_(),
             initial_state=_h0(gen, device, n=2))
    return (chunk_gated_delta_rule, x,
            dict(output_final_state=True, cu_seqlens=cu_seqlens_of(lengths, device)),
            "gated_delta_rule")


def delta_rule(gen, device):
    x = dict(q=randn((B, T, H, K), gen, device=device).requires_grad_(),
             k=_unit_keys(gen, device), v=randn((B, T, H, V), gen, device=device).requires_grad_(),
             beta=unit_interval((B, T, H), gen, device=device).requires_grad_())
    # No initial state and no final state: both optional outputs absent.
    return chunk_delta_rule, x, {}, "gated_delta_rule"


def simple_gla(gen, device):
    x = _leaves(gen, device, q=(B, T, H, K), k=(B, T, H, K), v=(B, T, H, V))
    x.update(g=_gate(gen, device, (B, T, H)), initial_state=_h0(gen, device))
    return chunk_simple_gla, x, dict(output_final_state=True), "simple_gla"


def retention(gen, device):
    x = _leaves(gen, device, q=(B, T, H, K), k=(B, T, H, K), v=(B, T, H, V))
    return chunk_retention, x, dict(output_final_state=True), "simple_gla"


def mamba2(gen, device):
    P, N = 8, 16
    x = dict(x=randn((B, T, H, P), gen, device=device).requires_grad_(),
             dt=randn((B, T, H), gen, device=device).requires_grad_(),
             A=(-torch.rand(H, generator=gen) - 0.5).to(device).requires_grad_(),
             B=randn((B, T, 1, N), gen, device=device).requires_grad_(),
             C=randn((B, T, 1, N), gen, device=device).requires_grad_(),
             D=randn((H,), gen, device=device).requires_grad_(),
             initial_states=randn((B, H, P, N), gen, device=device).requires_grad_())
    return (mamba_chunk_scan_combined, x,
            dict(chunk_size=64, dt_softplus=True, return_final_states=True), "simple_gla")


def gla(gen, device):
    x = _leaves(gen, device, q=(B, T, H, K), k=(B, T, H, K), v=(B, T, H, V))
    x.update(g=_gate(gen, device, (B, T, H, K)), initial_state=_h0(gen, device))
    return chunk_gla, x, dict(output_final_state=True), "gla"


def rwkv6(gen, device):
    x = _leaves(gen, device, r=(B, T, H, K), k=(B, T, H, K), v=(B, T, H, V), u=(H, K))
    x.update(w=_gate(gen, device, (B, T, H, K)), initial_state=_h0(gen, device))
    return chunk_rwkv6, x, dict(output_final_state=True), "gla"


def _dplr_leaves(gen, device, q_name):
    kk = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    gate = torch.sigmoid(torch.randn(B, T, H, K, generator=gen))
    w = (-math.exp(-0.5) * torch.rand(B, T, H, K, generator=gen)).clamp(max=-1e-4)
    x = {q_name: randn((B, T, H, K), gen, device=device),
         "k": randn((B, T, H, K), gen, device=device, scale=K ** -0.5),
         "v": randn((B, T, H, V), gen, device=device), "a": (-kk).to(device),
         "b": (kk * gate).to(device), ("gk" if q_name == "q" else "w"): w.to(device),
         "initial_state": randn((B, H, K, V), gen, device=device, scale=0.5)}
    return {n: t.requires_grad_() for n, t in x.items()}


def dplr(gen, device):
    return (chunk_dplr_delta_rule, _dplr_leaves(gen, device, "q"),
            dict(output_final_state=True), "dplr")


def rwkv7(gen, device):
    return chunk_rwkv7, _dplr_leaves(gen, device, "r"), dict(output_final_state=True), "dplr"


CASES = [gated_delta_rule, gated_delta_rule_varlen, delta_rule, simple_gla, retention,
         mamba2, gla, rwkv6, dplr, rwkv7]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_compiled_fullgraph_equals_eager(case, device, seed, monkeypatch):
    fullgraph = "varlen" not in case.__name__
    monkeypatch.setenv("FLA_BACKEND", "triton")
    torch._dynamo.reset()
    fn, leaves, kwargs, family = case(generator(seed), device)
    names, tensors = list(leaves), list(leaves.values())

    def f(*args):
        out = fn(**dict(zip(names, args)), **kwargs)
        return tuple(t for t in (out if isinstance(out, tuple) else (out,)) if t is not None)

    steps = []
    real_run = compile_ahead.run
    monkeypatch.setattr(compile_ahead, "run",
                        lambda label, *a: steps.append(label) or real_run(label, *a))
    compiled = torch.compile(f, fullgraph=fullgraph, backend="aot_eager")
    out = compiled(*tensors)
    ran = list(steps)
    ref = f(*tensors)
    assert len(out) == len(ref)
    gen = generator(seed + 1)
    cotangents = [torch.randn(r.shape, generator=gen).to(r) for r in ref]
    grads = torch.autograd.grad(out, tensors, cotangents)
    ref_grads = torch.autograd.grad(ref, tensors, cotangents)
    for name, a, b in zip(["out"] * len(out) + [f"d{n}" for n in names],
                          (*out, *grads), (*ref, *ref_grads)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)
    # The compiled forward ran the family's forward step behind its custom op, and the
    # compiled backward its backward step.
    assert f"{family}.fwd" in ran
    assert f"{family}.bwd" in steps[len(ran):] or f"{family}.bwd" in ran


def test_ops_are_registered():
    for name in ("chunk_gated_delta_rule", "chunk_simple_gla", "chunk_gla",
                 "chunk_dplr_delta_rule"):
        for step in ("fwd", "bwd"):
            assert hasattr(torch.ops.fla, f"{name}_{step}")


# ------------------------------------------------------- the public forward stages (API.md)
def test_public_stages_compile_fullgraph(device, seed):
    """chunk_scaled_dot_kkt_fwd, solve_tril and chunk_gated_delta_rule_fwd_h (forward-only
    building blocks, public per API.md) are custom ops too: chained under
    torch.compile(fullgraph=True) they give the eager results, None outputs included."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_scaled_dot_kkt import chunk_scaled_dot_kkt_fwd
    from fla.ops.utils import chunk_local_cumsum, solve_tril

    gen = generator(seed)
    k = F.normalize(randn((B, T, H, K), gen, device=device), dim=-1)
    u = randn((B, T, H, V), gen, device=device)
    beta = unit_interval((B, T, H), gen, device=device)
    g = log_gate((B, T, H), gen, low=-0.5).to(device)
    h0 = randn((B, H, K, V), gen, device=device)

    def stages(k, u, beta, g, h0):
        gc = chunk_local_cumsum(g, chunk_size=64)
        A = chunk_scaled_dot_kkt_fwd(k, beta=beta, g=gc, output_dtype=torch.float32)
        Ai = solve_tril(A, output_dtype=None)
        w = 0.5 * k  # any [B, T, H, K] factor: compiled must equal eager
        h, v_new, ht = chunk_gated_delta_rule_fwd_h(k, w, u, g=gc,
                                                    initial_state=h0,
                                                    output_final_state=True)
        h2, none_v, none_ht = chunk_gated_delta_rule_fwd_h(k, None, u, save_new_value=False)
        assert none_v is None and none_ht is None
        return A, Ai, h, v_new, ht, h2

    torch._dynamo.reset()
    expected = stages(k, u, beta, g, h0)
    got = torch.compile(stages, fullgraph=True, backend="aot_eager")(k, u, beta, g, h0)
    for i, (a, b) in enumerate(zip(got, expected)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"output {i}")
