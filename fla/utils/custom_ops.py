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
gradient) is returned as an empty placeholder, and the caller, who knows which outputs
exist, maps it back with :func:`present`.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from fla.utils import compile_ahead

__all__ = ["stage_op", "present", "grads_for"]

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
    inputs = [a for a in args if isinstance(a, torch.Tensor)]
    fixed = []
    for t in items:
        if t is None:
            t = torch.empty(0, device=_device_of(args))
        elif any(t is a or t._base is a or (a._base is not None and t._base is a._base)
                 for a in inputs):
            t = t.clone()
        fixed.append(t)
    return fixed[0] if single else tuple(fixed)


def stage_op(name: str, step: Callable, schema: str, label: str | None = None):
    """Register ``step`` (host code chaining Triton stages) as the custom op
    ``fla::name`` with the given schema (``"(Tensor q, ..., float scale) -> (Tensor,
    Tensor)"``) and a fake implementation derived from the step.

    The real implementation runs the step through :func:`fla.utils.compile_ahead.run`
    (``label`` names it there; default ``name``). Returns the op: call it with the
    schema's arguments; ``None`` outputs come back as empty placeholders (see
    :func:`present`).
    """
    label = label or name

    def real(*args):
        return _as_outputs(compile_ahead.run(label, step, *args), args)

    def fake(*args):
        with compile_ahead.launches_skipped():
            return _as_outputs(step(*args), args)

    op = torch.library.custom_op(f"{NAMESPACE}::{name}", real, mutates_args=(),
                                 schema=schema)
    op.register_fake(fake)
    return op


def present(t: torch.Tensor, exists: bool) -> torch.Tensor | None:
    """An op output mapped back: ``t`` if the step produced it, else None."""
    return t if exists else None


def grads_for(inputs: Sequence[Any], grads: dict[int, torch.Tensor]) -> tuple:
    """The tuple an autograd formula returns: ``grads[i]`` for input i where that input
    is a tensor, None for the rest (None inputs, flags, offsets)."""
    return tuple(grads.get(i) if isinstance(x, torch.Tensor) else None
                 for i, x in enumerate(inputs))
