"""The modules of ``fla.modules`` under ``torch.compile(fullgraph=True)``: every Triton
forward, backward and decoding step is a registered custom op (``torch.ops.fla.*``), so
the whole call, argument checks included, traces without a graph break; the compiled call
gives the eager outputs and gradients, and the ops are nodes of the graphs it compiled
(read from the forward and backward graphs themselves: the profiler stopped naming a
compiled graph's custom ops in PyTorch 2.14).

Two host reads stay graph breaks, before the ops: the id range check of the
cross-entropy losses (an id outside the vocabulary would make the kernels read outside a
row) and the ``cu_seqlens`` values of packed sequences (validated, and the chunk grid
sized from them). Those cases compile with breaks allowed and must still give the eager
results; the part after the check (the ``*_triton`` entry points) compiles fullgraph.
"""
import importlib

import pytest
import torch

from fla.modules import (
    FusedRMSNormGated,
    GatedMLP,
    GroupNorm,
    RMSNorm,
    ShortConvolution,
    cross_entropy_loss,
    fused_linear_cross_entropy,
    l2_norm,
    layer_norm,
)
from fla.modules.activations import swiglu
from fla.modules.convolution import causal_conv1d
from fla.modules.fused_cross_entropy import _cross_entropy_triton
from fla.modules.fused_linear_cross_entropy import _linear_cross_entropy_triton
from fla.modules.qkv_l2norm import split_qkv_l2norm
from fla.ops.utils.cumsum import chunk_local_cumsum
from tests.helpers import cu_seqlens_of, generator, randn

pytestmark = pytest.mark.interpret

OPS = ["l2norm_fwd", "l2norm_bwd", "split_qkv_l2norm_fwd", "split_qkv_l2norm_bwd",
       "swiglu_fwd", "swiglu_bwd", "swiglu_packed_fwd", "swiglu_packed_bwd", "norm_fwd",
       "norm_bwd", "causal_conv1d_fwd", "causal_conv1d_bwd",
       "causal_conv1d_update", "cross_entropy_fwd", "cross_entropy_bwd",
       "linear_cross_entropy_fwd", "linear_cross_entropy_bwd", "chunk_local_cumsum"]


def _outputs(out):
    return [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if t is not None]


