"""fla.ops.gated_delta_rule.gate: Gated DeltaNet's g and β from the packed [a | b]
projection, forward and every gradient against float64 PyTorch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fla.ops.gated_delta_rule.gate import gated_delta_rule_gate
from tests.helpers import TOLERANCE, assert_rel_close, generator, randn


def reference(ab, A_log, dt_bias, beta_scale):
    H = ab.shape[-1] // 2
    a, b = ab[..., :H], ab[..., H:]
    if dt_bias is not None:
        a = a + dt_bias
    return -A_log.exp() * F.softplus(a), beta_scale * b.sigmoid()


def check_gate(shape, H, dtype, device, seed, beta_scale=1.0, with_dt_bias=True,
               grads=("g", "beta"), scale=2.0):
    gen = generator(seed)
    ab = randn((*shape, 2 * H), gen, dtype, device, scale=scale, requires_grad=True)
    with torch.no_grad():  # one entry past softplus's linear threshold (20)
        ab.view(-1)[0] = 25.0
    A_log = randn((H,), gen, torch.float32, device, requires_grad=True)
    dt_bias = randn((H,), gen, torch.float32, device, requires_grad=True) if with_dt_bias \
        else None
    g, beta = gated_delta_rule_gate(ab, A_log, dt_bias, beta_scale)
    assert g.dtype == torch.float32 and beta.dtype == dtype
    assert g.shape == beta.shape == (*shape, H)

    leaves64 = [t.detach().double().requires_grad_() for t in (ab, A_log)]
    dt64 = None if dt_bias is None else dt_bias.detach().double().requires_grad_()
    g_ref, beta_ref = reference(*leaves64, dt64, beta_scale)
    tol = TOLERANCE[dtype]
    assert_rel_close("g", g, g_ref, tol)
    assert_rel_close("beta", beta, beta_ref, tol)

    dg = randn(g.shape, gen, torch.float32, device)
    dbeta = randn(beta.shape, gen, dtype, device)
    loss = sum((out.float() * d.float()).sum() for name, out, d in
               (("g", g, dg), ("beta", beta, dbeta)) if name in grads)
    loss_ref = sum((out * d.double()).sum() for name, out, d in
                   (("g", g_ref, dg), ("beta", beta_ref, dbeta)) if name in grads)
    loss.backward()
    loss_ref.backward()
    assert ab.grad.dtype == dtype
    assert_rel_close("dab", ab.grad, leaves64[0].grad, tol)
    if "g" in grads:
        # Sums over every token: float32 accumulation whatever the input dtype.
        assert_rel_close("dA_log", A_log.grad, leaves64[1].grad, 1e-4)
        if dt_bias is not None:
            assert_rel_close("ddt_bias", dt_bias.grad, dt64.grad, 1e-4)
    else:
        assert not A_log.grad.any()


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("shape,H", [((2, 100), 4), ((1, 37), 6), ((3, 200), 1)])
def test_gate_kernels(shape, H, dtype, device, seed):
    check_gate(shape, H, dtype, device, seed)


@pytest.mark.interpret
def test_gate_kernels_options_fp32(device, seed):
    # β in (0, 2), no dt_bias, and losses reaching only one of the two outputs.
    check_gate((2, 70), 4, torch.float32, device, seed, beta_scale=2.0)
    check_gate((2, 70), 4, torch.float32, device, seed + 1, with_dt_bias=False)
    check_gate((2, 70), 4, torch.float32, device, seed + 2, grads=("beta",))
    check_gate((2, 70), 4, torch.float32, device, seed + 3, grads=("g",))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_torch_path(dtype, monkeypatch, seed):
    monkeypatch.setenv("FLA_BACKEND", "torch")
    check_gate((2, 50), 4, dtype, "cpu", seed)


@pytest.mark.gpu
def test_gpu_bf16_training_shape(seed):
    """The 340M Gated DeltaNet's shape: 4 x 4096 tokens, 4 heads, bf16."""
    check_gate((4, 4096), 4, torch.bfloat16, "cuda", seed)


@pytest.mark.parametrize("call,match", [
    (lambda: gated_delta_rule_gate(torch.randn(3, 7), torch.randn(3)), "ab"),
    (lambda: gated_delta_rule_gate(torch.randn(3, 8), torch.randn(3)), "A_log"),
    (lambda: gated_delta_rule_gate(torch.randn(3, 8), torch.randn(4), torch.randn(2)),
     "dt_bias"),
    (lambda: gated_delta_rule_gate(torch.randint(0, 3, (3, 8)), torch.randn(4)), "ab"),
])
def test_bad_calls(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_float64_and_zero_rows(seed):
    """float64 takes the PyTorch path and keeps float64; zero rows give empty outputs."""
    gen = generator(seed)
    ab = randn((3, 5, 8), gen, torch.float64)
    A_log, dt_bias = randn((4,), gen, torch.float64), randn((4,), gen, torch.float64)
    g, beta = gated_delta_rule_gate(ab, A_log, dt_bias, 2.0)
    g_ref, beta_ref = reference(ab, A_log, dt_bias, 2.0)
    assert g.dtype == beta.dtype == torch.float64
    assert_rel_close("g", g, g_ref, 1e-12)
    assert_rel_close("beta", beta, beta_ref, 1e-12)
    g, beta = gated_delta_rule_gate(torch.zeros(2, 0, 8), A_log.float())
    assert g.shape == beta.shape == (2, 0, 4)
