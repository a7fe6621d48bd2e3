"""chunk_rwkv7 / fused_recurrent_rwkv7: the DPLR delta rule with q = r, gk = w and scale
1.0, against the float64 RWKV7 loop (o, final state, dr, dw, dk, dv, da, db, dh0) on
RWKV7-like inputs; head_first; varlen; argument names in errors; long sequences (GPU)."""
import pytest
import torch

from fla.ops.rwkv7 import chunk_rwkv7, fused_recurrent_rwkv7
from tests.helpers import assert_rel_close, cu_seqlens_of, generator, odd_length, uneven_lengths
from tests.ops.dplr_cases import INTERPRETER_DTYPES, compare, make_inputs

OPS = {"chunk": chunk_rwkv7, "fused_recurrent": fused_recurrent_rwkv7}


def _as_dplr(fn, head_first=False):
    """The RWKV7 op called with RWKV7's names, seen through the DPLR names of the inputs."""
    def call(q, k, v, a, b, gk, initial_state=None, **kw):
        t = (lambda x: x.transpose(1, 2)) if head_first else (lambda x: x)  # noqa: E731
        o, ht = fn(r=t(q), w=t(gk), k=t(k), v=t(v), a=t(a), b=t(b),
                   initial_state=initial_state, head_first=head_first, **kw)
        return t(o), ht
    return call


def _rwkv7_scale(kwargs):
    # The float64 DPLR loop defaults to K^-1/2; RWKV7's default is 1.0.
    return dict(kwargs, scale=1.0)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("op", list(OPS))
def test_matches_float64_loop(op, dtype, device, seed):
    gen = generator(seed)
    inputs = make_inputs(gen, B=1, T=odd_length(gen, 65, 140), H=2, K=32, V=16)
    # The op runs at its default scale (1.0); the reference is told 1.0 explicitly.
    fn = _as_dplr(OPS[op])
    compare(inputs, dtype, device, fn=lambda scale=None, **kw: fn(**kw), gen=gen, scale=1.0)


@pytest.mark.interpret
@pytest.mark.parametrize("op", list(OPS))
def test_varlen_head_first(op, device, seed):
    gen = generator(seed)
    lengths = uneven_lengths(2, gen, low=1, high=130)
    inputs = make_inputs(gen, B=1, T=sum(lengths), H=1, K=16, V=16, N=2)
    compare(inputs, torch.float32, device, fn=_as_dplr(OPS[op], head_first=True), gen=gen,
            scale=0.5, cu_seqlens=cu_seqlens_of(lengths, device))


@pytest.mark.no_poison
def test_errors_name_rwkv7_arguments():
    x = torch.randn(1, 10, 2, 16)
    for fn in OPS.values():
        with pytest.raises(ValueError, match=r"^w: expected shape"):
            fn(x, torch.randn(1, 10, 2, 8), x, x, x, x)
        with pytest.raises(TypeError, match=r"^r: expected a torch.Tensor"):
            fn(None, x, x, x, x, x)


# ------------------------------------------------------------------ GPU (bf16)
@pytest.mark.gpu
@pytest.mark.parametrize("op", list(OPS))
def test_gpu_bf16_real_shape(op, seed):
    gen = generator(seed)
    inputs = make_inputs(gen, B=4, T=4096, H=32, K=64, V=64)
    fn = _as_dplr(OPS[op])
    compare(inputs, torch.bfloat16, "cuda", fn=lambda scale=None, **kw: fn(**kw), gen=gen,
            scale=1.0, ref_device="cuda")


@pytest.mark.gpu
def test_gpu_long_sequence_no_nan(seed):
    """T = 65536 in bf16 with RWKV7's ranges: forward, final state and every gradient
    finite, and the chunked output close to the fused recurrent one."""
    gen = generator(seed)
    inputs = make_inputs(gen, B=1, T=65536, H=2, K=64, V=64)
    outs = []
    for fn in (chunk_rwkv7, fused_recurrent_rwkv7):
        xs = {n: x.to(torch.float32 if n == "initial_state" else torch.bfloat16).cuda()
              .requires_grad_() for n, x in inputs.items()}
        o, ht = fn(r=xs["q"], w=xs["gk"], k=xs["k"], v=xs["v"], a=xs["a"], b=xs["b"],
                   initial_state=xs["initial_state"], output_final_state=True)
        (o.float().square().mean() + ht.square().mean()).backward()
        assert torch.isfinite(o).all() and torch.isfinite(ht).all()
        for name, x in xs.items():
            assert torch.isfinite(x.grad).all(), f"d{name} not finite"
        outs.append((o, ht))
    assert_rel_close("o chunk vs recurrent", outs[0][0], outs[1][0], 5e-3)
    assert_rel_close("final_state chunk vs recurrent", outs[0][1], outs[1][1], 5e-3)
