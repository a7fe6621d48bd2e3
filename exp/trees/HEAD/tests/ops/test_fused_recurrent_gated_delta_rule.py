"""fused_recurrent_gated_delta_rule / fused_recurrent_delta_rule against the float64 loop.

Outputs, final states and the gradients of q, k, v, g, beta and initial_state, through
the Triton kernels (the interpreter without a GPU: fp32, fp16, small shapes) and through
the PyTorch path. bf16 and the decode shape run on the GPU only.
"""
import warnings

import pytest
import torch

from fla.ops.delta_rule.fused_recurrent import fused_recurrent_delta_rule
from fla.ops.delta_rule.naive import naive_recurrent_delta_rule
from fla.ops.gated_delta_rule import fused_recurrent as fr
from fla.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule
from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
from fla.utils.tuning import Config
from tests.helpers import assert_rel_close, cu_seqlens_of, generator, odd_length, randn, uneven_lengths
from tests.ops.gated_delta_cases import GRAD_NAMES, INTERPRETER_DTYPES, cast, make_inputs, run
from tests.ops.gated_delta_cases import compare as _compare


def compare(*args, fn=fused_recurrent_gated_delta_rule, **kwargs):
    return _compare(*args, fn=fn, **kwargs)


# ------------------------------------------------------------------- kernels vs loop
CASES = {
    # name: shape and options
    "gated": dict(B=2, H=2, HV=2, K=32, V=32),
    "grouped_heads": dict(B=1, H=1, HV=2, K=16, V=32),
    "odd_head_dims": dict(B=1, H=1, HV=1, K=24, V=20),
    "no_gate_no_beta_no_h0": dict(B=2, H=1, HV=1, K=16, V=16, gate=False, beta=False,
                                  h0=False),
}


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64_loop(case, dtype, device, seed):
    gen = generator(seed)
    options = dict(CASES[case])
    T = odd_length(gen, low=20, high=70)
    inputs = make_inputs(gen, T=T, **options)
    compare(inputs, dtype, device, gen=gen)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES, ids=lambda d: str(d)[6:])
def test_varlen_uneven_sequences_with_their_own_initial_states(dtype, device, seed):
    gen = generator(seed)
    lengths = uneven_lengths(3, gen, low=1, high=80)
    cu = cu_seqlens_of(lengths, device)
    inputs = make_inputs(gen, B=1, T=sum(lengths), H=1, HV=2, K=16, V=16, N=len(lengths))
    compare(inputs, dtype, device, gen=gen, cu_seqlens=cu)


@pytest.mark.interpret
def test_qk_l2norm_in_kernel_scale_and_several_v_tiles(device, seed, monkeypatch):
    """l2norm of q, k inside the kernels (and through their backward), a custom scale,
    and V split into several tiles (partial dq/dk/dbeta/dg sums) in both directions."""
    kernel = fr.fused_recurrent_gated_delta_rule_fwd_kernel
    monkeypatch.setattr(kernel, "default", lambda a: Config(BV=8, num_warps=1, num_stages=1))
    monkeypatch.setattr(kernel, "_chosen", {})
    monkeypatch.setattr(fr, "_bwd_block_v", lambda K, V: 8)
    gen = generator(seed)
    inputs = make_inputs(gen, B=1, T=odd_length(gen, low=10, high=40), H=1, HV=2, K=16,
                         V=24, normalized_k=False)
    compare(inputs, torch.float32, device, gen=gen, use_qk_l2norm_in_kernel=True,
            scale=0.37)


@pytest.mark.interpret
def test_head_first_matches_time_major(device, seed):
    gen = generator(seed)
    inputs = make_inputs(gen, B=2, T=17, H=1, HV=2, K=16, V=16)
    do = randn((2, 17, 2, 16), gen, torch.float64)
    leaves = cast(inputs, torch.float32, device)
    o, ht, grads = run(fused_recurrent_gated_delta_rule, leaves, do, None)

    hf = {n: None if x is None else (x.transpose(1, 2) if n != "initial_state" else x)
          for n, x in cast(inputs, torch.float32, device).items()}
    hf = {n: None if x is None else x.detach().requires_grad_() for n, x in hf.items()}
    o_hf, ht_hf, grads_hf = run(fused_recurrent_gated_delta_rule, hf,
                                do.transpose(1, 2), None, head_first=True)
    assert o_hf.shape == (2, 2, 17, 16)
    torch.testing.assert_close(o_hf.transpose(1, 2), o)
    torch.testing.assert_close(ht_hf, ht)
    for name in GRAD_NAMES:
        grad = grads_hf[name]
        if name != "initial_state":
            grad = grad.transpose(1, 2)
        torch.testing.assert_close(grad, grads[name], msg=name)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES, ids=lambda d: str(d)[6:])
