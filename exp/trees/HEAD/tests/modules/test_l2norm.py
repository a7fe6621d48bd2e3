"""fla.modules.l2norm: y = x / sqrt(Σx² + eps) and its gradient, against float64."""
from __future__ import annotations

import pytest
import torch

import fla.modules.l2norm as l2mod
import fla.modules.layernorm_kernels as kernels
from fla.modules.l2norm import L2NORM_EPS, L2Norm, l2_norm, l2norm
from fla.ops.utils.l2norm import L2NORM_EPS as OPS_EPS
from fla.ops.utils.l2norm import l2norm as ops_l2norm
from tests.helpers import TOLERANCE, assert_rel_close, generator, randn
from tests.ops.config_sweep import record_launches


def ref_l2norm(x, eps=L2NORM_EPS):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def check_l2norm(shape, dtype, device, seed, eps=L2NORM_EPS, scale=1.0, output_dtype=None):
    gen = generator(seed)
    x = randn(shape, gen, dtype, device, scale=scale, requires_grad=True)
    y = l2norm(x, eps=eps, output_dtype=output_dtype)
    assert y.dtype == (output_dtype or dtype)
    dy = randn(shape, gen, y.dtype, device)
    y.backward(dy)
    x_ref = x.detach().double().requires_grad_()
    y_ref = ref_l2norm(x_ref, eps)
    y_ref.backward(dy.double())
    tol = TOLERANCE[dtype]
    assert_rel_close("y", y, y_ref, tol)
    assert x.grad.dtype == dtype
    assert_rel_close("dx", x.grad, x_ref.grad, tol)


def test_eps_matches_the_ops():
    assert L2NORM_EPS == OPS_EPS
    x = torch.randn(3, 5, 64)
    assert_rel_close("y", l2_norm(x), ops_l2norm(x), 1e-6)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(2, 7, 3, 64), (9, 37), (5, 1000), (300, 16)])
def test_l2norm_kernels(shape, dtype, device, seed):
    check_l2norm(shape, dtype, device, seed)


@pytest.mark.interpret
def test_l2norm_kernels_small_rows_and_eps(device, seed):
    # Tiny rows make eps matter; the output dtype may differ from the input's.
    check_l2norm((6, 33), torch.float32, device, seed, eps=1e-2, scale=1e-2)
    check_l2norm((6, 33), torch.float16, device, seed + 1, output_dtype=torch.float32)


@pytest.mark.interpret
def test_l2norm_kernels_multi_pass(monkeypatch, device, seed):
    monkeypatch.setattr(kernels, "MAX_SINGLE_PASS_D", 64)
    monkeypatch.setattr(kernels, "MULTI_PASS_BLOCK", 32)
    calls = record_launches(monkeypatch, l2mod.l2norm_fwd_kernel)
    check_l2norm((5, 150), torch.float32, device, seed)
    assert calls and calls[0][1]["NCHUNK"] == 5


