"""Whole layers under ``torch.compile(fullgraph=True)`` on the Triton path: every kernel
step inside (the chunk ops, short convolutions, norms, l2norm, activations) is a
registered custom op, so a layer's forward and backward trace without a graph break and
give the eager results. CPU: every layer on the Triton path in the interpreter with
``aot_eager`` on tiny widths (fp32, 1e-5); GPU: the default (inductor) backend in bf16."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers import assert_rel_close, rel_error
from tests.layers.test_layers import RECURRENT, inputs, make

COMPILED_LAYERS = [n for n in RECURRENT if n != "retention_conv"] + ["attention"]


def _fwd_bwd(layer, x):
    """Output, dx and every parameter gradient of ``sum(out²)``."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = layer(x)[0]
    out.float().pow(2).sum().backward()
    return [out.detach(), x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.interpret
@pytest.mark.parametrize("name", COMPILED_LAYERS)
def test_layer_triton_path_compiles_fullgraph(name, seed, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the GPU test below covers every layer")
    monkeypatch.setenv("FLA_BACKEND", "triton")
    torch._dynamo.reset()
    layer = make(name)
    x = inputs(seed, 1, 20)
    expected = _fwd_bwd(layer, x)
    got = _fwd_bwd(torch.compile(layer, fullgraph=True, backend="aot_eager"), x)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert (a is None) == (b is None), i
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"tensor {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", COMPILED_LAYERS)
def test_layer_compiles_fullgraph_gpu(name, seed, monkeypatch):
    """bf16, compiled with inductor, is as accurate as bf16 eager: both against the same
    layer in fp32 (eager and compiled bf16 round different intermediates, so they differ
    from each other by bf16's own error, ~1e-2 on the RWKV layers)."""
    monkeypatch.delenv("FLA_BACKEND", raising=False)
    torch._dynamo.reset()
    reference = make(name).to("cuda")
    layer = copy.deepcopy(reference).to(torch.bfloat16)
    x = inputs(seed, 2, 300).to("cuda")
    expected = _fwd_bwd(reference, x)
    eager = _fwd_bwd(layer, x.to(torch.bfloat16))
    compiled = torch.compile(copy.deepcopy(layer), fullgraph=True)
    got = _fwd_bwd(compiled, x.to(torch.bfloat16))
    names = ["output", "dx"] + [n for n, _ in layer.named_parameters()]
    for n, a, e, ref in zip(names, got, eager, expected):
        assert (a is None) == (ref is None), n
        if a is not None:
            bound = 2 * rel_error(e, ref) + 1e-3
            assert rel_error(a, ref) <= bound, f"{n}: compiled {rel_error(a, ref):.3e}, " \
                                                f"eager {rel_error(e, ref):.3e}"
    # A second call with another length neither breaks nor changes the values.
    x2 = inputs(seed + 1, 2, 170).to("cuda", torch.bfloat16)
    assert_rel_close("output, new length", compiled(x2)[0], layer(x2)[0], 5e-2)
