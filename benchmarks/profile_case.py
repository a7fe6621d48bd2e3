"""Where the time of one benchmark case goes: per-kernel GPU time and host overhead.

    python -m benchmarks.profile_case CASE [CASE ...] [--mode fwd|fwdbwd|both] [--steps 5]

For each case of :mod:`benchmarks.cases` (e.g. ``RMSNorm/16384x4096``) and mode it prints

* the do_bench median (as ``run_side`` measures it: gradients reset between reps),
* the sum of the GPU kernels' times per step and the share of the step they fill (the
  rest is launch latency / host work the GPU waits for),
* the kernels of one step, longest first (torch.profiler, CUDA activity),
* with ``--sequence``, one step's launches in launch order (a split pass launches one
  kernel several times: the table above adds them up),
* with ``--host``, the Python functions that take the host's time over 200 steps
  (cProfile, by own and by cumulative time, the backward on the calling thread): what
  to cut when the kernels fill too little of the step;
* with ``--tune``, each kernel's whole tuning space timed at the case's keys (``FLA_TUNE=1``
  over a fresh cache: the medians above are then those of the fastest configs), and per
  key every config's time against the default rule's.

It measures whichever ``fla`` is importable (run it from the checkout for ours).
"""
from __future__ import annotations

import argparse

import torch

from benchmarks import cases as registry


def _step(prepared, mode: str, do: torch.Tensor | None):
    if mode == "fwd":
        with torch.no_grad():
            prepared.forward()
        return
    out = prepared.forward()
    torch.autograd.backward(prepared.grad_target(out), do)


def _reset(prepared) -> None:
    for x in prepared.leaves:
        x.grad = None


def profile(case, mode: str, steps: int, host: bool = False, sequence: bool = False) -> None:
    import triton.testing
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    module = __import__(case.module, fromlist=[case.function])
    prepared = case.build(case, getattr(module, case.function), "cuda", mode == "fwdbwd")
    do = None
    if mode == "fwdbwd":
        out = prepared.forward()
        target = prepared.grad_target(out)
        do = torch.randn(target.shape, device="cuda", dtype=torch.float32).to(target.dtype)
        del out, target
    for _ in range(3):
        _reset(prepared)
        _step(prepared, mode, do)
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(lambda: _step(prepared, mode, do), warmup=25, rep=100,
                                 grad_to_none=prepared.leaves or None, return_mode="median")

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            _reset(prepared)
            _step(prepared, mode, do)
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(event, "self_cuda_time_total", 0.0)
        if device_us > 0:
            rows.append((device_us / steps, event.count // steps or 1, event.key))
    rows.sort(reverse=True)
    kernel_ms = sum(r[0] for r in rows) / 1e3
    print(f"\n{case.name} {mode}: do_bench median {ms:.4f} ms; kernels {kernel_ms:.4f} ms "
          f"per step ({100 * kernel_ms / ms:.0f}% of the step)")
    for us, count, name in rows[:12]:
        print(f"  {us:9.1f} us  x{count:<3d} {name[:100]}")
    if sequence:
        # The table above adds up a kernel's launches; a split pass launches one kernel
        # several times (transitions, then outputs): one step's launches in order.
        with torch_profile(activities=[ProfilerActivity.CUDA]) as one:
            _reset(prepared)
            _step(prepared, mode, do)
            torch.cuda.synchronize()
        launches = [(e.name, e.device_time) for e in one.events()
                    if getattr(e, "device_time", 0) > 0]
        print("  one step's launches in order (us): " + ", ".join(
            f"{name[:48]} {us:.1f}" for name, us in launches))
    if host:
        import cProfile
        import pstats

        runs = 200
        profiler = cProfile.Profile()
        # cProfile sees its own thread only: the backward runs on the calling thread here
        # (autograd would run it on its device thread), so that it is counted too.
        torch.autograd.set_multithreading_enabled(False)
        try:
            profiler.enable()
            for _ in range(runs):
                _reset(prepared)
                _step(prepared, mode, do)
            profiler.disable()
        finally:
            torch.autograd.set_multithreading_enabled(True)
        torch.cuda.synchronize()
        stats = pstats.Stats(profiler)
        print(f"  host: {1e6 * stats.total_tt / runs:.1f} us of Python per step (backward "
              f"on the calling thread); by own time, then by cumulative time:")
        stats.sort_stats("tottime").print_stats(22)
        stats.sort_stats("cumulative").print_stats(30)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cases", nargs="+", help="case names or selectors (see benchmarks.cases)")
    p.add_argument("--mode", choices=("fwd", "fwdbwd", "both"), default="both")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--host", action="store_true", help="also profile the host (cProfile)")
    p.add_argument("--sequence", action="store_true",
                   help="also list one step's kernel launches in launch order")
    p.add_argument("--tune", action="store_true",
                   help="time every config of each kernel's space; print them per key")
    args = p.parse_args(argv)
    if args.tune:
        import os
        import tempfile
        os.environ["FLA_TUNE"] = "1"
        os.environ["FLA_CACHE_DIR"] = tempfile.mkdtemp(prefix="fla-tune-")
    modes = ("fwd", "fwdbwd") if args.mode == "both" else (args.mode,)
    for case in registry.select(args.cases):
        for mode in modes:
            if mode in case.modes:
                profile(case, mode, args.steps, args.host, args.sequence)
    if args.tune:
        _print_tuning()
    return 0


def _print_tuning() -> None:
    """Every tuned kernel's timings by key, fastest first, the default rule's config
    marked."""
    import sys

    from fla.utils.tuning import TunedKernel
    seen = set()
    for module in list(sys.modules.values()):
        if not (getattr(module, "__name__", "") or "").startswith("fla."):
            continue
        for tuned in vars(module).values():
            if not isinstance(tuned, TunedKernel) or id(tuned) in seen or not tuned.timings:
                continue
            seen.add(id(tuned))
            for key, (default, timings) in tuned.timings.items():
                named = dict(zip(tuned.key, key))
                print(f"\n{tuned.name.rsplit('.', 1)[-1]} {named}")
                for config, ms in sorted(timings.items(), key=lambda item: item[1]):
                    mark = "  <- default" if config == default else ""
                    print(f"  {ms:8.4f} ms  {config}{mark}")


if __name__ == "__main__":
    raise SystemExit(main())
