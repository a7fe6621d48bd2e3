"""fla.modules.layernorm: RMSNorm, LayerNorm, GroupNorm (residual, prenorm, fp32 residual).

Every fast path (the Triton kernels — in the interpreter without a GPU — and the PyTorch
path) is compared with a float64 reference written here from the definitions, for the
outputs and every gradient.
"""
from __future__ import annotations

import pytest
import torch

import fla.modules.layernorm_kernels as kernels
from fla.modules.layernorm import GroupNorm, LayerNorm, RMSNorm, group_norm, layer_norm, rms_norm
from fla.utils.triton_facts import compiled_kernel_count
from tests.helpers import TOLERANCE, assert_rel_close, generator, randn, rel_error
from tests.ops.config_sweep import record_launches, sweep_configs


# ----------------------------------------------------------------------------- reference
def ref_norm(x, weight=None, bias=None, residual=None, g=None, eps=1e-5, num_groups=1,
             is_rms_norm=False, activation=None):
    """float64 definition: returns (y, s) with s = x + residual."""
    s = x if residual is None else x + residual
    grouped = s.reshape(*s.shape[:-1], num_groups, s.shape[-1] // num_groups)
    if not is_rms_norm:
        grouped = grouped - grouped.mean(-1, keepdim=True)
    y = (grouped / torch.sqrt((grouped * grouped).mean(-1, keepdim=True) + eps)).reshape(s.shape)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    if activation in ("swish", "silu"):
        y = y * g * torch.sigmoid(g)
    elif activation == "sigmoid":
        y = y * torch.sigmoid(g)
    return y, s


def check_against_reference(call, ref_call, inputs, gen, tol, prenorm):
    """Run ``call(**inputs)`` forward and backward (random output gradients) and compare
    outputs and input gradients with ``ref_call`` on float64 copies of the inputs."""
    out = call(**inputs)
    outs = out if isinstance(out, tuple) else (out,)
    assert len(outs) == (2 if prenorm else 1)
    grads = [randn(o.shape, gen, dtype=o.dtype, device=o.device) for o in outs]
    torch.autograd.backward(list(outs), grads)

    leaves = {k: v.detach().to(torch.float64).requires_grad_(v.requires_grad)
              for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    ref_args = {**inputs, **leaves}
    y_ref, s_ref = ref_call(**ref_args)
    ref_outs = (y_ref, s_ref)[:len(outs)]
    torch.autograd.backward(list(ref_outs), [gr.to(torch.float64) for gr in grads])

    for name, o, r in zip(("y", "s"), outs, ref_outs):
        assert_rel_close(name, o, r, tol)
    for name, t in inputs.items():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            assert t.grad is not None, f"d{name}: no gradient"
            assert t.grad.dtype == t.dtype, f"d{name}: dtype {t.grad.dtype} != {t.dtype}"
            assert_rel_close(f"d{name}", t.grad, leaves[name].grad, tol)
    return outs


def make_inputs(shape, gen, dtype, device, *, weight=True, bias=True, residual=False,
                gate=False, param_dtype=None):
    D = shape[-1]
    param_dtype = param_dtype or dtype
    inputs = {"x": randn(shape, gen, dtype, device, requires_grad=True)}
    # Weights away from 1 and biases away from 0: a kernel ignoring them must fail.
    inputs["weight"] = (randn((D,), gen, param_dtype, device, scale=0.5).add(1.0)
                        .requires_grad_() if weight else None)
    inputs["bias"] = randn((D,), gen, param_dtype, device, scale=0.5,
                           requires_grad=True) if bias else None
    inputs["residual"] = randn(shape, gen, dtype, device, requires_grad=True) if residual else None
    if gate:
        inputs["g"] = randn(shape, gen, dtype, device, scale=2.0, requires_grad=True)
    return inputs


NORMS = {
    # name: (fast functional, reference kwargs)
    "rms": (lambda **a: rms_norm(**a), dict(is_rms_norm=True)),
    "layer": (lambda **a: layer_norm(**a), dict()),
    "group": (lambda **a: group_norm(num_groups=4, **a), dict(num_groups=4)),
    "group_rms": (lambda **a: group_norm(num_groups=5, is_rms_norm=True, **a),
                  dict(num_groups=5, is_rms_norm=True)),
}


def run_norm(kind, shape, dtype, device, seed, *, weight=True, bias=True, residual=False,
             prenorm=False, residual_in_fp32=False, eps=1e-5, param_dtype=None):
    gen = generator(seed)
    fast, ref_kwargs = NORMS[kind]
    inputs = make_inputs(shape, gen, dtype, device, weight=weight, bias=bias,
                         residual=residual, param_dtype=param_dtype)

    def call(**a):
        return fast(**a, eps=eps, prenorm=prenorm, residual_in_fp32=residual_in_fp32)

    def ref(**a):
        return ref_norm(**a, eps=eps, **ref_kwargs)

    outs = check_against_reference(call, ref, inputs, gen, TOLERANCE[dtype], prenorm)
    if prenorm:
        expected = torch.float32 if residual_in_fp32 else dtype
        assert outs[1].dtype == expected
    assert outs[0].dtype == dtype
    return outs


# ------------------------------------------------------------------ kernels (interpreter)
@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind,shape", [
    ("rms", (5, 37)), ("rms", (2, 9, 1000)), ("layer", (7, 37)), ("layer", (3, 3, 1000)),
    ("group", (2, 5, 200)), ("group_rms", (11, 1000)),
])
def test_norm_kernels(kind, shape, dtype, device, seed):
    run_norm(kind, shape, dtype, device, seed)


