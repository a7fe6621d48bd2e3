"""fla.ops.mamba2.operands: B and C per head, and v = dt ⊙ x, forward and gradients
against float64 PyTorch."""
from __future__ import annotations

import pytest
import torch

from fla.ops.mamba2 import operands
from fla.ops.mamba2.operands import heads_of_groups, scaled_input
from tests.helpers import (
    TOLERANCE,
    assert_rel_close,
    generator,
    output_grad,
    randn,
    recorded_steps,
)


def check_heads_of_groups(b, T, G, H, N, dtype, device, seed):
    gen = generator(seed)
    t = randn((b, T, G, N), gen, dtype, device, requires_grad=True)
    out = heads_of_groups(t, H)
    assert out.shape == (b, T, H, N) and out.dtype == dtype
    t64 = t.detach().double().requires_grad_()
    ref = t64.repeat_interleave(H // G, dim=2)
    # A copy: exact.
    assert torch.equal(out, ref.to(dtype))
    dout = output_grad(out.shape, gen, dtype)
    (out.float() * dout.to(device).float()).sum().backward()
    (ref * dout.to(device)).sum().backward()
    assert t.grad.dtype == dtype
    assert_rel_close("dt", t.grad, t64.grad, TOLERANCE[dtype])


def check_scaled_input(shape, dtype, device, seed):
    gen = generator(seed)
    x = randn(shape, gen, dtype, device, requires_grad=True)
    dt = randn(shape[:-1], gen, torch.float32, device).abs().requires_grad_()
    v = scaled_input(x, dt)
    assert v.shape == x.shape and v.dtype == dtype
    x64, dt64 = (t.detach().double().requires_grad_() for t in (x, dt))
    ref = x64 * dt64[..., None]
    tol = TOLERANCE[dtype]
    assert_rel_close("v", v, ref, tol)
    dv = output_grad(v.shape, gen, dtype)
    (v.float() * dv.to(device).float()).sum().backward()
    (ref * dv.to(device)).sum().backward()
    assert x.grad.dtype == dtype and dt.grad.dtype == torch.float32
    assert_rel_close("dx", x.grad, x64.grad, tol)
    # Each a sum over P of dv·x with fp32 accumulation: bounded by the size of its terms.
    terms = (dv.to(device) * x64.detach()).abs().sum(-1)
    err = (dt.grad.double() - dt64.grad).abs()
    assert (err <= 1e-5 * (terms + dt64.grad.abs())).all(), f"ddt: error {err.max():.3e}"


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("G,H,N", [(1, 4, 16), (2, 6, 24), (3, 3, 8)])
def test_heads_of_groups_kernels(G, H, N, dtype, device, seed):
    check_heads_of_groups(2, 37, G, H, N, dtype, device, seed)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("P", [8, 24])
def test_scaled_input_kernels(P, dtype, device, seed):
    check_scaled_input((2, 41, 3, P), dtype, device, seed)


@pytest.mark.interpret
def test_kernels_run(device, seed, monkeypatch):
    """The Triton steps, not the PyTorch path, computed the results above."""
    calls = recorded_steps(monkeypatch, operands._group_op, operands._sum_op,
                           operands._scaled_fwd_op, operands._scaled_bwd_op)
    check_heads_of_groups(1, 9, 1, 4, 8, torch.float32, device, seed)
    check_scaled_input((1, 9, 2, 8), torch.float32, device, seed)
    assert calls == ["mamba2_group_heads", "mamba2_sum_group_heads",
                     "mamba2_scaled_input_fwd", "mamba2_scaled_input_bwd"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_torch_path(dtype, monkeypatch, seed):
    monkeypatch.setenv("FLA_BACKEND", "torch")
    check_heads_of_groups(2, 20, 2, 4, 8, dtype, "cpu", seed)
    check_scaled_input((2, 20, 3, 8), dtype, "cpu", seed)


def test_one_group_per_head_is_the_input(seed):
    t = randn((1, 5, 4, 8), generator(seed))
    assert heads_of_groups(t, 4) is t


@pytest.mark.gpu
def test_gpu_bf16_training_shape(seed):
    """Mamba2's benchmark shape: 4 x 4096 tokens, 32 heads, one group of N = 128, P = 64."""
    check_heads_of_groups(4, 4096, 1, 32, 128, torch.bfloat16, "cuda", seed)
    check_scaled_input((4, 4096, 32, 64), torch.bfloat16, "cuda", seed)
