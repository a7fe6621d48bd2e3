"""fla.modules.fused_norm_gate: norm(x) · γ (+ β) ⊙ act(g), against a float64 reference
(outputs and the gradients dx, dg, dγ, dβ, d residual)."""
from __future__ import annotations

import pytest
import torch

import fla.modules.layernorm_kernels as kernels
from fla.modules.fused_norm_gate import (
    FusedLayerNormGated,
    FusedRMSNormGated,
    layer_norm_gated,
    rms_norm_gated,
)
from tests.helpers import TOLERANCE, assert_rel_close, generator, randn
from tests.modules.test_layernorm import check_against_reference, make_inputs, ref_norm
from tests.ops.config_sweep import record_launches


def run_gated(shape, dtype, device, seed, *, activation="swish", rms=True, bias=False,
              weight=True, residual=False, prenorm=False, residual_in_fp32=False):
    gen = generator(seed)
    inputs = make_inputs(shape, gen, dtype, device, weight=weight, bias=bias,
                         residual=residual, gate=True)
    fast = rms_norm_gated if rms else layer_norm_gated

    def call(**a):
        return fast(**a, activation=activation, prenorm=prenorm,
                    residual_in_fp32=residual_in_fp32)

    def ref(**a):
        return ref_norm(**a, is_rms_norm=rms, activation=activation)

    outs = check_against_reference(call, ref, inputs, gen, TOLERANCE[dtype], prenorm)
    assert outs[0].dtype == dtype
    return outs


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation", ["swish", "silu", "sigmoid"])
@pytest.mark.parametrize("shape", [(3, 4, 2, 64), (13, 1000), (5, 37)])
def test_rms_norm_gated_kernels(shape, activation, dtype, device, seed):
    run_gated(shape, dtype, device, seed, activation=activation)


@pytest.mark.interpret
@pytest.mark.parametrize("activation", ["swish", "sigmoid"])
@pytest.mark.parametrize("residual,prenorm,residual_in_fp32", [
    (True, False, False), (True, True, False), (True, True, True), (False, True, True),
])
def test_layer_norm_gated_kernels(activation, residual, prenorm, residual_in_fp32, device,
                                  seed):
    run_gated((4, 3, 100), torch.float16, device, seed, activation=activation, rms=False,
              bias=True, residual=residual, prenorm=prenorm,
              residual_in_fp32=residual_in_fp32)


@pytest.mark.interpret
def test_gated_kernels_no_weight(device, seed):
    run_gated((6, 80), torch.float32, device, seed, weight=False, residual=True, prenorm=True)


@pytest.mark.interpret
@pytest.mark.parametrize("rms", [True, False])
def test_gated_kernels_multi_pass(rms, monkeypatch, device, seed):
    monkeypatch.setattr(kernels, "MAX_SINGLE_PASS_D", 64)
    monkeypatch.setattr(kernels, "MULTI_PASS_BLOCK", 32)
    bwd_stats = record_launches(monkeypatch, kernels.norm_bwd_stats_kernel)
    run_gated((5, 150), torch.float32, device, seed, rms=rms, bias=not rms, residual=True,
              prenorm=True)
    assert len(bwd_stats) == 1


@pytest.mark.interpret
def test_gated_modules(device, seed):
    gen = generator(seed)
    x = randn((2, 5, 3, 32), gen, device=device, requires_grad=True)
    g = randn((2, 5, 3, 32), gen, device=device, requires_grad=True)
    for module, kwargs in (
        (FusedRMSNormGated(32), dict(is_rms_norm=True, activation="swish")),
        (FusedRMSNormGated(32, activation="sigmoid", eps=1e-6),
         dict(is_rms_norm=True, activation="sigmoid", eps=1e-6)),
        (FusedRMSNormGated(32, elementwise_affine=False), dict(is_rms_norm=True,
                                                               activation="silu")),
        (FusedLayerNormGated(32, bias=True), dict(activation="swish")),
    ):
        module = module.to(device)
        with torch.no_grad():
            for p in module.parameters():
                p.add_(randn(p.shape, gen, device=device, scale=0.3))
        y = module(x, g)
        params = {k: (None if v is None else v.detach().double())
                  for k, v in (("weight", module.weight), ("bias", module.bias))}
        y_ref, _ = ref_norm(x.detach().double(), g=g.detach().double(), **params, **kwargs)
        assert_rel_close(f"{module}", y, y_ref, 1e-4)
        y.sum().backward()
    assert FusedRMSNormGated(8).bias is None
    assert "activation='swish'" in repr(FusedRMSNormGated(8))


@pytest.mark.parametrize("activation", ["swish", "sigmoid"])
def test_torch_path(activation, monkeypatch, seed):
    monkeypatch.setenv("FLA_BACKEND", "torch")
    run_gated((3, 7, 200), torch.float32, "cpu", seed, activation=activation, residual=True,
              prenorm=True)
    run_gated((3, 7, 200), torch.bfloat16, "cpu", seed + 1, activation=activation, rms=False,
              bias=True, residual=True, prenorm=True, residual_in_fp32=True)


def test_input_errors():
    x, g, w = torch.randn(2, 8), torch.randn(2, 8), torch.ones(8)
    with pytest.raises(ValueError, match=r"g: expected the shape of x, \(2, 8\), got \(2, 9\)"):
        rms_norm_gated(x, torch.randn(2, 9), w, None)
    with pytest.raises(ValueError, match=r"activation: expected one of .*got 'relu'"):
        rms_norm_gated(x, g, w, None, activation="relu")
    with pytest.raises(ValueError, match=r"activation: expected one of .*got 'gelu'"):
        FusedRMSNormGated(8, activation="gelu")
    with pytest.raises(ValueError, match=r"weight: expected shape \(8,\).*got shape \(4,\)"):
        rms_norm_gated(x, g, torch.ones(4), None)
    with pytest.raises(ValueError, match=r"hidden_size = 16.*last dim 8"):
        FusedRMSNormGated(16)(x, g)
    with pytest.raises(TypeError, match=r"g: expected dtype .* got int64"):
        rms_norm_gated(x, torch.ones(2, 8, dtype=torch.int64), w, None)
    with pytest.raises(TypeError, match=r"g: expected a torch.Tensor, got NoneType"):
        rms_norm_gated(x, None, w, None)
    with pytest.raises(TypeError, match=r"g: expected a torch.Tensor, got NoneType"):
        FusedRMSNormGated(8)(x, None)
    with pytest.raises(ValueError, match=r"hidden_size = 8.*last dim 0"):
        FusedRMSNormGated(8)(torch.randn(2, 0), torch.randn(2, 0))


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["swish", "sigmoid"])
def test_gpu_bf16_real_size(activation, seed):
    # Head-wise (D = 128, many rows) as in the layers, and a model-wide width.
    run_gated((8, 2048, 16, 128), torch.bfloat16, "cuda", seed, activation=activation)
    run_gated((4096, 4096), torch.bfloat16, "cuda", seed + 1, activation=activation,
              residual=True, prenorm=True, residual_in_fp32=True)
    run_gated((8, kernels.MAX_SINGLE_PASS_D + 1000), torch.bfloat16, "cuda", seed + 2,
              activation=activation, rms=False, bias=True)
