"""fla.modules.fused_linear_cross_entropy: loss, dx, dW, db against float64
F.cross_entropy(F.linear(x, W, b)).

In the interpreter (fp32, fp16) the row chunking is forced small (num_chunks=3 over 21
rows: chunks of 7, so dW and db accumulate over chunks); the GPU tests run bf16 at
real-ish sizes with the default chunking, and compare peak memory with the unfused path.
"""
import pytest
import torch
import torch.nn.functional as F

from fla.modules.fused_linear_cross_entropy import (
    CHUNK_LOGITS_BYTES,
    FusedLinearCrossEntropyLoss,
    chunk_rows,
    fused_linear_cross_entropy,
)
from tests.helpers import TOLERANCE, assert_rel_close, generator, randn
from tests.modules.test_fused_cross_entropy import IGNORE, make_target, upstream


def make_inputs(shape, H, V, gen, dtype, device, bias=True, n_ignored=3,
                ignore_index=IGNORE):
    x = randn((*shape, H), gen, dtype=dtype, device=device, requires_grad=True)
    weight = randn((V, H), gen, dtype=dtype, device=device, scale=H ** -0.5 * 2,
                   requires_grad=True)
    b = randn((V,), gen, dtype=dtype, device=device, scale=0.5, requires_grad=True) \
        if bias else None
    N = 1
    for d in shape:
        N *= d
    target = make_target(N, V, gen, n_ignored, ignore_index, device).view(shape)
    return x, target, weight, b


def reference(x, target, weight, bias, *, reduction="mean", label_smoothing=0.0,
              logit_scale=1.0, ignore_index=IGNORE):
    """float64 loss of the same values; returns (loss, [x, W, b] float64 leaves)."""
    leaves = [None if t is None else t.detach().to(torch.float64).cpu().requires_grad_()
              for t in (x, weight, bias)]
    x64, w64, b64 = leaves
    z = F.linear(x64.reshape(-1, x64.shape[-1]), w64, b64) * logit_scale
    loss = F.cross_entropy(z, target.cpu().reshape(-1).long(), ignore_index=ignore_index,
                           reduction=reduction, label_smoothing=label_smoothing)
    if reduction == "none":
        loss = loss.view(target.shape)
    return loss, leaves


def check_all(x, target, weight, bias, gen, tol, **options):
    loss = fused_linear_cross_entropy(x, target, weight, bias, **options)
    options.pop("num_chunks", None)
    ref, leaves = reference(x, target, weight, bias, **options)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    assert_rel_close("loss", loss, ref, tol)
    g = upstream(loss, gen)
    loss.backward(g)
    ref.backward(g.to(torch.float64).cpu())
    for name, ours, theirs in zip(("dx", "dW", "db"), (x, weight, bias), leaves):
        if ours is None or not ours.requires_grad:
            continue
        assert ours.grad.dtype == ours.dtype and ours.grad.shape == ours.shape
        assert_rel_close(name, ours.grad, theirs.grad, tol)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("reduction,label_smoothing,bias", [
    ("mean", 0.1, True), ("sum", 0.0, False), ("none", 0.2, True)])
def test_matches_reference_in_chunks(dtype, reduction, label_smoothing, bias, device, seed):
    gen = generator(seed)
    x, target, weight, b = make_inputs((3, 7), 48, 9001, gen, dtype, device, bias=bias)
    check_all(x, target, weight, b, gen, TOLERANCE[dtype], reduction=reduction,
              label_smoothing=label_smoothing, logit_scale=0.9, num_chunks=3)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_chunk_module(dtype, device, seed):
    """The default chunking (one chunk at this size; no fp32 accumulator in fp32), through
    the module with the benchmark's call order crit(x, target, weight)."""
    gen = generator(seed)
    x, target, weight, _ = make_inputs((13,), 40, 1000, gen, dtype, device, bias=False)
    crit = FusedLinearCrossEntropyLoss(label_smoothing=0.05, logit_scale=1.7)
    loss = crit(x, target, weight)
    ref, (x64, w64, _) = reference(x, target, weight, None, label_smoothing=0.05,
                                   logit_scale=1.7)
    assert_rel_close("loss", loss, ref, TOLERANCE[dtype])
    (loss * 3).backward()
    (ref * 3).backward()
    assert_rel_close("dx", x.grad, x64.grad, TOLERANCE[dtype])
    assert_rel_close("dW", weight.grad, w64.grad, TOLERANCE[dtype])


@pytest.mark.interpret
@pytest.mark.parametrize("which", ["x", "weight"])
def test_gradient_of_one_input_only(which, device, seed):
    gen = generator(seed)
    x, target, weight, b = make_inputs((10,), 32, 700, gen, torch.float32, device)
    for name, t in (("x", x), ("weight", weight), ("bias", b)):
        t.requires_grad_(name == which)
    check_all(x, target, weight, b, gen, TOLERANCE[torch.float32], num_chunks=2)
    assert (x.grad is None) == (which != "x")
    assert (weight.grad is None) == (which != "weight")
    assert b.grad is None


@pytest.mark.interpret
def test_no_grad_and_all_ignored(device, seed):
    gen = generator(seed)
    x, target, weight, b = make_inputs((9,), 24, 500, gen, torch.float32, device)
    with torch.no_grad():
        loss = fused_linear_cross_entropy(x, target, weight, b, num_chunks=2)
    assert loss.grad_fn is None
    ref, _ = reference(x, target, weight, b)
    assert_rel_close("loss without grad", loss, ref, TOLERANCE[torch.float32])
    # Like torch: 'mean' over no row is nan (0/0) with zero gradients; 'sum' is 0.
    ignored = torch.full_like(target, IGNORE)
    loss = fused_linear_cross_entropy(x, ignored, weight, b, num_chunks=2)
    assert torch.isnan(loss)
    loss.backward()
    for t in (x, weight, b):
        assert (t.grad == 0).all()
    assert fused_linear_cross_entropy(x, ignored, weight, b, reduction="sum").item() == 0


