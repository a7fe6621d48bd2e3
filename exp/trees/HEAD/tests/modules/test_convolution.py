"""ShortConvolution / causal_conv1d against F.conv1d in float64, sequence by sequence."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fla.modules.convolution import ShortConvolution, causal_conv1d, causal_conv1d_update
from tests.helpers import (
    TOLERANCE,
    assert_rel_close,
    cu_seqlens_of,
    generator,
    odd_length,
    randn,
    uneven_lengths,
)


# ----------------------------------------------------------------------- reference
def conv_ref(x, weight, bias=None, cache=None, activation=None, lengths=None):
    """Float64: each sequence left-padded with its history (the cache's last W − 1
    columns, or zeros) and convolved by F.conv1d. Returns (y, final cache [N, D, W])."""
    x = x.to(torch.float64).cpu()
    w = weight.reshape(weight.shape[0], -1).to(torch.float64).cpu()
    b = None if bias is None else bias.to(torch.float64).cpu()
    D, W = w.shape
    seqs = list(x) if lengths is None else list(x[0].split(lengths))
    ys, finals = [], []
    for n, seq in enumerate(seqs):
        hist = (torch.zeros(D, W - 1, dtype=torch.float64) if cache is None
                else cache[n, :, 1:].to(torch.float64).cpu())
        ext = torch.cat([hist, seq.T], dim=1)
        y = F.conv1d(ext[None], w[:, None], b, groups=D)[0].T
        ys.append(F.silu(y) if activation in ("silu", "swish") else y)
        finals.append(ext[:, -W:])                 # T >= 1: column 0 of a cache never stays
    y = torch.stack(ys) if lengths is None else torch.cat(ys)[None]
    return y, torch.stack(finals)


def compare(x, weight, bias, cache, activation, lengths, gen, tol, cu_seqlens=None):
    """Forward and every gradient of causal_conv1d against the float64 reference."""
    y, ht = causal_conv1d(x, weight, bias, initial_state=cache, output_final_state=True,
                          activation=activation, cu_seqlens=cu_seqlens)
    inputs = [t for t in (x, weight, bias, cache) if t is not None]
    ref_inputs = [t.detach().cpu().to(torch.float64).requires_grad_() for t in inputs]
    rx, rw = ref_inputs[0], ref_inputs[1]
    rb = ref_inputs[2] if bias is not None else None
    rc = ref_inputs[-1] if cache is not None else None
    y_ref, ht_ref = conv_ref(rx, rw, rb, rc, activation, lengths)
    assert y.dtype == x.dtype and ht.dtype == x.dtype
    assert_rel_close("y", y, y_ref, tol)
    assert_rel_close("final_state", ht, ht_ref, tol)
    dy = randn(y.shape, gen, x.dtype, x.device)
    dht = randn(ht.shape, gen, x.dtype, x.device)
    grads = torch.autograd.grad((y, ht), inputs, (dy, dht))
    ref_grads = torch.autograd.grad((y_ref, ht_ref), ref_inputs, (dy.double().cpu(),
                                                                   dht.double().cpu()))
    names = ["dx", "dweight", "dbias", "dcache"]
    present = [n for n, t in zip(names, (x, weight, bias, cache)) if t is not None]
    for name, g, r in zip(present, grads, ref_grads):
        assert g.dtype == dict(zip(present, inputs))[name].dtype
        assert_rel_close(name, g, r, tol)


CASES = [  # (W, activation, bias, cache)
    (4, "silu", True, True),
    (3, None, False, False),
    (2, "swish", False, True),
]


# --------------------------------------------------------------------------- tests
@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("W, activation, bias, cache", CASES)
def test_conv_matches_float64(device, seed, dtype, W, activation, bias, cache):
    gen = generator(seed)
    B, D = 2, 20
    T = odd_length(gen, 65, 140)          # two chunks of 64, the last partial
    x = randn((B, T, D), gen, dtype, device, requires_grad=True)
    w = randn((D, W), gen, dtype, device, 0.5, requires_grad=True)
    b = randn((D,), gen, dtype, device, requires_grad=True) if bias else None
    h0 = randn((B, D, W), gen, dtype, device, requires_grad=True) if cache else None
    compare(x, w, b, h0, activation, None, gen, TOLERANCE[dtype])


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_conv_varlen(device, seed, dtype):
    """Uneven packed sequences, some shorter than the kernel: no leakage, each from its
    own cache row, and the final cache of a short sequence keeps old cache columns."""
    gen = generator(seed)
    D, W = 12, 4
    lengths = uneven_lengths(3, gen, 1, 80)
    lengths[1] = 1 + int(torch.randint(0, 2, (1,), generator=gen))      # 1 or 2 < W
    x = randn((1, sum(lengths), D), gen, dtype, device, requires_grad=True)
    w = randn((D, W), gen, dtype, device, 0.5, requires_grad=True)
    b = randn((D,), gen, dtype, device, requires_grad=True)
    h0 = randn((len(lengths), D, W), gen, dtype, device, requires_grad=True)
    cu = cu_seqlens_of(lengths, device).to(torch.int32)
    compare(x, w, b, h0, "silu", lengths, gen, TOLERANCE[dtype], cu_seqlens=cu)
    compare(x, w, None, None, None, lengths, gen, TOLERANCE[dtype], cu_seqlens=cu)


@pytest.mark.interpret
def test_conv_module_weight_layout(device, seed):
    """The module's [D, 1, W] weight, its grads, and no cache returned unless asked."""
    gen = generator(seed)
    conv = ShortConvolution(16, 4, bias=True).to(device)
    x = randn((2, 9, 16), gen, torch.float32, device, requires_grad=True)
    y, ht = conv(x)
    assert ht is None
    y_ref, _ = conv_ref(x.detach(), conv.weight.detach(), conv.bias.detach(), None, "silu")
    assert_rel_close("y", y, y_ref, 1e-4)
    y.sum().backward()
    assert conv.weight.grad.shape == (16, 1, 4) and conv.bias.grad.shape == (16,)
    assert torch.isfinite(conv.weight.grad).all() and torch.isfinite(x.grad).all()


