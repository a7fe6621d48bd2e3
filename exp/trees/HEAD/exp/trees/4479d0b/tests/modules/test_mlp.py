"""swiglu and GatedMLP against float64 PyTorch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fla.modules.activations import swiglu, swiglu_packed
from fla.modules.mlp import GatedMLP
from tests.helpers import TOLERANCE, assert_rel_close, generator, randn


def swiglu_ref(g, u):
    g, u = g.to(torch.float64), u.to(torch.float64)
    return g * torch.sigmoid(g) * u


def _grads_vs_ref(out, ref, inputs, ref_inputs, names, gen, tol):
    assert_rel_close("y", out, ref, tol)
    dy = randn(out.shape, gen, out.dtype, out.device)
    grads = torch.autograd.grad(out, inputs, dy)
    ref_grads = torch.autograd.grad(ref, ref_inputs, dy.double().cpu())
    for name, g, r in zip(names, grads, ref_grads):
        assert g.dtype == out.dtype
        assert_rel_close(name, g, r, tol)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_swiglu_matches_float64(device, seed, dtype):
    gen = generator(seed)
    shape = (3, 37, 100)
    g = randn(shape, gen, dtype, device, 2.0, requires_grad=True)
    u = randn(shape, gen, dtype, device, requires_grad=True)
    rg, ru = (t.detach().cpu().double().requires_grad_() for t in (g, u))
    _grads_vs_ref(swiglu(g, u), swiglu_ref(rg, ru), (g, u), (rg, ru), ["dgate", "dup"], gen,
                  TOLERANCE[dtype])


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_swiglu_packed_and_strided(device, seed, dtype):
    """Halves of one [..., 2I] tensor: as two strided views and packed."""
    gen = generator(seed)
    gu = randn((5, 7, 2 * 72), gen, dtype, device, 2.0, requires_grad=True)
    rgu = gu.detach().cpu().double().requires_grad_()
    ref = swiglu_ref(*rgu.chunk(2, -1))
    _grads_vs_ref(swiglu_packed(gu), ref, (gu,), (rgu,), ["dgate_up"], gen, TOLERANCE[dtype])
    g, u = gu.chunk(2, -1)
    ref = swiglu_ref(*rgu.chunk(2, -1))
    _grads_vs_ref(swiglu(g, u), ref, (gu,), (rgu,), ["dgate_up (views)"], gen, TOLERANCE[dtype])


def test_gated_mlp_sizes():
    def size(*args, **kwargs):
        return GatedMLP(*args, device="meta", **kwargs).intermediate_size

    assert size(1000) == 2816                           # int(1000·4·2/3) = 2666 -> 2816
    assert size(2048) == 5632                           # 5461 -> 5632
    assert size(1024, hidden_ratio=2) == 1536           # 1365 -> 1536
    assert size(64, intermediate_size=100) == 100
    mlp = GatedMLP(64, intermediate_size=100)
    assert mlp.gate_up_proj.weight.shape == (200, 64) and mlp.down_proj.weight.shape == (64, 100)


def _mlp_ref(mlp, x64, act=F.silu):
    w = mlp.gate_up_proj.weight.detach().double().cpu()
    I = mlp.intermediate_size
    gate, up = x64 @ w[:I].T, x64 @ w[I:].T
    return (act(gate) * up) @ mlp.down_proj.weight.detach().double().cpu().T


@pytest.mark.interpret
@pytest.mark.parametrize("fuse_swiglu", [True, False])
def test_gated_mlp_matches_float64(device, seed, fuse_swiglu):
    gen = generator(seed)
    torch.manual_seed(seed)
    mlp = GatedMLP(48, intermediate_size=80, fuse_swiglu=fuse_swiglu).to(device)
    x = randn((2, 13, 48), gen, torch.float32, device, requires_grad=True)
    rx = x.detach().cpu().double().requires_grad_()
    _grads_vs_ref(mlp(x), _mlp_ref(mlp, rx), (x,), (rx,), ["dx"], gen, 1e-4)
    assert mlp.gate_up_proj.weight.grad is None       # autograd.grad, not backward
    mlp(x).sum().backward()
    assert torch.isfinite(mlp.gate_up_proj.weight.grad).all()


def test_gated_mlp_other_activation(seed):
    gen = generator(seed)
    mlp = GatedMLP(32, intermediate_size=64, hidden_act="gelu")
    assert not mlp.fuse_swiglu
    x = randn((4, 32), gen, torch.float32)
    assert_rel_close("y", mlp(x), _mlp_ref(mlp, x.double(), F.gelu), 1e-4)
    with pytest.raises(ValueError, match="hidden_act: unknown activation 'nope'"):
        GatedMLP(32, hidden_act="nope")


def test_gated_mlp_loads_separate_gate_up_weights(seed):
    """A state dict with the reference library's gate_proj / up_proj keys loads."""
    torch.manual_seed(seed)
    mlp = GatedMLP(16, intermediate_size=24)
    gate, up, down = torch.randn(24, 16), torch.randn(24, 16), torch.randn(16, 24)
    mlp.load_state_dict({"gate_proj.weight": gate, "up_proj.weight": up,
                         "down_proj.weight": down})
    torch.testing.assert_close(mlp.gate_up_proj.weight, torch.cat([gate, up]))
    x = torch.randn(3, 16, dtype=torch.float64)
    ref = (F.silu(x @ gate.double().T) * (x @ up.double().T)) @ down.double().T
    assert_rel_close("y", mlp.double()(x), ref, 1e-10)


