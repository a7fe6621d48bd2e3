"""Time one benchmark case with a tuned kernel's config forced, one process a config.

    python -m benchmarks.force_configs CASE --kernel MODULE:KERNEL [--where K=256,USE_W=True]
        --config BV=64,num_warps=8,num_stages=2 [--config ...] [--mode fwd|fwdbwd]

The default rule runs first, then each ``--config``, each in a fresh process (a config
that faults or miscompiles costs only its own row; `profile_case --tune` times a whole
space in one process, where one fault ends the run). A config replaces the kernel's
default wherever the launch's tuning arguments match every ``--where`` item (other keys
of the same kernel keep their default). Each row prints the do_bench median of the case's
mode and the largest relative difference ‖x − x_default‖ / ‖x_default‖ over what the mode
produces (the op's output tensors, or every leaf's gradient with ``fwdbwd``) against the
default's: a config that changes neither the arithmetic nor its order (tile widths along
V, warps, stages) gives bit-equal results, so anything above rounding there is a fault.

It measures whichever ``fla`` is importable (run it from the checkout for ours).
"""
from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from fla.utils.tuning import Config

_CONFIG_FIELDS = ("num_warps", "num_stages")


def _value(text: str) -> Any:
    """A command-line value as the tuning layer sees it: int, float, bool, None or str."""
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


def parse_items(text: str) -> dict[str, Any]:
    """``"K=256,USE_W=True"`` -> ``{"K": 256, "USE_W": True}``."""
    items = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"expected NAME=VALUE, got {part!r} in {text!r}")
        items[name.strip()] = _value(value)
    return items


def parse_config(text: str) -> Config:
    """``"BV=64,BK=128,num_warps=8,num_stages=2"`` -> that :class:`Config`."""
    items = parse_items(text)
    options = {name: items.pop(name) for name in _CONFIG_FIELDS if name in items}
    return Config(items, **options)


def forcing_rule(default: Callable[[Mapping[str, Any]], Config], config: Config,
                 where: Mapping[str, Any]) -> Callable[[Mapping[str, Any]], Config]:
    """A default rule giving ``config`` where every ``where`` item equals the launch's
    tuning argument of that name (a missing one counts as None), else ``default``'s."""
    def rule(args: Mapping[str, Any]) -> Config:
        if all(args.get(name) == value for name, value in where.items()):
            return config
        return default(args)
    return rule


def relative_difference(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ in float64 (0 for two zero tensors; inf for a shape change or a
    non-finite x)."""
    if x.shape != ref.shape:
        return float("inf")
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return float("inf")
    norm = ref.norm().item()
    diff = (x - ref).norm().item()
    return diff / norm if norm else (0.0 if diff == 0 else float("inf"))


def _kernel(spec: str):
    module, _, name = spec.partition(":")
    if not name:
        raise ValueError(f"--kernel: expected MODULE:KERNEL, got {spec!r}")
    return getattr(importlib.import_module(module), name)


def _produced(prepared, mode: str) -> list[torch.Tensor]:
    """What one call of the mode produces, on the CPU: the output tensors, or each leaf's
    gradient."""
    if mode == "fwd":
        with torch.no_grad():
            out = prepared.forward()
        outs = out if isinstance(out, (tuple, list)) else (out,)
        return [t.detach().float().cpu() for t in outs if isinstance(t, torch.Tensor)]
    for leaf in prepared.leaves:
        leaf.grad = None
    out = prepared.forward()
    target = prepared.grad_target(out)
    gen = torch.Generator(device=target.device).manual_seed(0)
    do = torch.randn(target.shape, device=target.device, generator=gen).to(target.dtype)
    torch.autograd.backward(target, do)
    return [leaf.grad.detach().float().cpu() for leaf in prepared.leaves
            if leaf.grad is not None]


def _step(prepared, mode: str) -> Callable[[], None]:
    if mode == "fwd":
        def forward():
            with torch.no_grad():
                prepared.forward()
        return forward
    target = prepared.grad_target(prepared.forward())
    do = torch.randn(target.shape, device=target.device).to(target.dtype)

    def forward_backward():
        for leaf in prepared.leaves:
            leaf.grad = None
        torch.autograd.backward(prepared.grad_target(prepared.forward()), do)
    return forward_backward


def run_one(case_name: str, mode: str, kernel: str, where: Mapping[str, Any],
            config: Config | None, baseline: Path) -> dict:
    """One row, in this process: force ``config`` (None: the default rule, whose results
    are saved to ``baseline``), time the mode, compare with the baseline."""
    import triton.testing

    from benchmarks import cases as registry

    if config is not None:
        tuned = _kernel(kernel)
        tuned.default = forcing_rule(tuned.default, config, where)
    matched = registry.select([case_name])
    if len(matched) != 1:
        raise ValueError(f"{case_name!r} names {len(matched)} cases, expected one")
    case = matched[0]
    module = importlib.import_module(case.module)
    prepared = case.build(case, getattr(module, case.function), "cuda", mode == "fwdbwd")
    produced = _produced(prepared, mode)
    if config is None:
        torch.save(produced, baseline)
        difference = 0.0
    else:
        saved = torch.load(baseline)
        difference = max((relative_difference(x, ref) for x, ref in zip(produced, saved)),
                         default=0.0)
        if len(produced) != len(saved):
            difference = float("inf")
    step = _step(prepared, mode)
    step()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(step, warmup=50, rep=200)
    return {"config": None if config is None else str(config), "ms": ms,
            "difference": difference}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("case", help="one case name of benchmarks.cases, e.g. "
                                "chunk_gated_delta_rule/8x2048x32x256")
    p.add_argument("--kernel", required=True,
                   help="the tuned kernel, MODULE:NAME (e.g. fla.ops.common.chunk_fwd_inter:"
                        "chunk_gated_delta_rule_fwd_inter_kernel)")
    p.add_argument("--where", default="", help="tuning arguments a launch must match, "
                                               "NAME=VALUE[,NAME=VALUE...]")
    p.add_argument("--config", action="append", default=[],
                   help="META=VALUE,...,num_warps=W,num_stages=S (repeatable)")
    p.add_argument("--mode", choices=("fwd", "fwdbwd"), default="fwd")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a config")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    where = parse_items(args.where)
    if args.child is not None:
        spec = json.loads(args.child)
        config = None if spec["config"] is None else parse_config(spec["config"])
        print(json.dumps(run_one(args.case, args.mode, args.kernel, where, config,
                                 Path(spec["baseline"]))))
        return 0
    configs = [parse_config(text) for text in args.config]   # refused here, not in a child
    baseline = Path(tempfile.mkdtemp(prefix="fla-force-")) / "baseline.pt"
    print(f"{args.case} {args.mode}, {args.kernel.rpartition(':')[2]} where {where or 'always'}")
    failed = 0
    for text, config in [(None, None)] + list(zip(args.config, configs)):
        label = "default rule" if config is None else str(config)
        child = [sys.executable, "-m", "benchmarks.force_configs", args.case,
                 "--kernel", args.kernel, "--where", args.where, "--mode", args.mode,
                 "--child", json.dumps({"config": text, "baseline": str(baseline)})]
        try:
            done = subprocess.run(child, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"  {label}: timed out after {args.timeout:.0f} s", flush=True)
            failed += 1
            continue
        rows = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not rows:
            tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            print(f"  {label}: FAILED (rc {done.returncode}): {tail}", flush=True)
            failed += 1
            if config is None:
                return 1        # nothing to compare the others with
            continue
        row = json.loads(rows[-1])
        print(f"  {label}: {row['ms']:.3f} ms, difference from the default's "
              f"{row['difference']:.2e}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
