"""RotaryEmbedding / rotary_embedding against an explicit float64 rotation."""
from __future__ import annotations

import pytest
import torch

from fla.modules.rotary import RotaryEmbedding, rotary_embedding
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
def rotate_ref(x: torch.Tensor, positions: torch.Tensor, dim: int, base: float = 10000.0,
               interleaved: bool = False) -> torch.Tensor:
    """x ``[B, T, H, D]`` rotated in float64; positions ``[B, T]`` (any integers)."""
    x = x.detach().to(torch.float64).cpu()
    R = dim // 2
    inv = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    theta = positions.to(torch.float64).cpu()[..., None] * inv          # [B, T, R]
    cos, sin = theta.cos()[:, :, None], theta.sin()[:, :, None]
    y = x.clone()
    if interleaved:
        i1, i2 = torch.arange(0, dim, 2), torch.arange(1, dim, 2)
    else:
        i1, i2 = torch.arange(R), torch.arange(R, dim)
    x1, x2 = x[..., i1], x[..., i2]
    y[..., i1] = x1 * cos - x2 * sin
    y[..., i2] = x2 * cos + x1 * sin
    return y


def positions_of(B: int, T: int, offsets=0, lengths=None) -> torch.Tensor:
    """``[B, T]`` token positions: offset + index, restarting per packed sequence."""
    if lengths is None:
        off = torch.as_tensor(offsets).reshape(-1, 1).expand(B, 1).cpu()
        return off + torch.arange(T)[None]
    off = torch.as_tensor(offsets).reshape(-1).expand(len(lengths)).cpu()
    return torch.cat([o + torch.arange(L) for o, L in zip(off.tolist(), lengths)])[None]


def check_grads(pairs, tol):
    for name, out, ref in pairs:
        assert_rel_close(name, out, ref, tol)


def run_and_compare(rope, q, k, pos, gen, tol, **kwargs):
    """Forward + backward of ``rope`` against the float64 rotation (the gradient of a
    rotation is the rotation by −θ: its reference is rotate_ref at −positions)."""
    q_rot, k_rot = rope(q, k, **kwargs)
    assert q_rot.dtype == q.dtype and k_rot.dtype == k.dtype
    assert_rel_close("q_rot", q_rot, rotate_ref(q, pos, rope.dim, rope.base, rope.interleaved), tol)
    assert_rel_close("k_rot", k_rot, rotate_ref(k, pos, rope.dim, rope.base, rope.interleaved), tol)
    dq_out = randn(q_rot.shape, gen, q.dtype, q.device)
    dk_out = randn(k_rot.shape, gen, k.dtype, k.device)
    dq, dk = torch.autograd.grad((q_rot, k_rot), (q, k), (dq_out, dk_out))
    check_grads([
        ("dq", dq, rotate_ref(dq_out, -pos, rope.dim, rope.base, rope.interleaved)),
        ("dk", dk, rotate_ref(dk_out, -pos, rope.dim, rope.base, rope.interleaved)),
    ], tol)


# --------------------------------------------------------------------------- tests
@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("partial", [False, True])
def test_rotary_matches_float64(device, seed, dtype, interleaved, partial):
    gen = generator(seed)
    B, H, HK, D = 2, 3, 2, 32
    T = odd_length(gen, 5, 70, chunk=32)
    dim = 20 if partial else D
    offset = int(torch.randint(0, 50, (1,), generator=gen))
    q = randn((B, T, H, D), gen, dtype, device, requires_grad=True)
    k = randn((B, T, HK, D), gen, dtype, device, requires_grad=True)
    rope = RotaryEmbedding(dim, interleaved=interleaved)
    run_and_compare(rope, q, k, positions_of(B, T, offset), gen, TOLERANCE[dtype],
                    seqlen_offset=offset)


@pytest.mark.interpret
@pytest.mark.parametrize("max_seqlen", [None, 512])
def test_rotary_tensor_offsets(device, seed, max_seqlen):
    gen = generator(seed)
    B, T, H, D = 3, odd_length(gen, 3, 40, chunk=32), 2, 16
    offsets = torch.randint(0, 300, (B,), generator=gen)
    q = randn((B, T, H, D), gen, torch.float32, device, requires_grad=True)
    k = randn((B, T, H, D), gen, torch.float32, device, requires_grad=True)
    rope = RotaryEmbedding(D)
    run_and_compare(rope, q, k, positions_of(B, T, offsets), gen, 1e-4,
                    seqlen_offset=offsets.to(device), max_seqlen=max_seqlen)
    if max_seqlen is not None:
        assert rope.cos_sin(1, torch.device(device))[0].shape[0] >= max_seqlen