def test_swiglu_torch_path(monkeypatch, seed):
    monkeypatch.setenv("FLA_BACKEND", "torch")
    gen = generator(seed)
    g = randn((9, 33), gen, torch.float16, scale=2.0, requires_grad=True)
    u = randn((9, 33), gen, torch.float16, requires_grad=True)
    rg, ru = (t.detach().double().requires_grad_() for t in (g, u))
    _grads_vs_ref(swiglu(g, u), swiglu_ref(rg, ru), (g, u), (rg, ru), ["dgate", "dup"], gen,
                  5e-3)
    mlp = GatedMLP(16, intermediate_size=40)
    x = randn((3, 16), gen, torch.float32)
    assert_rel_close("mlp", mlp(x), _mlp_ref(mlp, x.double()), 1e-4)


def test_swiglu_errors():
    with pytest.raises(ValueError, match=r"up: expected the shape of gate \(2, 3\)"):
        swiglu(torch.randn(2, 3), torch.randn(2, 4))
    with pytest.raises(TypeError, match="up: expected the dtype of gate"):
        swiglu(torch.randn(2, 3), torch.randn(2, 3, dtype=torch.float16))
    with pytest.raises(ValueError, match="gate_up: expected an even last dim"):
        swiglu_packed(torch.randn(2, 5))


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_swiglu_bf16_gpu(seed):
    gen = generator(seed)
    gu = randn((2, 2048, 2 * 5632), gen, torch.bfloat16, "cuda", 2.0, requires_grad=True)
    rgu = gu.detach().cpu().double().requires_grad_()
    _grads_vs_ref(swiglu_packed(gu), swiglu_ref(*rgu.chunk(2, -1)), (gu,), (rgu,),
                  ["dgate_up"], gen, 5e-3)


@pytest.mark.gpu
def test_gated_mlp_bf16_gpu(seed):
    gen = generator(seed)
    torch.manual_seed(seed)
    mlp = GatedMLP(2048).to("cuda", torch.bfloat16)
    x = randn((2, 1000, 2048), gen, torch.bfloat16, "cuda", requires_grad=True)
    y = mlp(x)
    # The same weights in float32 (no TF32): bf16 rounding of three GEMMs stays in 5e-3.
    ref = GatedMLP(2048).to("cuda")
    ref.load_state_dict({k: v.float() for k, v in mlp.state_dict().items()})
    assert_rel_close("y", y, ref(x.float()), 5e-3)
