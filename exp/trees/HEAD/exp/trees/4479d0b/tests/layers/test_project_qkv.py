"""fla.layers.utils.project_qkv: the fused path (one GEMM for q, k, v and one short
convolution over their concatenated channels) equals the three projections and
convolutions run apart, and modules that are not plain (hooks, subclasses) keep their
own forward."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fla.layers import GatedDeltaNet
from fla.layers.utils import fused_linear, project_qkv, shared_input_linears, short_convs
from tests.helpers import cu_seqlens_of, generator, randn, uneven_lengths


def make_layer(seed: int, conv_bias: bool) -> GatedDeltaNet:
    torch.manual_seed(seed)
    layer = GatedDeltaNet(hidden_size=64, head_dim=16, num_heads=2, expand_v=2,
                          conv_bias=conv_bias)
    if conv_bias:
        with torch.no_grad():
            for conv in (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d):
                conv.bias.uniform_(-0.5, 0.5)
    return layer


def apart(layer, x, mask, cu_seqlens):
    """q, k, v with each projection and convolution called on its own."""
    qkv = [lin(x) for lin in (layer.q_proj, layer.k_proj, layer.v_proj)]
    (q, k, v), _ = short_convs((layer.q_conv1d, layer.k_conv1d, layer.v_conv1d), qkv, None,
                               False, mask, cu_seqlens)
    return q, k, v


def outputs_and_grads(fn, layer, x, do):
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    outs = fn(x)
    sum((o * d).sum() for o, d in zip(outs, do)).backward()
    return list(outs) + [x.grad] + [p.grad for p in layer.parameters() if p.grad is not None]


def layer_inputs(kind: str, gen):
    """``(x, mask, cu_seqlens)``: ``[2, 37, 64]`` ("dense"), the same with the first row
    left-padded by 11 ("padded"), or three uneven sequences packed in one row ("packed")."""
    if kind == "packed":
        lengths = uneven_lengths(3, gen, low=1, high=30)
        return randn((1, sum(lengths), 64), gen), None, cu_seqlens_of(lengths)
    mask = None
    if kind == "padded":
        mask = torch.ones(2, 37, dtype=torch.bool)
        mask[0, :11] = False
    return randn((2, 37, 64), gen), mask, None


@pytest.mark.parametrize("conv_bias", [False, True])
@pytest.mark.parametrize("inputs", ["dense", "padded", "packed"])
def test_fused_path_equals_the_three_apart(conv_bias, inputs, seed):
    gen = generator(seed)
    layer = make_layer(seed, conv_bias)
    x, mask, cu_seqlens = layer_inputs(inputs, gen)
    do = [randn((*x.shape[:2], w), gen) for w in (32, 32, 64)]
    fused = outputs_and_grads(
        lambda t: project_qkv(layer, t, None, False, mask, cu_seqlens)[:3], layer, x, do)
    expected = outputs_and_grads(lambda t: apart(layer, t, mask, cu_seqlens), layer, x, do)
    assert len(fused) == len(expected)
    for i, (a, b) in enumerate(zip(fused, expected)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"tensor {i}")


def unit_heads(t, head_dim):
    t = t.unflatten(-1, (-1, head_dim))
    return t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6)


@pytest.mark.parametrize("use_cache", [False, True])
@pytest.mark.parametrize("inputs", ["dense", "packed"])
def test_qk_l2norm_on_the_fused_and_the_apart_path(use_cache, inputs, seed):
    """qk_l2norm: q and k normalised per head after the convolutions, on the fused path
    (split_qkv_l2norm over the fused tensor) and apart (use_cache), gradients included."""
    gen = generator(seed)
    layer = make_layer(seed, True)
    x, _, cu_seqlens = layer_inputs(inputs, gen)
    do = [randn((*x.shape[:2], 2, 16), gen), randn((*x.shape[:2], 2, 16), gen),
          randn((*x.shape[:2], 64), gen)]

    def normed(t):
        q, k, v = project_qkv(layer, t, None, use_cache, None, cu_seqlens, qk_l2norm=True)[:3]
        assert q.shape == k.shape == (*t.shape[:2], 2, 16)
        return q, k, v.reshape(*t.shape[:2], 64)

    def expected(t):
        q, k, v = apart(layer, t, None, cu_seqlens)
        return unit_heads(q, 16), unit_heads(k, 16), v

    got = outputs_and_grads(normed, layer, x, do)
    want = outputs_and_grads(expected, layer, x, do)
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"tensor {i}")


class ScaledLinear(nn.Linear):
    """A Linear whose forward is not its weights' maths alone (as an adapter's)."""

    def forward(self, x):
        return 2 * super().forward(x)


def test_modules_that_are_not_plain_keep_their_forward(seed):
    gen = generator(seed)
    layer = make_layer(seed, False)
    x = randn((2, 9, 64), gen)
    expected = [t.detach() for t in apart(layer, x, None, None)]
    # A hook that doubles k's projection, and a subclass that doubles v's.
    handle = layer.k_proj.register_forward_hook(lambda mod, args, out: 2 * out)
    q, k, v, _ = project_qkv(layer, x, None, False, None, None)
    handle.remove()
    plain_v = layer.v_proj
    layer.v_proj = ScaledLinear(64, 64, bias=False)
    layer.v_proj.weight = plain_v.weight
    _, _, v_scaled, _ = project_qkv(layer, x, None, False, None, None)
    torch.testing.assert_close(q, expected[0])
    with torch.no_grad():  # each as its module computes it: the hook and the subclass ran
        torch.testing.assert_close(k, layer.k_conv1d(2 * layer.k_proj(x))[0])
        torch.testing.assert_close(v_scaled, layer.v_conv1d(2 * plain_v(x))[0])


def test_fused_linear_with_some_biases(seed):
    gen = generator(seed)
    lins = [nn.Linear(8, 3, bias=True), nn.Linear(8, 5, bias=False), nn.Linear(8, 2)]
    x = randn((4, 8), gen)
    torch.testing.assert_close(fused_linear(x, *lins), torch.cat([m(x) for m in lins], -1))


def groups_of_linears(seed: int):
    torch.manual_seed(seed)
    return [(nn.Linear(16, 6, bias=False), nn.Linear(16, 4, bias=False)),
            (nn.Linear(16, 3, bias=False),), (nn.Linear(16, 5, bias=False),)]


def shared_and_apart(groups, x, loss_of, autocast=None):
    """Run ``shared_input_linears`` and each group's ``fused_linear`` apart over ``x``;
    for each: [outputs..., x's gradient, every weight's gradient (zeros where None)]."""
    results = []
    for fn in (lambda t: shared_input_linears(t, *groups),
               lambda t: [fused_linear(t, *group) for group in groups]):
        for group in groups:
            for lin in group:
                lin.weight.grad = None
        xi = x.detach().requires_grad_()
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            outs = fn(xi)
        assert all(o.dtype == (autocast or x.dtype) for o in outs)
        loss_of(outs).backward()
        results.append([*[o.detach().float() for o in outs], xi.grad,
                        *[torch.zeros_like(lin.weight) if lin.weight.grad is None
                          else lin.weight.grad for group in groups for lin in group]])
    return results


@pytest.mark.parametrize("used", ["all", "some"])
def test_shared_input_linears_equal_the_groups_apart(used, seed):
    """One node for several groups of projections of one input: values and the gradients
    of x and of every weight as the groups computed apart (a group's output the loss does
    not use gets zero gradients here, None apart: its weights are slices of one stacked
    weight)."""
    gen = generator(seed)
    groups = groups_of_linears(seed)
    x = randn((3, 7, 16), gen)
    widths = [sum(lin.out_features for lin in group) for group in groups]
    do = [randn((3, 7, w), gen) for w in widths]
    keep = [True, used == "all", True]
    results = shared_and_apart(
        groups, x, lambda outs: sum((o * d).sum() for o, d, k in zip(outs, do, keep) if k))
    for i, (a, b) in enumerate(zip(*results)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"tensor {i}")


def test_shared_input_linears_under_autocast(seed):
    """bf16 autocast (CPU): the same as each Linear under autocast, gradients in the
    weights' float32."""
    gen = generator(seed)
    groups = groups_of_linears(seed)
    x = randn((2, 5, 16), gen)
    results = shared_and_apart(groups, x, lambda outs: sum(o.float().sum() for o in outs),
                               autocast=torch.bfloat16)
    n_out = len(groups) + 1
    assert all(g.dtype == torch.float32 for g in results[0][n_out:])
    for i, (a, b) in enumerate(zip(*results)):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2, msg=f"tensor {i}")


