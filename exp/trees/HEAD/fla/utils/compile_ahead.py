"""Compile ahead: the kernels of a multi-kernel step built in parallel before it runs.

A chunked op's forward launches three to six Triton kernels and its backward six to ten.
Triton compiles each at its first launch, one after another, 0.5-7 s apiece, so the first
fwd+bwd call at a new shape took 8-18 s on the H100 (benchmarks/RESULTS.md, cold start).
Triton's compiler spends most of that time in C++ with the GIL released, so the kernels
of a step can be built side by side in threads.

:func:`run` does that for a step (a forward or backward orchestration of stages) the
first time it sees its argument types and shapes: it runs the step once in *recording*
mode, where every launch through the tuning layer (:class:`fla.utils.tuning.TunedKernel`)
submits the compilation of the config it would use to a thread pool instead of
launching; it waits for them; then it runs the step for real, and every launch finds its
kernel built. The recording run executes the step's PyTorch operations on the
uninitialised outputs of kernels that did not run, so a step given to :func:`run` must
not modify its inputs outside its kernels nor read device values on the host.

A step can name its follower (:func:`follow`: a forward its backward): its kernels are
recorded together with the first step's and compile in the background while the first
step, and the rest of the model's forward, run; the first backward then waits only for
what is still building. A cold fwd+bwd then costs about the longest single build instead
of the forward's longest plus the backward's.

Off in the interpreter, when tuning (``FLA_TUNE=1``: tuning compiles every config
anyway), under ``torch.compile`` tracing and CUDA graph capture, and with
``FLA_COMPILE_AHEAD=0``. Anything that fails while recording or compiling ahead is
ignored: the real run compiles (and reports) as it would without this.
"""
from __future__ import annotations

import os
import sysconfig
import threading
from contextlib import contextmanager, nullcontext
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

from fla.utils.triton_facts import is_interpreter

__all__ = ["run", "recording", "launches_skipped", "follow"]

_SEEN_LIMIT = 4096
_seen: set = set()
# Every build handed to the pool, by (kernel, key, config): a later recording of the same
# kernel (the backward after its prefetch) waits on the same build instead of a second.
_builds: dict[tuple, Future] = {}
# label -> (next label, next step, args_of(args, outputs)): see :func:`follow`.
_followers: dict[str, tuple[str, Callable, Callable]] = {}
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_state = threading.local()  # .recorder: the active _Recorder of this thread, if any


def recording():
    """The active recorder of this thread (read by the tuning layer at each launch), or
    None."""
    return getattr(_state, "recorder", None)


def _stand_in(value: Any) -> Any:
    """What a build needs of a tensor argument: Triton specializes a kernel on a pointer's
    dtype and its 16-byte alignment, not on the data. A small tensor with both stands in,
    so that a build in flight does not keep the recording run's (full-size) tensors
    alive."""
    if not isinstance(value, torch.Tensor) or value.data_ptr() % 16:
        return value
    return torch.empty(16, dtype=value.dtype, device=value.device)


class _Recorder:
    def __init__(self) -> None:
        self.jobs: list[Future] = []

    def launch(self, tuned, grid, named: dict) -> None:
        """Called by TunedKernel.launch instead of launching: choose the config as the
        real launch will, and compile it in the pool."""
        key = tuned.key_of(named)
        config = tuned._chosen.get(key)
        if config is None:
            config = tuned._choose(key, named, grid)
        if (key, config) in tuned._verified:
            return
        device = next((v.device for v in named.values()
                       if isinstance(v, torch.Tensor) and v.is_cuda), None)
        stand_ins = {n: _stand_in(v) for n, v in named.items()}

        def build():
            # Worker threads start on device 0: compile for the inputs' device.
            with torch.cuda.device(device) if device is not None else nullcontext():
                tuned._compile(config, grid, stand_ins)

        ident = (id(tuned), key, config, device)
        pool = _executor()
        with _lock:
            job = _builds.get(ident)
            if job is None:
                job = _builds[ident] = pool.submit(build)
        if job not in self.jobs:
            self.jobs.append(job)

    def wait(self) -> None:
        for job in self.jobs:
            try:
                job.result()
            except Exception:  # noqa: BLE001 - the real launch rebuilds and reports
                pass
        self.jobs.clear()


class _Skipper:
    """A recorder that drops every launch: see :func:`launches_skipped`."""

    def launch(self, tuned, grid, named: dict) -> None:
        return None