@pytest.mark.interpret
@pytest.mark.parametrize("kind", ["rms", "layer", "group"])
@pytest.mark.parametrize("residual,prenorm,residual_in_fp32", [
    (True, False, False), (True, True, False), (True, True, True), (True, False, True),
    (False, True, False), (False, True, True),
])
def test_norm_kernels_residual(kind, residual, prenorm, residual_in_fp32, device, seed):
    run_norm(kind, (3, 5, 120), torch.float16, device, seed, residual=residual,
             prenorm=prenorm, residual_in_fp32=residual_in_fp32)


@pytest.mark.interpret
@pytest.mark.parametrize("kind,weight,bias", [
    ("rms", False, False), ("layer", True, False), ("group", False, True),
])
def test_norm_kernels_affine_options(kind, weight, bias, device, seed):
    run_norm(kind, (6, 100), torch.float32, device, seed, weight=weight, bias=bias,
             residual=True, prenorm=True)


@pytest.mark.interpret
def test_norm_kernels_fp32_params_fp16_input(device, seed):
    run_norm("layer", (9, 64), torch.float16, device, seed, param_dtype=torch.float32,
             residual=True, prenorm=True, residual_in_fp32=True)


@pytest.mark.interpret
@pytest.mark.parametrize("kind,D", [("rms", 200), ("layer", 200), ("group", 480)])
def test_norm_kernels_multi_pass(kind, D, monkeypatch, device, seed):
    """Rows wider than MAX_SINGLE_PASS_D take the chunked path (lowered here so that a
    small D exercises it: 32-wide chunks, the last one partial)."""
    monkeypatch.setattr(kernels, "MAX_SINGLE_PASS_D", 64)
    monkeypatch.setattr(kernels, "MULTI_PASS_BLOCK", 32)
    fwd_stats = record_launches(monkeypatch, kernels.norm_fwd_stats_kernel)
    bwd_stats = record_launches(monkeypatch, kernels.norm_bwd_stats_kernel)
    run_norm(kind, (5, D), torch.float32, device, seed, residual=True, prenorm=True)
    assert len(fwd_stats) == 1 and len(bwd_stats) == 1


@pytest.mark.interpret
@pytest.mark.parametrize("kind", ["rms", "group"])
def test_norm_kernels_multi_pass_backward_only(kind, monkeypatch, device, seed):
    """Between the two limits the forward is single-pass and the backward chunked."""
    monkeypatch.setattr(kernels, "MAX_SINGLE_PASS_BWD_D", 64)
    monkeypatch.setattr(kernels, "MULTI_PASS_BLOCK", 32)
    fwd_stats = record_launches(monkeypatch, kernels.norm_fwd_stats_kernel)
    bwd_stats = record_launches(monkeypatch, kernels.norm_bwd_stats_kernel)
    run_norm(kind, (7, 400), torch.float16, device, seed, residual=True)
    assert not fwd_stats and len(bwd_stats) == 1


