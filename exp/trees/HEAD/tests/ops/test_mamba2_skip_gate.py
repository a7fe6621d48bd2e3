"""fla.ops.mamba2.skip_gate: Mamba2's y = (o + D ⊙ x) ⊙ silu(z), forward and every
gradient against float64 PyTorch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fla.ops.mamba2 import skip_gate
from fla.ops.mamba2.skip_gate import skip_and_gate
from tests.helpers import (
    TOLERANCE,
    assert_rel_close,
    assert_sum_close,
    generator,
    output_grad,
    randn,
    recorded_steps,
)


def reference(o, x, D, z):
    y = o
    if D is not None:
        y = y + x * (D[:, None] if D.dim() == 1 else D)
    if z is not None:
        y = y * F.silu(z)
    return y


def check_skip_gate(shape, dtype, device, seed, D_shape="H", with_z=True):
    gen = generator(seed)
    b, T, H, P = shape
    o = randn(shape, gen, dtype, device, requires_grad=True)
    x = randn(shape, gen, dtype, device, requires_grad=True)
    z = randn(shape, gen, dtype, device, scale=2.0, requires_grad=True) if with_z else None
    D = None if D_shape is None else randn((H,) if D_shape == "H" else (H, P), gen,
                                           torch.float32, device, requires_grad=True)
    y = skip_and_gate(o, x, D, z)
    assert y.dtype == dtype and y.shape == shape

    leaves = [t for t in (o, x, D, z) if t is not None]
    leaves64 = {id(t): t.detach().double().requires_grad_() for t in leaves}
    y_ref = reference(*(None if t is None else leaves64[id(t)] for t in (o, x, D, z)))
    tol = TOLERANCE[dtype]
    assert_rel_close("y", y, y_ref, tol)

    dy = output_grad(shape, gen, dtype)
    (y.float() * dy.to(device).float()).sum().backward()
    (y_ref * dy.to(device)).sum().backward()
    for name, t in (("do", o), ("dx", x if D is not None else None), ("dz", z)):
        if t is not None:
            assert t.grad.dtype == dtype
            assert_rel_close(name, t.grad, leaves64[id(t)].grad, tol)
    if D is not None:
        # A sum over every token (and over P for a per-head D), float32 accumulation
        # whatever the input dtype: bounded by the size of the terms that cancel in it.
        assert D.grad.dtype == torch.float32 and D.grad.shape == D.shape
        gate = 1.0 if z is None else F.silu(leaves64[id(z)].detach())
        terms = dy.to(device) * gate * leaves64[id(x)].detach()      # [b, T, H, P]
        terms = terms.reshape(-1, *D.shape) if D.dim() == 2 else \
            terms.transpose(-1, -2).reshape(-1, H)
        assert_sum_close("dD", D.grad.flatten(), leaves64[id(D)].grad.flatten(),
                         terms.reshape(terms.shape[0], -1), 1e-5)
    else:
        assert x.grad is None


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("D_shape,with_z", [("H", True), ("HP", True), (None, True),
                                            ("H", False)],
                         ids=["D-z", "DHP-z", "z", "D"])
def test_kernels(dtype, D_shape, with_z, device, seed):
    # 3 x 4 x 24 = 288 channels (a partial channel tile) over 2 x 37 tokens (a partial
    # row block).
    check_skip_gate((2, 37, 3 * 4, 24), dtype, device, seed, D_shape, with_z)


@pytest.mark.interpret
def test_kernels_wide_rows(device, seed):
    # 16 x 64 = 1024 channels: two 512-wide channel tiles a token.
    check_skip_gate((1, 20, 16, 64), torch.float32, device, seed)


@pytest.mark.interpret
def test_kernels_run(device, seed, monkeypatch):
    """The Triton steps, not the PyTorch path, computed the results above."""
    calls = recorded_steps(monkeypatch, skip_gate._fwd_op, skip_gate._bwd_op)
    check_skip_gate((1, 9, 2, 8), torch.float32, device, seed)
    assert calls == ["mamba2_skip_gate_fwd", "mamba2_skip_gate_bwd"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_torch_path(dtype, monkeypatch, seed):
    monkeypatch.setenv("FLA_BACKEND", "torch")
    check_skip_gate((2, 30, 4, 8), dtype, "cpu", seed, "HP")


def test_neither_D_nor_z(seed):
    gen = generator(seed)
    o = randn((1, 5, 2, 4), gen, torch.float32)
    x = randn((1, 5, 2, 4), gen, torch.bfloat16)
    y = skip_and_gate(o, x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, o.to(torch.bfloat16))


@pytest.mark.gpu
def test_gpu_bf16_training_shape(seed):
    """Mamba2's benchmark shape: 4 x 4096 tokens, 32 heads of 64 channels, bf16."""
    check_skip_gate((4, 4096, 32, 64), torch.bfloat16, "cuda", seed)
    check_skip_gate((4, 4096, 32, 64), torch.bfloat16, "cuda", seed + 1, "HP", False)
