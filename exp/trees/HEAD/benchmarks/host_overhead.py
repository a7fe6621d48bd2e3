"""Host time per call of the norm path, layer by layer (GPU only).

    python -m benchmarks.host_overhead [--rows 16] [--width 4096] [--calls 2000]
                                       [--bound-ab ROUNDS] [--profile]

At a tiny shape the GPU work is a few microseconds, so the wall time of a long loop of
calls (synchronised once at the end) is what the host spends per call. Printed for: the
raw Triton launch of the forward kernel, the same launch through our tuning layer and as
a bound launch (``TunedKernel.launch_bound``), ``norm_fwd``, ``RMSNorm`` forward (no
grad), RMSNorm forward + backward, and ``torch.nn.functional.rms_norm`` for comparison.
The differences say where a step's host time goes when the kernels fill too little of
it (benchmarks/profile_case.py). ``--bound-ab`` then times RMSNorm's forward + backward
with bound launches on and off in interleaved rounds (host speed drifts within a call).
"""
from __future__ import annotations

import argparse
import time

import torch


def per_call_us(fn, calls: int) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--profile", action="store_true",
                   help="then a cProfile of RMSNorm forward + backward (one thread)")
    p.add_argument("--bound-ab", type=int, default=0, metavar="ROUNDS",
                   help="then RMSNorm fwd+bwd with bound launches on and off, interleaved")
    args = p.parse_args(argv)

    from fla.modules import RMSNorm
    from fla.modules import layernorm_kernels as lk

    N, D = args.rows, args.width
    x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
    norm = RMSNorm(D).to(device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    rstd = torch.empty(N, device="cuda", dtype=torch.float32)
    BLOCK, NCHUNK = lk.row_layout(D)
    named = dict(x=x, residual=None, weight=norm.weight, bias=None, g=None, y=y,
                 residual_out=None, mean=None, rstd=rstd, eps=1e-5, R=N, D=D, G=1,
                 BLOCK=BLOCK, NCHUNK=NCHUNK, IS_RMS_NORM=True, HAS_RESIDUAL=False,
                 STORE_RESIDUAL_OUT=False, HAS_WEIGHT=True, HAS_BIAS=False, ACTIVATION=0,
                 STATS_GIVEN=False)
    tensor_names = ("x", "residual", "weight", "bias", "g", "y", "residual_out", "mean",
                    "rstd")
    tensors = {k: named[k] for k in tensor_names}
    scalars = {k: v for k, v in named.items() if k not in tensor_names}
    tuned = lk.norm_fwd_kernel
    lk.norm_fwd(x, norm.weight, None, None, None, 1e-5, 1, True, 0, None)  # choose + compile
    config = tuned.chosen_config(**named)
    meta = config.launch_kwargs() if config is not None else {}
    grid = (triton_cdiv(N, meta.get("BR", 1)),)

    xg = x.clone().requires_grad_()
    dy = torch.randn_like(x)

    def fwd_bwd():
        out = norm(xg)
        torch.autograd.backward(out, dy)
        xg.grad = None
        norm.weight.grad = None

    _, _, _, rstd_saved = lk.norm_fwd(x, norm.weight, None, None, None, 1e-5, 1, True, 0,
                                      None)

    def norm_bwd_alone():
        lk.norm_bwd(dy, x, norm.weight, None, None, None, rstd_saved, None, 1, True, 0,
                    x.dtype, None)

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, grad):
            return grad

    def engine_round_trip():  # autograd's cost alone: a Python Function doing nothing
        out = Identity.apply(xg)
        torch.autograd.backward(out, dy)
        xg.grad = None

    def fwd_bwd_one_thread():  # the backward on the calling thread, not autograd's
        torch.autograd.set_multithreading_enabled(False)
        try:
            fwd_bwd()
        finally:
            torch.autograd.set_multithreading_enabled(True)

    def torch_fwd_bwd():
        out = torch.nn.functional.rms_norm(xg, (D,), norm.weight, 1e-5)
        torch.autograd.backward(out, dy)
        xg.grad = None
        norm.weight.grad = None

    compiled = tuned.kernel[grid](**named, **meta)
    values = tuned._direct.values({**named, **config.meta})
    stream = torch.cuda.current_stream().cuda_stream

    def bare_launcher():  # the floor: the compiled kernel's launcher, nothing around it
        compiled.run(grid[0], 1, 1, stream, compiled.function, compiled.packed_metadata,
                     None, None, None, *values)

    rows = [
        ("compiled kernel's launcher alone (the floor)", bare_launcher),
        ("raw Triton launch (norm_fwd_kernel)", lambda: tuned.kernel[grid](**named, **meta)),
        ("tuning-layer launch", lambda: tuned[grid](**named)),
        ("bound launch (tensors checked, scalars fixed)",
         lambda: tuned.launch_bound(grid, tensors, scalars)),
        ("norm_fwd (allocations + launch)",
         lambda: lk.norm_fwd(x, norm.weight, None, None, None, 1e-5, 1, True, 0, None)),
        ("RMSNorm forward, no grad", lambda: _no_grad(norm, x)),
        ("torch rms_norm forward, no grad", lambda: _no_grad(
            lambda t: torch.nn.functional.rms_norm(t, (D,), norm.weight, 1e-5), x)),
        ("norm_bwd alone (allocations, launch, dw sum)", norm_bwd_alone),
        ("autograd round trip of a do-nothing Function", engine_round_trip),
        ("RMSNorm forward + backward", fwd_bwd),
        ("RMSNorm forward + backward, backward on the calling thread", fwd_bwd_one_thread),
        ("torch rms_norm forward + backward", torch_fwd_bwd),
    ]
    from fla.utils.direct_launch import direct_launches

    print(f"host time per call at [{N}, {D}] bf16 ({args.calls} calls each), "
          f"us: direct launches (fla/utils/direct_launch.py) | through Triton's path")
    for name, fn in rows:
        times = []
        for direct in (True, False):
            with direct_launches(direct):
                times.append(per_call_us(fn, args.calls))
        print(f"  {times[0]:8.1f} | {times[1]:8.1f}  {name}")
    if args.bound_ab:
        _bound_ab(fwd_bwd, args.bound_ab, args.calls, D)
    if args.profile:
        _time_inside_backward(fwd_bwd, fwd_bwd_one_thread, args.calls)
        _sample_all_threads(fwd_bwd, args.calls)
        # cProfile sees only its own thread: run the backward on the calling thread.
        import cProfile
        import pstats
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.calls):
            fwd_bwd_one_thread()
        profiler.disable()
        torch.cuda.synchronize()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return 0


