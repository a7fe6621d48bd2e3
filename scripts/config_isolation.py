"""Run every config of every tuned kernel a benchmark case launches, each in its own process.

    python scripts/config_isolation.py CASE [--only NAME] [--tiny] [--device cuda]
                                       [--timeout 150] [--bound 1e-2] [--mode fwd|fwdbwd]
                                       [--config SPEC ... --where NAME=VALUE,...]

CASE is a `benchmarks/cases.py` selector naming one case (e.g. `chunk_gla/1x8192x96x128`).
The case's forward + backward (``--mode fwd``: its forward under ``torch.no_grad()``) is
run once with the default configs, recording which tuned kernels it launches; then, for
each of those kernels (or those whose name has ``--only``) and each config of its tuning
space, a child process runs the case with the default configs, forces that one config,
runs it again, and reports the largest relative difference over the output and every
input gradient (the outputs alone with ``fwd``), and on a GPU the mode's median time.
One line per config, a table last.

``--config BV=64,BK=128,num_warps=8,num_stages=2`` (repeatable; ``--only`` must then name
one kernel) forces those configs instead of the space's, whether the space holds them or
not, after a first row with the default rule (their baseline): how a config is tried
before it joins a space. ``--where K=256,USE_W=True`` forces
a config only at the launches whose arguments match every item (an argument the launch
does not pass counts as None); the kernel's other launches keep their default. A config
that changes neither the arithmetic nor its order (tile widths along V, warps, stages)
gives results bit-equal to the default's, so a difference above rounding is a fault.

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


def _value(text: str):
    """A command-line value as a kernel argument: int, float, bool, None or str."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def parse_items(text: str) -> dict:
    """``"K=256,USE_W=True"`` -> ``{"K": 256, "USE_W": True}``."""
    items = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"expected NAME=VALUE, got {part!r} in {text!r}")
        items[name.strip()] = _value(value)
    return items


def parse_config(text: str):
    """``"BV=64,BK=128,num_warps=8,num_stages=2[,maxnreg=168]"`` -> that ``Config``."""
    from fla.utils.tuning import Config

    items = parse_items(text)
    options = {n: items.pop(n) for n in ("num_warps", "num_stages", "maxnreg") if n in items}
    return Config(items, **options)


def matches(named: dict, where: dict) -> bool:
    """Whether a launch's arguments hold every ``where`` item (missing ones are None)."""
    return all(named.get(name) == value for name, value in where.items())


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


def _run(case, prepared, device, mode, collect=True):
    """What one call of the mode gives: the forward's output tensors (``fwd``, no grad),
    or the grad target and every leaf's gradient (in float32; nothing unless
    ``collect``, as timed)."""
    import torch

    if mode == "fwd":
        with torch.no_grad():
            out = prepared.forward()
        outs = out if isinstance(out, (tuple, list)) else (out,)
        return [t.detach().float() for t in outs if isinstance(t, torch.Tensor) and collect]
    for leaf in prepared.leaves:
        leaf.grad = None
    target = prepared.grad_target(prepared.forward())
    gen = torch.Generator(device=device).manual_seed(case.seed + 1)
    do = torch.randn(target.shape, generator=gen, device=device,
                     dtype=torch.float32).to(target.dtype)
    torch.autograd.backward(target, do)
    if not collect:
        return []
    return [target.detach().float()] + [leaf.grad.float() for leaf in prepared.leaves
                                        if leaf.grad is not None]


def _record(case, device, mode):
    """(prepared inputs, default outputs, {kernel name: (kernel, first launch kwargs)})."""
    fn = case.resolve()
    prepared = case.prepare(fn, device, grad=mode == "fwdbwd")
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
        outputs = _run(case, prepared, device, mode)
    finally:
        for name, kernel in kernels.items():
            kernel.launch = originals[name]
    return prepared, outputs, seen


def child(args) -> None:
    import torch

    case = _case(args.case, args.tiny)
    prepared, reference, seen = _record(case, args.device, args.mode)
    if args.kernel not in seen:
        print("not launched")
        return
    kernel, kwargs = seen[args.kernel]
    if args.configs:
        # Row 0: the default rule itself, the given configs' baseline.
        if args.index > len(args.configs):
            print("end")
            return
        config = parse_config(args.configs[args.index - 1]) if args.index else None
    else:
        configs = kernel.candidates(kwargs)
        if args.index >= len(configs):
            print("end")
            return
        config = configs[args.index]
    where = parse_items(args.where)
    default_launch = kernel.launch

    def forced(grid, call_args, call_kwargs):
        named = kernel._bind(call_args, call_kwargs)
        if config is None or not matches(named, where):
            return default_launch(grid, call_args, call_kwargs)
        launch = {**named, **config.launch_kwargs()}
        return kernel.kernel[grid(launch) if callable(grid) else grid](**launch)

    kernel.launch = forced
    try:
        outputs = _run(case, prepared, args.device, args.mode)
        if args.device == "cuda":
            torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 - the report is the point
        print(f"{config or 'default rule'} | FAIL | "
              f"{type(error).__name__}: {str(error)[:160]} |")
        return
    worst = max(((o - r).norm() / r.norm().clamp_min(1e-30)).item()
                for o, r in zip(outputs, reference))
    ms = ""
    if args.device == "cuda":
        import triton

        ms = triton.testing.do_bench(
            lambda: _run(case, prepared, "cuda", args.mode, collect=False), warmup=25,
            rep=args.rep)
        ms = f"{ms:.3f}"
    status = "ok" if worst <= args.bound else "BAD"
    print(f"{config or 'default rule'} | {status} | {worst:.1e} | {ms}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("case")
    p.add_argument("--only", default="", help="kernels whose name has this")
    p.add_argument("--tiny", action="store_true", help="the case at its small test shape")
    p.add_argument("--device", default="cuda")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds per config")
    p.add_argument("--bound", type=float, default=1e-2,
                   help="largest relative difference from the default configs")
    p.add_argument("--mode", choices=("fwd", "fwdbwd"), default="fwdbwd")
    p.add_argument("--rep", type=float, default=100.0, help="do_bench's rep (ms)")
    p.add_argument("--config", dest="configs", action="append", default=[],
                   help="force this config (META=VALUE,...,num_warps=W,num_stages=S) "
                        "instead of the space's; repeatable; needs --only")
    p.add_argument("--where", default="",
                   help="force only at launches with these arguments: NAME=VALUE,...")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kernel", help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"   # before anything imports Triton
    if args.child:
        child(args)
        return 0

    for text in args.configs:   # a malformed spec is refused before any child runs
        parse_config(text)
    parse_items(args.where)
    case = _case(args.case, args.tiny)
    _, _, seen = _record(case, args.device, args.mode)
    names = sorted(n for n in seen if args.only in n)
    if args.configs and len(names) != 1:
        sys.exit(f"--config needs --only to name one launched kernel; it names {names}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x]))
    rows = []
    for name in names:
        for index in range(1000):
            command = [sys.executable, __file__, args.case, "--child", "--kernel", name,
                       "--index", str(index), "--device", args.device,
                       "--bound", str(args.bound), "--mode", args.mode,
                       "--rep", str(args.rep), "--where", args.where]
            command += (["--tiny"] if args.tiny else []) + [
                item for text in args.configs for item in ("--config", text)]
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
    mode = "fwd" if args.mode == "fwd" else "fwd+bwd"
    print(f"\n{case.name} ({args.device}): config | status | max relative difference | "
          f"{mode} ms")
    print(f"| kernel | config | status | max rel. diff | {mode} ms |")
    print("| --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    return 1 if any("| FAIL |" in r or "| BAD |" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