@pytest.mark.interpret
def test_norm_kernels_gradient_through_residual_only(device, seed):
    """Only the prenorm sum reaches the loss: dy is None in the backward."""
    gen = generator(seed)
    x = randn((4, 50), gen, device=device, requires_grad=True)
    r = randn((4, 50), gen, device=device, requires_grad=True)
    w = randn((50,), gen, device=device, requires_grad=True)
    _, s = rms_norm(x, w, None, r, prenorm=True)
    ds = randn((4, 50), gen, device=device)
    s.backward(ds)
    assert_rel_close("dx", x.grad, ds, 1e-6)
    assert_rel_close("dresidual", r.grad, ds, 1e-6)
    assert w.grad is None or float(w.grad.abs().max()) == 0.0


@pytest.mark.interpret
def test_norm_kernels_layouts(device, seed):
    """Non-contiguous input, an empty batch, and no autograd."""
    gen = generator(seed)
    base = randn((40, 6), gen, device=device)
    x = base.t()  # [6, 40], not contiguous
    w = randn((40,), gen, device=device)
    y = layer_norm(x, w, None)
    assert_rel_close("y", y, ref_norm(x.double(), w.double())[0], TOLERANCE[torch.float32])
    with torch.no_grad():
        y2 = rms_norm(x, w, None)
    assert_rel_close("y", y2, ref_norm(x.double(), w.double(), is_rms_norm=True)[0], 1e-4)
    r = randn((6, 40), gen, torch.float16, device)
    with torch.no_grad():
        y3, s3 = group_norm(x, w, w, r, prenorm=True, residual_in_fp32=True, num_groups=2)
    y3_ref, s3_ref = ref_norm(x.double(), w.double(), w.double(), r.double(), num_groups=2)
    assert_rel_close("y", y3, y3_ref, 1e-4)
    assert s3.dtype == torch.float32
    assert_rel_close("s", s3, s3_ref, 1e-6)
    empty = torch.zeros(0, 3, 40, device=device)
    assert rms_norm(empty, w, None).shape == (0, 3, 40)


# ------------------------------------------------------------------------- modules
@pytest.mark.interpret
def test_modules(device, seed):
    gen = generator(seed)
    x = randn((2, 3, 48), gen, device=device, requires_grad=True)
    residual = randn((2, 3, 48), gen, device=device)
    for module, ref_kwargs in (
        (RMSNorm(48), dict(is_rms_norm=True)),
        (LayerNorm(48), dict()),
        (GroupNorm(4, 48, bias=True), dict(num_groups=4)),
        (GroupNorm(3, 48, is_rms_norm=True), dict(num_groups=3, is_rms_norm=True)),
        (RMSNorm(48, elementwise_affine=False), dict(is_rms_norm=True)),
        (LayerNorm(48, bias=False, eps=1e-3), dict(eps=1e-3)),
    ):
        module = module.to(device)
        with torch.no_grad():
            for p in module.parameters():
                p.add_(randn(p.shape, gen, device=device, scale=0.3))
        y, s = module(x, residual, prenorm=True, residual_in_fp32=True)
        params = {k: (None if v is None else v.detach().double())
                  for k, v in (("weight", module.weight), ("bias", module.bias))}
        y_ref, s_ref = ref_norm(x.detach().double(), residual=residual.double(), **params,
                                **ref_kwargs)
        assert_rel_close(f"{module} y", y, y_ref, 1e-4)
        assert_rel_close(f"{module} s", s, s_ref, 1e-6)
        y.sum().backward()
        for p in module.parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all()
    assert "RMSNorm(48, eps=1e-05)" == repr(RMSNorm(48))
    assert "GroupNorm(4, 48, eps=1e-05, bias=True)" == repr(GroupNorm(4, 48, bias=True))
    assert RMSNorm(8).bias is None and LayerNorm(8).bias is not None
    assert LayerNorm(8, elementwise_affine=False).weight is None


