"""Where one RMSNorm forward + backward step's host time goes, on the host it runs on.

    python -m benchmarks.norm_timeline [--steps 300] [--rows 16384] [--width 4096]

RMSNorm's fwd+bwd (issue 7) is host-bound on some GPU hosts: the GPU finishes the
forward kernel and waits until the host has launched the backward's. This times a step
the way ``run_side`` does (a 256 MB cache flush before each step, do_bench's median) and
stamps, with ``time.perf_counter_ns``, the moments the host reaches: the forward and
backward ops' entries and exits, each kernel launch's start and end (dγ's partial-sum
reduction as ``dw sum``) or, once a step plan replays them, each allocation and launch of
the plans (``forward plan 2 launch``), the forward's and
the backward's return (medians over ``--steps`` steps, µs from the step's start, with
the 10th and 90th percentiles). Variants: ours, ours with autograd's multithreading off
(the backward on the calling thread: a user's setting, shown for the hand-off's cost)
and PyTorch's ``rms_norm``. The kernels' own time is ``benchmarks.profile_case
RMSNorm/16384x4096``'s; how fast the host is, ``benchmarks.host_overhead``'s autograd
round trip of a do-nothing Function.

Without a GPU it runs the PyTorch path on the CPU (no stamps inside the ops, no
do_bench): a smoke test of the tool only.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

_now = time.perf_counter_ns


class _Stamps:
    """The step's stamps by name (ns); the wrappers below write into it."""

    def __init__(self) -> None:
        self.at: dict[str, int] = {}
        self.ops: tuple = ()  # (label, StageOp) of the norm ops, set by _stamping
        self.stamped_plans: set[int] = set()  # ids of the plans whose steps are stamped

    def around(self, name: str, fn):
        def stamped(*args, **kwargs):
            self.at[name + " >"] = _now()
            out = fn(*args, **kwargs)
            self.at[name + " <"] = _now()
            return out
        return stamped


class _StampedKernel:
    """A tuned kernel whose launches are stamped (``kernel[grid](...)`` and
    ``kernel.launch_bound(...)``)."""

    def __init__(self, stamps: _Stamps, name: str, kernel) -> None:
        self._stamps, self._name, self._kernel = stamps, name, kernel

    def __getitem__(self, grid):
        return self._stamps.around(self._name + " launch", self._kernel[grid])

    def launch_bound(self, grid, tensors, scalars):
        return self._stamps.around(self._name + " launch", self._kernel.launch_bound)(
            grid, tensors, scalars)

    def __getattr__(self, attr):
        return getattr(self._kernel, attr)


@contextlib.contextmanager
def _stamping(stamps: _Stamps):
    """Stamp the norm ops and kernel launches of fla.modules while the block runs."""
    import fla.modules.layernorm as ln
    import fla.modules.layernorm_kernels as lk
    saved = {(ln, "_norm_fwd_op"): ln._norm_fwd_op, (ln, "_norm_bwd_op"): ln._norm_bwd_op,
             (lk, "norm_fwd_kernel"): lk.norm_fwd_kernel,
             (lk, "norm_bwd_kernel"): lk.norm_bwd_kernel,
             (lk, "sum_partial_pair"): lk.sum_partial_pair}
    stamps.ops = (("forward plan", ln._norm_fwd_op), ("backward plan", ln._norm_bwd_op))
    ln._norm_fwd_op = stamps.around("forward op", ln._norm_fwd_op)
    ln._norm_bwd_op = stamps.around("backward op", ln._norm_bwd_op)
    # The backward's second launch (dγ's partial sums) and what follows it: on the hosts
    # where the step is host-bound, the backward op returned ~120 µs after its kernel's
    # launch (2026-11-27).
    lk.sum_partial_pair = stamps.around("dw sum", lk.sum_partial_pair)
    lk.norm_fwd_kernel = _StampedKernel(stamps, "forward kernel", lk.norm_fwd_kernel)
    lk.norm_bwd_kernel = _StampedKernel(stamps, "backward kernel", lk.norm_bwd_kernel)
    try:
        yield
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)


