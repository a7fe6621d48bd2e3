"""The Triton steps of every public op as PyTorch custom ops (``torch.ops.fla.*``).

``torch.compile`` cannot trace into the tuning layer (locks, caches, config choice) nor
into Triton's launcher; a custom op is one opaque node to it. Each op's forward step
(the chain of stage kernels) and backward step are registered with :func:`stage_op`,
and the op's autograd formula joins them with ``register_autograd``, so that
``torch.compile(fullgraph=True)`` traces a whole layer's forward and backward, and the
node runs the same kernels as eager mode.

The fake (meta) implementation that compile uses for shapes is the step itself run over
FakeTensors with every kernel launch skipped (:func:`fla.utils.compile_ahead.
launches_skipped`): stages allocate their outputs with torch calls, so the fake outputs
have the real ones' shapes, dtypes and strides by construction, with no second
description to keep in step with the kernels.

Custom ops return tensors only: a ``None`` output of a step (no final state, no gate
gradient) is returned by the op as an empty placeholder (in eager mode it stays None),
and the caller, who knows which outputs exist, maps either back with :func:`present`.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Sequence

import torch

from fla.utils import compile_ahead
from fla.utils.step_plans import StepPlans

__all__ = ["stage_op", "decode_op", "present", "upstream_grads", "needs_backward",
           "StageOp", "traced", "use_op", "outside_graph"]

NAMESPACE = "fla"


def _device_of(args: Sequence[Any]) -> torch.device:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device("cpu")


def _as_outputs(outs: Any, args: Sequence[Any]) -> tuple[torch.Tensor, ...] | torch.Tensor:
    """A step's outputs as a custom op may return them: None -> empty placeholder, an
    output that is one of the inputs (or a view of one) -> a copy (outputs may not alias
    inputs)."""
    single = isinstance(outs, torch.Tensor)
    items = (outs,) if single else tuple(outs)
    # Storage roots of the inputs: an output sharing one aliases an input.
    roots = {id(a if a._base is None else a._base) for a in args if isinstance(a, torch.Tensor)}
    fixed = []
    for t in items:
        if t is None:
            t = torch.empty(0, device=_device_of(args))
        elif id(t if t._base is None else t._base) in roots:
            t = t.clone()
        fixed.append(t)
    return fixed[0] if single else tuple(fixed)


def outside_graph(fn: Callable) -> Callable:
    """``fn`` as ``torch.compiler.disable(fn)``: run eagerly, a graph break before it,
    when a compiled caller reaches it; a plain call otherwise.

    ``torch.compiler.disable`` imports ``torch._dynamo`` (1-4 s, measured in a cold
    process on the H100 host) when it is applied; applied at import time it added that
    to the first call of every op whose module loads lazily. Here the disabled wrapper
    is made at the first call that finds ``torch._dynamo`` loaded, which every compiled
    call does (tracing loads it); eager processes never import it.
    """
    disabled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            if "torch._dynamo" not in sys.modules:
                return fn(*args, **kwargs)
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    return call


def traced(args: Sequence[Any]) -> bool:
    """Whether this call is being traced (torch.compile, export, or a tensor subclass such
    as FakeTensor or FunctionalTensor in the arguments): then the registered op must
    be called, as the tracer needs it."""
    if torch.compiler.is_compiling():
        return True
    # The first tensor argument decides: a tracer's tensors (fake, functional) are never
    # mixed with plain ones in one call. A plain loop: this runs at every call of every op.
    for a in args:
        if isinstance(a, torch.Tensor):
            return type(a) not in _PLAIN
    return False


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_functorch_active = torch._C._are_functorch_transforms_active


def use_op(args: Sequence[Any]) -> bool:
    """For a public function that is itself registered as an op (its step calls the
    function again): :func:`traced`, except while launches are skipped or recorded
    (:mod:`fla.utils.compile_ahead`) — inside an op's fake implementation, its own or an
    enclosing op's, where the function must run as is rather than re-enter the op."""
    return traced(args) and compile_ahead.recording() is None