@pytest.mark.interpret
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("prenorm", [False, True])
def test_output_dtype_is_a_cast_of_the_output(backend, out_dtype, prenorm, monkeypatch, device,
                                              seed):
    """``output_dtype`` (a float32 residual stream normed into the autocast dtype) gives
    exactly the cast of the float32 output, and its gradients (to fp32 summation order):
    the kernels compute y in fp32 and round once, and read a 16-bit dy as the cast's
    backward would hand it."""
    if backend == "torch":
        monkeypatch.setenv("FLA_BACKEND", "torch")
        device = "cpu"
    gen = generator(seed)
    x = randn((3, 37, 96), gen, torch.float32, device, requires_grad=True)
    residual = randn((3, 37, 96), gen, torch.float32, device, requires_grad=True)
    weight = randn((96,), gen, torch.float32, device, requires_grad=True)
    dy = randn((3, 37, 96), gen, out_dtype, device)
    ds = randn((3, 37, 96), gen, torch.float32, device)
    kwargs = dict(residual=residual, prenorm=True) if prenorm else {}
    results = []
    for direct in (True, False):
        out = rms_norm(x, weight, None, output_dtype=out_dtype if direct else None, **kwargs)
        y, s = out if prenorm else (out, None)
        if not direct:
            y = y.to(out_dtype)
        assert y.dtype == out_dtype
        outputs, grads = ([y, s], [dy, ds]) if prenorm else ([y], [dy])
        leaves = [x, weight] + ([residual] if prenorm else [])
        results.append([y.detach()] + list(torch.autograd.grad(outputs, leaves, grads)))
    # Exact on the CPU, except that Triton's interpreter rounds fp32 -> bf16 toward zero
    # (the GPU to nearest): there y may differ from the cast by one ulp. On the GPU the
    # kernels compiled for a 16-bit y or dy schedule their fp32 arithmetic differently
    # from those for fp32 (the H100 showed 1-ulp flips in y and ~1e-7 in the gradients).
    one_ulp = 2 ** -7 if out_dtype == torch.bfloat16 else 2 ** -10
    loose_y = device == "cuda" or (backend == "triton" and out_dtype == torch.bfloat16)
    for name, a, b in zip(["y", "dx", "dweight", "dresidual"], *results):
        if name == "y":
            torch.testing.assert_close(a, b, rtol=one_ulp if loose_y else 0, atol=0, msg=name)
        elif device == "cuda":
            assert rel_error(a, b) <= 1e-6, name
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    with pytest.raises(TypeError, match="output_dtype"):
        rms_norm(x, weight, None, output_dtype=torch.int32)