@pytest.mark.interpret
def test_backward_twice_is_refused(device, seed):
    gen = generator(seed)
    x, target, weight, _ = make_inputs((5,), 16, 300, gen, torch.float32, device, bias=False)
    loss = fused_linear_cross_entropy(x, target, weight)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_chunk_rule():
    # The benchmark's shape: 4 balanced chunks of 4096 rows, 1 GiB of bf16 logits each.
    assert chunk_rows(16384, 128256, 2) == 4096
    for N, V, size in [(16384, 128256, 2), (100_000, 256_000, 2), (5000, 128256, 4),
                       (777, 50_000, 2)]:
        rows = chunk_rows(N, V, size)
        assert 1 <= rows <= N
        assert rows * V * size <= CHUNK_LOGITS_BYTES + 64 * V * size
    assert chunk_rows(4096, 32000, 2) == 4096          # small enough: one chunk
    assert chunk_rows(21, 9001, 2, num_chunks=3) == 7
    assert chunk_rows(5, 10, 4, num_chunks=9) == 1


def test_torch_path(monkeypatch, seed):
    monkeypatch.setenv("FLA_BACKEND", "torch")
    gen = generator(seed)
    x, target, weight, b = make_inputs((2, 5), 16, 301, gen, torch.float32, "cpu")
    check_all(x, target, weight, b, gen, TOLERANCE[torch.float32], reduction="mean",
              label_smoothing=0.1, logit_scale=1.3)


# ---------------------------------------------------------------------------- input checks
@pytest.mark.interpret
def test_bad_target_raises_then_next_call_works(device, seed):
    gen = generator(seed)
    x, target, weight, b = make_inputs((8,), 16, 97, gen, torch.float32, device)
    bad = target.clone()
    bad[5] = 97
    with pytest.raises(ValueError, match=r"max 97.*V = 97"):
        fused_linear_cross_entropy(x, bad, weight, b)
    bad[5] = -1
    with pytest.raises(ValueError, match=r"min -1"):
        fused_linear_cross_entropy(x, bad, weight, b)
    check_all(x, target, weight, b, gen, TOLERANCE[torch.float32])


def test_argument_errors():
    x, W = torch.randn(6, 8), torch.randn(20, 8)
    target = torch.randint(0, 20, (6,))
    with pytest.raises(ValueError, match=r"weight: expected shape \[V, H\] with H = 8"):
        fused_linear_cross_entropy(x, target, torch.randn(20, 9))
    with pytest.raises(ValueError, match=r"bias: expected shape \(20,\)"):
        fused_linear_cross_entropy(x, target, W, torch.randn(21))
    with pytest.raises(TypeError, match="weight: expected the dtype of x"):
        fused_linear_cross_entropy(x, target, W.half())
    with pytest.raises(TypeError, match="target: expected an integer dtype"):
        fused_linear_cross_entropy(x, target.float(), W)
    with pytest.raises(ValueError, match=r"target: expected shape \(6,\).*has N = 6 rows"):
        fused_linear_cross_entropy(x, target[:5], W)
    with pytest.raises(ValueError, match="label_smoothing"):
        FusedLinearCrossEntropyLoss(label_smoothing=1.5)
    with pytest.raises(ValueError, match="reduction"):
        fused_linear_cross_entropy(x, target, W, reduction="batchmean")
    with pytest.raises(ValueError, match="num_chunks"):
        FusedLinearCrossEntropyLoss(num_chunks=0)


# ----------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("reduction,bias", [("mean", False), ("none", True)])
def test_bf16_real_size(reduction, bias, seed):
    gen = generator(seed)
    x, target, weight, b = make_inputs((4096,), 1024, 32000, gen, torch.bfloat16, "cuda",
                                       bias=bias, n_ignored=200)
    check_all(x, target, weight, b, gen, TOLERANCE[torch.bfloat16], reduction=reduction,
              label_smoothing=0.1, num_chunks=3)


@pytest.mark.gpu
def test_peak_memory_below_unfused(seed):
    """16384 tokens, H = 2048, V = 65536 bf16 (2 chunks by default): the fused loss's
    extra memory over fwd + bwd is well below the unfused path's."""
    gen = generator(seed)
    x, target, weight, _ = make_inputs((16384,), 2048, 65536, gen, torch.bfloat16, "cuda",
                                       bias=False, n_ignored=0)

    def extra_memory(step):
        x.grad = weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step().backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        grads = (x.grad.float(), weight.grad.float())
        x.grad = weight.grad = None
        return peak, grads

    unfused, (dx_ref, dw_ref) = extra_memory(
        lambda: F.cross_entropy(F.linear(x, weight).float(), target))
    fused, (dx, dw) = extra_memory(lambda: fused_linear_cross_entropy(x, target, weight))
    print(f"extra memory: fused {fused / 2**30:.2f} GiB, unfused {unfused / 2**30:.2f} GiB")
    assert fused < 0.3 * unfused
    # The same gradients as the unfused bf16 path (itself within bf16 rounding).
    assert_rel_close("dx vs unfused", dx, dx_ref, 1e-2)
    assert_rel_close("dW vs unfused", dw, dw_ref, 1e-2)
