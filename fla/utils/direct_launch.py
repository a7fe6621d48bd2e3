"""Launch an already compiled Triton kernel without Triton's per-call Python path.

Why: a training step of a 340M-parameter model launches ~600 Triton kernels, and on the
hosts we measured each launch cost 40-80 us of host time, about two thirds of it in
``JITFunction.run`` (binding the arguments, building and formatting the cache key, the
option dict's ``str()``, a launch-metadata object for the hook chain). When the GPU work
of a kernel is shorter than that, the GPU waits for the host.

What this does: the first launch at a given (config, argument specialization, device)
goes through Triton as usual and returns its ``CompiledKernel``; later launches with an
equal key call that kernel's launcher directly, with the same arguments Triton would pass
(every parameter in signature order, constexprs included; the launcher skips those).
This calling convention is the same on Triton 3.3 through 3.9.

Correctness rests on one property: our key must be at least as fine as Triton's own
specialization, so that two calls with equal keys would also have found the same compiled
kernel in Triton's cache. Triton specializes, per non-constexpr argument:

* a tensor on its dtype and on whether its address is a multiple of 16 bytes;
* an integer on whether it equals 1, whether it is a multiple of 16, and on its type
  (int32, int64 or uint64 by range); a bool as a 1-bit integer, a float as fp32;
* None as a constexpr;

and on every constexpr's value and the launch options (warps, stages: part of our
config), plus the runtime switches Triton reads at each call (``debug``, the
instrumentation mode of its sanitizers, ...). The key below records all of these (more
than Triton for ``do_not_specialize`` arguments, which only costs an extra pass through
Triton for a new combination). Any other argument type (tuples, tensor descriptors, NumPy
scalars, integers outside 64 bits) sends the launch through Triton every time. So do
launch hooks (a profiler such as proton installs them) and a kernel's pre-run hooks: the
direct call would skip them. Not kept: Triton's check that a global a kernel read has
not changed since it compiled (our kernels read module constants only).

CUDA only: on ROCm, Triton also specializes a tensor on whether its storage is under 2 GB
(buffer operations), which this key does not record.
"""
from __future__ import annotations

import inspect
import os
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from fla.utils.step_plans import _state as _plans_state
from fla.utils.step_plans import invalidate as _invalidate_plans
from fla.utils.step_plans import note_launch
from fla.utils.switches import switched
from fla.utils.triton_facts import launch_hook_holder, runtime_switches_reader

__all__ = ["BoundLaunch", "DirectLauncher", "bound_launches", "direct_launch_enabled",
           "direct_launches"]

_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def direct_launch_enabled() -> bool:
    """``FLA_DIRECT_LAUNCH=0`` sends every launch through Triton's own path."""
    return os.environ.get("FLA_DIRECT_LAUNCH", "1") not in ("0", "")


_enabled = [True]


def direct_launches(enabled: bool):
    """Turn direct launches on or off inside a block (benchmarks and tests compare the
    two paths in one process)."""
    return switched(_enabled, enabled)


_bound_enabled = [True]


def bound_launches(enabled: bool):
    """Turn bound launches (:class:`BoundLaunch`) on or off inside a block; off, each
    launch takes the direct path's lookup (benchmarks compare the two in one process)."""
    return switched(_bound_enabled, enabled)


def bound_launches_enabled() -> bool:
    return _bound_enabled[0]


_HOOKS = launch_hook_holder()
_switches = runtime_switches_reader()


