"""Run a stage under every config of its tuning space (GPU tests of the spaces).

A config the tuning layer may pick must compile and be correct on the installed
Triton/GPU pair: :func:`sweep_configs` forces each config of each kernel's space in turn
(no fallback to another config) and compares the stage's outputs with references.
"""
from __future__ import annotations

import torch

from tests.helpers import rel_error


def _by_name(tuned_kernel, args, kwargs) -> dict:
    """A launch's arguments by name (positional ones in the kernel's parameter order)."""
    return {**dict(zip(tuned_kernel.arg_names, args)), **kwargs}


def _no_step_plans(monkeypatch) -> None:
    """A replayed step plan (fla/utils/step_plans.py) launches its recorded kernels
    without calling ``TunedKernel.launch``, which the helpers below replace: off here."""
    from fla.utils import step_plans

    monkeypatch.setattr(step_plans, "_enabled", [False])


def record_launches(monkeypatch, tuned_kernel) -> list:
    """Capture the (grid, arguments by name) of the launcher's calls of ``tuned_kernel``."""
    _no_step_plans(monkeypatch)
    calls = []
    original = tuned_kernel.launch

    def launch(grid, args, kwargs):
        calls.append((grid, _by_name(tuned_kernel, args, kwargs)))
        return original(grid, args, kwargs)

    monkeypatch.setattr(tuned_kernel, "launch", launch)
    return calls


def force_config(monkeypatch, tuned_kernel, config) -> None:
    """Launch ``tuned_kernel`` with ``config`` exactly (no fallback to another config)."""
    _no_step_plans(monkeypatch)
    def launch(grid, args, kwargs):
        launch_args = {**_by_name(tuned_kernel, args, kwargs), **config.launch_kwargs()}
        return tuned_kernel.kernel[grid(launch_args) if callable(grid) else grid](**launch_args)

    monkeypatch.setattr(tuned_kernel, "launch", launch)


def sweep_configs(monkeypatch, stages, min_configs: int) -> list[str]:
    """``stages``: (name, tuned kernel, call() -> outputs, references, bound) tuples.
    Returns a line per config that failed to build, to run or to match its references;
    asserts each space holds at least ``min_configs`` configs."""
    failures = []
    for name, kernel, call, refs, bound in stages:
        with monkeypatch.context() as m:
            calls = record_launches(m, kernel)
            call()
        configs = kernel.candidates(calls[0][1])
        assert len(configs) >= min_configs, f"{name}: a tuning space of {len(configs)} configs"
        for config in configs:
            with monkeypatch.context() as m:
                force_config(m, kernel, config)
                try:
                    outs = call()
                    torch.cuda.synchronize()
                except Exception as error:  # noqa: BLE001 - report every failing config
                    line = f"{name} {config}: {type(error).__name__}: {str(error)[:300]}"
                    if _context_lost(error):
                        # Every later launch in this process fails too: name this one.
                        raise AssertionError("\n".join(failures + [line])) from error
                    failures.append(line)
                    continue
            for out, ref in zip(outs, refs):
                err = rel_error(out, ref)
                if not err <= bound:
                    failures.append(f"{name} {config}: relative error {err:.2e} > {bound}")
    return failures


def _context_lost(error: Exception) -> bool:
    """A fault that leaves the CUDA context unusable (an illegal address, a trap)."""
    text = str(error)
    return any(t in text for t in ("illegal memory access", "illegal instruction",
                                   "unspecified launch failure", "misaligned address"))


def launched_stages(monkeypatch, modules, call, refs, bound: float) -> list:
    """The tuned kernels of ``modules`` that one ``call()`` launches, as the ``stages``
    tuples of :func:`sweep_configs` (each checked against ``refs`` within ``bound``)."""
    from fla.utils.tuning import TunedKernel

    stages = []
    for module in modules:
        for name, kernel in list(vars(module).items()):
            if not isinstance(kernel, TunedKernel):
                continue
            with monkeypatch.context() as m:
                calls = record_launches(m, kernel)
                call()
            if calls:
                stages.append((f"{module.__name__}.{name}", kernel, call, refs, bound))
    return stages
