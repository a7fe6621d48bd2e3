"""Where the first call of a case spends its wall clock: a sampled-stack profile.

    python -m benchmarks.first_call_profile CASE [--interval-ms 5] [--top 25]

Runs the case's first fwd+bwd in this process (caches as the environment has them: set
``TRITON_CACHE_DIR`` / ``FLA_CACHE_DIR`` to empty folders for a cold start) while a
thread samples the main thread's Python stack every few milliseconds. cProfile is of no
use here: torch's frame-evaluation hooks and Triton's compile threads hide most of the
time from it. Prints the wall clock of the call, then the functions (file:line name)
present in the largest share of samples, inclusive ("cumulative") and as the innermost
frame of our own code or the libraries ("self").
"""
from __future__ import annotations

import argparse
import collections
import sys
import threading
import time

import torch

from benchmarks.cases import BY_NAME


class StackSampler:
    """Samples one thread's Python stack on a timer until stopped."""

    def __init__(self, thread_id: int, interval_s: float):
        self.thread_id, self.interval_s = thread_id, interval_s
        self.inclusive: collections.Counter = collections.Counter()
        self.innermost: collections.Counter = collections.Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "StackSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            frame = sys._current_frames().get(self.thread_id)
            seen = set()
            inner = None
            while frame is not None:
                code = frame.f_code
                where = f"{code.co_filename.split('site-packages/')[-1]}:" \
                        f"{code.co_firstlineno} {code.co_name}"
                inner = inner or where
                seen.add(where)
                frame = frame.f_back
            self.inclusive.update(seen)
            if inner:
                self.innermost[inner] += 1
            self.samples += 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("case", help="a case name of benchmarks.cases, e.g. chunk_rwkv7/4x4096x32x64")
    p.add_argument("--interval-ms", type=float, default=5.0)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="the case at a small shape (smoke test)")
    args = p.parse_args(argv)

    case = BY_NAME[args.case].tiny() if args.tiny else BY_NAME[args.case]
    prepared = case.prepare(case.resolve(), args.device, grad=True)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    sync()
    with StackSampler(threading.get_ident(), args.interval_ms / 1e3) as sampler:
        t0 = time.perf_counter()
        out = prepared.forward()
        target = prepared.grad_target(out)
        torch.autograd.backward(target, torch.randn_like(target))
        sync()
        wall = time.perf_counter() - t0
    n = max(sampler.samples, 1)
    print(f"{args.case}: first fwd+bwd {wall:.2f} s, {sampler.samples} samples")
    for title, counter in (("inclusive", sampler.inclusive), ("innermost", sampler.innermost)):
        print(f"\n{title} share of samples:")
        for where, count in counter.most_common(args.top):
            print(f"  {100 * count / n:5.1f}%  {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