def test_delta_rule_wrapper(dtype, device, seed):
    gen = generator(seed)
    lengths = uneven_lengths(2, gen, low=1, high=70)
    inputs = make_inputs(gen, B=1, T=sum(lengths), H=1, HV=1, K=16, V=32, N=2, gate=False)
    inputs.pop("g")
    compare(inputs, dtype, device, fn=fused_recurrent_delta_rule,
            ref_fn=naive_recurrent_delta_rule, gen=gen,
            cu_seqlens=cu_seqlens_of(lengths, device))


@pytest.mark.interpret
def test_final_state_gradient_alone_and_half_precision_state(device, seed):
    """Only the final state feeds the loss (o unused), from an fp16 initial state."""
    gen = generator(seed)
    inputs = make_inputs(gen, B=1, T=23, H=1, HV=1, K=16, V=16)
    leaves = cast(inputs, torch.float32, device, state_dtype=torch.float16)
    _, ht = fused_recurrent_gated_delta_rule(**leaves, output_final_state=True)
    dht = randn(ht.shape, gen, torch.float64)
    (ht.double() * dht.to(ht.device)).sum().backward()

    ref = {n: x.to(torch.float16 if n == "initial_state" else torch.float32)
           .to(torch.float64).detach().requires_grad_() for n, x in inputs.items()}
    _, ht_ref = naive_recurrent_gated_delta_rule(**ref, output_final_state=True)
    (ht_ref * dht).sum().backward()
    assert_rel_close("final_state", ht, ht_ref, 1e-4)
    for name in GRAD_NAMES:
        grad, expected = leaves[name].grad, ref[name].grad
        assert grad.dtype == leaves[name].dtype
        if expected is None:  # q does not reach the final state
            assert torch.equal(grad, torch.zeros_like(grad)), name
            continue
        assert_rel_close(f"d{name}", grad, expected, 5e-3 if name == "initial_state" else 1e-4)


@pytest.mark.interpret
def test_inference_path_and_no_final_state(device, seed):
    gen = generator(seed)
    inputs = make_inputs(gen, B=3, T=1, H=2, HV=2, K=16, V=16)
    leaves = cast(inputs, torch.float32, device)
    o_grad, ht_grad = fused_recurrent_gated_delta_rule(**leaves, output_final_state=True)
    with torch.no_grad():
        o, ht = fused_recurrent_gated_delta_rule(**leaves, output_final_state=True)
        o_none, ht_none = fused_recurrent_gated_delta_rule(**leaves)
    assert ht_none is None and not o.requires_grad
    # Different constexpr flags compile different kernels: equal up to rounding.
    torch.testing.assert_close(o, o_grad.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ht, ht_grad.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(o_none, o, rtol=1e-6, atol=1e-6)
    o_ref, ht_ref = naive_recurrent_gated_delta_rule(**inputs, output_final_state=True)
    assert_rel_close("o", o, o_ref, 1e-4)
    assert_rel_close("final_state", ht, ht_ref, 1e-4)


# --------------------------------------------------------------------- PyTorch path
@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES, ids=lambda d: str(d)[6:])
def test_torch_path_matches_float64_loop(dtype, seed, monkeypatch):
    monkeypatch.setenv("FLA_BACKEND", "torch")
    gen = generator(seed)
    lengths = uneven_lengths(2, gen, low=1, high=70)
    inputs = make_inputs(gen, B=1, T=sum(lengths), H=1, HV=2, K=16, V=24, N=2,
                         normalized_k=False)
    compare(inputs, dtype, "cpu", gen=gen, cu_seqlens=cu_seqlens_of(lengths),
            use_qk_l2norm_in_kernel=True)


@pytest.mark.interpret
def test_torch_path_equals_the_kernels(device, seed, monkeypatch):
    gen = generator(seed)
    inputs = make_inputs(gen, B=2, T=19, H=1, HV=2, K=16, V=16)
    do = randn((2, 19, 2, 16), gen, torch.float64)
    dht = randn((2, 2, 16, 16), gen, torch.float64)
    o, ht, grads = run(fused_recurrent_gated_delta_rule, cast(inputs, torch.float32, device),
                       do, dht)
    monkeypatch.setenv("FLA_BACKEND", "torch")
    o_t, ht_t, grads_t = run(fused_recurrent_gated_delta_rule,
                             cast(inputs, torch.float32, "cpu"), do, dht)
    assert_rel_close("o", o, o_t, 1e-5)
    assert_rel_close("final_state", ht, ht_t, 1e-5)
    for name in GRAD_NAMES:
        assert_rel_close(f"d{name}", grads[name], grads_t[name], 1e-5)