def test_gate_projections_ride_with_qkv(seed):
    """project_qkv's ``extra`` groups: fused with q, k, v (no cache) or apart (with a
    cache in or out), the same outputs."""
    gen = generator(seed)
    layer = make_layer(seed, False)
    x = randn((2, 9, 64), gen)
    extra = [(layer.a_proj, layer.b_proj), (layer.g_proj,)]
    fused = project_qkv(layer, x, None, False, None, None, extra=extra)
    with_cache = project_qkv(layer, x, None, True, None, None, extra=extra)
    assert len(fused) == len(with_cache) == 6 and fused[3] is None
    for i in (0, 1, 2, 4, 5):
        torch.testing.assert_close(fused[i], with_cache[i], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused[5], layer.g_proj(x))


def test_shared_input_linears_like_separate_linears_at_the_edges(seed):
    """As separate Linears would: outputs may be modified in place, float64 stays float64
    under autocast, and frozen weights get no gradient (none is computed)."""
    gen = generator(seed)
    groups = groups_of_linears(seed)
    x = randn((2, 5, 16), gen, requires_grad=True)
    outs = shared_input_linears(x, *groups)
    outs[1].mul_(2)  # in place on an output
    sum(o.sum() for o in outs).backward()
    for group in groups:
        for lin in group:
            lin.weight.requires_grad_(False)
            lin.weight.grad = None
    x.grad = None
    sum(o.sum() for o in shared_input_linears(x, *groups)).backward()
    assert x.grad is not None
    assert all(lin.weight.grad is None for group in groups for lin in group)
    groups64 = [tuple(lin.double() for lin in group) for group in groups]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = shared_input_linears(x.detach().double(), *groups64)
    assert all(o.dtype == torch.float64 for o in outs)