@pytest.mark.interpret
@pytest.mark.parametrize("varlen", [False, True])
def test_conv_decode_equals_full(device, seed, varlen):
    """Prefill a prefix (final cache), then one token per call: every step gives the
    full-sequence output and the cache it should hold."""
    gen = generator(seed)
    D, W, N = 24, 4, 3
    conv = ShortConvolution(D, W, bias=True).to(device)
    lengths = [5, 2, 7] if varlen else [7, 7, 7]
    steps = 4
    x_full = [randn((L + steps, D), gen, torch.float32, device) for L in lengths]
    with torch.no_grad():
        if varlen:
            x_pre = torch.cat([s[:L] for s, L in zip(x_full, lengths)])[None]
            y_pre, cache = conv(x_pre, output_final_state=True,
                                cu_seqlens=cu_seqlens_of(lengths, device))
        else:
            x_pre = torch.stack([s[:L] for s, L in zip(x_full, lengths)])
            y_pre, cache = conv(x_pre, output_final_state=True)
        refs = [conv_ref(s[None], conv.weight, conv.bias, None, "silu") for s in x_full]
        for t in range(steps):
            tok = torch.stack([s[L + t] for s, L in zip(x_full, lengths)])       # [N, D]
            if varlen:
                y_t, new = conv(tok[None], cache=cache, output_final_state=True,
                                cu_seqlens=torch.arange(N + 1, device=device))
                y_t = y_t[0]
            else:
                y_t, new = conv(tok[:, None], cache=cache, output_final_state=True)
                y_t = y_t[:, 0]
            assert new is cache                         # updated in place
            for n, (L, (y_ref, _)) in enumerate(zip(lengths, refs)):
                assert_rel_close(f"y[{n}, step {t}]", y_t[n], y_ref[0, L + t], 1e-5)
                seq = x_full[n][:L + t + 1]
                expected = torch.cat([torch.zeros(W, D, device=device), seq])[-W:].T
                torch.testing.assert_close(cache[n], expected, rtol=0, atol=0)