@pytest.mark.interpret
def test_l2norm_module_and_empty(device, seed):
    gen = generator(seed)
    x = randn((4, 48), gen, device=device)
    assert_rel_close("module", L2Norm()(x), ref_l2norm(x.double()), 1e-4)
    assert_rel_close("eps", L2Norm(eps=0.5)(x), ref_l2norm(x.double(), 0.5), 1e-4)
    assert l2norm(torch.zeros(0, 8, device=device)).shape == (0, 8)
    assert "eps=1e-06" in repr(L2Norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path(dtype, monkeypatch, seed):
    monkeypatch.setenv("FLA_BACKEND", "torch")
    check_l2norm((3, 5, 200), dtype, "cpu", seed)


def test_input_errors():
    with pytest.raises(TypeError, match=r"x: expected dtype in \(float32, float16, bfloat16\), got int64"):
        l2norm(torch.ones(3, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"x: expected shape \[\.\.\., D\] with D >= 1, got \(3, 0\)"):
        l2norm(torch.ones(3, 0))
    with pytest.raises(ValueError, match=r"eps: expected a finite number >= 0, got -0.1"):
        l2norm(torch.ones(3, 4), eps=-0.1)
    with pytest.raises(TypeError, match=r"output_dtype: expected None or one of .* got torch.int32"):
        l2norm(torch.ones(3, 4), output_dtype=torch.int32)


@pytest.mark.gpu
def test_gpu_bf16_real_size(seed):
    check_l2norm((8, 4096, 16, 128), torch.bfloat16, "cuda", seed)
    check_l2norm((4096, 4096), torch.bfloat16, "cuda", seed + 1)
    check_l2norm((4, kernels.MAX_SINGLE_PASS_D + 1000), torch.bfloat16, "cuda", seed + 2)


def test_token_rows_of_layouts():
    base = torch.randn(2, 5, 3 * 4 * 8)
    q = base[..., 32:64].unflatten(-1, (4, 8))
    assert l2mod.token_rows(torch.randn(2, 5, 4, 8)) == (1, 8)
    assert l2mod.token_rows(q) == (4, 96)
    assert l2mod.token_rows(base[:1, :1, 32:64].unflatten(-1, (4, 8))) == (1, 8)  # contiguous
    assert l2mod.token_rows(base[:1, ::2, :32].unflatten(-1, (4, 8))) == (4, 192)
    assert l2mod.token_rows(base[:, ::2, :32].unflatten(-1, (4, 8))) is None  # 480 != 3·192
    assert l2mod.token_rows(q.transpose(0, 1)) is None  # tokens not evenly strided
    assert l2mod.token_rows(q.transpose(-1, -2)) is None  # rows not unit-stride
    assert l2mod.token_rows(torch.randn(5, 1, 8).expand(5, 3, 8)) is None  # overlapping
    assert l2mod.token_rows(base[..., :8]) is None  # 3-D: heads 5 apart, not 8


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_strided_rows_are_read_in_place(dtype, device, monkeypatch, seed):
    """q as a view of a fused [B, T, 3·H·D] projection: the kernels read it where it is
    (the launch gets the view's own address) and the values and gradients equal float64."""
    gen = generator(seed)
    base = randn((2, 37, 3 * 4 * 32), gen, dtype, device, requires_grad=True)
    calls = record_launches(monkeypatch, l2mod.l2norm_fwd_kernel)
    x = base[..., 128:256].unflatten(-1, (4, 32))
    y = l2norm(x)
    assert calls[0][1]["x"].data_ptr() == x.data_ptr() and calls[0][1]["x_stride"] == 384
    dy = randn(y.shape, gen, dtype, device)
    y.backward(dy)
    x_ref = x.detach().double().requires_grad_()
    ref_l2norm(x_ref).backward(dy.double())
    assert_rel_close("y", y, ref_l2norm(x.detach().double()), TOLERANCE[dtype])
    assert_rel_close("dx", base.grad[..., 128:256].unflatten(-1, (4, 32)), x_ref.grad,
                     TOLERANCE[dtype])
    assert torch.all(base.grad[..., :128] == 0) and torch.all(base.grad[..., 256:] == 0)


@pytest.mark.interpret
@pytest.mark.parametrize("multi_pass", [False, True])
def test_backward_from_the_output_into_a_slice(multi_pass, device, monkeypatch, seed):
    """l2norm_bwd(y, ..., from_output=True, dx=slice): the gradient from the output alone,
    written into the columns of a wider tensor, the other columns untouched."""
    if multi_pass:
        monkeypatch.setattr(kernels, "MAX_SINGLE_PASS_D", 32)
        monkeypatch.setattr(kernels, "MULTI_PASS_BLOCK", 16)
    gen = generator(seed)
    x = randn((3, 11, 2, 48), gen, device=device)
    dy = randn(x.shape, gen, device=device)
    y, rstd = l2mod.l2norm_fwd(x)
    out = torch.full((3, 11, 200), 7.0, device=device)
    dx = out[..., 100:196].unflatten(-1, (2, 48))
    assert l2mod.l2norm_bwd(y, rstd, dy, from_output=True, dx=dx) is dx
    x_ref = x.double().requires_grad_()
    ref_l2norm(x_ref).backward(dy.double())
    assert_rel_close("dx", dx, x_ref.grad, 1e-4)
    assert torch.all(out[..., :100] == 7) and torch.all(out[..., 196:] == 7)
    with pytest.raises(ValueError, match="dx"):
        l2mod.l2norm_bwd(y, rstd, dy, dx=out[..., :96].unflatten(-1, (2, 48)).transpose(0, 1))
