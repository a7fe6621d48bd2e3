"""fla.ops.mamba2.time_steps: Mamba2's dt' = clamp(softplus?(dt + dt_bias)) and g = dt'·A,
forward and every gradient against float64 PyTorch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fla.ops.mamba2 import time_steps as module
from fla.ops.mamba2.time_steps import time_steps
from tests.helpers import (
    TOLERANCE,
    assert_rel_close,
    assert_sum_close,
    generator,
    randn,
    recorded_steps,
)


def reference(dt, A, dt_bias, softplus, low, high):
    u = dt if dt_bias is None else dt + dt_bias
    if softplus:
        u = F.softplus(u)
    u = u.clamp(min=low, max=high)
    return u, u * A


def check_time_steps(shape, dtype, device, seed, softplus=True, with_bias=True, low=0.0,
                     high=float("inf"), grads=("dt", "g")):
    gen = generator(seed)
    H = shape[-1]
    dt = randn(shape, gen, dtype, device, scale=2.0, requires_grad=True)
    with torch.no_grad():  # one entry past softplus's linear threshold (20)
        dt.view(-1)[0] = 25.0
    A = (-randn((H,), gen, torch.float32, device).abs()).requires_grad_()
    dt_bias = randn((H,), gen, torch.float32, device, requires_grad=True) if with_bias \
        else None
    out, g = time_steps(dt, A, dt_bias, softplus, low, high)
    assert out.dtype == g.dtype == torch.float32 and out.shape == g.shape == dt.shape

    leaves64 = {id(t): t.detach().double().requires_grad_() for t in (dt, A, dt_bias)
                if t is not None}
    out_ref, g_ref = reference(leaves64[id(dt)], leaves64[id(A)],
                               None if dt_bias is None else leaves64[id(dt_bias)],
                               softplus, low, high)
    # float32 math on the input as given: exact but for float32 rounding.
    assert_rel_close("dt'", out, out_ref, 1e-5)
    assert_rel_close("g", g, g_ref, 1e-5)

    ddt = randn(shape, gen, torch.float32, device)
    dg = randn(shape, gen, torch.float32, device)
    loss = sum((o * d).sum() for name, o, d in (("dt", out, ddt), ("g", g, dg))
               if name in grads)
    loss_ref = sum((o * d.double()).sum() for name, o, d in
                   (("dt", out_ref, ddt), ("g", g_ref, dg)) if name in grads)
    loss.backward()
    loss_ref.backward()
    assert dt.grad.dtype == dtype
    assert_rel_close("ddt", dt.grad, leaves64[id(dt)].grad, TOLERANCE[dtype])
    # Sums over every token, float32 accumulation whatever the input dtype: bounded by
    # the size of the terms that cancel in them (a head's dA can be 100x below them).
    if "g" in grads:
        dA_terms = (dg.double() * out_ref).detach()
        assert_sum_close("dA", A.grad, leaves64[id(A)].grad, dA_terms, 1e-5)
    else:
        assert A.grad is None or not A.grad.any()
    if dt_bias is not None:
        assert_sum_close("ddt_bias", dt_bias.grad, leaves64[id(dt_bias)].grad,
                         leaves64[id(dt)].grad, 1e-5)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("shape", [(2, 100, 4), (1, 37, 6), (3, 200, 1)])
def test_kernels(shape, dtype, device, seed):
    check_time_steps(shape, dtype, device, seed)


@pytest.mark.interpret
def test_kernels_options(device, seed):
    # No softplus (raw steps, some negative: the clamp at 0 cuts their gradient), no bias,
    # a finite upper limit, and losses reaching one of the two outputs.
    check_time_steps((2, 70, 4), torch.float32, device, seed, softplus=False)
    check_time_steps((2, 70, 4), torch.float32, device, seed + 1, with_bias=False,
                     low=0.1, high=2.0)
    check_time_steps((2, 70, 4), torch.float32, device, seed + 2, grads=("dt",))
    check_time_steps((2, 70, 4), torch.float32, device, seed + 3, grads=("g",))


@pytest.mark.interpret
def test_kernels_run(device, seed, monkeypatch):
    """The Triton steps, not the PyTorch path, computed the results above."""
    calls = recorded_steps(monkeypatch, module._fwd_op, module._bwd_op)
    check_time_steps((1, 9, 2), torch.float32, device, seed)
    assert calls == ["mamba2_time_steps_fwd", "mamba2_time_steps_bwd"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_torch_path(dtype, monkeypatch, seed):
    monkeypatch.setenv("FLA_BACKEND", "torch")
    check_time_steps((2, 50, 4), dtype, "cpu", seed)


@pytest.mark.gpu
def test_gpu_bf16_training_shape(seed):
    """Mamba2's benchmark shape: 4 x 4096 tokens, 32 heads, bf16 raw steps."""
    check_time_steps((4, 4096, 32), torch.bfloat16, "cuda", seed)