# ------------------------------------------------------------------------- torch path
@pytest.mark.parametrize("kind", ["rms", "layer", "group", "group_rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path(kind, dtype, monkeypatch, seed):
    monkeypatch.setenv("FLA_BACKEND", "torch")
    run_norm(kind, (3, 7, 1000), dtype, "cpu", seed, residual=True, prenorm=True)
    run_norm(kind, (4, 200), dtype, "cpu", seed + 1, prenorm=True, residual_in_fp32=True,
             weight=kind != "rms")


# ----------------------------------------------------------------------------- errors
def test_input_errors():
    x = torch.randn(2, 8)
    w = torch.ones(8)
    with pytest.raises(ValueError, match=r"weight: expected shape \(8,\).*D = 8.*got shape \(7,\)"):
        rms_norm(x, torch.ones(7), None)
    with pytest.raises(ValueError, match=r"bias: expected shape \(8,\).*got shape \(2, 4\)"):
        layer_norm(x, w, torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"hidden_size = 16.*last dim 8"):
        RMSNorm(16)(x)
    with pytest.raises(ValueError, match=r"hidden_size = 16.*last dim 8"):
        LayerNorm(16, elementwise_affine=False)(x)
    with pytest.raises(ValueError, match=r"num_groups: 3 groups do not divide .*D = 8"):
        group_norm(x, w, None, num_groups=3)
    with pytest.raises(ValueError, match=r"num_groups: 3 groups do not divide hidden_size D = 10"):
        GroupNorm(3, 10)
    with pytest.raises(ValueError, match=r"num_groups: expected num_groups >= 1, got 0"):
        group_norm(x, w, None, num_groups=0)
    with pytest.raises(ValueError, match=r"residual: expected the shape of x, \(2, 8\), got \(2, 9\)"):
        rms_norm(x, w, None, residual=torch.randn(2, 9))
    with pytest.raises(TypeError, match=r"x: expected dtype in \(float32, float16, bfloat16\), got float64"):
        rms_norm(x.double(), w, None)
    with pytest.raises(TypeError, match=r"weight: expected dtype .* got int64"):
        rms_norm(x, torch.ones(8, dtype=torch.int64), None)
    with pytest.raises(TypeError, match=r"residual: expected dtype .* got int32"):
        rms_norm(x, w, None, residual=torch.ones(2, 8, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"x: expected a torch.Tensor, got list"):
        rms_norm([1.0], w, None)
    with pytest.raises(ValueError, match=r"eps: expected a finite number >= 0, got -1"):
        layer_norm(x, w, None, eps=-1.0)
    with pytest.raises(ValueError, match=r"x: expected shape \[\.\.\., D\] with D >= 1"):
        rms_norm(torch.randn(3, 0), None, None)
    with pytest.raises(ValueError, match=r"hidden_size: expected hidden_size >= 1, got 0"):
        RMSNorm(0)


# ---------------------------------------------------------------------- GPU, real sizes
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["rms", "layer", "group"])
def test_gpu_bf16_real_size(kind, seed):
    run_norm(kind, (4096, 4096), torch.bfloat16, "cuda", seed)
    run_norm(kind, (2, 2048, 4096), torch.bfloat16, "cuda", seed + 1, residual=True,
             prenorm=True, residual_in_fp32=True)
    run_norm(kind, (4096, 4000), torch.bfloat16, "cuda", seed + 2, residual=True,
             prenorm=True)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_gpu_bf16_multi_pass(kind, seed):
    D = kernels.MAX_SINGLE_PASS_D + 1000
    run_norm(kind, (6, D), torch.bfloat16, "cuda", seed, residual=True, prenorm=True)
    run_norm(kind, (3, kernels.MAX_SINGLE_PASS_D), torch.bfloat16, "cuda", seed + 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_other_dtypes(dtype, seed):
    for kind in ("rms", "layer", "group_rms"):
        run_norm(kind, (1000, 2000), dtype, "cuda", seed, residual=True, prenorm=True)


@pytest.mark.gpu
def test_gpu_no_recompile_for_new_row_count(seed):
    gen = generator(seed)
    w = torch.ones(1024, device="cuda")
    for N in (100, 1000, 4097):
        x = randn((N, 1024), gen, torch.bfloat16, "cuda", requires_grad=True)
        rms_norm(x, w.requires_grad_(), None).sum().backward()
        if N == 100:
            counts = [compiled_kernel_count(k) for k in (kernels.norm_fwd_kernel,
                                                         kernels.norm_bwd_kernel)]
    assert counts == [compiled_kernel_count(k) for k in (kernels.norm_fwd_kernel,
                                                         kernels.norm_bwd_kernel)]


@pytest.mark.gpu
@pytest.mark.parametrize("D", [128, 4096])
def test_gpu_tuning_spaces(D, monkeypatch, seed):
    """Every config the tuning layer may pick builds and computes the same function."""
    gen = generator(seed)
    x = randn((2048, D), gen, torch.bfloat16, "cuda")
    w = randn((D,), gen, torch.bfloat16, "cuda").add(1.0)
    dy = randn((2048, D), gen, torch.bfloat16, "cuda")
    y_ref, _ = ref_norm(x.double(), w.double(), is_rms_norm=True)
    x_ref = x.double().requires_grad_()
    ref_norm(x_ref, w.double(), is_rms_norm=True)[0].backward(dy.double())

    def forward():
        return (rms_norm(x, w, None),)

    def backward():
        xg = x.clone().requires_grad_()
        rms_norm(xg, w, None).backward(dy)
        return (xg.grad,)

    failures = sweep_configs(monkeypatch, [
        ("norm_fwd", kernels.norm_fwd_kernel, forward, [y_ref], 5e-3),
        ("norm_bwd", kernels.norm_bwd_kernel, backward, [x_ref.grad], 5e-3),
    ], min_configs=3)
    assert not failures, "\n".join(failures)