@pytest.mark.interpret
@pytest.mark.parametrize("per_sequence_offsets", [False, True])
def test_rotary_varlen(device, seed, per_sequence_offsets):
    gen = generator(seed)
    lengths = uneven_lengths(4, gen, 1, 50, chunk=32)
    T, H, D = sum(lengths), 2, 16
    cu = cu_seqlens_of(lengths, device).to(torch.int32)
    if per_sequence_offsets:
        offsets = torch.randint(0, 100, (len(lengths),), generator=gen)
        offset_arg = offsets.to(device)
    else:
        offsets = offset_arg = int(torch.randint(0, 100, (1,), generator=gen))
    q = randn((1, T, H, D), gen, torch.float16, device, requires_grad=True)
    k = randn((1, T, 1, D), gen, torch.float16, device, requires_grad=True)
    rope = RotaryEmbedding(D, interleaved=bool(seed % 2))
    run_and_compare(rope, q, k, positions_of(1, T, offsets, lengths), gen, 5e-3,
                    seqlen_offset=offset_arg, cu_seqlens=cu)


@pytest.mark.interpret
def test_rotary_decode_equals_full(device, seed):
    gen = generator(seed)
    B, T, H, D = 2, 9, 2, 16
    prefix = 4
    q = randn((B, T, H, D), gen, torch.float32, device)
    k = randn((B, T, H, D), gen, torch.float32, device)
    rope = RotaryEmbedding(12)
    q_full, k_full = rope(q, k)
    q_pre, k_pre = rope(q[:, :prefix], k[:, :prefix])
    torch.testing.assert_close(q_pre, q_full[:, :prefix], rtol=0, atol=0)
    torch.testing.assert_close(k_pre, k_full[:, :prefix], rtol=0, atol=0)
    for t in range(prefix, T):
        # An int offset and a per-row tensor offset must give the same token.
        q_t, k_t = rope(q[:, t:t + 1], k[:, t:t + 1], seqlen_offset=t)
        torch.testing.assert_close(q_t, q_full[:, t:t + 1], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(k_t, k_full[:, t:t + 1], rtol=1e-6, atol=1e-6)
        offs = torch.full((B,), t, dtype=torch.long, device=device)
        q_t, k_t = rope(q[:, t:t + 1], k[:, t:t + 1], seqlen_offset=offs)
        torch.testing.assert_close(q_t, q_full[:, t:t + 1], rtol=1e-6, atol=1e-6)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotary_functional(device, seed, dtype):
    gen = generator(seed)
    B, T, H, D, dim = 2, odd_length(gen, 3, 40, chunk=32), 2, 24, 16
    rope = RotaryEmbedding(dim, interleaved=True)
    cos, sin = rope.cos_sin(T + 7, torch.device(device))
    x = randn((B, T, H, D), gen, dtype, device, requires_grad=True)
    offsets = torch.tensor([0, 5], device=device)
    y = rotary_embedding(x, cos, sin, interleaved=True, seqlen_offsets=offsets)
    pos = positions_of(B, T, offsets)
    assert_rel_close("y", y, rotate_ref(x, pos, dim, interleaved=True), TOLERANCE[dtype])
    dy = randn(y.shape, gen, dtype, device)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert_rel_close("dx", dx, rotate_ref(dy, -pos, dim, interleaved=True), TOLERANCE[dtype])
    with pytest.raises(ValueError, match=r"L = \d+ positions"):
        rotary_embedding(x, cos[:T], sin[:T], seqlen_offsets=3)


@pytest.mark.interpret
def test_rotary_noncontiguous_input(device, seed):
    """q, k as slices of one fused projection: token stride larger than H·D."""
    gen = generator(seed)
    B, T, H, D = 2, 11, 2, 16
    qkv = randn((B, T, 3 * H * D), gen, torch.float32, device)
    q = qkv[..., :H * D].view(B, T, H, D)
    k = qkv[..., H * D:2 * H * D].view(B, T, H, D)
    rope = RotaryEmbedding(D)
    q_rot, k_rot = rope(q, k, seqlen_offset=2)
    pos = positions_of(B, T, 2)
    assert_rel_close("q_rot", q_rot, rotate_ref(q, pos, D), 1e-4)
    assert_rel_close("k_rot", k_rot, rotate_ref(k, pos, D), 1e-4)


def test_rotary_torch_path(monkeypatch, seed):
    monkeypatch.setenv("FLA_BACKEND", "torch")
    gen = generator(seed)
    B, H, D = 2, 3, 16
    T = odd_length(gen, 5, 60, chunk=32)
    q = randn((B, T, H, D), gen, torch.float16, requires_grad=True)
    k = randn((B, T, 1, D), gen, torch.float16, requires_grad=True)
    rope = RotaryEmbedding(10, interleaved=True)
    run_and_compare(rope, q, k, positions_of(B, T, 3), gen, 5e-3, seqlen_offset=3)
    offsets = torch.tensor([4, 1])
    run_and_compare(rope, q, k, positions_of(B, T, offsets), gen, 5e-3, seqlen_offset=offsets)
    lengths = uneven_lengths(3, gen, 1, 30, chunk=32)
    qv = randn((1, sum(lengths), H, D), gen, torch.float32, requires_grad=True)
    kv = randn((1, sum(lengths), H, D), gen, torch.float32, requires_grad=True)
    run_and_compare(rope, qv, kv, positions_of(1, sum(lengths), 5, lengths), gen, 1e-4,
                    seqlen_offset=5, cu_seqlens=cu_seqlens_of(lengths))


def test_rotary_tables_stay_float32():
    rope = RotaryEmbedding(8, base=500.0).to(torch.bfloat16)
    cos, sin = rope.cos_sin(100, torch.device("cpu"))
    assert cos.dtype == sin.dtype == torch.float32
    assert cos.shape == (128, 4)                       # grown to a power of two
    assert rope.cos_sin(128, torch.device("cpu"))[0] is cos   # reused, not rebuilt
    theta = torch.arange(128, dtype=torch.float64)[:, None] * 500.0 ** (
        -torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    assert_rel_close("cos", cos, theta.cos(), 1e-5)


def test_rotary_errors():
    rope = RotaryEmbedding(2048)
    q = torch.randn(1, 8, 4, 64)
    with pytest.raises(ValueError, match=r"RotaryEmbedding\(dim=2048\) is wider than the "
                                         r"head dim 64 of q"):
        rope(q, q)
    with pytest.raises(ValueError, match="even int"):
        RotaryEmbedding(7)
    rope = RotaryEmbedding(16)
    with pytest.raises(ValueError, match="q: expected a 4-D tensor"):
        rope(torch.randn(8, 4, 16), torch.randn(1, 8, 4, 16))
    with pytest.raises(ValueError, match="k: expected a 4-D tensor"):
        rope(torch.randn(1, 8, 4, 16), torch.randn(8, 4, 16))
    with pytest.raises(ValueError, match="k: head dim 32 differs from the head dim 16 of q"):
        rope(torch.randn(1, 8, 4, 16), torch.randn(1, 8, 4, 32))
    with pytest.raises(ValueError, match=r"k: expected shape .*T is 9 here but 8 in q"):
        rope(torch.randn(1, 8, 4, 16), torch.randn(1, 9, 4, 16))
    with pytest.raises(ValueError, match=r"looks like a \[B, H, T, \.\.\.\] tensor"):
        x = torch.randn(1, 4, 300, 16)          # [B, H, T, D] passed as [B, T, H, D]
        rope(x, x)
    x = torch.randn(2, 8, 4, 16)
    with pytest.raises(ValueError, match=r"seqlen_offset: expected shape \[B\] = \[2\]"):
        rope(x, x, seqlen_offset=torch.tensor([1, 2, 3]))
    with pytest.raises(TypeError, match="seqlen_offset: expected an int32/int64 tensor"):
        rope(x, x, seqlen_offset=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="seqlen_offset: expected a position offset >= 0"):
        rope(x, x, seqlen_offset=-1)
    with pytest.raises(ValueError, match="cu_seqlens: packed sequences need the batch size "
                                         "B == 1.*B = 2"):
        rope(x, x, cu_seqlens=torch.tensor([0, 3, 8]))
    xv = torch.randn(1, 8, 4, 16)
    with pytest.raises(ValueError, match=r"seqlen_offset: expected shape \[N\] = \[2\]"):
        rope(xv, xv, seqlen_offset=torch.tensor([1]), cu_seqlens=torch.tensor([0, 3, 8]))
    with pytest.raises(ValueError, match="cu_seqlens: expected the last offset"):
        rope(xv, xv, cu_seqlens=torch.tensor([0, 3, 7]))


def _compile_case(rope, q, k, **kwargs):
    def f(q, k):
        q_rot, k_rot = rope(q, k, **kwargs)
        return q_rot * 2, k_rot
    return f


@pytest.mark.interpret
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_rotary_compiles_fullgraph(monkeypatch, device, seed, backend):
    """torch.compile(fullgraph=True) traces through (the custom op on the Triton path)
    and gives the eager values and gradients."""
    import fla.modules.rotary as rotary

    monkeypatch.setenv("FLA_BACKEND", backend)
    torch._dynamo.reset()
    launches = []
    real = rotary._rotary_apply_triton
    monkeypatch.setattr(rotary, "_rotary_apply_triton",
                        lambda *a: launches.append(1) or real(*a))
    gen = generator(seed)
    B, T, H, D = 2, 13, 2, 16
    q = randn((B, T, H, D), gen, device=device, requires_grad=True)
    k = randn((B, T, 1, D), gen, device=device, requires_grad=True)
    lengths = [5, 8]
    cases = [
        ({"seqlen_offset": 3}, B),
        ({"seqlen_offset": torch.tensor([2, 7], device=device)}, B),
        ({"cu_seqlens": cu_seqlens_of(lengths, device), "seqlen_offset": 1}, 1),
    ]
    for kwargs, rows in cases:
        rope = RotaryEmbedding(12)
        f = _compile_case(rope, q, k, **kwargs)
        compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
        qi, ki = q[:rows], k[:rows]
        out = compiled(qi, ki)
        ref = f(qi, ki)
        grads = torch.autograd.grad(out, (q, k), (torch.ones_like(out[0]), out[1].detach()))
        ref_grads = torch.autograd.grad(ref, (q, k), (torch.ones_like(ref[0]), ref[1].detach()))
        for a, b in zip((*out, *grads), (*ref, *ref_grads)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # The kernel ran (behind fla::rotary_apply) exactly when the Triton path was chosen.
    assert bool(launches) == (backend == "triton")


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_bf16_gpu(seed, interleaved):
    gen = generator(seed)
    B, T, H, HK, D = 4, 2049, 32, 8, 128
    q = randn((B, T, H, D), gen, torch.bfloat16, "cuda", requires_grad=True)
    k = randn((B, T, HK, D), gen, torch.bfloat16, "cuda", requires_grad=True)
    offsets = torch.randint(0, 2048, (B,), generator=gen)
    rope = RotaryEmbedding(D, interleaved=interleaved)
    run_and_compare(rope, q, k, positions_of(B, T, 100), gen, 5e-3, seqlen_offset=100)
    run_and_compare(rope, q, k, positions_of(B, T, offsets), gen, 5e-3,
                    seqlen_offset=offsets.cuda(), max_seqlen=4200)
    lengths = uneven_lengths(8, gen, 1, 1500)
    qv = randn((1, sum(lengths), H, D), gen, torch.bfloat16, "cuda", requires_grad=True)
    kv = randn((1, sum(lengths), HK, D), gen, torch.bfloat16, "cuda", requires_grad=True)
    run_and_compare(RotaryEmbedding(64, interleaved=interleaved), qv, kv,
                    positions_of(1, sum(lengths), 0, lengths), gen, 5e-3,
                    cu_seqlens=cu_seqlens_of(lengths, "cuda"))


@pytest.mark.gpu
def test_rotary_compile_default_backend_gpu(seed):
    torch._dynamo.reset()
    gen = generator(seed)
    B, T, H, HK, D = 2, 777, 16, 4, 128
    q = randn((B, T, H, D), gen, torch.bfloat16, "cuda", requires_grad=True)
    k = randn((B, T, HK, D), gen, torch.bfloat16, "cuda", requires_grad=True)
    offsets = torch.tensor([3, 40], device="cuda")
    for kwargs in ({"seqlen_offset": 5}, {"seqlen_offset": offsets, "max_seqlen": 1024}):
        rope = RotaryEmbedding(D)
        f = _compile_case(rope, q, k, **kwargs)
        compiled = torch.compile(f, fullgraph=True)
        out, ref = compiled(q, k), f(q, k)
        dq = randn(q.shape, gen, torch.bfloat16, "cuda")
        dk = randn(k.shape, gen, torch.bfloat16, "cuda")
        grads = torch.autograd.grad(out, (q, k), (dq, dk))
        ref_grads = torch.autograd.grad(ref, (q, k), (dq, dk))
        # Inductor computes the per-token cos/sin tables with its own fp32 cos and sin
        # (an ulp apart from eager's), which moves a few bf16 roundings by one ulp.
        for name, a, b in zip(["q_rot", "k_rot", "dq", "dk"], (*out, *grads),
                              (*ref, *ref_grads)):
            assert_rel_close(name, a, b, 1e-3)


@pytest.mark.gpu
def test_rotary_new_length_no_recompile_gpu(seed):
    from fla.modules.rotary import rotary_embedding_kernel
    from fla.utils.triton_facts import compiled_kernel_count

    gen = generator(seed)
    rope = RotaryEmbedding(128)
    for T in (100, 333, 1):
        q = randn((2, T, 8, 128), gen, torch.bfloat16, "cuda")
        rope(q, q, seqlen_offset=T)
        if T == 100:
            count = compiled_kernel_count(rotary_embedding_kernel)
    assert compiled_kernel_count(rotary_embedding_kernel) == count > 0
