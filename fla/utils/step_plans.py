"""Step plans: a step's host work recorded once per exact call signature and replayed.

Why: at small shapes a training step is host-bound. The delta rule's fwd+bwd at
4x2048x16x128 runs 0.73 ms of kernels on an H100 and took 0.8-1.4 ms of host time a step
on the hosts we were lent; with every launch stubbed, offline, ~85% of that host time is
our own layers (each stage's input checks, argument dicts, config lookups, grids), which
give the same answers at every call with the same shapes.

What: a step (the host code of an op's forward or backward, :class:`fla.utils.custom_ops.
StageOp`) is a function of its arguments' shapes, strides, dtypes, devices, alignments
and scalar values, with every tensor value left to the kernels. The second eager call
with one exact signature runs the step under a recorder that notes, in order:

* every PyTorch call that makes or changes a tensor (``torch.empty``, views, an in-place
  op, a small reduction), with its tensor arguments as references to the step's inputs or
  to tensors made earlier in the step;
* every kernel launch through the direct launcher (:mod:`fla.utils.direct_launch`): the
  compiled kernel, grid and argument values, tensors by reference;
* what the step returns, by reference.

Later calls with that signature replay the list: the same PyTorch calls on the new
tensors, the same launches with the new tensors in their slots, the outputs assembled.
No check, dict, config choice or grid is recomputed.

A recording is dropped (after a second attempt the signature keeps running the step,
never recorded again) when the step does anything a replay could not repeat: reads a
tensor's value on the host (``.item()``, ``.tolist()``, a tensor as a bool), uses a
tensor it was not given and did not make (a module-level cache), or launches a kernel
through Triton's own path (a first compile, the interpreter, a kernel outside the tuning
layer, a launch hook such as a profiler's). A step called inside another step's
recording runs as is (its launches must reach that recorder). A replay falls back to
the step whenever the launch path's state differs from the recording's: direct launches
off, a launch hook set, Triton's runtime switches changed, another current device, a
forced backend; re-chosen configs (:func:`invalidate`) drop every plan.
``FLA_STEP_PLANS=0`` turns plans off; :func:`step_plans` turns them off inside a block.

What the signature holds: the grad mode; each tensor's shape, strides, dtype, device and
whether its address is a multiple of 16 bytes (Triton specializes on it); every other
argument's type and value (lists, such as packed-sequence offsets, by value). Not the
tensors' values nor their addresses: a replay's launches read whatever the new tensors
hold. What a step decides from anything else (a module constant, an environment
variable other than ``FLA_BACKEND``) must not change while plans are in use; the test
suite drops every plan before each test for that reason.
"""
from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from fla.utils import compile_ahead as _compile_ahead
from fla.utils.switches import switched

__all__ = ["StepPlans", "step_plans", "invalidate", "note_untracked_launch",
           "note_launch", "plans_enabled"]

_Tensor = torch.Tensor
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_SCALARS = (bool, int, float, str)

# Tensor queries with a non-tensor answer that only describe the tensor (no value read).
_METADATA = frozenset({
    "__get__", "size", "stride", "dim", "ndimension", "numel", "nelement", "data_ptr",
    "is_contiguous", "element_size", "get_device", "storage_offset", "__len__",
    "is_floating_point", "is_complex", "untyped_storage", "dtype", "device", "shape",
    # Grad mode (``torch.no_grad()`` inside a step; the signature holds the mode a step
    # was called in).
    "_set_grad_enabled", "is_grad_enabled",
})
# Calls whose answer, when it is the very tensor they were called on, changes nothing
# (``x.contiguous()`` on a contiguous x): not recorded.
_IDENTITY_IF_SAME = frozenset({"contiguous", "to", "type", "view_as", "reshape",
                               "expand_as", "float", "half", "bfloat16"})

_MAX_PLANS = 64        # plans kept per step, by signature
_MAX_PENDING = 256     # signatures seen once (recorded at their second call)
_RECORDINGS = 2        # recordings a signature gets before it is left unplanned

_state = threading.local()  # .recorder: the active _Recorder of this thread, if any
_generation = [0]
_enabled = [True]


def plans_enabled() -> bool:
    """Whether steps replay their recorded launch plans: on unless :func:`step_plans`
    turned them off or ``FLA_STEP_PLANS=0``."""
    return _enabled[0] and os.environ.get("FLA_STEP_PLANS", "1") not in ("0", "")


def step_plans(enabled: bool):
    """Turn step plans on or off inside a block (tests and benchmarks compare both)."""
    return switched(_enabled, enabled)


def invalidate() -> None:
    """Drop every plan: each step records anew (called when the tuning layer's chosen
    configs or default rules change, as a plan holds the compiled kernels they chose; and
    by the test suite before each test, whose monkeypatched knobs a plan would not see)."""
    _generation[0] += 1


