"""fla.modules.fused_cross_entropy: loss and dlogits against float64 F.cross_entropy.

The Triton kernels run in the interpreter without a GPU (fp32, fp16, small N); bf16 at
real sizes on the GPU. V = 9001 takes several BV blocks per row (5 in fp32, 3 in 16-bit)
with a partial last one; V = 1000 fits one partial block.
"""
import pytest
import torch
import torch.nn.functional as F

from fla.modules.fused_cross_entropy import FusedCrossEntropyLoss, cross_entropy_loss
from tests.helpers import TOLERANCE, assert_rel_close, generator, randn

IGNORE = -100


def make_target(N, V, gen, n_ignored, ignore_index=IGNORE, device="cpu"):
    """Random ids with both ends of the vocabulary present and ``n_ignored`` rows
    ignored (never row 0 or 1)."""
    t = torch.randint(0, V, (N,), generator=gen)
    t[0], t[1] = V - 1, 0
    if n_ignored:
        rows = 2 + torch.randperm(N - 2, generator=gen)[:n_ignored]
        t[rows] = ignore_index
    return t.to(device)


def reference(logits, target, *, reduction="mean", label_smoothing=0.0, logit_scale=1.0,
              ignore_index=IGNORE):
    """float64 torch loss of the same values; returns (loss, float64 leaf logits)."""
    z = logits.detach().to(torch.float64).cpu().requires_grad_()
    loss = F.cross_entropy((z * logit_scale).reshape(-1, z.shape[-1]),
                           target.cpu().reshape(-1).long(), ignore_index=ignore_index,
                           reduction=reduction, label_smoothing=label_smoothing)
    if reduction == "none":
        loss = loss.view(target.shape)
    return loss, z


def upstream(loss, gen):
    """A gradient ≠ 1: 3 for a scalar loss, random weights for per-row losses."""
    if loss.dim() == 0:
        return torch.tensor(3.0, dtype=loss.dtype, device=loss.device)
    return torch.rand(loss.shape, generator=gen, dtype=torch.float64).to(loss.device,
                                                                          loss.dtype)


def check_against_reference(logits, target, gen, tol, **options):
    loss = cross_entropy_loss(logits, target, **options)
    ref, z = reference(logits, target, **options)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    assert_rel_close("loss", loss, ref, tol)
    g = upstream(loss, gen)
    loss.backward(g)
    ref.backward(g.to(torch.float64).cpu())
    assert logits.grad.dtype == logits.dtype
    assert_rel_close("dlogits", logits.grad, z.grad, tol)


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("reduction,label_smoothing", [
    ("mean", 0.0), ("mean", 0.1), ("sum", 0.0), ("none", 0.2)])
def test_matches_reference(dtype, reduction, label_smoothing, device, seed):
    gen = generator(seed)
    N, V = 11, 9001
    logits = randn((N, V), gen, dtype=dtype, device=device, scale=2.0, requires_grad=True)
    target = make_target(N, V, gen, n_ignored=3, device=device)
    check_against_reference(logits, target, gen, TOLERANCE[dtype], reduction=reduction,
                            label_smoothing=label_smoothing, logit_scale=0.8)


@pytest.mark.interpret
def test_single_block_scaled_leading_dims_module(device, seed):
    """V = 1000 (one masked block), logits [B, T, V], a logit scale and the module."""
    gen = generator(seed)
    B, T, V = 2, 5, 1000
    logits = randn((B, T, V), gen, device=device, requires_grad=True)
    target = make_target(B * T, V, gen, n_ignored=2, ignore_index=7, device=device)
    target = target.view(B, T)
    crit = FusedCrossEntropyLoss(ignore_index=7, reduction="none", label_smoothing=0.05,
                                 logit_scale=2.5)
    loss = crit(logits, target)
    ref, z = reference(logits, target, reduction="none", label_smoothing=0.05,
                       logit_scale=2.5, ignore_index=7)
    assert loss.shape == (B, T)
    assert_rel_close("loss", loss, ref, TOLERANCE[torch.float32])
    loss.sum().backward()     # an expanded (stride-0) gradient per row
    ref.sum().backward()
    assert_rel_close("dlogits", logits.grad, z.grad, TOLERANCE[torch.float32])