# ------------------------------------------------------------------------ refusals
@pytest.mark.no_poison
@pytest.mark.parametrize("change, error, text", [
    (dict(v=(2, 5, 3, 16)), ValueError, "multiple of the q/k heads"),
    (dict(initial_state=(3, 2, 16, 16)), ValueError, "initial_state"),
    (dict(g=(2, 5, 1)), ValueError, "g: expected shape"),
    (dict(q=(2, 5, 2, 300), k=(2, 5, 2, 300)), ValueError, "K = 300"),
])
def test_bad_inputs_are_refused_before_any_kernel(change, error, text):
    shapes = dict(q=(2, 5, 2, 16), k=(2, 5, 2, 16), v=(2, 5, 2, 16), g=(2, 5, 2),
                  beta=(2, 5, 2), initial_state=(2, 2, 16, 16))
    shapes.update(change)
    args = {n: torch.zeros(s) for n, s in shapes.items()}
    with pytest.raises(error, match=text):
        fused_recurrent_gated_delta_rule(**args)


def test_bad_dtype_is_refused():
    q = torch.zeros(1, 4, 1, 16, dtype=torch.float64)
    with pytest.raises(TypeError, match="q: expected dtype"):
        fused_recurrent_gated_delta_rule(q, q.float(), q.float())


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_bf16_matches_float64_loop_on_gpu(seed):
    gen = generator(seed)
    lengths = uneven_lengths(3, gen, low=1, high=300)
    inputs = make_inputs(gen, B=1, T=sum(lengths), H=2, HV=4, K=128, V=128, N=3)
    compare(inputs, torch.bfloat16, "cuda", gen=gen, cu_seqlens=cu_seqlens_of(lengths, "cuda"))
    inputs = make_inputs(gen, B=2, T=odd_length(gen, 100, 400), H=2, HV=2, K=256, V=256)
    compare(inputs, torch.bfloat16, "cuda", gen=gen)


@pytest.mark.gpu
def test_decode_step_at_serving_shape(seed):
    """One token, B=256, H=32, K=V=128, bf16 inputs, fp32 state: the shape the decode
    benchmark times."""
    gen = generator(seed)
    B, H, K, V = 256, 32, 128, 128
    inputs = make_inputs(gen, B=B, T=1, H=H, HV=H, K=K, V=V)
    x = {n: t.to(torch.float32 if n == "initial_state" else torch.bfloat16).cuda()
         for n, t in inputs.items()}
    with torch.no_grad():
        o, ht = fused_recurrent_gated_delta_rule(**x, output_final_state=True,
                                                 use_qk_l2norm_in_kernel=True)
    ref = {n: t.to(torch.float32 if n == "initial_state" else torch.bfloat16)
           .to(torch.float64).cuda() for n, t in inputs.items()}
    o_ref, ht_ref = naive_recurrent_gated_delta_rule(**ref, output_final_state=True,
                                                     use_qk_l2norm=True)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    assert_rel_close("o", o, o_ref, 5e-3)
    assert_rel_close("final_state", ht, ht_ref, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("KV", [64, 128, 256])
def test_every_config_in_the_tuning_space_is_correct_on_gpu(KV, seed, monkeypatch):
    """Each forward and backward config compiles on this Triton/GPU and gives the float64
    loop's result (a config that failed to build would warn and fall back: an error here)."""
    gen = generator(seed)
    inputs = make_inputs(gen, B=1, T=33, H=1, HV=2, K=KV, V=KV)
    fwd = fr.fused_recurrent_gated_delta_rule_fwd_kernel
    bwd = fr.fused_recurrent_gated_delta_rule_bwd_kernel
    BK = fr._block_k(KV)
    fwd_space = fwd.candidates({"BK": BK, "K": KV, "V": KV})
    bwd_space = bwd.candidates({"BK": BK, "BV": fr._bwd_block_v(KV, KV)})
    for kernel in (fwd, bwd):
        monkeypatch.setattr(kernel, "_disk", {})  # no config read from a tuning cache
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(max(len(fwd_space), len(bwd_space))):
            for kernel, space in ((fwd, fwd_space), (bwd, bwd_space)):
                config = space[i % len(space)]
                monkeypatch.setattr(kernel, "default", lambda a, c=config: c)
                monkeypatch.setattr(kernel, "_chosen", {})
            compare(inputs, torch.float32, "cuda", gen=gen, tol=1e-4)