@pytest.mark.interpret
def test_conv_step_function_and_strided_cache(device, seed):
    gen = generator(seed)
    N, D, W = 3, 40, 3
    w = randn((D, W), gen, torch.float16, device)
    x = randn((N, D), gen, torch.float16, device)
    state = randn((N, 2, D, W), gen, torch.float16, device)
    cache = state[:, 1]                                 # a strided view into a bigger state
    before = cache.clone()
    y, out = causal_conv1d_update(x, cache, w, activation=None)
    assert out is cache
    expected_cache = torch.cat([before[:, :, 1:], x[:, :, None]], dim=-1)
    torch.testing.assert_close(state[:, 1], expected_cache, rtol=0, atol=0)
    ref = (expected_cache.double() * w.double()).sum(-1)
    assert_rel_close("y", y, ref, 5e-3)


@pytest.mark.interpret
def test_conv_chunked_prefill_equals_one_call(device, seed):
    gen = generator(seed)
    B, D, W = 2, 8, 4
    T = odd_length(gen, 10, 90)
    split = int(torch.randint(1, T, (1,), generator=gen))
    x = randn((B, T, D), gen, torch.float32, device)
    w = randn((D, W), gen, torch.float32, device)
    y, ht = causal_conv1d(x, w, activation="silu", output_final_state=True)
    y1, h1 = causal_conv1d(x[:, :split], w, activation="silu", output_final_state=True)
    y2, h2 = causal_conv1d(x[:, split:], w, activation="silu", initial_state=h1,
                           output_final_state=True)
    assert_rel_close("y", torch.cat([y1, y2], 1), y, 1e-6)
    torch.testing.assert_close(h2, ht, rtol=0, atol=0)


def test_conv_torch_path(monkeypatch, seed):
    monkeypatch.setenv("FLA_BACKEND", "torch")
    gen = generator(seed)
    D, W = 10, 4
    x = randn((2, odd_length(gen, 5, 60), D), gen, torch.float16, requires_grad=True)
    w = randn((D, W), gen, torch.float16, scale=0.5, requires_grad=True)
    b = randn((D,), gen, torch.float16, requires_grad=True)
    h0 = randn((2, D, W), gen, torch.float16, requires_grad=True)
    compare(x, w, b, h0, "silu", None, gen, 5e-3)
    lengths = uneven_lengths(3, gen, 1, 40)
    xv = randn((1, sum(lengths), D), gen, torch.float32, requires_grad=True)
    wv = randn((D, W), gen, torch.float32, requires_grad=True)
    h0v = randn((3, D, W), gen, torch.float32, requires_grad=True)
    compare(xv, wv, None, h0v, None, lengths, gen, 1e-4, cu_seqlens=cu_seqlens_of(lengths))
    # The decode step on the PyTorch path.
    cache = randn((2, D, W), gen, torch.float32)
    tok = randn((2, D), gen, torch.float32)
    y, _ = causal_conv1d_update(tok, cache.clone(), wv.detach(), activation="silu")
    y_ref, _ = conv_ref(tok[:, None], wv.detach(), None, cache, "silu")
    assert_rel_close("step y", y, y_ref[:, 0], 1e-5)


