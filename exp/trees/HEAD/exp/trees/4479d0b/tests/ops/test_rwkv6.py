"""RWKV6 (chunk and fused recurrent) against the float64 loop: outputs, final states and
every gradient (r, k, v, w, u, initial_state), through the Triton kernels (interpreted on
CPU: fp32, fp16, small shapes; bf16 at real shapes on the GPU) and the PyTorch paths.
Decays are log-sigmoids clamped at −5 a step."""
import pytest
import torch

from fla.ops.rwkv6 import chunk_rwkv6, fused_recurrent_rwkv6, naive_recurrent_rwkv6
from tests.helpers import (
    assert_rel_close,
    cu_seqlens_of,
    generator,
    odd_length,
    randn,
    uneven_lengths,
)
from tests.ops.gated_delta_cases import INTERPRETER_DTYPES, run
from tests.ops.vector_gate_cases import cast_leaves, compare_with_loop, log_sigmoid_gate

OPS = {"chunk": chunk_rwkv6, "fused_recurrent": fused_recurrent_rwkv6}
FP32_NAMES = ("initial_state", "w")


def make_inputs(gen, *, B, T, H, K, V, N=None, h0=True):
    N = B if N is None else N
    return {
        "r": randn((B, T, H, K), gen, torch.float64),
        "k": randn((B, T, H, K), gen, torch.float64, scale=K ** -0.5),
        "v": randn((B, T, H, V), gen, torch.float64),
        "w": log_sigmoid_gate((B, T, H, K), gen),
        "u": randn((H, K), gen, torch.float64, scale=0.5),
        "initial_state": randn((N, H, K, V), gen, torch.float64, scale=0.5) if h0 else None,
    }


def leaves_of(inputs, dtype, device):
    return cast_leaves(inputs, dtype, device, FP32_NAMES)


def compare(inputs, dtype, device, *, fn, gen, ref_fn=naive_recurrent_rwkv6, tol=None,
            **kwargs):
    compare_with_loop(inputs, dtype, device, fn=fn, ref_fn=ref_fn, gen=gen,
                      fp32_names=FP32_NAMES, tol=tol, **kwargs)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("mode", list(OPS))
def test_matches_float64_loop(mode, dtype, device, seed):
    gen = generator(seed)
    T = odd_length(gen, low=65, high=110)
    compare(make_inputs(gen, B=2, T=T, H=1, K=16, V=32), dtype, device, fn=OPS[mode], gen=gen)


@pytest.mark.interpret
@pytest.mark.parametrize("mode", list(OPS))
def test_varlen_uneven_sequences(mode, device, seed):
    gen = generator(seed)
    lengths = uneven_lengths(3, gen, low=1, high=100)
    inputs = make_inputs(gen, B=1, T=sum(lengths), H=2, K=16, V=16, N=3)
    compare(inputs, torch.float16, device, fn=OPS[mode], gen=gen,
            cu_seqlens=cu_seqlens_of(lengths, device))


@pytest.mark.interpret
def test_fused_recurrent_reverse_and_head_first(device, seed):
    gen = generator(seed)
    inputs = make_inputs(gen, B=2, T=odd_length(gen, 5, 60), H=2, K=16, V=16)

    def reversed_naive(r, k, v, w, u, **kw):
        o, ht = naive_recurrent_rwkv6(*(x.flip(1) for x in (r, k, v, w)), u, **kw)
        return o.flip(1), ht

    def head_first_reverse(r, k, v, w, u, **kw):
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        o, ht = fused_recurrent_rwkv6(t(r), t(k), t(v), t(w), u, reverse=True,
                                      head_first=True, **kw)
        return t(o), ht

    compare(inputs, torch.float32, device, fn=head_first_reverse, ref_fn=reversed_naive,
            gen=gen, scale=0.4)


@pytest.mark.interpret
def test_chunk_equals_fused_recurrent(device, seed):
    gen = generator(seed)
    lengths = uneven_lengths(2, gen, low=10, high=120)
    inputs = make_inputs(gen, B=1, T=sum(lengths), H=1, K=16, V=16, N=2)
    cu = cu_seqlens_of(lengths, device)
    do = torch.randn(inputs["v"].shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(inputs["initial_state"].shape, generator=gen, dtype=torch.float64)
    (o1, h1, g1), (o2, h2, g2) = [run(fn, leaves_of(inputs, torch.float32, device), do, dht,
                                      cu_seqlens=cu) for fn in OPS.values()]
    assert_rel_close("o", o1, o2, 1e-4)
    assert_rel_close("final_state", h1, h2, 1e-4)
    for name in g1:
        assert_rel_close(f"d{name}", g1[name], g2[name], 1e-4)


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("mode", list(OPS))
def test_torch_paths_match_float64_loop(mode, dtype, seed, monkeypatch):
    monkeypatch.setenv("FLA_BACKEND", "torch")
    gen = generator(seed)
    lengths = uneven_lengths(3, gen, low=1, high=140)
    inputs = make_inputs(gen, B=1, T=sum(lengths), H=2, K=16, V=16, N=3)
    compare(inputs, dtype, "cpu", fn=OPS[mode], gen=gen, cu_seqlens=cu_seqlens_of(lengths))


@pytest.mark.no_poison
@pytest.mark.parametrize("mode", list(OPS))
def test_bad_inputs_are_refused(mode):
    fn = OPS[mode]
    r = torch.randn(1, 10, 2, 16)
    v = torch.randn(1, 10, 2, 8)
    w = -torch.rand(1, 10, 2, 16)
    with pytest.raises(ValueError, match=r"u: expected shape \[H, K\]"):
        fn(r, r, v, w, torch.zeros(3, 16))
    with pytest.raises(ValueError, match=r"w: expected shape \[B, T, H, K\]"):
        fn(r, r, v, -torch.rand(1, 10, 2, 8), torch.zeros(2, 16))
    with pytest.raises(ValueError, match=r"u: RWKV6 needs"):
        fn(r, r, v, w, None)
    with pytest.raises(ValueError, match=r"k: expected shape"):
        fn(r, torch.randn(1, 10, 2, 8), v, w, torch.zeros(2, 16))


# ------------------------------------------------------------------ GPU, real shapes
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [dict(B=2, T=1000, H=4, K=128, V=128),
                                   dict(B=1, T=300, H=2, K=256, V=256)],
                         ids=["2x1000x4x128", "K=V=256"])
@pytest.mark.parametrize("mode", list(OPS))
def test_gpu_bf16_real_shapes(mode, shape):
    gen = generator(0x6b6)
    compare(make_inputs(gen, **shape), torch.bfloat16, "cuda", fn=OPS[mode], gen=gen)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(OPS))
def test_gpu_bf16_varlen(mode):
    gen = generator(0x6b7)
    lengths = [1, 63, 700, 129, 1000]
    inputs = make_inputs(gen, B=1, T=sum(lengths), H=4, K=128, V=128, N=len(lengths))
    compare(inputs, torch.bfloat16, "cuda", fn=OPS[mode], gen=gen,
            cu_seqlens=cu_seqlens_of(lengths, "cuda"))
