"""fla.modules.qkv_l2norm.split_qkv_l2norm: q, k (unit L2 rows per head) and v out of one
fused projection, against float64, with the gradient coming back as one tensor."""
from __future__ import annotations

import pytest
import torch

from fla.modules.qkv_l2norm import split_qkv_l2norm
from tests.helpers import TOLERANCE, assert_rel_close, generator, randn


def reference(qkv, key_dim, head_k_dim, head_v_dim, eps=1e-6):
    q, k, v = qkv.split([key_dim, key_dim, qkv.shape[-1] - 2 * key_dim], -1)
    q, k = (t.unflatten(-1, (-1, head_k_dim)) for t in (q, k))
    q, k = (t / torch.sqrt((t * t).sum(-1, keepdim=True) + eps) for t in (q, k))
    return q, k, v.unflatten(-1, (-1, head_v_dim))


def check(shape, key_dim, head_k_dim, head_v_dim, dtype, device, seed, used=(True,) * 3):
    gen = generator(seed)
    qkv = randn(shape, gen, dtype, device, requires_grad=True)
    outs = split_qkv_l2norm(qkv, key_dim, head_k_dim, head_v_dim)
    H, HV = key_dim // head_k_dim, (shape[-1] - 2 * key_dim) // head_v_dim
    assert [tuple(o.shape) for o in outs] == [(*shape[:2], H, head_k_dim)] * 2 + [
        (*shape[:2], HV, head_v_dim)]
    assert all(o.is_contiguous() and o.dtype == dtype for o in outs)
    grads = [randn(o.shape, gen, dtype, device) for o in outs]
    sum((o * g).sum() for o, g, u in zip(outs, grads, used) if u).backward()
    qkv_ref = qkv.detach().double().requires_grad_()
    refs = reference(qkv_ref, key_dim, head_k_dim, head_v_dim)
    sum((r * g.double()).sum() for r, g, u in zip(refs, grads, used) if u).backward()
    tol = TOLERANCE[dtype]
    for name, o, r in zip("qkv", outs, refs):
        assert_rel_close(name, o, r, tol)
    assert qkv.grad.dtype == dtype and qkv.grad.is_contiguous()
    assert_rel_close("dqkv", qkv.grad, qkv_ref.grad, tol)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dims", [(64, 32, 32, 64), (96, 48, 16, 48)])
def test_split_qkv_l2norm(dims, dtype, device, seed):
    """Equal q/k/v heads, and grouped value heads of another width."""
    key_dim, head_k_dim, head_v_dim, value_dim = dims
    check((2, 19, 2 * key_dim + value_dim), key_dim, head_k_dim, head_v_dim, dtype, device,
          seed)


@pytest.mark.interpret
@pytest.mark.parametrize("used", [(False, True, True), (True, False, False)])
def test_outputs_the_loss_does_not_reach(used, device, seed):
    """Columns of an output without a gradient get zeros (not the poisoned empty)."""
    check((1, 7, 3 * 32), 32, 16, 16, torch.float32, device, seed, used)


def test_torch_path(monkeypatch, seed):
    monkeypatch.setenv("FLA_BACKEND", "torch")
    check((2, 9, 160), 64, 32, 16, torch.float32, "cpu", seed)


@pytest.mark.interpret
def test_channel_first_layout(device, seed):
    """A [B, C, T] buffer viewed [B, T, C] (a convolution's output layout): copied, same
    results."""
    gen = generator(seed)
    qkv = randn((2, 96, 9), gen, device=device).transpose(1, 2)
    for o, r in zip(split_qkv_l2norm(qkv, 32, 16, 16), reference(qkv.double(), 32, 16, 16)):
        assert_rel_close("out", o, r, 1e-4)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="qkv"):
        split_qkv_l2norm(torch.randn(2, 3, 4, 96), 32, 16, 16)
    with pytest.raises(ValueError, match="head_k_dim = 24"):
        split_qkv_l2norm(torch.randn(2, 3, 96), 32, 24, 16)
    with pytest.raises(ValueError, match="value_dim"):
        split_qkv_l2norm(torch.randn(2, 3, 64), 32, 16, 16)


@pytest.mark.gpu
def test_gpu_bf16_at_a_model_shape(seed):
    check((4, 2048, 3 * 1024), 1024, 128, 128, torch.bfloat16, "cuda", seed)