def recording_backend():
    """``(backend, seen)``: aot_eager that also adds to the set ``seen`` the name
    (``fla::<op>``) of every operator node of each forward and backward graph it
    compiles; an op that mutates an input appears wrapped by functionalization
    (``auto_functionalized(op, ...)``) and is named by the op it wraps."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    seen: set[str] = set()

    def record(gm, _example_inputs):
        for n in gm.graph.nodes:
            if n.op != "call_function":
                continue
            op = n.target
            if isinstance(op, torch._ops.HigherOrderOperator) and n.args:
                op = n.args[0]
            if isinstance(op, torch._ops.OpOverload):
                seen.add(op.name())
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=record, bw_compiler=record), seen


def compare_compiled(fn, args, ops, seed, fullgraph=True):
    """``fn(*args)`` compiled (aot_eager) against eager: outputs and the gradients of the
    args and parameters that require grad, to 1e-6; the ops named in ``ops`` are nodes
    of the compiled forward or backward graphs (``fla::<name>``)."""
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    leaves += [p for p in getattr(fn, "parameters", lambda: [])() if p.requires_grad]
    backend, seen = recording_backend()
    compiled = torch.compile(fn, fullgraph=fullgraph, backend=backend)
    out = _outputs(compiled(*args))
    gen = generator(seed + 1)
    cotangents = [randn(t.shape, gen, t.dtype, t.device) for t in out]
    grads = torch.autograd.grad(out, leaves, cotangents) if leaves else ()
    ref = _outputs(fn(*args))
    ref_grads = torch.autograd.grad(ref, leaves, cotangents) if leaves else ()
    assert len(out) == len(ref)
    for i, (a, b) in enumerate(zip((*out, *grads), (*ref, *ref_grads))):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"tensor {i}")
    missing = [op for op in ops if f"fla::{op}" not in seen]
    assert not missing, f"custom ops not in the compiled graphs: {missing}"


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("FLA_BACKEND", "triton")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_ops_are_registered():
    for name in OPS:
        assert hasattr(torch.ops.fla, name), name


# -------------------------------------------------------------------------------- norms
def test_rms_norm(device, seed):
    gen = generator(seed)
    norm = RMSNorm(24).to(device)
    with torch.no_grad():
        norm.weight.copy_(randn(24, gen))
    x = randn((2, 5, 24), gen, device=device, requires_grad=True)
    compare_compiled(norm, (x,), ["norm_fwd", "norm_bwd"], seed)


@pytest.mark.parametrize("residual_in_fp32", [False, True])
def test_layer_norm_prenorm_residual(device, seed, residual_in_fp32):
    gen = generator(seed)
    x, residual = (randn((3, 4, 32), gen, device=device, requires_grad=True) for _ in "xr")
    weight, bias = (randn(32, gen, device=device, requires_grad=True) for _ in "wb")

    def f(x, residual, weight, bias):
        return layer_norm(x, weight, bias, residual=residual, prenorm=True,
                          residual_in_fp32=residual_in_fp32)

    compare_compiled(f, (x, residual, weight, bias), ["norm_fwd", "norm_bwd"], seed)


def test_group_norm(device, seed):
    gen = generator(seed)
    norm = GroupNorm(4, 32, bias=True).to(device)
    with torch.no_grad():
        norm.weight.copy_(randn(32, gen))
        norm.bias.copy_(randn(32, gen))
    x = randn((6, 32), gen, device=device, requires_grad=True)
    compare_compiled(norm, (x,), ["norm_fwd", "norm_bwd"], seed)


def test_fused_rms_norm_gated(device, seed):
    gen = generator(seed)
    norm = FusedRMSNormGated(16).to(device)
    x, g = (randn((2, 3, 16), gen, device=device, requires_grad=True) for _ in "xg")
    compare_compiled(norm, (x, g), ["norm_fwd", "norm_bwd"], seed)


def test_l2_norm(device, seed):
    x = randn((2, 7, 3, 16), generator(seed), device=device, requires_grad=True)
    compare_compiled(l2_norm, (x,), ["l2norm_fwd", "l2norm_bwd"], seed)


def test_split_qkv_l2norm(device, seed):
    qkv = randn((2, 7, 3 * 32), generator(seed), device=device, requires_grad=True)
    compare_compiled(lambda t: split_qkv_l2norm(t, 32, 16, 16), (qkv,),
                     ["split_qkv_l2norm_fwd", "split_qkv_l2norm_bwd"], seed)


# ------------------------------------------------------------------------- convolution
def test_short_convolution_with_cache(device, seed):
    gen = generator(seed)
    conv = ShortConvolution(16, 4, bias=True).to(device)
    x = randn((2, 9, 16), gen, device=device, requires_grad=True)
    cache = randn((2, 16, 4), gen, device=device, requires_grad=True)

    def f(x, cache):
        return conv(x, cache=cache, output_final_state=True)

    compare_compiled(f, (x, cache), ["causal_conv1d_fwd", "causal_conv1d_bwd"], seed)


def test_short_convolution_decode_steps(device, seed):
    """Two decoding steps: the cache rolls in place, in the compiled call as in eager."""
    gen = generator(seed)
    conv = ShortConvolution(16, 3, bias=True).to(device)
    xs = randn((2, 2, 1, 16), gen, device=device)
    cache = randn((2, 16, 3), gen, device=device)
    caches = {"compiled": cache.clone(), "eager": cache.clone()}

    def decode(x, cache):
        with torch.no_grad():
            ys = [conv(x[i], cache=cache, output_final_state=True)[0] for i in range(2)]
        return torch.stack(ys)

    backend, seen = recording_backend()
    compiled = torch.compile(decode, fullgraph=True, backend=backend)
    compiled(xs, cache.clone())  # compiles
    y = compiled(xs, caches["compiled"])
    y_ref = decode(xs, caches["eager"])
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(caches["compiled"], caches["eager"], rtol=0, atol=0)
    torch.testing.assert_close(caches["eager"][:, :, 1:], xs[:, :, 0].permute(1, 2, 0))
    assert "fla::causal_conv1d_update" in seen


def test_causal_conv1d_varlen(device, seed):
    """Packed sequences: the offsets are read on the host (a break), then the op runs."""
    gen = generator(seed)
    lengths = [5, 11, 3]
    x = randn((1, sum(lengths), 8), gen, device=device, requires_grad=True)
    weight = randn((8, 4), gen, device=device, requires_grad=True)
    cache = randn((3, 8, 4), gen, device=device, requires_grad=True)
    cu_seqlens = cu_seqlens_of(lengths, device)

    def f(x, weight, cache):
        return causal_conv1d(x, weight, initial_state=cache, output_final_state=True,
                             activation="silu", cu_seqlens=cu_seqlens)

    compare_compiled(f, (x, weight, cache), ["causal_conv1d_fwd", "causal_conv1d_bwd"], seed,
                     fullgraph=False)


@pytest.mark.parametrize("case", ["conv", "cumsum"])
def test_varlen_offsets_do_not_recompile(device, seed, case):
    """The offsets are read eagerly, outside the graph: a batch of other lengths (same
    sequence and chunk counts) reuses the compiled graphs."""
    from torch._dynamo.testing import CompileCounterWithBackend

    x = randn((1, 19, 8), generator(seed), device=device, requires_grad=True)
    if case == "conv":
        weight = randn((8, 3), generator(seed + 1), device=device)

        def f(x, cu_seqlens):
            return causal_conv1d(x * 2, weight, cu_seqlens=cu_seqlens)[0]
    else:
        def f(x, cu_seqlens):
            return chunk_local_cumsum(x * 2, 16, cu_seqlens=cu_seqlens)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter)
    for lengths in ([5, 11, 3], [9, 4, 6]):
        cu_seqlens = cu_seqlens_of(lengths, device)
        torch.testing.assert_close(compiled(x, cu_seqlens), f(x, cu_seqlens), rtol=1e-6,
                                   atol=1e-6)
        if lengths[0] == 5:
            frames = counter.frame_count
    assert counter.frame_count == frames


# ---------------------------------------------------------------------------- swiglu
def test_swiglu(device, seed):
    gen = generator(seed)
    gate, up = (randn((3, 5, 24), gen, device=device, requires_grad=True) for _ in "gu")
    compare_compiled(swiglu, (gate, up), ["swiglu_fwd", "swiglu_bwd"], seed)


def test_gated_mlp(device, seed):
    gen = generator(seed)
    mlp = GatedMLP(16, intermediate_size=40).to(device)
    x = randn((2, 3, 16), gen, device=device, requires_grad=True)
    compare_compiled(mlp, (x,), ["swiglu_packed_fwd", "swiglu_packed_bwd"], seed)


# ----------------------------------------------------------------------- cross-entropy
def _targets(gen, shape, V, device):
    target = torch.randint(0, V, shape, generator=gen)
    target[0] = -100  # one ignored row
    return target.to(device)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy(device, seed, reduction):
    gen = generator(seed)
    N, V = 6, 50
    logits = randn((N, V), gen, device=device, requires_grad=True)
    target = _targets(gen, (N,), V, device)
    options = dict(ignore_index=-100, label_smoothing=0.1, logit_scale=0.7)

    def inner(logits, target):
        return _cross_entropy_triton(logits, target, options["ignore_index"],
                                     options["label_smoothing"], options["logit_scale"],
                                     reduction, (N,))

    compare_compiled(inner, (logits, target), ["cross_entropy_fwd", "cross_entropy_bwd"],
                     seed)
    torch._dynamo.reset()

    def public(logits, target):  # the id check reads the host: a break before the op
        return cross_entropy_loss(logits, target, reduction=reduction, **options)

    compare_compiled(public, (logits, target), ["cross_entropy_fwd", "cross_entropy_bwd"],
                     seed, fullgraph=False)


@pytest.mark.parametrize("reduction,dtype", [("mean", torch.float32), ("none", torch.float32),
                                             ("sum", torch.bfloat16)])
def test_fused_linear_cross_entropy(device, seed, reduction, dtype):
    """Two row chunks; 'mean' and 'sum' hand out the forward's gradients (bf16: summed in
    an fp32 accumulator), 'none' recomputes them in the backward op."""
    # (The package exports a function of the module's name.)
    lce = importlib.import_module("fla.modules.fused_linear_cross_entropy")
    gen = generator(seed)
    N, H, V = 7, 16, 40
    x = randn((N, H), gen, dtype, device, requires_grad=True)
    weight = randn((V, H), gen, dtype, device, scale=0.3, requires_grad=True)
    bias = randn(V, gen, dtype, device, requires_grad=True)
    target = _targets(gen, (N,), V, device)
    ops = ["linear_cross_entropy_fwd"] + (["linear_cross_entropy_bwd"]
                                          if reduction == "none" else [])

    def inner(x, target, weight, bias):
        return _linear_cross_entropy_triton(x, target, weight, bias, (-100, 0.1, 1.5),
                                            reduction, (N,), 2)

    # The op's fake must leave the fp32-accumulation probe (CUDA) to a real call.
    lce._ADDMM_FP32_OK.clear()
    compare_compiled(inner, (x, target, weight, bias), ops, seed)
    seen = dict(lce._ADDMM_FP32_OK)
    lce._ADDMM_FP32_OK.clear()
    assert seen == {d: lce._addmm_fp32_supported(d) for d in seen}
    torch._dynamo.reset()

    def public(x, target, weight, bias):
        return fused_linear_cross_entropy(x, target, weight, bias, reduction=reduction,
                                          label_smoothing=0.1, logit_scale=1.5, num_chunks=2)

    compare_compiled(public, (x, target, weight, bias), ops, seed, fullgraph=False)


# ---------------------------------------------------------------------------- cumsum
@pytest.mark.parametrize("reverse", [False, True])
def test_chunk_local_cumsum(device, seed, reverse):
    g = randn((2, 37, 3, 4), generator(seed), device=device, requires_grad=True)

    def f(g):
        return chunk_local_cumsum(g, 16, reverse=reverse, scale=0.5)

    compare_compiled(f, (g,), ["chunk_local_cumsum"], seed)


def test_chunk_local_cumsum_varlen(device, seed):
    g = randn((1, 40, 2), generator(seed), device=device, requires_grad=True)
    cu_seqlens = cu_seqlens_of([17, 23], device)

    def f(g):
        return chunk_local_cumsum(g, 16, cu_seqlens=cu_seqlens)

    compare_compiled(f, (g,), ["chunk_local_cumsum"], seed, fullgraph=False)
