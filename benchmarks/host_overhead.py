"""Host time per call of the norm path, layer by layer (GPU only).

    python -m benchmarks.host_overhead [--rows 16] [--width 4096] [--calls 2000]

At a tiny shape the GPU work is a few microseconds, so the wall time of a long loop of
calls (synchronised once at the end) is what the host spends per call. Printed for: the
raw Triton launch of the forward kernel, the same launch through our tuning layer,
``norm_fwd``, ``RMSNorm`` forward (no grad), RMSNorm forward + backward, and
``torch.nn.functional.rms_norm`` for comparison. The differences say where a step's
host time goes when the kernels fill too little of it (benchmarks/profile_case.py).
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

    def torch_fwd_bwd():
        out = torch.nn.functional.rms_norm(xg, (D,), norm.weight, 1e-5)
        torch.autograd.backward(out, dy)
        xg.grad = None
        norm.weight.grad = None

    rows = [
        ("raw Triton launch (norm_fwd_kernel)", lambda: tuned.kernel[grid](**named, **meta)),
        ("tuning-layer launch", lambda: tuned[grid](**named)),
        ("norm_fwd (allocations + launch)",
         lambda: lk.norm_fwd(x, norm.weight, None, None, None, 1e-5, 1, True, 0, None)),
        ("RMSNorm forward, no grad", lambda: _no_grad(norm, x)),
        ("torch rms_norm forward, no grad", lambda: _no_grad(
            lambda t: torch.nn.functional.rms_norm(t, (D,), norm.weight, 1e-5), x)),
        ("RMSNorm forward + backward", fwd_bwd),
        ("torch rms_norm forward + backward", torch_fwd_bwd),
    ]
    print(f"host time per call at [{N}, {D}] bf16 ({args.calls} calls each):")
    for name, fn in rows:
        print(f"  {per_call_us(fn, args.calls):8.1f} us  {name}")
    return 0


def _no_grad(fn, x):
    with torch.no_grad():
        return fn(x)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


if __name__ == "__main__":
    raise SystemExit(main())