def test_conv_errors():
    conv = ShortConvolution(8, 4)
    x = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match=r"x: expected a 3-D tensor"):
        conv(torch.randn(5, 8))
    with pytest.raises(ValueError, match=r"x: expected \[B, T, D\] with D = hidden_size = 8, "
                                         r"got \(2, 5, 6\)"):
        conv(torch.randn(2, 5, 6))
    with pytest.raises(ValueError, match=r"weight: expected shape \[D, W\] = \[6, W\]"):
        causal_conv1d(torch.randn(2, 5, 6), conv.weight)
    with pytest.raises(ValueError, match=r"cache: expected shape \[N, D, W\] = "
                                         r"\[2, 8, 4\].*got \(2, 8, 3\)"):
        conv(x, cache=torch.randn(2, 8, 3))
    with pytest.raises(ValueError, match="cu_seqlens: packed sequences need the batch size"):
        conv(x, cu_seqlens=torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match=r"cache: expected shape \[N, D, W\] = "
                                         r"\[3, 8, 4\]"):
        conv(torch.randn(1, 9, 8), cache=torch.randn(1, 8, 4),
             cu_seqlens=torch.tensor([0, 2, 5, 9]))
    with pytest.raises(ValueError, match="activation: expected one of"):
        ShortConvolution(8, 4, activation="gelu")
    with pytest.raises(ValueError, match=r"cache: expected shape \[N, D, W\] = \[2, 8, 4\]"):
        causal_conv1d_update(torch.randn(2, 8), torch.randn(3, 8, 4), torch.randn(8, 4))


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["silu", None])
def test_conv_bf16_gpu(seed, activation):
    gen = generator(seed)
    B, T, D, W = 4, 2049, 2048, 4
    x = randn((B, T, D), gen, torch.bfloat16, "cuda", requires_grad=True)
    w = randn((D, W), gen, torch.bfloat16, "cuda", 0.5, requires_grad=True)
    b = randn((D,), gen, torch.bfloat16, "cuda", requires_grad=True)
    h0 = randn((B, D, W), gen, torch.bfloat16, "cuda", requires_grad=True)
    compare(x, w, b, h0, activation, None, gen, 5e-3)
    lengths = uneven_lengths(6, gen, 1, 1500)
    lengths[2] = 2
    xv = randn((1, sum(lengths), D), gen, torch.bfloat16, "cuda", requires_grad=True)
    h0v = randn((6, D, W), gen, torch.bfloat16, "cuda", requires_grad=True)
    compare(xv, w, b, h0v, activation, lengths, gen, 5e-3,
            cu_seqlens=cu_seqlens_of(lengths, "cuda").to(torch.int32))


@pytest.mark.gpu
def test_conv_decode_bf16_gpu(seed):
    gen = generator(seed)
    N, D, W, L = 64, 4096, 4, 37
    conv = ShortConvolution(D, W, bias=True).to("cuda", torch.bfloat16)
    x = randn((N, L + 3, D), gen, torch.bfloat16, "cuda")
    with torch.no_grad():
        y_full, _ = conv(x)
        _, cache = conv(x[:, :L], output_final_state=True)
        for t in range(L, L + 3):
            y_t, cache = conv(x[:, t:t + 1], cache=cache, output_final_state=True)
            assert_rel_close(f"step {t}", y_t, y_full[:, t:t + 1], 5e-3)


@pytest.mark.gpu
def test_conv_new_length_no_recompile_gpu(seed):
    from fla.modules.convolution import (
        causal_conv1d_bwd_dw_kernel,
        causal_conv1d_bwd_dx_kernel,
        causal_conv1d_fwd_kernel,
    )
    from fla.utils.triton_facts import compiled_kernel_count

    kernels = (causal_conv1d_fwd_kernel, causal_conv1d_bwd_dw_kernel,
               causal_conv1d_bwd_dx_kernel)

    gen = generator(seed)
    w = randn((256, 4), gen, torch.bfloat16, "cuda", requires_grad=True)
    for T in (100, 333, 7):
        x = randn((2, T, 256), gen, torch.bfloat16, "cuda", requires_grad=True)
        y, _ = causal_conv1d(x, w, activation="silu")
        y.sum().backward()
        if T == 100:
            counts = [compiled_kernel_count(k) for k in kernels]
    assert counts == [compiled_kernel_count(k) for k in kernels]
    assert min(counts) > 0
