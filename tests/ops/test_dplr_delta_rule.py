"""chunk_dplr_delta_rule / fused_recurrent_dplr_delta_rule against the float64 loop
(outputs, final states, dq, dk, dv, da, db, dgk, dh0) through the Triton kernels
(interpreted on CPU: fp32, fp16; bf16 at real shapes on the GPU) and the PyTorch paths;
chunk == recurrent; the delta-rule special case; bad inputs."""

import pytest
import torch
import torch.nn.functional as F

from fla.ops.delta_rule import chunk_delta_rule
from fla.ops.generalized_delta_rule import chunk_dplr_delta_rule, fused_recurrent_dplr_delta_rule
from tests.helpers import (
    TOLERANCE,
    assert_rel_close,
    cu_seqlens_of,
    generator,
    odd_length,
    uneven_lengths,
)
from tests.interpreter_bf16 import AVAILABLE as GPU_BF16_EMULATED
from tests.interpreter_bf16 import gpu_bf16
from tests.ops.dplr_cases import INTERPRETER_DTYPES, compare, leaves, make_inputs, run

OPS = {"chunk": chunk_dplr_delta_rule, "fused_recurrent": fused_recurrent_dplr_delta_rule}


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("op", list(OPS))
def test_matches_float64_loop(op, dtype, device, seed):
    gen = generator(seed)
    T = odd_length(gen, low=65, high=140)           # more than one chunk, never a multiple
    compare(make_inputs(gen, B=2, T=T, H=1, K=16, V=32), dtype, device, fn=OPS[op], gen=gen,
            scale=0.7)


@pytest.mark.interpret
@pytest.mark.skipif(not GPU_BF16_EMULATED, reason="this Triton's interpreter differs")
def test_chunk_bf16_with_the_gpus_rounding(device, seed):
    """bf16 through every Triton stage, in the interpreter with the GPU's bf16 dots and
    rounding (tests/interpreter_bf16.py): o, the final state and every gradient within
    5e-3 of the float64 loop. The backward's gate gradient sums terms that cancel, which
    rounded dot operands spoil unless each side's rounding cancels too (bf16 operands in
    the backward intra kernel with its terms formed from the unrounded values: dgk
    1.1e-2). K = 64: the intra kernels' full-width tiles. (On the GPU: the real-shape
    tests.)"""
    if device != "cpu":
        pytest.skip("the interpreter's test; bf16 on the GPU runs at real shapes")
    gen = generator(seed)
    T = odd_length(gen, low=130, high=200)
    with gpu_bf16():
        compare(make_inputs(gen, B=1, T=T, H=2, K=64, V=32), torch.bfloat16, device,
                fn=chunk_dplr_delta_rule, gen=gen, scale=1.0)


@pytest.mark.interpret
@pytest.mark.parametrize("op", list(OPS))
def test_varlen_uneven_with_initial_states(op, device, seed):
    gen = generator(seed)
    lengths = uneven_lengths(3, gen, low=1, high=140)
    inputs = make_inputs(gen, B=1, T=sum(lengths), H=2, K=32, V=16, N=3)
    compare(inputs, torch.float32, device, fn=OPS[op], gen=gen,
            cu_seqlens=cu_seqlens_of(lengths, device))


