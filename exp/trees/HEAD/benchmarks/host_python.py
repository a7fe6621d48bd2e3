"""Our own Python per call of an op's Triton path, measured on a machine without a GPU.

    python -m benchmarks.host_python [OP ...] [--mode fwd|fwdbwd|both] [--profile N]

``TRITON_INTERPRET=1`` sends CPU tensors down the Triton path and
:func:`fla.utils.compile_ahead.launches_skipped` drops every kernel launch, so what is
timed is the host code around the kernels: input checks, the custom-op and autograd
wrappers, compile-ahead's signature, allocations, config choice up to the launch. It
leaves out the launch itself (~6 µs of our Python and Triton's launcher a kernel) and
autograd's hand-off to its CUDA device thread, which only a GPU host shows
(``benchmarks.host_overhead``, ``benchmarks.profile_case --host``). Under the
interpreter ``is_interpreter()`` and ``dot_precision()`` read the environment; on CUDA
tensors neither does, so their share here is an artefact. The GPU hosts we were lent ran
the same Python about 4.5x slower than this repository's 2-core CI machine.

``--profile N`` prints the N functions with the most own time (cProfile over 200
steps) and the calls a step. Ops: simple_gla, gla, gdn (chunk_gated_delta_rule), rms
(RMSNorm), each at 2 x 128 x 2 x 64 in fp32.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import time

import torch

SHAPE = (2, 128, 2, 64)


def _leaves(*shapes, negative=()):
    out = []
    for i, shape in enumerate(shapes):
        t = -torch.rand(*shape) if i in negative else torch.randn(*shape)
        out.append(t.requires_grad_())
    return out


def _simple_gla():
    from fla.ops.simple_gla import chunk_simple_gla
    B, T, H, D = SHAPE
    q, k, v, g = _leaves(SHAPE, SHAPE, SHAPE, (B, T, H), negative=(3,))
    return (lambda: chunk_simple_gla(q, k, v, g=g)[0]), [q, k, v, g]


def _gla():
    from fla.ops.gla import chunk_gla
    q, k, v, g = _leaves(SHAPE, SHAPE, SHAPE, SHAPE, negative=(3,))
    return (lambda: chunk_gla(q, k, v, g)[0]), [q, k, v, g]


def _gdn():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    B, T, H, D = SHAPE
    q, k, v, g = _leaves(SHAPE, SHAPE, SHAPE, (B, T, H), negative=(3,))
    beta = torch.rand(B, T, H).requires_grad_()
    return (lambda: chunk_gated_delta_rule(q, k, v, g, beta)[0]), [q, k, v, g, beta]


def _rms():
    from fla.modules import RMSNorm
    B, T, H, D = SHAPE
    norm = RMSNorm(H * D)
    (x,) = _leaves((B * T, H * D))
    return (lambda: norm(x)), [x, norm.weight]


OPS = {"simple_gla": _simple_gla, "gla": _gla, "gdn": _gdn, "rms": _rms}


@contextlib.contextmanager
def _triton_path_on_cpu():
    """CPU tensors down the Triton path (the interpreter's switch), no launch made."""
    from fla.utils import compile_ahead

    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        with compile_ahead.launches_skipped():
            yield
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


def measure(name: str, mode: str, steps: int = 2000, profile: int = 0) -> float:
    """µs of host Python a step (forward, or forward + backward) of op ``name``."""
    forward, leaves = OPS[name]()
    with _triton_path_on_cpu():
        do = torch.randn_like(forward())

        def step():
            if mode == "fwd":
                with torch.no_grad():
                    forward()
                return
            torch.autograd.backward(forward(), do)
            for t in leaves:
                t.grad = None

        for _ in range(50):
            step()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        us = (time.perf_counter() - t0) / steps * 1e6
        if profile:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(200):
                step()
            profiler.disable()
            stats = pstats.Stats(profiler)
            print(f"  {name} {mode}: {stats.total_calls / 200:.0f} Python calls a step")
            stats.sort_stats("tottime").print_stats(profile)
    return us


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ops", nargs="*", help=f"some of {', '.join(OPS)} (default: all)")
    p.add_argument("--mode", choices=("fwd", "fwdbwd", "both"), default="both")
    p.add_argument("--profile", type=int, default=0, metavar="N")
    args = p.parse_args(argv)
    unknown = [name for name in args.ops if name not in OPS]
    if unknown:
        p.error(f"unknown ops {unknown}; choose from {list(OPS)}")
    modes = ("fwd", "fwdbwd") if args.mode == "both" else (args.mode,)
    for name in args.ops or list(OPS):
        for mode in modes:
            print(f"{name:10s} {mode:6s} {measure(name, mode, profile=args.profile):7.1f} "
                  f"us a step (launches skipped)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
