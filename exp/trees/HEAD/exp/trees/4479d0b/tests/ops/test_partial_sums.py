"""fla.ops.utils.partial_sums: the one-launch sum of per-program partial gradients
against float64 sums, for one and two outputs, P and widths that are not multiples of
the kernel's blocks, and every parameter dtype."""
from __future__ import annotations

import pytest
import torch

from fla.ops.utils.partial_sums import sum_partial_pair, sum_partials
from tests.helpers import TOLERANCE, assert_rel_close, assert_rounded_once, generator, randn

pytestmark = pytest.mark.interpret


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("P, shape", [(1, (7,)), (67, (130,)), (264, (48, 4)), (5, (1,))])
def test_one_gradient(P, shape, dtype, device, seed):
    gen = generator(seed)
    parts = randn((P, *shape), gen, torch.float32, device)
    like = torch.empty(shape, dtype=dtype, device=device)
    out = sum_partials(parts, like)
    assert out.shape == like.shape and out.dtype == dtype
    if dtype == torch.float32:
        assert_rel_close("sum", out, parts.double().sum(0), TOLERANCE[dtype])
    else:
        assert_sum_rounded_once(out, parts)


def assert_sum_rounded_once(out: torch.Tensor, parts: torch.Tensor) -> None:
    """Each element of a 16-bit ``out`` is the float64 sum of ``parts`` [P, ...] rounded
    once (:func:`tests.helpers.assert_rounded_once`), plus what an fp32 sum of P terms
    may lose."""
    fp32_loss = parts.shape[0] * 2.0 ** -24 * parts.double().abs().sum(0)
    assert_rounded_once("sum", out, parts.double().sum(0), fp32_loss)


def test_two_gradients_of_different_widths(device, seed):
    """A filter [D, W] and a bias [D] (a short convolution's dw, db) in one launch."""
    gen = generator(seed)
    P, D, W = 97, 70, 4
    dw_part = randn((P, D, W), gen, torch.float32, device)
    db_part = randn((P, D), gen, torch.float32, device)
    weight = torch.empty(D, W, dtype=torch.bfloat16, device=device)
    bias = torch.empty(D, dtype=torch.float32, device=device)
    dw, db = sum_partials(dw_part, weight, db_part, bias)
    assert (dw.shape, dw.dtype, db.shape, db.dtype) == ((D, W), torch.bfloat16, (D,),
                                                        torch.float32)
    assert_sum_rounded_once(dw, dw_part)
    assert_rel_close("db", db, db_part.double().sum(0), TOLERANCE[torch.float32])


def test_cancelling_partials_are_summed_before_rounding(device):
    """Partials summed in fp32 and rounded once: 1 + 2^-10 and -1 give 2^-10 in bf16
    (a cast of each partial first would give 0)."""
    parts = torch.tensor([[1 + 2 ** -10], [-1.0]], device=device)
    out = sum_partials(parts, torch.empty(1, dtype=torch.bfloat16, device=device))
    assert out.item() == 2 ** -10


@pytest.mark.parametrize("present", ["a", "b", "both", "none"])
def test_a_pair_either_of_which_may_be_absent(present, device, seed):
    """sum_partial_pair: a None ``like`` gives a None gradient, the others their sums."""
    gen = generator(seed)
    parts = [randn((9, 12), gen, torch.float32, device) for _ in "ab"]
    likes = [torch.empty(12, device=device) if name in present or present == "both" else None
             for name in "ab"]
    outs = sum_partial_pair(parts[0], likes[0], parts[1], likes[1])
    for part, like, out in zip(parts, likes, outs):
        if like is None:
            assert out is None
        else:
            assert_rel_close("sum", out, part.double().sum(0), TOLERANCE[torch.float32])