def _hooks_installed() -> bool:
    """Whether a launch hook is set. Triton 3.6+ keeps an empty hook chain when none is
    set: that counts as none."""
    for hook in (_HOOKS.launch_enter_hook, _HOOKS.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


class _Unsupported(Exception):
    """An argument type this module does not specialize: launch through Triton."""


def _specialization(value: Any) -> Any:
    """What Triton specializes a non-constexpr argument on (or finer)."""
    if isinstance(value, torch.Tensor):
        return value.dtype, not value.data_ptr() & 15
    kind = type(value)
    if kind is int:
        if _INT32_MIN <= value <= _INT32_MAX:
            width = 32
        elif _INT64_MIN <= value <= _INT64_MAX:
            width = 64
        elif _INT64_MAX < value < (1 << 64):
            width = 65  # Triton's uint64
        else:
            raise _Unsupported(kind)  # Triton's own handling differs by release
        return width, value == 1, not value & 15
    if kind is bool or kind is float or value is None:
        return kind
    raise _Unsupported(kind)


def _generated(names: Sequence[str], constexpr: Sequence[bool], defaults: Mapping[str, Any],
               valued: frozenset = frozenset()):
    """Two functions specialised to one kernel's parameter list, written out as code
    (as Triton does for its binder): a loop over ~20 parameters with a call per item
    costs several times more host time than one expression.

    ``key(args, head)``: ``head`` followed by each parameter's part of the key; the
    parameters in ``valued`` (non-constexpr ones whose whole value matters to the caller,
    such as a tuning key's) also add their value.
    ``values(args)``: every parameter's value in signature order, defaults filled in.
    """
    env = {"_spec": _specialization, "_Tensor": torch.Tensor}
    reads = []
    for i, name in enumerate(names):
        if name in defaults:
            env[f"_d{i}"] = defaults[name]
            reads.append(f"args.get({name!r}, _d{i})")
        else:
            reads.append(f"args[{name!r}]")
    parts = []
    for read, is_constexpr, name in zip(reads, constexpr, names):
        if is_constexpr:  # with its type: 1, True and 1.0 are equal but compile apart
            parts.append(f"(_c := {read}).__class__, _c")
        else:  # tensors and None inline (most arguments); anything else through _spec
            other = "(_spec(_v), _v)" if name in valued else "_spec(_v)"
            # Any tensor (a Parameter too) by its dtype and alignment only: the key must
            # never hold a tensor (it would keep it alive, and compare it by value).
            # None first: the absent optional tensors are as common as the present ones.
            parts.append(f"(None if (_v := {read}) is None else (_v.dtype, not "
                         f"_v.data_ptr() & 15) if _v.__class__ is _Tensor or isinstance("
                         f"_v, _Tensor) else {other})")
    source = (f"def key(args, head):\n    return head + ({''.join(p + ', ' for p in parts)})\n"
              f"def values(args):\n    return [{', '.join(reads)}]\n")
    exec(compile(source, "<fla.utils.direct_launch>", "exec"), env)  # noqa: S102
    return env["key"], env["values"]


class DirectLauncher:
    """Per-kernel cache of compiled kernels for direct launches.

    ``launch(jit_fn, config, grid, args, options)`` launches ``jit_fn`` with ``args`` (a
    mapping of parameter names to values, the config's meta-parameters included; the
    parameters with defaults may be left out) on ``grid`` (a tuple, already evaluated);
    ``options`` are the launch options Triton takes as keywords (``num_warps``,
    ``num_stages``, ``enable_fp_fusion``, ``maxnreg``: :meth:`Config.options`).

    The tuning layer also keeps, per kernel, a map from the *caller's* arguments (those
    it passes, without the config's meta-parameters) to the config it was given and the
    compiled kernel (:meth:`remember`, :meth:`lookup`): a repeated call then costs one
    key and one dict lookup instead of choosing the config and keying the launch apart.
    That key holds the whole value of ``valued`` parameters (the tuning key's), so that
    it determines the config as well as Triton's specialization.
    """

    def __init__(self, jit_fn, valued: Sequence[str] = ()):
        params = jit_fn.params
        self.names: tuple[str, ...] = tuple(p.name for p in params)
        self.constexpr: tuple[bool, ...] = tuple(bool(p.is_constexpr) for p in params)
        # Parameters with a default value the caller may leave out (Triton's binder
        # fills them in; so do we).
        self.defaults: dict[str, Any] = {
            p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        self._key, self.values = _generated(self.names, self.constexpr, self.defaults)
        self._valued = frozenset(valued)
        self._jit_fn = jit_fn
        self._pre_run_hooks = getattr(jit_fn, "pre_run_hooks", ())
        # (launcher, function handle, packed metadata, the CompiledKernel): the last only
        # keeps the kernel alive, whose destructor unloads its module (Triton 3.9).
        self._compiled: dict[tuple, tuple[Callable, Any, Any, Any]] = {}
        # The caller-argument key (see the class docstring): made for the meta-parameter
        # names of the first config remembered; configs with other names are not kept.
        self._meta_names: frozenset | None = None
        self._caller_key: Callable | None = None
        self._by_caller: dict[tuple, tuple[Any, tuple]] = {}
        # Bound launches by their caller's scalar arguments (see :meth:`bind`): a few a
        # scalar set, for calls that differ in their tensors' dtypes or alignments only.
        self.bound: dict[tuple, list[BoundLaunch]] = {}
        # Scalar sets seen once (bound at their second call: a set that changes every
        # call, as a packed batch's token count can, is never bound), and the generated
        # tensor checks by slot layout (shared by every scalar set of that layout).
        self.seen_once: set[tuple] = set()
        self._checks: dict[tuple, Callable] = {}
        self.stats = {"direct": 0, "through_triton": 0, "bound": 0}

    def _head(self) -> tuple:
        return (torch.cuda.current_device(), getattr(self._jit_fn, "debug", None),
                _switches())

    def _usable(self) -> bool:
        return _enabled[0] and not self._pre_run_hooks and not _hooks_installed()

    def key(self, config: Any, args: Mapping[str, Any]) -> tuple | None:
        """The cache key of a launch, or None when an argument's type is not covered."""
        try:
            return self._key(args, (config, *self._head()))
        except _Unsupported:
            return None

    def remember(self, config: Any, named: Mapping[str, Any]) -> None:
        """After a launch of ``config`` with the caller's arguments ``named`` (its config
        chosen and verified by the tuning layer): let :meth:`lookup` find both."""
        meta = frozenset(config.meta)
        if self._meta_names is None:
            self._meta_names = meta
            keep = [i for i, name in enumerate(self.names) if name not in meta]
            self._caller_key, _ = _generated(
                [self.names[i] for i in keep], [self.constexpr[i] for i in keep],
                self.defaults, self._valued)
        if meta != self._meta_names or not self._usable():
            return
        head = self._head()
        try:
            entry = self._compiled.get(self._key({**named, **config.meta}, (config, *head)))
            if entry is not None:
                self._by_caller[self._caller_key(named, head)] = (config, entry)
        except (_Unsupported, TypeError, KeyError):
            pass

    def forget(self) -> None:
        """Drop the remembered calls (their configs were chosen under rules since changed)."""
        self._by_caller = {}
        self.bound = {}
        self.seen_once = set()
        _invalidate_plans()  # the step plans hold the configs chosen before too

    def bind(self, named: Mapping[str, Any], tensor_names: Iterable[str],
             grid_of: Callable[[Mapping[str, Any]], Sequence[int]]) -> BoundLaunch | None:
        """A :class:`BoundLaunch` of the call ``named`` (the caller's arguments) with every
        argument but ``tensor_names`` fixed, or None if the call is not remembered yet
        (:meth:`remember`) or a named argument is neither a tensor nor None.
        ``grid_of(arguments with the config's meta-parameters)`` gives the grid, which
        the bound launch keeps."""
        hit = self.lookup(named)
        if hit is None:
            return None
        config, entry, device = hit
        args = {**named, **config.meta}
        values = self.values(args)
        index = {name: i for i, name in enumerate(self.names)}
        slots = {}
        for name in tensor_names:
            t = named[name]
            if t is None:
                slots[name] = (index[name], None)
            elif isinstance(t, torch.Tensor):
                slots[name] = (index[name], (t.dtype, not t.data_ptr() & 15))
                values[index[name]] = None  # the template must not keep the tensor alive
            else:
                return None
        grid = (*grid_of(args), 1, 1)[:3]
        layout = tuple(slots.items())
        check = self._checks.get(layout)
        if check is None:
            check = self._checks[layout] = _bound_arguments(slots)
        return BoundLaunch(self, self._head(), grid, values, check, entry, device)

    def lookup(self, named: Mapping[str, Any]) -> tuple[Any, tuple, int] | None:
        """``(config, compiled entry, device)`` remembered for these caller arguments on
        the current device, or None."""
        if self._caller_key is None or not self._usable():
            return None
        head = self._head()
        try:
            hit = self._by_caller.get(self._caller_key(named, head))
        except (_Unsupported, TypeError, KeyError):  # unhashable, missing, not covered
            return None
        return None if hit is None else (*hit, head[0])

    def run(self, entry: tuple, grid: Sequence[int], args: Mapping[str, Any],
            device: int) -> None:
        """Launch a compiled ``entry`` with ``args`` (the caller's and the config's
        meta-parameters) on ``grid``, on the current stream of ``device``."""
        self.stats["direct"] += 1
        _call_launcher(entry, grid, device, self.values(args))

    def launch(self, jit_fn, config: Any, grid: Sequence[int], args: Mapping[str, Any],
               options: Mapping[str, Any]):
        key = None
        if self._usable():
            try:
                key = self.key(config, args)
                entry = self._compiled.get(key) if key is not None else None
            except (TypeError, KeyError):  # an unhashable constexpr; a missing argument
                key = entry = None
            if entry is not None:
                return self.run(entry, grid, args, key[1])
        self.stats["through_triton"] += 1
        compiled = jit_fn[grid](**args, **options)
        if key is not None and compiled is not None:
            if hasattr(compiled, "result"):  # Triton's asynchronous compile mode
                compiled = compiled.result()
            self._compiled[key] = (compiled.run, compiled.function, compiled.packed_metadata,
                                   compiled)
        return compiled


class BoundLaunch:
    """One remembered launch of a compiled kernel with every argument fixed but its
    tensors: calling it with tensors of the dtypes and 16-byte alignments it was bound
    with launches at once, skipping the per-argument keying of :meth:`DirectLauncher.
    lookup` and the tuning layer's binding. Measured on an H100 host (RMSNorm's forward
    kernel, µs of host time a launch): 10.4 bound, 14.1 through the lookup, 6.0 for the
    compiled launcher alone; RMSNorm's forward + backward at [16, 4096], interleaved
    rounds: 258 (min) / 302 (median) bound, 296 / 423 not.

    The binder keeps the launches by the call's scalar arguments (the tuning layer's
    ``TunedKernel.launch_bound``): the scalars then fix the config, the grid and Triton's
    specialization of everything but the tensors, which a call checks. A call that
    differs in any tensor's dtype, alignment or presence, in the set of tensor names, or
    in the current device, the runtime switches, the launch hooks or the off switch,
    returns False without launching, and the caller takes the usual path.
    """

    __slots__ = ("_launcher", "_head", "_grid", "_values", "_arguments", "_entry",
                 "_device")

    def __init__(self, launcher: DirectLauncher, head: tuple, grid: Sequence[int],
                 values: list, arguments: Callable, entry: tuple, device: int) -> None:
        self._launcher, self._head, self._grid, self._device = launcher, head, grid, device
        self._values, self._arguments = values, arguments
        self._entry = entry

    def __call__(self, tensors: Mapping[str, torch.Tensor | None]) -> bool:
        launcher = self._launcher
        if not launcher._usable() or launcher._head() != self._head:
            return False
        try:
            values = self._arguments(tensors, self._values)
        except (KeyError, AttributeError, TypeError):  # a name missing, not a tensor
            return False
        if values is None:
            return False
        launcher.stats["bound"] += 1
        _call_launcher(self._entry, self._grid, self._device, values)
        return True


def _call_launcher(entry: tuple, grid: Sequence[int], device: int, values: list) -> None:
    """:func:`_launch_compiled`, noted by a step plan's recording (fla.utils.step_plans)
    when one runs on this thread."""
    if getattr(_plans_state, "recorder", None) is not None:
        note_launch(entry, grid, device, values)
    _launch_compiled(entry, grid, device, values)


def _launch_compiled(entry: tuple, grid: Sequence[int], device: int, values: list) -> None:
    """Call a compiled ``entry``'s launcher as Triton does (3.3 through 3.9 alike): the
    grid (padded to three dims), the current stream of ``device``, the function handle,
    the packed metadata, then the launch metadata and the enter / exit hooks (None: the
    callers send launches through Triton whenever a hook is set), then every parameter's
    value in signature order."""
    run, function, packed_metadata, _ = entry
    run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
        torch._C._cuda_getCurrentRawStream(device), function, packed_metadata,
        None, None, None, *values)


def _bound_arguments(slots: Mapping[str, tuple[int, tuple | None]]):
    """``arguments(tensors, template) -> [every parameter's value] or None``, written out
    (as :func:`_generated` does): None unless ``tensors`` holds exactly the slots' names,
    each None where the slot was bound to None and otherwise a tensor of the bound dtype
    and 16-byte alignment; else a copy of ``template`` (every parameter's bound value,
    None at the tensor slots) with the tensors in their slots."""
    env: dict[str, Any] = {}
    checks = [f"len(tensors) == {len(slots)}"]
    fills = []
    for name, (index, spec) in slots.items():
        if spec is None:
            checks.append(f"tensors[{name!r}] is None")
            continue
        env[f"_dtype{index}"] = spec[0]
        aligned = "not " if spec[1] else ""
        checks.append(f"(_t := tensors[{name!r}]) is not None and _t.dtype is _dtype{index} "
                      f"and {aligned}(_t.data_ptr() & 15)")
        fills.append(f"        values[{index}] = tensors[{name!r}]\n")
    source = (f"def arguments(tensors, template):\n"
              f"    if {' and '.join(checks)}:\n"
              f"        values = template.copy()\n"
              f"{''.join(fills)}"
              f"        return values\n"
              f"    return None\n")
    exec(compile(source, "<fla.utils.direct_launch.bound>", "exec"), env)  # noqa: S102
    return env["arguments"]