@pytest.mark.interpret
def test_chunk_equals_fused_recurrent_head_first_k_not_pow2(device, seed):
    gen = generator(seed)
    inputs = make_inputs(gen, B=1, T=odd_length(gen, 65, 130), H=2, K=24, V=20)
    do = torch.randn(inputs["v"].shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(inputs["initial_state"].shape, generator=gen, dtype=torch.float64)

    def head_first(fn):
        def call(q, k, v, a, b, gk, initial_state, **kw):
            t = lambda x: x.transpose(1, 2)  # noqa: E731
            o, ht = fn(t(q), t(k), t(v), t(a), t(b), t(gk), initial_state=initial_state,
                       head_first=True, **kw)
            return t(o), ht
        return call

    (o1, h1, g1), (o2, h2, g2) = (run(head_first(fn), leaves(inputs, torch.float32, device),
                                      do, dht) for fn in OPS.values())
    assert_rel_close("o", o1, o2, 1e-4)
    assert_rel_close("final_state", h1, h2, 1e-4)
    for name in g1:
        assert_rel_close(f"d{name}", g1[name], g2[name], 1e-4)


@pytest.mark.interpret
def test_delta_rule_is_a_special_case(device, seed):
    """a = −β k, b = k, gk = 0 and v ← β v: the delta rule S ← (I − βkkᵀ)S + βk vᵀ."""
    gen = generator(seed)
    B, T, H, K, V = 1, odd_length(gen, 65, 130), 2, 16, 16
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    h0 = torch.randn(B, H, K, V, generator=gen)
    o_ref, ht_ref = chunk_delta_rule(q, k, v, beta, initial_state=h0, output_final_state=True)
    args = [x.to(device) for x in (q, k, v * beta[..., None], -beta[..., None] * k, k,
                                   torch.zeros_like(k))]
    for fn in OPS.values():
        o, ht = fn(*args, initial_state=h0.to(device), output_final_state=True)
        assert_rel_close("o", o, o_ref, 1e-4)
        assert_rel_close("final_state", ht, ht_ref, 1e-4)


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("op", list(OPS))
def test_torch_paths_match_float64_loop(op, dtype, seed, monkeypatch):
    monkeypatch.setenv("FLA_BACKEND", "torch")
    gen = generator(seed)
    lengths = uneven_lengths(2, gen, low=1, high=140)
    inputs = make_inputs(gen, B=1, T=sum(lengths), H=2, K=16, V=16, N=2)
    compare(inputs, dtype, "cpu", fn=OPS[op], gen=gen, cu_seqlens=cu_seqlens_of(lengths))


@pytest.mark.no_poison
def test_bad_inputs_are_refused():
    x = torch.randn(1, 10, 2, 16)
    v = torch.randn(1, 10, 2, 8)
    for fn in OPS.values():
        with pytest.raises(ValueError, match=r"gk: expected shape .*\(1, 10, 2, 15\)"):
            fn(x, x, v, x, x, torch.randn(1, 10, 2, 15))
        with pytest.raises(TypeError, match=r"a: expected dtype"):
            fn(x, x, v, x.double(), x, x)
        with pytest.raises(ValueError, match=r"initial_state: expected shape"):
            fn(x, x, v, x, x, x, initial_state=torch.randn(1, 2, 16, 16))
        with pytest.raises(ValueError, match=r"cu_seqlens: expected the last offset"):
            fn(x, x, v, x, x, x, cu_seqlens=torch.tensor([0, 4, 9]))
        with pytest.raises(ValueError, match=r"K = 300 is over the limit"):
            y = torch.randn(1, 4, 1, 300)
            fn(y, y, v[:, :4, :1], y, y, y)


# ------------------------------------------------------------------ GPU (bf16, real shapes)
@pytest.mark.gpu
@pytest.mark.parametrize("op", list(OPS))
def test_gpu_bf16_real_shape(op, seed):
    gen = generator(seed)
    compare(make_inputs(gen, B=4, T=4096, H=32, K=64, V=64), torch.bfloat16, "cuda",
            fn=OPS[op], gen=gen, ref_device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(OPS))
def test_gpu_bf16_varlen(op, seed):
    gen = generator(seed)
    lengths = uneven_lengths(4, gen, low=1, high=3000)
    inputs = make_inputs(gen, B=1, T=sum(lengths), H=8, K=128, V=128, N=4)
    compare(inputs, torch.bfloat16, "cuda", fn=OPS[op], gen=gen, ref_device="cuda",
            cu_seqlens=cu_seqlens_of(lengths, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_bf16_forward_without_gradients(D, seed):
    """A forward that feeds no backward runs the state pass without saving h (a variant
    compiled apart, with a default of its own): output and final state against the
    float64 loop, packed uneven sequences."""
    from fla.ops.generalized_delta_rule import naive_recurrent_dplr_delta_rule
    gen = generator(seed)
    lengths = uneven_lengths(3, gen, low=1, high=2000)
    inputs = make_inputs(gen, B=1, T=sum(lengths), H=8, K=D, V=D, N=3)
    cu = cu_seqlens_of(lengths, "cuda")
    xs = {n: None if x is None else
          x.to(torch.float32 if n == "initial_state" else torch.bfloat16).cuda()
          for n, x in inputs.items()}
    with torch.no_grad():
        o, ht = chunk_dplr_delta_rule(**xs, output_final_state=True, cu_seqlens=cu)
        o_ref, ht_ref = naive_recurrent_dplr_delta_rule(
            **{n: None if x is None else x.double() for n, x in xs.items()},
            output_final_state=True, cu_seqlens=cu)
    assert_rel_close("o", o, o_ref, 5e-3)
    assert_rel_close("final_state", ht, ht_ref, 5e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
def test_every_tuning_config_of_the_chunk_kernels(D, monkeypatch):
    """Each config the tuning layer may pick for a kernel of chunk_dplr_delta_rule (the
    intra-chunk and local stages, both state passes) compiles on this Triton/GPU and gives
    the float64 loop's outputs and gradients (bf16 inputs). Their defaults were once
    chosen offline and never run; this runs every config they may take."""
    from fla.ops.common import (chunk_dplr_bwd_dhu, chunk_dplr_bwd_intra,
                                chunk_dplr_bwd_local, chunk_dplr_fwd_h,
                                chunk_dplr_fwd_intra)
    modules = (chunk_dplr_fwd_intra, chunk_dplr_fwd_h, chunk_dplr_bwd_intra,
               chunk_dplr_bwd_local, chunk_dplr_bwd_dhu)
    _sweep_launched_kernels(D, monkeypatch, chunk_dplr_delta_rule, modules, len(modules))


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
def test_every_tuning_config_of_the_recurrent_kernels(D, monkeypatch):
    """The same for fused_recurrent_dplr_delta_rule's forward and backward kernels: the
    forward's default differs on few sequences x heads (16 columns at 4 warps at K = 64,
    64 at 8 warps at K = 128) from the decode batches' one-warp rule."""
    from fla.ops.generalized_delta_rule import fused_recurrent as module
    _sweep_launched_kernels(D, monkeypatch, fused_recurrent_dplr_delta_rule, (module,), 2)


def _sweep_launched_kernels(D, monkeypatch, fn, modules, kernels: int):
    """Every config of every tuned kernel of ``modules`` that ``fn`` launches, against
    the float64 loop (bf16 inputs, outputs and gradients within 2e-2)."""
    from tests.helpers import output_grad, randn
    from tests.ops.config_sweep import launched_stages, sweep_configs
    from tests.ops.dplr_cases import reference

    gen = generator(0xd91)
    inputs = make_inputs(gen, B=2, T=300, H=2, K=D, V=D)
    do = output_grad(inputs["v"].shape, gen, torch.bfloat16)
    dht = randn(inputs["initial_state"].shape, gen, torch.float64)
    o_ref, ht_ref, g_ref = reference(inputs, torch.bfloat16, do, dht, "cuda")
    order = sorted(inputs)
    refs = [o_ref, ht_ref] + [g_ref[n] for n in order]

    def call():
        o, ht, grads = run(fn, leaves(inputs, torch.bfloat16, "cuda"), do, dht)
        return [o, ht] + [grads[n] for n in order]

    launched = launched_stages(monkeypatch, modules, call, refs, 2e-2)
    assert len(launched) == kernels, [name for name, *_ in launched]
    failures = sweep_configs(monkeypatch, launched, min_configs=2)
    assert not failures, "\n".join(failures)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=lambda d: str(d)[6:])
def test_forward_without_gradients_under_steep_gates(dtype, device, seed):
    """Gates of −2.5 to −5 a step (the steepest the op documents): the state is mostly each chunk's last tokens, scaled by
    e^{γ_C − γ} with an exponent that must be exactly 0 at the last token. With sequences
    that end inside a chunk, γ_C taken as the scan's last row (rows past the end added as
    zeros, associated differently by a parallel scan) rather than the last token's row put
    that exponent ulps of ~300 away from 0. Final state and output against float64. In
    fp16 the intra-chunk kernel's gate-referenced operands reach e^{+40} (8 steps of −5)
    there: past fp16's range, so that kernel's products must take fp32 operands."""
    from fla.ops.generalized_delta_rule import naive_recurrent_dplr_delta_rule
    gen = generator(seed)
    lengths = uneven_lengths(3, gen, low=40, high=160)
    cu = cu_seqlens_of(lengths)
    x = make_inputs(gen, B=1, T=sum(lengths), H=2, K=32, V=16, N=3)
    x["gk"] = -2.5 - 2.5 * torch.rand(x["gk"].shape, generator=gen, dtype=torch.float64)
    x = {n: t.float() if n == "initial_state" else t.to(dtype) for n, t in x.items()}
    with torch.no_grad():
        o, ht = chunk_dplr_delta_rule(**{n: t.to(device) for n, t in x.items()},
                                      output_final_state=True, cu_seqlens=cu.to(device))
        o_ref, ht_ref = naive_recurrent_dplr_delta_rule(
            **{n: t.double() for n, t in x.items()}, output_final_state=True,
            cu_seqlens=cu)
    tol = 1e-5 if dtype == torch.float32 else TOLERANCE[dtype]
    assert_rel_close("final_state", ht, ht_ref, tol)
    assert_rel_close("o", o, o_ref, tol)