@pytest.mark.interpret
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_rows_ignored(reduction, device, seed):
    """Like torch: 'mean' over no row is nan (0/0), 'sum' is 0; the gradient is 0."""
    gen = generator(seed)
    N, V = 5, 333
    logits = randn((N, V), gen, device=device, requires_grad=True)
    target = torch.full((N,), IGNORE, device=device)
    loss = cross_entropy_loss(logits, target, reduction=reduction, label_smoothing=0.1)
    ref, _ = reference(logits, target, reduction=reduction, label_smoothing=0.1)
    if reduction == "mean":
        assert torch.isnan(loss) and torch.isnan(ref)
    else:
        assert (loss == 0).all()
    loss.sum().backward()
    assert (logits.grad == 0).all()


@pytest.mark.interpret
def test_without_grad(device, seed):
    gen = generator(seed)
    N, V = 7, 2500
    logits = randn((N, V), gen, device=device)
    target = make_target(N, V, gen, n_ignored=1, device=device)
    loss = cross_entropy_loss(logits, target, label_smoothing=0.3)
    ref, _ = reference(logits, target, label_smoothing=0.3)
    assert_rel_close("loss", loss, ref, TOLERANCE[torch.float32])
    with torch.no_grad():
        logits.requires_grad_()
        assert cross_entropy_loss(logits, target).grad_fn is None


def test_torch_path(monkeypatch, seed):
    """FLA_BACKEND=torch: the PyTorch path, same results."""
    monkeypatch.setenv("FLA_BACKEND", "torch")
    gen = generator(seed)
    N, V = 9, 777
    logits = randn((N, V), gen, requires_grad=True)
    target = make_target(N, V, gen, n_ignored=2)
    check_against_reference(logits, target, gen, TOLERANCE[torch.float32],
                            reduction="mean", label_smoothing=0.1, logit_scale=1.5)
    with pytest.raises(ValueError, match="V = 777"):
        cross_entropy_loss(logits, torch.full((N,), 777))


# ---------------------------------------------------------------------------- input checks
@pytest.mark.interpret
def test_bad_target_raises_then_next_call_works(device, seed):
    gen = generator(seed)
    N, V = 6, 50
    logits = randn((N, V), gen, device=device, requires_grad=True)
    target = make_target(N, V, gen, n_ignored=1, device=device)
    too_big = target.clone()
    too_big[3] = V + 4
    with pytest.raises(ValueError, match=r"V = 50.*max 54|max 54.*V = 50"):
        cross_entropy_loss(logits, too_big)
    negative = target.clone()
    negative[2] = -3
    with pytest.raises(ValueError, match=r"min -3"):
        cross_entropy_loss(logits, negative)
    # ignore_index itself is allowed anywhere, also inside [0, V).
    loss = cross_entropy_loss(logits, target)
    loss.backward()
    ref, z = reference(logits, target)
    ref.backward()
    assert_rel_close("loss after a refused call", loss, ref, TOLERANCE[torch.float32])
    assert_rel_close("dlogits after a refused call", logits.grad, z.grad,
                     TOLERANCE[torch.float32])


def test_argument_errors():
    logits = torch.randn(4, 10)
    target = torch.tensor([1, 2, 3, 4])
    with pytest.raises(TypeError, match="target: expected an integer dtype"):
        cross_entropy_loss(logits, target.float())
    with pytest.raises(ValueError, match=r"target: expected shape \(4,\).*5 ids"):
        cross_entropy_loss(logits, torch.tensor([1, 2, 3, 4, 5]))
    with pytest.raises(ValueError, match=r"label_smoothing: expected a float in \[0, 1\)"):
        cross_entropy_loss(logits, target, label_smoothing=1.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        FusedCrossEntropyLoss(label_smoothing=-0.1)
    with pytest.raises(ValueError, match="reduction: expected one of 'mean', 'sum', 'none'"):
        FusedCrossEntropyLoss(reduction="avg")
    with pytest.raises(TypeError, match="logits: expected dtype"):
        cross_entropy_loss(logits.long(), target)
    with pytest.raises(ValueError, match="logit_scale"):
        cross_entropy_loss(logits, target, logit_scale=float("inf"))


# ----------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("reduction,label_smoothing", [("mean", 0.0), ("none", 0.1)])
def test_bf16_real_size(reduction, label_smoothing, seed):
    gen = generator(seed)
    N, V = 4096, 32000
    logits = randn((N, V), gen, dtype=torch.bfloat16, device="cuda", scale=2.0,
                   requires_grad=True)
    target = make_target(N, V, gen, n_ignored=100, device="cuda")
    check_against_reference(logits, target, gen, TOLERANCE[torch.bfloat16],
                            reduction=reduction, label_smoothing=label_smoothing)
