"""fla.ops.utils.two_term: a 16-bit dot with an fp32 operand carried as two 16-bit tiles
keeps ~16 of its mantissa bits (one tile keeps 8 in bf16, 11 in fp16)."""
import pytest
import torch
import triton
import triton.language as tl

from fla.ops.utils.two_term import two_term_dot
from tests.helpers import generator, rel_error
from tests.interpreter_bf16 import AVAILABLE as GPU_BF16_EMULATED, gpu_bf16


@triton.jit
def _dots_kernel(x16, y32, out, M: tl.constexpr, R: tl.constexpr, N: tl.constexpr,
                 TWO_TERM: tl.constexpr):
    """out = x16 · y32, x16 [M, R]."""
    o_m, o_r, o_n = tl.arange(0, M), tl.arange(0, R), tl.arange(0, N)
    a = tl.load(x16 + o_m[:, None] * R + o_r[None, :])
    b = tl.load(y32 + o_r[:, None] * N + o_n[None, :])
    c = two_term_dot(a, b, tl.zeros([M, N], dtype=tl.float32), TWO_TERM, "tf32")
    tl.store(out + o_m[:, None] * N + o_n[None, :], c)


def _errors(dtype, seed):
    gen = generator(seed)
    M, R, N = 32, 64, 16
    x = torch.randn(M, R, generator=gen).to(dtype)
    # fp32 values with more mantissa bits than a 16-bit tile holds.
    y = torch.randn(R, N, generator=gen) * 1e3 + torch.randn(R, N, generator=gen)
    ref = x.double() @ y.double()
    errors = {}
    for two_term in (False, True):
        out = torch.empty(M, N)
        _dots_kernel[(1,)](x, y, out, M, R, N, two_term)
        errors[two_term] = rel_error(out, ref)
    return errors


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_two_terms_keep_twice_the_bits(dtype, device, seed):
    """One 16-bit tile rounds the fp32 operand at 2^-9 (bf16) / 2^-12 (fp16) relative;
    two keep it to ~2^-17 / ~2^-22 (the product's own fp32 sums then lead)."""
    if device != "cpu":
        pytest.skip("the interpreter's test (the GPU runs these dots in the delta rules)")
    if dtype == torch.bfloat16 and not GPU_BF16_EMULATED:
        pytest.skip("bf16 dots need tests/interpreter_bf16.py's emulation")
    if dtype == torch.bfloat16:
        with gpu_bf16():
            errors = _errors(dtype, seed)
    else:
        errors = _errors(dtype, seed)
    one = 2.0 ** (-8 if dtype == torch.bfloat16 else -11)
    assert one / 16 < errors[False] < one, errors
    assert errors[True] < one / 64, errors
