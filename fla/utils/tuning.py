"""Our tuning layer over Triton kernels.

Why not ``triton.autotune``: its keys are positional indices into the argument list
(a renamed or reordered argument turns into ``IndexError: list index out of range``),
the first call at every new key benchmarks every config (minutes for a model's first
step), it has no cache that outlives the process, and with several configs it fails in
the interpreter when no GPU driver is present.

What this layer does instead, for a kernel decorated with :func:`tuned`:

* keys are argument *names*, checked against the kernel's signature when the module is
  imported; a tensor argument contributes its dtype, anything else its value;
* each kernel has a heuristic ``default(args) -> Config``: a call uses it at once and
  nothing is benchmarked;
* with ``FLA_TUNE=1`` the first call at a new key benchmarks the kernel's ``space`` and
  keeps the fastest; results are saved on disk per (kernel and a hash of its source,
  key, GPU name, Triton version) under ``FLA_CACHE_DIR`` (default
  ``~/.cache/fla/tuning``) and read back by later processes, tuning on or not;
* a config that the installed Triton/GPU pair fails to compile is skipped with a
  warning and the next candidate is taken; only when every candidate fails is an error
  raised, listing each failure;
* in the interpreter (``TRITON_INTERPRET=1``) only one config runs: the default (or,
  should it fail, the next one that works).

Usage::

    @tuned(key=["K", "V"], default=lambda a: Config(BK=64, BV=64, num_warps=4),
           space=lambda a: [Config(BK=bk, BV=bv, num_warps=w) ...])
    @triton.jit(do_not_specialize=["T"])
    def my_kernel(q, k, v, T, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, ...):
        ...

    my_kernel[lambda meta: (cdiv(V, meta["BV"]), N * H)](q, k, v, T, K=K, V=V)

(``cdiv`` from :mod:`fla.utils.grid`: host arithmetic in plain Python.)

The config's meta-parameters (``BK`` ...) are supplied by the layer; the caller passes
everything else. Sequence length must never be a key (a new length must not re-tune).
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import tempfile
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from fla.utils.compile_ahead import recording
from fla.utils.direct_launch import (DirectLauncher, bound_launches_enabled,
                                     direct_launch_enabled)
from fla.utils.triton_facts import (
    TRITON_VERSION_STRING,
    device_name,
    interpreter_setup_problem,
    is_interpreter,
)

__all__ = ["Config", "TunedKernel", "tuned", "tuning_enabled", "cache_dir"]


@dataclass(frozen=True)
class Config:
    """One launch configuration: constexpr meta-parameters plus warps and stages, and
    optionally a cap on the registers a thread (``maxnreg``, NVIDIA only: the compiler
    otherwise takes all it finds useful, up to 255, which for one-warp programs can set
    how many fit an SM)."""

    meta: Mapping[str, Any] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 2
    maxnreg: int | None = None

    def __init__(self, meta: Mapping[str, Any] | None = None, *, num_warps: int = 4,
                 num_stages: int = 2, maxnreg: int | None = None, **meta_kwargs: Any):
        merged = dict(meta or {})
        merged.update(meta_kwargs)
        object.__setattr__(self, "meta", dict(sorted(merged.items())))
        object.__setattr__(self, "num_warps", int(num_warps))
        object.__setattr__(self, "num_stages", int(num_stages))
        object.__setattr__(self, "maxnreg", None if maxnreg is None else int(maxnreg))
        # Computed once: a config is hashed and compared on every launch (host time).
        ident = (tuple(self.meta.items()), self.num_warps, self.num_stages, self.maxnreg)
        object.__setattr__(self, "_ident", ident)
        object.__setattr__(self, "_hash", hash(ident))
        # Fused multiply-adds asked for explicitly: every kernel's numerics and speed were
        # measured with them, Triton 3.10 turns them off by default (3.9 warns about it
        # on every first compile that leaves the choice to it), and
        # TRITON_FORCE_DISABLE_FP_FUSION still turns them off.
        options = {"num_warps": self.num_warps, "num_stages": self.num_stages,
                   "enable_fp_fusion": True}
        if self.maxnreg is not None:
            options["maxnreg"] = self.maxnreg
        object.__setattr__(self, "_options", options)
        object.__setattr__(self, "_launch", {**self.meta, **options})

    def launch_kwargs(self) -> dict[str, Any]:
        """The keyword arguments a launch adds: meta-parameters and :meth:`options`."""
        return dict(self._launch)

    def options(self) -> dict[str, Any]:
        """The compile options: num_warps, num_stages, enable_fp_fusion (True) and, when
        set, maxnreg."""
        return dict(self._options)

    def to_json(self) -> dict[str, Any]:
        data = {"meta": dict(self.meta), "num_warps": self.num_warps,
                "num_stages": self.num_stages}
        if self.maxnreg is not None:
            data["maxnreg"] = self.maxnreg
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Config":
        return cls(data["meta"], num_warps=data["num_warps"], num_stages=data["num_stages"],
                   maxnreg=data.get("maxnreg"))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and self._ident == other._ident

    def __str__(self) -> str:
        meta = ", ".join(f"{k}={v}" for k, v in self.meta.items())
        regs = "" if self.maxnreg is None else f", maxnreg={self.maxnreg}"
        return (f"Config({meta}, num_warps={self.num_warps}, num_stages={self.num_stages}"
                f"{regs})")

    __repr__ = __str__


def tuning_enabled() -> bool:
    """``FLA_TUNE=1``: benchmark the config space at the first call of each new key."""
    return os.environ.get("FLA_TUNE", "0") not in ("", "0") and not is_interpreter()


def cache_dir() -> Path:
    """Where ``FLA_TUNE=1`` keeps its timed configs: ``FLA_CACHE_DIR``, else
    ``~/.cache/fla/tuning``."""
    root = os.environ.get("FLA_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "fla" / "tuning"


def _safe(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in text)


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


# Bound launches kept per kernel (TunedKernel.launch_bound): past this many distinct
# scalar sets the kernel starts a fresh set (and so does its set of scalar sets seen
# once); per set, this many tensor variants (dtypes, alignments), the first ones kept.
_MAX_BOUND = 64
_MAX_VARIANTS = 4


def _key_part(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _dtype_name(value.dtype)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return _dtype_name(value)
    return repr(value)


class TunedKernel:
    """A ``@triton.jit`` kernel plus the rules that choose its launch configuration."""

    def __init__(self, kernel, *, key: Sequence[str],
                 default: Callable[[Mapping[str, Any]], Config],
                 space: Callable[[Mapping[str, Any]], Iterable[Config]] | Sequence[Config] = (),
                 reset_to_zero: Sequence[str] = (), restore: Sequence[str] = (),
                 name: str | None = None):
        self.kernel = kernel
        python_fn = getattr(kernel, "fn", kernel)
        while hasattr(python_fn, "fn"):
            python_fn = python_fn.fn
        self.name = name or f"{python_fn.__module__}.{python_fn.__name__}"
        self.arg_names = list(inspect.signature(python_fn).parameters)
        self._arg_set = frozenset(self.arg_names)
        # Part of the cache file's name: configs tuned for an older version of the
        # kernel's source are not read back after an edit.
        try:
            source = inspect.getsource(python_fn)
        except (OSError, TypeError):
            source = self.name
        self.source_hash = hashlib.sha1(source.encode()).hexdigest()[:10]
        for what, names in (("key", key), ("reset_to_zero", reset_to_zero),
                            ("restore", restore)):
            unknown = [n for n in names if n not in self.arg_names]
            if unknown:
                raise ValueError(
                    f"tuned({self.name}): {what} names {unknown} are not arguments of the "
                    f"kernel; its arguments are {self.arg_names}")
        self.key = tuple(key)
        self._direct = None
        self.default = default
        self.space = space
        self.reset_to_zero = tuple(reset_to_zero)
        self.restore = tuple(restore)
        self._chosen: dict[tuple, Config] = {}
        self._verified: set[tuple] = set()
        self._disk: dict[str, dict] | None = None
        self._lock = threading.Lock()
        self.stats = {"heuristic": 0, "tuned": 0, "disk_hits": 0, "skipped_configs": 0}
        # Launches after the first at a key skip Triton's per-call Python path
        # (fla/utils/direct_launch.py); the interpreter has no compiled kernel to keep.
        self._direct = (DirectLauncher(kernel, valued=self.key) if direct_launch_enabled()
                        and not is_interpreter() and torch.version.hip is None
                        and hasattr(kernel, "params") else None)
        self.failures: dict[tuple, dict[Config, str]] = {}
        # Each tuned key's default-rule config and do_bench medians (ms) by config, for
        # reports (``python -m benchmarks.profile_case CASE --tune``).
        self.timings: dict[tuple, tuple[Config, dict[Config, float]]] = {}

    # Replacing the default rule or the chosen configs (tests force configs so) must also
    # drop the direct launcher's remembered calls, which hold the configs chosen before.
    @property
    def default(self) -> Callable[[Mapping[str, Any]], Config]:
        return self._default

    @default.setter
    def default(self, rule) -> None:
        self._default = rule
        if self._direct is not None:
            self._direct.forget()

    @property
    def _chosen(self) -> dict[tuple, Config]:
        return self._chosen_configs

    @_chosen.setter
    def _chosen(self, chosen: dict[tuple, Config]) -> None:
        self._chosen_configs = chosen
        if self._direct is not None:
            self._direct.forget()

    # ------------------------------------------------------------------ public
    def __getitem__(self, grid):
        def launcher(*args, **kwargs):
            return self.launch(grid, args, kwargs)
        return launcher

    def launch(self, grid, args: Sequence[Any], kwargs: Mapping[str, Any]):
        # Launchers pass every argument by name: then the names need only a subset check
        # (host time per launch matters for small and memory-bound kernels).
        if args or not self._arg_set.issuperset(kwargs):
            named = self._bind(args, kwargs)
        else:
            named = kwargs
        recorder = recording()
        if recorder is not None:  # fla.utils.compile_ahead: compile, do not launch
            return recorder.launch(self, grid, named)
        direct = self._direct
        if direct is not None:
            # A call seen before: its config and compiled kernel in one lookup.
            hit = direct.lookup(named)
            if hit is not None:
                config, entry, device = hit
                args = {**named, **config.meta}
                return direct.run(entry, self._grid(grid, args), args, device)
        key = self.key_of(named)
        config = self._chosen.get(key)
        if config is None:
            config = self._choose(key, named, grid)
        if (key, config) in self._verified:
            result = self._run(config, grid, named)
            if direct is not None:
                direct.remember(config, named)
            return result
        return self._run_first(key, config, grid, named)

    def launch_bound(self, grid, tensors: Mapping[str, Any],
                     scalars: Mapping[str, Any]) -> None:
        """``self[grid](**tensors, **scalars)``, cheaper on the host when called again
        with equal scalars: the launch is then bound once (config, compiled kernel, grid
        and every scalar fixed; :class:`fla.utils.direct_launch.BoundLaunch`) and later
        calls only check their tensors' dtypes and alignments.

        ``tensors`` holds every tensor (or None) argument, ``scalars`` every other one;
        the grid (a tuple or a function of the arguments) must depend on the scalars and
        the config only, and each call site must pass its scalars with the same types
        (True and 1 are one key here). For the host-bound small kernels (norms, partial
        sums), launched several times a layer.
        """
        direct = self._direct
        if direct is None or not bound_launches_enabled() or recording() is not None:
            self.launch(grid, (), {**tensors, **scalars})
            return
        key = tuple(scalars.items())
        variants = direct.bound.get(key)
        if variants is not None:
            for bound in variants:
                if bound(tensors):
                    return
        named = {**tensors, **scalars}
        self.launch(grid, (), named)
        if variants is None:
            # Bind at a scalar set's second call: one seen once may never come back.
            seen = direct.seen_once
            if key not in seen:
                if len(seen) >= _MAX_BOUND:
                    seen.clear()
                seen.add(key)
                return
        elif len(variants) >= _MAX_VARIANTS:  # keep the first few; bind no more
            return
        bound = direct.bind(named, tensors, lambda args: self._grid(grid, args))
        if bound is None:
            return
        if variants is None:
            direct.seen_once.discard(key)
            if len(direct.bound) >= _MAX_BOUND:  # many scalar sets that do come back
                direct.bound.clear()
            variants = direct.bound[key] = []
        variants.append(bound)

    def key_of(self, named: Mapping[str, Any]) -> tuple:
        return tuple(_key_part(named.get(k)) for k in self.key)

    def chosen_config(self, **named: Any) -> Config | None:
        """The config a call with these key arguments would use, if chosen already."""
        return self._chosen.get(self.key_of(named))

    def candidates(self, named: Mapping[str, Any]) -> list[Config]:
        """The default first, then the rest of the space without repeats."""
        space = self.space(named) if callable(self.space) else self.space
        ordered: list[Config] = []
        for config in [self.default(named), *space]:
            if config not in ordered:
                ordered.append(config)
        return ordered

    # ----------------------------------------------------------------- binding
    def _bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        if len(args) > len(self.arg_names):
            raise TypeError(f"{self.name}: {len(args)} positional arguments for "
                            f"{len(self.arg_names)} parameters")
        named = dict(zip(self.arg_names, args))
        for k, v in kwargs.items():
            if k not in self.arg_names:
                raise TypeError(f"{self.name}: unexpected argument {k!r}; arguments are "
                                f"{self.arg_names}")
            if k in named:
                raise TypeError(f"{self.name}: argument {k!r} given twice")
            named[k] = v
        return named

    # ------------------------------------------------------------------ choice
    def _choose(self, key: tuple, named: Mapping[str, Any], grid) -> Config:
        with self._lock:
            config = self._chosen.get(key)
            if config is not None:
                return config
            # A caller passing a meta-parameter is a usage error: raise it as such here,
            # before tuning or the fallback loop could mistake it for a config failure.
            self._launch_args(self.default(named), named)
            if not is_interpreter():
                config = self._from_disk(key)
                if config is not None:
                    self.stats["disk_hits"] += 1
            if config is None and tuning_enabled():
                config = self._tune(key, named, grid)
                self.stats["tuned"] += 1
                self._to_disk(key, config)
            if config is None:
                config = self.default(named)
                self.stats["heuristic"] += 1
            self._chosen[key] = config
            return config

    def _launch_args(self, config: Config, named: Mapping[str, Any]) -> dict[str, Any]:
        clash = [k for k in config.meta if k in named]
        if clash:
            raise TypeError(f"{self.name}: the caller passed {clash}, which the tuning "
                            f"layer supplies from the config")
        return {**named, **config.launch_kwargs()}

    def _grid(self, grid, launch_args: Mapping[str, Any]):
        return grid(launch_args) if callable(grid) else grid

    def _run(self, config: Config, grid, named: Mapping[str, Any]):
        # No clash check here: a config reaches _run only after _run_first or _choose
        # checked the call's arguments against it.
        if self._direct is not None:
            args = {**named, **config.meta}
            return self._direct.launch(self.kernel, config, self._grid(grid, args), args,
                                       config._options)
        launch_args = {**named, **config._launch}
        return self.kernel[self._grid(grid, launch_args)](**launch_args)

    def _compile(self, config: Config, grid, named: Mapping[str, Any]) -> None:
        """Compile without launching (GPU only; the interpreter compiles nothing)."""
        launch_args = self._launch_args(config, named)
        compiled = self.kernel.warmup(grid=self._grid(grid, launch_args), **launch_args)
        # Triton defers loading the binary and building its launcher (a C stub compiled
        # with the system compiler, ~0.3 s a new signature) to the first launch: do both
        # here, so that a build in compile ahead's pool leaves nothing for that launch.
        # Idempotent; an error it raises (OutOfResources) is the config's, as at launch.
        init_handles = getattr(compiled, "_init_handles", None)
        if init_handles is not None:
            init_handles()

    def _run_first(self, key: tuple, config: Config, grid, named: Mapping[str, Any]):
        """First launch of a config at a key: a failure to build it moves on to the next
        candidate instead of ending the call."""
        self._launch_args(config, named)  # usage errors raise, not skip configs
        tried = [config] + [c for c in self.candidates(named) if c != config]
        errors: dict[Config, str] = {}
        for candidate in tried:
            try:
                if not is_interpreter():
                    # On a GPU, build first; the interpreter compiles nothing ahead, so
                    # there the run itself is the check.
                    self._compile(candidate, grid, named)
                # The launch stays inside the try on the GPU too: Triton raises
                # OutOfResources (shared memory, threads) when the compiled kernel's
                # handles are first loaded, which happens at launch, not at warmup. It is
                # raised before anything runs, so the next candidate sees clean inputs.
                result = self._run(candidate, grid, named)
            except Exception as error:  # noqa: BLE001 - any build failure skips the config
                errors[candidate] = f"{type(error).__name__}: {error}"
                self.stats["skipped_configs"] += 1
                continue
            if errors:
                self.failures.setdefault(key, {}).update(errors)
                warnings.warn(
                    f"{self.name}: {len(errors)} config(s) failed to build on Triton "
                    f"{TRITON_VERSION_STRING} / {device_name()} and were skipped; using "
                    f"{candidate}. First failure: {next(iter(errors.values()))[:300]}",
                    RuntimeWarning, stacklevel=4)
            with self._lock:
                self._chosen[key] = candidate
                self._verified.add((key, candidate))
            return result
        details = "\n".join(f"  {c}: {e[:500]}" for c, e in errors.items())
        problem = interpreter_setup_problem()
        raise RuntimeError(f"{self.name}: no config could be built for key "
                           f"{dict(zip(self.key, key))}:\n{details}"
                           + (f"\n{problem}" if problem else ""))

    # ------------------------------------------------------------------ tuning
    def _tune(self, key: tuple, named: Mapping[str, Any], grid) -> Config:
        from triton.testing import do_bench

        # Tuning must leave no trace: in-place outputs (``restore``) and accumulators
        # (``reset_to_zero``) get back the values the caller passed once tuning is over,
        # so the real launch that follows sees exactly the caller's inputs. Optional
        # tensor arguments may be None (or omitted) and are skipped.
        zeroed = [n for n in self.reset_to_zero if torch.is_tensor(named.get(n))]
        saved = {n: named[n].clone() for n in (*self.restore, *zeroed)
                 if torch.is_tensor(named.get(n))}
        timings: dict[Config, float] = {}
        errors: dict[Config, str] = {}
        for config in self.candidates(named):
            try:
                self._compile(config, grid, named)
            except Exception as error:  # noqa: BLE001
                errors[config] = f"{type(error).__name__}: {error}"
                self.stats["skipped_configs"] += 1
                continue

            def call(config=config):
                for n in zeroed:
                    named[n].zero_()
                self._run(config, grid, named)

            try:
                timings[config] = do_bench(call, warmup=5, rep=25, return_mode="median")
            except Exception as error:  # noqa: BLE001 - e.g. out of resources at launch
                errors[config] = f"{type(error).__name__}: {error}"
                self.stats["skipped_configs"] += 1
        for n, value in saved.items():
            named[n].copy_(value)
        if errors:
            self.failures.setdefault(key, {}).update(errors)
        if not timings:
            details = "\n".join(f"  {c}: {e[:500]}" for c, e in errors.items())
            raise RuntimeError(f"{self.name}: every config failed while tuning key "
                               f"{dict(zip(self.key, key))}:\n{details}")
        best = min(timings, key=timings.get)
        self.timings[key] = (self.default(named), timings)
        self._verified.add((key, best))
        return best

    # -------------------------------------------------------------- disk cache
    def cache_file(self) -> Path:
        return (cache_dir() / _safe(device_name()) / _safe(TRITON_VERSION_STRING)
                / f"{_safe(self.name)}-{self.source_hash}.json")

    @staticmethod
    def _key_string(key: tuple) -> str:
        return json.dumps(list(key))

    def _from_disk(self, key: tuple) -> Config | None:
        if self._disk is None:
            self._disk = self._read_cache(self.cache_file())
        entry = self._disk.get(self._key_string(key))
        if entry is None:
            return None
        try:
            return Config.from_json(entry)
        except (KeyError, TypeError, ValueError):  # a damaged entry is a miss, not an error
            return None

    @staticmethod
    def _read_cache(path: Path) -> dict:
        """The cache file's mapping; a missing, unreadable or damaged file reads as empty
        (valid JSON that is not an object included)."""
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _to_disk(self, key: tuple, config: Config) -> None:
        path = self.cache_file()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            current = self._read_cache(path)
            current[self._key_string(key)] = config.to_json()
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as handle:
                json.dump(current, handle, indent=1, sort_keys=True)
            os.replace(tmp, path)  # atomic: concurrent processes never read half a file
            self._disk = current
        except OSError as error:
            warnings.warn(f"{self.name}: could not save tuned config to {path}: {error}",
                          RuntimeWarning, stacklevel=3)


def tuned(*, key: Sequence[str], default: Callable[[Mapping[str, Any]], Config],
          space: Callable[[Mapping[str, Any]], Iterable[Config]] | Sequence[Config] = (),
          reset_to_zero: Sequence[str] = (), restore: Sequence[str] = (),
          name: str | None = None) -> Callable[[Any], TunedKernel]:
    """Decorator: wrap a ``@triton.jit`` kernel in a :class:`TunedKernel`.

    Args:
        key: argument names whose values select the config (tensor -> its dtype).
        default: ``args -> Config``, the heuristic used without tuning.
        space: ``args -> [Config]`` (or a list), what ``FLA_TUNE=1`` benchmarks.
        reset_to_zero: tensors zeroed before each tuning trial (atomic accumulators).
        restore: tensors updated in place by the kernel, restored after tuning.
        name: the name in the disk cache; defaults to ``module.function``.
    """
    def wrap(kernel) -> TunedKernel:
        return TunedKernel(kernel, key=key, default=default, space=space,
                           reset_to_zero=reset_to_zero, restore=restore, name=name)
    return wrap
