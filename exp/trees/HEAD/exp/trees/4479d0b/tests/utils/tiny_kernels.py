"""Tiny Triton kernels for the tuning-layer tests (Triton needs kernels in a real file).

Each kernel computes ``y = 2 * x`` over ``n`` elements in tiles of ``BLOCK``; a
non-power-of-two ``BLOCK`` makes ``tl.arange`` raise, which is how the tests produce a
config that fails to build.
"""
import triton
import triton.language as tl

from fla.utils.tuning import Config, tuned


@triton.jit(do_not_specialize=["n"])
def double_kernel(x, y, n, D: tl.constexpr, BLOCK: tl.constexpr):
    # D is unused by the maths: it is only a key (a "head width") for the tests.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y + offs, 2 * tl.load(x + offs, mask=mask), mask=mask)


def grid(meta):
    return (triton.cdiv(meta["n"], meta["BLOCK"]),)


def make_tuned(default, space=(), key=("D",)):
    """A fresh TunedKernel over ``double_kernel`` (each test gets its own stats)."""
    return tuned(key=list(key), default=default, space=space,
                 name="tests.tiny_kernels.double")(double_kernel)


GOOD = Config(BLOCK=32, num_warps=1)
ALSO_GOOD = Config(BLOCK=64, num_warps=2)
BROKEN = Config(BLOCK=24, num_warps=1)   # not a power of two: tl.arange refuses it
BROKEN_TOO = Config(BLOCK=48, num_warps=1)