def _recorder() -> _Recorder | None:
    return getattr(_state, "recorder", None)


_watching = [False]


def _watch_triton_launches() -> None:
    """Make every launch through Triton's own entry point (``JITFunction.run``, and the
    interpreter's) drop the recording running on its thread: a kernel launched outside the
    tuning layer (a test forcing a config, a kernel without one) is not a direct launch a
    plan could repeat. Installed once, at the first recording; it costs a thread-local
    read a launch on that path (first compiles, not the direct launches)."""
    if _watching[0]:
        return
    _watching[0] = True
    from triton.runtime import jit

    classes = [jit.JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
        classes.append(InterpretedFunction)
    except ImportError:  # pragma: no cover - every release we support has it
        pass
    for cls in classes:
        original = cls.run

        def run(self, *args, _original=original, **kwargs):
            if getattr(_state, "recorder", None) is not None and not kwargs.get("warmup"):
                note_untracked_launch()
            return _original(self, *args, **kwargs)

        cls.run = run


def note_untracked_launch() -> None:
    """A launch a replay could not repeat (through Triton's own path): the recording
    running on this thread, if any, is dropped."""
    recorder = _recorder()
    if recorder is not None:
        recorder.fail("a launch through Triton's own path")


def note_launch(entry: tuple, grid: tuple, device: int, values: list) -> None:
    """A launch through the direct launcher (``_call_launcher``'s arguments), recorded by
    the recording running on this thread, if any."""
    recorder = _recorder()
    if recorder is not None:
        recorder.launch(entry, grid, device, values)


class _Unplannable(Exception):
    pass


class _Recorder(TorchFunctionMode):
    """Records one run of a step (see the module's doc). ``refs`` maps ``id(tensor)`` to
    its index in the replay's environment (the arguments first, then each tensor the step
    makes, in order) while that tensor lives."""

    def __init__(self, args: tuple) -> None:
        super().__init__()
        self.refs: dict[int, int] = {}
        self.ops: list[tuple] = []
        self.failure: str | None = None
        for i, a in enumerate(args):
            if isinstance(a, _Tensor):
                self.refs.setdefault(id(a), i)
        self.args = len(args)
        self.size = len(args)
        self._watches: dict[int, weakref.ref] = {}

    def fail(self, why: str) -> None:
        if self.failure is None:
            self.failure = why

    def _template(self, value: Any) -> Any:
        """``value`` with every tensor replaced by a reference; raises _Unplannable for a
        tensor the step was not given and did not make, or an object a replay cannot
        hold by value."""
        if isinstance(value, _Tensor):
            ref = self.refs.get(id(value))
            if ref is None:
                raise _Unplannable("a tensor the step was not given and did not make")
            return _Ref(ref)
        if value is None or isinstance(value, (*_SCALARS, torch.dtype, torch.device,
                                               torch.layout, torch.memory_format, slice,
                                               type(Ellipsis))):
            return value
        if isinstance(value, (tuple, list)):  # torch.Size too (a tuple to its callees)
            items = [self._template(v) for v in value]
            return tuple(items) if isinstance(value, tuple) else items
        raise _Unplannable(f"an argument of type {type(value).__name__}")

    def _add(self, t: _Tensor) -> None:
        # Not kept alive (the step's intermediates are freed when it drops them, as
        # without a recording): when one dies its id leaves the map, so that a later
        # tensor given the same id is not taken for it.
        key = id(t)
        self.refs[key] = self.size
        self.size += 1
        self._watches[key] = weakref.ref(t, lambda _, key=key: self._forget(key))

    def _forget(self, key: int) -> None:
        self.refs.pop(key, None)
        self._watches.pop(key, None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if self.failure is not None:
            return result
        name = getattr(func, "__name__", "")
        tensors = [r for r in (result if isinstance(result, (tuple, list)) else (result,))
                   if isinstance(r, _Tensor)]
        if not tensors:
            if name not in _METADATA:
                self.fail(f"{name} answers with a value the host reads")
            return result
        if (len(tensors) == 1 and tensors[0] is result and args and args[0] is result
                and name in _IDENTITY_IF_SAME):
            return result
        try:
            call = (func, self._template(tuple(args)),
                    {k: self._template(v) for k, v in kwargs.items()})
        except _Unplannable as why:
            self.fail(f"{name}: {why}")
            return result
        if isinstance(result, _Tensor):
            if id(result) in self.refs:  # in place: the call is kept, nothing new is made
                self.ops.append((_CALL, call, None))
            else:
                self.ops.append((_CALL, call, self.size))
                self._add(result)
        else:
            fresh = [t for t in tensors if id(t) not in self.refs]
            if len(tensors) != len(result):
                self.fail(f"{name} answers with tensors and other values")
                return result
            self.ops.append((_CALL_MANY, call, [id(t) not in self.refs for t in result]))
            for t in fresh:
                self._add(t)
        return result

    def launch(self, entry: tuple, grid: tuple, device: int, values: list) -> None:
        if self.failure is not None:
            return
        template = list(values)
        slots = []
        for i, v in enumerate(values):
            if isinstance(v, _Tensor):
                ref = self.refs.get(id(v))
                if ref is None:
                    self.fail("a kernel argument the step was not given and did not make")
                    return
                slots.append((i, ref))
                template[i] = None  # the plan must not keep a tensor alive
        self.ops.append((_LAUNCH, (entry, tuple(grid), device, template, tuple(slots)), None))

    def outputs(self, result: Any) -> Any:
        return self._template(result)


class _Ref:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


_CALL, _CALL_MANY, _LAUNCH = 0, 1, 2


def _resolve(template: Any, env: list) -> Any:
    if template.__class__ is _Ref:
        return env[template.index]
    if isinstance(template, tuple):
        return tuple(_resolve(t, env) for t in template)
    if isinstance(template, list):
        return [_resolve(t, env) for t in template]
    return template


def _has_refs(template: Any) -> bool:
    if template.__class__ is _Ref:
        return True
    if isinstance(template, (tuple, list)):
        return any(_has_refs(t) for t in template)
    if isinstance(template, dict):
        return any(_has_refs(t) for t in template.values())
    return False


class _Plan:
    """A recorded step, replayed by :meth:`__call__` (the arguments of a call with the
    recorded signature) as a list of closures."""

    __slots__ = ("_steps", "_outputs", "_state")

    def __init__(self, recorder: _Recorder, outputs: Any, state: tuple) -> None:
        # Each tensor the step makes is dropped from the replay's environment after its
        # last use (as the step drops its intermediates), unless the step returns it.
        last_use: dict[int, int] = {}
        for i, op in enumerate(recorder.ops):
            for ref in _reads(op):
                last_use[ref] = i
            if op[0] == _CALL and op[2] is not None:
                last_use.setdefault(op[2], i)
        kept = set(_refs_in(outputs))
        drops: dict[int, list[int]] = {}
        for ref, i in last_use.items():
            if ref >= recorder.args and ref not in kept:
                drops.setdefault(i, []).append(ref)
        self._steps = [(_compile(op), tuple(drops.get(i, ())))
                       for i, op in enumerate(recorder.ops)]
        self._outputs = outputs
        self._state = state

    def usable(self) -> bool:
        return _launch_state() == self._state

    def __call__(self, args: tuple) -> Any:
        env = list(args)
        for step, drops in self._steps:
            step(env)
            for ref in drops:
                env[ref] = None
        return _resolve(self._outputs, env)


def _refs_in(template: Any):
    if template.__class__ is _Ref:
        yield template.index
    elif isinstance(template, (tuple, list)):
        for t in template:
            yield from _refs_in(t)
    elif isinstance(template, dict):
        for t in template.values():
            yield from _refs_in(t)


def _reads(op: tuple):
    """The environment entries a recorded operation reads."""
    if op[0] == _LAUNCH:
        return [ref for _, ref in op[1][4]]
    _, args, kwargs = op[1]
    return [*_refs_in(args), *_refs_in(kwargs)]


def _compile(op: tuple) -> Callable[[list], None]:
    """One recorded operation as a closure over the replay's environment."""
    kind, body, extra = op
    if kind == _LAUNCH:
        from fla.utils.direct_launch import _launch_compiled

        entry, grid, device, template, slots = body

        def launch(env):
            values = template.copy()
            for i, ref in slots:
                values[i] = env[ref]
            _launch_compiled(entry, grid, device, values)
        return launch
    func, args, kwargs = body
    if kind == _CALL and not _has_refs(kwargs) and not any(
            _has_refs(a) for a in args if a.__class__ is not _Ref):
        # The common form (``torch.empty_like(x)``, ``x.new_empty(shape)``, ``x[0]``):
        # tensors at the top level of the positional arguments only.
        template = list(args)
        slots = [(i, a.index) for i, a in enumerate(args) if a.__class__ is _Ref]
        keep = extra is not None

        def call_flat(env):
            values = template.copy()
            for i, ref in slots:
                values[i] = env[ref]
            result = func(*values, **kwargs)
            if keep:
                env.append(result)
        return call_flat
    if kind == _CALL:
        def call(env):
            result = func(*_resolve(args, env),
                          **{k: _resolve(v, env) for k, v in kwargs.items()})
            if extra is not None:
                env.append(result)
        return call
    fresh = extra

    def call_many(env):
        result = func(*_resolve(args, env), **{k: _resolve(v, env) for k, v in kwargs.items()})
        env.extend(t for t, new in zip(result, fresh) if new)
    return call_many


_direct_launch: list = [None]  # the direct launcher's module, once imported


def _launch_state() -> tuple:
    """What a replay depends on beyond the signature: direct launches on and no hook set,
    Triton's runtime switches, the current device, the tuning generation, a forced
    backend (``FLA_BACKEND``)."""
    dl = _direct_launch[0]
    if dl is None:  # imported here: fla.utils.direct_launch imports this module
        from fla.utils import direct_launch as dl
        _direct_launch[0] = dl
    device = torch._C._cuda_getDevice() if torch.cuda.is_initialized() else -1
    return (dl._enabled[0] and not dl._hooks_installed(), dl._switches(), device,
            _generation[0], os.environ.get("FLA_BACKEND"))


def _signature(args: tuple) -> tuple | None:
    """The exact call signature (see the module's doc) and the grad mode, or None for an
    argument a plan cannot key."""
    out = [torch.is_grad_enabled()]
    for a in args:
        kind = a.__class__
        if kind is _Tensor or kind is torch.nn.Parameter:
            out.append((a.shape, a.stride(), a.dtype, a.device, not a.data_ptr() & 15))
        elif a is None:
            out.append(None)
        elif kind in _SCALAR_KINDS:
            out.append((kind, a))
        elif kind is list or kind is tuple:
            if not all(v.__class__ is int for v in a):
                return None
            out.append((kind, tuple(a)))
        elif kind is torch.dtype:
            out.append(a)
        else:
            return None
    return tuple(out)


_SCALAR_KINDS = frozenset({bool, int, float, str})


def _launches_kernels(args: tuple) -> bool:
    """Whether the step runs compiled kernels (a CUDA tensor among its arguments): only
    those launches go through the direct launcher a plan replays."""
    for a in args:
        if a.__class__ in _PLAIN_TENSORS:
            return a.is_cuda
    return False

_UNSEEN = object()


class StepPlans:
    """The plans of one step (see the module's doc): ``run(args, step)`` is ``step(*args)``,
    or the replay of the plan recorded for the arguments' signature."""

    def __init__(self) -> None:
        self._plans: dict[tuple, _Plan | None] = {}  # None: the signature is unplannable
        # Signatures not planned yet: how many calls (one run, then recordings) they had.
        self._pending: dict[tuple, int] = {}
        self._lock = threading.Lock()
        self._generation = _generation[0]
        # Why the last unplannable signature was not planned (for tests and debugging).
        self.last_failure: str | None = None

    def run(self, args: tuple, fallback: Callable) -> Any:
        """``fallback(*args)`` (the step as the caller runs it without plans), or the
        replay of the plan recorded for these arguments' signature: signatures are
        recorded at their second call (the first may compile, which goes through Triton's
        own path)."""
        if (not plans_enabled() or not _launches_kernels(args)
                or getattr(_state, "recorder", None) is not None
                or _compile_ahead.recording() is not None):
            # Inside another step's recording (a step calling a step), the inner step runs
            # as is, so that the outer recording sees its launches: a replay here would
            # launch them past the recorder. Under compile ahead's recording the launches
            # are skipped, which only the step itself does.
            return fallback(*args)
        if self._generation != _generation[0]:  # configs re-chosen: record anew
            self.clear()
        key = _signature(args)
        if key is None:
            return fallback(*args)
        plan = self._plans.get(key, _UNSEEN)
        if plan is not _UNSEEN:
            if plan is not None and plan.usable():
                return plan(args)
            return fallback(*args)
        calls = self._pending.get(key, 0)
        if not calls:
            with self._lock:
                if len(self._pending) >= _MAX_PENDING:
                    self._pending.clear()
                self._pending[key] = 1
            return fallback(*args)
        return self._record(key, args, fallback, calls)

    def _record(self, key: tuple, args: tuple, fallback: Callable, calls: int) -> Any:
        _watch_triton_launches()
        state = _launch_state()
        recorder = _Recorder(args)
        _state.recorder = recorder
        try:
            with recorder:
                result = fallback(*args)
        finally:
            _state.recorder = None
        plan = None
        if recorder.failure is None:
            try:
                outputs = recorder.outputs(result)
            except _Unplannable as why:
                recorder.fail(str(why))
            else:
                if _launch_state() == state:
                    plan = _Plan(recorder, outputs, state)
        with self._lock:
            if plan is None:
                self.last_failure = (recorder.failure
                                     or "the launch path changed while recording")
                if calls < _RECORDINGS:  # a kernel still compiling, say: once more
                    self._pending[key] = calls + 1
                    return result
            self._pending.pop(key, None)
            if len(self._plans) >= _MAX_PLANS:
                self._plans.clear()
            self._plans[key] = plan
        return result

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()
            self._pending.clear()
            self._generation = _generation[0]
