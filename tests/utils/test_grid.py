"""The host-side grid arithmetic equals Triton's functions, at a fraction of their cost."""
import timeit

import triton

from fla.utils.grid import cdiv, next_power_of_2


def test_cdiv_and_next_power_of_2_equal_tritons():
    for x in range(0, 3000):
        for y in (1, 2, 3, 16, 63, 64, 128, 1000):
            assert cdiv(x, y) == triton.cdiv(x, y), (x, y)
        assert next_power_of_2(x) == triton.next_power_of_2(x), x
    for x in (2 ** 31 - 1, 2 ** 31, 2 ** 40 + 3):
        assert next_power_of_2(x) == triton.next_power_of_2(x)
        assert cdiv(x, 64) == triton.cdiv(x, 64)


def test_host_helpers_are_not_slower_than_tritons():
    # Triton >= 3.5 makes both constexpr functions (~2 µs a host call); ours are plain
    # expressions. Compared against each other, so a slow machine cannot fail it; the best
    # of three rounds each, so that a neighbouring test process (pytest -n 2) cannot either.
    ours = min(timeit.repeat(lambda: cdiv(1000, 64) + next_power_of_2(100), number=20000,
                             repeat=3))
    theirs = min(timeit.repeat(lambda: triton.cdiv(1000, 64) + triton.next_power_of_2(100),
                               number=20000, repeat=3))
    assert ours <= 1.5 * theirs