def _bound_ab(fwd_bwd, rounds: int, calls: int, D: int) -> None:
    """RMSNorm forward + backward with bound launches (fla/utils/direct_launch.py) on and
    off, interleaved round by round in this process (host speed drifts within a call):
    host µs a call at the small shape, and do_bench's median at 16384 x D."""
    import statistics

    import triton.testing

    from fla.modules import RMSNorm
    from fla.utils.direct_launch import bound_launches

    x = torch.randn(16384, D, device="cuda", dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn_like(x)
    norm = RMSNorm(D).to(device="cuda", dtype=torch.bfloat16)

    def big():
        torch.autograd.backward(norm(x), dy)

    host: dict[bool, list[float]] = {True: [], False: []}
    bench: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for on in (True, False):
            with bound_launches(on):
                host[on].append(per_call_us(fwd_bwd, calls))
                bench[on].append(1e3 * triton.testing.do_bench(
                    big, warmup=25, rep=100, grad_to_none=[x, norm.weight],
                    return_mode="median"))
    for on in (True, False):
        print(f"  bound launches {'on ' if on else 'off'}: host fwd+bwd min "
              f"{min(host[on]):6.1f} / median {statistics.median(host[on]):6.1f} us; "
              f"do_bench 16384x{D} fwd+bwd min {min(bench[on]):6.1f} / median "
              f"{statistics.median(bench[on]):6.1f} us ({rounds} rounds)")


def _time_inside_backward(multi_threaded, one_thread, calls: int) -> None:
    """Host time spent inside the norm's backward formula, per call, with the backward
    on autograd's device thread and on the calling thread: if they differ, the thread
    itself makes our Python slower; if not, the difference is in the hand-off."""
    import time as _time

    from fla.modules import layernorm
    eager = layernorm._norm_fwd_op._function
    original = eager.backward
    spent = [0.0]

    def timed(ctx, *grads):
        t0 = _time.perf_counter()
        try:
            return original(ctx, *grads)
        finally:
            spent[0] += _time.perf_counter() - t0

    eager.backward = staticmethod(timed)
    try:
        for name, fn in (("device thread", multi_threaded), ("calling thread", one_thread)):
            spent[0] = 0.0
            total = per_call_us(fn, calls)
            inside = spent[0] / (calls + 50) * 1e6
            print(f"  backward on the {name}: {total:8.1f} us a call, {inside:8.1f} us of "
                  f"it inside the backward formula")
    finally:
        eager.backward = original


def _sample_all_threads(fn, calls: int, interval_s: float = 2e-4) -> None:
    """Innermost Python frames of every thread but the sampler's, sampled while ``fn``
    runs ``calls`` times: where the device thread's time goes."""
    import collections
    import sys
    import threading

    counts: collections.Counter = collections.Counter()
    stop = threading.Event()
    me = []

    def sample():
        me.append(threading.get_ident())
        names = {t.ident: t.name for t in threading.enumerate()}
        while not stop.wait(interval_s):
            for ident, frame in sys._current_frames().items():
                if ident == me[0]:
                    continue
                code = frame.f_code
                where = (f"{code.co_filename.split('site-packages/')[-1]}:"
                         f"{frame.f_lineno} {code.co_name}")
                counts[(names.get(ident, f"thread {ident}"), where)] += 1

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    finally:
        stop.set()
        sampler.join()
    total = sum(counts.values()) or 1
    print("  sampled innermost frames (all threads, RMSNorm forward + backward):")
    for (thread, where), n in counts.most_common(20):
        print(f"    {100 * n / total:5.1f}%  {thread[:20]:20s} {where}")


def _no_grad(fn, x):
    with torch.no_grad():
        return fn(x)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


if __name__ == "__main__":
    raise SystemExit(main())