class StageOp:
    """A step registered as the custom op ``fla::name`` (see :func:`stage_op`).

    Calling it runs the op under tracing; in eager mode it runs the same step and the same
    autograd formula through a plain ``torch.autograd.Function``, which skips the custom
    op's dispatch (argument defaults, redispatch, alias checks: ~30-80 µs of host time a
    call, and a training step makes hundreds of calls while the GPU waits). Both ways
    run the identical step, setup and backward functions.
    """

    def __init__(self, name: str, step: Callable, schema: str, label: str,
                 ahead: bool = True) -> None:
        self.name, self.step, self.label, self.ahead = name, step, label, ahead
        self._plans = StepPlans()

        def fake(*args):
            with compile_ahead.launches_skipped():
                return _as_outputs(step(*args), args)

        def real(*args):
            # Inside a compiled graph the step runs in full (plans are for eager calls).
            return _as_outputs(self._unplanned(*args), args)

        self.op = torch.library.custom_op(f"{NAMESPACE}::{name}", real, mutates_args=(),
                                          schema=schema)
        self.op.register_fake(fake)
        self._function: type | None = None
        self._apply: Callable | None = None

    def _step(self, *args):
        # Eager calls repeat their host work through a plan per exact signature
        # (fla.utils.step_plans); the first calls run the step itself.
        return self._plans.run(args, self._unplanned)

    def _unplanned(self, *args):
        if self.ahead:  # compile ahead at new argument types
            return compile_ahead.run(self.label, self.step, *args)
        return self.step(*args)

    def run(self, *args):
        """The step in eager mode, outputs as it returns them: None stays None (no
        placeholder allocations: the formulas and callers take either) and an output may
        alias an input (autograd.Function allows both; only the registered op may not)."""
        return self._step(*args)

    def register_autograd(self, backward: Callable, setup_context: Callable) -> None:
        """The op's autograd formula (``torch.library`` conventions), used by both ways.
        ``backward`` must accept None for the gradient of any output."""
        self.op.register_autograd(backward, setup_context=setup_context)
        run = self.run

        class Eager(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *args):
                outputs = run(*args)
                setup_context(ctx, args, outputs)
                # Outputs the loss does not reach (the saved auxiliaries, placeholders) get
                # None rather than a zero-filled tensor: every formula accepts None.
                ctx.set_materialize_grads(False)
                return outputs

            @staticmethod
            def backward(ctx, *grads):
                return backward(ctx, *grads)

        Eager.__name__ = Eager.__qualname__ = f"{self.name}_eager"
        self._function = Eager
        # autograd.Function.apply is a Python wrapper (default-argument binding, functorch
        # checks, a pass over the arguments) around the C entry point; with no functorch
        # transform active and no setup_context it does nothing else, so eager calls go
        # to the C entry point itself (a few µs of host time a call).
        self._apply = super(torch.autograd.Function, Eager).apply

    def __call__(self, *args):
        if traced(args):
            return self.op(*args)
        if self._function is not None and torch.is_grad_enabled():
            for a in args:
                if isinstance(a, torch.Tensor) and a.requires_grad:
                    if _functorch_active():
                        return self._function.apply(*args)
                    return self._apply(*args)
        return self._step(*args)


def stage_op(name: str, step: Callable, schema: str, label: str | None = None,
             ahead: bool = True) -> StageOp:
    """Register ``step`` (host code chaining Triton stages) as the custom op
    ``fla::name`` with the given schema (``"(Tensor q, ..., float scale) -> (Tensor,
    Tensor)"``) and a fake implementation derived from the step.

    The real implementation runs the step through :func:`fla.utils.compile_ahead.run`
    (``label`` names it there; default ``name``). Returns a :class:`StageOp`: call it
    with the schema's arguments; ``None`` outputs come back as empty placeholders (see
    :func:`present`); give it an autograd formula with ``register_autograd``.
    ``ahead=False`` for steps of one or two small kernels (the modules): nothing worth
    compiling side by side, and no per-call signature for compile ahead to compute.
    """
    return StageOp(name, step, schema, label or name, ahead)


def decode_op(name: str, step: Callable, schema: str, mutates: str,
              label: str | None = None) -> Callable:
    """Register a decoding step that updates a state or cache in place (declared in
    ``schema`` as ``Tensor(a!)``, named by ``mutates``) as the custom op ``fla::name``,
    without autograd. A functional op would return a new state and add a read and a
    write of it to a step bound by exactly that traffic.

    Returns a function of the schema's arguments: under tracing it calls the op (one node,
    capturable in a CUDA graph); in eager mode it runs the step directly (through compile
    ahead when ``label`` is given), without the dispatcher's host time. The fake is the
    step with its launches skipped, as for :func:`stage_op`."""

    def real(*args):
        return compile_ahead.run(label, step, *args) if label else step(*args)

    def fake(*args):
        with compile_ahead.launches_skipped():
            return step(*args)

    op = torch.library.custom_op(f"{NAMESPACE}::{name}", real, mutates_args=(mutates,),
                                 schema=schema)
    op.register_fake(fake)

    def call(*args):
        return op(*args) if traced(args) else real(*args)

    call.op = op
    return call


def present(t: torch.Tensor, exists: bool) -> torch.Tensor | None:
    """An op output mapped back: ``t`` if the step produced it, else None."""
    return t if exists else None


def needs_backward(*tensors: torch.Tensor | None) -> bool:
    """Whether a call on ``tensors`` (None entries skipped) will be differentiated: grad
    mode on and some tensor requiring grad. Decided by the caller, outside the op: inside
    an autograd Function's forward grad mode is off. The ops' forward steps take it as
    a flag, to keep what only a backward reads (scores, states, checkpoints)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in tensors)


def upstream_grads(do: torch.Tensor | None, dht: torch.Tensor | None, like: torch.Tensor,
                   has_final_state: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output and final-state gradients as a recurrent op's backward step takes them:
    ``do`` contiguous (zeros shaped like ``like`` when the loss did not reach the output)
    and ``dht`` contiguous, or None when the forward returned no final state (then it is
    a placeholder's gradient) or the loss did not reach it."""
    do = torch.zeros_like(like) if do is None else do.contiguous()
    dht = dht.contiguous() if has_final_state and dht is not None else None
    return do, dht