def _stamp_plan_steps(stamps: _Stamps) -> None:
    """Stamp every step of the norm ops' recorded plans (fla/utils/step_plans.py): a
    replay launches the compiled kernels itself, past the stamped kernel objects above.
    Each allocation, PyTorch call and launch of a plan gets its own pair of stamps
    ("forward plan 0 empty_like", ...). Plans of an older generation (another variant's,
    not yet cleared) are left alone."""
    from fla.utils import step_plans
    for label, op in stamps.ops:
        plans = op._plans
        if plans._generation != step_plans._generation[0]:
            continue
        for plan in plans._plans.values():
            if plan is None or id(plan) in stamps.stamped_plans:
                continue
            steps = []
            for i, (step, drops) in enumerate(plan._steps):
                what = next((c.cell_contents.__name__ for c in step.__closure__ or ()
                             if callable(c.cell_contents)
                             and getattr(c.cell_contents, "__name__", "") not in
                             ("", "_launch_compiled")), step.__name__)
                steps.append((stamps.around(f"{label} {i} {what}", step), drops))
            plan._steps = steps
            stamps.stamped_plans.add(id(plan))


@contextlib.contextmanager
def _plans_dropped_after(step_plans):
    """No stamped plan outlives the block (the do_bench below times plain ones)."""
    try:
        yield
    finally:
        step_plans.invalidate()


def _quantiles(values: list[float]) -> tuple[float, float, float]:
    ordered = sorted(values)
    return (statistics.median(ordered), ordered[len(ordered) // 10],
            ordered[9 * len(ordered) // 10])


def timeline(step_fn, leaves, steps: int, device: str, warmup: int = 20,
             flush_mb: int = 256) -> tuple[float | None, dict]:
    """``(do_bench median in µs or None off the GPU, {stamp: (median, p10, p90) µs})``
    of ``step_fn() -> (output, grad_output)`` followed by its backward, each step after
    a ``flush_mb`` write (do_bench's cache flush: the GPU is busy with it while the
    host starts the step)."""
    from fla.utils import step_plans
    stamps = _Stamps()
    flush = torch.empty(flush_mb * 256 * 1024, dtype=torch.int32, device=device)
    rows: list[dict[str, float]] = []
    step_plans.invalidate()  # plans recorded below, then their steps stamped
    with _stamping(stamps), _plans_dropped_after(step_plans):
        for i in range(steps + warmup):
            if i == warmup:
                _stamp_plan_steps(stamps)
            for x in leaves:
                x.grad = None
            flush.zero_()
            stamps.at.clear()
            start = _now()
            y, dy = step_fn()
            forward_done = _now()
            torch.autograd.backward(y, dy)
            backward_done = _now()
            if i >= warmup:
                row = {"forward returned": forward_done, "backward returned": backward_done,
                       **stamps.at}
                rows.append({k: (v - start) / 1e3 for k, v in row.items()})
    median_us = None
    if device == "cuda":
        import triton.testing
        torch.cuda.synchronize()
        median_us = 1e3 * triton.testing.do_bench(
            lambda: torch.autograd.backward(*step_fn()), warmup=25, rep=200,
            grad_to_none=leaves, return_mode="median")
    names = sorted(rows[0], key=lambda k: statistics.median(r[k] for r in rows))
    return median_us, {k: _quantiles([r[k] for r in rows]) for k in names}


def _report(label: str, median_us: float | None, stamps: dict) -> None:
    bench = "" if median_us is None else f": do_bench median {median_us:.1f} µs"
    print(f"== {label}{bench}")
    for name, (mid, low, high) in stamps.items():
        print(f"   {name:24s} {mid:8.1f} µs  (p10 {low:.1f}, p90 {high:.1f})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--width", type=int, default=4096)
    args = p.parse_args(argv)

    from fla.modules import RMSNorm
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    N, D = args.rows, args.width
    x = torch.randn(N, D, device=device, generator=gen).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(N, D, device=device, generator=gen).to(torch.bfloat16)
    norm = RMSNorm(D).to(device=device, dtype=torch.bfloat16)
    weight = torch.ones(D, device=device, dtype=torch.bfloat16, requires_grad=True)

    def ours():
        return norm(x), dy

    def torchs():
        return torch.nn.functional.rms_norm(x, (D,), weight, 1e-5), dy

    for label, fn, leaves, threaded in (
            ("ours", ours, [x, norm.weight], True),
            ("ours, autograd multithreading off", ours, [x, norm.weight], False),
            ("torch.nn.functional.rms_norm", torchs, [x, weight], True)):
        torch.autograd.set_multithreading_enabled(threaded)
        try:
            _report(label, *timeline(fn, leaves, args.steps, device))
        finally:
            torch.autograd.set_multithreading_enabled(True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