@contextmanager
def launches_skipped():
    """Within this context, kernel launches through the tuning layer do nothing.

    A step run this way still allocates its outputs with the shapes, dtypes and strides
    of a real run: over FakeTensors that is a custom op's fake implementation, derived
    from the step itself (:mod:`fla.utils.custom_ops`)."""
    previous = recording()
    _state.recorder = _Skipper()
    try:
        yield
    finally:
        _state.recorder = previous


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            # Python fills sysconfig's table lazily and not thread-safely, and Triton's
            # cache key reads it in every build: filled here, before builds run side by
            # side (on Triton 3.3 a build racing the fill saw EXT_SUFFIX as None).
            sysconfig.get_config_vars()
            workers = max(1, min(16, (os.cpu_count() or 2) - 1))
            _pool = ThreadPoolExecutor(workers, thread_name_prefix="fla-compile")
        return _pool


_AS_IS = (bool, str, torch.dtype, type(None))
_Tensor = torch.Tensor


def _signature(value: Any) -> Any:
    """What decides which kernels a step compiles: dtypes, ranks, devices, the sizes past
    the (batch, time) dims and the flags; not B, T or counts, which change from call to
    call under varlen (a size that does change a kernel's specialization, like T's
    divisibility by 16, only means that kernel compiles at its launch as usual)."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.shape[2:], value.dim(), value.get_device())
    if isinstance(value, _AS_IS):
        return value
    if isinstance(value, (tuple, list)):
        if value and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                         for v in value):
            return "numbers"  # offsets and the like: their count varies with the batch
        return tuple(map(_signature, value))
    return type(value).__name__


def _call_signature(args: tuple) -> tuple:
    """:func:`_signature` of a step's argument tuple. Every call of every step computes
    it: plain tensors, None and flags, the common arguments, are read inline here."""
    out = []
    for a in args:
        kind = a.__class__
        if kind is _Tensor or kind is torch.nn.Parameter:
            out.append((a.dtype, a.shape[2:], a.dim(), a.get_device()))
        elif a is None or kind is bool:
            out.append(a)
        elif kind is int or kind is float:  # a count or a scale: any value, one build
            out.append(kind.__name__)
        else:
            out.append(_signature(a))
    return tuple(out)


def _enabled(args) -> bool:
    if os.environ.get("FLA_COMPILE_AHEAD", "1") in ("0", "") or is_interpreter():
        return False
    if not any(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
        return False
    from fla.utils.tuning import tuning_enabled

    if tuning_enabled() or recording() is not None:
        return False
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and compiler.is_compiling():
        return False
    return not torch.cuda.is_current_stream_capturing()


def follow(label: str, next_label: str, next_step: Callable,
           args_of: Callable[[tuple, Any], tuple]) -> None:
    """Declare that the step ``label`` is followed by ``next_step`` (a forward by its
    backward): when ``label`` records its launches, ``next_step(*args_of(args, outputs))``
    is recorded right after it (on the recording run's outputs, in the shapes the real
    ones will have), and its kernels compile in the pool while the first step and
    whatever follows it run. ``next_step``'s own first call then only waits for the
    builds still in flight."""
    _followers[label] = (next_label, next_step, args_of)


def _record(step: Callable, args: tuple, recorder: _Recorder) -> Any:
    _state.recorder = recorder
    try:
        with torch.no_grad():
            return step(*args)
    except Exception:  # noqa: BLE001 - garbage-in host logic: the real run decides
        return None
    finally:
        _state.recorder = None


def run(label: str, step: Callable, *args: Any) -> Any:
    """``step(*args)``; at the first call with these argument types and shapes (per
    ``label``), its kernels are compiled in parallel first (see the module's doc)."""
    key = (label, _call_signature(args))
    # Every later call takes this exit: one signature and one set lookup of host work.
    if key in _seen or not _enabled(args):
        return step(*args)
    with _lock:
        first = key not in _seen
        if first:
            if len(_seen) >= _SEEN_LIMIT:
                _seen.clear()
                _builds.clear()
            _seen.add(key)
    if first:
        recorder = _Recorder()
        outputs = _record(step, args, recorder)
        follower = _followers.get(label)
        # Only a step whose inputs carry gradients will be followed by its backward.
        # (Not torch.is_grad_enabled(): a custom op's forward runs with grad mode off.)
        wants_grad = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        if follower is not None and outputs is not None and wants_grad:
            _, next_step, args_of = follower
            try:
                next_args = args_of(args, outputs)
            except Exception:  # noqa: BLE001 - the follower records at its own call
                next_args = None
            if next_args is not None:
                _record(next_step, next_args, _Recorder())  # not waited for here
            del next_args
        del outputs
        recorder.wait()
        del recorder  # nothing of the recording run may stay allocated during the real one
    return step(*args)
