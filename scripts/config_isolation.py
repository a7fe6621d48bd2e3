"""Run every config of every tuned kernel a benchmark case launches, each in its own process.

    python scripts/config_isolation.py CASE [--only NAME] [--tiny] [--device cuda]
                                       [--timeout 150] [--bound 1e-2]

CASE is a `benchmarks/cases.py` selector naming one case (e.g. `chunk_gla/1x8192x96x128`).
The case's forward + backward is run once with the default configs, recording which
tuned kernels it launches; then, for each of those kernels (or those whose name has
``--only``) and each config of its tuning space, a child process runs the case with the
default configs, forces that one config, runs it again, and reports the largest
relative difference over the output and every input gradient, and on a GPU the fwd+bwd
median time. One line per config, a table last.

Why a process per config: a config that faults (an illegal address is what Triton
miscompiles usually produce) leaves the CUDA context unusable, so the GPU config sweeps
in the tests (``tests/ops/config_sweep.py``) report the first such config and lose every
later one. Here each config's fate is its own: this found the faulting state-pass config
of GLA (2026-11-25). On CPU (``--device cpu --tiny``, the Triton interpreter) it checks
the same code paths without timings.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _case(selector: str, tiny: bool):
    from benchmarks.cases import select

    cases = select([selector])
    if len(cases) != 1:
        sys.exit(f"{selector!r} selects {len(cases)} cases; name exactly one")
    return cases[0].tiny() if tiny else cases[0]


def _tuned_kernels() -> dict:
    """Every TunedKernel of the imported fla modules, by its name."""
    from fla.utils.tuning import TunedKernel

    found = {}
    for name, module in list(sys.modules.items()):
        if name.startswith("fla.") and module is not None:
            for value in list(vars(module).values()):
                if isinstance(value, TunedKernel):
                    found[value.name] = value
    return found


def _fwd_bwd(case, prepared, device):
    """Outputs of one forward + backward: the grad target and every leaf's gradient."""
    import torch

    for leaf in prepared.leaves:
        leaf.grad = None
    target = prepared.grad_target(prepared.forward())
    gen = torch.Generator(device=device).manual_seed(case.seed + 1)
    do = torch.randn(target.shape, generator=gen, device=device,
                     dtype=torch.float32).to(target.dtype)
    torch.autograd.backward(target, do)
    return [target.detach().float()] + [leaf.grad.float() for leaf in prepared.leaves
                                        if leaf.grad is not None]


def _record(case, device):
    """(prepared inputs, default outputs, {kernel name: (kernel, first launch kwargs)})."""
    fn = case.resolve()
    prepared = case.prepare(fn, device, grad=True)
    kernels = _tuned_kernels()
    seen = {}
    originals = {}
    for name, kernel in kernels.items():
        originals[name] = kernel.launch

        def launch(grid, args, kwargs, name=name, kernel=kernel):
            seen.setdefault(name, (kernel, dict(kwargs)))
            return originals[name](grid, args, kwargs)

        kernel.launch = launch
    try:
        outputs = _fwd_bwd(case, prepared, device)
    finally:
        for name, kernel in kernels.items():
            kernel.launch = originals[name]
    return prepared, outputs, seen


def child(args) -> None:
    import torch

    case = _case(args.case, args.tiny)
    prepared, reference, seen = _record(case, args.device)
    if args.kernel not in seen:
        print("not launched")
        return
    kernel, kwargs = seen[args.kernel]
    configs = kernel.candidates(kwargs)
    if args.index >= len(configs):
        print("end")
        return
    config = configs[args.index]

    def forced(grid, call_args, call_kwargs):
        launch = {**call_kwargs, **config.launch_kwargs()}
        return kernel.kernel[grid(launch) if callable(grid) else grid](**launch)

    kernel.launch = forced
    try:
        outputs = _fwd_bwd(case, prepared, args.device)
        if args.device == "cuda":
            torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 - the report is the point
        print(f"{config} | FAIL | {type(error).__name__}: {str(error)[:160]} |")
        return
    worst = max(((o - r).norm() / r.norm().clamp_min(1e-30)).item()
                for o, r in zip(outputs, reference))
    ms = ""
    if args.device == "cuda":
        import triton

        ms = f"{triton.testing.do_bench(lambda: _fwd_bwd(case, prepared, 'cuda'), warmup=5, rep=25):.3f}"
    status = "ok" if worst <= args.bound else "BAD"
    print(f"{config} | {status} | {worst:.1e} | {ms}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("case")
    p.add_argument("--only", default="", help="kernels whose name has this")
    p.add_argument("--tiny", action="store_true", help="the case at its small test shape")
    p.add_argument("--device", default="cuda")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds per config")
    p.add_argument("--bound", type=float, default=1e-2,
                   help="largest relative difference from the default configs")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kernel", help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"   # before anything imports Triton
    if args.child:
        child(args)
        return 0

    case = _case(args.case, args.tiny)
    _, _, seen = _record(case, args.device)
    names = sorted(n for n in seen if args.only in n)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x]))
    rows = []
    for name in names:
        for index in range(1000):
            command = [sys.executable, __file__, args.case, "--child", "--kernel", name,
                       "--index", str(index), "--device", args.device,
                       "--bound", str(args.bound)] + (["--tiny"] if args.tiny else [])
            try:
                done = subprocess.run(command, capture_output=True, text=True, env=env,
                                      timeout=args.timeout)
                lines = done.stdout.strip().splitlines()
                error = " ".join(done.stderr.strip().splitlines()[-1:])[:160]
                line = lines[-1] if lines else f"#{index} | FAIL | exit {done.returncode}: {error} |"
            except subprocess.TimeoutExpired:
                line = f"#{index} | FAIL | timeout after {args.timeout:.0f} s |"
            if line in ("end", "not launched"):
                break
            print(f"{name.rsplit('.', 1)[-1]} | {line}", flush=True)
            rows.append(f"| {name.rsplit('.', 1)[-1]} | {line} |")
    print(f"\n{case.name} ({args.device}): config | status | max relative difference | "
          "fwd+bwd ms")
    print("| kernel | config | status | max rel. diff | fwd+bwd ms |")
    print("| --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    return 1 if any("| FAIL |" in r or "| BAD |" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
