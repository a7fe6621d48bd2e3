"""Step plans on against off (fla/utils/step_plans.py), in one process, on the GPU.

    python -m benchmarks.plans_ab CASE [CASE ...] [--rounds 3]

For each case of :mod:`benchmarks.cases` (e.g. ``chunk_gated_delta_rule/4x2048x16x128``),
rounds alternate plans off and on; each prints the do_bench medians of the forward and
of fwd+bwd (ms, as ``run_side`` measures them) and the host's time a fwd+bwd step (µs,
the median of 30 steps issued without a sync: the launch queue does not fill, so this is
the time the host needs, whatever the GPU does).
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks import cases as registry


def _host_us(step, leaves, steps: int = 30) -> float:
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        for x in leaves:
            x.grad = None
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    times.sort()
    return times[len(times) // 2] * 1e6


def compare(case, rounds: int) -> None:
    import triton.testing

    from fla.utils.step_plans import step_plans

    module = __import__(case.module, fromlist=[case.function])
    prepared = case.build(case, getattr(module, case.function), "cuda", True)
    target = prepared.grad_target(prepared.forward())
    do = torch.randn(target.shape, device="cuda").to(target.dtype)
    del target

    def fwd_bwd():
        torch.autograd.backward(prepared.grad_target(prepared.forward()), do)

    def fwd():
        with torch.no_grad():
            prepared.forward()

    rows = {False: [], True: []}
    for _ in range(rounds):
        for on in (False, True):
            with step_plans(on):
                for _ in range(3):  # the first calls of a signature record its plan
                    for x in prepared.leaves:
                        x.grad = None
                    fwd_bwd()
                ms_fb = triton.testing.do_bench(fwd_bwd, warmup=25, rep=100,
                                                grad_to_none=prepared.leaves,
                                                return_mode="median")
                ms_f = triton.testing.do_bench(fwd, warmup=25, rep=100, return_mode="median")
                rows[on].append((ms_f, ms_fb, _host_us(fwd_bwd, prepared.leaves)))
    for on in (False, True):
        r = rows[on]
        print(f"{case.name:40s} plans {'on ' if on else 'off'}: fwd "
              + " ".join(f"{x[0]:.3f}" for x in r) + " | fwd+bwd "
              + " ".join(f"{x[1]:.3f}" for x in r) + " | host us "
              + " ".join(f"{x[2]:.0f}" for x in r), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cases", nargs="+", help="case names or selectors (see benchmarks.cases)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    for case in registry.select(args.cases):
        if "fwdbwd" in case.modes:
            compare(case, args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
